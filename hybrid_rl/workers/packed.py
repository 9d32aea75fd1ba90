"""Padding-free forward passes: a micro-batch packed into one row, attention that never crosses sequences, and
log-probs taken from the LM head chunk by chunk without the [tokens × vocabulary] logits.

A rollout batch is left-padded prompts and right-padded responses; even trimmed and sorted by length, a
micro-batch computes every padding position through every layer. Packing keeps only the real tokens:
``pack`` lays the micro-batch's sequences end to end in one row with their own position ids (taken from the
padded layout, so rotary embeddings see exactly what the padded pass saw) and the cumulative lengths
``cu_seqlens``. The model runs with a registered transformers attention function, ``hybrid_rl_varlen``, that
attends within each sequence: PyTorch's flash-attention ``varlen_attn`` on CUDA where the installed torch has
it, otherwise one causal SDPA call per sequence (exact, and what the CPU tests compare against the padded path; on
CPU it costs more than the padding it saves, so packing is on by default on CUDA only).

The LM head is the other waste: a micro-batch of 16 × 1k response tokens with Qwen's 151,936-entry vocabulary
is 5 GB of bf16 logits plus float32 softmax chunks, all to read one entry and an entropy per token.
``FusedLogProb`` computes log p(target) and the entropy from the last hidden states and the head's weight in
row chunks and recomputes each chunk in backward, so the full logits never exist. The model's own head is
swapped for this computation only inside ``logprob_head`` (an instance-level ``forward``), so parameter names,
FSDP2 units and the weight push are untouched.

With Ulysses sequence parallelism (``workers/ulysses.py``) a packed row is cut in slices over a group of ranks and
the attention function exchanges them for heads around the same per-sequence attention.

Left out: sliding-window attention (no supported model uses it in training), attention dropout (0 in the
supported configs), and ring attention.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hybrid_rl.batch import to_device
from hybrid_rl.telemetry.perf import Work
from hybrid_rl.workers.ulysses import ShardedRow, sharded_attention

ATTN_NAME = "hybrid_rl_varlen"
LOGIT_CHUNK_ROWS = 1024
"""Rows of hidden states per LM-head chunk: 1024 × 151,936 float32 logits is 0.6 GB, big enough to keep the matmul
efficient and small enough to leave room for larger micro-batches."""

_registered = False


# --------------------------------------------------------------------------- packing
@dataclass
class Packed:
    input_ids: torch.Tensor  # [1, T] the real tokens of every row, end to end
    position_ids: torch.Tensor  # [1, T] each sequence's own positions
    cu_seqlens: torch.Tensor  # [b + 1] int32 sequence boundaries in the packed row
    max_seqlen: int
    keep: torch.Tensor  # [n] packed positions whose next token is a response token (the LM head's rows)
    targets: torch.Tensor  # [n] those response tokens
    valid: torch.Tensor  # [b, R] bool, on the host: which response slots the n rows fill (row-major)
    slots: torch.Tensor  # [n] the same slots as flat indices into [b * R], on the device (``unpack``)
    shared: "SharedPrompts | None" = None  # pack_shared's layout (each prompt once); None: one sequence per row
    work: Work | None = None  # what a forward over this row computes (tokens, attention pairs, LM-head rows): ``perf``
    keep_host: torch.Tensor | None = None  # ``keep`` on the host (``ulysses.shard`` splits it without a device read)


def _host(tensors: dict[str, torch.Tensor], host: dict[str, torch.Tensor] | None, key: str) -> torch.Tensor:
    """``tensors[key]`` on the host: from ``host`` when given, else read here (one device sync)."""
    if host is not None and key in host:
        return host[key]
    return tensors[key].cpu()


def _to_device(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host int64 index tensors on ``device`` in one pinned, non-blocking copy (views of it)."""
    flat = to_device(torch.cat(parts), device)
    return list(flat.split([len(x) for x in parts]))


