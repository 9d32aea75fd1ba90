"""Where raw rows come from: local .jsonl/.parquet files, the ``datasets`` hub, or a synthetic task.

``load_rows`` turns ``data.train_path``/``data.val_path`` into a list of plain
dicts and nothing more; formatting rows into prompts is the task's job
(``tasks.py``). Local paths are checked before anything else so that a typo in a
file name is reported as a missing file instead of turning into a hub lookup
(which on an offline machine would fail with a confusing network error). The
``datasets`` import is lazy: CPU runs on local or synthetic data never pay for
it. Left out: streaming, sharded file globs, and caching of hub downloads beyond
what ``datasets`` itself does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from .tasks import TASKS, DataError

SYNTHETIC_PREFIX = "synthetic:"
LOCAL_FORMATS = (".jsonl", ".parquet")
# Extensions that mark a path as meant to be a local file even when it is missing.
FILE_LIKE = LOCAL_FORMATS + (".json", ".csv", ".arrow", ".txt")
_DEFAULT_KEY = "data.train_path"


def load_rows(path: str, split: str, hub_config: Optional[str], task: str, num_synthetic: int, seed: int,
              key: str = _DEFAULT_KEY, options: Any = None, held_out: bool = False) -> list[dict[str, Any]]:
    """Read all rows of ``path`` as dicts.

    ``split`` and ``hub_config`` only matter for hub datasets; ``num_synthetic``, ``seed``, ``options`` (the task's
    config section) and ``held_out`` only for ``synthetic:<task>``: ``held_out`` asks for the task's fixed test set
    where it has one (``arith``), and otherwise for ``num_synthetic`` rows with ``seed`` (pass a different seed, or
    fewer rows, for validation). ``key`` is the config key named in error messages.
    """
    if path.startswith(SYNTHETIC_PREFIX):
        name = path[len(SYNTHETIC_PREFIX):]
        synth = TASKS.get(name)
        if synth is None or not synth.synthetic:
            raise DataError(f"{key}={path!r}: no synthetic task {name!r}; "
                            f"use one of {[f'{SYNTHETIC_PREFIX}{n}' for n in _synthetic_names()]}")
        if name != task:
            raise DataError(f"{key}={path!r} is the synthetic {name!r} task but data.task={task!r}; set data.task={name}")
        test = synth.held_out(options) if held_out else None
        return test if test is not None else synth.generate(num_synthetic, seed, options)

    local = Path(path).expanduser()
    suffix = local.suffix.lower()
    if local.is_file():
        if suffix == ".jsonl":
            return _read_jsonl(local, key)
        if suffix == ".parquet":
            return _read_parquet(local, key)
        raise DataError(f"{key}={path!r}: unsupported file type {suffix or '(none)'}; convert it to .jsonl or .parquet")
    if suffix in FILE_LIKE or path.startswith((".", "/", "~")):
        raise DataError(f"{key}={path!r}: no such file; fix {key} to point at an existing .jsonl/.parquet file")
    # Anything else (a hub name such as "openai/gsm8k", or a local directory
    # that ``datasets`` knows how to read) goes to ``datasets.load_dataset``.
    return _read_hub(path, split, hub_config, key)


def _synthetic_names() -> list[str]:
    return sorted(n for n, t in TASKS.items() if t.synthetic)


def _read_jsonl(path: Path, key: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline, say) are not rows
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); fix that line of {key}") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: a JSON {type(row).__name__}, expected an object of fields; fix that line of {key}")
            rows.append(row)
    if not rows:
        raise DataError(f"{key}={str(path)!r}: the file has no rows; point {key} at a non-empty file")
    return rows


def _read_parquet(path: Path, key: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises several unrelated types for a corrupt file
        raise DataError(f"{key}={str(path)!r}: cannot read it as parquet ({type(e).__name__}: {_first_line(e)}); "
                        f"fix or re-export the file") from e
    if not rows:
        raise DataError(f"{key}={str(path)!r}: the file has no rows; point {key} at a non-empty file")
    return rows


def _read_hub(name: str, split: str, hub_config: Optional[str], key: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except Exception as e:
        raise DataError(f"{key}={name!r} is not a local file, and reading it from the hub needs the 'datasets' package "
                        f"({type(e).__name__}: {_first_line(e)}); pip install datasets or use a local .jsonl/.parquet file") from e
    try:
        ds = datasets.load_dataset(name, hub_config, split=split)
    except Exception as e:  # offline, unknown name, bad config or split: all one message
        raise DataError(f"{key}={name!r} (data.hub_config={hub_config!r}, split={split!r}) is not a local file and could not "
                        f"be loaded from the datasets hub ({type(e).__name__}: {_first_line(e)}); check the name, config "
                        f"and split, or download it to a local .jsonl/.parquet file") from e
    rows = [dict(r) for r in ds]
    if not rows:
        raise DataError(f"{key}={name!r} split {split!r} has no rows; pick another split")
    return rows


def _first_line(e: BaseException, limit: int = 200) -> str:
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."
