"""Worker processes for user reward functions: a slow one runs in parallel, a hung call is abandoned.

``RewardPool`` keeps ``reward.num_workers`` processes for the run. The parent sends each idle worker a chunk of
(index, response, ground truth, sample info) and the worker sends back one result per call as it finishes, so the parent
knows when each call started and which sample a worker is on. A call running past ``reward.timeout_s`` is
abandoned: its worker is killed (SIGKILL; workers hold no state), the sample fails, the rest of that worker's
chunk goes back in the queue, and a fresh worker takes its place. Results are placed by index, so scores and
their order are those of scoring one sample at a time.

Each worker is a fresh interpreter (``python -c``, joined by a socket pair) that inherits the environment, the
working directory and ``sys.path``. ``fork`` would be cheaper, but the trainer is full of threads (torch's pools,
the overlap pipeline's generation thread, tensorboard, NCCL/CUDA), and a child forked while one of them holds a lock
can deadlock, or carry CUDA state it must not touch. multiprocessing's ``spawn``/``forkserver`` would re-run the
parent's main script in every worker, which a training script without an ``if __name__ == "__main__"`` guard does
not survive. So the function travels by name: a ``module:function`` or ``path/to/file.py:function`` (made
absolute) is resolved again in each worker, and a built-in or registered function is pickled by reference (which
needs it importable at module level: not a lambda). Workers ignore SIGINT/SIGTERM (the trainer decides how the run
ends) and die with their parent (``lifeline.py``). Left out: a thread pool (a hung Python call cannot be
abandoned) and batched calls of the user function.
"""

from __future__ import annotations

import collections
import math
import os
import socket
import subprocess
import sys
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Callable

FnRef = tuple  # ("spec", "module:fn" or "/abs/file.py:fn", task) or ("object", fn)
START_TIMEOUT_S = 300.0
"""A worker that has not imported the reward function after this long (a hung import) fails the batch."""


_BOOT = ("import sys; from multiprocessing.connection import Connection; c = Connection(int(sys.argv[1])); "
         "sys.path[:] = c.recv(); from hybrid_rl.rewards.worker import worker_main; worker_main(c, c.recv())")
"""A worker's whole command line (``python -c``): it imports ``hybrid_rl.rewards.worker`` by name, so this module
does not import the registry that resolves the function."""


class _Worker:
    """One worker: a fresh ``python -c`` joined to this process by a socket pair (its only channel)."""

    def __init__(self, ref: FnRef):
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                     stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(list(sys.path))
        self.conn.send(ref)
        self.ready = False
        self.born = time.monotonic()
        self.items: collections.deque[int] = collections.deque()  # indices sent, not yet answered; [0] is running
        self.started = 0.0  # when items[0] began
        self.warned = 0  # stall messages printed for items[0]

    def exit_code(self) -> int | None:
        try:
            return self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.conn.close()


def _stop_all(workers: list) -> None:
    for w in workers:
        try:
            w.kill()
        except Exception:
            pass
    workers.clear()


class PoolFailure(Exception):
    """A sample that failed in a worker: (index, what happened); the caller words it."""

    def __init__(self, index: int, detail: str, timed_out: bool):
        super().__init__(detail)
        self.index, self.detail, self.timed_out = index, detail, timed_out


