"""Writing a checkpoint: DCP shards + per-rank extra into ``.tmp-step_N``, then ``COMPLETE``, the rename and ``latest``.

Every failure is agreed on by all ranks (``_agree``), so a rank-local error raises everywhere instead of leaving the
others in a barrier; a failed write removes the temporary directory and names the bytes needed and free.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .layout import (COMPLETE, CONFIG_FILE, FORMAT_VERSION, LATEST, META_KEY, TMP_RE, CheckpointError,
                     complete_checkpoints, error_summary, fsync_dir, quiet_single_process, rank_world, remove_checkpoint,
                     step_dir_name, write_atomic)


def _has_optimizer_state(optimizer: torch.optim.Optimizer | None) -> bool:
    return optimizer is not None and any(len(s) > 0 for s in optimizer.state.values())



def _check_weights_only(obj: Any, what: str) -> bytes:
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means "not safely loadable"
        raise CheckpointError(f"{what} must hold only tensors and Python primitives (dict/list/tuple/int/float/str/bool/None) "
                              f"so it reloads with weights_only=True ({error_summary(e)[:200]}); convert it, e.g. with capture_rng()") from None
    return buf.getvalue()


_MARKER_ALLOWANCE = 16 * 1024
"""Bytes allowed for COMPLETE and config.yaml on top of the state."""
_PER_TENSOR_OVERHEAD = 3072
"""DCP's bytes per tensor besides its data: a header in the shard (about 2.5 KiB with torch 2.x) and its .metadata entry."""


def _state_bytes(obj: Any) -> int:
    """Bytes this rank's shards of ``obj`` (a nested state dict) take on disk, about: tensor data plus a header each."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj  # a DTensor: this rank writes its shard only
        return local.numel() * local.element_size() + _PER_TENSOR_OVERHEAD
    if isinstance(obj, Mapping):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_state_bytes(v) for v in obj)
    return 0


def _all_sum(n: int) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return n
    t = torch.tensor([n], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item())


def _free_bytes(path: Path) -> int:
    """Free bytes on the file system holding ``path`` (its nearest existing ancestor); -1 when unknown."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return -1


def _fmt_bytes(n: int) -> str:
    if n < 0:
        return "an unknown amount"
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _file_sizes(path: Path) -> dict[str, int]:
    """The size of every file a load reads in checkpoint directory ``path`` (the manifest kept in COMPLETE);
    ``config.yaml`` is a record read leniently (older checkpoints lack it), not part of the state."""
    return {f.name: f.stat().st_size for f in sorted(path.iterdir()) if f.is_file() and f.name not in (COMPLETE, CONFIG_FILE)}


class _WriteFailure:
    """A failed checkpoint write; it becomes its CheckpointError after the temporary directory is removed, so that
    the free space the message quotes counts the space the removal gave back."""

    def __init__(self, path: Path, cause: BaseException | str, needed: int):
        self.path, self.cause, self.needed = path, cause, needed

    def error(self) -> CheckpointError:
        cause = self.cause if isinstance(self.cause, str) else error_summary(self.cause)
        return CheckpointError(f"cannot write checkpoint {str(self.path)!r} ({cause}): it needs about {_fmt_bytes(self.needed)} "
                               f"(model + optimizer state) and {_fmt_bytes(_free_bytes(self.path))} is free there; free space, "
                               f"lower trainer.keep_last or move trainer.output_dir to a larger disk, and check it is writable "
                               f"(the previous checkpoint and 'latest' are untouched)")



