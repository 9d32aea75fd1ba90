"""``actor.optimizer_impl``: each of AdamW's implementations takes the same first step, the closed-form one, and the
fused one survives an offload round trip of its state."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.workers.fsdp_engine import TrainingEngine

LR, WD, EPS = 1e-2, 0.1, 1e-8


def _engine(impl: str) -> TrainingEngine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    eng = TrainingEngine(model, torch.device("cpu"), torch.float32, trainable=True)
    eng.configure_optimizer(LR, (0.9, 0.999), WD, 0, "constant", 10, 0.0, impl)
    return eng


def _grads(eng: TrainingEngine) -> list[torch.Tensor]:
    x = torch.linspace(-1, 1, 24).reshape(4, 6)
    eng.model(x).pow(2).sum().backward()
    return [p.grad.detach().clone() for p in eng.model.parameters()]


@pytest.mark.parametrize("impl", ["fused", "foreach", "for_loop"])
def test_first_step_is_the_closed_form_adamw_step(impl):
    """Adam's first step with bias correction: m = g, v = g², so p ← p(1 - lr·wd) - lr·g / (|g| + eps)."""
    eng = _engine(impl)
    before = [p.detach().clone() for p in eng.model.parameters()]
    grads = _grads(eng)
    eng.optimizer_step(grad_clip=0.0)
    for p0, g, p1 in zip(before, grads, eng.model.parameters()):
        expected = p0 * (1 - LR * WD) - LR * g / (g.abs() + EPS)
        torch.testing.assert_close(p1.detach(), expected, rtol=1e-6, atol=1e-7)
    assert eng.optimizer.defaults["fused"] is (True if impl == "fused" else None)
    assert eng.optimizer.defaults["foreach"] is {"fused": None, "foreach": True, "for_loop": False}[impl]


def test_implementations_agree_over_steps_and_through_an_offload():
    """Three steps each; the fused engine's state goes to the offload device and back between steps (its ``step``
    counter is a tensor beside the parameters, moved with the moments)."""
    fused, loop = _engine("fused"), _engine("for_loop")
    for _ in range(3):
        for eng in (fused, loop):
            _grads(eng)
            eng.optimizer_step(grad_clip=1.0)
        fused.offload(params=False, optimizer=True)
        assert fused.optimizer_offloaded
        fused.onload()
    for a, b in zip(fused.model.parameters(), loop.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    state = fused.optimizer.state[next(fused.model.parameters())]
    assert float(state["step"]) == 3.0


def test_unknown_implementation_is_refused():
    model = torch.nn.Linear(2, 2)
    eng = TrainingEngine(model, torch.device("cpu"), torch.float32, trainable=True)
    with pytest.raises(ValueError, match="for_loop"):
        eng.configure_optimizer(LR, (0.9, 0.999), 0.0, 0, "constant", 10, 0.0, "sgd")
