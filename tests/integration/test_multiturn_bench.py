"""``benchmarks/multiturn.py --cpu-smoke``: the tool-use benchmark's three runs and its summary, on CPU.

The runs are the tiny model's for a few steps (their figures mean nothing); what is checked is that each run
finished, the JSON holds every run's curves and the comparison the README quotes, and the plot was written.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import ROOT, subprocess_env


@pytest.mark.slow
def test_cpu_smoke_writes_the_summary(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "benchmarks/multiturn.py", "--cpu-smoke", "--out", str(out)], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    (path,) = out.glob("multiturn_*.json")
    result = json.loads(path.read_text())
    assert set(result["runs"]) == {"tool", "no_tool", "single_forced"}
    tool, base = result["runs"]["tool"], result["runs"]["no_tool"]
    assert tool["steps_run"] == 4 and base["steps_run"] == 4 and result["runs"]["single_forced"]["steps_run"] == 2
    assert [c["step"] for c in tool["curve"]] == [0, 2, 4]  # validation before training and every 2 steps
    assert "env/called_frac" in tool["per_step"][0] and "env/called_frac" not in base["per_step"][0]
    c = result["comparison"]
    assert c["gen_tokens_per_s_multi"] > 0 and c["gen_tokens_per_s_single_same_length"] > 0
    assert result["settings"]["forced_length"] >= 1 and "logprob_diff_mean" in tool
    assert path.with_suffix(".png").is_file()
    line = json.loads(proc.stdout.splitlines()[-2])
    assert line["benchmark"] == "multiturn" and line["commit"] == result["commit"]


@pytest.mark.slow
def test_a_run_stopped_by_its_time_limit_goes_on_with_resume(tmp_path):
    """A command's ``--run-timeout`` stops the tool run (SIGTERM); ``--resume`` in the same ``--out`` runs it to its
    end, and the record keeps both commands and the sum of their wall times."""
    out = tmp_path / "bench"
    base = [sys.executable, "benchmarks/multiturn.py", "--cpu-smoke", "--runs", "tool", "--out", str(out)]
    cut = subprocess.run([*base, "--run-timeout", "2"], cwd=ROOT, env=subprocess_env(), capture_output=True,
                         text=True, timeout=300)
    assert cut.returncode == 1 and "runs that did not finish: tool" in cut.stderr
    first = json.loads((out / "runs.json").read_text())["tool"]
    assert first["rc"] == "timeout" and "trainer.resume=never" in first["command"]
    done = subprocess.run([*base, "--resume", "--run-timeout", "600"], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-2000:]
    record = json.loads((out / "runs.json").read_text())["tool"]
    assert record["rc"] == 0 and len(record["commands"]) == 2 and "trainer.resume=auto" in record["commands"][1]
    assert record["wall_s"] > first["wall_s"]
    (path,) = out.glob("multiturn_*.json")
    tool = json.loads(path.read_text())["runs"]["tool"]
    assert tool["steps_run"] == 4 and tool["steps_planned"] == 4


def test_wilson_interval_and_planned_steps():
    sys.path.insert(0, str(ROOT))
    from benchmarks.multiturn import planned_steps, wilson

    # 1,000 of 1,000: the lower end is n / (n + z²) (the score interval at p = 1), here 1000 / 1003.8416
    low, high = wilson(1.0, 1000)
    assert high == 1.0 and abs(low - 1000 / (1000 + 1.96 ** 2)) < 1e-12
    # 0 of 1,000 mirrors it
    low, high = wilson(0.0, 1000)
    assert low == 0.0 and abs(high - 1.96 ** 2 / (1000 + 1.96 ** 2)) < 1e-12
    # 50 of 100: the textbook interval [0.404, 0.596]
    low, high = wilson(0.5, 100)
    assert (round(low, 3), round(high, 3)) == (0.404, 0.596)
    assert planned_steps("-m hybrid_rl train r.yaml trainer.total_steps=200 x=1 trainer.total_steps=100") == 100
    assert planned_steps("-m hybrid_rl train r.yaml") is None
