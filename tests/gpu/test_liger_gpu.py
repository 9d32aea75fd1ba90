"""Liger's fused kernels on a GPU (``model.use_liger``): patched into the actor and the reference, and the packed bf16
log-probs and gradients agree with the unpatched pass's (``pytest -m gpu tests/gpu/test_liger_gpu.py``; skips without
CUDA or without liger-kernel)."""

from __future__ import annotations

import pytest
import torch

from helpers import chat_prompts, generate_batch, make_cfg

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("liger_kernel", reason="needs liger-kernel (pip install 'hybrid_rl[liger]')")


def _run(liger: bool, batch=None):
    from hybrid_rl.distributed import DistInfo
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    torch.manual_seed(0)
    cfg = make_cfg("trainer.device=cuda", "model.dtype=bfloat16", f"model.use_liger={str(liger).lower()}",
                   "actor.use_kl_loss=true", "data.max_response_length=24", "rollout.forced_lengths=lognormal:12:0.8")
    d = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0))
    w = ActorRolloutRefWorker(cfg, d)
    if batch is None:
        batch = generate_batch(w, chat_prompts(w, ("7", "a longer prompt with several words", "3", "12+5=?")))
    lp, ent = w.actor.forward(batch, 1.0, with_entropy=True)
    m = batch["response_mask"].to(lp.device).float()
    ((lp * m).sum() + 0.1 * (ent * m).sum()).backward()
    grads = {n: p.grad.float().clone() for n, p in w.actor.model.named_parameters() if p.grad is not None}
    return w, batch, lp * m, grads


def test_liger_kernels_are_patched_and_agree(tiny_model_path):
    from hybrid_rl.kernels import liger_patched

    _, batch, lp_ref, g_ref = _run(False)
    w, _, lp_liger, g_liger = _run(True, batch)
    patched = liger_patched(w.actor.model)
    assert any("mlp" in n for n in patched) and any("layernorm" in n for n in patched), patched
    assert liger_patched(w.ref.model), "the reference model was not patched"
    m = batch["response_mask"].bool().to(lp_ref.device)
    diff = (lp_ref - lp_liger).abs()[m]
    assert diff.mean() < 0.02 and diff.max() < 0.2, (float(diff.mean()), float(diff.max()))
    assert set(g_ref) == set(g_liger)  # same parameter names: FSDP units and the weight push are untouched
    cos = [torch.nn.functional.cosine_similarity(g_ref[n].flatten(), g_liger[n].flatten(), dim=0) for n in g_ref]
    assert min(float(c) for c in cos) > 0.98