def _gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[b, L] -> [1, T]: the flat positions ``index`` of ``t`` (an integer gather: no device sync)."""
    return t.reshape(-1).index_select(0, index)[None]


def _response_slots(mask: torch.Tensor, prompt_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, R] which response slots hold a real token (host), and the same as flat indices into [b * R]. Response token j
    is predicted at padded column P + j - 1; it counts where the token itself is real."""
    valid = mask[:, prompt_width:]
    return valid, valid.reshape(-1).nonzero().squeeze(1)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])`` without the Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths  # where each range starts in the output
    return np.repeat(np.asarray(starts, dtype=np.int64) - offsets, lengths) + np.arange(int(lengths.sum()))


def pack(tensors: dict[str, torch.Tensor], host: dict[str, torch.Tensor] | None = None) -> Packed:
    """One row holding the real tokens of a padded micro-batch (``input_ids``/``attention_mask``/``position_ids``
    [b, P + R], ``responses`` [b, R]), and where its response tokens are predicted.

    The layout is worked out on the host (from ``host``'s copy of the mask when the caller read it once for the whole
    batch) and reaches the device as integer indices in one queued copy, so packing never waits for the GPU: boolean
    indexing on the device (a ``nonzero``) drained the GPU's queue several times per micro-batch."""
    responses = tensors["responses"]  # [b, R]
    mask = _host(tensors, host, "attention_mask").bool()  # [b, L]
    b, width = responses.shape
    prompt_width = mask.shape[1] - width
    lengths = mask.sum(dim=1)  # [b]
    cu = torch.zeros(b + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lengths, 0)
    flat = mask.reshape(-1)
    tokens = flat.nonzero().squeeze(1)  # where the real tokens are in the flattened [b, L]
    # packed index of every real token, in padded coordinates
    index = (torch.cumsum(flat.long(), 0) - 1).reshape(mask.shape)  # [b, L]
    valid, slots = _response_slots(mask, prompt_width)
    keep = index[:, prompt_width - 1:prompt_width - 1 + width][valid]  # [n]
    work = Work(int(lengths.sum()), int((lengths * (lengths + 1) // 2).sum()), len(keep))  # each sequence causal
    keep_host = keep
    tokens, keep, slots, cu = _to_device([tokens, keep, slots, cu], responses.device)
    return Packed(input_ids=_gather(tensors["input_ids"], tokens), position_ids=_gather(tensors["position_ids"], tokens),
                  cu_seqlens=cu.to(torch.int32), max_seqlen=int(lengths.max()) if b else 0, keep=keep,
                  targets=responses.reshape(-1).index_select(0, slots), valid=valid, slots=slots, work=work,
                  keep_host=keep_host)


def unpack(values: torch.Tensor, packed: Packed) -> torch.Tensor:
    """[n] per-response-token values back to [b, R], 0 in the padding slots."""
    b, width = packed.valid.shape
    return values.new_zeros(b * width).index_copy(0, packed.slots, values).view(b, width)


@dataclass
class SharedPrompts:
    """Where the prompts and the responses of a prompt-shared packed row are (``pack_shared``).

    The row holds every distinct prompt once, first (``prompt_tokens`` of them, cut by ``cu_prompt``: causal
    self-attention), then every response (cut by ``cu_resp``); ``kv_idx`` / ``cu_kv`` are the keys each response
    attends to: its prompt, then itself."""

    prompt_tokens: int
    cu_prompt: torch.Tensor
    max_prompt: int
    cu_resp: torch.Tensor
    max_resp: int
    kv_idx: torch.Tensor
    cu_kv: torch.Tensor
    max_kv: int
    tokens_unshared: int
    """The tokens the same micro-batch packed without sharing would hold (``perf`` reads the saving)."""


def pack_shared(tensors: dict[str, torch.Tensor], host: dict[str, torch.Tensor] | None = None) -> Packed:
    """``pack`` with each distinct prompt's tokens once: the n responses of a GRPO group attend to one copy.

    Exact: a prompt's tokens never see its responses (causal), so every copy of it computes the same hidden states; one
    copy whose gradient sums what each response sends back is the same computation with the shared part done once.
    Rows are matched by their prompt tokens (after ``trim_padding``, a group's rows are identical there). The prompts
    come first in the row and the responses after them, so each attention call reads a contiguous slice. The LM-head
    row that predicts a response's first token is its prompt's last position, shared by the group's responses.
    Like ``pack``, the layout is built on the host (``host``: the mask and ids read once per batch) and sent as indices.
    A micro-batch whose prompts are all distinct (one sample per prompt) has nothing to share: it gets ``pack``'s layout
    (``shared`` None), one attention call per layer and no gathered copies of keys and values.
    """
    responses = tensors["responses"]  # [b, R]
    mask = _host(tensors, host, "attention_mask").bool()  # [b, L]
    width = mask.shape[1]
    prompt_width = width - responses.shape[1]
    ids = _host(tensors, host, "input_ids")
    prompt_rows = torch.where(mask[:, :prompt_width], ids[:, :prompt_width], -1)  # [b, P] pads marked
    _, group = torch.unique(prompt_rows, dim=0, return_inverse=True)
    group = group.numpy()
    p_len, r_len = mask[:, :prompt_width].sum(1).numpy(), mask[:, prompt_width:].sum(1).numpy()
    # groups in the order their first row comes; rows grouped, ascending within a group
    _, first = np.unique(group, return_index=True)  # the inverse ids are 0..G-1: first[g] is group g's first row
    if len(first) == len(group):
        return pack(tensors, host)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    rank_of = rank[group]  # [b] each row's group, numbered in that order
    heads = np.sort(first)  # each group's first row, in group order
    cu_p = np.concatenate([[0], np.cumsum(p_len[heads])])
    order = np.argsort(rank_of, kind="stable")
    order = order[r_len[order] > 0]  # the rows with a response, as they follow each other in the packed row
    n, p = r_len[order], p_len[order]
    resp_start = cu_p[-1] + np.cumsum(n) - n
    prompt_start = cu_p[rank_of[order]]
    # flat [b, L] positions of the packed row's tokens: each group's prompt (from its first row), then the responses
    take = np.concatenate([_ranges(heads * width + prompt_width - p_len[heads], p_len[heads]),
                           _ranges(order * width + prompt_width, n)])
    # each response's keys: its prompt's copy, then itself
    kv_idx = _ranges(np.stack([prompt_start, resp_start], 1).ravel(), np.stack([p, n], 1).ravel())
    cu_r, cu_kv = (np.concatenate([[0], np.cumsum(x)]) for x in (n, p + n))
    # LM-head rows in row-major order (as responses[valid]): the prompt's last position predicts the first response
    # token, then each response position predicts the next
    by_row = np.argsort(order, kind="stable")
    keep = _ranges(resp_start[by_row] - 1, n[by_row])
    keep[np.cumsum(n[by_row]) - n[by_row]] = (prompt_start + p - 1)[by_row]
    valid, slots = _response_slots(mask, prompt_width)
    # computed: each prompt once (causal over itself), each response over its prompt's copy and causal over itself
    heads_len = p_len[heads].astype(np.int64)
    pairs = (heads_len * (heads_len + 1) // 2).sum() + (n * p + n * (n + 1) // 2).sum()
    work = Work(int(cu_p[-1] + n.sum()), int(pairs), len(keep))
    take_d, keep_d, kv_d, slots_d, cu_p_d, cu_r_d, cu_kv_d = _to_device(
        [torch.from_numpy(np.asarray(x, dtype=np.int64)) for x in (take, keep, kv_idx)] + [slots]
        + [torch.from_numpy(np.asarray(x, dtype=np.int64)) for x in (cu_p, cu_r, cu_kv)], responses.device)
    shared = SharedPrompts(
        prompt_tokens=int(cu_p[-1]), cu_prompt=cu_p_d.to(torch.int32), max_prompt=int(p_len.max(initial=0)),
        cu_resp=cu_r_d.to(torch.int32), max_resp=int(r_len.max(initial=0)), kv_idx=kv_d, cu_kv=cu_kv_d.to(torch.int32),
        max_kv=int((p_len + r_len).max(initial=0)), tokens_unshared=int(mask.sum()))
    return Packed(input_ids=_gather(tensors["input_ids"], take_d), position_ids=_gather(tensors["position_ids"], take_d),
                  cu_seqlens=shared.cu_prompt, max_seqlen=shared.max_kv, keep=keep_d,
                  targets=responses.reshape(-1).index_select(0, slots_d), valid=valid, slots=slots_d, shared=shared,
                  work=work, keep_host=torch.from_numpy(np.asarray(keep, dtype=np.int64)))


# --------------------------------------------------------------------------- attention
def _varlen_kernel():
    """PyTorch's flash-attention varlen entry point and how this torch asks for causality (None: not available)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn, causal, "enable_gqa" in params


_KERNEL: tuple | None | bool = False


_END_ALIGNED: bool | None = None


def _check_end_aligned(device: torch.device, dtype: torch.dtype) -> None:
    """Once per process: the varlen kernel's causal diagonal for fewer queries than keys must be end-aligned
    (flash-attention's rule; the prompt-shared responses rely on it). Compared with an explicit mask on 3 queries over
    5 keys; a kernel that aligns to the start (as SDPA's ``is_causal`` does) stops the run rather than train wrongly."""
    global _END_ALIGNED
    if _END_ALIGNED is None:
        fn, causal, _ = _KERNEL
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(n, 1, 64, generator=g).to(device, dtype) for n in (3, 5, 5))
        cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device=device) for n in (3, 5))
        out = fn(q, k, v, cu_q, cu_k, 3, 5, **causal)
        mask = torch.arange(5, device=device)[None, :] <= torch.arange(3, device=device)[:, None] + 2
        ref = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                             v.transpose(0, 1).float(), attn_mask=mask).transpose(0, 1)
        _END_ALIGNED = bool((out.float() - ref).abs().max() < 0.05)
    if not _END_ALIGNED:
        raise RuntimeError("actor.share_prompts: this torch's varlen attention aligns the causal diagonal to the start "
                           "when there are fewer queries than keys, so responses cannot attend to a shared prompt; set "
                           "actor.share_prompts=false")


def _segments_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                        max_q: int, max_k: int, scaling: float | None) -> torch.Tensor:
    """Causal attention of query segments over key segments ([T, H, D] rows cut by ``cu_q`` / ``cu_k``), the causal
    diagonal aligned to the end of each pair (a segment's queries are the last of its keys, flash-attention's rule)."""
    global _KERNEL
    groups = q.shape[1] // k.shape[1]
    if _KERNEL is False:
        _KERNEL = _varlen_kernel()
    if q.is_cuda and q.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        # without FSDP (a plain ``python -m hybrid_rl`` run) the residual stream is float32 under autocast and RoPE
        # returns float32 queries and keys: run the kernel in the autocast dtype, as transformers' flash path does
        dtype = torch.get_autocast_dtype("cuda")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if q.is_cuda and _KERNEL is not None and q.dtype in (torch.float16, torch.bfloat16):
        fn, causal, has_gqa = _KERNEL
        if cu_q is not cu_k:
            _check_end_aligned(q.device, q.dtype)
        if groups > 1 and not has_gqa:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        extra = {"enable_gqa": True} if groups > 1 and has_gqa else {}
        return fn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling, **causal, **extra)  # [T, Hq, D]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    # one SDPA per segment: exact. (One call with a block-diagonal [T, T] mask was 7x slower in backward on CPU.)
    out = torch.empty_like(q)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for qs, qe, ks, ke in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        if qe == qs:
            continue
        lq, lk = qe - qs, ke - ks
        qq, kk, vv = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
        if lq == lk:
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scaling)
        else:  # SDPA's is_causal aligns to the start: give the end-aligned mask explicitly
            mask = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scaling)
        out[qs:qe] = o.transpose(0, 1)
    return out


