"""Metric sinks: a tqdm progress bar, tensorboard scalars and ``metrics.jsonl``; plus phase timers.

Only rank 0 writes; other ranks get a tracker whose methods do nothing, so the
driver never branches on rank. Metric names are grouped as ``rollout/*``,
``actor/*``, ``reward/*``, ``timing/*``, ``perf/*``, ``val/*``. Left out:
wandb/mlflow (tensorboard files are readable by both).
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch


def rank0_print(*args: Any, rank: int = 0) -> None:
    if rank == 0:
        print(*args, file=sys.stderr, flush=True)


class Timer:
    """Named wall-clock timers: ``with timer("gen"): ...`` → ``timing/gen`` in seconds."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"phase/{name}"):  # phases show up in trainer.profile_steps tables
                yield
        finally:
            self.times[f"timing/{name}"] = self.times.get(f"timing/{name}", 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out


class Tracker:
    def __init__(self, output_dir: str, loggers: list[str], total_steps: int, enabled: bool, initial_step: int = 0):
        self.enabled = enabled
        self.out = Path(output_dir)
        self.bar = None
        self.tb = None
        self.jsonl = None
        if not enabled:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        if "console" in loggers:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True, file=sys.stderr)
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.out / "tensorboard"))
        if "jsonl" in loggers:
            self.jsonl = open(self.out / "metrics.jsonl", "a", buffering=1)  # the trainer trims it on (re)start

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.bar is not None and "reward/mean" in metrics:
            post = {"reward": f"{metrics['reward/mean']:.3f}"}
            if "perf/tokens_per_s" in metrics:
                post["tok/s"] = f"{metrics['perf/tokens_per_s']:.0f}"
            if "val/reward_mean" in metrics:
                post["val"] = f"{metrics['val/reward_mean']:.3f}"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)

    def write(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.jsonl is not None:
            self.jsonl.close()
