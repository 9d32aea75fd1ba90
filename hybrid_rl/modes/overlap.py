"""The rollout pipeline behind overlap mode: a double buffer with a staleness bound.

Two batch slots: the one the trainer is working on, and at most one being
generated in a background thread. ``start`` launches generation of the next
batch with whatever weights the engine holds (the driver pushes θ_k first);
``take`` hands over the finished batch, or generates one in the foreground
when nothing is in flight (the first step, or ``max_staleness=0``, which makes
overlap mode behave exactly like sync mode). ``check_staleness`` enforces the
bound on recorded weight versions. The thread only touches the rollout
engine, never the actor, and the driver never pushes weights while a
generation is in flight. Partial rollouts carried across the step boundary
(staleness 2) are ``partial.PartialRolloutPipeline``, a subclass. Left out:
deeper queues of whole batches (staleness > 1).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from hybrid_rl.batch import Batch


def used_here(batch: Batch) -> Batch:
    """A batch generated in the rollout thread is read on this thread's CUDA stream: tell the caching allocator, so
    that its memory is not handed to the generation stream (``rollout.cuda_stream``) while this stream still reads
    it (``Tensor.record_stream``; nothing to do on CPU or when both share one stream)."""
    for t in batch.tensors.values():
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))
    return batch


class StalenessError(RuntimeError):
    """A batch older than ``trainer.max_staleness`` reached the trainer with ``trainer.stale_policy=error``."""


class RolloutPipeline:
    def __init__(self, worker, max_staleness: int, stale_policy: str = "drop", background: bool = True,
                 trains_here: bool = True):
        """``background``: False on split placement's trainer ranks (they generate nothing). ``trains_here``: False
        on its rollout ranks, whose generation thread has the CPU cores to itself."""
        self.worker = worker
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        use_thread = max_staleness > 0 and background
        initializer = None
        if use_thread and trains_here and getattr(worker, "device", None) is not None and worker.device.type == "cpu":
            initializer = self._split_cpu_threads()
        self.executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout", initializer=initializer)
                         if use_thread else None)
        self.pending: Future | None = None
        self.dropped = 0

    @staticmethod
    def _split_cpu_threads():
        """On CPU the generation thread and the trainer share the cores: give each half of torch's intra-op threads.

        Both at full width oversubscribe the cores (2 + 2 OpenMP threads on 2 cores made a 2-core step ~2× slower
        than sync). torch's thread count is per calling thread, so the trainer keeps the larger half and the
        rollout thread sets its own when it starts.
        """
        total = torch.get_num_threads()
        gen_threads = max(1, total // 2)
        torch.set_num_threads(max(1, total - gen_threads))
        return lambda: torch.set_num_threads(gen_threads)

    def _generate(self, prompts: Batch) -> Batch:
        start = time.perf_counter()
        batch = self.worker.generate(prompts)
        batch.meta["gen_s"] = time.perf_counter() - start
        batch.meta["source_prompts"] = prompts  # kept so a stale batch can be regenerated
        return batch

    def generate_now(self, prompts: Batch) -> Batch:
        """Generate in the foreground with the engine's current weights (split placement's rollout ranks)."""
        return self._generate(prompts)

    def start_as_loaded(self, prompts: Batch) -> None:
        """Generate ``prompts`` in the background with the weights the engine holds, pushing nothing (split
        placement's rollout ranks, whose weights arrive by broadcast); ``take`` hands the batch over."""
        if self.pending is not None:
            raise RuntimeError("a rollout is already in flight; take() it first")
        self.pending = self.executor.submit(self._generate, prompts)

    def start(self, prompts: Batch) -> None:
        """Generate ``prompts`` in the background with the engine's current weights."""
        if self.executor is None:
            self._queued = prompts  # sync semantics: generated when taken, under the newest weights
            return
        if self.pending is not None:
            raise RuntimeError("a rollout is already in flight; take() it first")
        self.worker.sharding_manager.sync_weights()  # push θ_k now, while no generation is running
        self.pending = self.executor.submit(self._generate, prompts)

    def take(self, next_prompts: Callable[[], Batch]) -> Batch:
        """The next batch to train on: the one in flight, or one generated now."""
        if self.pending is not None:
            batch, self.pending = self.pending.result(), None
            return used_here(batch)
        prompts = getattr(self, "_queued", None) or next_prompts()
        self._queued = None
        with self.worker.rollout_mode():
            return self._generate(prompts)

    def peek(self) -> Batch | None:
        """The finished in-flight batch (after ``wait``), for checkpoints; None when nothing is in flight."""
        if self.pending is None:
            return None
        return self.pending.result()

    def restore(self, batch: Batch) -> None:
        """Put a checkpointed in-flight batch back, so a resumed run trains on exactly what it would have."""
        done: Future = Future()
        done.set_result(batch)
        self.pending = done

    def wait(self) -> None:
        """Block until the in-flight generation (if any) is done, keeping its result."""
        if self.pending is not None:
            self.pending.exception()

    def check_staleness(self, batch: Batch, trainer_version: int) -> Batch:
        """Enforce ``trainer_version - weight_version <= max_staleness`` for every sample."""
        oldest = int(batch.tensors["weight_version"].min())
        if trainer_version - oldest > self.max_staleness:
            if self.stale_policy == "error" or "source_prompts" not in batch.meta:
                raise StalenessError(f"batch sampled at weight version {oldest} reached the trainer at version "
                                     f"{trainer_version}, beyond trainer.max_staleness={self.max_staleness}")
            # drop it and regenerate the same prompts under the current weights
            self.dropped += 1
            with self.worker.rollout_mode():
                batch = self._generate(batch.meta["source_prompts"])
        batch.meta["trainer_version"] = trainer_version
        batch.meta["dropped_batches"] = self.dropped
        return batch

    def close(self) -> None:
        if self.executor is not None:
            self.wait()
            self.executor.shutdown(wait=True)
