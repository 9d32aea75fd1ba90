"""The peak memory of each timed phase a training run logged, named as the memory planner names its phases.

The trainer logs, per step, each phase's peak allocated memory (``perf/phase_memory_allocated_gb/<phase>``, GiB, the
largest over ranks), the largest micro-batch a phase computed (``perf/phase_micro_batch_tokens/<phase>``) and the
engine's pool (``perf/engine_pool_gb``). The training phases run with the engine asleep, and torch still counts its
pool then: ``from_rows`` takes the pool off them, so that each figure is comparable with the planner's phase of the
same name (``hybrid_rl.planner``). Read by ``scale_7b.py``, ``peers/run_hybrid_rl.py`` and ``plan_calibration.py``.
"""

from __future__ import annotations

PLANNED = {"gen": "generation", "old_log_prob": "old log-prob", "ref": "ref log-prob", "update": "actor update",
           "values": "critic values", "update_critic": "critic update"}
"""Timed phase → the planner's phase."""
TRAINING = ("old_log_prob", "ref", "update", "values", "update_critic")
"""Phases that run with the engine asleep: its pool (counted by torch while it sleeps) is taken off their peak."""


def from_rows(rows: list[dict]) -> dict:
    """Over the step rows of a ``metrics.jsonl``: ``phase_peak_gib`` (timed phase → the largest peak, the pool taken
    off the training phases), ``micro_batch_tokens`` (timed phase → the largest micro-batch), ``engine_pool_gb``
    (None without an engine) and ``peak_outside_engine_gib``."""
    pool = max((r.get("perf/engine_pool_gb", 0.0) for r in rows), default=0.0)
    phases, micro = {}, {}
    for phase in PLANNED:
        key = f"perf/phase_memory_allocated_gb/{phase}"
        if any(key in r for r in rows):
            peak = max(r[key] for r in rows if key in r)
            phases[phase] = peak - pool if phase in TRAINING else peak
        key = f"perf/phase_micro_batch_tokens/{phase}"
        if any(key in r for r in rows):
            micro[phase] = int(max(r[key] for r in rows if key in r))
    outside = [r["perf/max_memory_allocated_outside_engine_gb"] for r in rows
               if "perf/max_memory_allocated_outside_engine_gb" in r]
    return {"phase_peak_gib": phases, "micro_batch_tokens": micro, "engine_pool_gb": pool or None,
            "peak_outside_engine_gib": max(outside, default=None)}


def memory_record(rows: list[dict]) -> dict:
    """``from_rows`` as a result records it: ``memory`` (timed phase → ``measured_gib``, ``micro_batch_tokens``) and
    ``engine_pool`` (``measured_gib``)."""
    got = from_rows(rows)
    return {"memory": {p: {"measured_gib": v, "micro_batch_tokens": got["micro_batch_tokens"].get(p)}
                       for p, v in got["phase_peak_gib"].items()},
            "engine_pool": {"measured_gib": got["engine_pool_gb"]}}
