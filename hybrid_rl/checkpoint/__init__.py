"""Resumable checkpoints: sharded model + optimizer (DCP), per-rank small state, atomic publish.

Why: an RL run is hours of rollouts; a crash or pre-emption must cost at most
one save interval, and the resumed run must continue the *same* trajectory
(same parameters, AdamW moments, LR schedule, data order and sampling RNG).

Layout (``root`` is normally ``<trainer.output_dir>/checkpoints``, so the run's
``config.yaml`` sits two directories above every ``step_*``)::

    root/
      latest                    # "step_00000020\\n": a hint, replaced atomically
      step_00000020/
        .metadata, __*_*.distcp # torch.distributed.checkpoint shards (model + optimizer)
        extra_rank0.pt ...      # per-rank small state (torch.save, loaded with weights_only)
        config.yaml             # the resolved run config that trained up to this step (when the caller passes one)
        COMPLETE                # JSON {step, world_size, files: {shard/extra name: size}, ...}; written last, by rank 0
      .tmp-step_00000030/       # a save in progress (or a crashed one): never chosen

Model and optimizer go through ``torch.distributed.checkpoint.state_dict``
(``get_state_dict``/``set_state_dict``), so the same code path serves an FSDP2
model (DTensor shards, each rank writes its own) and a plain module (a world
of one), and DCP reshards on load: a checkpoint written by N ranks loads into
a plain module in one process (that is how :func:`hybrid_rl.export.export_hf` works). The state
dict keys are the module's FQNs, which ``fully_shard`` does not change, so the
FSDP2 and plain keys are identical.

Decisions:

* The *full* model state is saved, LoRA included (frozen base + adapters). It
  is the simplest correct choice: a checkpoint restores the exact module
  without re-deriving which tensors were frozen, and export needs nothing but
  the checkpoint and the base model's architecture. Cost: with LoRA on a large
  model each checkpoint carries the frozen base too (use ``keep_last``).
* ``extra`` (step, weight_version, sampler state, RNG states, ...) is saved per
  rank because RNG streams differ per rank; so resuming needs the same world
  size (model/optimizer alone would reshard, the extra cannot). It must be made
  of tensors and Python primitives: it is validated at save time and loaded with
  ``torch.load(weights_only=True)`` (no pickled code from checkpoint files).
* The LR scheduler's ``state_dict`` is stored with the extra, and so are the
  optimizer's param-group hyper-parameters when AdamW has no state yet (DCP's
  ``get_state_dict`` would otherwise run a zero-lr "init" step on the *live*
  optimizer, which advances Adam's step counter and changes later updates).
* Publication is atomic: everything is written into ``.tmp-step_N``; after a
  barrier rank 0 writes ``COMPLETE``, renames the directory to ``step_N``, then
  replaces ``latest``, then prunes. A crash at any point leaves either the old
  set of complete checkpoints or the new one. ``root`` must be on a file system
  every rank sees (a shared one for multi-node runs).
* A write that fails (disk full, permissions) removes the temporary directory
  and raises one :class:`CheckpointError` naming the path, the bytes needed (the
  model + optimizer state) and the bytes free; the free space is checked before
  writing, so a disk that is already too full fails before anything is written.
* ``latest`` is a hint and ``COMPLETE`` is not proof the files are intact:
  ``COMPLETE`` records every file's size, and :func:`verify_checkpoint` checks
  them (and that ``.metadata`` reads and each shard is as long as its index
  says; that part also covers checkpoints written before the sizes were kept)
  before a load. A damaged checkpoint is a :class:`CorruptCheckpointError`
  naming the file, distinct from a model/optimizer mismatch, and
  :func:`find_resumable` skips it (with a warning) for the newest intact one.

The package is split by job: ``layout`` (the directory format, the ``COMPLETE``
marker, atomic file writes, :func:`find_latest`), ``integrity`` (:func:`verify_checkpoint`
and :func:`find_resumable`), ``saving``, ``loading`` and ``rng`` (:func:`capture_rng`).

Left out: checksums of the shard contents (sizes catch truncation, the common
damage; reading every byte back would double the save's I/O), async/background saving, saving the frozen reference policy (it is
rebuilt from ``model.path``), the rollout engine's weights (re-pushed from the
actor by the sharding manager), and frozen-weight-free LoRA checkpoints.
"""

from .integrity import find_resumable, verify_checkpoint
from .layout import (CHECKPOINT_SUBDIR, COMPLETE, CONFIG_FILE, FORMAT_VERSION, LATEST, CheckpointError,
                     CorruptCheckpointError, find_latest, is_complete, step_dir_name)
from .loading import load_checkpoint, read_checkpoint_config
from .rng import capture_rng, restore_rng
from .saving import save_checkpoint

__all__ = ["CHECKPOINT_SUBDIR", "COMPLETE", "CONFIG_FILE", "FORMAT_VERSION", "LATEST", "CheckpointError",
           "CorruptCheckpointError", "capture_rng", "find_latest", "find_resumable", "is_complete", "load_checkpoint",
           "read_checkpoint_config", "restore_rng", "save_checkpoint", "step_dir_name", "verify_checkpoint"]
