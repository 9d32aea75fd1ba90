"""Python's cyclic garbage collector: the time it stops the process for, and when it may run.

The trainer shares one interpreter with an in-process vLLM engine, whose loop allocates Python objects for every
decoded token; each time the allocations cross the collector's threshold, a collection scans every tracked object
that is not frozen, holding the GIL, while the GPU waits for the next launch. ``gc_clock`` counts those pauses
(``gc.callbacks``), and the phase timers report them per phase (``perf/gc_pause_s/<phase>``, ``Timer.gc_metrics``).

``StepCollection`` is ``trainer.gc_steps``: the collector off while steps run, and one collection between steps,
after every N-th, with everything built at set-up frozen out of its scans (``gc.freeze``). Every rank collects at the
same point of the loop, so a pause no longer delays one rank inside a collective. Reference counting still frees
every object that is not part of a cycle at once; what waits for the step's end is cyclic garbage only.
"""

from __future__ import annotations

import gc
import threading
import time


class GcClock:
    """Seconds and number of collections of the cyclic collector since the clock was installed (all threads)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._started: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:  # "stop": collections neither nest nor overlap (the GIL is held throughout)
            self.seconds += time.perf_counter() - self._started
            self.collections += 1
            self._started = None


_clock: GcClock | None = None
_install_lock = threading.Lock()


def gc_clock() -> GcClock:
    """The process's clock, installed in ``gc.callbacks`` on first use."""
    global _clock
    with _install_lock:
        if _clock is None:
            _clock = GcClock()
            gc.callbacks.append(_clock._callback)
        return _clock


class StepCollection:
    """``trainer.gc_steps``: ``every`` > 0 turns the automatic collector off between ``start`` and ``stop`` and
    collects in ``after_step``, after every ``every``-th step; 0 leaves Python's automatic collection as it is."""

    def __init__(self, every: int) -> None:
        if every < 0:
            raise ValueError(f"gc_steps must be >= 0, got {every}")
        self.every = every
        self._was_enabled = True  # set by start
        self.active = False

    def start(self) -> None:
        """Collect what set-up left, freeze the survivors (the models, the engine, the data) out of later scans, and
        turn the automatic collector off."""
        if self.every == 0 or self.active:
            return
        self._was_enabled = gc.isenabled()
        gc.collect()
        gc.freeze()
        gc.disable()
        self.active = True

    def after_step(self, step: int) -> float | None:
        """After step ``step``: a full collection when it is due; returns its seconds (None when none ran)."""
        if not self.active or step % self.every:
            return None
        start = time.perf_counter()
        gc.collect()
        return time.perf_counter() - start

    def stop(self) -> None:
        """The collector back as it was before ``start``, what was frozen scanned again (collectable once it dies)."""
        if self.active:
            self.active = False
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
