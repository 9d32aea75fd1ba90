"""The driver's advantage phase: token rewards (optionally KL-penalised) → advantages.

This is the thin glue between a ``Batch`` and the pure estimators in
``hybrid_rl.algorithms``: it reads the batch's tensors, looks up the estimator
named by ``algorithm.adv_estimator`` in the registry
(``algorithms.advantages.ADV_ESTIMATORS``), calls it with what its
registration says it needs, and returns a batch with ``token_level_rewards``,
``advantages`` and ``returns`` added. No communication is needed: a prompt's n
samples live on one rank.
"""

from __future__ import annotations

import torch

from hybrid_rl import algorithms as alg
from hybrid_rl.batch import Batch
from hybrid_rl.config import AlgorithmConfig


def compute_advantage(batch: Batch, cfg: AlgorithmConfig, kl_coef: float | None = None) -> tuple[Batch, dict[str, float]]:
    """``kl_coef``: β of the KL-in-reward penalty now (the driver's KL controller); None = ``kl_ctrl.kl_coef``."""
    t = batch.tensors
    mask = t["response_mask"].float()  # [B, R]
    scores = t["token_level_scores"]  # [B, R]
    metrics: dict[str, float] = {}
    if cfg.use_kl_in_reward:
        rewards, kl_mean = alg.apply_kl_in_reward(scores, t["old_log_probs"], t["ref_log_prob"], mask, cfg.kl_ctrl.kl_coef if kl_coef is None else kl_coef, cfg.kl_penalty)
        metrics["actor/reward_kl_penalty"] = float(kl_mean)
        metrics["actor/reward_kl_penalty_coeff"] = float(cfg.kl_ctrl.kl_coef if kl_coef is None else kl_coef)
    else:
        rewards = scores
    estimator = alg.ADV_ESTIMATORS[cfg.adv_estimator]
    info: alg.EstimatorInfo = alg.ADV_ESTIMATORS.info(cfg.adv_estimator)
    needs: dict[str, object] = {}
    if info.needs_groups:
        needs["index"] = batch.non_tensors["uid"]  # a group is the n samples of one prompt
    if info.needs_critic:
        if "values" not in t:  # the driver's values phase runs whenever cfg.need_critic
            raise ValueError(f"algorithm.adv_estimator={cfg.adv_estimator} needs the critic's values in the batch "
                             f"(run the critic's compute_values first)")
        needs["values"] = t["values"]
    adv, ret = estimator(token_level_rewards=rewards, response_mask=mask, **needs, **info.config(cfg))
    return batch.union(tensors=dict(token_level_rewards=rewards, advantages=adv, returns=ret)), metrics


def kl_in_reward_stats(batch: Batch, cfg: AlgorithmConfig) -> tuple[float, float]:
    """(sum over sequences of each one's mean KL to the reference, number of sequences): what the adaptive KL
    controller is fed after the driver sums these over the ranks."""
    t = batch.tensors
    seq_kl = alg.sequence_kl(t["old_log_probs"], t["ref_log_prob"], t["response_mask"].float(), cfg.kl_penalty)  # [B]
    return float(seq_kl.sum()), float(len(batch))


def sparse_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar score on its last response token (the last sampled one of a multi-turn
    trajectory, whose mask has holes): [B] → [B, R]."""
    out = torch.zeros_like(response_mask, dtype=torch.float32)
    last = (alg.response_extent(response_mask) - 1).clamp(min=0).long()
    out[torch.arange(len(scores)), last] = scores.float().to(out.device)
    return out
