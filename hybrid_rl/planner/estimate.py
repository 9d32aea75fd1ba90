"""The memory model: the peak bytes one GPU holds in each phase of a step, as named terms.

Every term is a closed formula of the model shape (``shape.py``) and the config; ``P`` is the parameter count,
``W`` the ranks the trainer shards over, ``T`` the tokens of one micro-batch, ``h``/``I``/``kv`` the hidden, MLP and
key/value widths, ``L`` the layers, ``V`` the vocabulary, ``c`` the compute dtype's bytes (2 for bf16).

What the trainer keeps (``workers/fsdp_engine.py``): trainable models hold fp32 masters, sharded (``4P/W``; LoRA with
``model.lora.base_dtype=compute``: the frozen base in the compute dtype, ``cP/W``, and the adapters' fp32), and
AdamW's two fp32 moments (``8P/W``; LoRA: the adapters'); their fp32 gradients, sharded (``4P/W``; LoRA: adapters
only), live from a mini-batch's first backward until its optimizer step frees them, so only in the model's own update
phase, whose peak is the larger of its last backward and its optimizer step (the gradient shards, the activations
gone, and AdamW's temporaries: none fused, a copy of the second moment ``4P/W`` foreach, one tensor's for-loop).
The frozen reference is sharded in the compute dtype (``cP/W``; LoRA reuses the actor). A pass gathers two blocks
at a time (the current one and the prefetched next) and the root (embeddings) in the compute dtype; with
``actor.accumulate_unsharded`` the whole model stays gathered (``cP``) and the update accumulates full fp32
gradients (``4P``), reduce-scattered into their shards block by block only in the mini-batch's last backward, as
that backward frees the activations: the shards (``4P/W``) are not held beside the activations, and the update's
peak is the unsharded gradients with the last micro-batch's activations. The critic's passes likewise with
``critic.accumulate_unsharded`` (by default the actor's).

Activations kept for backward, bytes per token per layer at c = 2, counted from what autograd saves in a
Qwen2/Llama block: the two RMSNorms save their fp32 input and bf16 output (6h each), q/k/v's input (2h), attention's
q, k, v and output (4h + 4kv), o_proj's input (2h), gate/up's input (2h), SiLU's input, the product's two factors
and down_proj's input (8I): ``A = 22h + 4kv + 8I``; Liger's kernels save less (RMSNorm 2h, SwiGLU 6I):
``A = 14h + 4kv + 6I``. With recomputation a layer keeps only its input (``c·h``) and one layer's ``A`` is rebuilt
at a time. A no-grad pass holds one layer's temporaries: ``16h + 6I`` (the residual, an fp32 norm, gate, up and
their product). ``actor.share_prompts`` adds, per layer, the concatenated attention output (2h) and each response's
gathered copy of its prompt's keys and values (4kv × the unshared/shared token ratio, ``n(p+r)/(p+nr)``). Logits:
the fused head computes ``LOGIT_CHUNK_ROWS`` rows at a time (bf16 logits, fp32 softmax, fp32 gradient: 10 bytes an
entry) and accumulates the head's gradient in fp32 (4Vh); the unfused head keeps ``rows × V`` bf16 logits (2 bytes
an entry) and in the update their gradient (2 more), rows being the micro-batch's response tokens; the padded path
slices them out of the whole width and copies them, one more bf16 copy (2 more).

Micro-batches are taken at their worst: every sequence at ``max_prompt_length + max_response_length`` (a token
budget: the budget itself). With prompts shared, a fixed-size micro-batch of ``s`` rows computes each of its prompts
once: rows stay in prompt order (``micro_batching._by_prompt``; the update's unless ``actor.shuffle_mini_batches``), so
it meets at most ``g`` prompts, the most groups of ``n`` rows that a chunk of ``s`` rows cut at multiples of ``s``
spans, and computes ``g·p + s·r`` tokens. Ulysses sequence parallelism (``actor.ulysses_sequence_parallel_size = s``) gives each
group of ``s`` ranks one share of the batch (``W / s`` shares) and each rank ``1/s`` of every packed row of the actor's
and the reference's passes: their activations and LM-head rows are those of ``T / s`` tokens, except that attention
holds every position of its ``1/s`` of the heads, key/value heads repeated up to ``s`` (the ``4kv`` term becomes
``4 · head_dim · max(kv_heads, s)``); a packing critic (``critic.use_remove_padding``) cuts its rows the same way,
one that pads runs the group's rows whole. A reward model (``reward.model``) is a phase of its own: the state kept
between passes, its weights whole (each scoring rank holds a copy) and one micro-batch's no-grad temporaries at its
``max_length``. The engine takes
``rollout.vllm.gpu_memory_utilization × GPU memory`` (weights and KV cache); a sleeping engine (sync mode) holds
nothing, and the push wakes its weights alone: ``P × 2 / rollout.vllm.tensor_parallel_size``. Not modelled: the
caching allocator's fragmentation (reserved above allocated: ``trainer.expandable_segments``), NCCL's buffers and the
CUDA context (``CONTEXT_GIB``), and start-up: one rank of a sharded run loads the whole fp32 model (``4P``) on the host
and sends it one tensor at a time (``workers/materialize.py``); a world of one moves it to the GPU whole, its own
training state anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybrid_rl.config.geometry import mini_batch_seqs
from hybrid_rl.planner.shape import ModelShape
from hybrid_rl.workers.packed import LOGIT_CHUNK_ROWS

if TYPE_CHECKING:
    from hybrid_rl.config import Config

GIB = 2**30
CONTEXT_GIB = 1.0
"""What a GPU process holds beyond its tensors (CUDA context, NCCL's buffers, the sleeping engine's CUDA graphs)."""
FUSED_LOGIT_BYTES = 10
"""Bytes per logit entry of one fused-head chunk: bf16 logits, fp32 softmax, fp32 gradient (recomputed in backward)."""
LOGIT_BYTES = 2
"""Bytes per logit entry of the unfused head, per copy: bf16 (the logits; in the update their gradient; padded, the
slice's copy)."""
PUSH_GATHER_BYTES = 256 * 2**20
"""``TrainingEngine.push_gather_bytes``: one all-gather of the weight push."""


@dataclass
class Phase:
    name: str
    terms: dict[str, float] = field(default_factory=dict)
    """Term name → bytes on one GPU."""

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    def biggest(self, k: int = 3) -> list[tuple[str, float]]:
        return sorted(self.terms.items(), key=lambda kv: -kv[1])[:k]


def largest_tensor(shape: ModelShape, lora: bool) -> int:
    """Elements of the largest trainable tensor: the embedding (an LM head is no larger); under LoRA a bound on an
    adapter's factor (``rank × max(h, I)``): ``h × I``."""
    return shape.vocab * shape.hidden if not lora else shape.intermediate * shape.hidden


def optimizer_step(role: str, p_rank: float, impl: str, largest: float) -> dict[str, float]:
    """What the optimizer step adds to a role's kept state, ``p_rank`` trainable parameters on this rank: the fp32
    gradients reduced to shards (the pass's activations and gathered copies gone) and AdamW's temporaries: none
    (``fused``), a copy of the second-moment state (``foreach``), a copy of the largest tensor (``for_loop``)."""
    out = {f"{role} grads (fp32, sharded)": 4 * p_rank}
    if impl == "foreach":
        out[f"{role} AdamW step copy (fp32, sharded)"] = 4 * p_rank
    elif impl == "for_loop":
        out[f"{role} AdamW step copy (one tensor)"] = 4 * min(largest, p_rank)
    return out


def sp_kv_dim(shape: ModelShape, sp: int) -> int:
    """Key (or value) width per token of a rank's slice under sequence parallelism of size ``sp``: its share of the
    key/value heads over every position, heads repeated when fewer than ``sp`` (``ulysses.repeat_kv_heads``)."""
    return shape.kv_dim if sp == 1 else shape.head_size * max(shape.kv_heads, sp)


def activation_bytes_per_token_layer(shape: ModelShape, liger: bool, sp: int = 1) -> int:
    """``A`` at bf16: what one block saves for backward per token (see the module docstring)."""
    h, kv, i = shape.hidden, sp_kv_dim(shape, sp), shape.intermediate
    return (14 * h + 4 * kv + 6 * i) if liger else (22 * h + 4 * kv + 8 * i)


def no_grad_bytes_per_token(shape: ModelShape) -> int:
    """One block's live temporaries per token in a no-grad pass, at bf16."""
    return 16 * shape.hidden + 6 * shape.intermediate


def shared_bytes_per_token_layer(shape: ModelShape, unshared_ratio: float, sp: int = 1) -> float:
    """What ``actor.share_prompts`` adds to ``A``: the concatenated attention output and the gathered prompt K/V."""
    return 2 * shape.hidden + 4 * sp_kv_dim(shape, sp) * unshared_ratio


def grad_activations(shape: ModelShape, tokens: int, c: int, liger: bool, recompute: bool,
                     unshared_ratio: float | None = None, sp: int = 1) -> float:
    """Bytes kept for backward over ``tokens`` of one rank (a micro-batch, or its ``1/sp`` slice under sequence
    parallelism of size ``sp``; ``unshared_ratio``: prompts shared, see above)."""
    a = activation_bytes_per_token_layer(shape, liger, sp)
    if unshared_ratio is not None:
        a += shared_bytes_per_token_layer(shape, unshared_ratio, sp)
    a *= c / 2
    if recompute:
        return tokens * (shape.layers * shape.hidden * c + a)
    return tokens * shape.layers * a


def logits_bytes(shape: ModelShape, rows: int, fused: bool, grad: bool, packed: bool) -> float:
    """The LM head's output over ``rows`` response tokens (see the module docstring)."""
    if fused:
        head_grad = 4 * shape.vocab * shape.hidden if grad else 0
        return min(rows, LOGIT_CHUNK_ROWS) * shape.vocab * FUSED_LOGIT_BYTES + head_grad
    copies = 1 + int(grad) + int(not packed)
    return rows * shape.vocab * LOGIT_BYTES * copies + min(rows, LOGIT_CHUNK_ROWS) * shape.vocab * 4


@dataclass
class Layout:
    """Resolved settings the formulas read (the defaults that depend on the device taken as on CUDA)."""
    gpus: int
    train_ranks: int
    engine_ranks_separate: bool
    c: int
    fused: bool
    packed: bool
    shared: bool
    engine_awake_in_training: bool
    sp: int = 1
    """Ranks per sequence-parallel group of the actor's passes."""

    @classmethod
    def of(cls, cfg: "Config", gpus: int) -> "Layout":
        a = cfg.actor
        split = cfg.trainer.placement == "split"
        train_ranks = cfg.split_layout(gpus)[1] if split else gpus
        dtype = cfg.model.dtype if cfg.model.dtype != "auto" else "bfloat16"
        packed = dtype != "float32" if a.use_remove_padding is None else a.use_remove_padding  # as the worker resolves it
        return cls(gpus=gpus, train_ranks=max(train_ranks, 1), engine_ranks_separate=split,
                   c=4 if dtype == "float32" else 2, fused=True if a.fused_logprob is None else a.fused_logprob,
                   packed=packed, shared=packed if a.share_prompts is None else a.share_prompts,
                   engine_awake_in_training=not split and not cfg.engine_sleeps,
                   sp=a.ulysses_sequence_parallel_size)


def seq_len(cfg: "Config") -> int:
    return cfg.data.max_prompt_length + cfg.data.max_response_length


def prompts_met(rows: int, n: int) -> int:
    """The most prompts a chunk of ``rows`` consecutive rows meets, chunks cut at multiples of ``rows`` from the start
    of rows in prompt order, ``n`` rows per prompt (the pattern repeats every ``lcm(rows, n)`` rows)."""
    period = rows * n // math.gcd(rows, n)
    return max((start + rows - 1) // n - start // n + 1 for start in range(0, period, rows))


def micro_tokens(cfg: "Config", seqs: int, budget: int | None, rank_seqs: int, shared: bool = False) -> int:
    """Tokens of the largest micro-batch: the budget (a longer sequence goes alone), else ``seqs`` sequences at
    full length, never more than the rank holds; ``shared``: rows in prompt order, each prompt computed once."""
    if budget is not None:
        return max(budget, seq_len(cfg))
    s = min(seqs, rank_seqs)
    if shared:
        return prompts_met(s, cfg.rollout.n) * cfg.data.max_prompt_length + s * cfg.data.max_response_length
    return s * seq_len(cfg)


def unshared_ratio(cfg: "Config", seqs: int | None = None, tokens: int | None = None) -> float:
    """Tokens of a micro-batch's sequences each whole, per token of its packed row with prompts shared, at full
    lengths: ``n(p + r) / (p + n·r)`` in a budget's micro-batch, ``s(p + r) / tokens`` in one of ``seqs`` rows."""
    p, r, n = cfg.data.max_prompt_length, cfg.data.max_response_length, cfg.rollout.n
    if seqs is not None and tokens is not None:
        return seqs * (p + r) / tokens
    return n * (p + r) / (p + n * r)


def response_rows(cfg: "Config", tokens: int) -> int:
    """Rows through the LM head: the micro-batch's response tokens."""
    return tokens * cfg.data.max_response_length // seq_len(cfg)


def slice_of(tokens: int, sp: int) -> int:
    """A rank's part of ``tokens`` cut in ``sp`` slices (the row padded to a multiple of ``sp``)."""
    return -(-tokens // sp)


def engine_bytes(cfg: "Config", shape: ModelShape, gpu_bytes: float, rank_seqs: int) -> float:
    """The awake engine: the share of the GPU it reserves (vLLM's), or else what it holds: its weights, KV cache and
    one step's logits (the transformers engine's; vLLM's with its KV cache fitted, its 16-bit weights split over its
    tensor-parallel GPUs)."""
    mem = cfg.rollout.engine_memory()
    fitted = mem.fitted_kv_bytes(cfg, shape, gpu_bytes) if mem.fitted_kv_bytes is not None else None
    seqs = min(cfg.rollout.max_num_seqs, rank_seqs)
    if fitted is not None:
        return shape.params * 2 / mem.tensor_parallel + fitted + cfg.rollout.max_num_seqs * shape.vocab * 4
    if mem.gpu_share is not None:
        return mem.gpu_share * gpu_bytes
    wb = 4 if cfg.rollout_dtype == "float32" or (cfg.rollout_dtype == "auto" and cfg.model.dtype == "float32") else 2
    kv = seqs * seq_len(cfg) * shape.layers * 2 * shape.kv_dim * wb
    return shape.params * wb + kv + seqs * shape.vocab * 4


def critic_params(shape: ModelShape) -> int:
    """The value model: the backbone without the LM head, plus a scalar head."""
    head = 0 if shape.tied else shape.vocab * shape.hidden
    return shape.params - head + shape.hidden + 1


def reward_model_terms(cfg: "Config") -> dict[str, float]:
    """What scoring with ``reward.model`` adds on a rank: its whole weights (a copy per rank; the backbone and a
    scalar head) and one micro-batch's no-grad temporaries at ``max_length``; nothing without a reward model or
    where its shape cannot be read here."""
    from hybrid_rl.planner.shape import ShapeError, read_shape

    r = cfg.reward.model
    if r.path is None:
        return {}
    try:
        rm = read_shape(r.path)
    except ShapeError:
        return {}
    wb = 4 if r.dtype == "float32" else 2
    tokens = r.micro_batch_size * r.max_length
    params = rm.params - (0 if rm.tied else rm.vocab * rm.hidden) + rm.hidden  # the LM head's place: a bias-free score
    return {"reward model weights": params * wb,
            f"reward model activations ({tokens} tokens)": tokens * no_grad_bytes_per_token(rm) * wb / 2}


def phases(cfg: "Config", shape: ModelShape, gpus: int, gpu_bytes: float,
           micro_at: dict[str, int] | None = None) -> list[Phase]:
    """The phases of one step on the busiest GPU, each with its terms. ``micro_at`` (phase name → tokens) puts a
    phase's largest micro-batch at the size a run logged (``perf/phase_micro_batch_tokens/*``) instead of its worst
    case: the memory model checked on its own, apart from the worst-case lengths a verdict assumes."""
    micro_at = micro_at or {}
    lay = Layout.of(cfg, gpus)
    a, d, W, c = cfg.actor, cfg.data, lay.train_ranks, lay.c
    P = shape.params
    lora = cfg.model.lora.rank > 0
    P_train = shape.lora_params(cfg.model.lora.rank, cfg.model.lora.target_modules) if lora else P
    sp, dp = lay.sp, max(W // lay.sp, 1)  # a sequence-parallel group holds one of dp shares of the batch
    rank_seqs = max(d.train_batch_size * cfg.rollout.n // dp, 1)
    mini_seqs = max(mini_batch_seqs(a, dp, cfg.rollout.n), 1)
    budget = a.max_token_len_per_device if a.use_dynamic_bsz else None

    if lora and cfg.model.lora.base_dtype == "compute":  # the frozen base in the compute dtype, the adapters fp32
        actor = {"actor frozen base (sharded)": c * P / W, "actor params (fp32, sharded)": 4 * P_train / W}
    else:
        actor = {"actor params (fp32, sharded)": 4 * P / W}
    actor["actor AdamW (2 x fp32, sharded)"] = 8 * P_train / W
    ref = {"ref params (sharded)": c * P / W} if cfg.need_ref and not lora else {}
    critic: dict[str, float] = {}
    if cfg.need_critic:
        Pc = critic_params(shape)
        critic = {"critic params (fp32, sharded)": 4 * Pc / W, "critic AdamW (sharded)": 8 * Pc / W}
    engine = engine_bytes(cfg, shape, gpu_bytes, max(d.train_batch_size * cfg.rollout.n // W, 1))  # each its own
    awake = {"engine (awake)": engine} if lay.engine_awake_in_training else {}

    def kept(*, ref_on: bool = False, critic_on: bool = False, optimizer_on: bool = False) -> dict[str, float]:
        """What stays on the GPU between passes, given the offload settings (gradients are held only in an
        update phase: the optimizer step frees them; ``actor.optimizer_offload`` brings the actor's optimizer
        state to the GPU for its update only)."""
        out = dict(actor)
        if a.optimizer_offload and not optimizer_on:
            out.pop("actor AdamW (2 x fp32, sharded)")
        if ref and (ref_on or not cfg.ref.offload):
            out.update(ref)
        if critic:
            if critic_on or not cfg.critic.param_offload:
                out["critic params (fp32, sharded)"] = critic["critic params (fp32, sharded)"]
            if critic_on or not cfg.critic.optimizer_offload:
                out["critic AdamW (sharded)"] = critic["critic AdamW (sharded)"]
        return out

    def gathered(params: int, trainable: int, grad: bool, unsharded: bool = a.accumulate_unsharded) -> dict[str, float]:
        """The compute-dtype copies a pass gathers, and in backward the gradients not yet reduce-scattered
        (``unsharded``: the engine's ``accumulate_unsharded``, the actor's unless given)."""
        if unsharded:
            out = {"gathered params (whole model)": c * params}
            if grad:
                out["unsharded grads (fp32, whole model)"] = 4 * trainable
            return out
        root = shape.embedding_params
        out = {"gathered params (2 blocks + root)": c * (2 * shape.layer_params + root)}
        if grad:
            out["unsharded grads (2 blocks + root)"] = 4 * (2 * shape.layer_params + root) if not lora else 0
        return out

    def tokens_label(t: int, sp: int = sp) -> str:
        return f"{t} tokens" if sp == 1 else f"{slice_of(t, sp)} tokens, 1/{sp} of {t}"

    def no_grad_pass(name: str, seqs: int, extra: dict[str, float], logits: bool = True) -> Phase:
        t = micro_at.get(name) or micro_tokens(cfg, seqs, budget, rank_seqs, shared=lay.shared)  # rows in batch order
        ts = slice_of(t, sp)
        terms = {**extra, **awake, **gathered(P, P_train, grad=False),
                 f"activations, no grad ({tokens_label(t)})": ts * no_grad_bytes_per_token(shape) * c / 2}
        if logits:
            terms["logits"] = logits_bytes(shape, slice_of(response_rows(cfg, t), sp), lay.fused, grad=False,
                                           packed=lay.packed)
        return Phase(name, terms)

    out: list[Phase] = []
    # -- the engine's phase: the push (engine weights in, the trainer still whole), then generation
    if lay.engine_ranks_separate:
        out.append(Phase("generation (rollout ranks)", {"engine (awake)": engine,
                                                        "push buckets": cfg.rollout.weight_sync_bucket_mb * 2**20}))
    else:
        wb = 2 if cfg.rollout_dtype != "float32" else 4
        mem = cfg.rollout.engine_memory()  # a reserving engine's weights are within its share, over its GPUs
        in_engine = engine if lay.engine_awake_in_training else (min(shape.params * wb / mem.tensor_parallel, engine)
                                                                  if mem.gpu_share is not None else shape.params * wb)
        push = {**kept(), "engine weights": in_engine, "push gather + bucket":
                PUSH_GATHER_BYTES + cfg.rollout.weight_sync_bucket_mb * 2**20}
        out.append(Phase("weight push", push))
        gen = {"engine (awake)": engine, **kept()}
        if cfg.engine_sleeps:
            if a.param_offload:
                gen.pop("actor params (fp32, sharded)")
                gen.pop("actor frozen base (sharded)", None)
        out.append(Phase("generation", gen))
    # -- the no-grad passes
    if a.old_log_prob != "engine":
        out.append(no_grad_pass("old log-prob", a.log_prob_micro_batch_size_per_device, kept()))
    if ref:
        out.append(no_grad_pass("ref log-prob", cfg.ref.log_prob_micro_batch_size_per_device, kept(ref_on=True)))
    # -- the actor's update
    update_seqs = min(a.ppo_micro_batch_size_per_device, mini_seqs, rank_seqs)
    in_order = lay.shared and not a.shuffle_mini_batches  # shuffled mini-batches scatter a prompt's rows
    worst = micro_tokens(cfg, update_seqs, budget, rank_seqs, shared=in_order)
    t = micro_at.get("actor update") or worst
    ratio = (unshared_ratio(cfg) if budget is not None else unshared_ratio(cfg, update_seqs, worst)) if lay.shared \
        else None
    recompute = cfg.model.enable_gradient_checkpointing
    # gradient shards beside the activations only when each micro-batch reduce-scatters (module docstring)
    shards = {} if a.accumulate_unsharded else {"actor grads (fp32, sharded)": 4 * P_train / W}
    backward = {
        **kept(optimizer_on=True), **shards, **awake, **gathered(P, P_train, grad=True),
        f"activations ({tokens_label(t)}{', recomputed' if recompute else ''})":
            grad_activations(shape, slice_of(t, sp), c, cfg.model.use_liger, recompute, ratio, sp),
        "logits": logits_bytes(shape, slice_of(response_rows(cfg, t), sp), lay.fused, grad=True, packed=lay.packed)}
    step = {**kept(optimizer_on=True), **awake, **optimizer_step("actor", P_train / W, a.optimizer_impl,
                                                 largest_tensor(shape, lora) / W)}
    out.append(Phase("actor update", max(backward, step, key=lambda terms: sum(terms.values()))))
    # -- the reward model's pass (its weights on the GPU only while it scores)
    rm = reward_model_terms(cfg)
    if rm:
        out.append(Phase("reward model", {**kept(), **awake, **rm}))
    # -- the critic's passes
    if critic:
        cr, Pc = cfg.critic, critic_params(shape)
        cu = cr.accumulates_unsharded(a)
        cbudget = cr.max_token_len_per_device if cr.use_dynamic_bsz else None
        csp = sp if (lay.packed if cr.use_remove_padding is None else cr.use_remove_padding) else 1
        tv = micro_at.get("critic values") or micro_tokens(cfg, cr.forward_micro_batch_size_per_device, cbudget,
                                                            rank_seqs)
        out.append(Phase("critic values", {**kept(critic_on=True), **awake,
                                           **gathered(Pc, Pc, grad=False, unsharded=cu),
                                           f"activations, no grad ({tokens_label(tv, csp)})":
                                               slice_of(tv, csp) * no_grad_bytes_per_token(shape) * c / 2}))
        cmini = max(mini_batch_seqs(cr, dp, cfg.rollout.n), 1)
        tc = micro_at.get("critic update") or micro_tokens(cfg, min(cr.ppo_micro_batch_size_per_device, cmini),
                                                            cbudget, rank_seqs)
        cshards = {} if cu else {"critic grads (fp32, sharded)": 4 * Pc / W}
        cbackward = {
            **kept(critic_on=True), **cshards, **awake,
            **gathered(Pc, Pc, grad=True, unsharded=cu),
            f"activations ({tokens_label(tc, csp)}{', recomputed' if cr.enable_gradient_checkpointing else ''})":
                grad_activations(shape, slice_of(tc, csp), c, cfg.model.use_liger, cr.enable_gradient_checkpointing,
                                 sp=csp)}
        cstep = {**kept(critic_on=True), **awake,
                 **optimizer_step("critic", Pc / W, cr.optimizer_impl, largest_tensor(shape, False) / W)}
        out.append(Phase("critic update", max(cbackward, cstep, key=lambda terms: sum(terms.values()))))
    return out
