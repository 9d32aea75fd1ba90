"""Padding-free passes on a GPU: the flash-attention varlen kernel is the one used, and packed bf16 log-probs and
gradients agree with the padded pass's, and prompt-shared packing with the unshared
(``pytest -m gpu tests/gpu/test_packed_gpu.py``; skips without CUDA)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from helpers import assert_bf16_parity, gpu_actor_pass

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _packed(flag: bool) -> tuple[str, str]:
    return f"actor.use_remove_padding={str(flag).lower()}", f"actor.fused_logprob={str(flag).lower()}"


@contextmanager
def counted_kernel():
    """Count the calls that reach torch's flash varlen kernel (an importable kernel is not proof that it ran: with
    float32 queries the packed path falls back to one SDPA per sequence)."""
    from hybrid_rl.workers import packed

    if packed._KERNEL is False:
        packed._KERNEL = packed._varlen_kernel()
    assert packed._KERNEL is not None, "torch.nn.attention.varlen is missing: packed passes fall back to a loop"
    fn, causal, gqa = packed._KERNEL
    calls: list[tuple[int, int]] = []

    def counting(q, k, *args, **kwargs):
        calls.append((q.shape[0], k.shape[0]))
        return fn(q, k, *args, **kwargs)

    packed._KERNEL = (counting, causal, gqa)
    try:
        yield calls
    finally:
        packed._KERNEL = (fn, causal, gqa)


def test_varlen_kernel_and_bf16_parity(tiny_model_path):
    _, batch, lp_pad, g_pad = gpu_actor_pass(*_packed(False))
    with counted_kernel() as calls:
        _, _, lp_packed, g_packed = gpu_actor_pass(*_packed(True), batch=batch)
    assert calls, "the packed pass never reached the varlen kernel"
    assert_bf16_parity(batch, lp_pad, lp_packed, g_pad, g_packed)


def test_shared_prompts_bf16_parity_through_the_varlen_kernel(tiny_model_path):
    """actor.share_prompts on the flash varlen kernel: the responses' call has fewer queries than keys, and its causal
    diagonal must be aligned to the end (a start-aligned one would hide the responses from themselves)."""
    from hybrid_rl.workers import packed

    _, batch, lp_a, g_a = gpu_actor_pass(*_packed(True), "actor.share_prompts=false")
    with counted_kernel() as calls:
        _, _, lp_b, g_b = gpu_actor_pass(*_packed(True), "actor.share_prompts=true", batch=batch)
    assert any(nq < nk for nq, nk in calls), "no responses' call (fewer queries than keys) reached the kernel"
    assert packed._END_ALIGNED is True
    assert_bf16_parity(batch, lp_a, lp_b, g_a, g_b)


def test_float32_queries_under_autocast_reach_the_kernel():
    """Without FSDP (a plain ``python -m hybrid_rl`` run) the model computes under autocast and RoPE hands the
    attention float32 queries: they are cast to the autocast dtype and still take the kernel, with SDPA's result."""
    import torch.nn.functional as F

    from hybrid_rl.workers import packed

    g = torch.Generator(device="cpu").manual_seed(0)
    lens = [5, 9, 3]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(17, 4, 64, generator=g).cuda() for _ in range(3))
    with counted_kernel() as calls, torch.autocast("cuda", dtype=torch.bfloat16):
        out = packed._segments_attention(q, k, v, cu, cu, max(lens), max(lens), None)
    assert calls and out.dtype == torch.bfloat16
    start = 0
    for n in lens:
        ref = F.scaled_dot_product_attention(*(x[start:start + n].transpose(0, 1) for x in (q, k, v)), is_causal=True)
        assert (out[start:start + n].float() - ref.transpose(0, 1)).abs().max() < 3e-2
        start += n


def test_fused_head_on_the_gpu_matches_the_reference_forward_and_backward():
    """The fused head on CUDA (the entropy's row dot as multiply-and-sum, the path the flagship ran), in float64
    against the full-logits reference, with log-prob and entropy gradients at a temperature."""
    from hybrid_rl.workers.packed import fused_logprob_entropy
    from hybrid_rl.algorithms import entropy_from_logits, logprobs_from_logits

    torch.manual_seed(0)
    n, h, v = 300, 64, 5003
    hidden = torch.randn(n, h, dtype=torch.float64, device="cuda", requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, device="cuda", requires_grad=True)
    targets = torch.randint(0, v, (n,), device="cuda")
    gl, ge = torch.randn(n, dtype=torch.float64, device="cuda"), torch.randn(n, dtype=torch.float64, device="cuda")
    ref_h, ref_w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    logits = ref_h @ ref_w.t()
    lp_ref = logprobs_from_logits(logits[None], targets[None], 0.7)[0]
    ent_ref = entropy_from_logits(logits[None], 0.7)[0]
    ((lp_ref * gl).sum() + (ent_ref * ge).sum()).backward()
    lp, ent = fused_logprob_entropy(hidden, weight, targets, 0.7, chunk=128)
    ((lp * gl).sum() + (ent * ge).sum()).backward()
    for got, want in ((lp, lp_ref), (ent, ent_ref), (hidden.grad, ref_h.grad), (weight.grad, ref_w.grad)):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("share", [False, True], ids=["pack", "pack_shared"])
def test_packing_from_host_copies_never_waits_for_the_gpu(share):
    """With the host copies ``micro_batches`` hands over, laying out a micro-batch and scattering its results back
    queue work without one device sync (torch's sync debug mode turns any into an error). Before, boolean indexing,
    ``unique`` and ``.tolist()`` on the device drained the queue several times per micro-batch."""
    from hybrid_rl.micro_batching import _host_layout, _host_rows
    from hybrid_rl.batch import Batch
    from hybrid_rl.workers.packed import pack, pack_shared, unpack

    g = torch.Generator().manual_seed(0)
    b, n, P, R = 16, 4, 12, 20
    p_len = torch.randint(3, P + 1, (b // n,), generator=g).repeat_interleave(n)
    r_len = torch.randint(1, R + 1, (b,), generator=g)
    ids = torch.randint(5, 1000, (b, P + R), generator=g)
    mask = torch.zeros(b, P + R, dtype=torch.long)
    for i in range(b):
        mask[i, P - p_len[i]:P], mask[i, P:P + r_len[i]] = 1, 1
        ids[i, :P] = ids[i - i % n, :P]
    t = dict(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
             responses=ids[:, P:], prompts=ids[:, :P])
    batch = Batch({k: v.cuda() for k, v in t.items()})
    host = _host_rows(_host_layout(batch, share), torch.arange(b).numpy(), batch, batch)
    fn = pack_shared if share else pack
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        p = fn(batch.tensors, host)
        back = unpack(p.targets.float(), p)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    reference = fn({k: v for k, v in t.items()})  # the same layout built on the CPU
    assert torch.equal(p.input_ids.cpu(), reference.input_ids) and torch.equal(p.keep.cpu(), reference.keep)
    assert torch.equal(back.cpu(), (t["responses"] * reference.valid).float())
