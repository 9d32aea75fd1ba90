"""Stop a run cleanly on SIGTERM (what a scheduler sends before it kills a job) or SIGINT (Ctrl-C).

The first signal only sets a flag: the current step finishes (its update is not cut in half, overlap mode's
background generation completes), every rank agrees on the stop at the end of the step (one all-reduce over
the whole world, so split placement's rollout and trainer ranks stop at the same step), a checkpoint is written,
one line says where it is and how to resume, and the process exits with 128 + the signal number. The same
signal again exits at once with the default action. Left out: stopping in the middle of a step (a step is the unit a
checkpoint can resume from exactly) and signals other than TERM and INT.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

import torch

from hybrid_rl.distributed import all_reduce_max

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunInterrupted(Exception):
    """The run stopped on a signal after checkpointing; the CLI prints the message and exits 128 + ``signum``."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class GracefulStop:
    """``with GracefulStop() as stop: ... if stop.agreed(device): ...``: signal handlers for the duration of a run."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():  # handlers can only be set from the main thread
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum == signum:  # the same signal again: stop now, the default way (under torchrun a Ctrl-C
            # reaches each rank as SIGINT from the terminal and SIGTERM from the agent: one stop, not two)
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.signum = signum
        if os.environ.get("RANK", "0") == "0":  # one notice per run, not one per rank
            print(f"hybrid_rl: got {signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
                  f"(send it again to stop at once)", file=sys.stderr, flush=True)

    def agreed(self, device: torch.device, group=None) -> int:
        """The signal any rank received (0: none); every rank must call this at the same point of every step.

        ``group`` (None: the default world group, on ``device``) must hold every rank. Split placement passes its
        gloo world group and the CPU (``Placement.stop_check``): a rollout rank reaches the check as soon as its next
        round is under way and waits there for the trainer ranks' update, and an NCCL all-reduce would make its
        current CUDA stream wait for them too, pausing the generation queued behind it on the GPU."""
        flag = torch.tensor([float(self.signum)], dtype=torch.float64, device=device)
        all_reduce_max(flag, group)  # over the whole world: every rank of every role stops together
        return int(flag.item())
