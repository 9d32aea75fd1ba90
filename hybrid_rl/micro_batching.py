"""Micro-batches for the forward/backward passes: fixed-size or by a token budget, with padding trimmed.

A rollout batch is padded to its longest prompt (left) and longest response
(right), so a micro-batch of short sequences would still pay for the longest
one. ``trim_padding`` cuts every micro-batch down to its own longest prompt and
response (positions are explicit, so nothing else changes). With a token
budget (``actor.use_dynamic_bsz``), sequences are packed longest-first into
micro-batches whose padded size stays within ``max_tokens``; every rank uses the
same number of micro-batches (the maximum over ranks), because each FSDP2
forward is a collective. Loss normalisation by the mini-batch's global counts
(in the worker) makes the result independent of how sequences are grouped.
Rows are grouped by length before chunking, so padding stays small. With ``packed`` (the engine's
``use_remove_padding``: each micro-batch runs as one row of real tokens) a bin's cost is its real tokens, so the
same budget holds more sequences.
"""

from __future__ import annotations

import numpy as np
import torch

from hybrid_rl.batch import Batch
from hybrid_rl.distributed import all_reduce_max
from hybrid_rl.telemetry.tracking import note_micro_batch_tokens

PROMPT_KEYS = ("prompts",)
SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")
HOST_META = "packing_host"
"""``Batch.meta`` key of a packed micro-batch's host copies (``attention_mask``; ``input_ids`` with shared prompts),
cut from one device-to-host read per batch (``workers.packed.pack`` lays the micro-batch out from them)."""


def trim_padding(batch: Batch, lengths: tuple[np.ndarray, np.ndarray] | None = None) -> Batch:
    """Drop prompt columns that are padding in every row (left) and response columns past the longest response.

    ``lengths`` (each row's prompt and response length, e.g. from ``_lengths``) saves reading them back from the device.
    """
    t = batch.tensors
    p_width, r_width = t["prompts"].shape[1], t["responses"].shape[1]
    p_len, r_len = lengths if lengths is not None else _lengths(batch)
    keep_p = max(int(p_len.max(initial=0)), 1)
    keep_r = max(int(r_len.max(initial=0)), 1)
    if keep_p == p_width and keep_r == r_width:
        return batch
    out = {}
    for k, v in t.items():
        if k in PROMPT_KEYS:
            out[k] = v[:, p_width - keep_p:]
        elif k in SEQUENCE_KEYS:
            out[k] = v[:, p_width - keep_p:p_width + keep_r]
        elif v.dim() >= 2 and v.shape[1] == r_width:  # per-response-token tensors
            out[k] = v[:, :keep_r]
        else:
            out[k] = v
    return Batch(out, dict(batch.non_tensors), dict(batch.meta))


def pad_widths(batch: Batch, p_width: int, r_width: int, pad_token_id: int) -> Batch:
    """The inverse of ``trim_padding``: left-pad the prompt part to ``p_width`` and right-pad the response
    part to ``r_width`` (masks 0, ids ``pad_token_id``, positions continued), so batches from several ranks concat."""
    t = batch.tensors
    dp, dr = p_width - t["prompts"].shape[1], r_width - t["responses"].shape[1]
    if dp < 0 or dr < 0:
        raise ValueError(f"cannot pad a batch of widths {t['prompts'].shape[1]}/{t['responses'].shape[1]} "
                         f"down to {p_width}/{r_width}")
    if dp == 0 and dr == 0:
        return batch
    fill = {"input_ids": pad_token_id, "prompts": pad_token_id, "responses": pad_token_id}
    r_old = t["responses"].shape[1]
    out = {}
    for k, v in t.items():
        left = dp if k in PROMPT_KEYS or k in SEQUENCE_KEYS else 0
        right = dr if k in SEQUENCE_KEYS or (k not in PROMPT_KEYS and v.dim() >= 2 and v.shape[1] == r_old) else 0
        if not left and not right:
            out[k] = v
            continue
        parts = [torch.full((v.shape[0], left, *v.shape[2:]), fill.get(k, 0), dtype=v.dtype, device=v.device), v]
        if k == "position_ids" and right:
            parts.append(v[:, -1:] + torch.arange(1, right + 1, device=v.device, dtype=v.dtype)[None, :])
        else:
            parts.append(torch.full((v.shape[0], right, *v.shape[2:]), fill.get(k, 0), dtype=v.dtype, device=v.device))
        out[k] = torch.cat(parts, dim=1)
    return Batch(out, dict(batch.non_tensors), dict(batch.meta))


