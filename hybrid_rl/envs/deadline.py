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
