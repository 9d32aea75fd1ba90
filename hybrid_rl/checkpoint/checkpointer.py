"""The trainer's checkpoints: what a run's checkpoint holds beside the weights, and resuming from one.

``resume_target`` picks the checkpoint ``trainer.resume`` names and checks its run config against this one before
anything costly is built; ``Checkpointer`` then saves and restores the run's state through the format of this package
(``save_checkpoint`` / ``load_checkpoint``): the actor (model, AdamW, LR schedule) through DCP over the training ranks'
group, the critic beside it, and per rank the step, the weight version, the sampler position, every RNG stream (the
global ones, the worker's, the engine's sampling RNG), the adaptive KL controller, the batch generated ahead or the
partial-rollout pool (a round in flight finishes first: nothing partial is saved), and the loop's own counters
(``LoopState``). Left out: choosing when to save (the loop's
``trainer.save_freq``) and resuming on another world size (the per-rank state is per rank).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from hybrid_rl.batch import Batch
from hybrid_rl.checkpoint.integrity import find_resumable, verify_checkpoint
from hybrid_rl.checkpoint.layout import CHECKPOINT_SUBDIR, CheckpointError, CorruptCheckpointError, find_latest, is_complete
from hybrid_rl.checkpoint.loading import load_checkpoint, read_checkpoint_config
from hybrid_rl.checkpoint.rng import capture_rng, restore_rng
from hybrid_rl.checkpoint.saving import save_checkpoint
from hybrid_rl.config import Config, ConfigError, resume_config_diff

if TYPE_CHECKING:
    from hybrid_rl.data import PromptSampler
    from hybrid_rl.modes.placement import Placement
    from hybrid_rl.modes.sources import RolloutSource
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker
    from hybrid_rl.workers.critic import CriticWorker


@dataclass
class LoopState:
    """The training loop's own counters, carried by every checkpoint."""

    skipped_in_a_row: int = 0
    """Consecutive steps whose update was skipped for a non-finite loss or gradient norm."""
    val_owed: bool = False
    """A stop signal put this step's validation off: the resumed run validates first."""

    def count_skipped(self, metrics: dict[str, float], limit: int, root: Path) -> None:
        """A non-finite loss/grad norm skips the update; ``limit`` (``trainer.max_skipped_updates``) in a row stops
        the run with ``TrainingDiverged`` (``root``: where its checkpoints are)."""
        skipped = metrics.get("actor/skipped_updates", 0) > 0 or metrics.get("critic/skipped_updates", 0) > 0
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if self.skipped_in_a_row >= limit:
            raise TrainingDiverged(f"{self.skipped_in_a_row} steps in a row had a non-finite loss or gradient norm and "
                                   f"were skipped (trainer.max_skipped_updates={limit}); lower actor.lr, check the "
                                   f"reward function, or resume from the last checkpoint in {root}")


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite updates; the message names the knob and the way out."""


def checkpoint_root(cfg: Config) -> Path:
    """Where the run's checkpoints live: ``<trainer.output_dir>/checkpoints``."""
    return Path(cfg.trainer.output_dir) / CHECKPOINT_SUBDIR


def resume_target(cfg: Config, notes: list[str]) -> Path | None:
    """The checkpoint ``trainer.resume`` names (None = a fresh run), its run config checked against ``cfg``;
    warnings go to ``notes`` (the tracker writes them once it exists)."""
    resume = cfg.trainer.resume
    if resume == "never":
        return None
    if resume == "auto":  # `latest` is a hint: the newest complete checkpoint whose files check out, warned if not it
        path, found = find_resumable(checkpoint_root(cfg))
        notes.extend(found)
        if path is None:
            return None
    else:
        path = Path(resume)
        if not is_complete(path):
            raise CheckpointError(f"trainer.resume={resume!r} is not a complete checkpoint (no COMPLETE marker: missing, "
                                  f"crashed or partial); point it at a <output_dir>/checkpoints/step_* directory, or use "
                                  f"trainer.resume=auto to pick the newest complete one")
        verify_checkpoint(path)  # damaged files: one line naming the file and the previous checkpoint
    check_resumed_config(cfg, path, notes)
    return path


def check_resumed_config(cfg: Config, path: Path, notes: list[str]) -> None:
    """Resuming continues the checkpoint's run: a setting that changes what is trained must not differ
    silently (ConfigError unless trainer.allow_config_change); harmless differences become a warning."""
    saved = read_checkpoint_config(path)
    if saved is None:
        notes.append(f"warning: {path} records no run config; resuming without comparing settings")
        return
    strict, harmless = resume_config_diff(saved, cfg)
    if strict and not cfg.trainer.allow_config_change:
        raise ConfigError(f"checkpoint {path} was trained with different settings: {', '.join(strict)}; to train with "
                          f"the new settings use a new trainer.output_dir, set trainer.resume=never to start over, or "
                          f"trainer.allow_config_change=true to continue this checkpoint with them")
    if strict:
        notes.append(f"warning: continuing {path} with changed training settings "
                     f"(trainer.allow_config_change=true): {', '.join(strict)}")
    if harmless:
        note = ""
        if cfg.actor.lr_scheduler == "cosine" and any(k.startswith(("trainer.total_steps", "trainer.total_epochs"))
                                                      for k in harmless):
            note = " (the cosine LR schedule stretches to the new length)"
        notes.append(f"warning: resuming {path} with changed settings: {', '.join(harmless)}{note}")


