"""One run per output directory: ``<trainer.output_dir>/run.lock``, held by global rank 0 for the whole run.

Two runs on one ``trainer.output_dir`` (seeds 0 and 1, a relaunch while the first still runs) overwrite each
other's metrics, checkpoints and ``latest`` and both exit 0. So the first thing a run does, before it writes
anything, is take an exclusive ``fcntl.flock`` on ``run.lock`` and keep the file open until ``fit`` ends. The
kernel drops a flock when its holder dies however it dies (SIGKILL, OOM killer), so a live holder is the truth,
also across hosts where the filesystem supports flock (local disks, NFSv4, Lustre mounted with ``flock``). The file
holds one JSON object describing the holder (pid, host, start time, command) for the refusal message; a clean end
empties it. A description with no flock holder is a run that was killed: it is taken over with a warning (its
complete checkpoints stay, ``trainer.resume=auto`` continues them). Where the filesystem refuses flock, the
description is all there is: a pid alive on this host (same process start time) still owns the directory, and a
holder on another host is taken for alive.

Under torchrun only rank 0 locks (ranks of one run must not lock each other out); the other ranks wait for its
verdict (one broadcast) so that every rank of a refused run stops with the same line before writing anything.
A run refused during set-up (bad data, a reward function that cannot load) calls ``release(discard=True)``: the
lock file it created and the directories it created for it go again, if nothing else was written there; a directory
or lock file that was there before stays. Left out: waiting for the lock to free up, and locking anything but the
output directory (a checkpoint path given to ``trainer.resume`` is only read).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
import weakref
from pathlib import Path
from typing import Any

LOCK_NAME = "run.lock"


class RunLockError(RuntimeError):
    """``trainer.output_dir`` is in use by another run (or cannot be locked); the message names it and the fix."""


def _proc_start(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22): tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _pid_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    now = _proc_start(pid)
    return start is None or now is None or now == start


def _describe(info: dict[str, Any]) -> str:
    agent = f" (rank 0 of the torchrun agent pid {info['agent_pid']})" if info.get("agent_pid") else ""
    return (f"pid {info.get('pid', '?')}{agent} on host {info.get('host', '?')}, started {info.get('started', '?')}, "
            f"command: {info.get('command', '?')}")


def _read_info(fd: int) -> dict[str, Any] | None:
    """The holder's description; None for an empty file (a clean end), {} for an unreadable one."""
    raw = os.pread(fd, 1 << 16, 0)
    if not raw.strip():
        return None
    try:
        info = json.loads(raw.decode("utf-8", "replace"))
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _my_info() -> dict[str, Any]:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:  # python -m hybrid_rl (also under torchrun): argv[0] is .../__main__.py
        prog = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:
        prog = [Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"]
    command = shlex.join([*prog, *sys.argv[1:]])
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "pid_start": _proc_start(os.getpid()), "command": command[:300],
            "agent_pid": os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None}


def _release_fd(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)  # a clean end: the next run takes the directory without a warning
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass
    finally:
        os.close(fd)


class RunLock:
    """The held lock (or a no-op one on ranks other than 0); ``release`` is idempotent and also runs at exit.

    ``created``: what ``acquire`` made for it, the lock file and the directories, innermost first."""

    def __init__(self, path: Path | None, fd: int | None, created: tuple[Path, ...] = ()):
        self.path = path
        self.created = created
        self._finalizer = weakref.finalize(self, _release_fd, fd) if fd is not None else None

    @property
    def held(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def release(self, discard: bool = False) -> None:
        """Unlock. ``discard`` (a run refused before it wrote anything): also remove what ``acquire`` created, the
        lock file and then each directory while it is empty; nothing else is touched."""
        if self._finalizer is None or not self._finalizer.alive:
            return
        self._finalizer()
        if discard:
            _remove_created(self.created)


def _remove_created(created: tuple[Path, ...]) -> None:
    for p in created:
        try:
            p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
        except OSError:  # not empty (something else was written there) or gone: leave it and everything above
            return


def acquire(output_dir: str | os.PathLike) -> RunLock:
    """Lock ``output_dir`` for this process; RunLockError naming the live holder if another run has it."""
    out = Path(output_dir)
    key = f"trainer.output_dir={str(output_dir)!r}"
    path = out / LOCK_NAME
    created = [d for d in (out, *out.parents) if not os.path.lexists(d)]
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(path):
            created.insert(0, path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        _remove_created(tuple(d for d in created if d != path))
        raise RunLockError(f"{key} cannot be written ({type(e).__name__}: {e.strerror or e}); "
                           f"choose a writable trainer.output_dir") from e
    try:
        fd_ok = _lock_or_explain(fd, path, key)
    except BaseException:
        os.close(fd)
        raise
    return RunLock(path, fd_ok, tuple(created))


def _lock_or_explain(fd: int, path: Path, key: str) -> int:
    flock_works = True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            # EWOULDBLOCK: a live process holds it
            raise RunLockError(_in_use(key, _read_info(fd), path)) from None
        flock_works = False
    info = _read_info(fd)
    if info:
        here = info.get("host") == socket.gethostname()
        pid = info.get("pid")
        mine = here and pid == os.getpid()
        if not mine and isinstance(pid, int) and (
                (here and _pid_alive(pid, info.get("pid_start"))) or (not here and not flock_works)):
            # flock granted (or unsupported) yet the recorded run lives: the file was replaced under it, or this
            # filesystem ignores flock; the description decides
            raise RunLockError(_in_use(key, info, path))
        print(f"warning: {key} was locked by a run that is gone ({_describe(info)}): killed or crashed, so its lock "
              f"is taken over; its complete checkpoints stay and trainer.resume=auto continues from the newest",
              file=sys.stderr, flush=True)
    elif info == {}:
        print(f"warning: {path} held no readable run description; taking the lock over", file=sys.stderr, flush=True)
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(_my_info()) + "\n").encode(), 0)
    return fd


def _in_use(key: str, info: dict[str, Any] | None, path: Path) -> str:
    who = _describe(info) if info else "a run whose description is not written yet"
    pid = info.get("pid") if info else None
    stop = f"kill {pid}" if isinstance(pid, int) else "stop it"
    if isinstance(pid, int) and info.get("host") == socket.gethostname() and not _pid_alive(pid, info.get("pid_start")):
        # the run died, but a process it forked inherited the open lock file and still holds it
        stop = f"pid {pid} is gone, but a process it started still holds the lock: find it with fuser -v {path}"
    return (f"{key} is in use by another run ({who}); two runs in one directory overwrite each other's metrics and "
            f"checkpoints: set another trainer.output_dir, or wait for that run to end or stop it ({stop}); "
            f"lock file {path}")


def take_run_lock(output_dir: str | os.PathLike, rank: int, world_size: int) -> RunLock:
    """Rank 0 locks ``output_dir``; under a process group every rank learns the verdict and raises the same line."""
    import torch.distributed as dist

    shared = world_size > 1 and dist.is_available() and dist.is_initialized()
    lock, error = RunLock(None, None), None
    if rank == 0:
        try:
            lock = acquire(output_dir)
        except RunLockError as e:
            error = str(e)
    if shared:
        verdict = [error]
        dist.broadcast_object_list(verdict, src=0)  # the others wait here: nothing is written before rank 0 holds it
        error = verdict[0]
    if error is not None:
        raise RunLockError(error)
    return lock
