"""The driver's reward phase: scores on the last response tokens, the overlong penalty, and with
``algorithm.filter_groups`` DAPO's dynamic sampling (drop the groups of equal rewards, refill with fresh ones).

The scoring itself (reward functions in worker processes, answer-shape counts) is ``hybrid_rl.scoring``; this
module is the step's use of it: the ``timing/reward`` timer, the (sum, count) ``reward/*`` stats, and the refill
loop, whose rounds every rank takes together (``scoring.fill_informative``).
"""

from __future__ import annotations

from typing import Callable

from hybrid_rl.batch import Batch
from hybrid_rl.config import Config
from hybrid_rl.data.tasks import Task
from hybrid_rl.distributed import DistInfo
from hybrid_rl.rewards import RewardScorer
from hybrid_rl.scoring import compute_scores, fill_informative, shape_overlong
from hybrid_rl.tracking import Timer

NextBatch = Callable[..., Batch]
"""The rollout source's ``next_batch(timer, last)``: a refill round's freshly generated batch."""


class RewardPhase:
    """Scores a step's batch; ``tokenizer`` decodes the responses, ``reward_fn`` scores them, ``task`` (None: an
    unknown one) counts their answer shapes, ``dist`` is the training ranks' world (group filtering meets there)."""

    def __init__(self, cfg: Config, tokenizer, reward_fn: RewardScorer, task: Task | None, dist: DistInfo):
        self.cfg, self.tokenizer, self.reward_fn, self.task, self.dist = cfg, tokenizer, reward_fn, task, dist

    def __call__(self, batch: Batch, timer: Timer, next_batch: NextBatch) -> tuple[Batch, dict]:
        """The scored batch (only informative groups under ``algorithm.filter_groups``, refilled through
        ``next_batch``) and its (sum, count) stats."""
        with timer("reward"):
            batch, reward_stats = self.score(batch)
        if self.cfg.algorithm.filter_groups.enable:
            batch, reward_stats = self.filter_groups(batch, reward_stats, timer, next_batch)
        return batch, reward_stats

    def score(self, batch: Batch) -> tuple[Batch, dict]:
        """Scores on the last response tokens, the overlong penalty; (sum, count) stats."""
        cfg = self.cfg
        batch, reward_stats = compute_scores(batch, self.tokenizer, self.reward_fn, cfg.reward.on_error, self.task)
        if cfg.reward.overlong_buffer_len > 0:
            batch, penalty_stats = shape_overlong(batch, cfg.data.max_response_length, cfg.reward.overlong_buffer_len,
                                                  cfg.reward.overlong_penalty_factor)
            reward_stats.update(penalty_stats)
        return batch, reward_stats

    def filter_groups(self, batch: Batch, reward_stats: dict, timer: Timer, next_batch: NextBatch
                      ) -> tuple[Batch, dict]:
        """``algorithm.filter_groups`` (DAPO's dynamic sampling, ``trainer.mode=sync`` only): drop the groups of equal
        rewards and refill with groups of fresh prompts (generated under the same θ_k, scored) until this rank holds
        its share of ``data.train_batch_size`` informative groups, every rank taking the same number of refill rounds
        (``scoring.fill_informative``). The reward stats count every scored sample; ``reward/mean`` and the other
        batch metrics describe the batch trained on."""
        cfg = self.cfg
        fg = cfg.algorithm.filter_groups
        switch = timer.times.get("timing/switch", 0.0)

        def more() -> Batch:
            nonlocal switch
            fresh = next_batch(timer, last=False)  # sync: push θ_k (already there), generate
            switch += timer.times.get("timing/switch", 0.0)
            with timer("reward"):
                fresh, stats = self.score(fresh)
            for k, (v, c) in stats.items():  # errors: a count per step; the rest: (sum, samples)
                v0, c0 = reward_stats.get(k, (0.0, 0.0))
                reward_stats[k] = (v0 + v, c0 if k == "reward/errors" else c0 + c)
            return fresh

        # the refills' generation and scoring count in timing/gen and timing/reward
        batch, counts = fill_informative(batch, more, cfg.data.train_batch_size // self.dist.world_size, fg.max_rounds,
                                         fg.metric, self.tokenizer.pad_token_id, self.dist.device, self.dist.group)
        if "timing/switch" in timer.times:
            timer.times["timing/switch"] = switch
        reward_stats.update({k: (v, 1.0) for k, v in counts.items()})
        return batch, reward_stats