def _lengths(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    t = batch.tensors
    p_width = t["prompts"].shape[1]
    # the response part of the attention mask: a multi-turn trajectory's observations are computed too
    both = torch.stack([t["attention_mask"][:, :p_width].sum(dim=1), t["attention_mask"][:, p_width:].sum(dim=1)])
    both = both.cpu().numpy()
    return both[0], both[1]


def _padded(rows: list[int], p_len: np.ndarray, r_len: np.ndarray, packed: bool = False) -> int:
    """Tokens a micro-batch computes: rows × (longest prompt + longest response) after ``trim_padding``, or
    its real tokens when packed."""
    if packed:
        return int(p_len[rows].sum() + r_len[rows].sum())
    return len(rows) * int(p_len[rows].max() + r_len[rows].max())


def _pack_by_length(order: np.ndarray, p_len: np.ndarray, r_len: np.ndarray, max_tokens: int,
                    packed: bool = False) -> list[list[int]]:
    """Consecutive runs of ``order`` (longest first) whose computed size stays within ``max_tokens``.

    Rows of similar length share a bin, so the padding each bin pays is small; a row longer than the
    budget goes alone.
    """
    bins: list[list[int]] = []
    mp = mr = 0
    real = 0
    for i in order:
        np_, nr = max(mp, p_len[i]), max(mr, r_len[i])
        cost = real + p_len[i] + r_len[i] if packed else (len(bins[-1]) + 1 if bins else 1) * (np_ + nr)
        if not bins or cost > max_tokens:
            bins.append([])
            np_, nr = p_len[i], r_len[i]
            real = 0
        bins[-1].append(int(i))
        mp, mr = np_, nr
        real += int(p_len[i] + r_len[i])
    return bins


def _by_prompt(uid: np.ndarray, p_len: np.ndarray, r_len: np.ndarray, max_seqs: int, max_tokens: int | None,
               group) -> list[np.ndarray]:
    """``plan_micro_batches`` for prompt-shared packing (``actor.share_prompts``): a prompt's rows stay together, so
    each micro-batch holds few distinct prompts, each computed once.

    Fixed-size chunks cut the rows in group order (a chunk of 16 with 8 samples per prompt is two whole groups). With a
    token budget the units are groups (a group over the budget is cut into pieces that fit, each with its prompt), a
    unit costs its prompt once plus its responses, and units are binned longest-first as ``_pack_by_length`` does."""
    members: dict = {}
    for row, u in enumerate(uid.tolist()):
        members.setdefault(u, []).append(row)
    groups = list(members.values())
    if max_tokens is None:
        order = np.array([r for g in groups for r in g], dtype=np.int64)
        return [np.sort(order[s:s + max_seqs]) for s in range(0, len(order), max_seqs)]
    units: list[list[int]] = []
    for rows in groups:
        piece: list[int] = []
        for r in sorted(rows, key=lambda r: -r_len[r]):
            if piece and p_len[piece[0]] + r_len[piece].sum() + r_len[r] > max_tokens:
                units.append(piece)
                piece = []
            piece.append(r)
        units.append(piece)

    def cost(rows: list[int]) -> int:
        return computed_tokens(rows, p_len, r_len, True, uid)

    bins: list[list[int]] = []
    for unit in sorted(units, key=lambda u: -cost(u)):
        if not bins or cost(bins[-1] + unit) > max_tokens:
            bins.append([])
        bins[-1].extend(unit)
    k = torch.tensor(len(bins))
    all_reduce_max(k, group)  # same number of FSDP forwards on every rank
    while len(bins) < min(int(k), len(uid)):
        j = max((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: cost(bins[b]))
        half = len(bins[j]) // 2
        bins[j:j + 1] = [bins[j][:half], bins[j][half:]]
    return [np.array(sorted(b)) for b in bins]


def plan_micro_batches(batch: Batch, max_seqs: int, max_tokens: int | None = None,
                       lengths: tuple[np.ndarray, np.ndarray] | None = None, group=None,
                       packed: bool = False, share_prompts: bool = False) -> list[np.ndarray]:
    """Row indices of each micro-batch: chunks of ``max_seqs`` rows of similar length, or bins within a token budget.

    Fixed-size chunks take the rows in order of length, so each micro-batch is trimmed to lengths close to
    its own rows' (with long-tailed responses, a random chunk of 16 pads to nearly the longest response of
    the batch: about twice the tokens). The chunk count is unchanged (``ceil(n / max_seqs)``), so every rank
    runs the same number of forwards, and the loss uses the mini-batch's global denominators, so grouping
    changes nothing but rounding.

    With a token budget, rows are packed longest-first into consecutive bins whose padded size (what the
    forward really computes, since sequences are padded, not packed) stays within ``max_tokens``. A rank that
    needs fewer bins than the busiest rank splits its largest bins in half until the counts match, which only
    shrinks them (the counts are compared over ``group``, the data-parallel group). (Balancing real tokens across bins instead, as verl does for padding-free packed sequences,
    would put one long row in every bin and pad each to it: about twice the budget.)
    """
    n = len(batch)
    p_len, r_len = lengths if lengths is not None else _lengths(batch)
    if share_prompts and "uid" in batch.non_tensors:
        return _by_prompt(np.asarray(batch.non_tensors["uid"]), p_len, r_len, max_seqs, max_tokens, group)
    order = np.argsort(-(p_len + r_len), kind="stable")
    if max_tokens is None:
        return [np.sort(order[s:s + max_seqs]) for s in range(0, n, max_seqs)]
    bins = _pack_by_length(order, p_len, r_len, max_tokens, packed)
    k = torch.tensor(len(bins))
    all_reduce_max(k, group)  # same number of FSDP forwards on every rank
    while len(bins) < min(int(k), n):
        j = max((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: _padded(bins[b], p_len, r_len, packed))
        half = len(bins[j]) // 2
        bins[j:j + 1] = [bins[j][:half], bins[j][half:]]
    return [np.array(sorted(b)) for b in bins]


def micro_batches(batch: Batch, max_seqs: int, max_tokens: int | None = None,
                  group=None, packed: bool = False, share_prompts: bool = False) -> list[tuple[np.ndarray, Batch]]:
    """(row indices, trimmed micro-batch) pairs covering ``batch`` (``packed``: budgets count real tokens;
    ``share_prompts``: a prompt's samples stay in one micro-batch, see ``_by_prompt``).

    The lengths are read from the device once for the whole batch: a read per micro-batch would stall the
    GPU queue between micro-batches.
    """
    p_len, r_len = _lengths(batch)
    host = _host_layout(batch, share_prompts) if packed else None
    out = []
    plan = plan_micro_batches(batch, max_seqs, max_tokens, (p_len, r_len), group, packed, share_prompts)
    uid = np.asarray(batch.non_tensors["uid"]) if packed and share_prompts and "uid" in batch.non_tensors else None
    note_micro_batch_tokens(max((computed_tokens(idx, p_len, r_len, packed, uid) for idx in plan), default=0))
    for idx in plan:
        micro = trim_padding(batch.index(idx), (p_len[idx], r_len[idx]))
        if host is not None:
            micro.meta[HOST_META] = _host_rows(host, idx, batch, micro)
        out.append((idx, micro))
    return out


def computed_tokens(rows: np.ndarray, p_len: np.ndarray, r_len: np.ndarray, packed: bool,
                    uid: np.ndarray | None = None) -> int:
    """Tokens one micro-batch computes: with ``uid`` (prompts shared) each distinct prompt once plus every response,
    packed its real tokens, else its rows × (longest prompt + longest response)."""
    rows = list(np.asarray(rows).tolist())
    if uid is not None:
        first = {}
        for r in rows:
            first.setdefault(uid[r], r)
        return int(p_len[list(first.values())].sum() + r_len[rows].sum())
    return _padded(rows, p_len, r_len, packed)


def _host_layout(batch: Batch, with_ids: bool) -> dict[str, torch.Tensor]:
    """The batch's attention mask (and ids, which ``pack_shared`` matches prompts by) on the host, read once: packing
    then lays out every micro-batch without waiting for the GPU (``workers.packed.pack``)."""
    t = batch.tensors
    host = {"attention_mask": t["attention_mask"].bool().cpu()}
    if with_ids:
        host["input_ids"] = t["input_ids"].cpu()
    return host


def _host_rows(host: dict[str, torch.Tensor], idx: np.ndarray, batch: Batch, micro: Batch) -> dict[str, torch.Tensor]:
    """``host``'s rows ``idx``, cut to the columns ``trim_padding`` kept for ``micro``."""
    p_width = batch.tensors["prompts"].shape[1]
    keep_p, keep_r = micro.tensors["prompts"].shape[1], micro.tensors["responses"].shape[1]
    rows = torch.from_numpy(np.asarray(idx, dtype=np.int64))
    return {k: v[rows][:, p_width - keep_p:p_width + keep_r] for k, v in host.items()}
