"""Policy-gradient losses: PPO's clipped surrogate, AReaL's decoupled PPO, GSPO's sequence-ratio clip and CISPO's
clipped importance weights.

Both return ``(loss, metrics)`` where ``loss`` is a scalar to *minimise*
(the negated surrogate objective) and ``metrics`` holds detached 0-dim
float tensors. Per-token losses are reduced with ``core.agg_loss``; pass
the mini-batch ``num_tokens``/``num_seqs`` when gradient-accumulating, and
``norm_length`` (the configured max response length) for
``seq-mean-token-sum-norm``, whose default divisor is the width of the
(possibly trimmed) tensor and so changes with the micro-batch split.

``POLICY_LOSSES`` is the one registry of losses, by name; the actor loss is
``Config.policy_loss``, from ``actor.policy_loss`` (``auto``: ``decoupled_ppo``
when the rollout correction is on, else ``ppo``). The worker calls the
registered function once, with the
keyword arguments every loss shares (``log_prob``, ``advantages``,
``response_mask``, the clip ratios, ``loss_agg_mode``, ``num_tokens``,
``num_seqs``, ``norm_length``) plus what the registration's ``inputs(tensors,
cfg)`` returns: the loss's own arguments, read from the micro-batch's tensors
and the config (e.g. decoupled PPO's behaviour log-probs and its off-policy
correction, ``rollout_correction.py``). A new loss is one function plus one
``register_policy_loss(...)``.

Left out: entropy bonus and KL loss (separate terms the caller adds, see
``core.entropy_from_logits`` and ``kl.kl_loss``), value loss, other
variants, and anything distributed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from hybrid_rl.registry import Registry

from .core import Number, check_same_shape, select_masked, agg_loss, masked_mean, masked_sum
from .rollout_correction import Correction, make_correction, token_truncate

__all__ = ["POLICY_LOSSES", "PolicyLossInfo", "cispo_loss", "decoupled_ppo_loss", "gspo_loss", "ppo_clip_loss",
           "register_policy_loss"]

Metrics = dict[str, Tensor]
PolicyLoss = Callable[..., tuple[Tensor, Metrics]]
LossInputs = Callable[[Mapping[str, Tensor], Any], dict[str, Any]]


@dataclass(frozen=True)
class PolicyLossInfo:
    """What the worker passes a loss beyond the shared arguments, registered with it."""

    inputs: LossInputs
    """``inputs(tensors, cfg)``: the loss's own keyword arguments from the micro-batch's tensors and the ``Config``."""


POLICY_LOSSES: Registry[PolicyLoss] = Registry("actor.policy_loss")
"""Every policy loss by name; ``POLICY_LOSSES.info(name)`` is its ``PolicyLossInfo``."""


def register_policy_loss(name: str, *, inputs: LossInputs) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register ``fn`` as the policy loss ``name`` (a duplicate name is an error)."""
    return POLICY_LOSSES.add(name, info=PolicyLossInfo(inputs))


# exp(20) ~ 4.9e8: large enough never to bind on sane data, small enough
# that the ratio (and its product with an advantage) stays finite.
_LOG_RATIO_CLAMP = 20.0


def _validate_clip(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: Optional[float]) -> None:
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if clip_ratio_high < 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1, got {clip_ratio_c}")


def _clipped_pg_losses(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: Optional[float],
) -> tuple[Tensor, Metrics]:
    """Per-token clipped PPO loss [B, R] and its clipping metrics."""
    _validate_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    check_same_shape(
        log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask
    )
    log_ratio = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, R]
    ratio = torch.exp(log_ratio)
    ppo_kl = masked_mean(-log_ratio, response_mask)

    unclipped = -advantages * ratio  # [B, R]
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    # Pessimistic bound: the larger loss. Where the clipped term wins the
    # ratio is outside the trust region and the token gets no gradient.
    pg_losses = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).to(log_prob.dtype), response_mask)

    if clip_ratio_c is not None:
        # Dual clip: for A < 0 a huge ratio would make the loss unbounded;
        # cap it at -A * c (again with zero gradient).
        dual = -advantages * clip_ratio_c
        negative = advantages < 0
        lower_active = negative & (pg_losses > dual)
        pg_losses = torch.where(negative, torch.minimum(pg_losses, dual), pg_losses)
        clipfrac_lower = masked_mean(lower_active.to(log_prob.dtype), response_mask)
    else:
        clipfrac_lower = torch.zeros((), dtype=log_prob.dtype, device=log_prob.device)

    metrics = {
        "pg_clipfrac": clipfrac.detach(),
        "pg_clipfrac_lower": clipfrac_lower.detach(),
        "ppo_kl": ppo_kl.detach(),
    }
    return pg_losses, metrics


