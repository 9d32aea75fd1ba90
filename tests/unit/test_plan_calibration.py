"""``benchmarks/plan_calibration.py`` reads each row's measured peak, GPUs and card from the result file it names."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import plan_calibration as pc  # noqa: E402


def test_measured_figures_come_from_the_result_files(tmp_path, capsys):
    """Changed figures in copies of the curated files change the table's measured column, and nothing else; a file
    that is missing is one row saying so."""
    name = "update_step_H100x1_qwen2.5-1.5b-random"
    doc = json.loads((pc.RESULTS / f"{name}.json").read_text())
    for c in doc["configs"]:
        if c["config"] == "packed+fused":
            c["peak_memory_allocated_gb"] = 12.34
    (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    flagship = json.loads((pc.RESULTS / "flagship_H200x4.json").read_text())
    flagship["runs"]["076941d"]["per_step"]["perf/engine_pool_gb"] = [1.0, 2.5]
    (tmp_path / "flagship_H200x4.json").write_text(json.dumps(flagship))
    shutil.copy(pc.RESULTS / "update_step_H200x4_qwen2.5-1.5b-random.json", tmp_path)
    pc.main(tmp_path)
    lines = capsys.readouterr().out.splitlines()[1:]
    rows = {(line[:40].strip(), line[41:81].strip()): line[81:].split() for line in lines}
    assert rows[(name, "packed+fused")][0] == "12.3"
    assert rows[("flagship_H200x4 (076941d)", "engine pool")][0] == "2.5"  # the most any step logged
    assert rows[(name, "padded, unfused")][0] == "44.6"
    assert rows[("flagship_H100x1 (cba16b7)", "trainer peak, padded, unfused")][0] == "-"  # not copied: missing
