"""Off-policy corrections for decoupled PPO: how the behaviour ratio weighs, truncates or drops each token's loss.

Under decoupled PPO (``policy_loss.decoupled_ppo_loss``) a sample was drawn by the engine's *behaviour* policy
(possibly older weights, other numerics) and the trust region sits around the trainer's *proximal* policy. Each
response token t of sequence i has the behaviour ratio

    ρ_{i,t} = π_prox(y_{i,t}) / π_behav(y_{i,t})     (``log_ratio`` = log π_prox − log π_behav, [B, R])

and the loss multiplies each token's clipped PPO term by a detached factor w_{i,t} computed from it. A correction
is the rule for w: one function per rule here, registered under the name ``algorithm.rollout_correction.method``
takes (``ROLLOUT_CORRECTIONS``), with the config knobs it reads. Every one returns a ``Correction``: the factor, the
ratio it acted on (for ``is_ratio_mean/max``), and which tokens it truncated (the truncating rules: logged as
``rollout/is_truncated_frac``) or masked (the masking rules: ``rollout/is_masked_frac``). A masked token keeps its
place in the loss's denominator (its loss is zeroed, the normalisation is unchanged), as in SkyRL and verl. All of
them give w = 1 everywhere when behaviour and proximal agree (ρ = 1), so decoupled PPO is then plain PPO whatever the
method. Log-ratios are clamped to [−20, 20] before ``exp``; positions outside ``response_mask`` are never counted
(their weight does not matter: the loss masks them).

Left out: combining corrections (one method per run), lower bounds for the truncations and the product mask,
SkyRL's outlier-token veto (drop a sequence for one extreme token), adaptive bands, and anything distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from hybrid_rl.registry import Registry

from .core import masked_sum

__all__ = ["Correction", "CorrectionInfo", "ROLLOUT_CORRECTIONS", "geo_mask", "make_correction",
           "register_correction", "sequence_mask", "sequence_truncate", "token_mask", "token_truncate"]

# exp(20) ~ 4.9e8: never binds on sane data, keeps every weight finite.
_LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class Correction:
    """What a correction makes of one micro-batch's ratios, every tensor [B, R] and detached."""

    weights: Tensor
    """The factor on each token's loss (0 = the token is dropped)."""
    ratio: Tensor
    """The ratio the rule acted on: ρ_{i,t} per token, or the sequence's own ratio on each of its tokens."""
    truncated: Optional[Tensor]
    """Bool: tokens whose weight was cut down to the bound; None for a rule that never truncates."""
    masked: Optional[Tensor]
    """Bool: tokens whose loss the rule zeroed; None for a rule that never masks."""


RolloutCorrection = Callable[..., Correction]


@dataclass(frozen=True)
class CorrectionInfo:
    """What the loss passes a correction beyond ``(log_ratio, response_mask)``, registered with it."""

    config: Callable[[Any], dict[str, Any]]
    """``config(rollout_correction_cfg)``: the correction's keyword arguments from ``algorithm.rollout_correction``."""


ROLLOUT_CORRECTIONS: Registry[RolloutCorrection] = Registry("algorithm.rollout_correction.method")
"""Every correction by name; ``ROLLOUT_CORRECTIONS.info(name)`` is its ``CorrectionInfo``."""


def register_correction(name: str, *, config: Callable[[Any], dict[str, Any]]) -> Callable[[RolloutCorrection],
                                                                                           RolloutCorrection]:
    """Decorator: register ``fn`` as ``algorithm.rollout_correction.method=name`` (a duplicate name is an error)."""
    return ROLLOUT_CORRECTIONS.add(name, info=CorrectionInfo(config))


def make_correction(rc: Any) -> Callable[[Tensor, Tensor], Correction]:
    """The correction ``rc.method`` names with its knobs bound: ``fn(log_ratio, response_mask) -> Correction``."""
    return partial(ROLLOUT_CORRECTIONS[rc.method], **ROLLOUT_CORRECTIONS.info(rc.method).config(rc))


