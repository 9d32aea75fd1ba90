"""``benchmarks/scale_7b.py``: its runs and their settings, where it may write, and (slow) its CPU smoke run end to end:
every run trains, sequence parallelism is on where named, and each phase's planner figure sits beside the run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from helpers import ROOT, subprocess_env

sys.path.insert(0, str(ROOT / "benchmarks"))
import scale_7b  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "scale_7b.py"


def test_gpu_runs_are_the_long_tail_and_three_sequence_parallel_sizes():
    args = scale_7b.parse_args(["--gpus", "8"])
    assert args.model == "builtin:qwen2.5-7b-random" and args.recipe.name == "gsm8k_grpo_7b.yaml"
    assert scale_7b.runs(args) == [
        ("mean8k_sp1", ["rollout.forced_lengths=lognormal:8192:0.8"]),
        ("fixed16k_sp1", ["rollout.forced_lengths=fixed:16384", "actor.ulysses_sequence_parallel_size=1"]),
        ("fixed16k_sp2", ["rollout.forced_lengths=fixed:16384", "actor.ulysses_sequence_parallel_size=2"]),
        ("fixed16k_sp4", ["rollout.forced_lengths=fixed:16384", "actor.ulysses_sequence_parallel_size=4"])]
    base = scale_7b.base_overrides(args)
    # the recipe's 512-token prompts + the 16,384 cap: the budget holds one whole sequence
    assert "data.max_response_length=16384" in base and "actor.max_token_len_per_device=16896" in base
    assert "data.train_batch_size=32" in base and "actor.ppo_mini_batch_size=8" in base  # 4 mini-batches, as the recipe


def test_every_gpu_run_is_a_config_the_planner_and_the_trainer_accept():
    args = scale_7b.parse_args(["--gpus", "8"])
    base = scale_7b.base_overrides(args)
    for name, ovr in scale_7b.runs(args):
        plan = scale_7b.predicted(args, [*base, *ovr], 79.2)  # validates the config on 8 ranks first
        assert plan["verdict"].startswith("fits"), (name, plan["verdict"])
        assert plan["engine_share_gib"] == pytest.approx(0.5 * 79.2)


def test_one_gpu_gets_an_engine_of_one_gpu_and_no_sequence_parallel_split():
    args = scale_7b.parse_args(["--gpus", "1", "--mean", "2048", "--tag", "lora64", "model.lora.rank=64"])
    assert [n for n, _ in scale_7b.runs(args)] == ["mean2k_sp1_lora64", "fixed16k_sp1_lora64"]
    assert scale_7b.runs(args)[0][1] == ["rollout.forced_lengths=lognormal:2048:0.8"]
    base = scale_7b.base_overrides(args)
    assert "rollout.vllm.tensor_parallel_size=1" in base and base[-1] == "model.lora.rank=64"  # the user's last
    # the same 4 prompts per GPU as 32 on 8: one sample group per mini-batch, 4 of them
    assert "data.train_batch_size=4" in base and "actor.ppo_mini_batch_size=1" in base
    assert "data.train_batch_size=12" in scale_7b.base_overrides(scale_7b.parse_args(["--gpus", "1", "--prompts", "12"]))
    for name, ovr in scale_7b.runs(args):  # the trainer accepts each on one rank
        scale_7b.predicted(args, [*base, *ovr], 139.8)
    # the recipe's 2 where the GPUs allow it; else the largest size below it that divides them
    assert [scale_7b.engine_tp(2, g) for g in (1, 2, 3, 4, 8)] == [1, 2, 1, 2, 2]
    assert not any("tensor_parallel_size" in o for o in scale_7b.base_overrides(scale_7b.parse_args(["--gpus", "4"])))


def test_runs_are_picked_by_their_name_with_or_without_the_tag():
    args = scale_7b.parse_args(["--gpus", "1", "--mean", "2048", "--tag", "lora64", "model.lora.rank=64"])
    every = scale_7b.runs(args)
    for names in (["mean2k_sp1"], ["mean2k_sp1_lora64"]):
        todo, unknown = scale_7b.selected(every, names, "lora64")
        assert [n for n, _ in todo] == ["mean2k_sp1_lora64"] and not unknown
    assert scale_7b.selected(every, [], "lora64")[0] == every
    assert scale_7b.selected(every, ["mean8k_sp1"], "lora64") == ([], {"mean8k_sp1"})
    plain = scale_7b.runs(scale_7b.parse_args(["--gpus", "1"]))
    assert scale_7b.selected(plain, ["mean8k_sp1_lora64"], "")[1] == {"mean8k_sp1_lora64"}


def _step(step_s: float, switch: float, mfu_lp: float) -> dict:
    return {"timing/step": step_s, "timing/gen": step_s / 2, "timing/switch": switch, "perf/mfu_log_prob": mfu_lp,
            "perf/tokens_per_s": 100.0, "rollout/response_length_mean": 10.0}


def test_summarize_reads_the_runs_again_from_their_directories(tmp_path, capsys):
    """``--summarize``: the measured steps (after the recorded warm-up) of each run's ``metrics.jsonl``, every one of
    them in ``per_step``, the switch and log-prob MFU averaged over them; the recorded settings stay; a directory
    whose steps do not give the recorded step time is refused in one line."""
    rows = [_step(9.0, 5.0, 0.1), _step(4.0, 0.2, 0.4), _step(6.0, 0.4, 0.5), {"val/score": 1.0}]
    (tmp_path / "run_a").mkdir()
    (tmp_path / "run_a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = {"mode": "a", "overrides": ["x=1"], "commit": "abc", "prompts": 4, "warmup": 1, "measured_steps": 2,
           "step_s": 5.0, "wall_s": 30.0, "gpu_busy_fraction": 0.5, "planner": {"p": 1}}
    failed = {"mode": "b", "overrides": [], "error": "exit 1"}
    path = tmp_path / "scale_7b_H200x1.json"
    path.write_text(json.dumps({"model": "m", "device": "H200x1", "n": 8, "runs": [run, failed]}))
    scale_7b.summarize_again(path)
    got = json.loads(path.read_text())["runs"]
    assert got[1] == failed
    a = got[0]
    assert a["switch_s"] == pytest.approx((0.2 + 0.4) / 2) and a["mfu_log_prob"] == pytest.approx((0.4 + 0.5) / 2)
    assert [r["timing/step"] for r in a["per_step"]] == [4.0, 6.0]
    assert a["commit"] == "abc" and a["planner"] == {"p": 1} and a["step_s"] == 5.0
    run["step_s"] = 7.0
    path.write_text(json.dumps({"model": "m", "device": "H200x1", "n": 8, "runs": [run]}))
    with pytest.raises(SystemExit, match="give 5.000 s a step, the JSON says 7.000"):
        scale_7b.summarize_again(path)
    assert scale_7b.main(["--summarize", str(tmp_path / "missing.json")]) == 2
    assert "error: --summarize" in capsys.readouterr().err


def test_merge_adds_the_runs_a_result_lacks_and_keeps_its_own(tmp_path, capsys):
    """``--merge``: another result's runs of other names join the JSON (their settings and commits as recorded), a run
    of a name the JSON holds stays the JSON's own, and a result of another model is refused in one line."""
    def doc(model, runs):
        return {"bench": "scale_7b", "model": model, "device": "H200x1", "commit": "new", "n": 8, "runs": runs}

    mine = {"mode": "full", "overrides": ["f=1"], "commit": "new", "error": "kept"}
    theirs = [{"mode": "full", "overrides": [], "commit": "old", "error": "older"},
              {"mode": "lora", "overrides": ["r=64"], "commit": "old", "error": "x"}]
    path, other = tmp_path / "a" / "scale_7b_H200x1.json", tmp_path / "b.json"
    path.parent.mkdir()
    path.write_text(json.dumps(doc("m", [mine])))
    other.write_text(json.dumps(doc("m", theirs)))
    assert scale_7b.main(["--summarize", str(path), "--merge", str(other)]) == 0
    got = json.loads(path.read_text())
    assert got["runs"] == [mine, theirs[1]] and got["commit"] == "new"
    other.write_text(json.dumps(doc("m2", theirs)))
    assert scale_7b.main(["--summarize", str(path), "--merge", str(other)]) == 2
    assert "has model 'm2'" in capsys.readouterr().err and json.loads(path.read_text()) == got


