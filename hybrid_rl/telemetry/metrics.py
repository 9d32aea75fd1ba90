"""Per-step data metrics from a finished rollout batch, as (sum, count) pairs and maxima.

Returned in reducible form so the driver can combine ranks exactly: means are
weighted by samples or tokens, maxima are all-reduced with MAX. Names follow
verl's grouping (``reward/*``, ``rollout/*``, ``actor/*``). ``step_metrics``
gathers a step's pairs and maxima on one rank, ``step_times`` its timers;
``finish_step_metrics`` completes them once reduced over the ranks (throughput,
MFU and memory: ``perf.step_perf_metrics``).
"""

from __future__ import annotations

import torch

from hybrid_rl.algorithms.core import response_extent
from hybrid_rl.batch import Batch
from hybrid_rl.envs.base import STOPS
from hybrid_rl.envs.metrics import env_metrics, is_multi_turn
from hybrid_rl.modes.partial import COUNTS as PARTIAL_COUNTS
from hybrid_rl.modes.partial import partial_metrics


def cut_at_cap(response_mask: torch.Tensor, max_response_length: int,
               env_stop: torch.Tensor | None = None) -> torch.Tensor:
    """[B] bool: the responses that reached ``max_response_length`` (cut, not finished; one that ended exactly at the
    cap counts as cut too; a multi-turn trajectory's length counts its observations), and the multi-turn
    trajectories the budget ended (``env_stop``: an observation that would not fit ends its trajectory short of the
    cap, unanswered). The one definition behind ``rollout/response_clip_ratio``, ``val/response_clip_ratio`` and
    ``actor.mask_truncated_completions``."""
    cut = response_extent(response_mask) >= max_response_length
    if env_stop is not None:
        cut = cut | (env_stop.to(cut.device) == STOPS.index("budget"))
    return cut


def outcome_sums(scores: torch.Tensor, response_mask: torch.Tensor, max_response_length: int,
                 env_stop: torch.Tensor | None = None) -> dict[str, float]:
    """Sums over a batch of the score, the score of responses cut at ``max_response_length`` (a flexible extractor
    pays a ramble whose last number happens to match), the response tokens and the cut responses; training
    (``reward/*``, ``rollout/*``) and validation (``val/*``) name them differently."""
    resp_len = response_extent(response_mask).float()
    clipped = cut_at_cap(response_mask, max_response_length, env_stop).to(scores.dtype)
    return {"score": float(scores.sum()), "clipped_score": float((scores * clipped).sum()),
            "length": float(resp_len.sum()), "clipped": float(clipped.sum())}


def batch_metrics(batch: Batch, max_response_length: int, trainer_version: int) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    t = batch.tensors
    mask = t["response_mask"].float()  # [B, R]
    n = float(len(batch))
    resp_len = response_extent(mask).float()  # [B]; a multi-turn trajectory's observations included
    prompt_len = t["attention_mask"][:, : t["prompts"].shape[1]].float().sum(dim=1)
    ntok = float(mask.sum())
    scores = t["scores"].float()
    staleness = (trainer_version - t["weight_version"]).float()
    out = outcome_sums(scores, mask, max_response_length, t.get("env_stop"))
    means = {
        "reward/mean": (out["score"], n),
        "reward/clipped_mean": (out["clipped_score"], n),  # the part of it that responses cut at the length cap earned
        "rollout/response_length_mean": (out["length"], n),
        "rollout/prompt_length_mean": (float(prompt_len.sum()), n),
        "rollout/response_clip_ratio": (out["clipped"], n),
        "actor/advantages_mean": (float((t["advantages"] * mask).sum()), ntok),
        "actor/entropy_old": (float((t["old_entropy"] * mask).sum()), ntok) if "old_entropy" in t else (0.0, 0.0),
        "rollout/staleness_mean": (float(staleness.sum()), n),
        "perf/response_tokens": (ntok, 1.0),
        "perf/total_tokens": (float(t["attention_mask"].float().sum()), 1.0),  # observation tokens included
    }
    maxima = {
        "reward/max": float(scores.max()),
        "reward/min_neg": float(-scores.min()),
        "rollout/response_length_max": float(resp_len.max()),
        "rollout/staleness_max": float(staleness.max()),
    }
    if "rollout_log_probs" in t:  # the engine's log-probs (rollout.logprobs): their gap to the trainer's
        diff = (t["rollout_log_probs"] - t["old_log_probs"]).abs() * mask
        # π_prox/π_behav per token: 1 in exact sync, drifts with staleness and engine numerics
        is_ratio = torch.exp((t["old_log_probs"] - t["rollout_log_probs"]).clamp(-20, 20))
        means.update({"rollout/logprob_diff": (float(diff.sum()), ntok),
                      "rollout/is_ratio_mean": (float((is_ratio * mask).sum()), ntok)})
        maxima.update({"rollout/logprob_diff_max": float(diff.max()),
                       "rollout/is_ratio_max": float((is_ratio * mask).max())})
    return means, maxima


def step_metrics(batch: Batch, max_response_length: int, pairs: dict[str, tuple[float, float]],
                 values: dict[str, float]) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """This rank's (sum, count) pairs and maxima of a step: the batch trained on (``batch_metrics``, and under partial
    rollouts the per-token staleness and carry-over counts) and the phases' ``pairs`` and plain ``values``."""
    means, maxima = batch_metrics(batch, max_response_length, batch.meta["trainer_version"])
    means.update(pairs)
    means.update({k: (v, 1.0) for k, v in values.items()})
    if "token_weight_version" in batch.tensors:  # staleness per token; partial rollouts: their carry-over counts
        extra_means, extra_max = partial_metrics(batch, batch.meta["trainer_version"], counts=not is_multi_turn(batch))
        means.update(extra_means)
        maxima.update(extra_max)
    if is_multi_turn(batch):  # env/*: turns, tool calls and faults, observation tokens
        extra_means, extra_max = env_metrics(batch)
        means.update(extra_means)
        maxima.update(extra_max)
    return means, maxima


def step_times(times: dict[str, float], sync_s: float) -> dict[str, float]:
    """The step's timers with ``timing/other`` (sync mode, where ``timing/switch`` is timed: what the step spent
    outside its named phases, host work and stalls) and ``timing/sync_weights`` (the push alone, ``sync_s``)."""
    if "timing/switch" in times:
        times["timing/other"] = max(0.0, times["timing/step"] - sum(
            v for k, v in times.items() if k not in ("timing/step", "timing/sync_weights")))
    times["timing/sync_weights"] = sync_s
    return times


def finish_step_metrics(out: dict[str, float], meta: dict, sync_bytes: int, world: int) -> None:
    """Complete the step metrics ``out``, reduced over the ``world`` training ranks, in place: ``reward/min``, the
    weight push and version of the batch (``meta``), the counts of partial rollouts summed over the ranks (each
    rank's count was reduced as a mean) and the share of their rounds' context read from vLLM's prefix cache."""
    out["reward/min"] = -out.pop("reward/min_neg")
    out["rollout/weight_sync_bytes"] = float(sync_bytes)
    out["rollout/weight_version"] = float(meta.get("weight_version") or 0)
    out["rollout/dropped_batches"] = float(meta.get("dropped_batches", 0))
    for key in (f"rollout/{k}" for k in PARTIAL_COUNTS):
        if key in out:
            out[key] *= world
    if out.get("rollout/partial_context_tokens"):
        out["rollout/prefix_cache_hit"] = out["rollout/partial_cached_tokens"] / out["rollout/partial_context_tokens"]
