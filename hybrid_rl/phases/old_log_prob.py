"""The driver's old-log-prob phase: where a step's π_old comes from (``actor.old_log_prob``), timed as
``timing/old_log_prob``.

A source is one of ``recompute`` (the separate no-grad pass over the whole batch), ``first_mini`` (that pass
without the update's first mini-batch, which the update's own forward fills), ``update`` (no pass at all: the
update's own forward fills every row) or ``engine`` (the rollout engine's log-probs). The worker runs the choice
(``ActorRolloutRefWorker.prepare_old_log_probs``, then ``update_policy`` keyed on the same source).
"""

from __future__ import annotations

from hybrid_rl.batch import Batch
from hybrid_rl.config import Config
from hybrid_rl.tracking import Timer
from hybrid_rl.workers.actor_rollout_ref import OLD_LOG_PROB_PASSES, ActorRolloutRefWorker


def old_log_prob_source(cfg: Config, mini_batches: int, actor_updates: bool) -> str:
    """This step's π_old source: ``actor.old_log_prob`` as set, or under ``auto`` the update's own forward, detached,
    for its first mini-batch, where that is exact: the weights have not moved when that forward runs (in overlap
    mode it is under θ_k, the proximal policy), the actor updates this step (``actor_updates``), and nothing reads
    π_old before the update (KL-in-reward does; the step's metrics read it after). ``update``: one mini-batch per
    epoch (``mini_batches``), no pass at all; ``first_mini``: the pass runs on the other mini-batches only."""
    if cfg.actor.old_log_prob != "auto":
        return cfg.actor.old_log_prob
    if cfg.algorithm.use_kl_in_reward or not actor_updates:
        return "recompute"
    return "update" if mini_batches == 1 else "first_mini"


def old_log_probs(worker: ActorRolloutRefWorker, batch: Batch, source: str, timer: Timer) -> tuple[Batch, float]:
    """``batch`` with π_old from ``source`` and the share of the pass not run (``actor/old_log_prob_skipped``);
    ``timing/old_log_prob`` is the pass's time, 0 where none runs."""
    if source in OLD_LOG_PROB_PASSES:
        with timer("old_log_prob"):
            return worker.prepare_old_log_probs(batch, source)
    timer.times["timing/old_log_prob"] = 0.0
    return worker.prepare_old_log_probs(batch, source)
