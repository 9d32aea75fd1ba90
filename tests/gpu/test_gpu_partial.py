"""GPU test of the vLLM engine's interruptible generation (partial rollouts, ``trainer.partial_rollouts``).

Run on a CUDA machine with vLLM 0.26 installed (its own process: vLLM allows one engine per process):
    pytest -m gpu tests/gpu/test_gpu_partial.py
Skips cleanly without CUDA or without vLLM.

The model is the Qwen2.5-0.5B architecture with random weights (no download), trainer (FSDP2, world of one) and
engine colocated as in ``test_vllm_gpu.py``.

1. interrupt after a few engine steps, continue from prompt + partial tokens with the same weights: every aborted
   request kept what it had sampled, with one log-prob per token, and every greedy token, the first after the seam
   above all, is at the top of the trainer's distribution given the prompt and all tokens before it (an uninterrupted
   run is no exact reference: a random model's greedy choices are bf16 near-ties).
2. a real optimizer step and a push between the segments: the stitched batch (``partial.assemble_groups``) has
   the trainer's layout, per-token versions 0 then 1, and the continuation's log-probs match the trainer's
   recomputation under the new weights (the first segment's match the old weights).
3. after a push the continuation reads nothing of its context (prompt + first segment) from the prefix cache the old
   weights left (``RequestOutput.num_cached_tokens``): the push reset it, and the log-probs match the new weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

pytestmark = pytest.mark.gpu

from helpers import require_vllm_gpu  # noqa: E402

vllm = require_vllm_gpu()

from hybrid_rl.batch import Batch  # noqa: E402
from helpers import AfterPolls, actor_step, raise_sampled_log_probs, vllm_hybrid  # noqa: E402
from hybrid_rl.modes.partial import CarryOver, assemble_groups  # noqa: E402
from hybrid_rl.rollout.base import Continuation, SamplingParams  # noqa: E402

EOS, PAD = 151645, 151643
TOL = 2e-2  # mean |Δ log-prob| between engine and trainer in bf16
MAX_NEW = 32


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    mask = mask.float()
    return float((x.float() * mask).sum() / mask.sum().clamp(min=1))


def random_prompts(num: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 150000, (int(n),), generator=g).tolist()
            for n in torch.randint(lo, hi + 1, (num,), generator=g)]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    # overlap mode: the engine stays awake (free_cache_engine off), as partial rollouts run it
    h = vllm_hybrid(tmp_path_factory, ["rollout.vllm.gpu_memory_utilization=0.3", f"data.max_response_length={MAX_NEW}"],
                    free_cache_engine=False, sleep_level=1)
    yield h
    h.engine.shutdown()


def test_interrupt_and_continue_with_the_same_weights(hybrid):
    h = hybrid
    prompts = random_prompts(8, 12, 40, seed=1)
    greedy = SamplingParams(n=1, temperature=0.0)
    with h.sm as eng:
        whole = eng.generate_interruptible([Continuation(p, (), MAX_NEW, True) for p in prompts], greedy)
        heard: list[int] = []
        first = eng.generate_interruptible([Continuation(p, (), MAX_NEW, True) for p in prompts], greedy,
                                           interrupt=AfterPolls(6), on_finish=heard.extend)
        assert heard == [] and all(not s.finished for s in first)
        assert all(1 <= len(s.tokens) < MAX_NEW and len(s.logprobs) == len(s.tokens) for s in first)
        rest = eng.generate_interruptible([Continuation(p, tuple(s.tokens), MAX_NEW - len(s.tokens), True)
                                           for p, s in zip(prompts, first)], greedy)
    assert all(s.finished and len(s.tokens) == MAX_NEW for s in whole)
    # A random model's greedy choices are near-ties: bf16 noise (here the prefix cache's KV against a fresh prefill)
    # can flip one, so an uninterrupted run is no exact reference. The reference is the trainer's distribution given
    # prompt + everything before: every token must be near its top, above all the first one after the seam, which a
    # continuation that lost its partial tokens would have picked from the wrong context.
    ranks, seams = [], []
    with torch.no_grad():
        for p, a, b in zip(prompts, first, rest):
            assert b.finished and len(a.tokens) + len(b.tokens) == MAX_NEW and len(b.logprobs) == len(b.tokens)
            toks = torch.tensor(list(p) + a.tokens + b.tokens, device=h.dist.device)
            logits = h.actor.model(input_ids=toks[None], use_cache=False).logits[0, len(p) - 1:-1].float()
            chosen = logits.gather(1, toks[len(p):, None])
            rank = (logits > chosen).sum(1).tolist()
            ranks += rank
            seams.append(rank[len(a.tokens)])
    agree = sum(x == y for w, a, b in zip(whole, first, rest) for x, y in zip(a.tokens + b.tokens, w.tokens))
    print(f"interrupt+continue: trainer rank of each greedy token ≤ 2 at {sum(r <= 2 for r in ranks) / len(ranks):.3f}"
          f", seams {seams}; token agreement with an uninterrupted run {agree / (MAX_NEW * len(prompts)):.3f}")
    assert max(seams) <= 2, seams
    assert sum(r <= 2 for r in ranks) / len(ranks) >= 0.9


def test_stitched_batch_versions_and_logprobs_across_a_weight_update(hybrid):
    h = hybrid
    n, prompts = 2, random_prompts(4, 12, 40, seed=2)
    params = SamplingParams(n=1, temperature=1.0)
    carry = CarryOver(per_step=4, n=n, max_staleness=2, max_response_length=MAX_NEW)
    ids = torch.full((len(prompts), 40), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, 40 - len(p):], mask[i, 40 - len(p):] = torch.tensor(p), 1
    import numpy as np

    carry.add_prompts(Batch({"input_ids": ids, "attention_mask": mask},
                            {"uid": np.array([f"u{i}" for i in range(len(prompts))], dtype=object)}),
                      forced_lengths=(MAX_NEW,) * (len(prompts) * n))  # EOS ignored: every sample is interrupted
    with h.sm as eng:
        pending = carry.pending()
        carry.apply(pending, eng.generate_interruptible(carry.requests(pending), params, AfterPolls(5)), 0)
    assert not any(g.complete for g in carry.groups)
    old_lp, scored = _stitch_and_score(h, carry, n)  # trainer at θ_0, over the first segments
    raise_sampled_log_probs(h, scored)
    with h.sm as eng:  # pushes θ_1
        pending = carry.pending()
        carry.apply(pending, eng.generate_interruptible(carry.requests(pending), params), 1)
    batch = assemble_groups(carry.groups, n, [EOS], PAD, h.dist.device, params.logprob_temperature)
    t = batch.tensors
    assert t["responses"].shape == (len(prompts) * n, MAX_NEW) and int(t["response_mask"].sum()) == t["responses"].numel()
    assert torch.equal(t["input_ids"][:, -MAX_NEW:], t["responses"])
    cut = [len(s.tokens) - s.resumed_tokens for g in carry.groups for s in g.samples]
    for row, c in enumerate(cut):
        assert t["token_weight_version"][row].tolist() == [0] * c + [1] * (MAX_NEW - c)
    assert t["weight_version"].tolist() == [0] * len(cut)
    new_lp, _ = h.actor.compute_log_prob(batch, 16, params.logprob_temperature)
    second = (t["token_weight_version"] == 1) & t["response_mask"].bool()
    diff_new = masked_mean((t["rollout_log_probs"] - new_lp).abs(), second)
    first = (t["token_weight_version"] == 0) & t["response_mask"].bool()
    diff_old = masked_mean((t["rollout_log_probs"] - old_lp).abs(), first)
    print(f"continuation vs θ_1: {diff_new:.5f}; first segment vs θ_0: {diff_old:.5f}")
    assert diff_new <= TOL and diff_old <= TOL


def _stitch_and_score(h, carry: CarryOver, n: int) -> tuple[torch.Tensor, Batch]:
    """The trainer's θ-now log-probs of every token sampled so far, laid out as the final [B, MAX_NEW] batch
    (and the batch of those first segments)."""
    import copy

    done = copy.deepcopy(carry.groups)
    for g in done:
        for s in g.samples:
            s.finished = True
            s.forced_length = len(s.tokens)
    b = assemble_groups(done, n, [EOS], PAD, h.dist.device, 1.0)
    lp, _ = h.actor.compute_log_prob(b, 16, 1.0)
    out = torch.zeros((lp.shape[0], MAX_NEW), device=lp.device)
    out[:, :lp.shape[1]] = lp
    return out, b


def test_a_push_resets_the_prefix_cache_the_old_weights_left(hybrid):
    h = hybrid
    prompts = random_prompts(6, 40, 60, seed=3)
    params = SamplingParams(n=1, temperature=1.0)
    with h.sm as eng:
        first = eng.generate_interruptible([Continuation(p, (), MAX_NEW, True) for p in prompts], params,
                                           AfterPolls(12))
    assert all(1 <= len(s.tokens) < MAX_NEW and not s.finished for s in first)
    contexts = [list(p) + s.tokens for p, s in zip(prompts, first)]
    _one_step(h, contexts)
    with h.sm as eng:  # pushes the new weights
        rest = eng.generate_interruptible([Continuation(p, tuple(s.tokens), MAX_NEW - len(s.tokens), True)
                                           for p, s in zip(prompts, first)], params)
        cached = eng.last_generate_stats["cached_tokens"]
    context = sum(len(c) for c in contexts)
    diffs = []
    with torch.no_grad():
        for c, b in zip(contexts, rest):
            toks = torch.tensor(c + b.tokens, device=h.dist.device)
            logits = h.actor.model(input_ids=toks[None], use_cache=False).logits[0, len(c) - 1:-1].float()
            lp = torch.log_softmax(logits, -1).gather(1, toks[len(c):, None])[:, 0]
            diffs.append((lp - torch.tensor(b.logprobs, device=lp.device)).abs().mean().item())
    diff = sum(diffs) / len(diffs)
    print(f"{cached:.0f} of {context} context tokens from the prefix cache; continuation log-probs vs the new "
          f"weights' {diff:.4f}")
    assert cached == 0 and diff <= TOL


def _one_step(h, contexts: list[list[int]]) -> None:
    """``actor_step`` raising the contexts' log-likelihood."""
    def loss():
        total = 0.0
        for c in contexts:
            toks = torch.tensor(c, device=h.dist.device)[None]
            logits = h.actor.model(input_ids=toks, use_cache=False).logits[0, :-1].float()
            total = total - torch.log_softmax(logits, -1).gather(1, toks[0, 1:, None]).mean() / len(contexts)
        return total

    actor_step(h, loss)
