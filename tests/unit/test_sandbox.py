"""Tests for hybrid_rl.envs.sandbox: hostile and faulty snippets come back as bounded observations within their
limits, nothing they start outlives the call, and the trainer's process is untouched."""

from __future__ import annotations

import json
import os
import pwd
import sys
import tempfile
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from hybrid_rl.config.errors import ConfigError  # noqa: E402
from hybrid_rl.envs.sandbox import (SandboxLimits, SandboxResult, SandboxUnavailable,  # noqa: E402
                                    run_python)

linux = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox runs code on Linux only")

QUICK = SandboxLimits(timeout_s=3.0, cpu_s=2)
OBS_CHARS = 300
SLACK_S = 1.5  # start-up and kill latency on a loaded machine, on top of a limit


def _ignoring_sigxcpu() -> str:
    return "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"


# (id, code, limits, error_kind, text the observation contains, exit code or None to skip that check)
CASES = [
    ("calculation", "print(123 * 456)", QUICK, None, "56088", 0),
    ("busy_loop_cpu", "while True:\n    pass\n", SandboxLimits(timeout_s=20.0, cpu_s=1), "cpu_limit",
     "CPU time limit of 1 s", -24),
    ("busy_loop_ignoring_sigxcpu", _ignoring_sigxcpu(), SandboxLimits(timeout_s=20.0, cpu_s=1), "cpu_limit",
     "CPU time limit of 1 s", -9),
    ("busy_loop_wall", "while True:\n    pass\n", SandboxLimits(timeout_s=1.0, cpu_s=30), "timeout",
     "timed out after 1 s", None),
    ("sleep", "import time\ntime.sleep(60)\n", SandboxLimits(timeout_s=1.0), "timeout", "timed out after 1 s", None),
    ("alloc_10gb", "b = bytearray(10**10)\n", QUICK, "memory", "MemoryError", 1),
    ("file_100mb", "with open('big', 'wb') as f:\n    f.write(b'x' * (100 << 20))\n",
     replace(QUICK, file_size_mb=1), "file_size", "File too large", 1),
    ("system_exit", "raise SystemExit(3)", QUICK, "nonzero_exit", "error: exit code 3", 3),
    ("exception", "def f():\n    raise ValueError('boom')\nf()\n", QUICK, "nonzero_exit",
     "error: exit code 1: ValueError: boom", 1),
    ("kill_self", "import os\nos.kill(os.getpid(), 9)\n", QUICK, "killed", "killed by SIGKILL", -9),
    ("non_utf8", "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe')\n", QUICK, None, "\ufffd\ufffd", 0),
    ("stderr_on_success", "import sys\nprint(7)\nprint('careful', file=sys.stderr)\n", QUICK, None,
     "7\nstderr:\ncareful", 0),
    ("no_fork_at_one_process", "import subprocess\nsubprocess.run(['true'])\n", replace(QUICK, max_processes=1),
     "nonzero_exit", "BlockingIOError", 1),
]