def _exp(log_ratio: Tensor) -> Tensor:
    return torch.exp(torch.clamp(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


def _per_sequence(per_seq: Tensor, like: Tensor) -> Tensor:
    return per_seq.unsqueeze(-1).expand_as(like)  # [B] -> [B, R]


def _none(like: Tensor) -> Tensor:
    return torch.zeros_like(like, dtype=torch.bool)


def _check_cap(cap: Optional[float]) -> None:
    if cap is not None and not cap > 0:
        raise ValueError(f"cap must be > 0 or None, got {cap}")


def _truncate(ratio: Tensor, cap: Optional[float]) -> Correction:
    _check_cap(cap)
    if cap is None:
        return Correction(ratio, ratio, _none(ratio), None)
    return Correction(torch.clamp(ratio, max=cap), ratio, ratio > cap, None)


def _drop(ratio: Tensor, weights: Tensor, drop: Tensor) -> Correction:
    return Correction(torch.where(drop, torch.zeros_like(weights), weights), ratio, None, drop)


@register_correction("token_truncate", config=lambda rc: {"cap": rc.cap})
def token_truncate(log_ratio: Tensor, response_mask: Tensor, cap: Optional[float] = 2.0) -> Correction:
    """Token-level truncated importance sampling: w_{i,t} = min(ρ_{i,t}, cap) (``cap=None``: w = ρ, untruncated).

    AReaL's decoupled PPO (Fu et al. 2025, arXiv:2505.24298) and TIS (Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training", fengyao.notion.site/off-policy-rl). Truncated: ρ_{i,t} > cap.
    """
    return _truncate(_exp(log_ratio), cap)  # [B, R]


@register_correction("sequence_truncate", config=lambda rc: {"cap": rc.cap})
def sequence_truncate(log_ratio: Tensor, response_mask: Tensor, cap: Optional[float] = 2.0) -> Correction:
    """Sequence-level truncated importance sampling: every token of sequence i weighs w_i = min(ρ_i, cap) with
    ρ_i = ∏_t ρ_{i,t} over its response tokens (``cap=None``: w_i = ρ_i).

    verl's ``rollout_is: sequence`` (Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from
    the Training-Inference Mismatch"). Truncated: every token of a sequence with ρ_i > cap.
    """
    seq = _exp(masked_sum(log_ratio, response_mask, dim=-1))  # [B]
    return _truncate(_per_sequence(seq, log_ratio), cap)  # [B, R]


@register_correction("sequence_mask", config=lambda rc: {"cap": rc.cap})
def sequence_mask(log_ratio: Tensor, response_mask: Tensor, cap: Optional[float] = 2.0) -> Correction:
    """Sequence-level masked importance sampling: w_i = ρ_i if ρ_i ≤ cap, else 0 (the whole sequence is dropped),
    ρ_i = ∏_t ρ_{i,t} over its response tokens (``cap=None``: w_i = ρ_i, nothing dropped).

    Rejection sampling on the sequence ratio (verl's ``rollout_rs: sequence``, Liu, Li et al. 2025; SkyRL's
    ``sequence_mask_metric: product`` with only its upper bound). Masked: every token of a sequence with ρ_i > cap.
    """
    _check_cap(cap)
    seq = _per_sequence(_exp(masked_sum(log_ratio, response_mask, dim=-1)), log_ratio)  # [B, R]
    drop = seq > cap if cap is not None else _none(seq)
    return _drop(seq, seq, drop)


@register_correction("geo_mask", config=lambda rc: {"delta": rc.geo_delta})
def geo_mask(log_ratio: Tensor, response_mask: Tensor, delta: float = 0.01) -> Correction:
    """Geometric-mean sequence masking: w_i = 1 if 1 − δ ≤ g_i ≤ 1 + δ, else 0 (the whole sequence is dropped), where
    g_i = exp( (1/|y_i|) Σ_t log ρ_{i,t} ) is the geometric mean of the sequence's token ratios. The kept sequences
    are not reweighted.

    SkyRL's ``off_policy_correction.sequence_mask_metric: geometric`` (``geo_mask_low/high`` 0.99 / 1.01, δ = 0.01
    here), verl's geometric rejection sampling (``rollout_rs: geometric``). Unlike the product ratio, g does not
    grow with the response's length. Masked: every token of a sequence whose g_i leaves the band.

    The ±1% band is sized for engine-vs-trainer numerics at the same weights. Under staleness ρ also carries the
    policy's change since the sample was drawn, so the same band drops far more: on samples four versions old it
    keeps only the sequences the policy has moved least on (``benchmarks/README.md``, the learning runs).
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    lengths = response_mask.bool().sum(dim=-1).clamp(min=1).to(log_ratio.dtype)  # [B]
    geo = _per_sequence(_exp(masked_sum(log_ratio, response_mask, dim=-1) / lengths), log_ratio)  # [B, R]
    drop = (geo < 1.0 - delta) | (geo > 1.0 + delta)
    return _drop(geo, torch.ones_like(geo), drop)


@register_correction("token_mask", config=lambda rc: {"low": rc.band_low, "high": rc.band_high})
def token_mask(log_ratio: Tensor, response_mask: Tensor, low: float = 0.5, high: float = 5.0) -> Correction:
    """Token masking outside a ratio band: w_{i,t} = ρ_{i,t} if low ≤ ρ_{i,t} ≤ high, else 0 (the token is dropped,
    the rest of its sequence kept).

    IcePop (Ling Team, inclusionAI 2025: "Small Leak Can Sink a Great Ship: Boost RL Training on MoE with IcePop",
    and the Ring-1T report "Every Step Evolves"): M(k) = k for k in [α, β], 0 otherwise, with α = 0.5, β = 5.
    ``low=0`` masks only above ``high``. Masked: the tokens outside the band.
    """
    if not 0 <= low < high:
        raise ValueError(f"the band must satisfy 0 <= low < high, got [{low}, {high}]")
    ratio = _exp(log_ratio)  # [B, R]
    return _drop(ratio, ratio, (ratio < low) | (ratio > high))
