"""Run diagnostics: ``trainer.profile_steps`` (torch.profiler tables with the phases labelled) and
``trainer.stall_dump_s`` (every thread's stack when the set-up or a step runs too long)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_profile_table_and_stall_dump(tiny_model_path, tmp_path):
    cmd = [sys.executable, "-m", "hybrid_rl", "train", "recipes/cpu_successor.yaml", "trainer.total_steps=2",
           "trainer.profile_steps=[2]", "trainer.stall_dump_s=0.05", f"trainer.output_dir={tmp_path}",
           "trainer.resume=never", "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.logger=[jsonl]",
           "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "actor.old_log_prob=recompute"]  # auto would skip the pass
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "profile" / "step_2_rank0.txt").read_text()
    for phase in ("phase/gen", "phase/old_log_prob", "phase/update"):
        assert phase in table
    assert table.split("\n\n")[1].startswith("host waits for the device: ")  # the sync counts head the table
    assert not (tmp_path / "profile" / "step_1_rank0.txt").exists()
    # a step longer than 0.05 s dumped the stacks, including the driver's own frame
    assert "Thread 0x" in proc.stderr and "trainer.py" in proc.stderr
    # so did the set-up (a hang in it, e.g. in vLLM's world-wide groups, shows where each rank waits)
    assert "hybrid_rl: set-up still running after" in proc.stderr and "in _build" in proc.stderr


def test_profile_phases_profile_only_the_phases_named(tmp_path, capsys):
    """``trainer.profile_phases=[update]``: a profiled step writes the update's table alone (its ops, not the other
    phase's), wherever the timer runs; an unprofiled step writes nothing; a phase that did not run is one warning."""
    from types import SimpleNamespace

    import torch

    from hybrid_rl.telemetry.perf import watched_step
    from hybrid_rl.telemetry.tracking import Timer

    cfg = SimpleNamespace(trainer=SimpleNamespace(stall_dump_s=0.0, output_dir=str(tmp_path), profile_steps=[2],
                                                  profile_phases=["update", "values"]))
    for step in (1, 2):
        timer = Timer()
        with watched_step(cfg, step, 0, torch.device("cpu")):
            with timer("gen"):
                torch.cumsum(torch.ones(64), 0)
            with timer("update"):
                torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    files = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert files == ["step_2_rank0_update.txt"]
    table = (tmp_path / "profile" / files[0]).read_text()
    assert table.startswith("step 2, rank 0, phase update") and "aten::mm" in table and "aten::cumsum" not in table
    err = capsys.readouterr().err
    assert err.count("trainer.profile_phases: values did not run in step 2") == 1 and "update did not" not in err


def test_a_phase_time_leaves_out_its_hook_exit(monkeypatch):
    """A profiled phase's time is the phase's work: writing its profile table (the hook's exit) is not counted."""
    import time
    from contextlib import contextmanager

    from hybrid_rl.telemetry import tracking

    @contextmanager
    def slow_exit():
        yield
        time.sleep(0.5)  # a table written after the phase

    monkeypatch.setitem(tracking.phase_hooks, "update", slow_exit)
    timer = tracking.Timer()
    t0 = time.perf_counter()
    with timer("update"):
        time.sleep(0.05)
    outside = time.perf_counter() - t0
    took = timer.pop()["timing/update"]
    assert outside >= 0.55 and 0.05 <= took < 0.3


def test_stall_watchdog_dumps_every_thread_while_the_block_runs_long():
    import io
    import time

    from hybrid_rl.watchdog import StallWatchdog

    out = io.StringIO()
    with StallWatchdog(0.1, label="step 7", stream=out) as dog:
        time.sleep(0.45)
    text = out.getvalue()
    assert 2 <= dog.dumps <= 5 and text.count("still running") == dog.dumps
    assert "step 7" in text and "Thread 0x" in text and "MainThread" in text
    assert "test_stall_watchdog_dumps_every_thread_while_the_block_runs_long" in text  # the main thread's own frame
    quiet = io.StringIO()
    with StallWatchdog(5.0, stream=quiet) as dog:  # a block that ends in time says nothing, and exits at once
        pass
    assert dog.dumps == 0 and quiet.getvalue() == ""


CHILD = """
import re, sys, time
sys.path.insert(0, {root!r})
from hybrid_rl.watchdog import dump_stacks_on_signal
assert dump_stacks_on_signal()
print("ready", flush=True)
def stuck_in_c():
    t = time.perf_counter()
    re.match(r"(a+)+$", "a" * 27 + "b")  # a C call that keeps the GIL for seconds
    return time.perf_counter() - t
held = stuck_in_c()
print(f"held {{held:.2f}}", flush=True)
"""


@pytest.mark.slow
def test_sigusr1_dumps_every_stack_even_while_a_c_call_holds_the_gil():
    """The split set-up hang's silent ranks sat in an NCCL split holding the GIL: StallWatchdog (a Python thread)
    cannot print then, faulthandler's signal handler can, and the process goes on afterwards."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(root=str(ROOT))], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # inside the regex by now
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    held = float(out.split()[1])
    assert held > 0.6, f"the regex held the GIL only {held:.2f} s here; the check needs a longer one"
    assert "most recent call first" in err and "stuck_in_c" in err, err[-2000:]


def test_a_stalled_benchmark_run_gets_its_ranks_stacks_before_it_is_killed():
    """benchmarks/modes.py's stall guard signals the training processes below torchrun, not torchrun itself."""
    import time

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import modes
    from bench_common import kill_tree

    launcher = ("import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1], 'hybrid_rl', 'train'])")
    child = CHILD.format(root=str(ROOT)).replace('"a" * 27', '"a" * 29')  # stays stuck past the dump
    proc = subprocess.Popen([sys.executable, "-c", launcher, child, "hybrid_rl", "train"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        assert modes._dump_rank_stacks(proc, wait_s=1.0) == 1  # the child; the launcher would die of SIGUSR1
        assert proc.poll() is None
    finally:
        kill_tree(proc)
    err = proc.stderr.read()
    assert "most recent call first" in err and "stuck_in_c" in err, err[-2000:]
