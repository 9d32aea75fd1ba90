"""Tensor primitives shared by the advantage estimators and the losses.

Everything in an RL batch is right-padded to a common response length, so
every reduction here takes a ``mask`` and ignores the padded entries. The
log-prob/entropy helpers exist so that every caller computes them the same
way (float32, without a full log-softmax copy of the vocabulary).

Left out: anything distributed (all-reducing denominators across ranks is
the caller's job: compute the global ``num_tokens``/``num_seqs`` and pass
them to :func:`agg_loss`), and fused/kernel implementations.

Masks are treated as binary: an entry counts iff it is non-zero. Masked-out
entries are selected away with ``torch.where`` rather than multiplied by 0,
so a NaN/inf sitting in padding cannot leak into a sum.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = [
    "LOSS_AGG_MODES",
    "agg_loss",
    "entropy_from_logits",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "response_extent",
]

Number = Union[int, float, Tensor]

# Rows of the flattened [B*T, V] logits processed at a time. Bounds the
# float32 temporaries to chunk_rows * V elements (e.g. 1024 * 152k * 4 B
# ~= 620 MB) however long the batch is.
_CHUNK_ROWS = 1024


def response_extent(response_mask: Tensor) -> Tensor:
    """[B] long: one past the last masked-in position of each row (0 for none), the response's length in tokens.

    A single-turn response's mask is a prefix, so this is its sum; a multi-turn trajectory's mask has holes where
    observations sit, and this counts them too (its tokens up to its last sampled one)."""
    steps = torch.arange(1, response_mask.shape[-1] + 1, device=response_mask.device)
    return torch.where(response_mask.bool(), steps, torch.zeros((), dtype=steps.dtype, device=steps.device)).amax(
        dim=-1) if response_mask.shape[-1] else torch.zeros(response_mask.shape[:-1], dtype=torch.long)


def check_same_shape(**tensors: Tensor) -> None:
    """ValueError naming every shape unless all ``tensors`` have the same one."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"expected tensors of the same shape, got {shapes}")


def select_masked(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask is set, 0 elsewhere (broadcasting like x * mask)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of x over entries where mask is set; dim=None reduces to a scalar."""
    selected = select_masked(x, mask)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of x over entries where mask is set; 0 where nothing is masked in."""
    count = mask.bool().expand_as(x).sum() if dim is None else mask.bool().expand_as(x).sum(dim=dim)
    # clamp: an empty mask gives 0 / 1 = 0 instead of NaN.
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance (scalar) of x over the masked entries.

    Raises ValueError when the mask is empty, or has a single entry and
    ``unbiased`` is set, since the variance is undefined then.
    """
    count = int(mask.bool().expand_as(x).sum().item())
    if count == 0:
        raise ValueError("masked_var: the mask selects no entries")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        if count == 1:
            raise ValueError("masked_var: unbiased variance needs at least 2 masked entries, got 1")
        var = var * (count / (count - 1))
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) with mean/var (unbiased) over masked entries.

    With ``shift_mean=False`` the mean is added back, so only the scale
    changes. Entries outside the mask are transformed too (not zeroed);
    multiply by the mask if they must be 0.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 -> float32; float64 stays float64.
    return torch.promote_types(dtype, torch.float32)


def _row_chunks(n: int):
    for start in range(0, n, _CHUNK_ROWS):
        yield slice(start, min(start + _CHUNK_ROWS, n))


# Both functions below are custom autograd Functions rather than plain
# autograd over chunks: autograd would save every float32 copy of a bf16
# chunk for the backward, i.e. a full float32 [N, V] tensor after all. Here
# only the original logits (alive anyway) and an [N] logsumexp are saved,
# and the backward recomputes softmax chunk by chunk.


def _scaled(x: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    # the same ops as (logits.float() / T) on the whole tensor, one chunk at a time
    x = x.to(dtype)
    return x / temperature if temperature != 1.0 else x


class _LogProbFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:  # [N, V], [N] -> [N]
        dtype = _compute_dtype(logits.dtype)
        n = logits.shape[0]
        out = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        for rows in _row_chunks(n):
            x = _scaled(logits[rows], dtype, temperature)  # [C, V]
            lse[rows] = torch.logsumexp(x, dim=-1)
            out[rows] = x.gather(-1, labels[rows].unsqueeze(-1)).squeeze(-1) - lse[rows]
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, labels, lse = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty_like(logits)  # [N, V]
        for rows in _row_chunks(logits.shape[0]):
            g = grad_out[rows].to(lse.dtype).unsqueeze(-1)  # [C, 1]
            # d log p_y / d x = onehot(y) - softmax(x), x = l / T
            probs = torch.exp(_scaled(logits[rows], lse.dtype, t) - lse[rows].unsqueeze(-1))  # [C, V]
            chunk = -g * probs
            chunk.scatter_add_(-1, labels[rows].unsqueeze(-1), g)
            grad[rows] = (chunk / t if t != 1.0 else chunk).to(grad.dtype)
        return grad, None, None


class _EntropyFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float = 1.0) -> Tensor:  # [N, V] -> [N]
        dtype = _compute_dtype(logits.dtype)
        n = logits.shape[0]
        out = torch.empty(n, dtype=dtype, device=logits.device)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        for rows in _row_chunks(n):
            x = _scaled(logits[rows], dtype, temperature)
            lse[rows] = torch.logsumexp(x, dim=-1)
            probs = torch.exp(x - lse[rows].unsqueeze(-1))
            out[rows] = lse[rows] - _expected_logit(probs, x)
        ctx.save_for_backward(logits, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, lse = ctx.saved_tensors
        t = ctx.temperature
        grad = torch.empty_like(logits)
        for rows in _row_chunks(logits.shape[0]):
            x = _scaled(logits[rows], lse.dtype, t)
            probs = torch.exp(x - lse[rows].unsqueeze(-1))  # [C, V]
            mean_logit = _expected_logit(probs, x).unsqueeze(-1)  # [C, 1]
            # dH / dx_i = -p_i (x_i - E_p[x]), x = l / T
            centred = torch.where(probs > 0, x - mean_logit, torch.zeros((), dtype=x.dtype, device=x.device))
            chunk = -grad_out[rows].to(lse.dtype).unsqueeze(-1) * probs * centred
            grad[rows] = (chunk / t if t != 1.0 else chunk).to(grad.dtype)
        return grad, None


def _expected_logit(probs: Tensor, logits: Tensor) -> Tensor:
    # where(): a -inf logit (masked vocabulary entry) has p = 0 and must
    # contribute 0, not 0 * -inf = NaN.
    terms = torch.where(probs > 0, probs * logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    return terms.sum(dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[labels], computed in float32.

    logits: [B, T, V] (any float dtype), labels: [B, T] ints in [0, V).
    Returns [B, T] float32 (float64 for float64 logits); differentiable
    w.r.t. logits (gradient in the logits' dtype). Works on chunks of rows
    and never materialises a full float32 log-softmax; pass contiguous
    logits, or the reshape to [B*T, V] makes a copy.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on the leading dims"
        )
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
    out = _LogProbFromLogits.apply(flat, labels.reshape(-1).long(), float(temperature))  # [N]
    return out.reshape(labels.shape)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) along the last dim, in float32.

    logits: [B, T, V]; returns [B, T], differentiable. Uses
    logsumexp(l) - sum(p * l), which stays finite for very peaked
    distributions where -sum(p * log p) would hit 0 * -inf.
    """
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
    return _EntropyFromLogits.apply(flat, float(temperature)).reshape(logits.shape[:-1])


# ---------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------


def _check_positive(name: str, value: Optional[Number]) -> None:
    if value is not None and bool(value <= 0):
        raise ValueError(f"{name} must be > 0, got {value}")


def _agg_token_mean(loss_mat: Tensor, mask: Tensor, num_tokens, num_seqs, norm_length) -> Tensor:
    if num_tokens is None:
        num_tokens = mask.bool().sum().clamp(min=1)
    return masked_sum(loss_mat, mask) / num_tokens


def _agg_seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, num_tokens, num_seqs, norm_length) -> Tensor:
    seq_losses = masked_sum(loss_mat, mask, dim=-1)  # [B]
    if num_seqs is None:
        num_seqs = loss_mat.shape[0]
    return seq_losses.sum() / num_seqs


