"""Advantage estimators: turn token-level rewards into per-token advantages.

One function per estimator, each returning ``(advantages, returns)`` of
shape [B, R], zero outside ``response_mask``. Group-based estimators
(GRPO, Dr. GRPO, RLOO) take ``index``: one group id per sequence, shared by
the samples of one prompt, as a list, a numpy array (e.g. the object array of
``uid`` strings) or a 1-D tensor; ids are compared by value, never by identity.

All estimators run under ``torch.no_grad``: advantages are regression
targets / fixed weights, never something to differentiate through.

``ADV_ESTIMATORS`` is the one registry of estimators, by the name that
``algorithm.adv_estimator`` takes; each registration says what the estimator
needs (prompt groups, a critic) and which config knobs it reads. Config
validation reads it (the valid names, ``rollout.n >= 2`` for group-based ones,
no critic yet), and the driver's advantage phase
(``hybrid_rl.phases.advantage``) calls the registered function with keyword
arguments: ``token_level_rewards``, ``response_mask``, ``index`` (the batch's
``uid``s, when ``needs_groups``), ``values`` (when ``needs_critic``), and the
knobs ``config(cfg.algorithm)`` returns. A new estimator is one function plus
one ``@register_estimator(...)``.

Left out: distributed whitening (statistics are over the local batch),
KL-in-reward shaping (see ``kl.apply_kl_in_reward``), and OPO/GPG/other
verl estimators not used by this project.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from hybrid_rl.registry import Registry

from .core import check_same_shape, select_masked, masked_mean, masked_sum, masked_var, masked_whiten

# One group id per sequence: a 1-D tensor / numpy array, or a sequence of hashable ids.
GroupIndex = Union[Tensor, np.ndarray, Sequence[Hashable]]

__all__ = [
    "ADV_ESTIMATORS",
    "EstimatorInfo",
    "dr_grpo_advantage",
    "gae_advantage",
    "grpo_advantage",
    "reinforce_pp_advantage",
    "register_estimator",
    "rloo_advantage",
]

AdvEstimator = Callable[..., tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class EstimatorInfo:
    """What an estimator needs from the run, registered with it."""

    needs_groups: bool = False
    """It compares the samples of one prompt (``index`` = the batch's ``uid``s), so ``rollout.n`` must be >= 2."""
    needs_critic: bool = False
    """It needs value estimates (``values``), i.e. a critic; config validation rejects it until one is built."""
    config: Callable[[Any], dict[str, Any]] = lambda algorithm_cfg: {}
    """The estimator's keyword arguments read from ``AlgorithmConfig`` (e.g. grpo's ``norm_by_std``)."""


ADV_ESTIMATORS: Registry[AdvEstimator] = Registry("algorithm.adv_estimator")
"""Every advantage estimator by name, in registration order; ``ADV_ESTIMATORS.info(name)`` is its ``EstimatorInfo``."""


def register_estimator(
    name: str,
    *,
    needs_groups: bool = False,
    needs_critic: bool = False,
    config: Optional[Callable[[Any], dict[str, Any]]] = None,
) -> Callable[[AdvEstimator], AdvEstimator]:
    """Decorator: register ``fn`` as ``algorithm.adv_estimator=name`` (a duplicate name is an error)."""
    return ADV_ESTIMATORS.add(name, info=EstimatorInfo(needs_groups, needs_critic, config or (lambda algorithm_cfg: {})))


def _float_dtype(t: Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _scalar_id(i: Hashable) -> Hashable:
    """A group id as a plain Python value: tensors hash by identity (two ``tensor(0)`` are different
    dict keys), so 0-dim tensors and numpy scalars are replaced by their ``.item()``."""
    if isinstance(i, (Tensor, np.ndarray, np.generic)):
        if (i.numel() if isinstance(i, Tensor) else i.size) == 1:
            return i.item()
        raise ValueError(f"a group id must be a scalar, got an array of shape {tuple(i.shape)}")
    return i


def _group_ids(index: GroupIndex, batch_size: int, device: torch.device) -> tuple[Tensor, int]:
    """Map group ids to dense ints 0..G-1 (first-seen order).

    ``index`` may be a 1-D tensor or numpy array (ints, strings, objects) or any sequence of hashable ids.
    """
    if isinstance(index, (Tensor, np.ndarray)):
        if index.ndim != 1:
            raise ValueError(f"index must be 1-D (one group id per sequence), got shape {tuple(index.shape)}")
        ids = index.tolist()  # Python scalars (object arrays keep their objects: _scalar_id handles those)
    else:
        ids = list(index)
    if len(ids) != batch_size:
        raise ValueError(f"index has {len(ids)} entries but the batch has {batch_size} sequences")
    dense: dict[Hashable, int] = {}
    gid = [dense.setdefault(_scalar_id(i), len(dense)) for i in ids]
    return torch.tensor(gid, dtype=torch.long, device=device), len(dense)


def _sequence_scores(token_level_rewards: Tensor, response_mask: Tensor) -> Tensor:
    if token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be [B, R], got {tuple(token_level_rewards.shape)}")
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    rewards = token_level_rewards.to(_float_dtype(token_level_rewards))
    return masked_sum(rewards, response_mask, dim=-1)  # [B]


def _group_stats(scores: Tensor, gid: Tensor, n_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sequence (group size, group mean, unbiased group std), each [B]."""
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    counts = torch.bincount(gid, minlength=n_groups).to(scores.dtype)  # [G]
    means = zeros.index_add(0, gid, scores) / counts  # [G]
    sq_dev = zeros.index_add(0, gid, (scores - means[gid]) ** 2)  # [G]
    # Same two-pass unbiased estimate as torch.std; size-1 groups fixed up by callers.
    stds = (sq_dev / (counts - 1).clamp(min=1)).sqrt()  # [G]
    return counts[gid], means[gid], stds[gid]


def _broadcast(per_seq: Tensor, response_mask: Tensor) -> Tensor:
    return select_masked(per_seq.unsqueeze(-1), response_mask)  # [B, R]


@register_estimator("grpo", needs_groups=True, config=lambda c: {"norm_by_std": c.norm_adv_by_std_in_grpo})
@torch.no_grad()
def grpo_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GRPO: outcome score normalised within its prompt group.

    score_i = sum_t r[i, t] (masked); adv_i = (score_i - mean_g) / (std_g + eps)
    with the unbiased group std, or score_i - mean_g when ``norm_by_std`` is
    False. As in verl, a group of one sample uses mean 0 and std 1, so its
    advantage is its raw score (divided by 1 + eps).
    Returns (advantages, returns), both [B, R] and identical.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)  # [B]
    gid, n_groups = _group_ids(index, scores.shape[0], scores.device)
    counts, means, stds = _group_stats(scores, gid, n_groups)  # [B] each
    single = counts == 1
    means = torch.where(single, torch.zeros_like(means), means)
    stds = torch.where(single, torch.ones_like(stds), stds)
    centred = scores - means
    per_seq = centred / (stds + eps) if norm_by_std else centred  # [B]
    adv = _broadcast(per_seq, response_mask)  # [B, R]
    return adv, adv.clone()


@register_estimator("dr_grpo", needs_groups=True)
@torch.no_grad()
def dr_grpo_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
) -> tuple[Tensor, Tensor]:
    """Dr. GRPO: GRPO without the std division (removes the difficulty bias).

    Pair it with loss_agg_mode="seq-mean-token-sum-norm" to also remove the
    length bias, as the paper does.
    """
    return grpo_advantage(token_level_rewards, response_mask, index, norm_by_std=False)


@register_estimator("rloo", needs_groups=True)
@torch.no_grad()
def rloo_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
) -> tuple[Tensor, Tensor]:
    """RLOO: score minus the mean score of the *other* samples of its group.

    s_i - (sum_g - s_i) / (n - 1) = n / (n - 1) * (s_i - mean_g). A group of
    one sample has no baseline; its advantage is 0 (unlike verl, which
    leaves the raw score) so that it contributes no gradient.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)  # [B]
    gid, n_groups = _group_ids(index, scores.shape[0], scores.device)
    counts, means, _ = _group_stats(scores, gid, n_groups)  # [B] each
    per_seq = counts / (counts - 1).clamp(min=1) * (scores - means)  # [B]
    # For size-1 groups scores == means already, so per_seq is 0 there.
    adv = _broadcast(per_seq, response_mask)
    return adv, adv.clone()


def _discounted_reward_to_go(rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} over real tokens: a masked-out position (right padding, or an observation inside a
    multi-turn trajectory) is skipped, the running return carried through it unchanged; 0 there."""
    keep = response_mask.bool()
    rewards = select_masked(rewards, keep)
    returns = torch.zeros_like(rewards)  # [B, R]
    running = torch.zeros_like(rewards[:, 0])  # [B]
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(keep[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = select_masked(running, keep[:, t])
    return returns


@register_estimator("reinforce_pp", config=lambda c: {"gamma": c.gamma})
@torch.no_grad()
def reinforce_pp_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted reward-to-go, whitened over the whole batch.

    returns[b, t] = sum_{k>=t} gamma^(k-t) r[b, k] over real tokens;
    advantages = masked_whiten(returns) * mask (batch-level baseline and
    scale instead of a critic or per-prompt groups). Needs at least two real
    tokens in the batch (unbiased variance).
    """
    if token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be [B, R], got {tuple(token_level_rewards.shape)}")
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    rewards = token_level_rewards.to(_float_dtype(token_level_rewards))
    returns = _discounted_reward_to_go(rewards, response_mask, gamma)  # [B, R]
    advantages = select_masked(masked_whiten(returns, response_mask), response_mask)
    return advantages, returns


@register_estimator("gae", needs_critic=True, config=lambda c: {"gamma": c.gamma, "lam": c.lam, "whiten": c.gae_whiten,
                                                           "std_floor": c.gae_std_floor})
@torch.no_grad()
def gae_advantage(
    token_level_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float,
    lam: float,
    whiten: str = "std",
    std_floor: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (PPO with a critic).

    delta_t = r_t + gamma * V_{t+1} - V_t, with V = 0 after the last real
    token; A_t = sum_k (gamma*lam)^k delta_{t+k}. Masked-out positions are
    skipped (the next value and the running advantage carry through them),
    so right padding behaves like the end of the episode.
    returns = A + V (the critic target, un-whitened); advantages = A
    whitened over the masked tokens (``whiten="std"``), only centred
    (``"mean"``) or raw (``"none"``); ``std_floor`` bounds the whitening's
    divisor from below. Both zero outside the mask.
    """
    if token_level_rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be [B, R], got {tuple(token_level_rewards.shape)}")
    check_same_shape(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    dtype = torch.promote_types(_float_dtype(token_level_rewards), values.dtype)
    keep = response_mask.bool()
    # Padding may hold garbage (even NaN) values/rewards: select it away.
    rewards = select_masked(token_level_rewards.to(dtype), keep)
    values = select_masked(values.to(dtype), keep)

    adv = torch.zeros_like(rewards)  # [B, R]
    next_value = torch.zeros_like(rewards[:, 0])  # [B]
    last_gae = torch.zeros_like(rewards[:, 0])  # [B]
    for t in reversed(range(rewards.shape[1])):
        m = keep[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        # On a padded position keep the carried state untouched.
        next_value = torch.where(m, values[:, t], next_value)
        last_gae = torch.where(m, gae_t, last_gae)
        adv[:, t] = select_masked(gae_t, m)

    returns = select_masked(adv + values, keep)
    if whiten == "std" and std_floor > 0:
        centred = adv - masked_mean(adv, keep)
        adv = centred / torch.clamp(masked_var(adv, keep, unbiased=True).sqrt(), min=std_floor)
    elif whiten == "std":
        adv = masked_whiten(adv, keep)
    elif whiten == "mean":
        adv = adv - masked_mean(adv, keep)
    elif whiten != "none":
        raise ValueError(f"whiten must be 'std', 'mean' or 'none', got {whiten!r}")
    advantages = select_masked(adv, keep)
    return advantages, returns

