"""Where the trainer's batches come from: one ``RolloutSource`` per way of generating them.

The driver's step is the same in every mode and placement: ``batch = source.next_batch(...)``,
then train on it. What differs lives here, each source owning its own state:

- ``SyncSource`` (``trainer.mode=sync``, colocated): push θ_k, generate batch k, hand it over.
- ``OverlapSource`` (``trainer.mode=overlap``, colocated): hand over batch k (generated with θ_{k-1} in
  the background), push θ_k and start batch k+1 before the update (``pipeline.RolloutPipeline``).
- ``PartialOverlapSource`` (``trainer.mode=overlap`` with ``trainer.partial_rollouts``, colocated): as
  ``OverlapSource``, but the round in flight is interrupted once this rank has a step's complete groups and the
  rest is carried into the next round (``partial.PartialRolloutPipeline``).
- ``SplitSource`` (``trainer.placement=split``): the rollout ranks generate and hand batches to the
  trainer ranks, which send θ back over NCCL (``split.py``); on the rollout ranks ``next_batch``
  returns None (they train nothing), in either mode. With ``trainer.partial_rollouts`` each rollout rank runs
  ``partial.PartialRolloutPipeline``: its round generates in the background until every trainer rank is ready for
  the next batch, then is interrupted once the rank has its step's complete groups; the tail is carried.

Which rank plays which part comes first, from ``placement.Placement``. Each source also answers the questions the
checkpoint and validation code ask of the step: the batch generated ahead (``pending_batch``), the last weight
transfer (``sync_stats``), and how to run greedy validation on the engine (``validate``).
Left out: more than one step of staleness except through partial rollouts.
"""

from __future__ import annotations

import abc
from typing import Callable

from hybrid_rl.batch import Batch
from hybrid_rl.config import Config
from hybrid_rl.distributed import DistInfo
from hybrid_rl.modes.partial import PartialRolloutPipeline
from hybrid_rl.modes.overlap import RolloutPipeline
from hybrid_rl.modes.placement import Placement
from hybrid_rl.modes.split import send_batch
from hybrid_rl.telemetry.tracking import Timer
from hybrid_rl.weights.broadcast import broadcast_weights, receive_weights
from hybrid_rl.weights.replay import WeightReplayer

NextPrompts = Callable[[], Batch]
OnEngine = Callable[[int, int], dict]
"""Greedy validation on this rank's engine: (share index, number of shares) → reduced metrics."""


class RolloutSource(abc.ABC):
    """The batches a trainer rank trains on, and the state that producing them carries."""

    def __init__(self, worker, pipeline: RolloutPipeline, next_prompts: NextPrompts):
        self.worker = worker
        self.pipeline = pipeline
        self.next_prompts = next_prompts

    @abc.abstractmethod
    def next_batch(self, timer: Timer, last: bool) -> Batch | None:
        """The batch to train on this step (None: this rank only generates). ``last``: no step follows."""

    def check_staleness(self, batch: Batch, trainer_version: int) -> Batch:
        return self.pipeline.check_staleness(batch, trainer_version)

    def sync_stats(self) -> tuple[float, int]:
        """(seconds, bytes) of the step's weight transfer into the engine."""
        sm = self.worker.sharding_manager
        return (sm.last_sync_s, sm.last_sync_bytes) if sm is not None else (0.0, 0)

    def pending_batch(self) -> Batch | None:
        """The batch generated ahead (part of a checkpoint); waits for an in-flight generation."""
        self.pipeline.wait()
        return self.pipeline.peek()

    def restore_pending(self, batch: Batch) -> None:
        self.pipeline.restore(batch)

    def validate(self, on_engine: OnEngine, dist: DistInfo) -> dict:
        """Greedy validation with the current weights: every rank takes its share of the prompts."""
        self.pipeline.wait()  # the engine is shared with the in-flight rollout
        with self.worker.rollout_mode():
            return on_engine(dist.rank, dist.world_size)

    def close(self) -> None:
        self.pipeline.close()


class SyncSource(RolloutSource):
    """Generate batch k with θ_k, then hand it over."""

    def next_batch(self, timer: Timer, last: bool) -> Batch:
        prompts = self.next_prompts()
        manager = self.worker.rollout_mode()
        with manager:
            with timer("gen"):
                batch = self.worker.generate(prompts)
        # waking and pushing into the engine, and putting it back to sleep (``timing/sync_weights`` is part of it)
        timer.times["timing/switch"] = manager.last_switch_s
        return batch


