"""Python's garbage collector: its pauses timed per phase (``perf/gc_pause_s``), and ``trainer.gc_steps``."""

from __future__ import annotations

import gc
import json
import time
import weakref
from pathlib import Path

import pytest

from helpers import cpu_dist
from hybrid_rl.config import ConfigError, load_config
from hybrid_rl.telemetry.gc_pauses import StepCollection, gc_clock
from hybrid_rl.telemetry.tracking import Timer

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_successor.yaml"


class Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def cyclic_garbage() -> weakref.ref:
    return weakref.ref(Node())  # the Node is unreachable at once, kept alive by its own cycle


def test_the_clock_times_a_collection_within_the_wall_time_around_it():
    clock = gc_clock()
    assert gc_clock() is clock  # one per process
    garbage = [Node() for _ in range(20000)]  # (its allocation may set off automatic collections)
    del garbage
    s0, n0 = clock.seconds, clock.collections
    start = time.perf_counter()
    gc.collect()
    wall = time.perf_counter() - start
    assert clock.collections == n0 + 1
    assert 0 < clock.seconds - s0 <= wall


def test_a_collection_is_charged_to_the_phase_it_ran_in_and_to_the_step():
    timer = Timer()
    garbage = [Node() for _ in range(20000)]
    del garbage
    gc.disable()  # only the collection below runs inside the phases
    try:
        with timer("step"):
            with timer("gen"):
                start = time.perf_counter()
                gc.collect()
                wall = time.perf_counter() - start
            with timer("update"):
                pass
    finally:
        gc.enable()
    m = timer.gc_metrics()
    assert 0 < m["perf/gc_pause_s/gen"] <= wall
    assert m["perf/gc_pause_s/update"] == 0  # no collection ran there: 0, so that every rank logs the same keys
    assert m["perf/gc_pause_s"] >= m["perf/gc_pause_s/gen"]


def test_step_collection_holds_cyclic_garbage_until_a_due_step_ends():
    was = gc.isenabled()
    collector = StepCollection(2)
    collector.start()
    try:
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0  # what existed at start is out of later scans
        ref = cyclic_garbage()
        [Node() for _ in range(5000)]  # far past the automatic threshold: nothing collects on its own
        assert collector.after_step(1) is None  # not due
        assert ref() is not None
        seconds = collector.after_step(2)
        assert seconds is not None and seconds >= 0
        assert ref() is None
    finally:
        collector.stop()
    assert gc.isenabled() == was
    assert gc.get_freeze_count() == 0


def test_gc_steps_zero_leaves_the_collector_alone():
    collector = StepCollection(0)
    collector.start()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    ref = cyclic_garbage()
    gc.collect()
    assert ref() is None
    assert collector.after_step(1) is None
    collector.stop()
    assert gc.isenabled()


def test_a_negative_gc_steps_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"trainer\.gc_steps=-1 must be >= 0"):
        load_config(RECIPE, ["trainer.gc_steps=-1"]).validate()


def test_a_run_with_gc_steps_logs_its_collections_and_gives_the_collector_back(tmp_path):
    from hybrid_rl.trainer import Trainer

    out = tmp_path / "run"
    cfg = load_config(RECIPE, ["data.num_synthetic=32", "data.train_batch_size=4", "rollout.n=2",
                               "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_device=8",
                               "data.max_response_length=4", "trainer.total_steps=3", "trainer.test_freq=0",
                               "trainer.val_before_train=false",
                               "trainer.save_freq=-1", "trainer.logger=[jsonl]", "trainer.gc_steps=2",
                               f"trainer.output_dir={out}"]).validate()
    with Trainer(cfg, cpu_dist()) as trainer:
        history = trainer.fit()
        assert gc.isenabled() and gc.get_freeze_count() == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] == [h["step"] for h in history]
    assert ["timing/gc" in r for r in rows] == [False, True, False]  # after every 2nd step only
    assert 0 <= rows[1]["timing/gc"] <= rows[1]["timing/iteration"]
    assert all(r["perf/gc_pause_s"] == 0 for r in rows)  # no automatic collection ran inside a step
