"""``model.use_liger`` (hybrid_rl/liger.py) on CPU: what Liger is asked for, and the one-line errors that stop a run
before any weight is loaded. The kernels themselves are Triton (CUDA only): tests/gpu/test_liger_gpu.py checks that they
are patched in and that log-probs and gradients agree with the unpatched model's."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from helpers import liger_patched
from hybrid_rl.liger import LIGER_KERNELS, apply_liger

CUDA = torch.device("cuda", 0)


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)
    return Qwen2ForCausalLM(cfg)


def _fake_liger(monkeypatch, table):
    """A stand-in for liger_kernel.transformers.monkey_patch holding only the dispatch table (Liger needs Triton)."""
    mod = types.ModuleType("liger_kernel.transformers.monkey_patch")
    mod.MODEL_TYPE_TO_APPLY_LIGER_FN = table
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", mod)


def test_cpu_device_is_refused_with_the_key():
    with pytest.raises(ValueError, match=r"model\.use_liger=true needs a CUDA device.*set model\.use_liger=false"):
        apply_liger(_model(), torch.device("cpu"))


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)  # import fails
    with pytest.raises(ValueError, match=r"pip install 'hybrid_rl\[liger\]'"):
        apply_liger(_model(), CUDA)


def test_unsupported_model_type_is_refused(monkeypatch):
    _fake_liger(monkeypatch, {"llama": lambda **kw: None})
    with pytest.raises(ValueError, match=r"no kernels for model type 'qwen2'"):
        apply_liger(_model(), CUDA)


def test_in_model_kernels_only_never_the_loss(monkeypatch):
    calls = []
    _fake_liger(monkeypatch, {"qwen2": lambda **kw: calls.append(kw)})
    model = _model()
    assert apply_liger(model, CUDA) == "qwen2"
    (kw,) = calls
    assert kw.pop("model") is model
    assert kw == LIGER_KERNELS
    assert kw["rms_norm"] and kw["swiglu"] and kw["rope"]
    assert not kw["fused_linear_cross_entropy"] and not kw["cross_entropy"]  # our own LM-head path gives log-probs


def test_liger_patched_lists_instance_forwards_from_liger():
    model = _model()
    assert liger_patched(model) == []

    def forward(self, x):
        return x

    forward.__module__ = "liger_kernel.transformers.rms_norm"
    norm = model.model.norm
    norm.forward = forward.__get__(norm)
    assert liger_patched(model) == ["model.norm"]


def test_worker_on_cpu_stops_before_training(tiny_model_path):
    from helpers import cpu_dist, make_cfg

    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    with pytest.raises(ValueError, match=r"model\.use_liger=true needs a CUDA device"):
        ActorRolloutRefWorker(make_cfg("model.use_liger=true"), cpu_dist())


def test_critic_decoder_stack_gets_the_kernels(monkeypatch, tiny_model_path):
    """``model.use_liger`` reaches the critic: Liger patches the causal LM whose decoder stack becomes the value model's
    backbone (a stand-in patch that marks the final norm, as Liger's instance patch replaces its forward)."""
    from hybrid_rl.workers.critic import build_value_model

    seen = []

    def apply_qwen2(model, **kw):
        seen.append(model)
        base = getattr(model, model.base_model_prefix)

        def forward(self, x):
            return x

        forward.__module__ = "liger_kernel.transformers.rms_norm"
        base.norm.forward = forward.__get__(base.norm)

    _fake_liger(monkeypatch, {"qwen2": apply_qwen2})
    plain = build_value_model(tiny_model_path)
    assert seen == [] and liger_patched(plain) == []
    critic = build_value_model(tiny_model_path, liger_device=CUDA)
    (lm,) = seen
    assert lm.base_model is critic.backbone and liger_patched(critic) == ["backbone.norm"]
