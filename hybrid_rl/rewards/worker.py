"""A reward worker process (``pool.RewardPool``): resolve the function it was sent, then score chunks until told to stop.

It is the only module of the worker's command line, so resolving a ``module:function`` here through the registry
leaves the pool itself free of any import of the registry.
"""

from __future__ import annotations

import signal
from typing import Any, Callable

from ..lifeline import die_with_parent
from .call import describe_error, score_one
from .pool import FnRef
from .registry import get_reward_fn


def _resolve(ref: FnRef) -> Callable[[str, str], Any]:
    if ref[0] == "spec":
        return get_reward_fn(ref[1], ref[2])
    return ref[1]


def worker_main(conn, ref: FnRef) -> None:
    """A worker process's life: resolve the function, say ready, then score chunks until the parent hangs up."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        fn = _resolve(ref)
    except Exception as e:
        conn.send(("init_error", describe_error(e, 400)))
        return
    conn.send(("ready",))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for idx, response, truth, info in chunk:
            try:
                conn.send((idx, True, score_one(fn, response, truth, info)))
            except Exception as e:
                conn.send((idx, False, describe_error(e)))
