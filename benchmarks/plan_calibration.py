"""The memory planner's predictions beside the peaks the curated results measured, one row per reconstructable run.

    PYTHONPATH=. python benchmarks/plan_calibration.py

Each row names the result file and the run or configuration in it, the config it ran (the recipe of its commit, as
its overrides), and the phase whose peak that measurement is: ``flagship`` runs' ``peak_memory_outside_engine_gb``
and ``update_step`` configurations' ``peak_memory_allocated_gb`` are the trainer's largest phase (``update_step``
runs the log-prob pass and the update only: no engine, no reference), the ``perf/engine_pool_gb`` a flagship run
logged is the engine's share. The measured figures, the GPUs and the card of each row are read from the result file
(``benchmarks/results/``); a row whose file or entry is missing says so. Measured and predicted are torch's
allocated bytes, GiB. Prints a table; writes nothing.

Below them, one row per measured phase of every ``scale_7b_*.json`` (``benchmarks/scale_7b.py``, any model): each
run records its recipe, model, overrides, GPUs and card, and per timed phase the peak it measured (the engine's pool
taken off the phases it sleeps through) and the engine's pool; the prediction is the planner's as it is now, not the
one the run recorded. A run that logged its largest micro-batch per phase (``perf/phase_micro_batch_tokens/*``)
gets a second prediction, at those micro-batches (``at run``): the memory model apart from the worst-case lengths a
verdict assumes. ``--max-error PCT`` exits 1 when any row is off by more than ``PCT`` percent (the ``at run``
prediction where there is one), naming them.

    PYTHONPATH=. python benchmarks/plan_calibration.py --max-error 10

Then one row per measured phase of the hybrid_rl run of every ``peers_*.json`` (``benchmarks/peers/``) that recorded
its phases' peaks (``memory``), the same way: its recipe and overrides, the workload's built-in model.

The curated runs were measured with the actor's fp32 gradients kept from one update through the next step's
log-prob passes (``update_step`` times each pass after a warm-up update, the flagship a step after its first), where
the trainer's optimizer step frees them. Their rows (``Row.held_grads``) add the actor's fp32 gradient shards to every
phase that does not already count them (the no-grad passes, and an update that accumulates unsharded), so the
prediction is of what those runs held.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "benchmarks"))

from bench_common import RESULTS  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.planner.estimate import GIB, Phase, phases  # noqa: E402
from hybrid_rl.planner.gpus import card_memory_gib  # noqa: E402
from hybrid_rl.planner.shape import read_shape  # noqa: E402
from phase_memory import PLANNED  # noqa: E402  (a timed phase -> the planner's phase)

RECIPE = ROOT / "recipes" / "gsm8k_grpo.yaml"
M15 = "model.path=builtin:qwen2.5-1.5b-random"
SHARE_POOL = "rollout.vllm.fit_kv_cache=false"
"""The flagship runs predate ``rollout.vllm.fit_kv_cache``: vLLM's KV cache filled its share."""
# the flagship recipe before its memory levers (46cdd3a, cba16b7): recomputation, micro-batches of 16 / 32 sequences
OLD = ["model.enable_gradient_checkpointing=true", "actor.use_dynamic_bsz=false", "actor.accumulate_unsharded=false",
       "actor.share_prompts=false"]
UNPACKED = ["actor.use_remove_padding=false", "actor.fused_logprob=false"]
NO_CKPT = ["model.enable_gradient_checkpointing=false"]
ENGINE_POOL_H100_GIB = 39.5
"""vLLM's pool in the 1xH100 flagship run at cba16b7 (``gpu_memory_utilization`` 0.5 of the card, as its log reported
it): that run predates ``perf/engine_pool_gb``, so its file holds the peak with the pool in it, and this is taken off."""


@dataclass(frozen=True)
class Row:
    file: str
    """The result file's name under ``benchmarks/results/``, without ``.json``."""
    entry: str
    """The run (a flagship file's ``runs`` key) or configuration (an update_step file's ``config``) measured."""
    what: str
    """What the row is, in the table."""
    overrides: list[str] = field(default_factory=list)
    """The config it ran, as overrides of ``recipes/gsm8k_grpo.yaml``."""
    which: str = "trainer"
    """``trainer``: the trainer's largest phase; ``engine``: the engine's share."""
    less_gib: float = 0.0
    """Taken off the measured peak (what the file cannot separate)."""
    held_grads: bool = True
    """Measured while the actor's gradients stayed allocated between updates (every curated run)."""


