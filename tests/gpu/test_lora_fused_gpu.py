"""LoRA's fused adapted linears (``hybrid_rl/models/lora_fused.py``) on a GPU, under FSDP2 in bf16: the actor's
packed log-probs and adapter gradients agree with peft's own forward's (``pytest -m gpu
tests/gpu/test_lora_fused_gpu.py``; skips without CUDA)."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_bf16_parity, gpu_actor_pass

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

LORA = ("model.lora.rank=8", "model.lora.alpha=32", "model.lora.base_dtype=compute", "actor.use_kl_loss=true")


def test_fused_lora_agrees_with_peft_under_fsdp2(tiny_model_path, monkeypatch):
    import hybrid_rl.models.lora_fused as lf

    monkeypatch.setattr(lf, "fuse_lora_linears", lambda model: 0)  # peft's forward
    _, batch, lp_peft, g_peft = gpu_actor_pass(*LORA)
    monkeypatch.undo()
    calls = []
    real = lf.LoraLinearFn.apply
    monkeypatch.setattr(lf.LoraLinearFn, "apply", lambda *a: calls.append(1) or real(*a))
    w, _, lp_fused, g_fused = gpu_actor_pass(*LORA, batch=batch)
    assert calls, "the fused function never ran"
    assert g_fused and all("lora_" in n for n in g_fused)
    # peft starts lora_B at zero: lora_A's gradients are zero on both paths, lora_B's are the ones compared
    assert all(float(g.abs().max()) == 0.0 for n, g in {**g_peft, **g_fused}.items() if "lora_A" in n)
    only_b = lambda g: {n: t for n, t in g.items() if "lora_B" in n}  # noqa: E731
    assert_bf16_parity(batch, lp_peft, lp_fused, only_b(g_peft), only_b(g_fused))


def test_fused_lora_matches_peft_in_bf16_on_cuda(tiny_model_path):
    """A whole model in bf16 on cuda:0 with non-zero adapters: logits and every adapter gradient."""
    from peft import LoraConfig, get_peft_model

    from hybrid_rl.models import load_causal_lm
    from hybrid_rl.models.lora_fused import fuse_lora_linears

    out = []
    for fused in (False, True):
        torch.manual_seed(0)
        m = get_peft_model(load_causal_lm(tiny_model_path, torch.float32), LoraConfig(
            r=8, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"]))
        torch.manual_seed(1)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        m = m.to("cuda", torch.bfloat16)
        if fused:
            assert fuse_lora_linears(m) > 0
        ids = torch.randint(0, m.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2)).cuda()
        logits = m(ids).logits
        logits.float().log_softmax(-1).mean().backward()
        out.append((logits.detach().float(), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = out
    assert (l0 - l1).abs().max() < 0.1 and (l0 - l1).abs().mean() < 0.01
    assert set(g0) == set(g1) and len(g0) > 0
    for n in g0:
        cos = torch.nn.functional.cosine_similarity(g0[n].flatten(), g1[n].flatten(), dim=0)
        assert float(cos) > 0.99, n