# PPO's ratio is against the trainer's old log-probs (θ_k).
@register_policy_loss("ppo", inputs=lambda t, cfg: {"old_log_prob": t["old_log_probs"]})
def ppo_clip_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = None,
    loss_agg_mode: str = "token-mean",
    num_tokens: Optional[Number] = None,
    num_seqs: Optional[Number] = None,
    norm_length: Optional[int] = None,
) -> tuple[Tensor, Metrics]:
    """PPO clipped surrogate loss (with optional asymmetric / dual clip).

    All inputs [B, R]. ratio = exp(log_prob - old_log_prob);
    loss_t = max(-A r, -A clip(r, 1 - low, 1 + high)), and with
    ``clip_ratio_c`` (> 1) loss_t = min(loss_t, -A c) where A < 0.
    Metrics: pg_clipfrac, pg_clipfrac_lower (dual clip active), ppo_kl
    (masked mean of old_log_prob - log_prob).
    """
    pg_losses, metrics = _clipped_pg_losses(
        log_prob, old_log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    norm_length=norm_length)
    return loss, metrics


# ---------------------------------------------------------------------------
# Decoupled PPO (AReaL): behaviour-policy importance weights
# ---------------------------------------------------------------------------


def _decoupled_inputs(t: Mapping[str, Tensor], cfg: Any) -> dict[str, Any]:
    # Trust region around the proximal policy (the trainer's old_log_probs under θ_k), importance-weighted back
    # to the behaviour policy that sampled (the engine's log-probs, possibly θ_{k-1}).
    return dict(proximal_log_prob=t["old_log_probs"], behaviour_log_prob=t["rollout_log_probs"],
                correction=make_correction(cfg.algorithm.rollout_correction))


@register_policy_loss("decoupled_ppo", inputs=_decoupled_inputs)
def decoupled_ppo_loss(
    log_prob: Tensor,
    proximal_log_prob: Tensor,
    behaviour_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = None,
    correction: Callable[[Tensor, Tensor], Correction] = partial(token_truncate, cap=2.0),
    loss_agg_mode: str = "token-mean",
    num_tokens: Optional[Number] = None,
    num_seqs: Optional[Number] = None,
    norm_length: Optional[int] = None,
) -> tuple[Tensor, Metrics]:
    """Decoupled PPO for off-policy (asynchronous) rollouts, as in AReaL.

    The trust region is taken around the *proximal* policy (the weights
    just before this update), while the samples came from an older
    *behaviour* policy. So: clipped PPO loss on pi_theta / pi_prox, times
    a detached factor w computed from the behaviour ratio
    rho = pi_prox / pi_behav by ``correction(log_ratio, response_mask)``,
    one of ``rollout_correction.ROLLOUT_CORRECTIONS`` with its knobs bound
    (default: token-level truncation, w = min(rho, 2)). A token the
    correction masks (w = 0) stays in the loss's denominator. When
    behaviour == proximal every correction gives w = 1 and the result
    equals ppo_clip_loss.
    Extra metrics: is_ratio_mean, is_ratio_max (masked tokens, of the ratio
    the correction acted on, before truncation), and the share of masked
    tokens it changed: is_truncated_frac for a truncating correction,
    is_masked_frac for a masking one.
    """
    check_same_shape(
        proximal_log_prob=proximal_log_prob, behaviour_log_prob=behaviour_log_prob, response_mask=response_mask
    )

    pg_losses, metrics = _clipped_pg_losses(
        log_prob, proximal_log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )

    with torch.no_grad():
        log_diff = (proximal_log_prob - behaviour_log_prob).to(pg_losses.dtype)  # [B, R]
        c = correction(log_diff, response_mask)
        metrics["is_ratio_mean"] = masked_mean(c.ratio, response_mask)
        # Ratios are positive, so 0 outside the mask never wins the max.
        metrics["is_ratio_max"] = (select_masked(c.ratio, response_mask).max() if c.ratio.numel()
                                   else c.ratio.new_zeros(()))
        if c.truncated is not None:
            metrics["is_truncated_frac"] = masked_mean(c.truncated.to(c.ratio.dtype), response_mask)
        if c.masked is not None:
            metrics["is_masked_frac"] = masked_mean(c.masked.to(c.ratio.dtype), response_mask)

    loss = agg_loss(pg_losses * c.weights, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    norm_length=norm_length)
    return loss, metrics


# ---------------------------------------------------------------------------
# GSPO (Qwen): one importance ratio per sequence
# ---------------------------------------------------------------------------