def _agg_seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, num_tokens, num_seqs, norm_length) -> Tensor:
    seq_losses = masked_mean(loss_mat, mask, dim=-1)  # [B], 0 for empty sequences
    if num_seqs is None:
        num_seqs = loss_mat.shape[0]
    return seq_losses.sum() / num_seqs


def _agg_seq_mean_token_sum_norm(loss_mat: Tensor, mask: Tensor, num_tokens, num_seqs, norm_length) -> Tensor:
    # Dr. GRPO: a constant denominator, so long and short responses get the
    # same per-token weight (no length bias).
    if num_seqs is None:
        num_seqs = loss_mat.shape[0]
    if norm_length is None:
        norm_length = loss_mat.shape[-1]
    return masked_sum(loss_mat, mask) / (num_seqs * norm_length)


_AGG_FNS: dict[str, Callable[..., Tensor]] = {
    "token-mean": _agg_token_mean,
    "seq-mean-token-sum": _agg_seq_mean_token_sum,
    "seq-mean-token-mean": _agg_seq_mean_token_mean,
    "seq-mean-token-sum-norm": _agg_seq_mean_token_sum_norm,
}

LOSS_AGG_MODES: tuple[str, ...] = tuple(_AGG_FNS)


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    num_tokens: Optional[Number] = None,
    num_seqs: Optional[Number] = None,
    norm_length: Optional[int] = None,
) -> Tensor:
    """Reduce a per-token loss [B, R] to a scalar.

    Modes (see LOSS_AGG_MODES):
      token-mean               sum(loss*mask) / num_tokens   (default mask.sum())
      seq-mean-token-sum       sum_b sum_t loss[b,t] / num_seqs   (default B)
      seq-mean-token-mean      sum_b mean_t loss[b,t] / num_seqs  (empty seq -> 0)
      seq-mean-token-sum-norm  sum(loss*mask) / (num_seqs * norm_length)
                               (default norm_length R)

    With gradient accumulation, pass the *mini-batch* token/sequence counts
    as num_tokens/num_seqs for every micro-batch: the micro-batch losses then
    sum exactly to the mini-batch loss. (The defaults give per-micro-batch
    means, which weight tokens differently whenever micro-batches differ in
    token count.) Likewise pass a fixed ``norm_length`` (the configured max
    response length, as Dr. GRPO does): the default R is the width of this
    tensor, which shrinks when a micro-batch is trimmed to its own longest
    response, so the divisor would change with the split and from step to step.
    """
    fn = _AGG_FNS.get(mode)
    if fn is None:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}")
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be [B, R], got shape {tuple(loss_mat.shape)}")
    check_same_shape(loss_mat=loss_mat, mask=mask)
    _check_positive("num_tokens", num_tokens)
    _check_positive("num_seqs", num_seqs)
    _check_positive("norm_length", norm_length)
    return fn(loss_mat, mask, num_tokens, num_seqs, norm_length)
