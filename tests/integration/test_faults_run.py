"""Faults around a run: two runs on one output directory, a reward function that hangs.

The lock tests build tiny in-process Trainers of the CPU recipe (no step is trained); the reward tests score a
few strings through ``RewardScorer`` with user functions written to a file, in worker processes. Seconds each.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import cpu_dist
from hybrid_rl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_successor.yaml"
SMALL = ["data.num_synthetic=16", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
         "actor.ppo_micro_batch_size_per_device=16", "trainer.logger=[jsonl]", "trainer.total_steps=1",
         "trainer.test_freq=0", "trainer.val_before_train=false"]


def _cfg(out: Path, *overrides: str):
    return load_config(RECIPE, [*SMALL, f"trainer.output_dir={out}", *overrides]).validate()


# -- item 4: one run per trainer.output_dir -------------------------------------------------------------------
def test_second_run_on_the_same_output_dir_refuses_while_the_first_holds_it(tmp_path):
    from hybrid_rl.runlock import RunLockError
    from hybrid_rl.trainer import Trainer

    out = tmp_path / "run"
    first = Trainer(_cfg(out), cpu_dist())
    written = sorted(p.name for p in out.iterdir())
    with pytest.raises(RunLockError) as e:
        Trainer(_cfg(out, "trainer.seed=1"), cpu_dist())
    msg = str(e.value)
    assert "\n" not in msg
    for part in (f"trainer.output_dir={str(out)!r} is in use by another run", f"pid {os.getpid()}",
                 f"host {socket.gethostname()}", "started ", "command: ", "another trainer.output_dir",
                 f"kill {os.getpid()}"):
        assert part in msg, (part, msg)
    assert sorted(p.name for p in out.iterdir()) == written  # the refused run wrote nothing
    first.close()  # what the end of fit does: the directory is free again, with no stale description
    assert (out / "run.lock").read_text() == ""
    Trainer(_cfg(out, "trainer.seed=1"), cpu_dist()).close()


def test_lock_held_by_another_process_names_it(tmp_path):
    from hybrid_rl.runlock import RunLockError, acquire

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from hybrid_rl.runlock import acquire; "
                               "lock = acquire(sys.argv[1]); print('locked', flush=True); time.sleep(60)", str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockError, match=rf"pid {holder.pid} on host .* \(kill {holder.pid}\)"):
            acquire(tmp_path)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_stale_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path, capsys):
    """A run killed with SIGKILL leaves its description but no flock holder: the next run warns and goes on."""
    from hybrid_rl.trainer import Trainer

    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from hybrid_rl.runlock import acquire; "
                               "lock = acquire(sys.argv[1]); print('locked', flush=True); time.sleep(60)", str(out)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert holder.stdout.readline().strip() == "locked"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    holder.stdout.close()
    stale = json.loads((out / "run.lock").read_text())
    assert stale["pid"] == holder.pid  # the dead run's description is still there
    trainer = Trainer(_cfg(out), cpu_dist())
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if line.startswith("warning:") and "locked by a run that is gone" in line]
    assert len(warning) == 1, err
    assert f"pid {holder.pid} on host {socket.gethostname()}" in warning[0] and "taken over" in warning[0]
    assert json.loads((out / "run.lock").read_text())["pid"] == os.getpid()
    trainer.close()


# -- item 5: a reward function that hangs or is slow ----------------------------------------------------------
REWARDS = '''
import time

def hang(response, ground_truth):
    if response == "hang":
        time.sleep(30)
    return float(response == ground_truth)

def slow(response, ground_truth):
    time.sleep(0.02)
    return len(response) / 7 + (response == ground_truth)

def hang_all(response, ground_truth):
    time.sleep(30)
    return 1.0

def hang_once(response, ground_truth):  # the first call of the run hangs, every other one scores 1
    import os
    flag = __file__ + ".hung"
    if not os.path.exists(flag):
        open(flag, "w").close()
        time.sleep(30)
    return 1.0
'''


@pytest.fixture
def reward_file(tmp_path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def test_hanging_reward_fails_within_the_timeout_with_one_line(reward_file):
    from hybrid_rl.rewards import RewardError, RewardScorer

    cfg = load_config(RECIPE, [f"reward.function={reward_file}:hang", "reward.timeout_s=1"]).validate()
    scorer = RewardScorer.from_config(cfg.reward, cfg.data.task)  # num_workers=-1: a user function gets workers
    assert scorer.pool is not None
    start = time.monotonic()
    try:
        with pytest.raises(RewardError) as e:
            scorer.score(["1", "hang", "3"], ["1", "2", "3"])
    finally:
        scorer.close()
    assert time.monotonic() - start < 10  # worker start-up + 1 s, not 30 s
    msg = str(e.value)
    assert "\n" not in msg
    for part in (f"reward.function='{reward_file}:hang'", "did not return within reward.timeout_s=1", "on sample 1", "response='hang'",
                 "ground_truth='2'", "raise reward.timeout_s", "reward.on_error=zero"):
        assert part in msg, (part, msg)


def test_hanging_reward_scores_zero_and_is_counted_with_on_error_zero(reward_file, capsys, monkeypatch):
    from hybrid_rl.rewards import RewardScorer, registry

    monkeypatch.setattr(registry, "STALL_S", 0.5)
    scorer = RewardScorer(f"{reward_file}:hang", "successor", on_error="zero", timeout_s=1.5, num_workers=2)
    start = time.monotonic()
    try:
        scores, failed = scorer.score(["1", "hang", "3", "x", "5"], ["1", "2", "3", "4", "5"])
        assert (scores, failed) == ([1.0, 0.0, 1.0, 0.0, 1.0], 1)
        assert scorer.score(["7"], ["7"]) == ([1.0], 0)  # the killed worker was replaced
    finally:
        scorer.close()
    assert time.monotonic() - start < 10
    stall = [line for line in capsys.readouterr().err.splitlines() if "has been running for" in line]
    assert stall and "on sample 1 (response='hang', ground_truth='2'" in stall[0], stall
    assert "reward.timeout_s=1.5 abandons it" in stall[0]


def test_hanging_reward_in_a_run_stops_it_or_is_counted(reward_file, tmp_path):
    """In a real step: on_error=raise ends fit within seconds and frees the directory; on_error=zero logs the
    abandoned call as reward/errors and trains on."""
    from hybrid_rl.rewards import RewardError
    from hybrid_rl.trainer import Trainer

    out = tmp_path / "run"
    trainer = Trainer(_cfg(out, f"reward.function={reward_file}:hang_all", "reward.timeout_s=1", "reward.num_workers=1",
                           "trainer.save_freq=-1"), cpu_dist())
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"did not return within reward\.timeout_s=1 on sample 0 "):
        trainer.fit()
    assert time.monotonic() - start < 20
    rows = Trainer(_cfg(out, f"reward.function={reward_file}:hang_once", "reward.timeout_s=1", "reward.on_error=zero",
                        "reward.num_workers=1", "trainer.save_freq=-1"), cpu_dist()).fit()
    assert rows[0]["reward/errors"] == 1.0 and rows[0]["reward/mean"] == 15 / 16


def test_slow_reward_in_workers_scores_exactly_as_in_process(reward_file):
    from hybrid_rl.rewards import RewardScorer, get_reward_fn, score_responses

    responses = [f"r{i}" * (i % 5) for i in range(30)]
    truths = [f"r{i}" * (i % 3) for i in range(30)]
    expected, _ = score_responses(get_reward_fn(f"{reward_file}:slow", "successor"), responses, truths)
    serial = RewardScorer(f"{reward_file}:slow", "successor", num_workers=0)
    pooled = RewardScorer(f"{reward_file}:slow", "successor", num_workers=2)
    assert serial.pool is None and pooled.pool is not None
    try:
        assert serial.score(responses, truths) == (expected, 0)
        assert pooled.score(responses, truths) == (expected, 0)  # same floats, same order
        assert pooled.score(responses[::-1], truths[::-1]) == (expected[::-1], 0)
    finally:
        pooled.close()


def test_builtin_rewards_stay_in_process_and_slow_in_process_calls_are_reported(reward_file, capsys, monkeypatch):
    from hybrid_rl.rewards import RewardScorer, registry

    assert RewardScorer("auto", "gsm8k").pool is None  # microseconds per sample: no pool round trip
    monkeypatch.setattr(registry, "STALL_S", 0.2)
    slow_fn = lambda r, g: time.sleep(0.5) or 1.0  # noqa: E731
    assert registry.score_responses(slow_fn, ["a", "b"], ["x", "y"]) == ([1.0, 1.0], 0)
    stall = [line for line in capsys.readouterr().err.splitlines() if "has been running for" in line]
    assert any("on sample 0 (response='a'" in line for line in stall), stall
    assert "no time limit" in stall[0] and "reward.num_workers=0" in stall[0]


@pytest.mark.parametrize("override, message", [("reward.timeout_s=-1", r"reward\.timeout_s=-1\.?0? must be >= 0 seconds"),
                                               ("reward.num_workers=-2", r"reward\.num_workers=-2 must be -1 \(auto\)")])
def test_bad_reward_pool_settings_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RECIPE, [override]).validate()


def test_a_refused_run_removes_only_what_it_created(tmp_path):
    """release(discard=True), what a run refused during set-up calls: the lock file and the directories acquire made
    go; a directory that was there before, its files, and a lock file of an earlier run stay."""
    from hybrid_rl.runlock import LOCK_NAME, acquire

    fresh = tmp_path / "a" / "b" / "run"
    acquire(fresh).release(discard=True)
    assert list(tmp_path.iterdir()) == []
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    acquire(kept / "run").release(discard=True)
    acquire(kept).release(discard=True)
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"] and (kept / "notes.txt").read_text() == "mine"
    earlier = tmp_path / "earlier"
    acquire(earlier).release()  # a run that ended: its directory and empty lock file stay
    acquire(earlier).release(discard=True)
    assert (earlier / LOCK_NAME).read_text() == ""
    written = tmp_path / "written" / "run"  # something else was written there after the lock: the directory stays
    lock = acquire(written)
    (written / "metrics.jsonl").write_text("")
    lock.release(discard=True)
    assert sorted(p.name for p in written.iterdir()) == ["metrics.jsonl"]


def test_a_run_refused_during_set_up_leaves_no_output_dir(tmp_path):
    from hybrid_rl.data.tasks import DataError
    from hybrid_rl.trainer import Trainer

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1?"}\n')
    out = tmp_path / "new" / "run"
    with pytest.raises(DataError, match="data.train_path="):
        Trainer(_cfg(out, f"data.train_path={bad}", "data.task=gsm8k", "data.val_path=null"), cpu_dist())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_a_run_that_fails_in_a_step_closes_its_bar_and_files(tmp_path, capsys):
    """The progress bar ends on a line of its own before the error propagates (the line printed next is not the bar's
    tail), and the metric files are closed on that path too (no ResourceWarning at exit)."""
    import gc
    import warnings

    from hybrid_rl.rewards import RewardError
    from hybrid_rl.trainer import Trainer

    raising = tmp_path / "raising.py"
    raising.write_text("def score(response, ground_truth):\n    raise ZeroDivisionError('boom')\n")
    trainer = Trainer(_cfg(tmp_path / "run", f"reward.function={raising}:score", "reward.num_workers=0",
                           "trainer.logger=[console,jsonl,tensorboard]"), cpu_dist())
    bar, jsonl, tb = trainer.tracker.bar, trainer.tracker.jsonl, trainer.tracker.tb
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with pytest.raises(RewardError, match="ZeroDivisionError"):
            trainer.fit()
        assert bar.disable and jsonl.closed and tb.all_writers is None
        del trainer, bar, jsonl, tb
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
    assert capsys.readouterr().err.endswith("\n")  # the bar's line is finished: what is printed next starts a line
