"""Run a model-written Python snippet in a subprocess with resource limits: the ``python`` tool's execution core.

A tool-using rollout runs code that a policy wrote, for many trajectories at once; a snippet that loops, allocates
10 GB, forks, prints 100 MB, writes huge files or kills itself must come back as a short observation while the
trainer keeps running. :func:`run_python` gives each snippet:

- a fresh interpreter, ``python -I -S -X utf8`` (isolated mode: no ``PYTHON*`` variables, no user or site
  packages, so only the standard library imports), in a new session whose process group is killed when the
  snippet ends or its wall-clock time runs out, so background children die with it;
- an environment holding only ``PATH``: nothing of the trainer's (tokens, keys) is passed on;
- a fresh temporary directory as its working directory, removed afterwards;
- ``setrlimit`` limits (:class:`SandboxLimits`): CPU time, address space, size of a written file, open files,
  processes, and no core dumps. The limits are set by a small launcher that then execs the snippet's
  interpreter, because ``preexec_fn`` is unsafe in a process with threads (the trainer has many);
- when the trainer runs as root, the uid and gid ``nobody`` (root ignores the process limit and may write
  anywhere), with an interpreter that uid can run (:func:`sandbox_python`);
- stdout and stderr read as they come, in chunks, keeping the first ``max_output_bytes`` of each and discarding the
  rest, decoded as UTF-8 with replacement characters (``SandboxResult.invalid_utf8`` says when one was needed).

What it does not protect against (it is not a container, a VM or seccomp; for untrusted code at scale use a
sandbox service):

- the network: the snippet can open sockets and reach whatever the machine reaches;
- the filesystem: it reads every file its uid may read and writes wherever its uid may write (``/tmp`` is shared
  and nothing written outside its own directory is removed). Only the size of each file is capped, not their number
  or total. Running as the trainer's own (non-root) uid, it may also read the trainer's files and
  ``/proc/<pid>/environ``;
- other processes of its uid: it may signal them (the trainer, when they share a uid; other snippets, under
  ``nobody``);
- a process that leaves the group (``os.setsid()``, ``os.setpgid``) is not killed with it; its CPU time is
  still capped by the CPU limit, which every process of the snippet inherits;
- the snippet's killed children are reaped by the machine's init: in a container whose PID 1 does not reap
  orphans (``docker run`` without ``--init``), they stay zombies, which hold a pid each and count towards
  ``RLIMIT_NPROC``;
- ``RLIMIT_NPROC`` counts every process *and thread* of the uid on the whole machine, not the snippet's own:
  with the trainer's own uid and a trainer that already runs more threads than ``max_processes``, the snippet
  cannot fork or start a thread at all; under ``nobody``, all concurrent snippets share the count. Root ignores the
  limit, hence the switch to ``nobody``. Treat it as best effort: the wall-clock kill of the group is what bounds a
  fork bomb in time;
- memory is capped per process (``RLIMIT_AS``, address space), not for the group; the limits bound each
  snippet, not the machine's load when many run at once.

Linux only: on another platform :func:`run_python` raises :class:`SandboxUnavailable` instead of running code
without limits.
"""

from __future__ import annotations

import codecs
import functools
import logging
import os
import pwd
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal, Optional

from hybrid_rl.config.errors import ConfigError, require_positive

log = logging.getLogger(__name__)

ErrorKind = Literal["timeout", "cpu_limit", "memory", "file_size", "killed", "nonzero_exit"]
"""How a snippet ended when it did not exit with status 0."""

SCRIPT_NAME = "main.py"
"""The snippet's file in its working directory (the name its tracebacks show)."""
_CHILD_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin"}
_CHUNK = 1 << 16
_DRAIN_S = 1.0  # after the group is killed, how long the pipes may take to reach EOF (a process outside holds them)
_POLL_S = 0.01  # without a pidfd (Linux < 5.3), how often the loop checks whether the snippet exited
_LAUNCHER_FAILED = 127
_FALLBACK_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")

