"""benchmarks/learning_smollm2.py: before/after accuracy of a run directory, paired per question when the run saved
its validation samples (trainer.validation_data_dir)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.learning_smollm2 import paired, summarise  # noqa: E402


def _run(tmp_path: Path, before: list[float], after: list[float]) -> Path:
    run = tmp_path / "run"
    (run / "validation").mkdir(parents=True)
    rows = [{"step": 0, "val/reward_mean": sum(before) / len(before)},
            {"step": 1, "timing/step": 2.0, "reward/mean": 0.1},
            {"step": 2, "timing/step": 3.0, "reward/mean": 0.2, "val/reward_mean": sum(after) / len(after)}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for step, scores in ((0, before), (2, after)):  # two ranks' files, interleaved indices, as validation writes them
        for rank in (0, 1):
            recs = [{"index": i, "score": s} for i, s in enumerate(scores) if i % 2 == rank]
            (run / "validation" / f"step_{step:08d}_rank{rank}.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in recs))
    return run


def test_paired_gain_counts_questions_gained_and_lost(tmp_path):
    before = [1, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    after = [1, 1, 1, 0, 0, 0, 0, 0, 0, 1]  # gained 1, 2, 9; lost 4
    res = summarise("sync", _run(tmp_path, before, after), n_val=10)
    assert res["gain"] == 0.2 and res["steps"] == 2
    p = res["paired"]
    assert (p["n"], p["gained"], p["lost"]) == (10, 3, 1) and p["gain"] == 0.2
    d = [a - b for a, b in zip(after, before)]  # the textbook standard error of a mean of differences (ddof 0)
    mean = sum(d) / len(d)
    assert math.isclose(p["stderr"], math.sqrt(sum((x - mean) ** 2 for x in d) / len(d) / len(d)))
    assert p["stderr"] < res["gain_stderr"]  # most answers stay put: pairing is tighter than the unpaired error


def test_no_validation_samples_no_paired_entry(tmp_path):
    run = _run(tmp_path, [1, 0], [1, 1])
    for f in (run / "validation").iterdir():
        f.unlink()
    assert "paired" not in summarise("sync", run, n_val=2)
    assert paired({}, {}) == {"n": 0, "gained": 0, "lost": 0, "gain": 0.0, "stderr": 0.0}


def test_finished_accuracy_leaves_out_answers_cut_at_the_cap_and_tag_names_the_files(tmp_path):
    """val/clipped_reward_mean (right answers cut at the length cap) comes off the accuracy as finished_accuracy; a
    --tag keeps another setting's files from overwriting these."""
    from benchmarks.learning_smollm2 import main

    run = _run(tmp_path, [1, 1, 0, 0], [1, 1, 1, 0])
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    rows[0]["val/clipped_reward_mean"], rows[2]["val/clipped_reward_mean"] = 0.25, 0.0
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = summarise("sync", run, n_val=4)
    assert res["before"]["finished_accuracy"] == 0.25 and res["after"]["finished_accuracy"] == 0.75
    assert main(["--run", f"sync={run}", "--device", "cpux1", "--tag", "overlong", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "learning_smollm2_cpux1_overlong.json").is_file()
    assert (tmp_path / "learning_smollm2_cpux1_overlong.png").is_file()


def test_paired_finished_counts_only_answers_that_ended_before_the_cap(tmp_path):
    """Records with response_length and a config with data.max_response_length: a right answer cut at the cap counts
    as wrong in paired_finished (the plain pairing keeps it); older records without lengths give no such entry."""
    run = _run(tmp_path, [1, 1, 0, 0], [1, 1, 1, 0])
    (run / "config.yaml").write_text("data:\n  max_response_length: 8\n")
    lengths = {0: {0: 8, 1: 3, 2: 8, 3: 8}, 2: {0: 3, 1: 3, 2: 5, 3: 8}}  # step -> index -> tokens
    for f in (run / "validation").iterdir():
        step = int(f.name.split("_")[1])
        recs = [json.loads(x) for x in f.read_text().splitlines()]
        f.write_text("".join(json.dumps({**r, "response_length": lengths[step][r["index"]]}) + "\n" for r in recs))
    res = summarise("sync", run, n_val=4)
    assert (res["paired"]["gained"], res["paired"]["lost"]) == (1, 0)
    # finished before: only index 1; after: 0, 1 and 2 -> two gained
    assert (res["paired_finished"]["gained"], res["paired_finished"]["lost"]) == (2, 0)
    bare = _run(tmp_path / "old", [1, 0], [1, 1])
    (bare / "config.yaml").write_text("data:\n  max_response_length: 8\n")
    assert "paired_finished" not in summarise("sync", bare, n_val=2)
