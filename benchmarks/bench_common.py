"""Small helpers shared by the benchmark scripts (not part of the package), and where they write.

Output policy, one for every benchmark: a script writes its results (one JSON per benchmark and device, with the
commit and the settings, a PNG beside it where it plots, and any runs and logs) into a run directory,
``runs/<bench>/<UTC time>/`` in the repository unless ``--out`` (or ``--out-dir``) names another (``run_dir``).
``benchmarks/results/`` holds the curated results the READMEs quote and is written by one step only,
``benchmarks/publish.py``, which copies a finished result (its JSON and PNG) there after checking that it records
its commit, device and settings; a script asked to write there itself refuses in one line.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
"""The curated results: written only by ``publish.py``."""


def inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies below it (both resolved)."""
    try:
        Path(path).resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def run_dir(bench: str, out: str | os.PathLike | None = None) -> Path:
    """Where benchmark ``bench`` writes: ``out``, else ``runs/<bench>/<UTC time>/`` in the repository. A directory
    inside ``benchmarks/results/`` is refused (SystemExit, one line): that is ``publish.py``'s to write."""
    path = Path(out) if out else ROOT / "runs" / bench / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    if inside(path, RESULTS):
        raise SystemExit(f"error: --out {path}: benchmarks/results/ holds curated results, written only by "
                         f"benchmarks/publish.py; write to a run directory (default runs/{bench}/<UTC time>/) and "
                         f"publish what is worth keeping")
    return path


def git_commit(root: Path = ROOT) -> str:
    """The checked-out commit: ``$HYBRID_RL_COMMIT`` when set (a copy of the tree whose .git is missing or not the
    checkout's: ``HYBRID_RL_COMMIT=$(git rev-parse HEAD)`` where it was copied from), else read from .git without
    running git, else from a ``COMMIT`` file beside the code (an export: ``git rev-parse HEAD > .clean/COMMIT``). In a
    linked worktree ``.git`` is a file naming the worktree's own git directory, whose ``commondir`` holds the refs."""
    if os.environ.get("HYBRID_RL_COMMIT", "").strip():
        return os.environ["HYBRID_RL_COMMIT"].strip()[:12]
    try:
        git = root / ".git"
        if git.is_file():
            git = (root / git.read_text().split("gitdir:", 1)[1].strip()).resolve()
        common = (git / (git / "commondir").read_text().strip()).resolve() if (git / "commondir").is_file() else git
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            if (common / ref).exists():
                return (common / ref).read_text().strip()[:12]
            for line in (common / "packed-refs").read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0][:12]
        return head[:12]
    except OSError:
        pass
    try:  # a git-archive export keeps the commit in a file
        return (root / "COMMIT").read_text().strip()[:12]
    except OSError:
        return "unknown"


def parse_runs(ap: Any, runs: Iterable[str]) -> tuple[Any, list[str], list[str]]:
    """``ap``'s arguments, the rest as ``key=value`` recipe overrides, and the names ``--runs`` chose among ``runs``
    (comma-separated); anything else is ``ap``'s one-line error."""
    runs = list(runs)
    args, overrides = ap.parse_known_args()
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        ap.error(f"unknown arguments {bad}: recipe overrides are key=value")
    chosen = [r for r in args.runs.split(",") if r]
    if not chosen or any(r not in runs for r in chosen):
        ap.error(f"--runs={args.runs}: choose from {', '.join(runs)}")
    return args, overrides, chosen


def torch_device_tag(gpus: int = 1, cpu: str | None = None) -> str:
    """``H200x4``: the short name of the first CUDA device torch sees × ``gpus``; without CUDA (or torch), ``cpu``
    (default ``cpux<gpus>``)."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{gpu_short_name(torch.cuda.get_device_name(0))}x{gpus}"
    except Exception:
        pass
    return cpu if cpu is not None else f"cpux{gpus}"


def gpu_short_name(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` → ``H100``: the part of a GPU's name the result files are tagged with."""
    m = re.search(r"(GH200|H100|H200|H20|A100|A10G|L40S|L4|B200|MI300X)", name)
    return m.group(1) if m else re.sub(r"[^A-Za-z0-9]", "", name)[:16]


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it, by the parent links in /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(proc: subprocess.Popen) -> None:
    """torchrun and every process it started, and nothing else (other runs on the machine are left alone).

    Workers sit in their own process groups, so killpg alone misses them: the tree is found by parent links
    and stopped first, so that nothing forks a child while it is being collected, then killed.
    """
    stopped: set[int] = set()
    for _ in range(5):
        new = [pid for pid in process_tree(proc.pid) if pid not in stopped]
        if not new:
            break
        for pid in new:
            signal_pid(pid, signal.SIGSTOP)
        stopped.update(new)
    for pid in stopped:
        signal_pid(pid, signal.SIGKILL)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    time.sleep(3)  # let the driver release the GPU memory


def read_rows(run: Path) -> list[dict]:
    """A run's ``metrics.jsonl`` as one dict per step (rows logged for one step, e.g. a validation, merged)."""
    import json

    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            by_step.setdefault(int(r["step"]), {}).update(r)
    return [by_step[s] for s in sorted(by_step)]
