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

Left out: sliding-window attention (no supported model uses it in training), attention dropout (0 in the
supported configs), and sequence parallelism (Ulysses / ring): one packed row lives on one device.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
    valid: torch.Tensor  # [b, R] bool: which response slots the n rows fill (row-major)
    shared: "SharedPrompts | None" = None  # pack_shared's layout (each prompt once); None: one sequence per row


def pack(tensors: dict[str, torch.Tensor]) -> Packed:
    """One row holding the real tokens of a padded micro-batch (``input_ids``/``attention_mask``/``position_ids``
    [b, P + R], ``responses`` [b, R]), and where its response tokens are predicted."""
    mask = tensors["attention_mask"].bool()  # [b, L]
    responses = tensors["responses"]  # [b, R]
    width = responses.shape[1]
    prompt_width = mask.shape[1] - width
    lengths = mask.sum(dim=1)  # [b]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=mask.device)
    cu[1:] = torch.cumsum(lengths, 0)
    # packed index of every real token, in padded coordinates
    index = torch.cumsum(mask.flatten().long(), 0).reshape(mask.shape) - 1  # [b, L]
    # response token j is predicted at padded column P + j - 1; it counts where the token itself is real
    valid = mask[:, prompt_width:]  # [b, R]
    keep = index[:, prompt_width - 1:prompt_width - 1 + width][valid]  # [n]
    return Packed(input_ids=tensors["input_ids"][mask][None], position_ids=tensors["position_ids"][mask][None],
                  cu_seqlens=cu, max_seqlen=int(lengths.max()) if len(lengths) else 0, keep=keep,
                  targets=responses[valid], valid=valid)


def unpack(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[n] per-response-token values back to [b, R], 0 in the padding slots."""
    out = values.new_zeros(valid.shape)
    out[valid] = values
    return out


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


def pack_shared(tensors: dict[str, torch.Tensor]) -> Packed:
    """``pack`` with each distinct prompt's tokens once: the n responses of a GRPO group attend to one copy.

    Exact: a prompt's tokens never see its responses (causal), so every copy of it computes the same hidden states; one
    copy whose gradient sums what each response sends back is the same computation with the shared part done once.
    Rows are matched by their prompt tokens (after ``trim_padding``, a group's rows are identical there). The prompts
    come first in the row and the responses after them, so each attention call reads a contiguous slice. The LM-head
    row that predicts a response's first token is its prompt's last position, shared by the group's responses.
    """
    mask = tensors["attention_mask"].bool()  # [b, L]
    responses = tensors["responses"]  # [b, R]
    prompt_width = mask.shape[1] - responses.shape[1]
    ids, pos = tensors["input_ids"], tensors["position_ids"]
    dev = mask.device
    prompt_rows = torch.where(mask[:, :prompt_width], ids[:, :prompt_width], -1)  # [b, P] pads marked
    _, group = torch.unique(prompt_rows, dim=0, return_inverse=True)
    group_of, p_len = group.tolist(), mask[:, :prompt_width].sum(1).tolist()
    r_len = mask[:, prompt_width:].sum(1).tolist()
    members: dict[int, list[int]] = {}
    for row, g in enumerate(group_of):
        members.setdefault(g, []).append(row)
    groups = sorted(members.values(), key=lambda rows: rows[0])  # in the order their first row comes
    prompt_at: dict[int, range] = {}  # row -> its prompt's positions in the packed row
    tok, posn, cu_p = [], [], [0]
    for rows in groups:
        p = p_len[rows[0]]
        tok.append(ids[rows[0], prompt_width - p:prompt_width])
        posn.append(pos[rows[0], prompt_width - p:prompt_width])
        for row in rows:
            prompt_at[row] = range(cu_p[-1], cu_p[-1] + p)
        cu_p.append(cu_p[-1] + p)
    kv_idx: list[int] = []  # packed positions, built as Python ints and moved to the device once
    keep_of: dict[int, list[int]] = {}
    cu_r, cu_kv, cursor = [0], [0], cu_p[-1]
    for row in (r for rows in groups for r in rows):
        n = r_len[row]
        if n == 0:
            continue
        tok.append(ids[row, prompt_width:prompt_width + n])
        posn.append(pos[row, prompt_width:prompt_width + n])
        resp, prompt = range(cursor, cursor + n), prompt_at[row]
        kv_idx.extend(prompt)
        kv_idx.extend(resp)
        cu_r.append(cu_r[-1] + n)
        cu_kv.append(cu_kv[-1] + len(prompt) + n)
        keep_of[row] = [prompt[-1], *resp[:-1]]  # the prompt's last position predicts the first response token
        cursor += n
    keep = [i for row in range(len(group_of)) for i in keep_of.get(row, ())]  # row-major, as responses[valid]
    i64, i32 = dict(dtype=torch.long, device=dev), dict(dtype=torch.int32, device=dev)
    shared = SharedPrompts(
        prompt_tokens=cu_p[-1], cu_prompt=torch.tensor(cu_p, **i32), max_prompt=max(p_len, default=0),
        cu_resp=torch.tensor(cu_r, **i32), max_resp=max(r_len, default=0), kv_idx=torch.tensor(kv_idx, **i64),
        cu_kv=torch.tensor(cu_kv, **i32), max_kv=max((p_len[r] + r_len[r] for r in range(len(group_of))), default=0),
        tokens_unshared=int(mask.sum()))
    valid = mask[:, prompt_width:]  # [b, R]
    return Packed(input_ids=torch.cat(tok)[None], position_ids=torch.cat(posn)[None], cu_seqlens=shared.cu_prompt,
                  max_seqlen=shared.max_kv, keep=torch.tensor(keep, **i64), targets=responses[valid], valid=valid,
                  shared=shared)


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
    copy and to itself: two kernel calls.
    """
    cu = kwargs.get("hybrid_cu_seqlens")
    if cu is None:
        raise RuntimeError(f"attention '{ATTN_NAME}' needs packed inputs (hybrid_cu_seqlens): call the model through "
                           "hybrid_rl.workers.packed, or set actor.use_remove_padding=false")
    if query.shape[0] != 1:
        raise ValueError(f"'{ATTN_NAME}' takes one packed row, got a batch of {query.shape[0]}")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, H, D]
    sh: SharedPrompts | None = kwargs.get("hybrid_shared")
    if sh is None:
        max_len = int(kwargs["hybrid_max_seqlen"])
        return _segments_attention(q, k, v, cu, cu, max_len, max_len, scaling)[None], None
    tp = sh.prompt_tokens  # the prompts are the row's first tp tokens, the responses the rest
    out_p = _segments_attention(q[:tp], k[:tp], v[:tp], sh.cu_prompt, sh.cu_prompt, sh.max_prompt, sh.max_prompt,
                                scaling)
    out_r = _segments_attention(q[tp:], k[sh.kv_idx], v[sh.kv_idx], sh.cu_resp, sh.cu_kv, sh.max_resp, sh.max_kv,
                                scaling)
    return torch.cat([out_p, out_r])[None], None


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
    """Σ_k a[i, k] b[i, k] per row, as multiply-and-sum. A batched 1×V·V×1 product instead was the slow part of the
    flagship's old-log-prob pass on GPUs (4×H200: 2.6 → 4.1 s) and gained only ~3% on CPU (512 × 151,936)."""
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