class RewardPool:
    """``num_workers`` worker processes scoring with the function ``ref`` names; started on first use."""

    def __init__(self, ref: FnRef, num_workers: int):
        self.ref = ref
        self.num_workers = num_workers
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def close(self) -> None:
        _stop_all(self._workers)

    def _start(self) -> _Worker:
        w = _Worker(self.ref)
        self._workers.append(w)
        return w

    def _abandon(self, w, pending) -> int:
        """The item ``w`` was working on (returned); the rest of its chunk goes back to ``pending``; ``w`` is replaced."""
        idx = w.items.popleft()
        pending.extendleft(reversed(w.items))
        w.items.clear()
        self._replace(w)
        return idx

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers.remove(w)
        self._start()

    def score(self, responses: list[str], truths: list[str], timeout_s: float, on_failure: Callable[[PoolFailure], None],
              on_stall: Callable[[int, float, int, int], None], stall_s: float,
              infos: list[tuple] | None = None) -> list[float]:
        """Scores by index. A failed sample (exception, non-number, timeout, dead worker) goes to ``on_failure``,
        which raises (the pool is then stopped) or returns (the sample scores 0). ``on_stall(index, seconds, done,
        total)`` is called every ``stall_s`` seconds that one call keeps running. ``infos``: each sample's
        ``(data_source, extra_info JSON)`` (``call.call_reward``)."""
        n = len(responses)
        scores = [0.0] * n
        if n == 0:
            return scores
        while len(self._workers) < self.num_workers:
            self._start()
        chunk = max(1, min(64, math.ceil(n / (4 * self.num_workers))))
        pending = collections.deque(range(n))
        done = 0
        try:
            while done < n:
                now = time.monotonic()
                for w in self._workers:
                    if w.ready and not w.items and pending:
                        ids = [pending.popleft() for _ in range(min(chunk, len(pending)))]
                        w.conn.send([(i, responses[i], truths[i], infos[i] if infos is not None else None)
                                     for i in ids])
                        w.items.extend(ids)
                        w.started, w.warned = now, 0
                wake = [now + 1.0]
                for w in self._workers:
                    if w.items:
                        if timeout_s > 0:
                            wake.append(w.started + timeout_s)
                        wake.append(w.started + stall_s * (1 + w.warned))
                ready = wait([w.conn for w in self._workers], timeout=max(0.0, min(wake) - now))
                for w in [w for w in self._workers if w.conn in ready]:
                    try:
                        while w.conn.poll():
                            msg = w.conn.recv()
                            if msg[0] == "ready":
                                w.ready = True
                            elif msg[0] == "init_error":
                                raise WorkerInitError(msg[1])
                            else:
                                idx, ok, value = msg
                                w.items.popleft()
                                w.started, w.warned = time.monotonic(), 0
                                done += 1
                                if ok:
                                    scores[idx] = value
                                else:
                                    on_failure(PoolFailure(idx, value, timed_out=False))
                    except (EOFError, OSError):  # the worker died (its own os._exit, the OOM killer, ...)
                        code = w.exit_code()
                        if not w.ready:
                            raise WorkerInitError(f"the worker process exited while starting (exit code {code})")
                        if w.items:
                            idx = self._abandon(w, pending)
                            done += 1
                            on_failure(PoolFailure(idx, f"the worker process died (exit code {code})", timed_out=False))
                        else:
                            self._replace(w)
                now = time.monotonic()
                for w in list(self._workers):
                    if not w.ready and now - w.born > START_TIMEOUT_S:
                        raise WorkerInitError(f"the worker process did not load it within {START_TIMEOUT_S:g} s")
                    if not w.items:
                        continue
                    running = now - w.started
                    if timeout_s > 0 and running >= timeout_s:
                        idx = self._abandon(w, pending)
                        done += 1
                        on_failure(PoolFailure(idx, f"no result within reward.timeout_s={timeout_s:g}", timed_out=True))
                    elif running >= stall_s * (1 + w.warned):
                        w.warned += 1
                        on_stall(w.items[0], running, done, n)
        except BaseException:
            self.close()  # workers may be mid-chunk: the next call starts fresh ones
            raise
        return scores


class WorkerInitError(Exception):
    """A worker could not load the reward function (the message says why)."""


def worker_count(requested: int) -> int:
    """``reward.num_workers=-1``: min(8, the CPUs this rank may use: its affinity set shared by the node's ranks)."""
    if requested >= 0:
        return requested
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    per_rank = cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(8, per_rank))
