"""Restoring a checkpoint in place: model, optimizer, scheduler and parts through DCP, and this rank's extra.

Damaged files are a :class:`CorruptCheckpointError` naming the file (also when only the load itself finds them,
e.g. garbled bytes), distinct from a checkpoint that does not match the model or optimizer.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .integrity import corrupt_error, verify_checkpoint
from .layout import CONFIG_FILE, META_KEY, CheckpointError, error_summary, quiet_single_process, rank_world, require_complete


def _shard_names(path: Path) -> str:
    """The shard file(s) of ``path``, for a message about one of them that cannot be read."""
    shards = sorted(f.name for f in path.glob("*.distcp"))
    if len(shards) == 1:
        return shards[0]
    return f"one of its shard files ({', '.join(shards[:4])}{', ...' if len(shards) > 4 else ''})" if shards else "its .metadata"



_DAMAGE_TYPES = (EOFError, pickle.UnpicklingError, OSError, UnicodeDecodeError)
_DAMAGE_TEXT = ("metadata read failed", "PytorchStreamReader", "truncated", "Weights only load failed", "invalid load key",
                "central directory", "unexpected EOF")


def _damage_in(e: BaseException, seen: set[int] | None = None) -> BaseException | None:
    """The exception in ``e``'s chain (and in DCP's per-rank failures) that says a file is unreadable, if any;
    a model/optimizer mismatch (DCP: "Size mismatch", "Missing key") has none."""
    seen = set() if seen is None else seen
    if id(e) in seen:
        return None
    seen.add(id(e))
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: its str() holds every rank's traceback
    if not isinstance(failures, dict) and (isinstance(e, _DAMAGE_TYPES) or any(t in str(e) for t in _DAMAGE_TEXT)):
        return e
    inner = [exc for exc, _ in failures.values()] if isinstance(failures, dict) else []
    for c in (*inner, e.__cause__, e.__context__):
        found = _damage_in(c, seen) if isinstance(c, BaseException) else None
        if found is not None:
            return found
    return None



def read_checkpoint_config(path: str | os.PathLike) -> dict[str, Any] | None:
    """The resolved config that trained checkpoint ``path``: its own ``config.yaml``, else (checkpoints written
    before it kept one) the run directory's, two levels up; None when neither exists or parses."""
    import yaml

    path = Path(path)
    for f in (path / CONFIG_FILE, path.parent.parent / CONFIG_FILE):
        try:
            saved = yaml.safe_load(f.read_text())
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(saved, dict):
            return saved
    return None