@torch.compiler.disable  # compiled blocks (actor.use_torch_compile) break the graph here: per-sequence slicing and the
# kernel's lengths are data-dependent, which inductor failed on ("Exponent must be non-negative", torch 2.13)
def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function for one packed row: q [1, Hq, T, D], k/v [1, Hkv, T, D] → [1, T, Hq, D].

    Sequences are given by ``hybrid_cu_seqlens`` (passed through the model's forward kwargs); a call without
    them is a usage error (this implementation is only set on engines whose every forward is packed). With
    ``hybrid_shared`` (a ``SharedPrompts`` layout) each prompt attends to itself and each response to its prompt's one
    copy and to itself: two kernel calls. With ``hybrid_sp`` (a ``ulysses.ShardedRow``) the inputs are this rank's
    slice of the row, exchanged for whole-row heads around the attention.
    """
    cu = kwargs.get("hybrid_cu_seqlens")
    if cu is None:
        raise RuntimeError(f"attention '{ATTN_NAME}' needs packed inputs (hybrid_cu_seqlens): call the model through "
                           "hybrid_rl.workers.packed, or set actor.use_remove_padding=false")
    if query.shape[0] != 1:
        raise ValueError(f"'{ATTN_NAME}' takes one packed row, got a batch of {query.shape[0]}")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, H, D]
    row: ShardedRow | None = kwargs.get("hybrid_sp")
    if row is not None:
        def attend(q, k, v):
            return _row_attention(q, k, v, cu, kwargs, scaling)
        return sharded_attention(attend, q, k, v, row)[None], None
    return _row_attention(q, k, v, cu, kwargs, scaling)[None], None


def _row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, kwargs: dict,
                   scaling: float | None) -> torch.Tensor:
    """Attention over one whole packed row ([T, H, D]): per sequence, or prompt-shared (``hybrid_shared``)."""
    sh: SharedPrompts | None = kwargs.get("hybrid_shared")
    if sh is None:
        max_len = int(kwargs["hybrid_max_seqlen"])
        return _segments_attention(q, k, v, cu, cu, max_len, max_len, scaling)
    tp = sh.prompt_tokens  # the prompts are the row's first tp tokens, the responses the rest
    out_p = _segments_attention(q[:tp], k[:tp], v[:tp], sh.cu_prompt, sh.cu_prompt, sh.max_prompt, sh.max_prompt,
                                scaling)
    out_r = _segments_attention(q[tp:], k[sh.kv_idx], v[sh.kv_idx], sh.cu_resp, sh.cu_kv, sh.max_resp, sh.max_kv,
                                scaling)
    return torch.cat([out_p, out_r])


def packs_by_default(device: torch.device, dtype: torch.dtype) -> bool:
    """``actor.use_remove_padding``'s default: pack where flash-attention's varlen kernel runs the packed attention
    (CUDA, 16-bit compute). Elsewhere it is one SDPA call per sequence, which costs more than the padding it saves."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)


def use_varlen_attention(model: torch.nn.Module) -> None:
    """Register ``hybrid_rl_varlen`` with transformers and set it on ``model`` (every forward must then be packed)."""
    global _registered
    from transformers import AttentionInterface

    if not _registered:
        AttentionInterface.register(ATTN_NAME, varlen_attention)
        _registered = True
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(target, "set_attn_implementation"):
        target.set_attn_implementation(ATTN_NAME)
    else:  # older transformers
        target.config._attn_implementation = ATTN_NAME


# --------------------------------------------------------------------------- LM head
def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    z = hidden @ weight.t()  # [C, V] in the compute dtype, then at least float32 like the padded path
    if z.dtype != torch.float64:
        z = z.float()
    return z / temperature if temperature != 1.0 else z


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_k a[i, k] b[i, k] per row, as multiply-and-sum. A batched 1×V·V×1 product is slower on GPUs (the flagship's
    old-log-prob pass on 4×H200: 4.1 s against 2.6 s) and only ~3% faster on CPU (512 × 151,936)."""
    return (a * b).sum(-1)


class FusedLogProb(torch.autograd.Function):
    """(log softmax(h Wᵀ / T)[target], entropy) per row, chunked; backward recomputes each chunk's logits.

    Each chunk's [C, V] float32 logits are turned into log-probabilities in place; the entropy -Σ p log p and its
    gradient reuse that buffer and p, and the temperature is folded into the per-row gradients, so a chunk costs
    few passes over [C, V] (on GPUs those passes, not the head's matmuls, bound this layer). Unused outputs get no
    gradient (``set_materialize_grads(False)``): without an entropy gradient the backward skips its part. Logits
    are assumed finite (a linear layer's are)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk: int, with_entropy: bool = True):  # [n, H], [V, H], [n] -> [n], [n] (zeros without entropy)
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32,
                           device=hidden.device)
        ent = torch.zeros_like(logp)
        lse = torch.empty_like(logp)
        for s in range(0, n, chunk):
            z = _chunk_logits(hidden[s:s + chunk], weight, temperature)
            lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
            z.sub_(lse[s:s + chunk, None])  # log p
            logp[s:s + chunk] = z.gather(-1, targets[s:s + chunk, None]).squeeze(-1)
            if with_entropy:
                ent[s:s + chunk] = -_row_dot(torch.exp(z), z)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(targets)
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor | None, grad_ent: torch.Tensor | None):
        hidden, weight, targets, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            logp_all = _chunk_logits(h, weight, t).sub_(lse[s:s + chunk, None])  # [C, V] log p
            p = torch.exp(logp_all)
            # the logits are z/T: every row's gradient carries 1/T
            gl = grad_logp[s:s + chunk, None].to(p.dtype) / t if grad_logp is not None else None
            if grad_ent is not None:  # dH/dz_k = -p_k (log p_k - E_p[log p])
                ge = grad_ent[s:s + chunk, None].to(p.dtype) / t
                g = logp_all.sub_(_row_dot(p, logp_all)[:, None]).mul_(p).mul_(-ge)
                if gl is not None:
                    g.sub_(p.mul_(gl))
            else:  # d log p_y / dz = onehot(y) - p
                g = p.mul_(-gl)
            if gl is not None:
                g.scatter_add_(-1, targets[s:s + chunk, None], gl)
            g = g.to(hidden.dtype)
            if grad_h is not None:
                grad_h[s:s + chunk] = g @ weight.to(hidden.dtype)
            if grad_w is not None:
                grad_w += (g.t() @ h).to(acc)
        return grad_h, grad_w.to(weight.dtype) if grad_w is not None else None, None, None, None, None


def fused_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                          chunk: int = LOGIT_CHUNK_ROWS, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies [n] (float32) of ``targets`` under softmax(hidden @ weightᵀ / temperature); without
    ``with_entropy`` the entropies are zeros and carry no gradient (the pass skips computing them)."""
    if hidden.dtype != weight.dtype:  # autocast (one GPU without FSDP): the head's matmul runs in the autocast dtype
        dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else hidden.dtype
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    return FusedLogProb.apply(hidden, weight, targets.long(), float(temperature), chunk, with_entropy)


def output_head(model: torch.nn.Module) -> torch.nn.Module:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor) or getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}: the fused log-prob head needs a bias-free linear output layer "
                         "(get_output_embeddings()); set actor.fused_logprob=false for this model")
    return head


@contextmanager
def logprob_head(model: torch.nn.Module, targets: torch.Tensor, temperature: float, with_entropy: bool = True,
                 entropy_grad: bool = True):
    """Inside: the model's LM head returns [1, n, 2] = (log-prob of ``targets``, entropy) for its n input rows
    instead of logits (read them with ``split_head_output``). Without ``with_entropy`` the entropies are zeros;
    without ``entropy_grad`` they are detached, so backward does no entropy work (a loss without an entropy term)."""
    head = output_head(model)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])  # [n, H]
        logp, ent = fused_logprob_entropy(flat, head.weight, targets, temperature, with_entropy=with_entropy)
        if not entropy_grad:
            ent = ent.detach()
        # stacked straight into [1, n, 2]: a view here (``[None]``) is what FSDP2 warns about for a root output
        return torch.stack([logp[None], ent[None]], dim=-1)

    previous = head.__dict__.get("forward")  # an instance-level forward already set (e.g. by a wrapper)
    head.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del head.forward  # back to the class's forward
        else:
            head.forward = previous


def split_head_output(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The [.., n, 2] output of ``logprob_head`` as (log-probs [n], entropies [n]), float32."""
    flat = logits.reshape(-1, 2).float()
    return flat[:, 0], flat[:, 1]
