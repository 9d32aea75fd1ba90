"""``benchmarks/agent_loop.py``: its four runs and summary on CPU (``--cpu-smoke``: the tiny tool model for a few
steps, figures meaningless), and the simulated tool latency it adds."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from helpers import ROOT, subprocess_env


@pytest.mark.slow
def test_cpu_smoke_writes_the_summary(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "benchmarks/agent_loop.py", "--cpu-smoke", "--out", str(out)], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    (path,) = out.glob("agent_loop_*.json")
    result = json.loads(path.read_text())
    assert set(result["runs"]) == {"turns", "async", "turns_latency", "async_latency"}
    for name, run in result["runs"].items():
        assert run["rc"] == 0 and run["steps_run"] == 3 and run["gen_s_median"] > 0, name
        assert f"env.scheduler={name.split('_')[0]}" in run["command"]
    assert "env.name=tools_latency" in result["runs"]["async_latency"]["command"]
    assert result["comparison"]["gen_speedup_instant"] > 0 and result["comparison"]["gen_speedup_latency"] > 0
    assert path.with_suffix(".png").is_file()
    # --collect summarises the same runs again, naming the device and commit they ran at
    again = subprocess.run([sys.executable, "benchmarks/agent_loop.py", "--cpu-smoke", "--collect", str(out),
                            "--device", "H200x1", "--commit", "abc123", "--json", str(tmp_path / "c.json")], cwd=ROOT,
                           env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    collected = json.loads((tmp_path / "c.json").read_text())
    assert collected["device"] == "H200x1" and collected["commit"] == "abc123"
    assert collected["comparison"] == result["comparison"]
    assert all(r["steps_planned"] == 3 for r in collected["runs"].values())


def test_the_simulated_latency_has_the_asked_mean_and_repeats_slot_by_slot():
    sys.path.insert(0, str(ROOT))
    from benchmarks.agent_latency import latency_s

    draws = [latency_s(f"{i}/1/0", mean_s=0.5, sigma=1.0) for i in range(20000)]
    # the lognormal's mean is exp(mu + σ²/2) = 0.5; the sample mean's s.e. is 0.5·sqrt(e − 1)/sqrt(n) ≈ 0.0046
    assert abs(statistics.fmean(draws) - 0.5) < 0.02
    assert latency_s("7/2/0", 0.5) == latency_s("7/2/0", 0.5) != latency_s("7/2/1", 0.5)
    assert latency_s("7/2/0", mean_s=0.0) == 0.0
