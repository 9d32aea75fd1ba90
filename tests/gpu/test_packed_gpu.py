"""Padding-free passes on a GPU: the flash-attention varlen kernel is the one used, and packed bf16 log-probs and
gradients agree with the padded pass's, and prompt-shared packing with the unshared
(``pytest -m gpu tests/gpu/test_packed_gpu.py``; skips without CUDA)."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_bf16_parity, gpu_actor_pass

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _packed(flag: bool) -> tuple[str, str]:
    return f"actor.use_remove_padding={str(flag).lower()}", f"actor.fused_logprob={str(flag).lower()}"


def test_varlen_kernel_and_bf16_parity(tiny_model_path):
    from hybrid_rl.workers import packed

    _, batch, lp_pad, g_pad = gpu_actor_pass(*_packed(False))
    _, _, lp_packed, g_packed = gpu_actor_pass(*_packed(True), batch=batch)
    assert packed._KERNEL not in (None, False), "torch.nn.attention.varlen is missing: packed passes fall back to a loop"
    assert_bf16_parity(batch, lp_pad, lp_packed, g_pad, g_packed)


def test_shared_prompts_bf16_parity_through_the_varlen_kernel(tiny_model_path):
    """actor.share_prompts on the flash varlen kernel: the responses' call has fewer queries than keys, and its causal
    diagonal must be aligned to the end (a start-aligned one would hide the responses from themselves)."""
    from hybrid_rl.workers import packed

    _, batch, lp_a, g_a = gpu_actor_pass(*_packed(True), "actor.share_prompts=false")
    _, _, lp_b, g_b = gpu_actor_pass(*_packed(True), "actor.share_prompts=true", batch=batch)
    assert packed._KERNEL not in (None, False) and packed._END_ALIGNED is True
    assert_bf16_parity(batch, lp_a, lp_b, g_a, g_b)
