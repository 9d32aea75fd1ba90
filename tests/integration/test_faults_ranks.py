"""A dead or hung rank ends the whole run in bounded time with a message that names what failed, instead of the
other ranks waiting in a collective (torch's default: 30 minutes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["data.num_synthetic=256", "data.train_batch_size=16", "rollout.n=8", "actor.ppo_mini_batch_size=8",
         "actor.ppo_micro_batch_size_per_device=32", "trainer.logger=[jsonl]", "trainer.test_freq=0",
         "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.total_steps=500"]


def _rank_process(launcher: subprocess.Popen, rank: int, deadline: float):
    while time.monotonic() < deadline:
        assert launcher.poll() is None, launcher.stderr.read()[-3000:]
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank) and "hybrid_rl" in " ".join(child.cmdline()):
                    return child
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never started")


def _run_and_hurt(tmp_path: Path, hurt, *overrides: str) -> tuple[int, str, float]:
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = subprocess.Popen([sys.executable, "-m", "hybrid_rl", "train", "--nproc", "2", "recipes/cpu_successor.yaml",
                                 *SMALL, f"trainer.output_dir={out}", *overrides], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    victim = _rank_process(launcher, 1, deadline)
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert launcher.poll() is None and time.monotonic() < deadline, "the run did not reach step 2"
        time.sleep(0.2)
    hurt(victim)
    hurt_at = time.monotonic()
    try:
        _, err = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in psutil.Process().children(recursive=True):  # a stopped rank must not outlive the test
            p.kill()
    return launcher.returncode, err, time.monotonic() - hurt_at


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_and_is_named(tmp_path):
    rc, err, took = _run_and_hurt(tmp_path, lambda p: p.send_signal(signal.SIGKILL))
    assert rc != 0 and took < 90, (rc, took, err[-3000:])
    assert "rank      : 1" in err and "Signal 9 (SIGKILL)" in err, err[-3000:]


@pytest.mark.slow
def test_a_hung_rank_ends_the_run_after_the_collective_timeout(tmp_path):
    rc, err, took = _run_and_hurt(tmp_path, lambda p: p.send_signal(signal.SIGSTOP), "trainer.collective_timeout_s=10")
    assert rc != 0 and took < 120, (rc, took, err[-3000:])
    lines = [l for l in err.splitlines() if "trainer.collective_timeout_s=10" in l]
    assert lines and "hung or dead" in lines[0], err[-3000:]
