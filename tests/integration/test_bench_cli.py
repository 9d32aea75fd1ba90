"""``make bench`` (``benchmarks/modes.py``): what it runs by default, where it writes, and how it fails.

In-process: the default modes and their overrides, the one-line reasons (no GPU, an output folder among the
curated results, an invalid setting) and the error line picked out of a failed run's output. End to end on CPU
(``--cpu-smoke``, marked slow): a smoke run writes its table, JSON and PNG into the run directory it is given and
nothing under benchmarks/results/; a run whose modes fail exits 1 with one line per failed mode naming it, and
the log of the one whose trainer started.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, subprocess_env

sys.path.insert(0, str(ROOT / "benchmarks"))
import modes  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "modes.py"
RESULTS = ROOT / "benchmarks" / "results"


def _bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)


def _results_listing() -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in RESULTS.rglob("*")} if RESULTS.exists() else {}


def test_default_modes_are_the_recommended_ones():
    run, notes = modes.select_modes("", 4, "")
    assert [n for n, _ in run] == ["sync", "overlap_colocated", "split_partial"] and not notes
    split = dict(run)["split_partial"]
    assert {"trainer.placement=split", "trainer.mode=overlap", "trainer.partial_rollouts=true",
            "trainer.partial_rollout_ahead=3", "trainer.max_staleness=4"} <= set(split)
    assert not any(o.startswith("trainer.rollout_ranks=") for o in split)  # half and half
    # one GPU: partial rollouts colocated take split placement's place; split asked for by name is an error
    run, notes = modes.select_modes("", 1, "")
    assert [n for n, _ in run] == ["sync", "overlap_colocated", "overlap_partial"] and not notes
    partial = dict(run)["overlap_partial"]
    assert {"trainer.mode=overlap", "trainer.partial_rollouts=true", "trainer.partial_rollout_ahead=1",
            "trainer.max_staleness=2"} <= set(partial) and not any("placement" in o for o in partial)
    with pytest.raises(SystemExit, match="split_partial need"):
        modes.select_modes("sync,split_partial", 1, "")
    with pytest.raises(SystemExit, match="unknown mode.*overlap_colocted"):
        modes.select_modes("overlap_colocted", 4, "")


def test_gpu_defaults_read_the_shipped_prompts_with_vllm(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the data path does not depend on where it is called from
    args = modes.parse_args([])
    assert args.model == "builtin:qwen2.5-1.5b-random" and (args.steps, args.warmup) == (11, 3)
    assert args.overrides[0] == f"data.train_path={ROOT / 'benchmarks' / 'data' / 'gsm8k_train_1k.jsonl'}"
    assert "rollout.name=vllm" in args.overrides and args.recipe == str(ROOT / "benchmarks" / "bench_modes.yaml")
    assert sum(1 for _ in open(ROOT / "benchmarks" / "data" / "gsm8k_train_1k.jsonl")) == 1024
    # the run lengths: one step beyond the measured ones, the partial-rollout pool's steps with partial rollouts
    smoke = modes.parse_args(["--cpu-smoke"])
    assert modes.check_mode(smoke, ["trainer.mode=sync"]) == (smoke.steps + 1, None)
    steps, err = modes.check_mode(smoke, dict(modes.select_modes("", 2, "")[0])["split_partial"])
    assert err is None and steps == smoke.steps + 4  # ahead 3: a pool of max(2, ceil(1 + 3)) steps
    one = modes.parse_args(["--cpu-smoke"])
    one.gpus = 1
    steps, err = modes.check_mode(one, dict(modes.select_modes("", 1, "")[0])["overlap_partial"])
    assert err is None and steps == one.steps + 2  # ahead 1: a pool of max(2, ceil(1 + 1)) steps
    steps, err = modes.check_mode(smoke, ["trainer.mode=overlap", "trainer.max_staleness=1", "trainer.bogus=1"])
    assert steps is None and "trainer.bogus" in err and "\n" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here")
def test_cpu_only_machine_gets_one_line_and_a_nonzero_exit():
    proc = _bench("--gpus", "1", timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "needs NVIDIA GPUs and vLLM" in lines[0] and "install -e '.[vllm]'" in lines[0] and "--cpu-smoke" in lines[0]


def test_curated_results_folder_is_refused(tmp_path):
    before = _results_listing()
    with pytest.raises(SystemExit, match="curated results, written only by benchmarks/publish.py"):
        modes.main(["--cpu-smoke", "--out", str(RESULTS / "bench_test")])
    assert _results_listing() == before and not (RESULTS / "bench_test").exists()
    from bench_common import inside, run_dir

    assert inside(run_dir("bench"), ROOT / "runs" / "bench")


@pytest.mark.parametrize("log, line", [
    # a user error: the trainer's own line, not torchrun's report after it
    ("noise\nerror: model.path: './x' does not exist; fix model.path\n[W] ...\n"
     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n=====\nhybrid_rl FAILED\n  error_file: <N/A>",
     "model.path: './x' does not exist; fix model.path"),
    # a crash: the rank's exception, not the traceback or ChildFailedError
    ("[rank0]: Traceback (most recent call last):\n[rank0]:   File \"x.py\", line 1, in f\n"
     "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
     "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n==========\n  exitcode  : 1 (pid: 7)",
     "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    ("INFO loading\nERROR 01-01 12:00:00 [core.py:9] EngineCore failed to start.\nshutting down\n",
     "ERROR 01-01 12:00:00 [core.py:9] EngineCore failed to start."),
    ("", "no output"),
])
def test_error_line_of_a_failed_run(log, line):
    assert modes.error_line(log) == line


@pytest.mark.slow
def test_cpu_smoke_writes_into_its_run_dir_only(tiny_model_path, tmp_path):
    """Colocated sync and split placement with partial rollouts, the two ends of the plumbing, 2 steps each."""
    before = _results_listing()
    out = tmp_path / "bench"
    proc = _bench("--cpu-smoke", "--modes", "sync,split_partial", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout.splitlines()
    assert table[0].split()[:3] == ["mode", "step", "s"]
    assert [line.split()[0] for line in table[1:3]] == ["sync", "split_partial"]
    doc = json.loads((out / "modes_CPU_tiny-qwen2.json").read_text())
    assert [m["mode"] for m in doc["modes"]] == ["sync", "split_partial"]
    assert all(m["steps_measured"] == 1 and m["step_s"] > 0 for m in doc["modes"])
    assert doc["modes"][0]["speedup_vs_sync"] == 1.0 and doc["run_dir"] == str(out)
    assert (out / "modes_CPU_tiny-qwen2.png").stat().st_size > 0
    assert (out / "run_split_partial" / "metrics.jsonl").is_file()
    assert _results_listing() == before


@pytest.mark.slow
def test_failed_modes_exit_nonzero_with_one_line_each(tiny_model_path, tmp_path):
    """One mode whose trainer fails at start-up (a model that does not exist), one whose setting is invalid (never
    started): exit 1, and each failure is one line naming the mode; the started one's log is named."""
    out = tmp_path / "bench"
    proc = _bench("--cpu-smoke", "--modes", "sync,overlap_colocated", "--out", str(out),
                  "--mode-override", "sync:model.path=./no/such/model",
                  "--mode-override", "overlap_colocated:trainer.max_stalenes=1")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    failed = [line for line in proc.stderr.splitlines() if line.startswith("FAILED ")]
    assert len(failed) == 2, proc.stderr
    assert failed[0].startswith("FAILED sync: exit 1: model.path") and "./no/such/model" in failed[0]
    assert failed[0].endswith(f"(log: {out / 'run_sync' / 'stderr.log'})")
    assert failed[1].startswith("FAILED overlap_colocated: invalid setting: ") and "trainer.max_staleness" in failed[1]
    assert proc.stderr.strip().splitlines()[-1] == "error: 2 of 2 modes failed: sync, overlap_colocated"
    doc = json.loads((out / "modes_CPU_tiny-qwen2.json").read_text())
    assert [m["mode"] for m in doc["modes"]] == ["sync", "overlap_colocated"] and all("error" in m for m in doc["modes"])
