"""``actor.share_prompts``: each distinct prompt of a packed micro-batch passes through the model once and its
responses attend to that copy. It must compute exactly what the unshared packed pass computes: log-probs, entropies,
gradients, the whole update, and the reference's log-probs, on ragged lengths with several samples per prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybrid_rl.workers.packed import pack, pack_shared, unpack

from helpers import assert_close_grads, chat_prompts, cpu_dist, generate_batch, grads, make_cfg, score_batch

RAGGED = ("data.max_response_length=10", "rollout.forced_lengths=lognormal:4:0.8", "actor.use_remove_padding=true")
PROMPTS = ("7", "a longer prompt with several words", "3")


def _worker(share: bool, fused: bool = False, *extra: str) -> ActorRolloutRefWorker:
    torch.manual_seed(0)
    cfg = make_cfg(f"actor.share_prompts={str(share).lower()}", f"actor.fused_logprob={str(fused).lower()}", *RAGGED,
                   *extra)
    return ActorRolloutRefWorker(cfg, cpu_dist())


def test_layout_holds_each_prompt_once_and_every_sequence_in_its_segments(tiny_model_path):
    w = _worker(False)
    batch = generate_batch(w, chat_prompts(w, PROMPTS))  # 3 prompts x rollout.n=4 samples
    t = batch.tensors
    p, s = pack(t), pack_shared(t)
    sh = s.shared
    mask = t["attention_mask"].bool()
    prompt_width = t["prompts"].shape[1]
    p_len, r_len = mask[:, :prompt_width].sum(1), mask[:, prompt_width:].sum(1)
    assert len(sh.cu_prompt) - 1 == len(PROMPTS)
    assert s.input_ids.shape[1] == sh.tokens_unshared - int(p_len.sum()) + int(p_len[::4].sum())  # prompts once
    assert s.input_ids.shape[1] < p.input_ids.shape[1] == sh.tokens_unshared
    # what each response attends to (its keys) is its row's real tokens, with their positions, in order
    seen = []
    bounds = sh.cu_kv.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        idx = sh.kv_idx[a:b]
        seen.append((s.input_ids[0, idx].tolist(), s.position_ids[0, idx].tolist()))
    rows = [(t["input_ids"][r][mask[r]].tolist(), t["position_ids"][r][mask[r]].tolist())
            for r in range(len(batch)) if r_len[r] > 0]
    assert seen == rows
    # the LM head rows predict the same targets as the unshared pack's, in the same (row-major) order
    assert torch.equal(s.targets, p.targets) and torch.equal(s.valid, p.valid) and len(s.keep) == len(p.keep)
    assert torch.equal(s.input_ids[0, s.keep], p.input_ids[0, p.keep])  # the token each prediction is made from
    assert torch.equal(s.position_ids[0, s.keep], p.position_ids[0, p.keep])
    # the prompts first (each once), then the responses: each attention call reads a contiguous slice
    assert sh.prompt_tokens == int(sh.cu_prompt[-1]) == int(p_len[::4].sum())
    assert int(sh.cu_resp[-1]) == s.input_ids.shape[1] - sh.prompt_tokens == int(r_len.sum())
    assert torch.equal(unpack(s.targets.float(), s), (t["responses"] * s.valid).float())


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused_head"])
def test_shared_forward_and_backward_equal_unshared(tiny_model_path, fused):
    results = []
    for share in (False, True):
        w = _worker(share, fused)
        if not results:
            batch = generate_batch(w, chat_prompts(w, PROMPTS))
        lp, ent = w.actor.forward(batch, 0.7, with_entropy=True)
        m = batch["response_mask"].float()
        ((lp * m).sum() + 0.3 * (ent * m).sum()).backward()
        results.append((lp * m, ent * m, grads(w.actor.model)))
    assert len(set(batch["response_mask"].sum(1).tolist())) >= 3  # really ragged
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    assert (lp_a - lp_b).abs().max() < 1e-5 and (ent_a - ent_b).abs().max() < 1e-5
    assert_close_grads(g_a, g_b)


@pytest.mark.parametrize("budget", [[], ["actor.use_dynamic_bsz=true", "actor.max_token_len_per_device=48",
                                     "data.max_prompt_length=38"]],
                         ids=["six_per_micro_batch", "token_budget"])
def test_shared_update_and_reference_equal_unshared(tiny_model_path, budget):
    """The whole PPO update (pg + entropy + KL terms) and the reference pass, micro-batches cutting groups apart."""
    out, saved = [], None
    for share in (False, True):
        w = _worker(share, True, *budget, "data.train_batch_size=3", "actor.ppo_mini_batch_size=3",
                    "actor.ppo_micro_batch_size_per_device=6", "actor.log_prob_micro_batch_size_per_device=7",
                    "ref.log_prob_micro_batch_size_per_device=7", "actor.entropy_coeff=0.01", "actor.use_kl_loss=true",
                    "actor.kl_loss_type=k1", "actor.kl_loss_coef=0.1")
        if saved is None:
            saved = score_batch(w, generate_batch(w, chat_prompts(w, PROMPTS)))
        batch = w.compute_ref_log_prob(w.compute_log_prob(saved))
        stats = w.update_actor(batch)
        out.append((batch, stats, {n: p.detach().clone() for n, p in w.actor.model.named_parameters()}))
    (b_a, s_a, p_a), (b_b, s_b, p_b) = out
    m = b_a["response_mask"].bool()
    for key in ("old_log_probs", "ref_log_prob"):
        assert (b_a[key] - b_b[key]).abs()[m].max() < 1e-5, key
    assert abs(s_a["actor/pg_loss"][0] - s_b["actor/pg_loss"][0]) < 1e-5
    assert s_a["actor/grad_norm"][0] == pytest.approx(s_b["actor/grad_norm"][0], rel=1e-4)
    share = s_b["perf/update_token_share"][0] / s_b["perf/update_token_share"][1]  # tokens run per token of the batch
    assert 0.3 < share < 1.0 and "perf/update_token_share" not in s_a
    for n in p_a:  # 1% of one Adam step (lr 1e-3): rounding-sized gradient differences near zero flip its sign
        assert (p_a[n] - p_b[n]).abs().max() < 1e-5, n


def test_sharing_without_packing_is_refused(tiny_model_path):
    with pytest.raises(ValueError, match=r"actor\.share_prompts=true .* set actor\.use_remove_padding=true"):
        ActorRolloutRefWorker(make_cfg("actor.share_prompts=true", "actor.use_remove_padding=false"), cpu_dist())


def test_default_shares_only_where_the_run_packs_on_cuda(tiny_model_path):
    packed_cpu = ActorRolloutRefWorker(make_cfg("actor.use_remove_padding=true"), cpu_dist())
    assert packed_cpu.remove_padding and not packed_cpu.share_prompts  # CPU: off unless asked
    assert ActorRolloutRefWorker(make_cfg("actor.use_remove_padding=true", "actor.share_prompts=true"),
                                 cpu_dist()).share_prompts


def _plan_batch(uid, p_len, r_len):
    from hybrid_rl.batch import Batch

    return Batch({"prompts": torch.zeros(len(uid), 1)}, {"uid": np.asarray(uid)}, {}), (np.asarray(p_len),
                                                                                          np.asarray(r_len))


def test_micro_batches_keep_a_prompts_samples_together():
    from hybrid_rl.micro_batching import plan_micro_batches

    uid = [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2]  # 3 prompts x 4 samples, interleaved
    p_len = [10, 11, 12] * 4
    r_len = [9, 1, 5, 2, 8, 3, 7, 4, 6, 1, 2, 3]
    batch, lengths = _plan_batch(uid, p_len, r_len)
    fixed = plan_micro_batches(batch, max_seqs=4, lengths=lengths, packed=True, share_prompts=True)
    assert len(fixed) == 3 and sorted(int(i) for b in fixed for i in b) == list(range(12))
    assert all(len({uid[i] for i in b}) == 1 for b in fixed)  # one whole group per micro-batch
    unshared = plan_micro_batches(batch, max_seqs=4, lengths=lengths, packed=True)
    assert max(len({uid[i] for i in b}) for b in unshared) > 1  # by length, groups would be cut apart
    # a budget: units are groups (prompt once + responses); a group over the budget is cut into pieces that fit
    budget = 40
    binned = plan_micro_batches(batch, max_seqs=64, max_tokens=budget, lengths=lengths, packed=True, share_prompts=True)
    assert sorted(int(i) for b in binned for i in b) == list(range(12))
    for b in binned:
        shared_cost = sum({uid[i]: p_len[i] for i in b}.values()) + sum(r_len[i] for i in b)
        assert shared_cost <= budget or len(b) == 1
    assert len({tuple(sorted({uid[i] for i in b})) for b in binned if 0 in {uid[i] for i in b}}) == 1  # group 0 whole


@pytest.mark.parametrize("end_aligned", [True, False])
def test_kernel_alignment_is_checked_before_sharing(monkeypatch, end_aligned):
    """On CUDA the responses' call has fewer queries than keys: a varlen kernel whose causal diagonal is aligned to the
    start would hide each response from itself, so the first such call checks the kernel and stops the run if so."""
    import torch.nn.functional as F

    from hybrid_rl.workers import packed

    def fake_kernel(q, k, v, cu_q, cu_k, max_q, max_k, **_):  # [T, H, D], one segment
        lq, lk = q.shape[0], k.shape[0]
        shift = lk - lq if end_aligned else 0
        mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + shift
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              attn_mask=mask).transpose(0, 1)

    monkeypatch.setattr(packed, "_KERNEL", (fake_kernel, {}, True))
    monkeypatch.setattr(packed, "_END_ALIGNED", None)
    if end_aligned:
        packed._check_end_aligned(torch.device("cpu"), torch.float32)
        assert packed._END_ALIGNED is True
    else:
        with pytest.raises(RuntimeError, match="set actor.share_prompts=false"):
            packed._check_end_aligned(torch.device("cpu"), torch.float32)


def test_layout_on_hand_built_rows_with_empty_responses():
    """Groups out of order, a row with no response token, a group with none at all: every response still attends to
    its own prompt then itself, and the LM-head rows predict what ``pack`` predicts, in the same order."""
    P, R = 4, 3
    prompts = {0: [5, 6, 7], 1: [8, 9], 2: [3, 4, 5, 6]}
    rows = [(1, [11, 12]), (0, [13]), (1, []), (2, []), (0, [14, 15, 16]), (1, [17, 18, 19])]  # (prompt, response)
    b = len(rows)
    ids, mask = torch.zeros(b, P + R, dtype=torch.long), torch.zeros(b, P + R, dtype=torch.long)
    for i, (g, resp) in enumerate(rows):
        pr = prompts[g]
        ids[i, P - len(pr):P], mask[i, P - len(pr):P] = torch.tensor(pr), 1
        if resp:
            ids[i, P:P + len(resp)], mask[i, P:P + len(resp)] = torch.tensor(resp), 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    t = dict(input_ids=ids, attention_mask=mask, position_ids=pos, responses=ids[:, P:])
    p, s = pack(t), pack_shared(t)
    sh = s.shared
    assert s.input_ids[0, :sh.prompt_tokens].tolist() == [8, 9, 5, 6, 7, 3, 4, 5, 6]  # by first row: 1, 0, 2
    bounds = sh.cu_kv.tolist()
    seen = [s.input_ids[0, sh.kv_idx[a:e]].tolist() for a, e in zip(bounds[:-1], bounds[1:])]
    assert seen == [prompts[1] + [11, 12], prompts[1] + [17, 18, 19], prompts[0] + [13], prompts[0] + [14, 15, 16]]
    assert torch.equal(s.targets, p.targets) and torch.equal(s.input_ids[0, s.keep], p.input_ids[0, p.keep])
    assert torch.equal(s.position_ids[0, s.keep], p.position_ids[0, p.keep])
    assert torch.equal(unpack(s.targets.float(), s), (t["responses"] * s.valid).float())
    assert sh.tokens_unshared == int(mask.sum()) and sh.max_kv == 6 and sh.max_prompt == 4


def test_distinct_prompts_are_packed_without_sharing(tiny_model_path, monkeypatch):
    """One sample per prompt (PPO's rollout.n=1): nothing to share, so ``pack_shared`` lays the row out as ``pack``
    does, and a sharing worker's forward is the unshared one to the bit: one attention call per layer, not two."""
    import hybrid_rl.workers.packed as packed

    calls = []
    attention = packed._segments_attention
    monkeypatch.setattr(packed, "_segments_attention", lambda *a, **k: calls.append(1) or attention(*a, **k))
    extra = ("rollout.n=1", "algorithm.adv_estimator=reinforce_pp", "actor.ppo_micro_batch_size_per_device=4")
    results, batch = [], None
    for share in (False, True):
        w = _worker(share, False, *extra)
        if batch is None:
            batch = generate_batch(w, chat_prompts(w, PROMPTS))  # 3 distinct prompts x 1 sample
            t = batch.tensors
            p, s = pack(t), pack_shared(t)
            assert s.shared is None
            for key in ("input_ids", "position_ids", "cu_seqlens", "keep", "targets", "slots", "valid"):
                assert torch.equal(getattr(s, key), getattr(p, key)), key
        calls.clear()
        lp, ent = w.actor.forward(batch, 0.7, with_entropy=True)
        ((lp * batch["response_mask"]).sum()).backward()
        results.append((lp, ent, grads(w.actor.model), len(calls)))
    layers = w.actor.model.config.num_hidden_layers
    (lp_a, ent_a, g_a, calls_a), (lp_b, ent_b, g_b, calls_b) = results
    assert calls_a == calls_b == layers
    assert torch.equal(lp_a, lp_b) and torch.equal(ent_a, ent_b)
    assert all(torch.equal(g_a[n], g_b[n]) for n in g_a)
