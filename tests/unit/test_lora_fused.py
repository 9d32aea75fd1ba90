"""The fused LoRA linear (hybrid_rl/models/lora_fused.py) against peft's own forward and backward: the same outputs
and gradients on a whole model (the reference is peft's code, the model built twice from one seed), peft's
adapter switch and dropout left to peft, and the fused path actually taken."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as PeftLoraLinear

from hybrid_rl.models import apply_lora, load_causal_lm
from hybrid_rl.models.lora_fused import LoraLinearFn, fuse_lora_linears

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _pair(path: str, dropout: float = 0.0):
    """peft's model and the fused one: the same base and adapters (lora_B made non-zero, so adapters count)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = get_peft_model(load_causal_lm(path, torch.float32),
                           LoraConfig(r=8, lora_alpha=32, target_modules=TARGETS, lora_dropout=dropout, bias="none"))
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        models.append(m)
    return models


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    loss = logits.float().log_softmax(-1).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), grads


def test_the_fused_linear_gives_peft_s_outputs_and_gradients(tiny_model_path, monkeypatch):
    ref, fused = _pair(tiny_model_path)
    n_layers = ref.config.num_hidden_layers
    assert fuse_lora_linears(fused) == len(TARGETS) * n_layers

    calls = []
    real = LoraLinearFn.apply
    monkeypatch.setattr(LoraLinearFn, "apply", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(0, ref.config.vocab_size, (2, 11))
    want_logits, want = _loss_and_grads(ref, ids)
    got_logits, got = _loss_and_grads(fused, ids)

    assert len(calls) == len(TARGETS) * n_layers
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert set(got) == set(want) and all("lora_" in n for n in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_function_alone_matches_the_formula_in_float64():
    """y = x Wᵀ + b + s·(x Aᵀ) Bᵀ and its gradients for x, A, B by autograd on the plain formula (float64)."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)
    w, b = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    a = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    bb = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, 4, dtype=torch.float64)

    want = x @ w.t() + b + 0.75 * (x @ a.t()) @ bb.t()
    want_grads = torch.autograd.grad(want, (x, a, bb), g)
    got = LoraLinearFn.apply(x, w, b, a, bb, 0.75)
    got_grads = torch.autograd.grad(got, (x, a, bb), g)
    torch.testing.assert_close(got, want)
    for gg, wg in zip(got_grads, want_grads):
        torch.testing.assert_close(gg, wg)


def test_disabled_adapters_and_dropout_go_through_peft(tiny_model_path):
    ref, fused = _pair(tiny_model_path, dropout=0.3)
    fuse_lora_linears(fused)
    ids = torch.randint(0, ref.config.vocab_size, (1, 9))
    base = load_causal_lm(tiny_model_path, torch.float32).eval()
    with torch.no_grad():
        plain = base(ids).logits
        with fused.disable_adapter():  # the frozen reference's path
            torch.testing.assert_close(fused(ids).logits, plain)
        ref.train(), fused.train()
        torch.manual_seed(5)
        want = ref(ids).logits  # dropout on: peft's forward, the same random draws
        torch.manual_seed(5)
        torch.testing.assert_close(fused(ids).logits, want)
        fused.eval(), ref.eval()
        torch.testing.assert_close(fused(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


def test_apply_lora_fuses_every_adapted_linear(tiny_model_path):
    model = apply_lora(load_causal_lm(tiny_model_path, torch.bfloat16), 4, 16, TARGETS, 0.0)
    layers = [m for m in model.modules() if type(m) is PeftLoraLinear]
    assert layers and all(m.forward.__func__.__name__ == "_fused_forward" for m in layers)
    ids = torch.randint(0, model.config.vocab_size, (1, 7))
    assert torch.isfinite(model(ids).logits).all()
