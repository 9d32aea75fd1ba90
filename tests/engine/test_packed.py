"""Padding-free passes (``actor.use_remove_padding``) and the fused LM-head log-probs (``actor.fused_logprob``)
compute what the padded pass computes: log-probs, entropies, losses and gradients, on ragged lengths."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.algorithms import LOSS_AGG_MODES, entropy_from_logits, logprobs_from_logits
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybrid_rl.workers.packed import fused_logprob_entropy, pack, unpack

from helpers import assert_close_grads, chat_prompts, cpu_dist, generate_batch, grads, grads_at_step, make_cfg, score_batch

RAGGED = ("data.max_response_length=10", "rollout.forced_lengths=lognormal:4:0.8")
PATHS = [(False, False), (True, False), (False, True), (True, True)]  # (use_remove_padding, fused_logprob)


def _worker(remove_padding: bool, fused: bool, *extra: str) -> ActorRolloutRefWorker:
    torch.manual_seed(0)
    cfg = make_cfg(f"actor.use_remove_padding={remove_padding}", f"actor.fused_logprob={fused}", *RAGGED, *extra)
    return ActorRolloutRefWorker(cfg, cpu_dist())


def test_pack_keeps_real_tokens_and_predictor_positions(tiny_model_path):
    w = _worker(False, False)
    batch = generate_batch(w, chat_prompts(w, ("7", "a longer prompt with several words")))
    t = batch.tensors
    p = pack(t)
    lengths = t["attention_mask"].sum(1)
    assert p.input_ids.shape == (1, int(lengths.sum())) and p.cu_seqlens.tolist()[-1] == int(lengths.sum())
    assert int(p.valid.sum()) == int(t["response_mask"].sum()) == len(p.keep) == len(p.targets)
    # each kept position holds the token right before its target, and positions restart in every sequence
    prompt_width = t["prompts"].shape[1]
    for row in range(len(batch)):
        s = int(p.cu_seqlens[row])
        assert int(p.position_ids[0, s]) == int(t["position_ids"][row][t["attention_mask"][row].bool()][0])
    flat_targets = p.input_ids[0, p.keep + 1]
    assert torch.equal(flat_targets, p.targets)
    assert torch.equal(unpack(p.targets.float(), p), (t["responses"] * p.valid).float())
    assert prompt_width > 0


@pytest.mark.parametrize("remove_padding,fused", PATHS[1:])
def test_packed_and_fused_forward_equal_padded(tiny_model_path, remove_padding, fused):
    """Log-probs, entropies and the gradient of a loss using both, at a temperature, against the padded pass."""
    results = []
    for rp, fu in ((False, False), (remove_padding, fused)):
        w = _worker(rp, fu)
        if not results:
            batch = generate_batch(w, chat_prompts(w, ("7", "a longer prompt with several words", "3")))
        lengths = batch["response_mask"].sum(1)
        lp, ent = w.actor.forward(batch, 0.7, with_entropy=True)
        m = batch["response_mask"].float()
        ((lp * m).sum() + 0.3 * (ent * m).sum()).backward()
        results.append((lp * m, ent * m, grads(w.actor.model)))
    assert len(set(lengths.tolist())) >= 3  # really ragged
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    assert (lp_a - lp_b).abs().max() < 1e-5 and (ent_a - ent_b).abs().max() < 1e-5
    assert_close_grads(g_a, g_b)


def test_fused_logprob_matches_reference_forward_and_backward():
    torch.manual_seed(0)
    n, h, v = 37, 16, 101
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    gl, ge = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    ref_h, ref_w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logits = ref_h @ ref_w.t()
    lp_ref = logprobs_from_logits(logits[None], targets[None], 0.6)[0]
    ent_ref = entropy_from_logits(logits[None], 0.6)[0]
    ((lp_ref * gl).sum() + (ent_ref * ge).sum()).backward()
    lp, ent = fused_logprob_entropy(hidden, weight, targets, 0.6, chunk=8)  # several chunks, a ragged last one
    ((lp * gl).sum() + (ent * ge).sum()).backward()
    assert torch.allclose(lp, lp_ref, atol=1e-10) and torch.allclose(ent, ent_ref, atol=1e-10)
    assert torch.allclose(hidden.grad, ref_h.grad, atol=1e-10) and torch.allclose(weight.grad, ref_w.grad, atol=1e-10)
    # only the log-prob used: no entropy gradient flows
    hidden.grad = None
    lp, _ = fused_logprob_entropy(hidden, weight, targets, 1.0)
    lp.sum().backward()
    probs = torch.softmax(hidden.detach() @ weight.detach().t(), -1)
    expected = (torch.nn.functional.one_hot(targets, v) - probs) @ weight.detach()
    assert torch.allclose(hidden.grad, expected, atol=1e-10)
    # without the entropy: zeros that carry no gradient, the same log-probs and log-prob gradient
    hidden.grad = None
    lp_only, ent_off = fused_logprob_entropy(hidden, weight, targets, 1.0, with_entropy=False)
    assert not ent_off.requires_grad and not ent_off.any() and torch.equal(lp_only, lp)
    lp_only.sum().backward()
    assert torch.allclose(hidden.grad, expected, atol=1e-10)
    # only the entropy used, at a temperature
    hidden.grad, weight.grad, ref_h.grad, ref_w.grad = None, None, None, None
    (entropy_from_logits((ref_h @ ref_w.t())[None], 0.6)[0] * ge).sum().backward()
    (fused_logprob_entropy(hidden, weight, targets, 0.6, chunk=8)[1] * ge).sum().backward()
    assert torch.allclose(hidden.grad, ref_h.grad, atol=1e-10) and torch.allclose(weight.grad, ref_w.grad, atol=1e-10)


def test_fused_head_detaches_an_entropy_that_takes_no_gradient():
    from hybrid_rl.workers.packed import logprob_head, split_head_output

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6, bias=False))
    model.get_output_embeddings = lambda: model[0]
    targets = torch.randint(0, 6, (5,))
    x = torch.randn(5, 4)

    def grad_of(entropy_grad: bool, use_entropy: bool) -> torch.Tensor:
        model.zero_grad()
        with logprob_head(model, targets, 1.0, entropy_grad=entropy_grad):
            lp, ent = split_head_output(model(x)[None])
        assert ent.any()  # still computed, for the metrics
        (lp.sum() + (ent.sum() if use_entropy else 0)).backward()
        return model[0].weight.grad.clone()

    assert torch.equal(grad_of(False, True), grad_of(True, False))  # detached: the entropy adds nothing
    assert not torch.allclose(grad_of(True, True), grad_of(True, False))


def _update_grads(remove_padding: bool, fused: bool, mode: str, micro: int, saved=None):
    w = _worker(remove_padding, fused, "rollout.n=4", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                f"actor.ppo_micro_batch_size_per_device={micro}", f"actor.loss_agg_mode={mode}",
                "actor.entropy_coeff=0.01", "actor.use_kl_loss=true", "actor.kl_loss_type=k1", "actor.kl_loss_coef=0.1")
    if saved is None:
        saved = w.compute_ref_log_prob(score_batch(w, generate_batch(w, chat_prompts(w, ("7", "a longer prompt here")))))
    batch = w.compute_ref_log_prob(w.compute_log_prob(saved))
    with grads_at_step(w.actor) as steps:
        stats = w.update_actor(batch)
    return steps[-1], batch, saved, stats


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_packed_update_equals_padded_and_is_micro_batch_invariant(tiny_model_path, mode):
    """The whole PPO update (pg + entropy + KL terms, global denominators): padded 1×8 = packed 1×8 = packed 8×1."""
    g_pad, b_pad, saved, s_pad = _update_grads(False, False, mode, 8)
    g_pk, b_pk, _, s_pk = _update_grads(True, True, mode, 8, saved)
    g_pk1, _, _, _ = _update_grads(True, True, mode, 1, saved)
    m = b_pad["response_mask"].bool()
    assert (b_pad["old_log_probs"] - b_pk["old_log_probs"]).abs()[m].max() < 1e-5
    assert (b_pad["ref_log_prob"] - b_pk["ref_log_prob"]).abs()[m].max() < 1e-5
    assert abs(s_pad["actor/pg_loss"][0] - s_pk["actor/pg_loss"][0]) < 1e-5
    assert_close_grads(g_pad, g_pk, rel=1e-4)
    assert_close_grads(g_pk, g_pk1, rel=1e-4)


def test_packed_token_budget_counts_real_tokens(tiny_model_path):
    from hybrid_rl.micro_batching import plan_micro_batches

    w = _worker(True, True)
    batch = generate_batch(w)
    real = batch["attention_mask"].sum(1)
    budget = int(real.max()) * 2
    packed = plan_micro_batches(batch, max_seqs=64, max_tokens=budget, packed=True)
    padded = plan_micro_batches(batch, max_seqs=64, max_tokens=budget)
    assert sorted(int(i) for b in packed for i in b) == list(range(len(batch)))
    assert all(int(real[b].sum()) <= budget or len(b) == 1 for b in packed)
    assert len(packed) <= len(padded)


def test_varlen_attention_refuses_unpacked_calls(tiny_model_path):
    w = _worker(True, True)
    batch = generate_batch(w)
    with pytest.raises(RuntimeError, match="use_remove_padding"):
        t = batch.tensors
        w.actor.model(input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"])


@pytest.mark.parametrize("share", [False, True], ids=["pack", "pack_shared"])
def test_micro_batches_host_copies_give_the_device_read_layout(tiny_model_path, share):
    """``micro_batches`` reads the mask (and ids) to the host once per batch and cuts each micro-batch's rows and
    trimmed columns from it; packing from those copies must lay out exactly what reading the micro-batch gives."""
    from hybrid_rl.micro_batching import HOST_META, micro_batches
    from hybrid_rl.workers.packed import pack_shared

    w = _worker(True, True, "rollout.n=4")
    batch = generate_batch(w, chat_prompts(w, ("7", "a longer prompt with several words", "3")))
    fn = pack_shared if share else pack
    micros = micro_batches(batch, 64, max_tokens=int(batch["attention_mask"].sum(1).max()) * 2, packed=True,
                           share_prompts=share)
    assert len(micros) >= 2  # several micro-batches, each trimmed to its own widths
    for _, micro in micros:
        host = micro.meta[HOST_META]
        assert set(host) == ({"attention_mask", "input_ids"} if share else {"attention_mask"})
        a, b = fn(micro.tensors, host), fn(micro.tensors)
        for field in ("input_ids", "position_ids", "cu_seqlens", "keep", "targets", "valid", "slots"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        assert a.max_seqlen == b.max_seqlen
    assert HOST_META not in micro_batches(batch, 64)[0][1].meta  # the padded path reads nothing


def test_packing_is_the_default_only_where_the_varlen_kernel_runs_it():
    """CUDA with 16-bit compute packs by default; CPU and float32 models (one SDPA call per sequence) pad. The
    planner resolves the default the same way from the recipe's ``model.dtype``."""
    from hybrid_rl.config import load_config
    from hybrid_rl.planner.estimate import Layout
    from hybrid_rl.workers.packed import packs_by_default

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert packs_by_default(cuda, torch.bfloat16) and packs_by_default(cuda, torch.float16)
    assert not packs_by_default(cuda, torch.float32) and not packs_by_default(cpu, torch.bfloat16)
    for dtype, packed in (("float32", False), ("bfloat16", True), ("auto", True)):
        lay = Layout.of(load_config(None, [f"model.dtype={dtype}"]), 1)
        assert lay.packed is packed and lay.shared is packed, dtype
    assert Layout.of(load_config(None, ["model.dtype=float32", "actor.use_remove_padding=true"]), 1).packed
