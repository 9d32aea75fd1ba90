"""The hybrid engine on one process: engine/trainer parity, the sharding manager, and the PPO update."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from hybrid_rl.algorithms import LOSS_AGG_MODES
from hybrid_rl.phases.advantage import compute_advantage
from hybrid_rl.phases.reward import sparse_scores
from hybrid_rl.batch import Batch
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

from helpers import actor_params, chat_prompts, cpu_dist, generate_batch, make_cfg, score_batch, update_grads


def _assert_same_gradients(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    # Compare gradients, not post-Adam weights: Adam's first step is ~lr·sign(g), so coordinates whose
    # gradient is at rounding level (e.g. k_proj.bias, exactly 0 in exact arithmetic) flip freely.
    assert a.keys() == b.keys() and len(a) > 10
    for n in a:
        scale = max(float(a[n].abs().max()), 1e-12)
        assert float((a[n] - b[n]).abs().max()) <= 1e-4 * scale + 1e-9, n


def _engine_params(worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.rollout.named_weights()}


@pytest.fixture
def worker(tiny_model_path):
    torch.manual_seed(0)
    return ActorRolloutRefWorker(make_cfg(), cpu_dist(), total_training_steps=10)


def test_role_flags(tiny_model_path):
    w = ActorRolloutRefWorker(make_cfg(), cpu_dist(), role="actor_rollout")
    assert (w.is_actor, w.is_rollout, w.is_ref) == (True, True, False) and w.ref is None
    w = ActorRolloutRefWorker(make_cfg("actor.use_kl_loss=true"), cpu_dist(), role="actor_rollout_ref")
    assert w.is_ref and w.ref is not None
    with pytest.raises(ValueError, match="role must be one of"):
        ActorRolloutRefWorker(make_cfg(), cpu_dist(), role="critic")


def test_engine_logprobs_match_trainer(worker):
    """The engine's sampled-token log-probs equal the trainer's recomputation (fp32, left padding, T != 1)."""
    worker.cfg.rollout.temperature = 0.7
    batch = generate_batch(worker)
    assert batch.meta["temperature"] == 0.7
    assert batch["responses"].shape[0] == 4 * worker.cfg.rollout.n
    batch = worker.compute_log_prob(batch)
    mask = batch["response_mask"].bool()
    diff = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()[mask]
    assert mask.sum() > 20
    assert diff.max().item() < 1e-5, diff.max()


@pytest.mark.parametrize("setting, mode, expect", [("always", "sync", True), ("auto", "sync", False),
                                                   ("auto", "overlap", True)])
def test_rollout_logprobs_auto_asks_the_engine_only_where_training_reads_them(tiny_model_path, setting, mode,
                                                                                expect):
    """``rollout.logprobs=auto``: a synchronous run's generations carry no ``rollout_log_probs``; the same samples
    (one seed) as with them; overlap mode (decoupled PPO reads them) and ``always`` keep them."""
    w = ActorRolloutRefWorker(make_cfg(f"rollout.logprobs={setting}", f"trainer.mode={mode}",
                                       "trainer.max_staleness=1"), cpu_dist(), total_training_steps=10)
    torch.manual_seed(3)
    batch = generate_batch(w)
    assert ("rollout_log_probs" in batch.tensors) == expect
    ref = ActorRolloutRefWorker(make_cfg(), cpu_dist(), total_training_steps=10)  # the same built-in checkpoint
    torch.manual_seed(3)
    assert torch.equal(generate_batch(ref)["responses"], batch["responses"])
    assert "rollout_log_probs" not in w.generate(chat_prompts(w), validate=True).tensors  # validation: never


def test_response_mask_stops_after_eos(worker):
    eos = worker.tokenizer.eos_token_id
    batch0 = generate_batch(worker)  # push weights first; the hook below only biases the engine
    def favour_eos(module, args, out):
        out[..., eos] += 4.0
        return out
    handle = worker.rollout.model.lm_head.register_forward_hook(favour_eos)
    try:
        with worker.rollout_mode():
            batch = worker.generate(chat_prompts(worker))
    finally:
        handle.remove()
    resp, mask, lps = batch["responses"], batch["response_mask"], batch["rollout_log_probs"]
    lengths = mask.sum(dim=1)
    assert (lengths < resp.shape[1]).any() and (resp == eos).any(), "expected some sequences to stop on EOS"
    for r, m, lp in zip(resp, mask, lps):
        n = int(m.sum())
        hits = (r[:n] == eos).nonzero()
        if len(hits):  # EOS is the last masked-in token; after it pad, zero log-prob, mask 0
            assert hits[0].item() == n - 1
            assert (r[n:] == worker.tokenizer.pad_token_id).all() and (lp[n:] == 0).all()
        else:
            assert n == resp.shape[1]
    p = batch["prompts"].shape[1]
    assert torch.equal(batch["attention_mask"][:, p:], mask)
    assert torch.equal(batch["input_ids"][:, p:], resp)
    # response positions continue from the prompt's last real position
    prompt_len = batch["attention_mask"][:, :p].sum(dim=1)
    assert torch.equal(batch["position_ids"][:, p], prompt_len)
    assert len(batch0) == len(batch)


def test_sharding_manager_pushes_actor_weights_and_skips_unchanged(worker):
    with torch.no_grad():  # make the engine's copy differ from the actor
        for p in worker.rollout.model.parameters():
            p.add_(1.0)
    with worker.rollout_mode():
        engine = _engine_params(worker)
    actor = actor_params(worker)
    for name, p in actor.items():
        assert torch.equal(engine[name], p), name
    assert torch.equal(worker.rollout.model.lm_head.weight, actor["model.embed_tokens.weight"])  # tied
    sm = worker.sharding_manager
    assert sm.num_pushes == 1 and sm.last_sync_bytes == sum(p.numel() * 4 for p in actor.values())
    with worker.rollout_mode():
        pass
    assert sm.num_pushes == 1 and sm.last_sync_bytes == 0  # same version: no push


def test_sleep_level2_discards_and_push_restores(worker):
    worker.sharding_manager.sleep_level = 2
    generate_batch(worker)
    assert worker.rollout.weights_version is None  # discarded on exit
    assert all(p.numel() == 0 for _, p in worker.rollout.named_weights())
    with pytest.raises(RuntimeError, match="sleeping engine"):
        worker.rollout.generate(chat_prompts(worker), worker.sampling_params())
    with worker.rollout_mode():
        for name, p in worker.rollout.named_weights():
            assert torch.equal(p, dict(worker.actor.model.named_parameters())[name])


def test_the_update_frees_the_gradients_its_step_took(worker):
    """Every trainable parameter has a gradient at the optimizer step, and none after the update."""
    batch = score_batch(worker, generate_batch(worker))
    trainable = [n for n, p in worker.actor.model.named_parameters() if p.requires_grad]
    stepped = update_grads(worker, batch)
    assert sorted(stepped) == sorted(trainable) and any(float(g.abs().max()) > 0 for g in stepped.values())
    assert all(p.grad is None for p in worker.actor.model.parameters() if p.requires_grad)


def test_update_changes_params_and_next_rollout_uses_them(worker):
    before = actor_params(worker)
    batch = score_batch(worker, generate_batch(worker))
    v0 = worker.weight_version
    stats = worker.update_actor(batch)
    assert worker.weight_version == v0 + 1
    after = actor_params(worker)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(changed) == len(before), "every parameter should move after an AdamW step"
    assert stats["actor/grad_norm"][0] > 0
    # the next rollout pushes the new weights and its log-probs follow them
    old_engine = _engine_params(worker)
    batch2 = generate_batch(worker)
    new_engine = _engine_params(worker)
    assert all(torch.equal(new_engine[n], after[n]) for n in after)
    assert any(not torch.equal(old_engine[n], new_engine[n]) for n in after)
    batch2 = worker.compute_log_prob(batch2)
    m = batch2["response_mask"].bool()
    assert (batch2["rollout_log_probs"] - batch2["old_log_probs"]).abs()[m].max() < 1e-5


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_accumulation_invariance(tiny_model_path, mode):
    """One micro-batch of 8 and eight micro-batches of 1 give the same update."""
    results = []
    for micro in (8, 1):
        torch.manual_seed(0)
        cfg = make_cfg("rollout.n=4", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                       f"actor.ppo_micro_batch_size_per_device={micro}", f"actor.loss_agg_mode={mode}",
                       "actor.entropy_coeff=0.01")
        w = ActorRolloutRefWorker(cfg, cpu_dist())
        if not results:
            saved = score_batch(w, generate_batch(w, chat_prompts(w, ("7", "a longer prompt here"))))
        results.append(update_grads(w, saved))
    _assert_same_gradients(*results)


def _ragged_grads(mode: str, micro: int, saved: Batch | None) -> tuple[dict[str, torch.Tensor], Batch]:
    """Gradients of one update on ragged responses (forced long-tailed lengths), with pg, entropy and k1 KL terms."""
    torch.manual_seed(0)
    cfg = make_cfg("rollout.n=4", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "data.max_response_length=10",
                   "rollout.forced_lengths=lognormal:4:0.8", f"actor.ppo_micro_batch_size_per_device={micro}",
                   f"actor.loss_agg_mode={mode}", "actor.entropy_coeff=0.01", "actor.use_kl_loss=true",
                   "actor.kl_loss_type=k1", "actor.kl_loss_coef=0.1")
    w = ActorRolloutRefWorker(cfg, cpu_dist())
    if saved is None:
        saved = w.compute_ref_log_prob(score_batch(w, generate_batch(w, chat_prompts(w, ("7", "a longer prompt here")))))
    return update_grads(w, saved), saved


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_invariance_with_ragged_responses(tiny_model_path, mode):
    """1×8 and 8×1 micro-batches give the same gradient when responses differ in length, so that each 1-row
    micro-batch is trimmed to its own response (seq-mean-token-sum-norm used to divide by that trimmed width)."""
    g8, saved = _ragged_grads(mode, 8, None)
    lengths = saved["response_mask"].sum(1)
    assert len(set(lengths.tolist())) >= 3 and int(lengths.max()) <= 10  # really ragged, and within the cap
    g1, _ = _ragged_grads(mode, 1, saved)
    _assert_same_gradients(g8, g1)


def test_reference_policy_is_frozen(tiny_model_path):
    cfg = make_cfg("actor.use_kl_loss=true", "actor.kl_loss_coef=0.1")
    w = ActorRolloutRefWorker(cfg, cpu_dist())
    ref_before = {n: p.detach().clone() for n, p in w.ref.model.named_parameters()}
    batch = score_batch(w, generate_batch(w))
    batch = w.compute_ref_log_prob(batch)
    # before any update, reference == actor, so the log-probs agree
    assert torch.allclose(batch["ref_log_prob"], batch["old_log_probs"], atol=1e-6)
    stats = w.update_actor(batch)
    assert "actor/kl_loss" in stats
    for n, p in w.ref.model.named_parameters():
        assert torch.equal(p, ref_before[n])
    assert any(not torch.equal(p, ref_before[n]) for n, p in w.actor.model.named_parameters())


def test_forced_lengths_for_benchmarks(tiny_model_path):
    """rollout.forced_lengths imposes long-tailed response lengths (EOS ignored), capped at max_response_length."""
    w = ActorRolloutRefWorker(make_cfg("rollout.forced_lengths=lognormal:4:1.0", "data.max_response_length=12"), cpu_dist())
    batch = generate_batch(w)
    lengths = batch["response_mask"].sum(dim=1)
    assert lengths.min() >= 1 and lengths.max() <= 12 and len(set(lengths.tolist())) > 2
    assert batch["responses"].shape[1] == int(lengths.max())
    batch = w.compute_log_prob(batch)  # parity holds on forced lengths too
    m = batch["response_mask"].bool()
    assert (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()[m].max() < 1e-5
    from hybrid_rl.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="rollout.forced_lengths"):
        load_config(None, ["rollout.forced_lengths=zipf:3"]).validate()


def test_trim_padding_and_token_budget_plan(worker):
    from hybrid_rl.micro_batching import plan_micro_batches, trim_padding

    batch = worker.compute_log_prob(generate_batch(worker))
    small = batch.index([0, 1])  # the two samples of the shortest prompt
    trimmed = trim_padding(small)
    p = small["prompts"].shape[1]
    assert trimmed["prompts"].shape[1] == int(small["attention_mask"][:, :p].sum(1).max()) < p
    lp_full, _ = worker.actor.forward(small, 1.0)
    lp_trim, _ = worker.actor.forward(trimmed, 1.0)
    m = trimmed["response_mask"].bool()
    assert (lp_full[:, :lp_trim.shape[1]][m] - lp_trim[m]).abs().max() < 1e-5
    # a token budget covers every row exactly once, within budget for each bin
    lengths = batch["attention_mask"].sum(1)
    budget = int(lengths.max()) * 3
    plan = plan_micro_batches(batch, max_seqs=4, max_tokens=budget)
    assert sorted(i for b in plan for i in b) == list(range(len(batch)))
    assert len(plan) > 1
    for idx in plan:
        micro = trim_padding(batch.index(idx))
        assert micro["input_ids"].numel() <= budget  # padded tokens: what the forward computes


@pytest.mark.parametrize("knob", ["actor.use_dynamic_bsz", "model.enable_gradient_checkpointing"])
def test_training_knobs_give_the_same_update_and_log_probs(tiny_model_path, knob):
    """Token-budget micro-batches and activation checkpointing change how the update is computed, not its result."""
    results = []
    for flag in ("false", "true"):
        torch.manual_seed(0)
        cfg = make_cfg(f"{knob}={flag}", "actor.max_token_len_per_device=600", "data.max_prompt_length=64",
                       "data.max_response_length=6", "actor.ppo_micro_batch_size_per_device=16")
        w = ActorRolloutRefWorker(cfg, cpu_dist())
        if knob == "model.enable_gradient_checkpointing":
            m = w.actor.model  # transformers 5.2x renamed the flag
            on = m.is_activation_checkpointing if hasattr(m, "is_activation_checkpointing") else m.is_gradient_checkpointing
            assert on == (flag == "true")
        if not results:
            base = generate_batch(w)
        batch = w.compute_log_prob(base)
        batch, _ = compute_advantage(batch.union(tensors=dict(
            token_level_scores=sparse_scores(torch.arange(len(batch)).remainder(2).float(), batch["response_mask"]))),
            w.cfg.algorithm)
        results.append((batch["old_log_probs"] * batch["response_mask"], update_grads(w, batch)))
    (lp_a, ga), (lp_b, gb) = results
    assert (lp_a - lp_b).abs().max() < 1e-5
    _assert_same_gradients(ga, gb)


def _long_tailed_batch(n: int = 64, P: int = 8, R: int = 40) -> Batch:
    """Rows with lognormal response lengths (mean ~8, cap R) behind P prompt tokens."""
    import numpy as np

    rng = np.random.default_rng(0)
    r_len = np.clip(rng.lognormal(np.log(8), 0.8, n).round(), 1, R).astype(int)
    response_mask = torch.tensor((np.arange(R)[None, :] < r_len[:, None]).astype(np.int64))
    attn = torch.cat([torch.ones(n, P, dtype=torch.long), response_mask], 1)
    return Batch({"prompts": torch.ones(n, P, dtype=torch.long), "responses": torch.ones(n, R, dtype=torch.long),
                  "input_ids": torch.ones(n, P + R, dtype=torch.long), "attention_mask": attn,
                  "position_ids": attn.cumsum(1), "response_mask": response_mask})


def test_token_budget_bins_stay_within_budget_on_long_tails(monkeypatch):
    """Padded size per micro-batch ≤ budget (bins of similar lengths), little padding overall, and a rank that
    needs fewer bins than another splits its largest ones to match the count."""
    import hybrid_rl.micro_batching as mb

    batch = _long_tailed_batch()
    real = int(batch["attention_mask"].sum())
    budget = 120
    plan = mb.plan_micro_batches(batch, max_seqs=8, max_tokens=budget)
    padded = [mb.trim_padding(batch.index(idx))["input_ids"].numel() for idx in plan]
    assert sorted(i for idx in plan for i in idx) == list(range(len(batch)))
    assert max(padded) <= budget and sum(padded) < 1.3 * real
    # another rank needs more bins: this one matches the count, and its bins only shrink
    monkeypatch.setattr(mb, "all_reduce_max", lambda t, group=None: t.fill_(len(plan) + 3))
    more = mb.plan_micro_batches(batch, max_seqs=8, max_tokens=budget)
    assert len(more) == len(plan) + 3 and sorted(i for idx in more for i in idx) == list(range(len(batch)))
    assert max(mb.trim_padding(batch.index(idx))["input_ids"].numel() for idx in more) <= budget


def test_fixed_size_micro_batches_group_rows_by_length():
    """Chunks of similar-length rows: far fewer padded tokens than consecutive chunks, same count, every row once."""
    from hybrid_rl.micro_batching import plan_micro_batches, trim_padding

    batch = _long_tailed_batch()
    n = len(batch)
    plan = plan_micro_batches(batch, max_seqs=8)
    assert len(plan) == 8 and sorted(i for idx in plan for i in idx) == list(range(n))
    padded = sum(trim_padding(batch.index(idx))["input_ids"].numel() for idx in plan)
    consecutive = sum(trim_padding(batch.index(slice(s, s + 8)))["input_ids"].numel() for s in range(0, n, 8))
    assert padded < 0.75 * consecutive


def test_row_index_is_a_slice_for_runs_and_writes_the_same_rows():
    from hybrid_rl.batch import row_index

    assert row_index(np.array([3, 4, 5]), torch.device("cpu")) == slice(3, 6)
    scattered = row_index(np.array([5, 0, 2]), torch.device("cpu"))
    assert isinstance(scattered, torch.Tensor) and scattered.dtype == torch.long
    out = torch.zeros(6, 2)
    out[scattered, :1] = torch.tensor([[1.0], [2.0], [3.0]])
    assert out[:, 0].tolist() == [2.0, 0.0, 3.0, 0.0, 0.0, 1.0]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_mask_truncated_completions_drops_cut_responses_from_the_loss(tiny_model_path, mode):
    """actor.mask_truncated_completions: the update on a batch with responses cut at the cap gives the gradient of
    the same update on the batch without them (their tokens out of the loss and of its token/sequence counts)."""
    def grads(batch: Batch | None, *over: str) -> tuple[dict[str, torch.Tensor], Batch]:
        torch.manual_seed(0)
        cfg = make_cfg("rollout.n=4", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                       "data.max_response_length=10", "rollout.forced_lengths=lognormal:9:0.5",
                       "actor.ppo_micro_batch_size_per_device=2", f"actor.loss_agg_mode={mode}",
                       "actor.entropy_coeff=0.01", *over)
        w = ActorRolloutRefWorker(cfg, cpu_dist())
        if batch is None:
            batch = score_batch(w, generate_batch(w, chat_prompts(w, ("7", "a longer prompt here"))))
        return update_grads(w, batch), batch

    masked, batch = grads(None, "actor.mask_truncated_completions=true")
    cut = batch["response_mask"].sum(1) >= 10
    assert 0 < int(cut.sum()) < len(batch)  # some responses were cut at the cap, some finished
    assert float(batch["advantages"][cut].abs().sum()) > 0  # and the cut ones would have moved the policy
    kept, _ = grads(batch.index(np.flatnonzero(~cut.numpy())))
    _assert_same_gradients(masked, kept)
    unmasked, _ = grads(batch)
    assert any(float((masked[n] - unmasked[n]).abs().max()) > 1e-6 for n in masked)


def test_mask_truncated_completions_with_every_response_cut(tiny_model_path):
    """Every response at the cap: the loss is zero (no NaN), the update leaves the weights as they were."""
    torch.manual_seed(0)
    cfg = make_cfg("rollout.n=2", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                   "data.max_response_length=6", "rollout.forced_lengths=lognormal:60:0.1", "actor.ppo_micro_batch_size_per_device=2",
                   "actor.mask_truncated_completions=true")
    w = ActorRolloutRefWorker(cfg, cpu_dist())
    batch = score_batch(w, generate_batch(w, chat_prompts(w, ("7", "8"))))
    assert bool((batch["response_mask"].sum(1) == 6).all())
    before = actor_params(w)
    stats = w.update_actor(batch)
    assert all(torch.equal(before[n], p) for n, p in actor_params(w).items())
    assert all(np.isfinite(s) for s, _ in stats.values())
