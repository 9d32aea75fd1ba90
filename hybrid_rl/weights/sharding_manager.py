"""The hybrid switch: hand the GPU from the trainer to the rollout engine and back.

On entry the engine wakes up, and if it does not already hold the actor's
current weight version the actor streams its weights out
(``TrainingEngine.iter_full_params``, planned by ``weights.plan``: one
all-gather per few FSDP module groups in the engine dtype, the next one in
flight while the current one loads, LoRA merged on the fly, tied duplicates
once); ``weights.buckets`` groups them into buckets of ``bucket_mb``, handed
to ``engine.load_weights``, each bucket dropped as soon as it is loaded, so
the full state dict never exists at once. Weights
that only depend on frozen parameters (with LoRA: embeddings, norms,
untargeted linears) are pushed once and skipped afterwards, for as long as the
engine keeps them (sleep level 2 discards them: the next push is full again).
With ``replay`` (config ``rollout.weight_load_replay``) each bucket goes through a
``WeightReplayer``: the first time a bucket layout arrives the engine's real
``load_weights`` runs and its copies are recorded; later pushes of the same
layout replay them with one ``torch._foreach_copy_`` and skip the engine's
Python loader (one small tensor per push still takes the real path, for the
engine's bookkeeping). A level-2 sleep drops the recordings, and so does any
sign that the engine re-allocated its weights (see ``hybrid_rl.weights.replay``).
Then the actor's parameters (+ gradients) and/or optimizer state go to CPU if
``param_offload``/``optimizer_offload`` ask for it, and the engine's KV cache
wakes. On exit the engine goes to sleep and the actor's parameters come back; its optimizer state stays on CPU
until the update brings it to the GPU (``TrainingEngine.optimizer_on_device``). The push is
skipped when the version is unchanged (e.g. validation right after a
rollout). The engine owns its version: a push opens with
``engine.begin_weight_update()`` (no known version until it completes) and
closes with ``engine.finish_weight_update(version)``. ``sync_weights()`` pushes
without waking the KV cache (overlap mode, before a background generation
starts). Timing and bytes pushed are recorded for the driver's metrics.

Left out: pushing LoRA adapters alone into an engine with native LoRA support
(the engine always receives merged, HF-named full weights) and offload while a
background generation overlaps training (offload is for the sync loop: the
actor must not train while its shards sit on CPU).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Protocol

import torch

from hybrid_rl.rollout.base import RolloutEngine
from hybrid_rl.weights.buckets import bucketize
from hybrid_rl.weights.replay import WeightReplayer


class WeightSource(Protocol):
    """What the sharding manager needs from the training side (``TrainingEngine`` implements it)."""

    def iter_full_params(self, dtype: torch.dtype | None = None, skip_static: bool = False) -> Iterator[tuple[str, torch.Tensor]]: ...

    def offload(self, params: bool = True, optimizer: bool = True) -> None: ...

    def onload(self, params: bool = True, optimizer: bool = True) -> None: ...


class ShardingManager:
    def __init__(self, source: WeightSource, engine: RolloutEngine, version: Callable[[], int],
                 dtype: torch.dtype | None = None, bucket_mb: int = 512, free_cache_engine: bool = True,
                 sleep_level: int = 1, param_offload: bool = False, optimizer_offload: bool = False,
                 replay: bool = True):
        self.source = source
        self.engine = engine
        self.version = version
        self.dtype = dtype
        self.bucket_bytes = bucket_mb * 2**20
        self.free_cache_engine = free_cache_engine
        self.sleep_level = sleep_level
        self.param_offload = param_offload
        self.optimizer_offload = optimizer_offload
        self.last_sync_s = 0.0
        self.last_switch_s = 0.0
        """Seconds of the last entry plus exit (wake, push, offload, sleep, onload): the step's switching cost."""
        self.last_sync_bytes = 0
        self.last_sync_tensors = 0
        self.last_sync_replayed = 0
        """Tensors of the last push whose load was replayed instead of going through the engine's loader."""
        self.num_pushes = 0
        self._engine_has_static = False
        # the engine's load_weights is looked up at call time, so a wrapper set on the engine later still sees loads
        self.replayer = WeightReplayer(lambda bucket: self.engine.load_weights(bucket)) if replay else None

    def invalidate(self) -> None:
        """Forget what the engine holds: the next entry pushes every weight (e.g. after loading a checkpoint)."""
        self._engine_has_static = False
        self.engine.begin_weight_update()  # no known version until the next push completes

    def push(self) -> None:
        """Bring the engine to the actor's current version (no-op when it is already there)."""
        version = self.version()
        start = time.perf_counter()
        pushed, tensors, replayed = 0, 0, 0
        if self.engine.weights_version != version:
            # The engine keeps whatever it was given unless it discarded its weights
            # (sleep level 2 clears weights_version): only then resend frozen weights.
            skip_static = self._engine_has_static and self.engine.weights_version is not None
            self.engine.begin_weight_update()  # a push that fails half-way leaves no known version
            self._engine_has_static = False
            if self.replayer is not None:
                self.replayer.begin_push()
            for i, bucket in enumerate(bucketize(self.source.iter_full_params(self.dtype, skip_static=skip_static),
                                                 self.bucket_bytes)):
                if self.replayer is not None:
                    self.replayer.load(bucket, first=i == 0)
                else:
                    self.engine.load_weights(bucket)
                pushed += sum(t.numel() * t.element_size() for _, t in bucket)
                tensors += len(bucket)
                del bucket
            replayed = self.replayer.push_replayed_tensors if self.replayer is not None else 0
            self.engine.finish_weight_update(version)
            self._engine_has_static = True
            self.num_pushes += 1
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        self.last_sync_s = time.perf_counter() - start
        self.last_sync_bytes = pushed
        self.last_sync_tensors = tensors
        self.last_sync_replayed = replayed

    def sync_weights(self) -> None:
        """Push θ now (no-op when the engine holds it) without waking the KV cache or generating.

        For an engine that stays awake between rollouts (overlap mode: θ_k goes in
        before the next background generation starts). One that sleeps between
        rollouts goes back to sleep at ``sleep_level`` afterwards, as it would on
        leaving the context.
        """
        self.engine.wake_up(["weights"])
        self.push()
        if self.free_cache_engine:
            self.engine.sleep(level=self.sleep_level)
            self._after_sleep()

    def __enter__(self) -> RolloutEngine:
        start = time.perf_counter()
        try:
            return self._enter()
        finally:
            self.last_switch_s = time.perf_counter() - start

    def _enter(self) -> RolloutEngine:
        self.engine.wake_up(["weights"])
        self.push()
        offload = self.param_offload or self.optimizer_offload
        if offload:
            self.source.offload(params=self.param_offload, optimizer=self.optimizer_offload)
        try:
            self.engine.wake_up(["kv_cache"])
        except BaseException:
            if offload:
                self.source.onload()
            raise
        return self.engine

    def __exit__(self, *exc) -> None:
        start = time.perf_counter()
        try:
            if self.free_cache_engine:
                self.engine.sleep(level=self.sleep_level)
                self._after_sleep()
        finally:
            if self.param_offload:  # the optimizer state stays offloaded until the update needs it
                self.source.onload(params=True, optimizer=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the onload's copies belong to the switch, not to the next phase
            self.last_switch_s += time.perf_counter() - start

    def _after_sleep(self) -> None:
        """Recorded loads stay valid only while the engine keeps its weights where they were."""
        if self.replayer is None:
            return
        if self.sleep_level >= 2:
            self.replayer.invalidate()  # discarded weights: engine-side fills the replay skips are gone too
        else:
            self.replayer.release_stale()  # an engine that moved its weights: let go of the old copy now
