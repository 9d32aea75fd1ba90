"""Running tool and environment code with a time limit, in daemon threads.

A tool may hang (a blocking call, a loop that never ends) and an environment's ``step`` may too. Both run here in
threads of their own, so the rollout waits for each at most its limit and goes on without it: a late call is
reported as timed out and abandoned. Python cannot kill a thread, so an abandoned one keeps running; daemon threads
never keep the process from exiting, and a call that spins on the CPU is still taking a share of it. Code that may
run away belongs in a subprocess sandbox, whose limits the operating system enforces. Left out: cancelling a call
(there is no safe way to stop a Python thread) and processes (tools are plain functions of this process).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, Sequence, TypeVar

T = TypeVar("T")


@dataclass
class Outcome(Generic[T]):
    """How one call ended: its value, the exception it raised, or neither (``timed_out``)."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


def call_with_timeout(fn: Callable[[], T], timeout_s: float, name: str = "call") -> Outcome[T]:
    """``fn()`` in a daemon thread, waited for at most ``timeout_s`` seconds (≤ 0: no limit)."""
    box: list[Outcome] = []

    def run() -> None:
        try:
            box.append(Outcome(value=fn()))
        except BaseException as e:  # a tool's SystemExit or KeyboardInterrupt must not end the rollout thread either
            box.append(Outcome(error=e))

    thread = threading.Thread(target=run, name=f"hybrid_rl-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s if timeout_s > 0 else None)
    return box[0] if box else Outcome(timed_out=True)


def run_parallel(calls: Sequence[Callable[[], T]], workers: int, deadline: float | None) -> list[Outcome[T]]:
    """Every call of ``calls`` on up to ``workers`` daemon threads; returns their outcomes in order. Calls still
    running (or not started) at ``deadline`` (a ``time.monotonic()`` value, None: none) come back ``timed_out``."""
    results: list[Outcome | None] = [None] * len(calls)
    if not calls:
        return []
    todo: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(len(calls)):
        todo.put(i)
    done = threading.Semaphore(0)
    lock = threading.Lock()
    over = threading.Event()  # past the deadline: calls not started yet are never started

    def work() -> None:
        while not over.is_set():
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                out = Outcome(value=calls[i]())
            except BaseException as e:
                out = Outcome(error=e)
            with lock:
                results[i] = out
            done.release()

    for k in range(max(1, min(workers, len(calls)))):
        threading.Thread(target=work, name=f"hybrid_rl-env-{k}", daemon=True).start()
    for _ in range(len(calls)):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0 or not done.acquire(timeout=left):
            break
    over.set()
    with lock:  # what finished by now counts; the rest is abandoned to its threads
        return [r if r is not None else Outcome(timed_out=True) for r in results]


class CallPool:
    """Calls submitted one at a time, run on up to ``workers`` daemon threads (started as calls need them), their
    outcomes collected as they end: the asynchronous agent loop's environment steps. ``close`` abandons what has not
    ended: calls not started are never started, running ones finish on their threads unheard."""

    def __init__(self, workers: int, name: str = "env"):
        self.workers, self.name = max(1, workers), name
        self._todo: queue.SimpleQueue[tuple[Any, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[Any, Outcome]] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self.pending = 0
        """Calls submitted whose outcome has not been collected."""

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            item = self._todo.get()
            with self._lock:
                self._idle -= 1
            if item is None or self._closed.is_set():
                return
            key, fn = item
            try:
                out = Outcome(value=fn())
            except BaseException as e:  # as call_with_timeout: a tool's SystemExit must not end the worker
                out = Outcome(error=e)
            if not self._closed.is_set():
                self._done.put((key, out))

    def submit(self, key: Any, fn: Callable[[], Any]) -> None:
        self.pending += 1
        with self._lock:
            # a thread more while every started one is busy with an earlier call (queued calls count as busy)
            start = self._threads < self.workers and self._idle < self._todo.qsize() + 1
            if start:
                self._threads += 1
        self._todo.put((key, fn))
        if start:
            threading.Thread(target=self._work, name=f"hybrid_rl-{self.name}-{self._threads}", daemon=True).start()

    def collect(self, timeout: float | None = 0.0) -> list[tuple[Any, Outcome]]:
        """The outcomes that ended since the last call: waits up to ``timeout`` seconds for the first (0: does not
        wait, None: waits for as long as it takes) when calls are pending, then takes whatever else is there."""
        out: list[tuple[Any, Outcome]] = []
        if self.pending and (timeout is None or timeout > 0):
            try:
                out.append(self._done.get(timeout=timeout))
            except queue.Empty:
                return []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.pending -= len(out)
        return out

    def close(self) -> None:
        self._closed.set()
        for _ in range(self._threads):
            self._todo.put(None)
