"""Small helpers shared by the benchmark scripts (not part of the package)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_commit(root: Path = ROOT) -> str:
    """The checked-out commit, read from .git without running git (a copy of the tree on a GPU machine may have no .git),
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
    try:  # a git-archive export keeps the commit in a file
        return (root / "COMMIT").read_text().strip()[:12]
    except OSError:
        return "unknown"


def gpu_short_name(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` → ``H100``: the part of a GPU's name the result files are tagged with."""
    m = re.search(r"(GH200|H100|H200|H20|A100|A10G|L40S|L4|B200|MI300X)", name)
    return m.group(1) if m else re.sub(r"[^A-Za-z0-9]", "", name)[:16]