@linux
@pytest.mark.parametrize("code, limits, kind, text, exit_code", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_snippet_ends_as_a_bounded_observation(code, limits, kind, text, exit_code):
    start = time.monotonic()
    result = run_python(code, limits=limits)
    elapsed = time.monotonic() - start
    observation = result.observation(max_chars=OBS_CHARS)
    assert result.error_kind == kind, (result, observation)
    assert text in observation
    assert len(observation) <= OBS_CHARS
    if exit_code is not None:
        assert result.exit_code == exit_code
    assert elapsed < limits.timeout_s + SLACK_S
    assert result.wall_s <= elapsed
    if kind == "cpu_limit":
        assert result.cpu_s > 0.5 * limits.cpu_s  # the limit, not the clock, ended it


@linux
def test_calculation_observation_is_the_output():
    assert run_python("print(123 * 456)").observation() == "56088"
    assert run_python("x = 1").observation() == "(no output)"


def _group(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    alive = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return alive


def _wait_empty(pgid: int, within_s: float = 2.0) -> list[int]:
    """The group's live members once it is empty or ``within_s`` has passed (SIGKILL takes a moment to land)."""
    deadline = time.monotonic() + within_s
    while (alive := _group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


FORK_BOMB = """\
import os
print(os.getpid(), flush=True)
while True:
    try:
        if os.fork() == 0:
            print(os.getpid(), flush=True)
    except OSError:
        pass
"""


@linux
def test_fork_bomb_is_bounded_and_leaves_no_process():
    limits = SandboxLimits(timeout_s=2.0, max_processes=16)
    children_before = set(psutil.Process().children(recursive=True))  # other tests' in this pytest worker
    start = time.monotonic()
    result = run_python(FORK_BOMB, limits=limits)
    assert time.monotonic() - start < limits.timeout_s + SLACK_S
    assert result.error_kind == "timeout"
    pids = [int(line) for line in result.stdout.split()]
    # every process of the snippet printed its pid once: RLIMIT_NPROC held them to max_processes (fewer when the
    # uid already runs processes of its own)
    assert 1 <= len(pids) <= limits.max_processes
    assert _wait_empty(pids[0]) == []  # the leader's pid is the group's id
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert set(psutil.Process().children(recursive=True)) <= children_before
    assert len(result.observation(max_chars=OBS_CHARS)) <= OBS_CHARS


@linux
def test_background_child_dies_with_the_snippet():
    code = "import os, subprocess\nprint(os.getpid(), subprocess.Popen(['sleep', '30']).pid, flush=True)\n"
    result = run_python(code, limits=QUICK)
    assert result.ok, result
    leader, child = map(int, result.stdout.split())
    assert _wait_empty(leader) == []
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


@linux
@pytest.mark.parametrize("code, cap, stdout, invalid", [
    ("import sys\nsys.stdout.buffer.write(b'ok \\xff end')\n", 1 << 16, "ok \ufffd end", True),
    ("print('caf\u00e9 ok')", 1 << 16, "caf\u00e9 ok\n", False),
    # 'é' is two bytes (0xc3 0xa9); a cap of 4 keeps 'caf' and the first of them: the cut character is dropped
    ("print('caf\u00e9 ok')", 4, "caf", False),
    # a lone continuation byte before the cap is invalid output, cut or not
    ("import sys\nsys.stdout.buffer.write(b'a\\xa9bcdef')\n", 4, "a\ufffdbc", True),
])
def test_output_that_is_not_utf8_is_flagged(code, cap, stdout, invalid):
    result = run_python(code, limits=replace(QUICK, max_output_bytes=cap))
    assert result.ok, result
    assert (result.stdout, result.invalid_utf8) == (stdout, invalid)


@linux
def test_huge_output_is_capped_and_parent_memory_stays_bounded():
    code = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n"
    limits = replace(QUICK, timeout_s=20.0, cpu_s=10, max_output_bytes=1 << 16)
    tracemalloc.start()
    try:
        result = run_python(code, limits=limits)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.ok and result.truncated
    assert result.stdout == "x" * limits.max_output_bytes
    assert peak < 8 << 20, peak  # 100 MB went through the pipe; well under 10% of it was ever held
    observation = result.observation(max_chars=OBS_CHARS)
    assert len(observation) <= OBS_CHARS and observation.endswith("[output truncated]")


@linux
def test_parent_environment_does_not_reach_the_snippet(monkeypatch):
    monkeypatch.setenv("HYBRID_RL_SANDBOX_TEST_SECRET", "hunter2-do-not-leak")
    monkeypatch.setenv("PYTHONPATH", "/nonexistent/should/not/matter")
    code = "import json, os, sys\nprint(json.dumps({'env': dict(os.environ), 'path': sys.path}))\n"
    result = run_python(code, limits=QUICK)
    assert result.ok, result
    seen = json.loads(result.stdout)
    assert "hunter2-do-not-leak" not in result.stdout
    # PATH is the one variable passed; LC_CTYPE is the interpreter's own C-locale coercion (PEP 538)
    assert set(seen["env"]) <= {"PATH", "LC_CTYPE"}
    assert not any("site-packages" in p or "nonexistent" in p for p in seen["path"])


@linux
def test_working_directory_is_fresh_and_removed():
    code = "import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\n"
    first, second = run_python(code, limits=QUICK), run_python(code, limits=QUICK)
    dirs = []
    for result in (first, second):
        assert result.ok, result
        cwd, listing = result.stdout.splitlines()
        assert listing == "['main.py', 'scratch.txt']"  # the snippet's own file and what it wrote, nothing else
        assert Path(cwd).parent == Path(tempfile.gettempdir())
        assert not Path(cwd).exists()
        dirs.append(cwd)
    assert dirs[0] != dirs[1]


@linux
def test_root_trainer_runs_snippets_as_nobody(tmp_path):
    target = tmp_path / "written_by_snippet"
    code = (f"import os\nprint(os.getuid(), os.getgid())\n"
            f"try:\n    open({str(target)!r}, 'w').write('x')\n    print('wrote')\n"
            f"except PermissionError:\n    print('denied')\n")
    result = run_python(code, limits=QUICK)
    assert result.ok, result
    uid, gid, outcome = result.stdout.split()
    if os.geteuid() == 0:  # nobody, which cannot write into pytest's 0700 root-owned tmp_path
        nobody = pwd.getpwnam("nobody")
        assert (int(uid), int(gid), outcome, target.exists()) == (nobody.pw_uid, nobody.pw_gid, "denied", False)
    else:  # the trainer's own uid: writes outside the working directory are not prevented
        assert (int(uid), int(gid), outcome, target.exists()) == (os.getuid(), os.getgid(), "wrote", True)


@linux
def test_parallel_calls_from_threads():
    sizes = [10_000 * (i + 1) for i in range(8)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda n: run_python(f"print(sum(range({n})))", limits=QUICK), sizes))
    assert [r.stdout.strip() for r in results] == [str(n * (n - 1) // 2) for n in sizes]
    assert all(r.ok for r in results)


def test_observation_keeps_the_error_line_within_max_chars():
    result = SandboxResult(stdout="y" * 5000, stderr="", exit_code=1, error_kind="nonzero_exit",
                           error_detail="exit code 1: ValueError: bad", truncated=False, wall_s=0.1, cpu_s=0.05)
    observation = result.observation(max_chars=120)
    assert len(observation) <= 120
    assert observation.startswith("y" * 50)
    assert observation.endswith("\nerror: exit code 1: ValueError: bad")
    assert "more characters]" in observation


@pytest.mark.parametrize("field, value, fragment", [
    ("timeout_s", 0, "tools.python.timeout_s=0"),
    ("cpu_s", 0, "tools.python.cpu_s=0"),
    ("memory_mb", 8, "tools.python.memory_mb=8"),
    ("max_output_bytes", -1, "tools.python.max_output_bytes=-1"),
])
def test_limits_name_the_bad_key(field, value, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        replace(SandboxLimits(), **{field: value}).validate("tools.python")


def test_other_platforms_refuse_instead_of_running_unsandboxed(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(SandboxUnavailable, match="needs Linux") as info:
        run_python("print(1)")
    assert "\n" not in str(info.value)
