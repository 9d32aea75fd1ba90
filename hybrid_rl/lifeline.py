"""A child process that dies with its parent: a torchrun rank with the launcher, a reward worker with its rank.

A process killed with SIGKILL cannot stop its children, and torchrun starts every rank in a session of its own, so
``kill -KILL -- -<pgid>`` of ``make train`` kills ``make`` and the launcher but misses the ranks: they would train
on, holding the run's lock and the GPUs. ``die_with_parent`` asks the kernel to SIGKILL the calling process as soon as
its parent dies (Linux ``PR_SET_PDEATHSIG``) and, where that call is unavailable, starts a daemon thread that polls
the parent's pid and does the same. The rank's own children (reward workers, a vLLM engine process) die with it the
same way, and the kernel drops the flock of ``run.lock`` with the dead rank.

``PR_SET_PDEATHSIG`` fires when the *thread* that started the child ends; torchrun's agent starts the ranks from its
main thread, which lives as long as the launcher. Left out: a graceful stop (SIGTERM and a checkpoint) when the
parent is gone: no one is left to report it, and a step can outlast any grace.
"""

from __future__ import annotations

import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1
POLL_S = 0.5
"""How often the fallback thread looks at the parent's pid."""


def die_with_parent(parent_pid: int | None = None) -> str:
    """Make this process die (SIGKILL) when ``parent_pid`` (default: the current parent) dies; returns how:
    ``"pdeathsig"`` (the kernel's signal) or ``"watch"`` (a polling thread). A parent that is gone already ends
    this process at once."""
    parent = parent_pid if parent_pid is not None else os.getppid()
    if _set_pdeathsig():
        if os.getppid() != parent:  # the parent died before the kernel was asked: no signal will come
            _die()
        return "pdeathsig"
    watch_parent(parent)
    return "watch"


def watch_parent(parent_pid: int, poll_s: float = POLL_S) -> threading.Thread:
    """The portable fallback: a daemon thread that SIGKILLs this process once its parent is no longer ``parent_pid``
    (an orphan is re-parented to init or a subreaper)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        _die()

    thread = threading.Thread(target=watch, name="hybrid_rl-parent-watch", daemon=True)
    thread.start()
    return thread


def _set_pdeathsig() -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: no prctl
        return False


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
