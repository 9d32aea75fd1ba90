"""SIGTERM / SIGINT stop a run cleanly: the step finishes, a checkpoint is written, one line says where, the exit
code is 128 + the signal, and resuming continues exactly as after a periodic checkpoint. The same signal twice
stops at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "recipes/cpu_successor.yaml"
SMALL = ["data.num_synthetic=256", "data.train_batch_size=16", "rollout.n=8", "actor.ppo_mini_batch_size=8",
         "actor.ppo_micro_batch_size_per_device=64", "trainer.logger=[jsonl]", "trainer.test_freq=0",
         "trainer.val_before_train=false", "trainer.save_freq=100"]
STABLE = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]


def _cmd(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "hybrid_rl", "train", RECIPE, *SMALL, f"trainer.output_dir={out}", *overrides]


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _start_and_signal(out: Path, sig: int, *overrides: str, twice: bool = False) -> tuple[subprocess.Popen, str]:
    """Start a long run, wait for 2 logged steps, send ``sig`` (twice: again at once); returns the process and stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(_cmd(out, "trainer.total_steps=200", *overrides), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while len(_rows(out)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:] if proc.poll() else "slow"
        time.sleep(0.2)
    proc.send_signal(sig)
    if twice:
        time.sleep(0.3)
        proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=120)  # bounded: one step plus a checkpoint
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc, err


@pytest.mark.slow
@pytest.mark.parametrize("mode, sig", [("sync", signal.SIGTERM), ("overlap", signal.SIGINT)])
def test_signal_checkpoints_and_resume_is_exact(tmp_path, mode, sig):
    out = tmp_path / "run"
    proc, err = _start_and_signal(out, sig, f"trainer.mode={mode}")
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    stopped = [l for l in err.splitlines() if "stopped by" in l]
    assert len(stopped) == 1 and signal.Signals(sig).name in stopped[0] and "checkpoint" in stopped[0], err[-3000:]
    step = len(_rows(out))
    assert (out / "checkpoints" / f"step_{step:08d}" / "COMPLETE").exists(), sorted(os.listdir(out / "checkpoints"))
    # resume to two steps past the stop; an uninterrupted run of that length logs the same metrics
    end = step + 2
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(_cmd(out, f"trainer.mode={mode}", f"trainer.total_steps={end}"), cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=300)
    ref = tmp_path / "ref"
    subprocess.run(_cmd(ref, f"trainer.mode={mode}", f"trainer.total_steps={end}"), cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=300)
    assert STABLE(_rows(out)) == STABLE(_rows(ref))


@pytest.mark.slow
def test_the_same_signal_twice_stops_at_once(tmp_path):
    proc, err = _start_and_signal(tmp_path / "run", signal.SIGTERM, twice=True)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, err[-2000:])


@pytest.mark.slow
def test_sigkill_of_the_launcher_ends_every_rank_and_frees_the_lock(tmp_path):
    """``kill -KILL`` of the launcher alone (``make train`` killed with its process group kills the same process):
    the ranks, which torchrun starts in a session of their own, and their children end within seconds, and a new run
    can lock the output directory."""
    import psutil

    from hybrid_rl.runlock import acquire

    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = subprocess.Popen([sys.executable, "-m", "hybrid_rl", "train", "--nproc", "1", RECIPE, *SMALL,
                                 f"trainer.output_dir={out}", "trainer.total_steps=200"], cwd=ROOT, env=env,
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    run: list = []
    try:
        deadline = time.monotonic() + 240  # idle: ~20 s to the first logged step
        while not _rows(out):
            assert launcher.poll() is None and time.monotonic() < deadline, (
                launcher.stderr.read()[-3000:] if launcher.poll() is not None else "no step within 240 s")
            time.sleep(0.2)
        run = psutil.Process(launcher.pid).children(recursive=True)
        assert any("hybrid_rl" in " ".join(p.cmdline()) for p in run), [p.cmdline() for p in run]
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        _, alive = psutil.wait_procs(run, timeout=10)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
        acquire(out).release()  # the dead rank's flock is gone: a new run takes the directory
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for p in run:  # nothing of the run may outlive the test
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        launcher.stderr.close()
