"""Liger's fused kernels on a GPU (``model.use_liger``): patched into the actor, the reference and the critic, and
the packed bf16 log-probs and gradients agree with the unpatched pass's (``pytest -m gpu tests/gpu/test_liger_gpu.py``;
skips without CUDA or without liger-kernel)."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_bf16_parity, gpu_actor_pass, liger_patched

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("liger_kernel", reason="needs liger-kernel (pip install 'hybrid_rl[liger]')")


def test_liger_kernels_are_patched_and_agree(tiny_model_path):
    _, batch, lp_ref, g_ref = gpu_actor_pass("model.use_liger=false", "actor.use_kl_loss=true")
    w, _, lp_liger, g_liger = gpu_actor_pass("model.use_liger=true", "actor.use_kl_loss=true", batch=batch)
    patched = liger_patched(w.actor.model)
    assert any("mlp" in n for n in patched) and any("layernorm" in n for n in patched), patched
    assert liger_patched(w.ref.model), "the reference model was not patched"
    # same parameter names (FSDP units and the weight push untouched), log-probs and gradients within bf16 noise
    assert_bf16_parity(batch, lp_ref, lp_liger, g_ref, g_liger)


def test_liger_kernels_are_patched_into_the_critic(tiny_model_path):
    from hybrid_rl.workers.critic import build_value_model

    patched = liger_patched(build_value_model(tiny_model_path, liger_device=torch.device("cuda", 0)))
    assert any("mlp" in n for n in patched) and any("layernorm" in n for n in patched), patched
    assert all(n.startswith("backbone.") for n in patched), patched
