"""The driver's old-log-prob phase: where a step's π_old comes from (``actor.old_log_prob``), timed as
``timing/old_log_prob``.

``plan_old_log_prob`` decides once per step and returns an ``OldLogProbPlan``; the worker carries it out in two
calls, ``compute_old_log_probs(batch, plan)`` (the separate no-grad pass, part of it, the engine's log-probs, or
nothing) and ``update_policy(batch, plan)`` (the update, whose own first forward fills what the pass left out). The
plan says what to do, not which setting chose it, so neither call branches on ``actor.old_log_prob``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hybrid_rl.batch import Batch
from hybrid_rl.config import Config
from hybrid_rl.telemetry.tracking import Timer

if TYPE_CHECKING:
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker


@dataclass(frozen=True)
class OldLogProbPlan:
    """How this step's π_old is obtained. With every field at its default: the separate pass over the whole batch."""

    from_engine: bool = False
    """The rollout engine's log-probs of the sampled tokens stand in for π_old: no pass (``actor.old_log_prob=engine``)."""
    first_order: np.ndarray | None = None
    """Set: the update's first mini-batch of its first epoch takes π_old from its own forward, detached, and this is
    that epoch's row order (drawn here, where the update would draw it, so that the pass knows which rows to leave
    out); the pass covers the other mini-batches only, none when there is one."""
    skipped: float = 0.0
    """The share of the separate pass not run (``actor/old_log_prob_skipped``)."""

    @property
    def update_fills_first(self) -> bool:
        """Whether the update's own first forward writes π_old for its first mini-batch."""
        return self.first_order is not None

    @property
    def runs_pass(self) -> bool:
        """Whether the separate no-grad pass runs on any row (what ``timing/old_log_prob`` times)."""
        return self.skipped < 1.0


RECOMPUTE = OldLogProbPlan()
"""The separate pass over the whole batch, then an update that reads it (also the plan of any batch that arrives with
``old_log_probs`` already in it)."""


def plan_old_log_prob(cfg: Config, worker: ActorRolloutRefWorker, batch: Batch, actor_updates: bool) -> OldLogProbPlan:
    """This step's plan: ``actor.old_log_prob`` as set, or under ``auto`` the update's own forward, detached, for its
    first mini-batch, where that is exact: the weights have not moved when that forward runs (in overlap mode it is
    under θ_k, the proximal policy), the actor updates this step (``actor_updates``), and nothing reads π_old before
    the update (KL-in-reward does; the step's metrics read it after). With one mini-batch per epoch no pass runs at
    all; with more, the pass runs on the other mini-batches only."""
    setting = cfg.actor.old_log_prob
    if setting == "engine":
        return OldLogProbPlan(from_engine=True, skipped=1.0)
    if setting == "recompute" or cfg.algorithm.use_kl_in_reward or not actor_updates:
        return RECOMPUTE
    mini_batches = worker.num_mini_batches(batch)
    return OldLogProbPlan(first_order=worker.draw_update_order(len(batch)), skipped=1.0 / mini_batches)


def old_log_probs(worker: ActorRolloutRefWorker, batch: Batch, plan: OldLogProbPlan, timer: Timer) -> Batch:
    """``batch`` with π_old as far as ``plan`` has the pass compute it; ``timing/old_log_prob`` is the pass's time, 0
    where none runs."""
    if plan.runs_pass:
        with timer("old_log_prob"):
            return worker.compute_old_log_probs(batch, plan)
    timer.times["timing/old_log_prob"] = 0.0
    return worker.compute_old_log_probs(batch, plan)
