"""Small helpers shared by the benchmark scripts (not part of the package)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_commit(root: Path = ROOT) -> str:
    """The checked-out commit, read from .git without running git (the GPU lender's tree may have no git),
    else from a ``COMMIT`` file beside the code (an export: ``git rev-parse HEAD > .clean/COMMIT``)."""
    try:
        git = root / ".git"
        head = (git / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = head[5:]
            if (git / ref).exists():
                return (git / ref).read_text().strip()[:12]
            for line in (git / "packed-refs").read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0][:12]
        return head[:12]
    except OSError:
        pass
    try:  # a git-archive export (benchmarks/gpu_session.sh) carries the commit in a file
        return (root / "COMMIT").read_text().strip()[:12]
    except OSError:
        return "unknown"