ROWS = [
    Row("flagship_H200x4", "076941d", "trainer peak, levers on", [M15, SHARE_POOL]),
    Row("flagship_H200x4", "076941d", "engine pool", [M15, SHARE_POOL], which="engine"),
    Row("flagship_H100x1", "cba16b7", "trainer peak, padded, unfused", [M15, SHARE_POOL, "data.train_batch_size=64",
        "actor.ppo_mini_batch_size=16", *OLD, *UNPACKED], less_gib=ENGINE_POOL_H100_GIB),
    Row("update_step_H200x4_qwen2.5-1.5b-random", "padded", "padded, unfused", [M15, *OLD, *UNPACKED]),
    Row("update_step_H200x4_qwen2.5-1.5b-random", "packed+fused", "packed+fused", [M15, *OLD]),
    Row("update_step_H200x4_qwen2.5-1.5b-random", "packed+fused+no_ckpt [+Liger, see note]", "no ckpt, Liger",
        [M15, *OLD, *NO_CKPT, "model.use_liger=true"]),
    Row("update_step_H200x4_qwen2.5-1.5b-random", "packed+fused+no_ckpt+budget16k+unsharded [+Liger, see note]",
        "no ckpt, 16k budget, unsharded, Liger", [M15, *OLD, *NO_CKPT, "actor.use_dynamic_bsz=true",
                                                  "actor.max_token_len_per_device=16384",
                                                  "actor.accumulate_unsharded=true", "model.use_liger=true"]),
    Row("update_step_H100x1_qwen2.5-1.5b-random", "padded", "padded, unfused", [M15, *OLD, *UNPACKED]),
    Row("update_step_H100x1_qwen2.5-1.5b-random", "packed+fused", "packed+fused", [M15, *OLD]),
    Row("update_step_H100x1_qwen2.5-1.5b-random", "packed+fused+no_ckpt", "packed+fused, no ckpt",
        [M15, *OLD, *NO_CKPT]),
]


def box(doc: dict) -> tuple[int, float]:
    """(GPUs, GiB per GPU) of a result's ``device`` tag, e.g. ``H200x4`` -> (4, 139.8)."""
    m = re.fullmatch(r"(.+?)x(\d+)", doc["device"])
    if m is None:
        raise ValueError(f"device {doc['device']!r} is not <card>x<count>")
    return int(m.group(2)), card_memory_gib(m.group(1))


def measured(row: Row, doc: dict) -> tuple[float, list[str]]:
    """The row's measured GiB in ``doc``, and the overrides the file adds (an update_step file's batch shape)."""
    if doc.get("bench") == "update_step":
        entry = next((c for c in doc["configs"] if c["config"] == row.entry), None)
        if entry is None or "peak_memory_allocated_gb" not in entry:
            raise KeyError(f"no measured configuration {row.entry!r}")
        n = load_config(str(RECIPE)).rollout.n
        shape = ["actor.use_kl_loss=false", f"data.train_batch_size={doc['sequences'] // n}",
                 f"actor.ppo_mini_batch_size={doc['mini_batch_prompts']}"]
        return entry["peak_memory_allocated_gb"] - row.less_gib, shape
    run = doc["runs"].get(row.entry)
    if run is None:
        raise KeyError(f"no run {row.entry!r}")
    if row.which == "engine":
        return max(run["per_step"]["perf/engine_pool_gb"]) - row.less_gib, []
    return run.get("peak_memory_outside_engine_gb", run["peak_memory_allocated_gb"]) - row.less_gib, []


GRADS = "actor grads (fp32, sharded)"


def predicted(overrides: list[str], gpus: int, gib: float, which: str, held_grads: bool = False) -> float:
    """The planner's GiB for the row; ``held_grads``: the no-grad passes also hold the update's actor gradients."""
    cfg = load_config(str(RECIPE), overrides)
    all_phases = phases(cfg, read_shape(cfg.model.path), gpus, gib * GIB)
    if which == "engine":
        return next(p for p in all_phases if p.name == "generation").terms["engine (awake)"] / GIB
    trainer = [p for p in all_phases if p.name not in ("weight push", "generation")]
    grads = 4 * read_shape(cfg.model.path).params / gpus if held_grads else 0.0  # the actor's fp32 shards
    return max(p.total + (grads if GRADS not in p.terms else 0.0) for p in trainer) / GIB


def run_rows(label: str, recipe: Path, overrides: list[str], gpus: int, gpu_gib: float, memory: dict,
             pool: float | None) -> list[tuple[str, float, float, float | None]]:
    """(``label`` and phase, measured GiB, the planner's GiB now, the planner's GiB now at the run's largest
    micro-batch or None where the run did not log it) for each measured phase of one run (``memory``: timed phase →
    ``measured_gib``, ``micro_batch_tokens``) and its engine pool."""
    from hybrid_rl.planner.verdict import judge

    cfg = load_config(str(recipe), overrides).validate(gpus)  # as the run was checked
    shape, gpu_bytes = read_shape(cfg.model.path), gpu_gib * GIB
    planned = {p.name: p for p in judge(cfg, shape, gpus, gpu_bytes)[0]}
    micro = {PLANNED[ph]: m["micro_batch_tokens"] for ph, m in memory.items()
             if m.get("micro_batch_tokens") and ph in PLANNED}
    at_run = {p.name: p for p in phases(cfg, shape, gpus, gpu_bytes, micro)} if micro else {}
    out = []
    for phase, m in memory.items():
        if m.get("measured_gib") is not None and PLANNED.get(phase) in planned:
            name = PLANNED[phase]
            out.append((f"{label} {phase}", m["measured_gib"], planned[name].total / GIB,
                        at_run[name].total / GIB if name in micro and name in at_run else None))
    engine = planned.get("generation", Phase("generation")).terms.get("engine (awake)")
    if pool and engine:
        out.append((f"{label} engine pool", pool, engine / GIB, None))
    return out


