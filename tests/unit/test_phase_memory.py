"""Each phase's peak memory (``tracking.Timer`` on CUDA) and the step's peak across the Timer's counter resets.

torch's peak counters are replaced by a fake allocator here (CI has no GPU); the byte counts below are its own."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.telemetry.perf import step_perf_metrics
from hybrid_rl.telemetry.tracking import Timer

GIB = 2**30


class FakeAllocator:
    """torch.cuda's peak counters over explicit alloc/free calls (bytes)."""

    def __init__(self) -> None:
        self.now = self.peak = self.reserved_peak = 0

    def alloc(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)
        self.reserved_peak = max(self.reserved_peak, self.now + GIB)  # the cache keeps a GiB more

    def free(self, n: int) -> None:
        self.now -= n

    def reset(self, device=None) -> None:
        self.peak, self.reserved_peak = self.now, self.now + GIB


@pytest.fixture
def fake(monkeypatch):
    a = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: a.peak)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: a.reserved_peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", a.reset)
    return a


def test_each_phase_keeps_its_own_peak_and_the_step_keeps_the_largest(fake):
    fake.alloc(5 * GIB)  # validation between steps: 5 GiB at its peak, then freed
    fake.free(5 * GIB)
    timer = Timer(torch.device("cuda"))
    with timer("step"):
        with timer("gen"):
            fake.alloc(50 * GIB)
            fake.free(40 * GIB)  # 10 GiB stay (the engine's pool)
        with timer("update"):
            fake.alloc(30 * GIB)  # 40 GiB at most
            fake.free(30 * GIB)
        fake.alloc(70 * GIB)  # inside the step, outside any named phase: 80 GiB
        fake.free(70 * GIB)
    assert timer.memory_metrics() == {"perf/phase_memory_allocated_gb/gen": 50.0,
                                      "perf/phase_memory_allocated_gb/update": 40.0}
    assert timer.step_peaks == (80 * GIB, 81 * GIB)
    fake.alloc(2 * GIB)  # after the last phase boundary, before the step's metrics: 12 GiB, under the step's peak
    out = {"timing/step": 1.0, "timing/gen": 1.0, "perf/total_tokens": 1.0, "perf/response_tokens": 1.0}
    step_perf_metrics(out, world=1, gpus_all=1, flops=None, peak=None, ppo_epochs=1, device=torch.device("cuda"),
                      memory_peaks=timer.step_peaks)
    assert out["perf/max_memory_allocated_gb"] == 80.0 and out["perf/max_memory_reserved_gb"] == 81.0


def test_a_phase_run_twice_keeps_the_larger_peak_and_the_inter_step_peak_counts(fake):
    timer = Timer(torch.device("cuda"))
    fake.alloc(90 * GIB)  # before the first phase: the previous step's validation
    fake.free(90 * GIB)
    for n in (7, 3):
        with timer("reward"):
            fake.alloc(n * GIB)
            fake.free(n * GIB)
    assert timer.memory_metrics() == {"perf/phase_memory_allocated_gb/reward": 7.0}
    assert timer.step_peaks[0] == 90 * GIB


def test_off_the_gpu_nothing_is_read(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: pytest.fail("read on CPU"))
    timer = Timer(torch.device("cpu"))
    with timer("update"):
        pass
    assert timer.memory_metrics() == {} and "timing/update" in timer.times