class OverlapSource(RolloutSource):
    """One-step overlap: hand over batch k (sampled with θ_{k-1}) and start batch k+1 with θ_k."""

    def next_batch(self, timer: Timer, last: bool) -> Batch:
        with timer("wait_gen"):
            batch = self.pipeline.take(self.next_prompts)  # batch k, generated in the background
        if not last:
            self.pipeline.start(self.next_prompts())  # batch k+1 under θ_k, concurrent with the update
        timer.times["timing/gen"] = batch.meta["gen_s"]
        return batch


class PartialOverlapSource(OverlapSource):
    """Overlap with partial rollouts: take this step's groups (interrupting the round), start the next round.

    ``steps_left()``: the steps from the next one to the run's end; the pool the round started now draws from
    holds no more prompts than they train, so that nothing generated is left untrained.
    """

    def __init__(self, worker, pipeline, next_prompts: NextPrompts, steps_left: Callable[[], int]):
        super().__init__(worker, pipeline, next_prompts)
        self.steps_left = steps_left

    def next_batch(self, timer: Timer, last: bool) -> Batch:
        with timer("wait_gen"):
            batch = self.pipeline.take(self.next_prompts, self.worker.weight_version, final=last)
        if not last:
            self.pipeline.start(self.next_prompts, steps_left=self.steps_left())
        timer.times["timing/gen"] = batch.meta["gen_s"]
        return batch


class SplitSource(RolloutSource):
    """Split placement: batches from the rollout ranks, weights back to them (see ``split.py`` for the order)."""

    def __init__(self, worker, pipeline: RolloutPipeline, next_prompts: NextPrompts, cfg: Config, placement: Placement,
                 global_dist: DistInfo, pad_token_id: int, steps_left: Callable[[], int] = lambda: 2):
        super().__init__(worker, pipeline, next_prompts)
        self.cfg, self.layout, self.global_dist = cfg, placement.layout, global_dist
        self.dist = placement.dist
        self.pad_token_id = pad_token_id
        self.overlap = cfg.staleness_bound > 0
        self.partial = cfg.trainer.partial_rollouts  # the rollout ranks' pipeline is a PartialRolloutPipeline
        self.steps_left = steps_left
        self._sync = (0.0, 0)
        self._sent_version: int | None = None
        self._replayer = None
        if self.layout.is_rollout and cfg.rollout.weight_load_replay:
            engine = worker.rollout
            self._replayer = WeightReplayer(lambda bucket: engine.load_weights(bucket))

    # -- the two exchanges -----------------------------------------------------------
    def _exchange_weights(self) -> None:
        """θ from the trainer ranks to the rollout ranks (skipped when the rollout already has this version)."""
        w = self.worker
        if self.layout.is_rollout:
            self._sync = receive_weights(self.layout, w.rollout, self.global_dist.device, self._replayer)
            return
        skip = self._sent_version == w.weight_version
        src = _NoParams() if skip else w.actor
        took, sent = broadcast_weights(self.layout, src, w.rollout_dtype, self.cfg.rollout.weight_sync_bucket_mb * 2**20,
                                       w.weight_version, self.dist.device)
        self._sync = (self._sync[0] + took, self._sync[1] + sent)  # summed over the step's exchanges
        self._sent_version = w.weight_version

    def _trainers_ready(self) -> int | None:
        """Partial rollouts: a collective that the trainer ranks enter when they are ready for the next batch (the
        rollout ranks' rounds generate until then); every rank learns the version the trainers will train it at."""
        import torch.distributed as tdist

        mine = None if self.layout.is_rollout else self.worker.weight_version
        parts: list = [None] * self.layout.world
        tdist.all_gather_object(parts, mine, group=self.layout.obj_group)
        return parts[self.layout.leader]

    def _exchange_batch(self, batch: Batch | None) -> Batch | None:
        d = self.cfg.data
        return send_batch(self.layout, batch, (d.max_prompt_length, d.max_response_length), self.pad_token_id)

    # -- the step --------------------------------------------------------------------
    def next_batch(self, timer: Timer, last: bool) -> Batch | None:
        if self.layout.is_rollout:
            self._rollout_side(last)
            return None
        self._sync = (0.0, 0)
        if not self.overlap or self._sent_version is None:
            with timer("sync_weights"):
                self._exchange_weights()
        with timer("wait_gen"):
            if self.partial:
                self._trainers_ready()
            batch = self._exchange_batch(None).to(self.dist.device)
        if self.overlap:
            with timer("sync_weights"):
                self._exchange_weights()  # θ_k, received while this rank updates on batch k
        timer.times["timing/gen"] = batch.meta["gen_s"]
        return batch

    def _rollout_side(self, last: bool) -> None:
        """Generate, hand the batch over, take the new weights (and, overlapping, start the next in the background:
        the step ends here, so the per-step collectives after it pair up at once and the trainer ranks' wait for a
        batch still generating falls in their ``timing/wait_gen``, inside ``timing/step``)."""
        if self.partial:
            return self._rollout_side_partial(last)
        if not self.overlap or self.worker.rollout.weights_version is None:  # mirrors the trainer ranks' condition
            self._exchange_weights()
        pipe = self.pipeline
        batch = pipe.take(self.next_prompts) if pipe.pending is not None else pipe.generate_now(self.next_prompts())
        self._exchange_batch(batch)
        if self.overlap:
            self._exchange_weights()  # θ_k (nothing generates while it loads), pushed while the trainers update on k
            if not last:
                pipe.start_as_loaded(self.next_prompts())

    def _rollout_side_partial(self, last: bool) -> None:
        """Partial rollouts: the round started last step generates while the trainer ranks update; once they are
        ready, interrupt it at this rank's step of complete groups, hand those over, take θ_k, start the next round
        (the first step, or one after a validation or restore, generates what is missing in the foreground)."""
        pipe = self.pipeline
        if self.worker.rollout.weights_version is None:  # the first step: θ_0 (the trainer ranks send it too)
            self._exchange_weights()
        trainer_version = self._trainers_ready()
        self._exchange_batch(pipe.take(self.next_prompts, trainer_version, final=last))
        self._exchange_weights()  # θ_k: the round is over, nothing generates while it loads
        if not last:
            pipe.start(self.next_prompts, steps_left=self.steps_left())

    # -- state -----------------------------------------------------------------------
    def sync_stats(self) -> tuple[float, int]:
        return self._sync

    def validate(self, on_engine: OnEngine, dist: DistInfo) -> dict:
        """θ_k goes to the rollout ranks, they validate, the logging trainer rank gets the result."""
        import torch.distributed as tdist

        if self.layout.is_rollout:
            self.pipeline.wait()  # a partial round in flight finishes before θ_k is loaded (a no-op otherwise)
        self._exchange_weights()
        sp = self.layout
        mine = on_engine(sp.index, sp.n_rollout) if sp.is_rollout else None
        parts: list = [None] * sp.world
        tdist.all_gather_object(parts, mine, group=sp.obj_group)
        return parts[0]