def save_checkpoint(root: str | os.PathLike, step: int, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                    scheduler: Any | None, extra: Mapping[str, Any] | None, keep_last: int = 0,
                    process_group: "dist.ProcessGroup | None" = None, config: Mapping[str, Any] | None = None,
                    parts: Mapping[str, tuple[torch.nn.Module, Any, Any]] | None = None) -> Path:
    """Save ``model``/``optimizer``/``scheduler`` + this rank's ``extra`` as ``root/step_{step:08d}``; every rank calls it.

    Returns the published directory. ``keep_last`` > 0 prunes older complete
    checkpoints (lower steps) beyond the newest ``keep_last``, only after the new
    one is complete; 0 keeps all. Collective under a process group. Under split
    placement the model lives on the trainer ranks only: they pass their group as
    ``process_group`` (the DCP save runs over it) and the rollout ranks pass
    ``model=None`` and write their extra alone. ``config`` (rank 0's resolved run
    config, a nested dict of primitives) is written as ``config.yaml`` beside the
    shards, so a resume can tell whether it continues the same run
    (:func:`read_checkpoint_config`). ``parts`` adds more trained modules beside
    the model, by name (e.g. ``{"critic": (model, optimizer, scheduler)}``): same
    DCP save under ``<name>.model`` / ``<name>.optim``, their schedulers in the extra.
    """
    from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if step < 0:
        raise CheckpointError(f"checkpoint step must be >= 0, got {step}")
    if keep_last < 0:
        raise CheckpointError(f"keep_last={keep_last} must be >= 0 (0 keeps every checkpoint)")
    root = Path(root)
    rank, world = rank_world()
    name = step_dir_name(step)
    tmp = root / f".tmp-{name}"
    final = root / name

    has_optim = _has_optimizer_state(optimizer)
    parts = dict(parts or {})
    if {"model", "optim"} & set(parts):
        raise CheckpointError(f"checkpoint parts must not be named 'model' or 'optim' (got {sorted(parts)})")
    meta = {
        "format": FORMAT_VERSION,
        "step": int(step),
        "rank": rank,
        "world_size": world,
        "has_optimizer_state": has_optim,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        # Without AdamW state the DCP save skips the optimizer; keep its
        # hyper-parameters (lr after warm-up/schedule, initial_lr) here instead.
        "optimizer_param_groups": ([{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
                                   if optimizer is not None and not has_optim else None),
        "parts": {name: _optimizer_meta(opt, sched) for name, (_, opt, sched) in parts.items()},
    }
    payload = dict(extra or {})
    if META_KEY in payload:
        raise CheckpointError(f"extra must not use the reserved key {META_KEY!r}")
    payload[META_KEY] = meta
    # Every failure below is agreed on by all ranks (_agree), so a rank-local
    # error raises everywhere instead of leaving the others in a barrier.
    extra_bytes, error = None, None
    try:
        extra_bytes = _check_weights_only(payload, "checkpoint extra")
    except CheckpointError as e:
        error = e
    _agree(error, tmp)

    state = None
    if model is not None:
        if has_optim:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            state = {"model": get_model_state_dict(model)}
        for name, (part_model, part_optim, _) in parts.items():
            state[name] = _module_state(part_model, part_optim)
    needed = _all_sum(_state_bytes(state) + len(extra_bytes)) + _MARKER_ALLOWANCE
    if rank == 0:
        try:  # a crashed earlier save of this step may have left a tmp dir: clear it (and count its space as free)
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            if 0 <= _free_bytes(root) < needed:  # known to fail: fail before writing anything
                error = _WriteFailure(tmp, "not enough free space", needed)
            else:
                tmp.mkdir(parents=True)
        except OSError as e:
            error = _WriteFailure(tmp, e, needed)
    _agree(error, tmp, cleanup=tmp)

    if state is not None:
        try:
            with quiet_single_process():  # DCP agrees on its own failures across ranks
                dcp_save(state, storage_writer=FileSystemWriter(str(tmp)),
                         no_dist=not (dist.is_available() and dist.is_initialized()), process_group=process_group)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - OSError, torch's "enforce fail" RuntimeError, ...
            error = _WriteFailure(tmp, e, needed)
    if error is None:
        try:
            write_atomic(tmp / f"extra_rank{rank}.pt", extra_bytes)
        except OSError as e:
            error = _WriteFailure(tmp / f"extra_rank{rank}.pt", e, needed)
    _agree(error, tmp, cleanup=tmp)

    _fault_point(f"save:{step}")
    published = False
    if rank == 0:
        try:
            missing = [r for r in range(world) if not (tmp / f"extra_rank{r}.pt").exists()]
            if missing:
                raise CheckpointError(f"{str(tmp)!r}: ranks {missing} wrote no extra state; the checkpoint directory must be on a "
                                      f"file system every rank sees")
            if config is not None:
                import yaml

                write_atomic(tmp / CONFIG_FILE, yaml.safe_dump(dict(config), sort_keys=False).encode())
            marker = {"format": FORMAT_VERSION, "step": int(step), "world_size": world, "has_optimizer_state": has_optim,
                      "time": time.time(), "files": _file_sizes(tmp)}
            write_atomic(tmp / COMPLETE, (json.dumps(marker) + "\n").encode())
            if final.exists():  # re-saving a step (e.g. after resuming from it): swap it in, then drop the old one
                trash = root / f".trash-{name}-{os.getpid()}"
                os.rename(final, trash)
                try:
                    os.rename(tmp, final)
                except OSError:
                    os.rename(trash, final)
                    raise
                remove_checkpoint(trash)
            else:
                os.rename(tmp, final)
            published = True
            fsync_dir(root)
            write_atomic(root / LATEST, (name + "\n").encode())
            _prune(root, step, keep_last)
        except CheckpointError as e:
            error = e
        except OSError as e:
            if published:  # complete, only `latest` is stale: find_resumable still finds it (and says so)
                error = CheckpointError(f"{str(final)!r} is complete but {str(root / LATEST)!r} could not be updated ({e}); "
                                        f"trainer.resume=auto finds the newest complete checkpoint without it; check free space "
                                        f"and permissions")
            else:
                error = _WriteFailure(tmp, e, needed)
    _agree(error, final, cleanup=tmp)
    return final


def _optimizer_meta(optimizer: torch.optim.Optimizer | None, scheduler: Any | None) -> dict[str, Any]:
    """A part's scheduler state and, while its AdamW has no state yet, its param-group hyper-parameters."""
    has_optim = _has_optimizer_state(optimizer)
    groups = ([{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
              if optimizer is not None and not has_optim else None)
    return {"has_optimizer_state": has_optim, "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "optimizer_param_groups": groups}


def _module_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if _has_optimizer_state(optimizer):
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optim": optim_sd}
    return {"model": get_model_state_dict(model)}


def _fault_point(name: str) -> None:
    """Crash-test hook: ``HYBRID_RL_FAULT=save:N`` SIGKILLs the process here (shards written, not yet published)."""
    if os.environ.get("HYBRID_RL_FAULT") == name:
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _collective_device() -> torch.device:
    backend = str(dist.get_backend())
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend and torch.cuda.is_available() else torch.device("cpu")


def _agree(error: "BaseException | _WriteFailure | None", path: Path, cleanup: Path | None = None) -> None:
    """Raise on every rank if any rank failed (this rank's own error where it has one); also a barrier.

    With ``cleanup``, rank 0 removes that (temporary) directory first, once every rank has stopped writing into it.
    """
    failed = error is not None
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=_collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(int(flag.item()))
    if failed and cleanup is not None and rank_world()[0] == 0:
        shutil.rmtree(cleanup, ignore_errors=True)
    if isinstance(error, _WriteFailure):
        raise error.error()  # after the cleanup: the space it freed counts as free
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"checkpoint {str(path)!r} failed on another rank; that rank's log has the reason")


def _prune(root: Path, step: int, keep_last: int) -> None:
    # Stale tmp dirs of earlier steps are crashed saves: always garbage.
    for child in root.iterdir():
        m = TMP_RE.match(child.name)
        if m and int(m.group(1)) < step:
            shutil.rmtree(child, ignore_errors=True)
    if keep_last <= 0:
        return
    # Only checkpoints at or below the one just written are candidates; it is always kept.
    older = [(s, p) for s, p in complete_checkpoints(root) if s <= step]
    for _, path in older[:-keep_last]:
        remove_checkpoint(path)

