"""The offload memory benchmark (``benchmarks/offload_memory.py``): its CPU smoke run end to end, and its counting.

The smoke run builds the real worker twice (offload off, then on) with the tiny model on CPU, updates
once, and measures inside ``rollout_mode()``. On CPU the offload target is the training device itself,
so only the plumbing and the offload flags are checked here; the GPU numbers come from the GPU run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "offload_memory.py"


@pytest.fixture(scope="module")
def om():
    spec = importlib.util.spec_from_file_location("offload_memory", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_cpu_smoke_reports_both_modes(tiny_model_path, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert json.loads((tmp_path / "offload_memory_CPU_tiny-qwen2.json").read_text()) == record
    assert record["device"] == "CPU" and record["world_size"] == 1 and record["engine"] == "hf"
    off, on = record["modes"]["off"][0], record["modes"]["on"][0]
    assert off["offloaded"] == {"params": False, "optimizer": False}
    assert on["offloaded"] == {"params": True, "optimizer": True}  # the sharding manager offloaded on entry
    # params + AdamW exp_avg/exp_avg_sq in fp32 (+ AdamW's scalar steps): the update really ran; no gradients (its
    # optimizer step freed them), which would add another 4 bytes a parameter
    assert off["params"] == 80896 and 3 * 80896 * 4 <= off["actor_state_bytes"] < 4 * 80896 * 4
    assert off["engine_bytes"] >= 80896 * 4 and off["generated_tokens"] == on["generated_tokens"] == 4 * 2 * 6
    assert off["worker_freed"] and on["worker_freed"]
    assert record["actor_state_bytes"] == {"off": off["actor_state_bytes"], "on": on["actor_state_bytes"]}
    # no GPU: nothing to read, no verdict
    assert record["training_side_bytes"] == {"off": None, "on": None} and record["ratio"] is None
    assert record["meets_target"] is None and record["target"] == 0.10


def test_storage_bytes_counts_each_storage_once_on_the_device(om):
    base = torch.zeros(10)
    tied = torch.nn.Parameter(torch.zeros(3, 4))
    elsewhere = torch.zeros(100, device="meta")
    got = om.storage_bytes([base, base[2:5], base.view(2, 5), tied, tied, None, elsewhere, torch.zeros(0)],
                           torch.device("cpu"))
    assert got == 10 * 4 + 12 * 4


def test_summarize_ratio_and_verdict(om):
    def rank(training, actor):
        return dict(training_side_bytes=training, actor_state_bytes=actor, offloaded={})

    per_mode = {"off": [rank(8 * 2**30, 8 * 2**30), rank(9 * 2**30, 8 * 2**30)],
                "on": [rank(2**28, 0), rank(2**27, 0)]}
    s = om.summarize(per_mode, on_gpu=True)
    assert s["training_side_bytes"] == {"off": 9 * 2**30, "on": 2**28}  # the largest rank
    assert s["ratio"] == round(2**28 / (9 * 2**30), 4) and s["meets_target"] is True
    assert s["actor_state_ratio"] == 0.0 and s["training_side_gib"]["off"] == 9.0
    per_mode["on"][0]["training_side_bytes"] = 2 * 2**30
    assert om.summarize(per_mode, on_gpu=True)["meets_target"] is False
    assert om.summarize(per_mode, on_gpu=False)["ratio"] is None


def test_overrides_give_one_mini_batch_per_update(om):
    from hybrid_rl.config import load_config

    args = om.parse_args(["--cpu-smoke"])
    for world in (1, 2):
        for mode in om.MODES:
            cfg = load_config(args.recipe, om.make_overrides(args, world, mode)).validate(world)
            assert cfg.rollout.name == "hf" and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size
            assert cfg.actor.param_offload == cfg.actor.optimizer_offload == (mode == "on")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_gpu_asks_for_cpu_smoke(om, capsys):
    with pytest.raises(SystemExit):
        om.parse_args([])
    assert "--cpu-smoke" in capsys.readouterr().err