@register_policy_loss("gspo", inputs=lambda t, cfg: {"old_log_prob": t["old_log_probs"]})
def gspo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: Optional[float] = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    num_tokens: Optional[Number] = None,
    num_seqs: Optional[Number] = None,
    norm_length: Optional[int] = None,
) -> tuple[Tensor, Metrics]:
    """Group Sequence Policy Optimization, in its GSPO-token form (as verl and TRL ship it).

    All inputs [B, R]. The sequence ratio is the length-normalised log-ratio
    s_i = exp( (1/|y_i|) sum_t (log_prob - old_log_prob) ), and each token
    carries s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]: its value is s_i, its
    gradient flows through the token's own log-prob. Per token
    loss_t = max(-A s_i,t, -A clip(s_i,t, 1 - low, 1 + high)); since every
    token of a sequence holds the same value s_i, a sequence is clipped as a
    whole (no gradient from any of its tokens) or not at all.

    Clip ranges: the sequence ratio is a geometric mean over tokens, so it
    stays far closer to 1 than a token ratio; the paper uses
    ``clip_ratio_low=3e-4``, ``clip_ratio_high=4e-4`` (these defaults). The
    trainer passes ``actor.clip_ratio_low/high`` (0.2 by default, PPO's), so
    set them: ``actor.clip_ratio_low=3e-4 actor.clip_ratio_high=4e-4``.
    ``clip_ratio_c`` (dual clip) is not part of GSPO and must be None.

    Aggregation: ``loss_agg_mode`` is honoured like every other loss's. GSPO's
    objective is the mean over sequences of each sequence's token mean,
    ``seq-mean-token-mean`` (this default; set
    ``actor.loss_agg_mode=seq-mean-token-mean``): then a token's gradient is
    -s_i A_i / (|y_i| num_seqs), exactly the gradient of GSPO's sequence loss
    -min(s_i A_i, clip(s_i) A_i) / num_seqs. Under ``token-mean`` each
    sequence weighs by its length instead (gradient -s_i A_i / num_tokens).

    Metrics: pg_clipfrac (the fraction of sequences clipped, empty rows not
    counted), pg_clipfrac_lower (0: no dual clip), ppo_kl (masked mean of
    old_log_prob - log_prob, per token).
    """
    if clip_ratio_c is not None:
        raise ValueError(f"gspo has no dual clip: clip_ratio_c must be None, got {clip_ratio_c}")
    _validate_clip(clip_ratio_low, clip_ratio_high, None)
    check_same_shape(
        log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask
    )
    log_ratio = log_prob - old_log_prob  # [B, R]
    lengths = response_mask.bool().sum(dim=-1)  # [B]
    seq_log_ratio = masked_sum(log_ratio, response_mask, dim=-1) / lengths.clamp(min=1).to(log_ratio.dtype)  # [B]
    seq_log_ratio = torch.clamp(seq_log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    # Value sg[log s_i]; gradient d/d log_prob_t = 1 (the token's own log-prob).
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)  # [B, R]
    ratio = torch.exp(token_log_ratio)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(unclipped, clipped)

    with torch.no_grad():
        # A sequence is clipped when its (shared) clipped term wins; read it off any real token.
        seq_clipped = masked_sum((clipped > unclipped).to(log_prob.dtype), response_mask, dim=-1) > 0  # [B]
        real = lengths > 0
        clipfrac = (seq_clipped & real).sum().to(log_prob.dtype) / real.sum().clamp(min=1).to(log_prob.dtype)
        metrics = {
            "pg_clipfrac": clipfrac,
            "pg_clipfrac_lower": torch.zeros((), dtype=log_prob.dtype, device=log_prob.device),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    norm_length=norm_length)
    return loss, metrics


# ---------------------------------------------------------------------------
# CISPO (MiniMax-M1): clipped importance-sampling weights, every token keeps its gradient
# ---------------------------------------------------------------------------


@register_policy_loss("cispo", inputs=lambda t, cfg: {"old_log_prob": t["old_log_probs"]})
def cispo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 4.0,
    clip_ratio_c: Optional[float] = None,
    loss_agg_mode: str = "token-mean",
    num_tokens: Optional[Number] = None,
    num_seqs: Optional[Number] = None,
    norm_length: Optional[int] = None,
) -> tuple[Tensor, Metrics]:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, 2025), as TRL ships it.

    All inputs [B, R]. loss_t = -sg[min(r_t, 1 + high)] A_t log_prob_t, with r_t = exp(log_prob - old_log_prob):
    REINFORCE weighted by the importance ratio clipped from above and detached. Unlike PPO's clip, which drops the
    gradient of a token outside the trust region, every token keeps its gradient, -min(r, 1 + high) A; only its
    weight is bounded. The ratio is not clipped from below (the paper leaves that bound off), so
    ``clip_ratio_low`` is unused; ``clip_ratio_high`` is the weight's bound above 1 (ScaleRL uses 4, this
    default; the trainer passes ``actor.clip_ratio_high``, PPO's 0.2 unless set). ``clip_ratio_c`` must be None.

    Metrics: pg_clipfrac (tokens whose weight was capped), pg_clipfrac_lower (0), ppo_kl (masked mean of
    old_log_prob - log_prob).
    """
    if clip_ratio_c is not None:
        raise ValueError(f"cispo has no dual clip: clip_ratio_c must be None, got {clip_ratio_c}")
    if clip_ratio_high < 0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")
    check_same_shape(
        log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, response_mask=response_mask
    )
    log_ratio = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, max=1.0 + clip_ratio_high)
    pg_losses = -advantages * weight * log_prob
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((ratio > 1.0 + clip_ratio_high).to(log_prob.dtype), response_mask),
            "pg_clipfrac_lower": torch.zeros((), dtype=log_prob.dtype, device=log_prob.device),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                    norm_length=norm_length)
    return loss, metrics
