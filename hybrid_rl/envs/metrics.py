"""The ``env/`` metrics of a multi-turn batch (and ``val/env/`` of a validation), as (sum, count) pairs and maxima.

Read from the batch's per-trajectory counts (``assemble_trajectories``'s ``env_*`` tensors) and masks, so they
describe exactly the trajectories trained on (after group filtering, on the ranks that train): model turns, tool
calls and the share of trajectories with one, faults by kind (``base.ERROR_KINDS``) and per call, why trajectories
ended (``base.STOPS``), and the tokens the model sampled apart from those the observations and the template added.
"""

from __future__ import annotations

from hybrid_rl.batch import Batch
from hybrid_rl.envs.base import ERROR_KINDS, STOPS


def env_metric_keys(prefix: str = "env") -> list[str]:
    """Every mean key ``env_metrics`` returns (the same on every rank, a rank without samples included)."""
    return [f"{prefix}/{k}" for k in ("turns_mean", "tool_calls_mean", "called_frac", "errors_mean", "error_rate",
                                      "observation_tokens_mean", "sampled_tokens_mean")] + \
        [f"{prefix}/errors/{k}" for k in ERROR_KINDS] + [f"{prefix}/stop/{k}" for k in STOPS]


def env_metrics(batch: Batch, prefix: str = "env") -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """Per-trajectory means as (sum, count) and ``<prefix>/turns_max``; ``error_rate`` is faults per tool call."""
    t = batch.tensors
    n = float(len(batch))
    width = t["responses"].shape[1]
    sampled = t["response_mask"].float().sum(dim=1)
    observed = t["attention_mask"][:, -width:].float().sum(dim=1) - sampled
    errors = {k: float(t[f"env_errors_{k}"].sum()) for k in ERROR_KINDS}
    calls = t["env_tool_calls"].float()
    stop = t["env_stop"]
    means = {f"{prefix}/turns_mean": (float(t["env_turns"].sum()), n),
             f"{prefix}/tool_calls_mean": (float(calls.sum()), n),
             f"{prefix}/called_frac": (float((calls > 0).sum()), n),
             f"{prefix}/errors_mean": (sum(errors.values()), n),
             f"{prefix}/error_rate": (sum(errors.values()), float(calls.sum())),
             f"{prefix}/observation_tokens_mean": (float(observed.sum()), n),
             f"{prefix}/sampled_tokens_mean": (float(sampled.sum()), n),
             **{f"{prefix}/errors/{k}": (v, n) for k, v in errors.items()},
             **{f"{prefix}/stop/{k}": (float((stop == i).sum()), n) for i, k in enumerate(STOPS)}}
    maxima = {f"{prefix}/turns_max": float(t["env_turns"].max()) if len(batch) else 0.0}
    return means, maxima


def is_multi_turn(batch: Batch) -> bool:
    return "turn_ids" in batch.tensors


def zero_pairs(prefix: str) -> dict[str, tuple[float, float]]:
    return {k: (0.0, 0.0) for k in env_metric_keys(prefix)}


def add_pairs(into: dict[str, tuple[float, float]], more: dict[str, tuple[float, float]]) -> None:
    """Accumulate (sum, count) pairs in place."""
    for k, (v, c) in more.items():
        v0, c0 = into.get(k, (0.0, 0.0))
        into[k] = (v0 + v, c0 + c)

