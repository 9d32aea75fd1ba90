"""The driver's advantage phase: token rewards (optionally KL-penalised) → advantages.

This is the thin glue between a ``Batch`` and the pure estimators in
``hybrid_rl.algorithms``: it reads the batch's tensors, picks the estimator
named by ``algorithm.adv_estimator`` from a table, and returns a batch with
``token_level_rewards``, ``advantages`` and ``returns`` added. No communication
is needed: a prompt's n samples live on one rank.
"""

from __future__ import annotations

from typing import Callable

import torch

from hybrid_rl import algorithms as alg
from hybrid_rl.batch import Batch
from hybrid_rl.config import AlgorithmConfig


# Each outcome/return estimator with the config knobs it reads; groups are the ``uid``s.
_ESTIMATORS: dict[str, Callable] = {
    "grpo": lambda r, m, uid, cfg: alg.grpo_advantage(r, m, uid, norm_by_std=cfg.norm_adv_by_std_in_grpo),
    "dr_grpo": lambda r, m, uid, cfg: alg.dr_grpo_advantage(r, m, uid),
    "rloo": lambda r, m, uid, cfg: alg.rloo_advantage(r, m, uid),
    "reinforce_pp": lambda r, m, uid, cfg: alg.reinforce_pp_advantage(r, m, gamma=cfg.gamma),
}


def compute_advantage(batch: Batch, cfg: AlgorithmConfig) -> tuple[Batch, dict[str, float]]:
    t = batch.tensors
    mask = t["response_mask"].float()  # [B, R]
    scores = t["token_level_scores"]  # [B, R]
    metrics: dict[str, float] = {}
    if cfg.use_kl_in_reward:
        rewards, kl_mean = alg.apply_kl_in_reward(scores, t["old_log_probs"], t["ref_log_prob"], mask, cfg.kl_coef, cfg.kl_penalty)
        metrics["actor/reward_kl_penalty"] = float(kl_mean)
    else:
        rewards = scores
    estimator = _ESTIMATORS.get(cfg.adv_estimator)
    if estimator is None:  # gae is rejected by Config.validate until a critic exists
        raise ValueError(f"algorithm.adv_estimator={cfg.adv_estimator} is not supported by the driver yet")
    adv, ret = estimator(rewards, mask, batch.non_tensors["uid"], cfg)
    return batch.union(tensors=dict(token_level_rewards=rewards, advantages=adv, returns=ret)), metrics


def sparse_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar score on its last response token: [B] → [B, R]."""
    out = torch.zeros_like(response_mask, dtype=torch.float32)
    last = (response_mask.sum(dim=1) - 1).clamp(min=0).long()
    out[torch.arange(len(scores)), last] = scores.float().to(out.device)
    return out