@pytest.mark.parametrize("argv, message", [(["--mean", "20000"], "--mean=20000"), (["--tag", "a/b"], "--tag='a/b'")])
def test_bad_mean_or_tag_is_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        scale_7b.parse_args(["--gpus", "1", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_runs_of_several_commands_share_one_json(tmp_path):
    path = tmp_path / "scale_7b_H200x1.json"
    assert scale_7b.merged(path, [{"mode": "a", "x": 1}], "m") == [{"mode": "a", "x": 1}]  # nothing there yet
    path.write_text(json.dumps({"model": "m", "runs": [{"mode": "a", "x": 1}, {"mode": "b", "x": 2}]}))
    assert scale_7b.merged(path, [{"mode": "b", "x": 3}, {"mode": "c", "x": 4}], "m") == [
        {"mode": "a", "x": 1}, {"mode": "b", "x": 3}, {"mode": "c", "x": 4}]
    assert scale_7b.merged(path, [{"mode": "c"}], "another model") == [{"mode": "c"}]
    # so another model's runs get a file of their own
    seven = scale_7b.GPU["model"]
    assert scale_7b.result_stem("H200x1", seven, seven) == "scale_7b_H200x1"
    assert scale_7b.result_stem("H200x1", "builtin:qwen2.5-1.5b-random", seven) == "scale_7b_H200x1_qwen2.5-1.5b-random"
    assert scale_7b.result_stem("H200x1", "/data/Qwen2.5-0.5B", seven) == "scale_7b_H200x1_Qwen2.5-0.5B"


def test_refuses_to_write_among_the_curated_results():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(ROOT / "benchmarks" / "results")],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "curated" in proc.stderr and "benchmarks/publish.py" in proc.stderr


@pytest.mark.slow
def test_cpu_smoke_runs_every_run_and_reports_the_planner_beside_it(tmp_path):
    results = ROOT / "benchmarks" / "results"
    before = {str(p): p.stat().st_mtime for p in results.rglob("*")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path)], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "scale_7b_cpux2.json").read_text())
    assert (tmp_path / "scale_7b_cpux2.png").stat().st_size > 0
    assert [r["mode"] for r in doc["runs"]] == ["mean16_sp1", "fixed32_sp2"]
    for r in doc["runs"]:
        assert r["steps_measured"] == 1 and r["step_s"] > 0 and r["phases_s"]["update"] > 0
        assert set(r["memory"]) == {"gen", "old_log_prob", "ref", "update"}
        assert all(m["predicted_gib"] > 0 for m in r["memory"].values())
        assert r["planner"]["verdict"].startswith("fits")
        # each training pass logged its largest micro-batch, and the planner at it is at most its worst case
        for phase in ("old_log_prob", "update"):
            m = r["memory"][phase]
            assert 0 < m["micro_batch_tokens"] <= 16384
            assert 0 < m["predicted_at_run_micro_batches_gib"] <= m["predicted_gib"]
    fixed = doc["runs"][1]
    assert fixed["response_length_mean"] == 32  # every response forced to the cap
    ran = yaml.safe_load((tmp_path / "run_fixed32_sp2" / "config.yaml").read_text())
    assert ran["actor"]["ulysses_sequence_parallel_size"] == 2 and ran["model"]["path"] == "builtin:tiny-qwen2"
    assert {str(p): p.stat().st_mtime for p in results.rglob("*")} == before
