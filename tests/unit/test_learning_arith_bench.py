"""benchmarks/learning_arith.py on finished runs (``--collect``): the test split's name from each run's resolved
config, the first step and time at +N points, and each mode's final accuracy paired per question with sync's and with
the mean of the two sync seeds. Expected values are worked out here from the fabricated scores."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import learning_arith  # noqa: E402


def _run(out: Path, mode: str, curve: list[float], final: list[float], split: str | None) -> None:
    """A finished run: validations at steps 0, 10, 20 with ``curve`` accuracies (10 s of loop per step) and the last
    one's per-question scores; ``split=None`` writes a config from before ``data.arith.split`` existed."""
    run = out / mode
    (run / "validation").mkdir(parents=True)
    rows = []
    for step in range(21):
        r = {"step": step}
        if step:
            r.update({"reward/mean": 0.5, "timing/iteration": 10.0, "rollout/is_truncated_frac": 0.01})
        if step % 10 == 0:
            r["val/reward_mean"] = curve[step // 10]
        rows.append(r)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "validation" / "step_00000020_rank0.jsonl").write_text(
        "".join(json.dumps({"index": i, "score": s}) + "\n" for i, s in enumerate(final)))
    arith = {"families": ["add"], "digits": 2} if split is None else {"families": ["add"], "split": split}
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"arith": arith}}))


def test_collect_records_the_split_the_gain_and_the_pairing(tmp_path, monkeypatch):
    seed0 = [1, 1, 0, 0, 1, 0, 1, 1]
    seed1 = [1, 0, 0, 1, 1, 0, 1, 1]
    over = [1, 1, 0, 0, 0, 0, 1, 0]
    _run(tmp_path, "sync", [0.2, 0.45, 0.625], seed0, "canonical")
    _run(tmp_path, "sync_seed1", [0.2, 0.55, 0.625], seed1, "canonical")
    _run(tmp_path, "overlap", [0.2, 0.3, 0.375], over, "canonical")
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["learning_arith.py", "--collect", str(tmp_path), "--modes",
                                      "sync,sync_seed1,overlap", "--json", str(out), "--n-test", "8"])
    assert learning_arith.main() == 0
    res = json.loads(out.read_text())
    assert res["split"] == "canonical" and all(m["split"] == "canonical" for m in res["modes"].values())
    # +30 points over 0.2: sync at step 20 (200 s of loop), seed 1 at step 10 (100 s), overlap never
    assert res["modes"]["sync"]["gain"] == {"points": 30.0, "step": 20, "wall_s": 200.0}
    assert res["modes"]["sync_seed1"]["gain"] == {"points": 30.0, "step": 10, "wall_s": 100.0}
    assert res["modes"]["overlap"]["gain"] == {"points": 30.0, "step": None, "wall_s": None}
    # per question, overlap minus the seeds' mean: 0, .5, 0, -.5, -1, 0, 0, -1 -> mean -0.25
    d = [0, 0.5, 0, -0.5, -1, 0, 0, -1]
    mean = sum(d) / 8
    err = math.sqrt(sum((x - mean) ** 2 for x in d) / 7 / 8)
    p = res["modes"]["overlap"]["vs_sync_seeds_mean"]
    assert math.isclose(p["diff"], -0.25) and math.isclose(p["se"], err)
    assert p["within_2se"] == (0.25 <= 2 * err) and (p["gained"], p["lost"]) == (1, 3)
    # against sync seed 0 alone: overlap lost questions 4 and 7 -> -2/8
    assert math.isclose(res["modes"]["overlap"]["vs_sync"]["diff"], -0.25)
    assert "vs_sync_seeds_mean" not in res["modes"]["sync_seed1"]
    assert out.with_suffix(".png").is_file()


def test_runs_from_before_the_split_key_are_labelled_ordered(tmp_path, monkeypatch):
    _run(tmp_path, "sync", [0.2, 0.3, 0.4], [1, 0], None)
    _run(tmp_path, "overlap", [0.2, 0.3, 0.4], [1, 0], "canonical")
    assert learning_arith.arith_split(tmp_path / "sync") == "ordered"
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["learning_arith.py", "--collect", str(tmp_path), "--modes", "sync,overlap",
                                      "--json", str(out), "--n-test", "2"])
    assert learning_arith.main() == 0
    assert json.loads(out.read_text())["split"] == ["canonical", "ordered"]  # mixed: not comparable


