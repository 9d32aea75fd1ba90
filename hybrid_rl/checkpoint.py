"""Resumable checkpoints: sharded model + optimizer (DCP), per-rank small state, atomic publish, HF export.

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
a plain module in one process (that is how :func:`export_hf` works). The state
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

Left out: checksums of the shard contents (sizes catch truncation, the common
damage; reading every byte back would double the save's I/O), async/background saving, saving the frozen reference policy (it is
rebuilt from ``model.path``), the rollout engine's weights (re-pushed from the
actor by the sharding manager), and frozen-weight-free LoRA checkpoints.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import re
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist

COMPLETE = "COMPLETE"
LATEST = "latest"
CONFIG_FILE = "config.yaml"
CHECKPOINT_SUBDIR = "checkpoints"
"""Where the trainer should put checkpoints inside its run directory (``<output_dir>/checkpoints``)."""
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^\.tmp-step_(\d+)$")
_META_KEY = "__hybrid_rl_checkpoint__"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, found or loaded; the message names the path and the fix."""


class CorruptCheckpointError(CheckpointError):
    """A complete checkpoint whose files are damaged (truncated, missing, unreadable); an older one may still load."""

    def __init__(self, message: str, path: Path, file: str, problem: str):
        super().__init__(message)
        self.path, self.file, self.problem = path, file, problem


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# --------------------------------------------------------------------------- helpers
def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temp file next to ``path``, fsync, then ``os.replace``; a failed write leaves ``path`` as it was."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def _read_marker(path: Path) -> dict[str, Any] | None:
    """The parsed COMPLETE marker of ``path``, or None when it is missing or unreadable."""
    try:
        marker = json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_complete(path: str | os.PathLike) -> bool:
    p = Path(path)
    return _STEP_RE.match(p.name) is not None and p.is_dir() and _read_marker(p) is not None


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete ``step_*`` directory under ``root``, oldest first."""
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and is_complete(child):
            out.append((int(m.group(1)), child))
    return sorted(out)


def _remove_checkpoint(path: Path) -> None:
    # Drop the marker first: an interrupted rmtree must never leave a directory
    # that still looks complete but is missing shards.
    try:
        (path / COMPLETE).unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def _summary(e: BaseException) -> str:
    """One line from an exception; DCP's CheckpointException (a BaseException) wraps the per-rank causes."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (exc, _) = sorted(failures.items(), key=lambda kv: kv[0])[0]
        return f"rank {rank}: {_summary(exc)}"
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


@contextmanager
def _quiet_single_process():
    # DCP warns on every single-process save/load that it "assumes the intent";
    # here that is the intent (no_dist is passed explicitly).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _has_optimizer_state(optimizer: torch.optim.Optimizer | None) -> bool:
    return optimizer is not None and any(len(s) > 0 for s in optimizer.state.values())


def _check_weights_only(obj: Any, what: str) -> bytes:
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means "not safely loadable"
        raise CheckpointError(f"{what} must hold only tensors and Python primitives (dict/list/tuple/int/float/str/bool/None) "
                              f"so it reloads with weights_only=True ({_summary(e)[:200]}); convert it, e.g. with capture_rng()") from None
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
        cause = self.cause if isinstance(self.cause, str) else _summary(self.cause)
        return CheckpointError(f"cannot write checkpoint {str(self.path)!r} ({cause}): it needs about {_fmt_bytes(self.needed)} "
                               f"(model + optimizer state) and {_fmt_bytes(_free_bytes(self.path))} is free there; free space, "
                               f"lower trainer.keep_last or move trainer.output_dir to a larger disk, and check it is writable "
                               f"(the previous checkpoint and 'latest' are untouched)")


# --------------------------------------------------------------------------- save
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
    rank, world = _rank_world()
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
    if _META_KEY in payload:
        raise CheckpointError(f"extra must not use the reserved key {_META_KEY!r}")
    payload[_META_KEY] = meta
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
            with _quiet_single_process():  # DCP agrees on its own failures across ranks
                dcp_save(state, storage_writer=FileSystemWriter(str(tmp)),
                         no_dist=not (dist.is_available() and dist.is_initialized()), process_group=process_group)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - OSError, torch's "enforce fail" RuntimeError, ...
            error = _WriteFailure(tmp, e, needed)
    if error is None:
        try:
            _write_atomic(tmp / f"extra_rank{rank}.pt", extra_bytes)
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

                _write_atomic(tmp / CONFIG_FILE, yaml.safe_dump(dict(config), sort_keys=False).encode())
            marker = {"format": FORMAT_VERSION, "step": int(step), "world_size": world, "has_optimizer_state": has_optim,
                      "time": time.time(), "files": _file_sizes(tmp)}
            _write_atomic(tmp / COMPLETE, (json.dumps(marker) + "\n").encode())
            if final.exists():  # re-saving a step (e.g. after resuming from it): swap it in, then drop the old one
                trash = root / f".trash-{name}-{os.getpid()}"
                os.rename(final, trash)
                try:
                    os.rename(tmp, final)
                except OSError:
                    os.rename(trash, final)
                    raise
                _remove_checkpoint(trash)
            else:
                os.rename(tmp, final)
            published = True
            _fsync_dir(root)
            _write_atomic(root / LATEST, (name + "\n").encode())
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
    if failed and cleanup is not None and _rank_world()[0] == 0:
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
        m = _TMP_RE.match(child.name)
        if m and int(m.group(1)) < step:
            shutil.rmtree(child, ignore_errors=True)
    if keep_last <= 0:
        return
    # Only checkpoints at or below the one just written are candidates; it is always kept.
    older = [(s, p) for s, p in _complete_checkpoints(root) if s <= step]
    for _, path in older[:-keep_last]:
        _remove_checkpoint(path)


