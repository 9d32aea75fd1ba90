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
