"""``benchmarks/lora_linear.py``: the adapted-linear benchmark's CPU smoke run (plumbing only; its times mean
nothing) writes every shape's iterations, medians and ratio, and the plot; without a GPU and without
``--cpu-smoke`` it stops with one line."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from helpers import ROOT, subprocess_env


def test_cpu_smoke_writes_each_shape_s_times(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/lora_linear.py", "--cpu-smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "lora_linear_cpux1.json").read_text())
    assert doc["device"] == "cpux1" and doc["commit"] and doc["settings"]["rank"] == 8
    assert [r["linear"] for r in doc["rows"]] == ["q_proj", "gate_proj", "down_proj"]
    for r in doc["rows"]:
        for kind in ("peft", "fused"):
            assert len(r[kind]["ms"]) == doc["settings"]["iters"]
            assert r[kind]["median_ms"] == statistics.median(r[kind]["ms"])
        assert abs(r["speedup"] - r["peft"]["median_ms"] / r["fused"]["median_ms"]) < 1e-9
    assert abs(doc["block_ms"]["fused"] - sum(r["fused"]["median_ms"] for r in doc["rows"])) < 1e-9
    assert (tmp_path / "lora_linear_cpux1.png").is_file()


def test_without_a_gpu_it_asks_for_one_in_one_line(tmp_path):
    env = subprocess_env(CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "benchmarks/lora_linear.py", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "--cpu-smoke" in proc.stderr
    assert not list(tmp_path.iterdir())
