"""The checkpoint directory format: names, the ``COMPLETE`` marker, atomic file writes, and the newest complete step.

A ``step_*`` directory is complete only when it holds ``COMPLETE`` (written last); ``latest`` is a hint that
:func:`find_latest` checks against the markers. The helpers here (rank, atomic writes, one-line error summaries)
are shared by the saving, loading and integrity modules.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

COMPLETE = "COMPLETE"
LATEST = "latest"
CONFIG_FILE = "config.yaml"
CHECKPOINT_SUBDIR = "checkpoints"
"""Where the trainer should put checkpoints inside its run directory (``<output_dir>/checkpoints``)."""
FORMAT_VERSION = 1
STEP_RE = re.compile(r"^step_(\d+)$")
TMP_RE = re.compile(r"^\.tmp-step_(\d+)$")
META_KEY = "__hybrid_rl_checkpoint__"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, found or loaded; the message names the path and the fix."""


class CorruptCheckpointError(CheckpointError):
    """A complete checkpoint whose files are damaged (truncated, missing, unreadable); an older one may still load."""

    def __init__(self, message: str, path: Path, file: str, problem: str):
        super().__init__(message)
        self.path, self.file, self.problem = path, file, problem


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def fsync_dir(path: Path) -> None:
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


def write_atomic(path: Path, data: bytes) -> None:
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
    fsync_dir(path.parent)


def read_marker(path: Path) -> dict[str, Any] | None:
    """The parsed COMPLETE marker of ``path``, or None when it is missing or unreadable."""
    try:
        marker = json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_complete(path: str | os.PathLike) -> bool:
    p = Path(path)
    return STEP_RE.match(p.name) is not None and p.is_dir() and read_marker(p) is not None


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete ``step_*`` directory under ``root``, oldest first."""
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = STEP_RE.match(child.name)
        if m and is_complete(child):
            out.append((int(m.group(1)), child))
    return sorted(out)


def remove_checkpoint(path: Path) -> None:
    # Drop the marker first: an interrupted rmtree must never leave a directory
    # that still looks complete but is missing shards.
    try:
        (path / COMPLETE).unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def error_summary(e: BaseException) -> str:
    """One line from an exception; DCP's CheckpointException (a BaseException) wraps the per-rank causes."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (exc, _) = sorted(failures.items(), key=lambda kv: kv[0])[0]
        return f"rank {rank}: {error_summary(exc)}"
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


@contextmanager
def quiet_single_process():
    # DCP warns on every single-process save/load that it "assumes the intent";
    # here that is the intent (no_dist is passed explicitly).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def require_complete(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; pass a step_* directory or use find_latest(<run>/checkpoints)")
    marker = read_marker(path)
    if marker is None or not STEP_RE.match(path.name):
        raise CheckpointError(f"checkpoint {str(path)!r} is not a complete checkpoint (no {COMPLETE} marker or not a step_* directory); "
                              f"it is a crashed or partial save: use find_latest() to pick the newest complete one")
    return marker



def find_latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (or None).

    ``latest`` is trusted when it names a complete directory and no complete
    directory has a higher step (a crash between the rename and the ``latest``
    update leaves the newer one complete); otherwise the ``step_*`` directories
    are scanned. ``.tmp-*`` directories and directories without ``COMPLETE``
    are never chosen.
    """
    root = Path(root)
    complete = complete_checkpoints(root)
    if not complete:
        return None
    newest_step, newest = complete[-1]
    try:
        hinted = root / (root / LATEST).read_text().strip()
    except (OSError, ValueError):  # missing, unreadable, or garbage bytes (UnicodeDecodeError): only a hint
        return newest
    m = STEP_RE.match(hinted.name)
    if m and hinted.parent == root and is_complete(hinted) and int(m.group(1)) >= newest_step:
        return hinted
    return newest

