"""RL algorithm math: advantage estimators, policy losses, KL terms, and the
masked tensor helpers they share. Pure tensor functions, no distributed code.
Estimators and losses are registered by name (``ADV_ESTIMATORS``,
``POLICY_LOSSES``) beside their definitions."""

from .advantages import (
    ADV_ESTIMATORS,
    EstimatorInfo,
    dr_grpo_advantage,
    gae_advantage,
    grpo_advantage,
    register_estimator,
    reinforce_pp_advantage,
    rloo_advantage,
)
from .core import (
    LOSS_AGG_MODES,
    agg_loss,
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from .kl import KL_ESTIMATORS, apply_kl_in_reward, kl_k1, kl_k2, kl_k3, kl_loss, kl_penalty
from .policy_loss import POLICY_LOSSES, PolicyLossInfo, decoupled_ppo_loss, ppo_clip_loss, register_policy_loss

__all__ = [
    "ADV_ESTIMATORS",
    "EstimatorInfo",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "PolicyLossInfo",
    "agg_loss",
    "apply_kl_in_reward",
    "decoupled_ppo_loss",
    "dr_grpo_advantage",
    "entropy_from_logits",
    "gae_advantage",
    "grpo_advantage",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_loss",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_clip_loss",
    "register_estimator",
    "register_policy_loss",
    "reinforce_pp_advantage",
    "rloo_advantage",
]
