"""The crossover sweep (``benchmarks/modes_sweep.py``): its bookkeeping in-process, the process-tree
kill that ``benchmarks/modes.py`` stops runs with, and a CPU smoke run end to end: the tiny model on 2 gloo
ranks at two short lengths in sync and overlap colocated, then a second invocation (as when a sweep is cut
into parts) whose point the budget cannot hold: recorded as skipped and merged into the same file. Split placement is
left out of the smoke run to keep it near a minute (each run costs ~12 s of start-up on 2 CPU cores); its runs
are ``modes.py``'s own, which ``test_split.py`` covers, and its naming and ratios are checked in-process here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from helpers import ROOT, subprocess_env

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_common  # noqa: E402
import modes  # noqa: E402
import modes_sweep as ms  # noqa: E402

SCRIPT = ROOT / "benchmarks" / "modes_sweep.py"
REQUIRED = ("length_mean", "cap", "mode", "step_s", "gen_share", "speedup_vs_sync", "gpu_busy_fraction",
            "gpu_busy_timed", "phases_s", "steps_measured")


def test_split_ratios_and_auto_ratio():
    assert ms.parse_ratios("1:3,2:2", 4) == (False, [1, 2])
    assert ms.parse_ratios("auto,3:1", 4) == (True, [3])
    with pytest.raises(SystemExit, match="add up to the 4 GPUs"):
        ms.parse_ratios("1:2", 4)
    with pytest.raises(SystemExit, match="ROLLOUT:TRAINER"):
        ms.parse_ratios("half", 4)
    # R/W ~ the generation share balances the sides; never all or none of the GPUs
    assert [ms.auto_rollout_ranks(s, 4) for s in (0.05, 0.3, 0.5, 0.7, 0.99)] == [1, 1, 2, 3, 3]
    assert ms.split_mode(4, 2) == ("overlap_split", ["trainer.mode=overlap", "trainer.max_staleness=1",
                                                      "trainer.placement=split", "trainer.rollout_ranks=2"])
    name, ovr = ms.split_runs(4, [1], ["rollout.vllm.gpu_memory_utilization=0.6"])[0]
    assert name == "overlap_split_r1" and ovr[-2:] == ["trainer.rollout_ranks=1", "rollout.vllm.gpu_memory_utilization=0.6"]
    # --partial-aheads: one split_partial run per trainer.partial_rollout_ahead at each ratio, named for it
    runs = ms.split_runs(2, [1], [], "split_partial", ms.parse_aheads("0.25,1"))
    assert [n for n, _ in runs] == ["split_partial_a0.25", "split_partial_a1"]
    assert runs[1][1][-1] == "trainer.partial_rollout_ahead=1" and "trainer.partial_rollouts=true" in runs[1][1]
    # above 1: more steps of groups in flight, and the staleness bound they need (the last override wins)
    (name, ovr), = ms.split_runs(2, [1], [], "split_partial", [2.0])
    assert name == "split_partial_a2" and ovr[-2:] == ["trainer.partial_rollout_ahead=2", "trainer.max_staleness=3"]
    assert ms.split_runs(2, [1], [], "split_partial", []) == ms.split_runs(2, [1], [], "split_partial")
    with pytest.raises(SystemExit, match="--partial-aheads"):
        ms.parse_aheads("wide")


def test_partial_runs_start_with_the_pool_beyond_the_measured_steps():
    """A partial-rollout pool drains over a run's last pool_steps steps (no prompts beyond the end), and those steps
    run faster than the steady state: the run is started with that many steps after the measured ones, so none of
    them is measured. Other runs keep one step beyond (it generates nothing ahead)."""
    args = ms.parse_args(["--gpus", "4", "--warmup", "2", "--measure", "6", "--cpu-smoke"])
    assert (args.stop_after, args.steps) == (3, 4)  # --cpu-smoke measures one step
    for ahead, pool in ((None, 2), (1.0, 2), (2.0, 3), (3.0, 4)):
        (_, ovr), = ms.split_runs(4, [2], [], "split_partial", [ahead] if ahead else [])
        assert ms.run_steps(args, ovr) == args.stop_after + pool, ahead
    (_, plain), = ms.split_runs(4, [2], [], "overlap_split")
    assert ms.run_steps(args, plain) == args.steps
    assert ms.run_steps(args, ms.PARTIAL_MODE[1]) == args.stop_after + 2  # overlap colocated, the default ahead
    # the budget's estimate: the pool's fill, then steps at the rollout side's pace; the overlap estimate (8.2 sync
    # steps) skipped 2 + 6 steps at 4k on 4xH200 against a 321 s budget, and they took ~270 s
    args = ms.parse_args(["--gpus", "4", "--warmup", "4", "--measure", "8"])
    assert ms.steps_in_sync_steps("split_partial_a3", 4096, [], args) == pytest.approx(1.5 * 2 + 0.8 * 10)
    assert ms.steps_in_sync_steps("overlap_split", 4096, [], args) == pytest.approx(4 + 8 * 1.1)
    assert ms.Budget(total=540.0, run_timeout=0.0, init_s=60.0).why_not(
        38.1, ms.steps_in_sync_steps("split_partial_a3", 4096, [], args)) is None


def test_busy_fraction_from_timings():
    colo = {"step_s": 10.0, "phases_s": {"gen": 4.0, "reward": 1.0, "old_log_prob": 2.0, "update": 3.0}}
    assert ms.busy_from_timings(colo, ["trainer.mode=sync"], 4) == pytest.approx(0.9)  # reward runs on the host
    # split 1:3: the rollout GPU generates 8 of 10 s, the 3 trainer GPUs train 5 of 10 s
    split = {"step_s": 10.0, "rollout_ranks": 1, "phases_s": {"gen": 8.0, "wait_gen": 5.0, "update": 5.0}}
    assert ms.busy_from_timings(split, ["trainer.placement=split"], 4) == pytest.approx((8 + 3 * 5) / 40)


def test_merge_keeps_measurements_over_skips_and_derives_speedups():
    def row(mean, mode, step=None, gen=None, **kw):
        r = {"length_mean": mean, "cap": 2 * mean, "forced_lengths": f"lognormal:{mean}:0.8", "mode": mode, **kw}
        if step is None:
            return {**r, "skipped": "not started"}
        r.update(step_s=step, phases_s={"gen": gen or 0.0}, response_length_mean=mean)
        return {**r, "gen_share_own": gen / step} if mode == "sync" else r

    old = [row(256, "sync", 4.0, 1.0), row(256, "overlap_split_r1", 5.0, ratio="1:3")]
    new = [row(256, "sync"), row(256, "overlap_colocated", 3.2), row(256, "overlap_split", 3.0, ratio="2:2"),
           row(256, "overlap_stream", 2.5)]
    rows = ms.merge(old, new)
    assert [r["mode"] for r in rows] == ["sync", "overlap_colocated", "overlap_split", "overlap_stream",
                                         "overlap_split_r1"]
    assert rows[0]["step_s"] == 4.0  # the skip did not replace the measured sync run
    (p,) = ms.summarize_points(rows)
    assert p["gen_share"] == 0.25 and p["speedup"] == {"overlap_colocated": 1.25, "overlap_split": 4.0 / 3.0,
                                                       "overlap_stream": 1.6}
    assert p["best_split"] == {"mode": "overlap_split", "ratio": "2:2"} and "best_split_partial" not in p
    assert all(r["speedup_vs_sync"] == pytest.approx(4.0 / r["step_s"]) for r in rows)
    # split placement with partial rollouts: its own family, its own best ratio, never mixed into overlap_split's
    rows = ms.merge(rows, [row(256, "split_partial", 2.5, ratio="2:2"), row(256, "split_partial_r3", 2.0, ratio="3:1")])
    (p,) = ms.summarize_points(rows)
    assert p["speedup"]["split_partial"] == 2.0 and p["speedup"]["overlap_split"] == 4.0 / 3.0
    assert p["best_split_partial"] == {"mode": "split_partial_r3", "ratio": "3:1"}


def test_split_partial_runs_at_the_split_ratios_with_a_staleness_bound_of_two():
    name, ovr = ms.split_mode(4, 3, "split_partial")
    assert name == "split_partial_r3"
    assert {"trainer.placement=split", "trainer.rollout_ranks=3", "trainer.max_staleness=2",
            "trainer.partial_rollouts=true", "trainer.mode=overlap"} <= set(ovr)
    assert "trainer.max_staleness=1" not in ovr
    assert ms.split_mode(4, 2, "split_partial")[0] == "split_partial" and ms.split_mode(4, 2)[0] == "overlap_split"


def test_budget_skips_what_cannot_fit():
    b = ms.Budget(total=100.0, run_timeout=0.0, init_s=60.0)
    assert b.why_not(None, 3) is None  # nothing measured yet: run it, under the timeout
    assert b.why_not(10.0, 3) is None  # 60 + 3 x 11 fits in 100
    assert "estimated 126 s" in b.why_not(20.0, 3) and "--budget" in b.why_not(20.0, 3)
    b = ms.Budget(total=0.0, run_timeout=50.0, init_s=10.0)
    assert b.timeout() == 50.0 and "--run-timeout" in b.why_not(20.0, 3)
    rows = [{"length_mean": 256, "mode": "sync", "step_s": 4.0, "gen_share_own": 0.75}]
    assert ms.expected_step(1024, rows) == 16.0 and ms.expected_step(256, rows) == 4.0
    # only a longer point measured: scaled down by length, to a quarter at least
    longer = [{"length_mean": 4096, "mode": "sync", "step_s": 32.0}]
    assert ms.expected_step(2048, longer) == 16.0 and ms.expected_step(256, longer) == 8.0
    # an overlap run: its warm-up step is a sync step, a measured one about the longer side (+30%, at most 1.1)
    args = SimpleNamespace(warmup=1, measure=2, stop_after=3)
    assert ms.steps_in_sync_steps("sync", 256, rows, args) == 3
    assert ms.steps_in_sync_steps("overlap_split", 256, rows, args) == pytest.approx(1 + 2 * 1.3 * 0.75)
    assert ms.steps_in_sync_steps("overlap_colocated", 1024, rows, args) == pytest.approx(1 + 2 * 1.1)


def test_kill_takes_the_whole_tree_and_nothing_else(monkeypatch):
    """The benchmarks stop a run by its process tree (workers in other process groups included), not by name."""
    monkeypatch.setattr(bench_common, "time", SimpleNamespace(sleep=lambda s: None, perf_counter=time.perf_counter))
    bystander = subprocess.Popen(["sleep", "60"])
    proc = subprocess.Popen(["bash", "-c", "setsid sleep 61 & sleep 62 & wait"], start_new_session=True)
    try:
        deadline = time.time() + 10
        while len(bench_common.process_tree(proc.pid)) < 3 and time.time() < deadline:
            time.sleep(0.05)
        tree = bench_common.process_tree(proc.pid)
        assert len(tree) == 3 and bystander.pid not in tree
        bench_common.kill_tree(proc)
        time.sleep(0.2)
        for pid in tree[1:]:  # the children, reparented once bash died: gone (or zombies of init)
            try:
                state = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
            except FileNotFoundError:
                continue
            assert state in ("Z", "X"), (pid, state)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        for pid in bench_common.process_tree(proc.pid)[1:]:
            os.kill(pid, signal.SIGKILL)


def test_a_run_that_logs_no_step_is_stopped_as_hung(monkeypatch, tmp_path):
    """Seen on 4xH200: a run whose engines hung in their set-up used its whole budget (458 s). With a stall limit
    (``modes_sweep``: twice a start-up plus twice a step) it is stopped once no step has come for that long, and
    the reason says so; the stall limit grows with the point's step."""
    real_popen = subprocess.Popen
    monkeypatch.setattr(modes.subprocess, "Popen", lambda cmd, **kw: real_popen(["sleep", "60"], **kw))
    args = SimpleNamespace(gpus=1, recipe="r.yaml", model="m", steps=3, overrides=[], warmup=1, mode_timeout=None,
                           stall_timeout=2.0, stop_after=2)
    t = time.perf_counter()
    res = modes.run_mode("overlap_proc", [], args, tmp_path)
    assert time.perf_counter() - t < 15
    assert res["error"].startswith("stalled: no step logged for 2 s"), res
    b = ms.Budget(total=600.0, run_timeout=0.0, init_s=60.0)
    assert b.stall_limit(None) is None and b.stall_limit(10.0) == pytest.approx(2 * 60 + 22)
    b.note_run(100.0, [{"timing/step": 10.0}])  # a measured start-up of 90 s
    assert b.stall_limit(40.0) == pytest.approx(2 * 90 + 88)


