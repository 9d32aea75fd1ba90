"""The build cache for built-in models: one complete directory per model, safe for many ranks and hosts at once.

A cached directory is complete only when it holds ``BUILD_MARKER``, written last (after every file it vouches for
is fsynced), whose ``stamp`` matches what the caller would build now; anything else there is rebuilt, never
returned, because many ranks (and hosts, over NFS) build and read the cache at once. A build runs in a hidden
sibling directory of its own and is renamed into place with the marker already inside, under a file lock that only
saves duplicate work: where the lock does not exclude, builders race and the atomic rename settles it. What is
built, and its stamp, is the caller's (``models.py``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Callable

BUILD_MARKER = ".hybrid_rl_complete"
STALE_AFTER_S = 6 * 3600  # temp/aside directories older than this belong to dead builders
LOCK_WAIT_S = 900.0  # after this, build without the lock (the rename keeps that safe), e.g. a hung NFS lock


def cache_dir() -> Path:
    """Where built-in models are materialised (``$HYBRID_RL_CACHE`` or ``~/.cache/hybrid_rl``)."""
    return Path(os.environ.get("HYBRID_RL_CACHE", Path.home() / ".cache" / "hybrid_rl"))


NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST)
"""The ``errno`` values of a directory this process cannot write: no permission, a read-only file system, a file in
the way (as opposed to a full disk, ``ENOSPC``)."""


def unwritable(path: Path) -> Path | None:
    """The directory that stops this process from creating ``path`` (``path`` itself, or its nearest existing
    ancestor, when this user may not write there), or None. Nothing is created."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return None
    return existing


def holds_build(out: Path, stamp: str) -> bool:
    """Whether ``out`` is a finished build whose marker carries ``stamp``."""
    try:
        marker = json.loads((out / BUILD_MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not (isinstance(marker, dict) and marker.get("stamp") == stamp):
        return False
    # the marker alone once vouched for a build whose weights were never written (a rank > 0 build: see
    # models.save_on_any_rank); the files it stands for must be there too
    return (out / "config.json").is_file() and any(out.glob("*.safetensors"))


def _unique_sibling(out: Path, kind: str) -> Path:
    # host + pid + random: unique across hosts that share the directory (pids repeat across containers)
    return out.with_name(f".{out.name}.{kind}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove(path: Path) -> None:
    """Remove a file or directory tree, ignoring errors."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


def _fsync_tree(root: Path) -> None:
    # the marker must never reach the disk (or the NFS server) before the files it vouches for
    for f in root.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def stage_build(out: Path, write: Callable[[Path], None], marker: dict[str, Any]) -> Path:
    """Build into a fresh hidden sibling of ``out`` (``write(tmp)``), ``marker`` (holding the ``stamp``) last;
    return it (removed on failure)."""
    tmp = _unique_sibling(out, "tmp")
    try:
        tmp.mkdir()
        write(tmp)
        _fsync_tree(tmp)
        with open(tmp / BUILD_MARKER, "w") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        remove(tmp)
        raise
    return tmp


def _install(tmp: Path, out: Path, stamp: str) -> None:
    """Rename the finished build ``tmp`` to ``out``; a complete ``out`` wins, an incomplete one is replaced."""
    for _ in range(20):
        try:
            os.rename(tmp, out)  # atomic; replaces only a missing or empty directory
            return
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR, errno.EBUSY):
                raise
        if holds_build(out, stamp):  # lost the race to a complete build: use the winner's
            remove(tmp)
            return
        aside = _unique_sibling(out, "stale")
        try:
            os.rename(out, aside)
        except FileNotFoundError:  # another builder moved it first
            continue
        if holds_build(aside, stamp):
            # it was finished between our check and the move (another host's rename): put it back
            try:
                os.rename(aside, out)
            except OSError:
                pass  # yet another complete build took the place meanwhile
            else:
                remove(tmp)
                return
        remove(aside)
    raise OSError(errno.EBUSY, f"{out} kept changing while installing a fresh build")


def _sweep_leftovers(out: Path) -> None:
    """Remove temp and set-aside directories of builders that died long ago (interrupted runs)."""
    now = time.time()
    for p in out.parent.glob(f".{out.name}.*-*"):
        if p.name.startswith((f".{out.name}.tmp-", f".{out.name}.stale-")):
            try:
                old = now - p.lstat().st_mtime > STALE_AFTER_S
            except OSError:
                continue
            if old:
                remove(p)


def _wait_for_lock(lock_file, ready: Callable[[], bool]) -> bool:
    """Take an exclusive flock on ``lock_file``; False if ``ready()`` came true first (nothing to build).

    The lock only saves duplicate work: where it does not exclude (NFS without lockd,
    hosts that each lock locally) or is unsupported, builders race and the atomic rename
    in ``_install`` settles it. So an unusable lock or a long wait means "build anyway".
    """
    try:
        import fcntl
    except ImportError:  # not POSIX
        return True
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError:  # ENOLCK / EOPNOTSUPP
            return True
        if ready():  # another process (maybe on another host) finished meanwhile
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.2)


def build_once(out: Path, stamp: str, write: Callable[[Path], None], marker: dict[str, Any]) -> None:
    """Make ``out`` a complete build with ``stamp`` unless another builder does first: one builder per host under
    ``.<name>.lock``, the build staged beside ``out`` (``stage_build``) and renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as lock:
        if _wait_for_lock(lock, lambda: holds_build(out, stamp)) and not holds_build(out, stamp):
            _sweep_leftovers(out)
            _install(stage_build(out, write, marker), out, stamp)