# Runs in the child before the snippet: set the limits (capped at the hard limits this process already has, which
# it may not raise), then exec the snippet's interpreter; a failure is reported on the status pipe, whose
# close-on-exec end reads EOF once the exec succeeded.
_LAUNCHER = """\
import os, resource, sys
status = int(sys.argv[1])
os.set_inheritable(status, False)
try:
    for name, soft, hard in zip(sys.argv[2::3], sys.argv[3::3], sys.argv[4::3]):
        res = getattr(resource, name)
        ceiling = resource.getrlimit(res)[1]
        soft, hard = int(soft), int(hard)
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        resource.setrlimit(res, (soft, hard))
    os.execv(sys.executable, [sys.executable, "-I", "-S", "-X", "utf8", %r])
except BaseException as e:
    os.write(status, f"{type(e).__name__}: {e}".encode("utf-8", "replace"))
    os._exit(%d)
""" % (SCRIPT_NAME, _LAUNCHER_FAILED)


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run on this machine (not Linux, or the interpreter cannot start under its uid)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one snippet may use; the defaults fit a calculator-like tool called for many trajectories at once."""

    timeout_s: float = 5.0
    """Wall-clock seconds from start until the snippet's process group is killed."""
    cpu_s: int = 4
    """CPU seconds per process (``RLIMIT_CPU``): SIGXCPU at this, SIGKILL one second later."""
    memory_mb: int = 512
    """Address space per process in MiB (``RLIMIT_AS``); an allocation beyond it raises ``MemoryError``."""
    file_size_mb: int = 16
    """Largest file the snippet may write, in MiB (``RLIMIT_FSIZE``); a write beyond it fails with EFBIG."""
    max_open_files: int = 64
    """Open file descriptors per process (``RLIMIT_NOFILE``)."""
    max_processes: int = 64
    """``RLIMIT_NPROC``: processes and threads of the snippet's uid on the whole machine (best effort, see above)."""
    max_output_bytes: int = 65536
    """Bytes of stdout, and separately of stderr, kept; the rest is read and discarded, and the result is marked
    truncated."""

    def validate(self, prefix: str = "sandbox") -> None:
        """Raise :class:`ConfigError` naming ``prefix.field`` for a limit that cannot work."""
        if not self.timeout_s > 0:
            raise ConfigError(f"{prefix}.timeout_s={self.timeout_s} must be > 0 seconds")
        require_positive(self, prefix, ["cpu_s", "file_size_mb", "max_open_files", "max_processes",
                                        "max_output_bytes"])
        if self.memory_mb < 32:
            raise ConfigError(f"{prefix}.memory_mb={self.memory_mb} is too small for the interpreter to start; "
                              "set it to 32 or more")
        if self.max_open_files < 8:
            raise ConfigError(f"{prefix}.max_open_files={self.max_open_files} is too few for the interpreter; "
                              "set it to 8 or more")

    def rlimits(self) -> list[tuple[str, int, int]]:
        """``(RLIMIT_name, soft, hard)`` for each limit the launcher sets."""
        mib = 1 << 20
        return [("RLIMIT_CPU", self.cpu_s, self.cpu_s + 1),
                ("RLIMIT_AS", self.memory_mb * mib, self.memory_mb * mib),
                ("RLIMIT_FSIZE", self.file_size_mb * mib, self.file_size_mb * mib),
                ("RLIMIT_NOFILE", self.max_open_files, self.max_open_files),
                ("RLIMIT_NPROC", self.max_processes, self.max_processes),
                ("RLIMIT_CORE", 0, 0)]