def _sweep(tmp_path, *args: str) -> list[dict]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path), *args], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_cpu_smoke_sweep(tiny_model_path, tmp_path):
    printed = _sweep(tmp_path, "--lengths", "8,24", "--modes", "sync,overlap_colocated")
    assert [(p["length_mean"], p["mode"]) for p in printed] == [(8, "sync"), (8, "overlap_colocated"),
                                                                  (24, "sync"), (24, "overlap_colocated")]
    assert all("step_s" in p and "skipped" not in p for p in printed), [p.get("skipped") for p in printed]
    # a second part, merged into the same file: a point that cannot fit the budget is recorded as skipped, with the
    # reason, and runs nothing
    started = time.perf_counter()
    _sweep(tmp_path, "--lengths", "48", "--modes", "sync", "--budget", "30")
    assert time.perf_counter() - started < 30
    path = tmp_path / "modes_sweep_cpux2_tiny-qwen2.json"
    doc = json.loads(path.read_text())
    assert (tmp_path / "modes_sweep_cpux2_tiny-qwen2.png").stat().st_size > 0
    assert doc["device"] == "cpux2" and doc["gpus"] == 2 and doc["prompts_per_step"] == 8 and doc["commit"]
    assert set(ms.NOTES) <= set(doc["notes"])
    rows = {(r["length_mean"], r["mode"]): r for r in doc["rows"]}
    assert set(rows) == {(8, "sync"), (8, "overlap_colocated"), (24, "sync"), (24, "overlap_colocated"), (48, "sync")}
    assert "not started" in rows[48, "sync"]["skipped"] and "--budget" in rows[48, "sync"]["skipped"]
    for key, r in rows.items():
        if key == (48, "sync"):
            continue
        assert all(k in r for k in REQUIRED), (key, [k for k in REQUIRED if k not in r])
        sync = rows[r["length_mean"], "sync"]
        assert r["steps_measured"] == 1 and r["step_s"] > 0 and r["step_s_each"] == [r["step_s"]]
        assert r["speedup_vs_sync"] == pytest.approx(sync["step_s"] / r["step_s"])
        assert 0 < r["gen_share"] < 1 and r["gen_share"] == pytest.approx(sync["phases_s"]["gen"] / sync["step_s"])
        assert r["gpu_busy_fraction"] is None  # no nvidia-smi on CPU
        assert 0 < r["gpu_busy_timed"] <= 1
        assert r["cap"] == 2 * r["length_mean"] and r["response_length_mean"] <= r["cap"]
    assert rows[24, "sync"]["response_length_mean"] > rows[8, "sync"]["response_length_mean"]
    points = {p["length_mean"]: p for p in doc["points"]}
    assert points[24]["speedup"]["overlap_colocated"] == rows[24, "overlap_colocated"]["speedup_vs_sync"]
    assert points[24]["speedup"]["overlap_split"] is None and points[24]["best_split"] is None
    assert points[48]["skipped"] == {"sync": rows[48, "sync"]["skipped"]} and points[48]["gen_share"] is None
    # a later part with other settings must not mix into this file
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path), "--sigma", "0.5",
                           "--lengths", "8", "--modes", "sync"], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "--fresh" in proc.stderr and "sigma" in proc.stderr


def test_diagnostic_overrides_do_not_split_a_sweep():
    """A later part may dump stacks sooner (trainer.stall_dump_s) and still add rows to the same JSON."""
    a = {"sigma": 0.8, "overrides": ["rollout.name=vllm", "trainer.stall_dump_s=300"]}
    b = {"sigma": 0.8, "overrides": ["rollout.name=vllm", "trainer.stall_dump_s=120", "trainer.profile_steps=[2]"]}
    assert ms.comparable(a) == ms.comparable(b)
    assert ms.comparable(a) != ms.comparable({**a, "overrides": ["rollout.name=hf"]})
