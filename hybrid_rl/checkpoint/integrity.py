"""Whether a complete checkpoint's files are intact, and the newest intact one to resume from.

``COMPLETE`` records every file's size; :func:`verify_checkpoint` checks them, that ``.metadata`` reads and that
each shard is as long as its index says. :func:`find_resumable` skips damaged checkpoints (with a warning line) for
the newest intact one.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from .layout import (COMPLETE, LATEST, STEP_RE, CorruptCheckpointError, complete_checkpoints, error_summary,
                     is_complete, read_marker, require_complete)


def _latest_problem(root: Path, chosen: Path) -> str | None:
    """Why ``root/latest`` did not name ``chosen`` (None when it did)."""
    f = root / LATEST
    try:
        text = f.read_bytes().decode().strip()
    except FileNotFoundError:
        return f"{str(f)!r} is missing"
    except (OSError, UnicodeDecodeError) as e:
        return f"{str(f)!r} is unreadable ({error_summary(e)[:80]})"
    if not STEP_RE.match(text) or "/" in text:
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
    complete = [(s, p) for s, p in complete_checkpoints(root) if below is None or s < below]
    notes: list[str] = []
    first_damage: CorruptCheckpointError | None = None
    for _, path in reversed(complete):
        damage = _verify(path)
        if damage is None:
            problem = _latest_problem(root, path) if below is None else None
            if problem is not None:
                notes.append(f"warning: {problem}; resuming from the newest complete checkpoint, {path}")
            return path, notes
        err = corrupt_error(path, *damage, hint=False)
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
    marker = read_marker(path) or {}
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
        return ".metadata", f"cannot be read ({error_summary(e)[:120]})"
    for rel, end in sorted(ends.items()):
        try:
            size = (path / rel).stat().st_size
        except OSError:
            return rel, "is missing"
        if size < end:
            return rel, f"is {size} bytes but its index needs {end} (truncated)"
    return None


def corrupt_error(path: Path, file: str, problem: str, hint: bool = True) -> CorruptCheckpointError:
    fix = ""
    if hint:
        m = STEP_RE.match(path.name)
        older = None
        if m:
            try:
                older, _ = find_resumable(path.parent, below=int(m.group(1)))
            except CorruptCheckpointError:
                older = None
        fix = (f"; resume from the previous complete checkpoint, trainer.resume={older} (trainer.resume=auto skips damaged ones)"
               if older is not None else "; no older intact checkpoint: start over with trainer.resume=never")
    return CorruptCheckpointError(f"checkpoint {str(path)!r} is corrupt: {file} {problem}{fix}", path, file, problem)



def verify_checkpoint(path: str | os.PathLike) -> None:
    """Raise CorruptCheckpointError naming the file (and the previous intact checkpoint) if complete checkpoint
    ``path`` has a missing, truncated or unreadable file; cheap (sizes and ``.metadata`` only)."""
    path = Path(path)
    require_complete(path)
    damage = _verify(path)
    if damage is not None:
        raise corrupt_error(path, *damage)