@dataclass(frozen=True)
class SandboxResult:
    """How one snippet went; :meth:`observation` is what the model reads."""

    stdout: str
    """The first ``max_output_bytes`` of stdout, decoded as UTF-8 (invalid bytes become U+FFFD)."""
    stderr: str
    """The first ``max_output_bytes`` of stderr, decoded the same way."""
    exit_code: int
    """The exit status; ``-N`` when signal N ended the snippet (as ``subprocess`` reports it)."""
    error_kind: Optional[ErrorKind]
    """``None`` when the snippet exited with status 0 within its wall-clock time."""
    error_detail: str
    """One line on how it ended when ``error_kind`` is set (empty otherwise), e.g. ``exit code 1: ValueError: x``."""
    truncated: bool
    """Whether stdout or stderr was longer than ``max_output_bytes`` and cut."""
    wall_s: float
    """Seconds from start to the working directory's removal."""
    cpu_s: float
    """User plus system CPU seconds of the snippet's main process (and the children it waited for)."""
    invalid_utf8: bool = False
    """Whether stdout or stderr held bytes that are not UTF-8 (a character cut by ``max_output_bytes`` is not)."""

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    def observation(self, max_chars: int = 2000) -> str:
        """The text the model sees: stdout, then (on success) stderr, then an ``error: ...`` line; at most
        ``max_chars`` characters, the error line kept whole when it fits in half of them."""
        tail = []
        if self.truncated:
            tail.append("[output truncated]")
        if self.error_kind is not None:
            tail.append(f"error: {self.error_detail}")
        footer = _clip("\n".join(tail), max_chars // 2)
        parts = [self.stdout.rstrip("\n")]
        if self.error_kind is None and self.stderr.strip():
            parts.append("stderr:\n" + self.stderr.rstrip("\n"))
        body = "\n".join(p for p in parts if p)
        if not body and not footer:
            return "(no output)"
        room = max_chars - len(footer) - (1 if body and footer else 0)
        return "\n".join(p for p in (_clip(body, room), footer) if p)


def _clip(text: str, n: int) -> str:
    """``text`` cut to at most ``n`` characters, saying how many it lost."""
    if len(text) <= n:
        return text
    for keep in range(n, -1, -1):  # the marker's length depends on the number it names
        marker = f"... [{len(text) - keep} more characters]"
        if keep + len(marker) <= n:
            return text[:keep] + marker
    return text[:n]


class _Capped:
    """The first ``cap`` bytes of a stream; later bytes are dropped and the stream marked truncated."""

    def __init__(self, cap: int) -> None:
        self.data = bytearray()
        self.cap = cap
        self.truncated = False

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if len(chunk) > room:
            self.truncated = True
        if room > 0:
            self.data += chunk[:room]

    def decoded(self) -> tuple[str, bool]:
        """The bytes kept as text, and whether any were not UTF-8 (:func:`decode_utf8`)."""
        return decode_utf8(bytes(self.data), cut=self.truncated)


def decode_utf8(raw: bytes, cut: bool) -> tuple[str, bool]:
    """``raw`` as text, and whether any of it was not UTF-8 (those bytes become U+FFFD). Where ``raw`` was ``cut``
    from longer output, a last character the cut split in two is dropped, not counted as invalid."""
    try:  # not final when cut: an incomplete last character is held back, not an error
        return codecs.getincrementaldecoder("utf-8")().decode(raw, final=not cut), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), True


