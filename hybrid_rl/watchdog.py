"""``trainer.stall_dump_s``: print every thread's Python stack while a step runs longer than it should.

A plain Python thread that formats ``sys._current_frames()`` while holding the GIL, rather than ``faulthandler``'s
``dump_traceback_later``, whose C watchdog reads the other threads' frames without the GIL and can crash a busy
process (a SIGSEGV inside the profiler's export). The price: a step stuck in C++ code that keeps
the GIL silences this watchdog; the stalls it is for (collectives, CUDA waits, vLLM's engine loop) release it.
For those, ``dump_stacks_on_signal``: every training process prints all its threads' stacks on ``SIGUSR1``
(faulthandler, at that moment only), which is what a stall guard sends before it stops a hung run.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
import time
import traceback
from typing import TextIO


class StallWatchdog:
    """Context manager: every ``after_s`` seconds until the block ends, write all threads' stacks to ``stream``."""

    def __init__(self, after_s: float, label: str = "step", stream: TextIO | None = None):
        if after_s <= 0:
            raise ValueError(f"StallWatchdog needs after_s > 0, got {after_s}")
        self.after_s = after_s
        self.label = label
        self.stream = stream
        self.dumps = 0
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = 0.0

    def __enter__(self) -> "StallWatchdog":
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="hybrid_rl-stall-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(self.after_s):
            self.dump()

    def dump(self) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        elapsed = time.perf_counter() - self._start
        lines = [f"hybrid_rl: {self.label} still running after {elapsed:.1f} s; every thread's stack:"]
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            lines.append(f"Thread 0x{ident:016x} ({names.get(ident, '?')}) (most recent call last):")
            lines.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
        stream = self.stream or sys.stderr
        stream.write("\n".join(lines) + "\n")
        stream.flush()
        self.dumps += 1


def dump_stacks_on_signal() -> bool:
    """From now on ``kill -USR1 <pid>`` makes this process print every thread's stack to stderr and go on.

    faulthandler's C handler reads the frames without the GIL, so it also shows a thread stuck in a C call that
    holds it, where ``StallWatchdog`` stays silent: a rank waiting in an NCCL split (``split.make_layout``) prints
    only this way. Reading frames without the GIL can crash a busy process, so it runs only when asked, never on a
    timer: by hand, or by a stall guard about to kill the
    run anyway (``benchmarks/modes.py``). Returns False where there is no SIGUSR1 (Windows)."""
    if not hasattr(signal, "SIGUSR1"):
        return False
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    return True