class Checkpointer:
    """Saves and restores one rank's share of the run: the parts it is given, which the trainer built."""

    def __init__(self, cfg: Config, placement: Placement, worker: ActorRolloutRefWorker, critic: CriticWorker | None,
                 source: RolloutSource, sampler: PromptSampler, kl_ctrl: Any, notes: list[str]):
        self.cfg, self.placement, self.worker, self.critic = cfg, placement, worker, critic
        self.source, self.sampler, self.kl_ctrl, self.notes = source, sampler, kl_ctrl, notes
        self.root = checkpoint_root(cfg)

    def latest(self) -> Path | None:
        """The newest complete checkpoint (None: none yet)."""
        return find_latest(self.root)

    def save(self, step: int, loop: LoopState) -> None:
        """A checkpoint of the run after ``step`` (a collective: every rank calls it)."""
        w = self.worker
        pending = self.source.pending_batch()  # waits for the in-flight batch (it must not race the RNG capture)
        extra = {"step": step, "val_owed": loop.val_owed, "weight_version": w.weight_version,
                 "sampler": self.sampler.state_dict(),
                 "rng": self._capture_rng(), "skipped_in_a_row": loop.skipped_in_a_row,
                 "pending_batch": pending.state_dict() if pending is not None else None,
                 "kl_ctrl": self.kl_ctrl.state_dict()}
        model, optimizer, scheduler, group = self._actor_parts()
        with self._resident():
            save_checkpoint(self.root, step, model, optimizer, scheduler, extra, self.cfg.trainer.keep_last, group,
                            config=self.cfg.to_dict(), parts=self._extra_parts())

    def restore(self, path: Path) -> tuple[int, LoopState]:
        """Load checkpoint ``path`` into the parts; returns the step to continue after and the loop's counters. A
        checkpoint found corrupt while loading gives way to the previous complete one under ``trainer.resume=auto``."""
        try:
            with self._resident():
                extra = load_checkpoint(path, *self._actor_parts(), parts=self._extra_parts())
        except CorruptCheckpointError as e:  # damage the size checks missed; under resume=auto, the previous one
            older = None
            if self.cfg.trainer.resume == "auto":
                older, found = find_resumable(self.root, below=int(path.name.rsplit("_", 1)[1]))
                self.notes.extend(found)
            if older is None:
                raise
            self.notes.append(f"warning: checkpoint {path} is corrupt ({e.file} {e.problem}); "
                              f"resuming from the previous complete checkpoint, {older}")
            check_resumed_config(self.cfg, older, self.notes)
            return self.restore(older)  # it loads every tensor, over whatever the failed load had written
        self.worker.weight_version = extra["weight_version"]
        self.sampler.load_state_dict(extra["sampler"])
        loop = LoopState(skipped_in_a_row=extra.get("skipped_in_a_row", 0),
                         val_owed=bool(extra.get("val_owed", False)))  # a stop put this step's validation off
        if "kl_ctrl" in extra:  # the adaptive controller's β where the run left it
            self.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        if extra.get("pending_batch") is not None:
            device = self.placement.dist.device  # every rank's (a split side's DistInfo keeps the rank's device)
            self.source.restore_pending(Batch.from_state_dict(extra["pending_batch"]).to(device))
        self._restore_rng(extra["rng"])  # last: building models consumed the global RNG
        self.notes.append(f"resumed from {path} (step {extra['step']})")
        return int(extra["step"]), loop

    # -- the parts ------------------------------------------------------------------------
    def _capture_rng(self) -> dict:
        """Global RNGs, the worker's generators and the engine's sampling RNG (saved as generator "rollout")."""
        rng = capture_rng(self.worker.rng_generators())
        engine_rng = self.worker.rollout.rng_state() if self.worker.rollout is not None else None
        if engine_rng is not None:  # None: not capturable (vLLM samples with its own per-request RNG)
            rng["generators"]["rollout"] = engine_rng
        return rng

    def _restore_rng(self, rng: dict) -> None:
        restore_rng(rng, self.worker.rng_generators())
        engine = self.worker.rollout
        if engine is not None and engine.rng_state() is not None:
            saved = rng.get("generators", {})
            if "rollout" not in saved:
                raise CheckpointError(f"RNG state has no generator 'rollout' (it has {sorted(saved)}): the checkpoint "
                                      f"was saved by a run whose rollout engine had no capturable sampling RNG")
            engine.set_rng_state(saved["rollout"])

    def _actor_parts(self) -> tuple:
        """(model, optimizer, scheduler, DCP process group) of this rank: none on split placement's rollout ranks."""
        a = self.worker.actor
        if a is None:
            return None, None, None, None
        return a.model, a.optimizer, a.scheduler, self.placement.dcp_group

    def _extra_parts(self) -> dict:
        """Trained modules checkpointed beside the actor: the critic (model, optimizer, scheduler), when there is one."""
        return {"critic": self.critic.checkpoint_part()} if self.critic is not None else {}

    @contextmanager
    def _resident(self) -> Iterator[None]:
        """The critic, and the actor's optimizer state, on their device while a checkpoint reads or writes them (either
        may be offloaded between phases: ``critic.*_offload``, ``actor.optimizer_offload``)."""
        a = self.worker.actor
        with self.critic.resident() if self.critic is not None else nullcontext():
            with a.optimizer_on_device(self.cfg.actor.optimizer_offload) if a is not None else nullcontext():
                yield
