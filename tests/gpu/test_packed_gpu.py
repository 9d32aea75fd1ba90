"""Padding-free passes on a GPU: the flash-attention varlen kernel is the one used, and packed bf16 log-probs and
gradients agree with the padded pass's (``pytest -m gpu tests/gpu/test_packed_gpu.py``; skips without CUDA)."""

from __future__ import annotations

import pytest
import torch

from helpers import chat_prompts, generate_batch, make_cfg

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _run(flag: bool, batch=None):
    from hybrid_rl.distributed import DistInfo
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    torch.manual_seed(0)
    cfg = make_cfg("trainer.device=cuda", "model.dtype=bfloat16", f"actor.use_remove_padding={str(flag).lower()}",
                   f"actor.fused_logprob={str(flag).lower()}", "data.max_response_length=24",
                   "rollout.forced_lengths=lognormal:12:0.8")
    d = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))
    w = ActorRolloutRefWorker(cfg, d)
    if batch is None:
        batch = generate_batch(w, chat_prompts(w, ("7", "a longer prompt with several words", "3", "12+5=?")))
    lp, ent = w.actor.forward(batch, 1.0, with_entropy=True)
    m = batch["response_mask"].to(lp.device).float()
    ((lp * m).sum() + 0.1 * (ent * m).sum()).backward()
    grads = {n: p.grad.float().clone() for n, p in w.actor.model.named_parameters() if p.grad is not None}
    return batch, lp * m, grads


def test_varlen_kernel_and_bf16_parity(tiny_model_path):
    from hybrid_rl.workers import packed

    batch, lp_pad, g_pad = _run(False)
    _, lp_packed, g_packed = _run(True, batch)
    assert packed._KERNEL not in (None, False), "torch.nn.attention.varlen is missing: packed passes fall back to a loop"
    m = batch["response_mask"].bool().to(lp_pad.device)
    diff = (lp_pad - lp_packed).abs()[m]
    assert diff.mean() < 0.02 and diff.max() < 0.2, (float(diff.mean()), float(diff.max()))
    cos = [torch.nn.functional.cosine_similarity(g_pad[n].flatten(), g_packed[n].flatten(), dim=0) for n in g_pad]
    assert min(float(c) for c in cos) > 0.98


def _run_shared(share: bool, batch=None):
    from hybrid_rl.distributed import DistInfo
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    torch.manual_seed(0)
    cfg = make_cfg("trainer.device=cuda", "model.dtype=bfloat16", "actor.use_remove_padding=true",
                   "actor.fused_logprob=true", f"actor.share_prompts={str(share).lower()}", "data.max_response_length=24",
                   "rollout.forced_lengths=lognormal:12:0.8")
    d = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))
    w = ActorRolloutRefWorker(cfg, d)
    if batch is None:
        batch = generate_batch(w, chat_prompts(w, ("7", "a longer prompt with several words", "3", "12+5=?")))
    lp, ent = w.actor.forward(batch, 1.0, with_entropy=True)
    m = batch["response_mask"].to(lp.device).float()
    ((lp * m).sum() + 0.1 * (ent * m).sum()).backward()
    grads = {n: p.grad.float().clone() for n, p in w.actor.model.named_parameters() if p.grad is not None}
    return batch, lp * m, grads


def test_shared_prompts_bf16_parity_through_the_varlen_kernel(tiny_model_path):
    """actor.share_prompts on the flash varlen kernel: the responses' call has fewer queries than keys, and its causal
    diagonal must be aligned to the end (a start-aligned one would hide the responses from themselves)."""
    from hybrid_rl.workers import packed

    batch, lp_a, g_a = _run_shared(False)
    _, lp_b, g_b = _run_shared(True, batch)
    assert packed._KERNEL not in (None, False)
    m = batch["response_mask"].bool().to(lp_a.device)
    diff = (lp_a - lp_b).abs()[m]
    assert diff.mean() < 0.02 and diff.max() < 0.2, (float(diff.mean()), float(diff.max()))
    cos = [torch.nn.functional.cosine_similarity(g_a[n].flatten(), g_b[n].flatten(), dim=0) for n in g_a]
    assert min(float(c) for c in cos) > 0.98