def test_a_run_cut_short_is_paired_at_the_step_it_reached(tmp_path, monkeypatch):
    """overlap stops after step 10 of 20: it is compared with sync's step-10 scores, not sync's final ones, and the
    JSON says it was cut; its own run.json (written beside its folder's logs) supplies the planned steps."""
    at10 = [1, 0, 0, 1]
    _run(tmp_path, "sync", [0.2, 0.5, 0.75], [1, 1, 1, 0], "canonical")
    (tmp_path / "sync" / "validation" / "step_00000010_rank0.jsonl").write_text(
        "".join(json.dumps({"index": i, "score": s}) + "\n" for i, s in enumerate(at10)))
    run = tmp_path / "overlap"
    (run / "validation").mkdir(parents=True)
    rows = [{"step": 0, "val/reward_mean": 0.2}] + [{"step": s, "reward/mean": 0.5, "timing/iteration": 10.0}
                                                     for s in range(1, 11)]
    rows[-1]["val/reward_mean"] = 0.25
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "validation" / "step_00000010_rank0.jsonl").write_text(
        "".join(json.dumps({"index": i, "score": s}) + "\n" for i, s in enumerate([0, 0, 0, 1])))
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"arith": {"split": "canonical"}}}))
    (run / "run.json").write_text(json.dumps({"rc": "timeout", "wall_s": 99.0, "command": "x", "steps_planned": 20,
                                              "host": "h1"}))
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["learning_arith.py", "--collect", str(tmp_path), "--modes", "sync,overlap",
                                      "--json", str(out), "--n-test", "4", "--note", "two machines", "--steps", "20"])
    assert learning_arith.main() == 0
    res = json.loads(out.read_text())
    o = res["modes"]["overlap"]
    # per question at step 10: overlap 0,0,0,1 minus sync 1,0,0,1 -> -1,0,0,0: mean -0.25 (not -0.5 against step 20)
    assert o["vs_sync"]["step"] == 10 and math.isclose(o["vs_sync"]["diff"], -0.25)
    assert o["steps_planned"] == 20 and o["ended"].startswith("cut after step 10 of 20")
    assert (o["rc"], o["host"]) == ("timeout", "h1") and res["note"] == "two machines"
    assert "ended" not in res["modes"]["sync"]


def test_modes_included_from_an_earlier_json_pair_through_their_stored_scores(tmp_path, monkeypatch):
    """The sync seeds are collected into one JSON and their folders removed; overlap, collected later with that JSON
    included, is paired per question with them as if all three had been collected together (the first test's
    hand-worked figures), and the included modes say where they came from."""
    first, later = tmp_path / "first", tmp_path / "later"
    _run(first, "sync", [0.2, 0.45, 0.625], [1, 1, 0, 0, 1, 0, 1, 1], "canonical")
    _run(first, "sync_seed1", [0.2, 0.55, 0.625], [1, 0, 0, 1, 1, 0, 1, 1], "canonical")
    earlier = tmp_path / "earlier.json"
    monkeypatch.setattr(sys, "argv", ["learning_arith.py", "--collect", str(first), "--modes", "sync,sync_seed1",
                                      "--json", str(earlier), "--n-test", "8"])
    assert learning_arith.main() == 0
    assert json.loads(earlier.read_text())["modes"]["sync"]["scores"] == {"20": "11001011"}
    for run in first.iterdir():
        for f in sorted(run.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
    _run(later, "overlap", [0.2, 0.3, 0.375], [1, 1, 0, 0, 0, 0, 1, 0], "canonical")
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["learning_arith.py", "--collect", str(later), "--modes",
                                      "sync,sync_seed1,overlap", "--include", str(earlier), "--json", str(out),
                                      "--n-test", "8"])
    assert learning_arith.main() == 0
    res = json.loads(out.read_text())
    assert list(res["modes"]) == ["sync", "sync_seed1", "overlap"]
    assert res["modes"]["sync"]["included_from"]["json"] == "earlier.json"
    assert "included_from" not in res["modes"]["overlap"]
    p = res["modes"]["overlap"]["vs_sync_seeds_mean"]
    d = [0, 0.5, 0, -0.5, -1, 0, 0, -1]
    err = math.sqrt(sum((x + 0.25) ** 2 for x in d) / 7 / 8)
    assert math.isclose(p["diff"], -0.25) and math.isclose(p["se"], err) and (p["gained"], p["lost"]) == (1, 3)
    s1 = res["modes"]["sync_seed1"]["vs_sync"]  # seed 1 vs seed 0: question 1 lost, question 3 gained
    assert s1["diff"] == 0 and (s1["gained"], s1["lost"]) == (1, 1)


def test_scores_are_stored_with_gaps_marked_and_not_paired_across_splits(tmp_path, monkeypatch):
    assert learning_arith.encode_scores({0: 1.0, 2: 0.0, 3: 1.0}) == "1-01"
    assert learning_arith.decode_scores("1-01") == {0: 1.0, 2: 0.0, 3: 1.0}
    assert learning_arith.encode_scores({0: 0.5, 1: 1.0}) == [0.5, 1.0]
    _run(tmp_path, "sync", [0.2, 0.3, 0.4], [1, 0], "canonical")
    _run(tmp_path, "overlap", [0.2, 0.3, 0.4], [1, 1], "ordered")
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["learning_arith.py", "--collect", str(tmp_path), "--modes", "sync,overlap",
                                      "--json", str(out), "--n-test", "2"])
    assert learning_arith.main() == 0
    assert "vs_sync" not in json.loads(out.read_text())["modes"]["overlap"]  # index 1 is not the same problem