def run_python(code: str, *, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` as a Python 3 script under ``limits`` and report how it went (module docstring: what is and is
    not contained). Thread-safe: calls from many threads run side by side. A snippet's faults (exceptions, limits,
    signals, huge or invalid output) are in the result; only a sandbox that cannot start raises."""
    if sys.platform != "linux":
        raise SandboxUnavailable(f"the python tool's sandbox needs Linux (process groups, setrlimit), not "
                                 f"{sys.platform}: run rollouts that use the python tool on Linux")
    limits.validate()
    python = sandbox_python()  # probed on the first call, before its clock starts
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="hybrid_rl_sandbox_")
    try:
        uid, gid = _child_ids()
        script = os.path.join(workdir, SCRIPT_NAME)
        with open(script, "w", encoding="utf-8", errors="replace") as f:
            f.write(code)
        if uid is not None:
            os.chown(workdir, uid, gid)
            os.chown(script, uid, gid)
        exit_code, cpu_s, timed_out, out, err = _run(python, workdir, uid, gid, limits, start)
    finally:
        _remove_tree(workdir)
    (stdout, bad_out), (stderr, bad_err) = out.decoded(), err.decoded()
    kind, detail = _classify(exit_code, cpu_s, timed_out, stderr, limits)
    return SandboxResult(stdout=stdout, stderr=stderr, exit_code=exit_code, error_kind=kind, error_detail=detail,
                         truncated=out.truncated or err.truncated, wall_s=time.monotonic() - start, cpu_s=cpu_s,
                         invalid_utf8=bad_out or bad_err)


def _child_ids() -> tuple[Optional[int], Optional[int]]:
    """``(uid, gid)`` of ``nobody`` when this process is root, else ``(None, None)`` (keep our own)."""
    if os.geteuid() != 0:
        return None, None
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


@functools.lru_cache(maxsize=None)
def sandbox_python() -> str:
    """The interpreter that runs snippets (the launcher execs the same one): this process's own, unless it
    runs as root and ``nobody`` cannot run it (a virtual environment under ``/root``), then the first of
    ``/usr/bin/python3`` and ``/usr/local/bin/python3`` that ``nobody`` can run; probed once per process. Snippets
    import only the standard library, so any Python 3 serves."""
    uid, gid = _child_ids()
    if uid is None:
        return sys.executable
    tried = []
    for python in dict.fromkeys((sys.executable, *_FALLBACK_PYTHONS)):
        try:
            probe = subprocess.run([python, "-I", "-S", "-c", "import encodings, json, math"], cwd="/",
                                   env=_CHILD_ENV, stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
                                   user=uid, group=gid, extra_groups=[])
        except (OSError, subprocess.TimeoutExpired) as e:
            tried.append(f"{python} ({getattr(e, 'strerror', None) or type(e).__name__})")
            continue
        if probe.returncode == 0:
            if python != sys.executable:
                log.info("the python tool runs snippets with %s: uid %d cannot run %s", python, uid, sys.executable)
            return python
        tried.append(f"{python} (exit {probe.returncode})")
    raise SandboxUnavailable(f"the python tool's sandbox runs snippets as uid {uid} (nobody) because this process "
                             f"is root, and that uid can run none of {', '.join(tried)}: install a Python 3 every "
                             f"user can run as /usr/bin/python3, or run the trainer as a non-root user")


def _run(python: str, workdir: str, uid: Optional[int], gid: Optional[int], limits: SandboxLimits,
         start: float) -> tuple[int, float, bool, _Capped, _Capped]:
    """Start the launcher with ``python`` in ``workdir``, collect its output until it ends or times out, kill its
    group and reap it: ``(exit_code, cpu_s, timed_out, stdout, stderr)``."""
    status_r, status_w = os.pipe()
    args = [python, "-I", "-S", "-c", _LAUNCHER, str(status_w)]
    for name, soft, hard in limits.rlimits():
        args += [name, str(soft), str(hard)]
    try:
        proc = subprocess.Popen(args, cwd=workdir, env=_CHILD_ENV, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, bufsize=0, start_new_session=True, pass_fds=(status_w,),
                                user=uid, group=gid, extra_groups=[] if uid is not None else None)
    except OSError as e:
        os.close(status_r)
        raise SandboxUnavailable(f"the python tool's sandbox could not start {python}"
                                 f"{'' if uid is None else f' as uid {uid}'}: {e}") from e
    finally:
        os.close(status_w)
    try:
        with os.fdopen(status_r, "rb") as status:
            failure = status.read()  # EOF as soon as the launcher's exec of the snippet succeeded
        if failure:
            raise SandboxUnavailable(f"the python tool's sandbox could not set its limits or start the snippet: "
                                     f"{failure.decode('utf-8', 'replace')}")
        out, err, timed_out = _collect(proc, limits, start)
    finally:
        _kill_group(proc.pid)
        _, wait_status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
        proc.stdout.close()
        proc.stderr.close()
    return proc.returncode, usage.ru_utime + usage.ru_stime, timed_out, out, err


def _collect(proc: subprocess.Popen, limits: SandboxLimits, start: float) -> tuple[_Capped, _Capped, bool]:
    """Read both pipes until the snippet has exited and its group is killed, or ``timeout_s`` has passed: then
    kill the group and drain what is left. Returns ``(stdout, stderr, timed_out)``; the process is left unreaped
    (a zombie keeps its pid, so the group's id cannot be reused before it is killed)."""
    out, err = _Capped(limits.max_output_bytes), _Capped(limits.max_output_bytes)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    try:
        pidfd: Optional[int] = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ, None)
    except (AttributeError, OSError):
        pidfd = None
    exited = group_killed = timed_out = False
    deadline = start + limits.timeout_s
    try:
        while True:
            if not group_killed and (exited or (pidfd is None and _has_exited(proc.pid))):
                _kill_group(proc.pid)  # background children of a finished snippet die with it
                group_killed, deadline = True, time.monotonic() + _DRAIN_S
            pipes_open = any(k.data is not None for k in sel.get_map().values())
            now = time.monotonic()
            if group_killed and (not pipes_open or now >= deadline):
                break
            if now >= deadline:
                _kill_group(proc.pid)
                timed_out = group_killed = True
                deadline = now + _DRAIN_S
                continue
            wait = deadline - now if pidfd is not None or group_killed else min(deadline - now, _POLL_S)
            for key, _ in sel.select(wait):
                if key.data is None:
                    exited = True
                    sel.unregister(key.fileobj)
                    continue
                chunk = os.read(key.fd, _CHUNK)
                if chunk:
                    key.data.add(chunk)
                else:
                    sel.unregister(key.fileobj)
    finally:
        sel.close()
        if pidfd is not None:
            os.close(pidfd)
    return out, err, timed_out


def _has_exited(pid: int) -> bool:
    """Whether ``pid`` has exited, without reaping it."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _classify(exit_code: int, cpu_s: float, timed_out: bool, stderr: str,
              limits: SandboxLimits) -> tuple[Optional[ErrorKind], str]:
    """The error kind and its one-line detail, from how the snippet ended and the last line of its stderr."""
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    with_last = f": {last}" if last else ""
    if timed_out:
        return "timeout", f"timed out after {limits.timeout_s:g} s of wall-clock time"
    if exit_code < 0:
        sig = -exit_code
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= limits.cpu_s):
            return "cpu_limit", f"CPU time limit of {limits.cpu_s} s exceeded"
        if sig == signal.SIGXFSZ:
            return "file_size", f"file size limit of {limits.file_size_mb} MiB exceeded"
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return "killed", f"killed by {name}"
    if exit_code == 0:
        return None, ""
    if last.startswith("MemoryError"):
        return "memory", f"memory limit of {limits.memory_mb} MiB exceeded{with_last}"
    if "[Errno 27]" in last:  # EFBIG: the interpreter ignores SIGXFSZ, so the write raises instead
        return "file_size", f"file size limit of {limits.file_size_mb} MiB exceeded{with_last}"
    return "nonzero_exit", f"exit code {exit_code}{with_last}"


def _remove_tree(path: str) -> None:
    """Remove the working directory, whatever modes the snippet gave its contents; a failure (a process outside
    the group still writing there) is logged, not raised."""
    try:
        os.chmod(path, stat.S_IRWXU)
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                full = os.path.join(root, d)
                if not os.path.islink(full):
                    os.chmod(full, stat.S_IRWXU)
        shutil.rmtree(path)
    except OSError as e:
        log.warning("could not remove the python tool's working directory %s: %s", path, e)