# --------------------------------------------------------------------------- find
def find_latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (or None).

    ``latest`` is trusted when it names a complete directory and no complete
    directory has a higher step (a crash between the rename and the ``latest``
    update leaves the newer one complete); otherwise the ``step_*`` directories
    are scanned. ``.tmp-*`` directories and directories without ``COMPLETE``
    are never chosen.
    """
    root = Path(root)
    complete = _complete_checkpoints(root)
    if not complete:
        return None
    newest_step, newest = complete[-1]
    try:
        hinted = root / (root / LATEST).read_text().strip()
    except (OSError, ValueError):  # missing, unreadable, or garbage bytes (UnicodeDecodeError): only a hint
        return newest
    m = _STEP_RE.match(hinted.name)
    if m and hinted.parent == root and is_complete(hinted) and int(m.group(1)) >= newest_step:
        return hinted
    return newest


def _latest_problem(root: Path, chosen: Path) -> str | None:
    """Why ``root/latest`` did not name ``chosen`` (None when it did)."""
    f = root / LATEST
    try:
        text = f.read_bytes().decode().strip()
    except FileNotFoundError:
        return f"{str(f)!r} is missing"
    except (OSError, UnicodeDecodeError) as e:
        return f"{str(f)!r} is unreadable ({_summary(e)[:80]})"
    if not _STEP_RE.match(text) or "/" in text:
        return f"{str(f)!r} holds {text[:40]!r}, not a step_* name"
    if text == chosen.name:
        return None
    hinted = root / text
    if not hinted.is_dir():
        return f"{str(f)!r} names {text}, which does not exist"
    if not is_complete(hinted):
        return f"{str(f)!r} names {text}, which is not complete (no {COMPLETE} marker)"
    if _verify(hinted) is not None:
        return None  # reported as damaged on its own line
    return f"{str(f)!r} names {text}, but {chosen.name} is newer and complete (a save stopped before updating it)"


def find_resumable(root: str | os.PathLike, below: int | None = None) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint under ``root`` whose files check out (:func:`verify_checkpoint`), and a warning
    line for each thing that was not as ``latest`` and the markers said: ``latest`` missing, unreadable or naming
    an incomplete directory, and each damaged checkpoint skipped. ``below``: only steps lower than it (the
    fallback after one failed to load). (None, []) when there is no complete checkpoint; CorruptCheckpointError
    when every one is damaged (starting over silently would drop them all).
    """
    root = Path(root)
    complete = [(s, p) for s, p in _complete_checkpoints(root) if below is None or s < below]
    notes: list[str] = []
    first_damage: CorruptCheckpointError | None = None
    for _, path in reversed(complete):
        damage = _verify(path)
        if damage is None:
            problem = _latest_problem(root, path) if below is None else None
            if problem is not None:
                notes.append(f"warning: {problem}; resuming from the newest complete checkpoint, {path}")
            return path, notes
        err = _corrupt(path, *damage, hint=False)
        first_damage = first_damage or err
        notes.append(f"warning: skipping damaged checkpoint {path}: {damage[0]} {damage[1]}")
    if first_damage is None and below is None and complete == [] and (root / LATEST).exists():
        notes.append(f"warning: {str(root / LATEST)!r} is there but no complete checkpoint is; starting from step 0")
    if first_damage is not None:
        raise CorruptCheckpointError(f"no complete checkpoint under {str(root)!r} is intact ({len(complete)} damaged; the newest: "
                                     f"{first_damage.path.name}/{first_damage.file} {first_damage.problem}); start over with "
                                     f"trainer.resume=never (in a new trainer.output_dir to keep these files)",
                                     first_damage.path, first_damage.file, first_damage.problem)
    return None, notes