def _load_extra(path: Path, rank: int) -> dict[str, Any]:
    f = path / f"extra_rank{rank}.pt"
    try:
        return torch.load(f, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise corrupt_error(path, f.name, "is missing") from None
    except Exception as e:  # noqa: BLE001
        raise corrupt_error(path, f.name, f"cannot be read ({error_summary(e)[:120]})") from None


def _load_into(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, no_dist: bool,
               process_group: "dist.ProcessGroup | None" = None, key: str | None = None) -> None:
    """Load the model (+ optimizer) saved at the top level, or under part ``key``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    if optimizer is not None:
        # get_state_dict gives the (sharded, for FSDP2) layout to read into; on a
        # fresh optimizer it first materialises AdamW state, which the load overwrites.
        model_sd, optim_sd = get_state_dict(model, optimizer)
        inner = {"model": model_sd, "optim": optim_sd}
        dcp_load({key: inner} if key else inner, storage_reader=FileSystemReader(str(path)), no_dist=no_dist,
                 process_group=process_group)
        set_state_dict(model, optimizer, model_state_dict=inner["model"], optim_state_dict=inner["optim"])
    else:
        inner = {"model": get_model_state_dict(model)}
        dcp_load({key: inner} if key else inner, storage_reader=FileSystemReader(str(path)), no_dist=no_dist,
                 process_group=process_group)
        set_model_state_dict(model, inner["model"])


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any | None = None, process_group: "dist.ProcessGroup | None" = None,
                    parts: Mapping[str, tuple[torch.nn.Module, Any, Any]] | None = None) -> dict[str, Any]:
    """Restore ``model``/``optimizer``/``scheduler`` (and each of ``parts``, as saved) in place from ``path``; returns
    this rank's ``extra``.

    Every rank calls it (collective under a process group). The model (and
    optimizer) must be built and, for FSDP2, sharded exactly as in the saving
    run; the world size must match the saving run's (the per-rank extra
    cannot be resharded).
    """
    from torch.distributed.checkpoint import CheckpointException

    path = Path(path)
    marker = require_complete(path)
    rank, world = rank_world()
    saved_world = int(marker.get("world_size", -1))
    if saved_world != world:
        raise CheckpointError(f"checkpoint {str(path)!r} was written by {saved_world} ranks but this run has {world}; "
                              f"resume with the same number of ranks (or export it with hybrid_rl.export and start a new run)")
    verify_checkpoint(path)  # damaged files: a CorruptCheckpointError naming the file, not a "does not match" below
    extra = _load_extra(path, rank)
    meta = extra.pop(META_KEY, None)
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {str(path)!r}: extra_rank{rank}.pt was not written by hybrid_rl.checkpoint; pass a step_* directory it wrote")
    no_dist = not (dist.is_available() and dist.is_initialized())
    load_optim = optimizer is not None and bool(meta.get("has_optimizer_state"))
    parts = dict(parts or {})
    saved_parts = meta.get("parts") or {}
    missing = sorted(set(parts) - set(saved_parts))
    if missing and model is not None:
        raise CheckpointError(f"checkpoint {str(path)!r} holds no {', '.join(missing)} (it has {sorted(saved_parts) or 'none'}); "
                              f"resume from a checkpoint of a run that trained one, or start a new trainer.output_dir")
    try:
        if model is not None:  # split placement: the rollout ranks only read their extra
            with quiet_single_process():
                _load_into(path, model, optimizer if load_optim else None, no_dist, process_group)
                for name, (part_model, part_optim, _) in parts.items():
                    part_load_optim = part_optim is not None and bool(saved_parts[name].get("has_optimizer_state"))
                    _load_into(path, part_model, part_optim if part_load_optim else None, no_dist, process_group, key=name)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises several types for key/shape mismatches
        damage = _damage_in(e)
        if damage is not None:  # damage the size checks cannot see (garbled bytes): corrupt, not a different model
            name = Path(damage.filename).name if isinstance(damage, OSError) and damage.filename else _shard_names(path)
            raise corrupt_error(path, name, f"cannot be read ({error_summary(e)[:160]})") from e
        raise CheckpointError(f"checkpoint {str(path)!r} does not match this model/optimizer ({error_summary(e)}); "
                              f"resume with the saving run's model.path and model.lora settings") from e
    _restore_schedule(path, optimizer, scheduler, meta, load_optim)
    if model is not None:
        for name, (_, part_optim, part_sched) in parts.items():
            part = saved_parts[name]
            _restore_schedule(path, part_optim, part_sched, part, part_optim is not None and bool(part["has_optimizer_state"]))
    return extra


def _restore_schedule(path: Path, optimizer: torch.optim.Optimizer | None, scheduler: Any | None, meta: Mapping[str, Any],
                      loaded_optim: bool) -> None:
    """The scheduler's state, and the optimizer's hyper-parameters where it was saved without AdamW state."""
    if optimizer is not None and not loaded_optim:
        # Saved before AdamW had state: the resumed optimizer must have none either.
        optimizer.state.clear()
        groups = meta.get("optimizer_param_groups")
        if groups:
            if len(groups) != len(optimizer.param_groups):
                raise CheckpointError(f"checkpoint {str(path)!r} has {len(groups)} optimizer param groups, this optimizer "
                                      f"{len(optimizer.param_groups)}; build the optimizer as the saving run did")
            for g, saved in zip(optimizer.param_groups, groups):
                g.update(saved)
    if scheduler is not None:
        if meta.get("scheduler") is None:
            raise CheckpointError(f"checkpoint {str(path)!r} holds no LR scheduler state; pass scheduler=None or resume from a checkpoint saved with one")
        scheduler.load_state_dict(meta["scheduler"])