def scale_rows(doc: dict) -> list[tuple[str, float, float, float | None]]:
    """``run_rows`` for every run of a ``scale_7b_*.json``; runs that failed are left out."""
    out = []
    for run in doc.get("runs", []):
        if "error" in run or "memory" not in run:
            continue
        overrides = [f"model.path={doc['model']}", *run["base_overrides"], *run["overrides"]]
        out += run_rows(run["mode"], ROOT / doc["recipe"], overrides, doc["gpus"], doc["gpu_gib"], run["memory"],
                        (run.get("engine_pool") or {}).get("measured_gib"))
    return out


RUN_PATHS = ("data.train_path=", "data.val_path=", "trainer.output_dir=", "model.path=")
"""Overrides of a peers run that name its machine's files: the model is the workload's built-in shape instead."""


def peers_rows(doc: dict) -> list[tuple[str, float, float, float | None]]:
    """``run_rows`` for each hybrid_rl run of a ``peers_*.json`` (``benchmarks/peers/``) that recorded its phases'
    peaks: its recipe and overrides, the workload's model; where it holds runs on several machines, each row names
    its machine (the boot id's last 8 characters)."""
    out = []
    runs = [r for r in doc.get("frameworks", [])
            if r.get("framework") == "hybrid_rl" and "memory" in r and "error" not in r]
    for run in runs:
        gpus, gib = box(run)
        where = f"@{str(run.get('machine'))[-8:]} " if len(runs) > 1 else ""
        settings = run["settings"]
        overrides = [f"model.path={doc['model']}", *(o for o in settings["overrides"] if not o.startswith(RUN_PATHS))]
        out += run_rows(f"hybrid_rl {where}{doc['workload_name']}", ROOT / settings["recipe"], overrides, gpus, gib,
                        run["memory"], (run.get("engine_pool") or {}).get("measured_gib"))
    return out


def main(results: Path = RESULTS, max_error: float | None = None) -> int:
    """Print the table; 1 if ``max_error`` (percent) is given and a row errs by more, else 0."""
    print(f"{'result':40s} {'run':48s} {'measured':>9s} {'predicted':>9s} {'error':>7s} {'at run':>7s} {'error':>7s}")
    worse = []

    def line(label: str, what: str, value: float, pred: float, at_run: float | None = None) -> None:
        err = 100 * (pred - value) / value
        tail = ""
        if at_run is not None:
            run_err = 100 * (at_run - value) / value
            tail = f" {at_run:7.1f} {run_err:+6.0f}%"
        print(f"{label[:40]:40s} {what[:48]:48s} {value:9.1f} {pred:9.1f} {err:+6.0f}%{tail}")
        judged = run_err if at_run is not None else err  # the model at the run's micro-batches, where it logged them
        if max_error is not None and abs(judged) > max_error:
            worse.append(f"{label} {what} ({judged:+.0f}%)")

    for row in ROWS:
        label = f"{row.file} ({row.entry})" if not row.file.startswith("update_step") else row.file
        path = results / f"{row.file}.json"
        try:
            doc = json.loads(path.read_text())
            value, shape = measured(row, doc)
        except (OSError, KeyError, ValueError) as e:
            print(f"{label[:40]:40s} {row.what:48s} {'-':>9s}  ({path.name}: {e})")
            continue
        gpus, gib = box(doc)
        line(label, row.what, value, predicted([*row.overrides, *shape], gpus, gib, row.which, row.held_grads))
    for path in sorted(results.glob("scale_7b_*.json")):
        doc = json.loads(path.read_text())
        for what, value, pred, at_run in scale_rows(doc):
            line(path.stem, what, value, pred, at_run)
    for path in sorted(results.glob("peers_*.json")):
        for what, value, pred, at_run in peers_rows(json.loads(path.read_text())):
            line(path.stem, what, value, pred, at_run)
    if worse:
        print(f"off by more than {max_error:g}%: {'; '.join(worse)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-error", type=float, default=None, metavar="PCT",
                    help="exit 1 when a row's prediction is off by more than PCT percent of what it measured")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the folder of result files (default: the curated)")
    a = ap.parse_args()
    sys.exit(main(a.results, a.max_error))
