"""The critic's loss: PPO's clipped value regression onto the GAE returns.

A pure tensor function like the policy losses: the critic worker computes the
value predictions, this module says how far they are from the targets. The
clipping mirrors the policy's trust region: a prediction may move at most
``cliprange_value`` away from the value the batch was scored with (the "old"
values, from ``compute_values`` before the update), and the loss takes the
worse of the clipped and unclipped squared errors (PPO2 / TRL / verl).

Left out: Huber or distributional value losses, and the value-loss coefficient
of a shared actor-critic network (here the critic is its own model with its own
optimizer, so the scale is the learning rate's business).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .core import Number, check_same_shape, agg_loss, masked_mean

__all__ = ["clipped_value_loss"]


def clipped_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    old_values: Tensor,
    response_mask: Tensor,
    cliprange_value: Optional[float],
    loss_agg_mode: str = "token-mean",
    num_tokens: Optional[Number] = None,
    num_seqs: Optional[Number] = None,
    norm_length: Optional[int] = None,
) -> tuple[Tensor, Tensor]:
    """0.5 · agg(max((V − G)², (clip(V, V_old ± c) − G)²)) over the response tokens, and the clip fraction.

    vpreds, returns, old_values, response_mask: [B, R]. ``cliprange_value`` None
    turns clipping off (plain 0.5·MSE, clip fraction 0). ``num_tokens`` /
    ``num_seqs`` / ``norm_length`` go to ``agg_loss`` (pass the mini-batch's
    global counts under gradient accumulation). Returns (loss scalar, clipfrac
    scalar): clipfrac is the fraction of tokens whose clipped error is the
    larger one, i.e. where clipping removed the gradient.
    """
    check_same_shape(vpreds=vpreds, returns=returns, old_values=old_values, response_mask=response_mask)
    vpreds = vpreds.float()
    returns, old_values = returns.float(), old_values.float()
    err = (vpreds - returns).square()  # [B, R]
    if cliprange_value is None:
        losses = err
        clipfrac = torch.zeros((), device=vpreds.device)
    else:
        clipped = old_values + (vpreds - old_values).clamp(-cliprange_value, cliprange_value)  # [B, R]
        err_clipped = (clipped - returns).square()  # [B, R]
        losses = torch.maximum(err, err_clipped)
        clipfrac = masked_mean((err_clipped > err).float(), response_mask)
    loss = 0.5 * agg_loss(losses, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                          norm_length=norm_length)
    return loss, clipfrac.detach()