class _NoParams:
    """A weight source with nothing to send (the rollout ranks already hold this version)."""

    @staticmethod
    def iter_full_params(dtype=None, skip_static=False):
        return iter(())


def make_source(cfg: Config, placement: Placement, worker, next_prompts: NextPrompts, global_dist: DistInfo,
                pad_token_id: int, steps_left: Callable[[], int] = lambda: 2) -> RolloutSource:
    """The source for ``trainer.mode`` × ``trainer.placement``: the only place that choice is made.
    ``steps_left()``: the steps from the next one to the run's end (partial rollouts size their pool by it)."""
    split = placement.layout
    if cfg.trainer.partial_rollouts and cfg.trainer.mode == "overlap" and (split is None or split.is_rollout):
        per_step = cfg.data.train_batch_size // placement.sampler_world  # this rank's groups (a rollout rank's)
        pipe = PartialRolloutPipeline(worker, cfg.staleness_bound, cfg.trainer.stale_policy, per_step,
                                      cfg.trainer.partial_rollout_ahead)
        if split is None:
            return PartialOverlapSource(worker, pipe, next_prompts, steps_left)
        return SplitSource(worker, pipe, next_prompts, cfg, placement, global_dist, pad_token_id, steps_left)
    pipeline = RolloutPipeline(worker, cfg.staleness_bound, cfg.trainer.stale_policy,
                               background=split is None or split.is_rollout, trains_here=split is None)
    if split is not None:
        return SplitSource(worker, pipeline, next_prompts, cfg, placement, global_dist, pad_token_id, steps_left)
    if cfg.trainer.mode == "overlap":
        return OverlapSource(worker, pipeline, next_prompts)
    return SyncSource(worker, pipeline, next_prompts)