def test_concurrent_runs_overlap_in_time_and_name_each_other(tmp_path, monkeypatch):
    """--concurrent starts every mode's run, --stagger seconds apart, while the others still run; each run's record
    and its summary name the modes it shared the GPUs with."""
    import subprocess
    import time

    spans = {}
    real_popen = subprocess.Popen

    def fake_popen(cmd, **kw):  # a run that takes 1.5 s and logs one finished step
        run = Path(next(c for c in cmd if c.startswith("trainer.output_dir=")).split("=", 1)[1])
        spans[run.name] = [time.time()]
        row = json.dumps({"step": 1, "reward/mean": 0.5, "timing/iteration": 1.5, "val/reward_mean": 0.5})
        code = f"import time, pathlib; time.sleep(1.5); pathlib.Path({str(run / 'metrics.jsonl')!r}).write_text({row!r} + '\\n')"
        return real_popen([sys.executable, "-c", code], **kw)

    monkeypatch.setattr(learning_arith.subprocess, "Popen", fake_popen)
    out = tmp_path / "runs"
    monkeypatch.setattr(sys, "argv", ["learning_arith.py", "--modes", "sync_seed1,overlap_partial_geo_mask",
                                      "--concurrent", "--stagger", "0.5", "--steps", "1", "--out", str(out),
                                      "--device", "cpux1", "--json", str(tmp_path / "r.json"), "--n-test", "8"])
    assert learning_arith.main() == 0
    metas = {m: json.loads((out / m / "run.json").read_text()) for m in ("sync_seed1", "overlap_partial_geo_mask")}
    assert metas["sync_seed1"]["ran_beside"] == ["overlap_partial_geo_mask"]
    assert metas["overlap_partial_geo_mask"]["ran_beside"] == ["sync_seed1"]
    # the second started half a second after the first, while the first (1.5 s) was still running
    gap = spans["overlap_partial_geo_mask"][0] - spans["sync_seed1"][0]
    assert 0.4 <= gap < 1.4
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["modes"]["sync_seed1"]["ran_beside"] == ["overlap_partial_geo_mask"]
    assert "not comparable" in res["modes"]["overlap_partial_geo_mask"]["timing_note"]


def test_an_included_mode_without_scores_keeps_its_earlier_pairing_and_gets_medians(tmp_path, monkeypatch):
    """A mode from a JSON written before per-question scores were stored cannot be paired here: its earlier pairing is
    kept as ``vs_*_at_source`` beside the sync accuracies it was computed against; its step, generation and update
    medians are worked out from its stored steps."""
    earlier = tmp_path / "earlier.json"
    steps = [{"step": s, "timing/step": t, "timing/gen": g} for s, t, g in ((1, 1.0, 0.2), (2, 3.0, 0.6),
                                                                           (3, 2.0, 0.4), (4, 9.0, 0.5))]
    old = {"acc_after": 0.5, "acc_before": 0.2, "step_after": 20, "split": "canonical", "per_step": steps,
           "curve": [{"step": 20, "wall_s": 15.0, "acc": 0.5}], "gain": None, "steps_run": 20, "train_wall_s": 15.0,
           "mean_step_s": 3.75,
           "vs_sync_seeds_mean": {"diff": 0.01, "se": 0.02}, "vs_sync": None}
    earlier.write_text(json.dumps({"commit": "abc", "device": "H200x1", "modes": {
        "overlap": old, "sync": {"acc_after": 0.6}, "sync_seed1": {"acc_after": 0.62}}}))
    later = tmp_path / "later"
    _run(later, "sync", [0.2, 0.45, 0.625], [1, 1, 0, 0, 1, 0, 1, 1], "canonical")
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["learning_arith.py", "--collect", str(later), "--modes", "sync,overlap",
                                      "--include", str(earlier), "--json", str(out), "--n-test", "8"])
    assert learning_arith.main() == 0
    o = json.loads(out.read_text())["modes"]["overlap"]
    assert o["vs_sync_seeds_mean_at_source"] == {"diff": 0.01, "se": 0.02} and "vs_sync_at_source" not in o
    assert o["source_sync_acc_after"] == {"sync": 0.6, "sync_seed1": 0.62}
    assert o["vs_sync"] is None  # nothing to pair here: no scores
    assert o["median_step_s"] == 2.5 and math.isclose(o["median_gen_s"], 0.45) and "median_update_s" not in o


def test_a_negative_stagger_is_refused_in_one_line():
    import subprocess

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "learning_arith.py"), "--concurrent", "--stagger",
                          "-1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--stagger -1" in out.stderr.strip().splitlines()[-1]
