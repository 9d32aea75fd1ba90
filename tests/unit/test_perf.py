"""Model FLOPs and device peaks behind ``perf/mfu_*`` (``hybrid_rl.telemetry.perf``)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybrid_rl.telemetry.perf import ModelFlops, pass_mfu, peak_flops


@pytest.mark.parametrize("tied", [True, False])
def test_model_flops_by_hand(tied):
    cfg = Qwen2Config(vocab_size=100, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(cfg)
    f = ModelFlops.of(model)
    # per layer: q (16x16 + 16) + k, v (16x8 + 8 each) + o (16x16) + MLP (3 x 16x40) + 2 norms (16 each)
    layer = (16 * 16 + 16) + 2 * (16 * 8 + 8) + 16 * 16 + 3 * 16 * 40 + 2 * 16
    assert f.body_params == 2 * layer + 16  # + the final norm; embedding and head excluded
    assert f.head_params == 100 * 16 and f.attn_width == 2 * 4 * 4
    lengths = torch.tensor([3, 5])
    pairs = 3 * 4 / 2 + 5 * 6 / 2
    assert f.forward(lengths, 4.0) == pytest.approx(2 * f.body_params * 8 + 2 * 1600 * 4 + 4 * 32 * pairs)


def test_peaks_and_pass_mfu(monkeypatch):
    assert peak_flops(torch.device("cpu")) is None and peak_flops(torch.device("cpu"), 2.0) == 2e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda", 0)) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA GH200 480GB")
    assert peak_flops(torch.device("cuda", 0)) == 989e12
    times = {"timing/update": 3.0, "timing/old_log_prob": 1.0}
    out = pass_mfu(times, forward_flops=8e12, peak=1e12, gpus=4, ppo_epochs=2)
    assert out == {"perf/mfu_update_equiv": pytest.approx(3 * 2 * 8 / (3 * 4)),
                   "perf/mfu_log_prob_equiv": pytest.approx(8 / 4)}
    assert pass_mfu(times, 8e12, None, 4) == {}
    # old_log_prob=auto ran the pass on 3 of 4 mini-batches: its FLOPs are 3/4 of the batch's
    quarter_skipped = pass_mfu(times, forward_flops=8e12, peak=1e12, gpus=4, log_prob_share=0.75)
    assert quarter_skipped["perf/mfu_log_prob_equiv"] == pytest.approx(0.75 * 8 / 4)


def test_peak_tflops_must_be_positive():
    from hybrid_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="trainer.peak_tflops"):
        load_config(None, ["trainer.peak_tflops=0"]).validate()
    assert load_config(None, ["trainer.peak_tflops=989"]).validate().trainer.peak_tflops == 989


def test_update_step_runs_liger_configurations_last():
    """Liger patches transformers' classes for the whole process: a plain configuration after it would measure Liger."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import update_step

    names = ["packed+fused+liger", "padded", "packed+fused+no_ckpt+budget16k+unsharded+shared+liger", "packed+fused"]
    assert update_step.liger_last(names) == ["padded", "packed+fused", "packed+fused+liger",
                                             "packed+fused+no_ckpt+budget16k+unsharded+shared+liger"]
    # every issue-16 row names every lever, so none depends on what the recipe ships
    for name, overrides in update_step.CONFIGS.items():
        if name.startswith(("padded", "packed")):
            keys = {o.split("=")[0] for o in overrides}
            assert {"model.enable_gradient_checkpointing", "actor.share_prompts", "model.use_liger"} <= keys, name


def test_host_wait_summary_counts_the_rows_where_the_host_waits():
    from types import SimpleNamespace as Row

    from hybrid_rl.telemetry.perf import host_wait_summary

    rows = [Row(key="cudaStreamSynchronize", count=932, cpu_time_total=2.464e6), Row(key="aten::mm", count=10,
            cpu_time_total=5e5), Row(key="aten::nonzero", count=605, cpu_time_total=2.01e6)]
    assert host_wait_summary(rows) == ("host waits for the device: cudaStreamSynchronize 932 calls 2464 ms; "
                                       "aten::nonzero 605 calls 2010 ms")
    assert host_wait_summary(rows[1:2]) == "host waits for the device: none recorded"


def test_a_profiled_block_leaves_no_profiler_events_behind(tmp_path):
    """The profiler's events form reference cycles: left to the collector, they are freed by whichever later full
    collection runs first (inside a later phase). ``profiled`` collects them once its table is written."""
    import gc
    import warnings

    from torch.autograd.profiler_util import FunctionEvent

    from hybrid_rl.telemetry.perf import profiled

    x = torch.ones(8, 8)
    gc.disable()
    try:
        with profiled(tmp_path / "p.txt", "block", cuda=False):
            for _ in range(200):
                x = x * 1.0 + 0.0
        with warnings.catch_warnings():  # isinstance on torch's deprecated module proxies warns
            warnings.simplefilter("ignore")
            alive = sum(isinstance(o, FunctionEvent) for o in gc.get_objects())
    finally:
        gc.enable()
    assert "aten::mul" in (tmp_path / "p.txt").read_text()
    assert alive == 0