def _verify(path: Path) -> tuple[str, str] | None:
    """(file, what is wrong) for the first damaged file of complete checkpoint ``path``, None when its files check out.

    Sizes against COMPLETE's manifest (checkpoints written before it had one skip that), then ``.metadata``
    must unpickle (as DCP itself does on load) and every shard be as long as the index in it says.
    """
    marker = _read_marker(path) or {}
    files = marker.get("files")
    if isinstance(files, dict):
        for name, size in files.items():
            try:
                actual = (path / name).stat().st_size
            except OSError:
                return name, "is missing"
            if actual != size:
                return name, f"is {actual} bytes but the save wrote {size} (truncated or overwritten)"
    md = path / ".metadata"
    if not md.exists():
        return None  # no model state saved (or an old checkpoint missing it: the load then reports it)
    try:
        with open(md, "rb") as f:
            storage = pickle.load(f).storage_data  # noqa: S301 - DCP's own format, read exactly as its loader does
        ends: dict[str, int] = {}
        for info in storage.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), int(info.offset) + int(info.length))
    except Exception as e:  # noqa: BLE001 - truncated/garbled pickle: EOFError, UnpicklingError, AttributeError, ...
        return ".metadata", f"cannot be read ({_summary(e)[:120]})"
    for rel, end in sorted(ends.items()):
        try:
            size = (path / rel).stat().st_size
        except OSError:
            return rel, "is missing"
        if size < end:
            return rel, f"is {size} bytes but its index needs {end} (truncated)"
    return None


def _corrupt(path: Path, file: str, problem: str, hint: bool = True) -> CorruptCheckpointError:
    fix = ""
    if hint:
        m = _STEP_RE.match(path.name)
        older = None
        if m:
            try:
                older, _ = find_resumable(path.parent, below=int(m.group(1)))
            except CorruptCheckpointError:
                older = None
        fix = (f"; resume from the previous complete checkpoint, trainer.resume={older} (trainer.resume=auto skips damaged ones)"
               if older is not None else "; no older intact checkpoint: start over with trainer.resume=never")
    return CorruptCheckpointError(f"checkpoint {str(path)!r} is corrupt: {file} {problem}{fix}", path, file, problem)


def _shard_names(path: Path) -> str:
    """The shard file(s) of ``path``, for a message about one of them that cannot be read."""
    shards = sorted(f.name for f in path.glob("*.distcp"))
    if len(shards) == 1:
        return shards[0]
    return f"one of its shard files ({', '.join(shards[:4])}{', ...' if len(shards) > 4 else ''})" if shards else "its .metadata"


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Raise CorruptCheckpointError naming the file (and the previous intact checkpoint) if complete checkpoint
    ``path`` has a missing, truncated or unreadable file; cheap (sizes and ``.metadata`` only)."""
    path = Path(path)
    _require_complete(path)
    damage = _verify(path)
    if damage is not None:
        raise _corrupt(path, *damage)


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


# --------------------------------------------------------------------------- load
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


def _require_complete(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; pass a step_* directory or use find_latest(<run>/checkpoints)")
    marker = _read_marker(path)
    if marker is None or not _STEP_RE.match(path.name):
        raise CheckpointError(f"checkpoint {str(path)!r} is not a complete checkpoint (no {COMPLETE} marker or not a step_* directory); "
                              f"it is a crashed or partial save: use find_latest() to pick the newest complete one")
    return marker


def _load_extra(path: Path, rank: int) -> dict[str, Any]:
    f = path / f"extra_rank{rank}.pt"
    try:
        return torch.load(f, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise _corrupt(path, f.name, "is missing") from None
    except Exception as e:  # noqa: BLE001
        raise _corrupt(path, f.name, f"cannot be read ({_summary(e)[:120]})") from None


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
    marker = _require_complete(path)
    rank, world = _rank_world()
    saved_world = int(marker.get("world_size", -1))
    if saved_world != world:
        raise CheckpointError(f"checkpoint {str(path)!r} was written by {saved_world} ranks but this run has {world}; "
                              f"resume with the same number of ranks (or export it with hybrid_rl.export and start a new run)")
    verify_checkpoint(path)  # damaged files: a CorruptCheckpointError naming the file, not a "does not match" below
    extra = _load_extra(path, rank)
    meta = extra.pop(_META_KEY, None)
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
            with _quiet_single_process():
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
            raise _corrupt(path, name, f"cannot be read ({_summary(e)[:160]})") from e
        raise CheckpointError(f"checkpoint {str(path)!r} does not match this model/optimizer ({_summary(e)}); "
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


# --------------------------------------------------------------------------- RNG
def capture_rng(generators: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Python ``random``, numpy's global RNG, torch CPU, this device's CUDA RNG, and named generators.

    ``generators`` maps names to ``torch.Generator`` (any device) or
    ``numpy.random.Generator`` objects. The result holds only tensors and
    primitives, so it can go into ``extra``.
    """
    version, mt, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": [version, list(mt), gauss],
        "numpy": {"bit_generator": np_state["bit_generator"], "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
        "cuda": None,
        "generators": {},
    }
    if torch.cuda.is_available():
        state["cuda"] = {"device": torch.cuda.current_device(), "state": torch.cuda.get_rng_state()}
    for name, g in (generators or {}).items():
        if isinstance(g, torch.Generator):
            state["generators"][name] = {"kind": "torch", "state": g.get_state()}
        elif isinstance(g, np.random.Generator):
            state["generators"][name] = {"kind": "numpy", "state": json.dumps(g.bit_generator.state)}
        else:
            raise TypeError(f"capture_rng: generator {name!r} is a {type(g).__name__}, not a torch.Generator or numpy.random.Generator")
    return state


