"""Publish a benchmark result: copy its JSON (and the PNG of the same name) from a run directory into
``benchmarks/results/``, the curated results the READMEs quote.

    python benchmarks/publish.py runs/bench/20261201T120000Z/modes_H200x4_qwen2.5-1.5b-random.json
    python benchmarks/publish.py --no-device runs/plan_verdicts/<time>/plan_verdicts.json   # predictions, no device

The one way results get there (``bench_common``'s output policy): every benchmark writes into a run directory,
and a result is published once it is worth quoting. A JSON is published only if it records its ``commit``, its
``device`` (``--no-device`` for results of no device: the planner's predictions, a model) and its settings (one of
``settings``, ``overrides``, ``config``, ``configs``, ``recipe``, ``args``, ``workload``); otherwise nothing is copied and the
line printed names the file and the missing key. A published file of the same name is replaced. Left out: editing
the READMEs that quote a result (their figures are updated by hand, with the commit the JSON records).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import RESULTS, inside  # noqa: E402

SETTINGS_KEYS = ("settings", "overrides", "config", "configs", "recipe", "args", "workload")
"""Keys any of which records what a result ran."""


def missing(doc: object, device: bool = True) -> list[str]:
    """What a result JSON must record and does not: ``commit``, ``device`` (unless ``device`` is False), settings."""
    if not isinstance(doc, dict):
        return ["a JSON object at the top"]
    out = [key for key in ("commit", *(["device"] if device else [])) if key not in doc]
    if not any(key in doc for key in SETTINGS_KEYS):
        out.append("its settings (" + ", ".join(SETTINGS_KEYS) + ")")
    return out


def check(path: Path, results: Path = RESULTS, device: bool = True) -> None:
    """ValueError naming what keeps result ``path`` from being published; None if it may be."""
    if path.suffix != ".json" or not path.is_file():
        raise ValueError(f"{path}: not a result JSON file; name the .json a benchmark wrote into its run directory")
    if inside(path, results):
        raise ValueError(f"{path} is already in {results}")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from e
    lacking = missing(doc, device)
    if lacking:
        raise ValueError(f"{path} records no {' and no '.join(lacking)}; rerun the benchmark at a current commit "
                         f"(it records them), or pass --no-device for a result of no device")


def publish(path: Path, results: Path = RESULTS, device: bool = True) -> list[Path]:
    """Copy result ``path`` and its PNG (if there is one) into ``results``, after ``check``; the copies' paths."""
    check(path, results, device)
    results.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(src, results / src.name)) for src in (path, path.with_suffix(".png")) if src.is_file()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="result JSON files in a run directory")
    ap.add_argument("--no-device", action="store_true", help="the results are of no device (predictions, models)")
    ap.add_argument("--to", type=Path, default=RESULTS, help=argparse.SUPPRESS)  # the tests' stand-in for results/
    args = ap.parse_args(argv)
    try:
        for path in args.results:  # every file checked before any is copied: a bad one publishes nothing
            check(path, args.to, not args.no_device)
        for path in args.results:
            for dst in publish(path, args.to, not args.no_device):
                print(f"published {dst}")
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
