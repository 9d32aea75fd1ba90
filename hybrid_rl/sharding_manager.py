"""The hybrid switch: hand the GPU from the trainer to the rollout engine and back.

On entry the engine wakes up, and if it does not already hold the actor's
current weight version, the actor's parameters are gathered one by one,
cast to the engine dtype, grouped into buckets of ``bucket_mb`` and handed to
``engine.load_weights``; each bucket is dropped as soon as it is loaded, so
the full state dict never exists at once. On exit the engine goes to sleep
and returns its memory to training. The push is skipped when the version is
unchanged (e.g. validation right after a rollout). Timing and bytes pushed are
recorded for the driver's metrics. Left out here: LoRA-only pushes and
parameter/optimizer offload, which belong to the multi-GPU work.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator

import torch

from hybrid_rl.rollout.base import RolloutEngine


def bucketize(params: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in params:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


class ShardingManager:
    def __init__(self, iter_params: Callable[[], Iterable[tuple[str, torch.Tensor]]], engine: RolloutEngine,
                 version: Callable[[], int], bucket_mb: int = 512, free_cache_engine: bool = True, sleep_level: int = 1):
        self.iter_params = iter_params
        self.engine = engine
        self.version = version
        self.bucket_bytes = bucket_mb * 2**20
        self.free_cache_engine = free_cache_engine
        self.sleep_level = sleep_level
        self.last_sync_s = 0.0
        self.last_sync_bytes = 0
        self.num_pushes = 0

    def __enter__(self) -> RolloutEngine:
        self.engine.wake_up(["weights"])
        version = self.version()
        start = time.perf_counter()
        pushed = 0
        if self.engine.weights_version != version:
            for bucket in bucketize(self.iter_params(), self.bucket_bytes):
                self.engine.load_weights(bucket)
                pushed += sum(t.numel() * t.element_size() for _, t in bucket)
                del bucket
            self.engine.weights_version = version
            self.num_pushes += 1
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        self.last_sync_s = time.perf_counter() - start
        self.last_sync_bytes = pushed
        self.engine.wake_up(["kv_cache"])
        return self.engine

    def __exit__(self, *exc) -> None:
        if self.free_cache_engine:
            self.engine.sleep(level=self.sleep_level)