def restore_rng(state: Mapping[str, Any], generators: Mapping[str, Any] | None = None) -> None:
    """Inverse of :func:`capture_rng`; every name in ``generators`` must be in ``state``."""
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"], "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda["state"])
    saved = state.get("generators", {})
    for name, g in (generators or {}).items():
        if name not in saved:
            raise CheckpointError(f"RNG state has no generator {name!r} (it has {sorted(saved)}); capture it with capture_rng({{{name!r}: ...}})")
        entry = saved[name]
        if isinstance(g, torch.Generator) and entry["kind"] == "torch":
            g.set_state(entry["state"])
        elif isinstance(g, np.random.Generator) and entry["kind"] == "numpy":
            g.bit_generator.state = json.loads(entry["state"])
        else:
            raise CheckpointError(f"RNG state for {name!r} is a {entry['kind']} generator but a {type(g).__name__} was passed")


# --------------------------------------------------------------------------- export
def export_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, model_path: str,
              lora: tuple[int, int, list[str], float] | None = None, merge_lora: bool = True,
              trust_remote_code: bool = False, dtype: torch.dtype | None = None) -> Path:
    """Write a Hugging Face model directory (safetensors + tokenizer) from a checkpoint, in this process alone.

    The model is rebuilt from ``model_path`` (plus LoRA ``(rank, alpha,
    target_modules, dropout)`` when given, exactly as the trainer built it),
    the checkpoint's model weights are loaded with DCP (``no_dist``: any saving
    world size reshards into the plain module), and then either the adapters
    are merged (default; ``from_pretrained(out_dir)`` loads a plain model) or,
    with ``merge_lora=False``, only the adapters are saved (peft's
    ``adapter_model.safetensors`` + ``adapter_config.json``). ``dtype`` None
    keeps the base model's dtype (its ``config.json``); training masters are fp32.
    ``out_dir`` must not exist or be empty.
    """
    from torch.distributed.checkpoint import CheckpointException, FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    from hybrid_rl.models import apply_lora, load_causal_lm, load_tokenizer

    ckpt = Path(checkpoint)
    verify_checkpoint(ckpt)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"export directory {str(out)!r} exists and is not empty; remove it or pick another output directory")
    if lora is None and not merge_lora:
        raise CheckpointError(f"adapters-only export of {str(ckpt)!r} needs LoRA settings, but the run trained the full model (model.lora.rank=0); "
                              f"export the merged model instead")

    model = load_causal_lm(model_path, torch.float32, trust_remote_code)
    target_dtype = dtype if dtype is not None else _config_dtype(model)
    if lora is not None:
        rank, alpha, target_modules, dropout = lora
        model = apply_lora(model, rank, alpha, list(target_modules), dropout)
    state = {k: v for k, v in model.state_dict().items()}
    try:
        with _quiet_single_process():
            dcp_load({"model": state}, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {str(ckpt)!r} does not match the model rebuilt from {model_path!r} "
                              f"(lora rank {0 if lora is None else lora[0]}): {_summary(e)}; use the run's model.path and model.lora settings") from e
    # DCP loads plain tensors in place (they share storage with the parameters);
    # load_state_dict makes that explicit and checks every key was covered.
    model.load_state_dict(state, strict=True)
    model.eval()

    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    if lora is not None and merge_lora:
        model = model.merge_and_unload()
    model.to(target_dtype)
    # A merged/plain model writes config.json + model.safetensors; a PeftModel
    # (merge_lora=False) writes adapter_model.safetensors + adapter_config.json only.
    model.save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(model_path, trust_remote_code).save_pretrained(tmp)
    if out.exists():
        out.rmdir()  # empty, checked above
    out.parent.mkdir(parents=True, exist_ok=True)
    os.rename(tmp, out)
    return out


def _config_dtype(model: torch.nn.Module) -> torch.dtype:
    d = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else torch.float32
