"""KL estimators between the policy and a frozen reference policy.

Sampled per-token estimates of KL(pi_theta || pi_ref) from the log-probs
of the sampled tokens (Schulman, "Approximating KL Divergence"), used two
ways: as a loss term (``kl_loss``, GRPO style) or subtracted from the
reward before advantage estimation (``apply_kl_in_reward``, PPO style), whose
coefficient β a controller keeps: ``FixedKLController`` (constant) or
``AdaptiveKLController`` (Ziegler et al. 2019: β grows when the measured KL is
above ``target_kl`` and shrinks below it, by at most ±20% of the error per
``horizon`` sequences).

Sign convention: every estimator takes (log_prob, ref_log_prob) with the
*current/rollout* policy first, and is positive in expectation.

Left out: full-vocabulary KL and the straight-through "+" variants. The
controllers hold no distributed state: the driver feeds them the KL reduced
over all ranks, so every rank's β stays identical.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .core import Number, check_same_shape, select_masked, agg_loss, masked_mean

__all__ = ["AdaptiveKLController", "FixedKLController", "KL_ESTIMATORS", "apply_kl_in_reward", "kl_k1", "kl_k2", "kl_k3",
           "kl_loss", "kl_penalty", "make_kl_controller", "sequence_kl"]


def kl_k1(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k1 = log p - log q: unbiased, high variance, can be negative. [B, R]"""
    return log_prob - ref_log_prob


def kl_k2(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k2 = 0.5 (log p - log q)^2: biased, low variance, >= 0. [B, R]"""
    return 0.5 * (log_prob - ref_log_prob).square()


def kl_k3(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k3 = q/p - log(q/p) - 1: unbiased, low variance, >= 0. [B, R]

    The log-ratio is clamped to [-20, 20] before exp and the result to
    [-10, 10] (as verl does): a single token the reference finds far more
    likely would otherwise dominate the loss with an exp-sized value.
    """
    log_ratio = torch.clamp(ref_log_prob - log_prob, -20.0, 20.0)
    kld = torch.exp(log_ratio) - log_ratio - 1.0
    return torch.clamp(kld, -10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate [B, R] with the estimator named by ``kind``."""
    fn = KL_ESTIMATORS.get(kind)
    if fn is None:
        raise ValueError(f"unknown KL estimator {kind!r}; valid kinds: {', '.join(KL_ESTIMATORS)}")
    check_same_shape(log_prob=log_prob, ref_log_prob=ref_log_prob)
    return fn(log_prob, ref_log_prob)


def kl_loss(
    log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kind: str = "k3",
    loss_agg_mode: str = "token-mean",
    num_tokens: Optional[Number] = None,
    num_seqs: Optional[Number] = None,
    norm_length: Optional[int] = None,
) -> Tensor:
    """KL to the reference as a scalar loss term (multiply by the coefficient yourself).

    num_tokens/num_seqs/norm_length are passed to ``agg_loss`` (see there).
    """
    kld = kl_penalty(log_prob, ref_log_prob, kind)  # [B, R]
    return agg_loss(kld, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    norm_length=norm_length)


def apply_kl_in_reward(
    token_level_scores: Tensor,
    old_log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    kind: str = "k1",
) -> tuple[Tensor, float]:
    """Reward shaping: rewards = scores - kl_coef * KL, on response tokens only.

    Returns (token_level_rewards [B, R], kl_mean) where kl_mean is the
    token-level masked mean of the KL estimate (a Python float, for logging;
    verl averages per sequence first, which weights short responses more).
    Computed without grad: rewards are targets.
    """
    check_same_shape(token_level_scores=token_level_scores, response_mask=response_mask)
    with torch.no_grad():
        kld = select_masked(kl_penalty(old_log_prob, ref_log_prob, kind), response_mask)  # [B, R]
        rewards = token_level_scores - kl_coef * kld
        kl_mean = float(masked_mean(kld, response_mask).item())
    return rewards, kl_mean


def sequence_kl(old_log_prob: Tensor, ref_log_prob: Tensor, response_mask: Tensor, kind: str = "k1") -> Tensor:
    """Each sequence's mean per-token KL estimate [B] (what the adaptive controller tracks, as verl does)."""
    kld = kl_penalty(old_log_prob, ref_log_prob, kind)  # [B, R]
    return masked_mean(kld, response_mask, dim=-1)  # [B]


class FixedKLController:
    """β stays ``kl_coef``."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """β ← β · (1 + clip(KL/target − 1, −0.2, 0.2) · n_steps / horizon) after every batch of ``n_steps`` sequences."""

    def __init__(self, kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs target_kl > 0 and horizon > 0, got {target_kl} and {horizon}")
        super().__init__(kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000) -> FixedKLController:
    """The controller ``algorithm.kl_ctrl.type`` names: ``fixed`` or ``adaptive``."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; valid: fixed, adaptive")
