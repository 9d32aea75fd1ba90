"""Pack the staged files of one folder into folders of at most ``cap`` bytes each (first-fit, largest first), named
``<prefix>1``, ``<prefix>2``, ... under ``out``; a file over ``cap`` is refused (cut it first). Used by stage.sh:

    python3 benchmarks/peers/pack.py SRC OUT CAP PREFIX
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def pack(src: Path, out: Path, cap: int, prefix: str) -> list[Path]:
    bins: list[list] = []
    for f in sorted(src.iterdir(), key=lambda f: (-f.stat().st_size, f.name)):
        size = f.stat().st_size
        if size > cap:
            raise SystemExit(f"ERROR: {f.name} is {size} bytes, over {cap}: cut it into pieces first")
        b = next((b for b in bins if b[0] + size <= cap), None)
        if b is None:
            b = [0, []]
            bins.append(b)
        b[0] += size
        b[1].append(f)
    dirs = []
    for k, (_, files) in enumerate(bins, 1):
        d = out / f"{prefix}{k}"
        d.mkdir(parents=True)
        for f in files:
            shutil.move(str(f), d / f.name)
        dirs.append(d)
    return dirs


if __name__ == "__main__":
    pack(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
