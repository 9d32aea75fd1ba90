"""The training engine: one model, FSDP2-sharded when a process group exists, plus its optimizer.

Narrow on purpose (verl's newer ``engine/base.py`` shape): ``forward`` for
log-probs/entropy of response tokens, ``compute_log_prob`` for no-grad passes
in micro-batches, ``backward``/``optimizer_step`` for training,
``iter_full_params`` for the sharding manager and ``offload``/``onload`` for
handing the GPU to the rollout engine. It knows nothing about PPO; the worker
composes losses on top. With ``torch.distributed`` initialised the model is
wrapped with ``fully_shard`` per decoder block and at the root (bf16 compute,
fp32 gradient reduction on GPU); a world of one without a process group runs
the plain module, with bf16 autocast on GPU.

The weight push (``iter_full_params``) streams the model out a few FSDP
module groups (decoder blocks, or the root's embeddings + final norm) at a
time: consecutive groups are merged up to ``push_gather_bytes``, every rank
casts its local dim-0 shards of the merged chunk to the engine dtype into one
flat buffer (one ``_foreach_copy_``) and a single ``all_gather_into_tensor`` brings
it over; one ``split_with_sizes_copy`` lays it out parameter-major and every
full tensor is a view of that buffer. The next chunk's gather is issued before
the current one is copied out, so the collectives run back to back while the
consumer loads. The layout (which collective, which slot, which view) is
computed once per (dtype, skip_static): a push only looks up the local shards.
Names are the base model's HF names: peft prefixes
and ``.base_layer`` are stripped, tied duplicates come once, and LoRA-wrapped
linears are merged on the fly (W + scale·B@A, the actor is never mutated).
Outputs that only depend on frozen parameters are marked static so the caller
can skip them once the engine holds them.

Left out: HSDP / 2-D meshes and non-dim-0 sharding take the slow per-parameter
``full_tensor()`` path, LoRA variants other than plain linear adapters (DoRA,
LoRA on embeddings/convolutions, lora_bias) are refused at set-up, and CPU
offload is the explicit ``offload``/``onload`` pair (FSDP2's always-on
``CPUOffloadPolicy`` trains on CPU-resident shards, which is not what a
colocated engine wants).
"""

from __future__ import annotations

import math
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from hybrid_rl.algorithms import entropy_from_logits, logprobs_from_logits
from hybrid_rl.batch import Batch, as_slice
from hybrid_rl.micro_batching import micro_batches

# Name segments that wrappers insert and the engine's (HF) names do not have.
_PEFT_ROOT = "base_model.model."
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", "base_layer.")


def _decoder_layer_classes(model: torch.nn.Module) -> set[str]:
    names = getattr(model, "_no_split_modules", None) or []
    return set(names)


def _compile_blocks(model: torch.nn.Module) -> int:
    """``torch.compile`` each decoder block's ``forward`` (dynamic shapes: one graph for every sequence length).

    Only the body is compiled: the module's hooks (FSDP2's gather and reshard, checkpointing) stay eager around
    it. Fewer, fused kernels for a loop that is launch-bound at small models; the first pass pays the compile.
    """
    layer_classes = _decoder_layer_classes(model)
    blocks = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not blocks:
        raise ValueError(f"actor.use_torch_compile: no decoder blocks found in {type(model).__name__} (its "
                         "_no_split_modules names none); set actor.use_torch_compile=false for this model")
    for block in blocks:
        block.forward = torch.compile(block.forward, dynamic=True)
    return len(blocks)


def engine_param_name(name: str) -> str:
    """The base model's parameter name for an actor parameter name (peft/FSDP/checkpoint wrappers removed)."""
    if name.startswith(_PEFT_ROOT):
        name = name[len(_PEFT_ROOT):]
    for seg in _WRAPPER_SEGMENTS:
        name = name.replace(seg, "")
    return name


# --------------------------------------------------------------------------- push plan
@dataclass
class _Output:
    """One tensor the engine receives: a copy of ``sources[0]``, or a LoRA merge of (W, A_1, B_1, A_2, B_2, ...)."""

    name: str
    sources: tuple[torch.nn.Parameter, ...]
    scales: tuple[float, ...] = ()
    """LoRA: one scaling per (A, B) pair; empty = plain copy."""
    fan_in_fan_out: bool = False
    static: bool = False
    """Every source is frozen: the value never changes during training."""

    @property
    def numel(self) -> int:
        return self.sources[0].numel()


def _lora_layers(model: torch.nn.Module) -> dict[int, tuple[torch.nn.Module, list[str]]]:
    """id(base weight) → (peft LoRA layer, active adapter names) for every LoRA-wrapped module."""
    try:
        from peft.tuners.lora.layer import Linear as LoraLinear, LoraLayer
    except ImportError:  # peft not installed: no LoRA layers possible
        return {}
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        unsupported = (not isinstance(module, LoraLinear) or any(module.use_dora.get(a, False) for a in adapters)
                       or any(getattr(module, "lora_bias", {}).get(a, False) for a in adapters)
                       or any(a in getattr(module, "lora_variant", {}) for a in adapters))
        if unsupported:
            raise NotImplementedError(f"LoRA on {name} ({type(module).__name__}): the weight push merges plain linear "
                                      "adapters only; restrict model.lora.target_modules to linear layers without DoRA")
        if module.merged:
            raise RuntimeError(f"{name}: adapters are merged into the base weight; unmerge them before training")
        out[id(module.base_layer.weight)] = (module, adapters)
    return out


def _owner_map(model: torch.nn.Module, fsdp: bool) -> dict[int, int]:
    """id(param) → index of its gather group: the innermost FSDP module (or decoder block) that holds it."""
    from torch.distributed.fsdp import FSDPModule

    layer_classes = _decoder_layer_classes(model)
    owners: dict[int, int] = {}
    for idx, module in enumerate(model.modules()):  # pre-order: inner modules overwrite outer ones
        if idx == 0 or (isinstance(module, FSDPModule) if fsdp else type(module).__name__ in layer_classes):
            for p in module.parameters():
                owners[id(p)] = idx
    return owners


def build_push_plan(model: torch.nn.Module, fsdp: bool) -> list[list[_Output]]:
    """The engine-facing outputs of ``model`` grouped by gather group, in module order."""
    lora = _lora_layers(model)
    adapter_ids = {id(m.lora_A[a].weight) for m, ads in lora.values() for a in ads}
    adapter_ids |= {id(m.lora_B[a].weight) for m, ads in lora.values() for a in ads}
    owners = _owner_map(model, fsdp)
    groups: dict[int, list[_Output]] = {}
    seen: set[str] = set()
    for name, p in model.named_parameters():  # dedups tied weights: the first name wins
        if id(p) in adapter_ids:
            continue
        out_name = engine_param_name(name)
        if id(p) in lora:
            module, adapters = lora[id(p)]
            sources = [p]
            for a in adapters:
                sources += [module.lora_A[a].weight, module.lora_B[a].weight]
            out = _Output(out_name, tuple(sources), tuple(float(module.scaling[a]) for a in adapters),
                          bool(module.fan_in_fan_out))
        else:
            out = _Output(out_name, (p,))
        out.static = not any(s.requires_grad for s in out.sources)
        if out_name in seen:
            raise RuntimeError(f"two actor parameters map to the engine name {out_name!r}")
        seen.add(out_name)
        groups.setdefault(owners.get(id(p), 0), []).append(out)
    return [groups[k] for k in sorted(groups)]


# --------------------------------------------------------------------------- gathering
def _fast_gather_group(p: torch.Tensor) -> dist.ProcessGroup | None:
    """The process group of a DTensor sharded FSDP2-style (1-D mesh, Shard(0), mesh order = group order), else None."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor) or p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),) or p.dim() == 0:
        return None
    group = p.device_mesh.get_group()
    if p.device_mesh.mesh.tolist() != dist.get_process_group_ranks(group):
        return None
    return group


# torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single; 2.11 only has the old name
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor. The push runs under no_grad, where ``to_local()`` is this attribute
    (minus a fresh view per call for DTensor parameters on newer torch)."""
    local = getattr(p, "_local_tensor", None)
    return local if local is not None else p.to_local()


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


@dataclass
class _Job:
    """One ``all_gather_into_tensor``: the dim-0 shards of several parameters, cast into one flat buffer per rank.

    Rank r sends, for every parameter in turn, a slot of ``chunk`` rows (torch.chunk's
    padded shard; only its own rows are written). The gathered buffer is rank-major
    [world, total]; one ``split_with_sizes_copy`` rewrites it parameter-major into a
    second buffer, and every full tensor is a view of that one (FSDP2's own copy-out).
    Built once per push layout: only the local tensors are looked up on each push.
    """

    group: dist.ProcessGroup | None
    """None for a world of one: the cast send buffer is already the full tensors."""
    dtype: torch.dtype
    params: list[torch.Tensor]
    slots: list[int]
    """Per-rank slot numel of each parameter (padded rows × row numel)."""
    world: int
    total: int
    out_views: list[tuple[tuple[int, ...], tuple[int, ...], int]]
    """(size, stride, offset) of each parameter's [world, slot] block in the copy-out buffer."""
    full_views: list[tuple[tuple[int, ...], tuple[int, ...], int]]
    """(size, stride, offset) of each full tensor in the copy-out buffer."""

    @classmethod
    def build(cls, group: dist.ProcessGroup, dtype: torch.dtype, params: list[torch.Tensor]) -> "_Job":
        ws = group.size()
        slots, out_views, full_views, base = [], [], [], 0
        for p in params:
            chunk = -(-p.shape[0] // ws)  # torch.chunk's (and FSDP2's) padded dim-0 shard size
            slot = chunk * math.prod(p.shape[1:])
            slots.append(slot)
            out_views.append(((ws, slot), (slot, 1), base))
            full_views.append((tuple(p.shape), _contiguous_strides(tuple(p.shape)), base))
            base += ws * slot
        return cls(group if ws > 1 else None, dtype, list(params), slots, ws, sum(slots), out_views, full_views)

    def launch(self) -> tuple[object, torch.Tensor, torch.Tensor]:
        """Cast this rank's shards into the send buffer and start the all-gather: (work or None, output, send)."""
        locals_ = [_local(p) for p in self.params]
        send = torch.empty(self.total, dtype=self.dtype, device=locals_[0].device)
        # each local shard goes to the head of its slot (uneven shards leave padding that is never read). One
        # _foreach_copy_ casts them all: on CUDA it is a fused multi-tensor kernel even across dtypes, where
        # _chunk_cat/cat fall back to one copy kernel per parameter once a cast is involved (profiled on H200:
        # 290 launches per 0.5B push)
        pieces = send.split_with_sizes(self.slots)
        pairs = [(d[:t.numel()], t.reshape(-1)) for d, t in zip(pieces, locals_) if t.numel()]
        if pairs:
            torch._foreach_copy_([d for d, _ in pairs], [t for _, t in pairs])
        if self.group is None:
            return None, send, send
        out = torch.empty(self.world * self.total, dtype=self.dtype, device=send.device)
        return _all_gather_single(out, send, group=self.group, async_op=True), out, send

    def full_tensors(self, out: torch.Tensor) -> dict[int, torch.Tensor]:
        """id(param) → its full tensor, from the gathered buffer (after the collective finished)."""
        if self.group is None:
            buf = out
        else:
            buf = torch.empty_like(out)
            torch.split_with_sizes_copy(out.view(self.world, self.total), self.slots, dim=1,
                                        out=[buf.as_strided(*v) for v in self.out_views])
        return {id(p): buf.as_strided(*v) for p, v in zip(self.params, self.full_views)}


@dataclass
class _Chunk:
    """Consecutive module groups gathered together: their outputs (yield order) and how to gather their sources."""

    outputs: list[_Output]
    jobs: list[_Job]
    direct: list[tuple[torch.Tensor, torch.dtype]]
    """Sources outside the fast path (plain tensors, other shardings): ``full_tensor()`` each."""


def _build_chunk(outputs: list[_Output], dtype: torch.dtype, adapter_dtype: torch.dtype) -> _Chunk:
    direct, fast, seen = [], {}, set()
    for o in outputs:
        for i, s in enumerate(o.sources):
            if id(s) in seen:
                continue
            seen.add(id(s))
            dt = dtype if i == 0 else adapter_dtype  # LoRA A/B are gathered in fp32 and merged there
            group = _fast_gather_group(s)
            if group is None:
                direct.append((s, dt))
            else:
                fast.setdefault((group, dt), []).append(s)
    jobs = [_Job.build(group, dt, params) for (group, dt), params in fast.items()]
    return _Chunk(outputs, jobs, direct)


def _coalesce(groups: list[list[_Output]], budget_bytes: int, esize: int) -> list[list[_Output]]:
    """Merge consecutive groups while their outputs stay within ``budget_bytes`` (a bigger group goes alone)."""
    merged: list[list[_Output]] = []
    size = 0
    for g in groups:
        nbytes = sum(o.numel for o in g) * esize
        if merged and size + nbytes <= budget_bytes:
            merged[-1] = merged[-1] + g
            size += nbytes
        else:
            merged.append(list(g))
            size = nbytes
    return merged


class _PendingGather:
    """One chunk's collectives in flight; ``wait`` returns id(source) → full tensor."""

    def __init__(self, chunk: _Chunk):
        self.full: dict[int, torch.Tensor] = {}
        for p, dt in chunk.direct:  # plain tensor, or a sharding the fast path does not know: correct and simple
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            self.full[id(p)] = full.to(dt)
        self.jobs = [(job, *job.launch()) for job in chunk.jobs]

    def wait(self) -> dict[int, torch.Tensor]:
        for job, work, out, _send in self.jobs:  # send stays referenced until its collective finished
            if work is not None:
                work.wait()
            self.full.update(job.full_tensors(out))
        self.jobs = []
        return self.full


def _materialise(out: _Output, full: dict[int, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    w = full[id(out.sources[0])]
    if not out.scales:
        return w
    # W + Σ scale·(B @ A), computed in fp32 from fp32 adapters, then cast once (peft's get_delta_weight order)
    merged = w.float()
    for i, scale in enumerate(out.scales):
        a, b = full[id(out.sources[1 + 2 * i])], full[id(out.sources[2 + 2 * i])]
        delta = (b.float() @ a.float()) * scale
        merged = merged + (delta.T if out.fan_in_fan_out else delta)
    return merged.to(dtype)


class TrainingEngine:
    def __init__(self, model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype, trainable: bool,
                 gradient_checkpointing: bool = False, accumulate_unsharded: bool = False, compile_blocks: bool = False):
        self.device = device
        self.accumulate_unsharded = accumulate_unsharded
        """Parameters stay gathered through a pass of micro-batches; gradients are reduced on the last one only."""
        self.compute_dtype = compute_dtype
        self.trainable = trainable
        self.fsdp = dist.is_initialized()
        if gradient_checkpointing and trainable:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x: the old name is deprecated
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()
        if not trainable:
            for p in model.parameters():
                p.requires_grad_(False)
        # Keep fp32 masters for training; the compute dtype is applied by FSDP's
        # mixed-precision policy (or autocast without FSDP).
        model.to(device=device, dtype=torch.float32 if trainable else compute_dtype)
        if compile_blocks:
            _compile_blocks(model)
        if self.fsdp:
            self._shard(model)
        self.model = model
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        # after sharding: the plan holds the (DTensor) parameters themselves
        self._push_plan = build_push_plan(model, self.fsdp)
        self.push_prefetch = True
        self._logits_to_keep = True
        self.push_gather_bytes = 256 * 2**20
        """Consecutive module groups are gathered in one collective up to this many bytes (engine dtype)."""
        self._gather_plans: dict[tuple, list[_Chunk]] = {}
        self.offload_device = torch.device("cpu")
        self.offload_copy = False
        """Copy on offload/onload even when the devices are equal (tests exercise the round trip on CPU)."""
        self.params_offloaded = False
        self._offloaded_opt_state: dict[tuple[int, str], torch.device] = {}
        """(id(param), state key) → the device it came from, for every optimizer tensor that was moved."""

    def _shard(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = None
        if self.compute_dtype != torch.float32:  # bf16 compute, fp32 masters and gradient reduction
            mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        from hybrid_rl.distributed import dp_group

        # An explicit mesh on the training device: without it fully_shard picks CUDA
        # whenever a GPU is visible, which breaks trainer.device=cpu on a GPU host.
        # Split placement shards over the trainer ranks only (the data-parallel group).
        group = dp_group()
        mesh = (DeviceMesh.from_group(group, self.device.type) if group is not None
                else init_device_mesh(self.device.type, (dist.get_world_size(),)))
        kwargs: dict = {"mesh": mesh}
        if self.accumulate_unsharded:  # otherwise torch's default (the root is not resharded after forward)
            kwargs["reshard_after_forward"] = False
        if mp is not None:
            kwargs["mp_policy"] = mp
        layer_classes = _decoder_layer_classes(model)
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)

    # -- optimisation -------------------------------------------------------------------
    def configure_optimizer(self, lr: float, betas: tuple[float, float], weight_decay: float, warmup_steps: int,
                            schedule: str, total_steps: int, min_lr_ratio: float) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)

        def lr_lambda(step: int) -> float:
            if warmup_steps > 0 and step < warmup_steps:
                return (step + 1) / warmup_steps
            if schedule == "constant" or total_steps <= warmup_steps:
                return 1.0
            progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda)

    def micro_batch_step(self, last: bool) -> None:
        """Before each backward of a gradient-accumulation loop: with ``accumulate_unsharded``, only the last
        micro-batch reduce-scatters the accumulated gradients and reshards the parameters."""
        if self.fsdp and self.accumulate_unsharded:
            self.model.set_requires_gradient_sync(last)
            self.model.set_reshard_after_backward(last)

    def reshard(self) -> None:
        """Free the gathered parameters a no-grad pass left behind (``accumulate_unsharded``; a no-op otherwise)."""
        if self.fsdp and self.accumulate_unsharded:
            from torch.distributed.fsdp import FSDPModule

            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, grad_clip: float) -> tuple[float, bool]:
        """Clip and step. Returns (grad_norm, stepped); a non-finite norm skips the step."""
        assert self.optimizer is not None and self.scheduler is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = grad_clip if grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        norm_value = float(norm)
        if not math.isfinite(norm_value):
            # no update taken, so the schedule does not advance either (as HF Trainer does on a skipped
            # step); stepping it here also made torch warn "lr_scheduler.step() before optimizer.step()"
            self.optimizer.zero_grad(set_to_none=True)
            return norm_value, False
        self.optimizer.step()
        self.scheduler.step()
        return norm_value, True

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer else 0.0

    # -- forward ------------------------------------------------------------------------
    def _autocast(self):
        if not self.fsdp and self.device.type == "cuda" and self.compute_dtype != torch.float32:
            return torch.autocast("cuda", dtype=self.compute_dtype)
        return nullcontext()

    def forward(self, micro: Batch, temperature: float, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of the response tokens of ``micro`` at ``temperature``: [b, R]."""
        t = micro.to(self.device).tensors
        responses = t["responses"]
        resp_len = responses.shape[1]
        kwargs = dict(input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"],
                      use_cache=False)
        with self._autocast():
            if self._logits_to_keep:
                # only the response positions go through the LM head (the prompt's logits are never used)
                try:
                    out = self.model(**kwargs, logits_to_keep=resp_len + 1)
                except TypeError:  # a remote-code model without the argument
                    self._logits_to_keep = False
            if not self._logits_to_keep:
                out = self.model(**kwargs)
        # logits at position i predict token i+1: the response tokens are predicted
        # by the R positions ending one before the last. They stay in the compute
        # dtype; the temperature and float32 are applied chunk by chunk inside.
        logits = out.logits[:, -resp_len - 1:-1, :]  # [b, R, V]
        log_probs = logprobs_from_logits(logits, responses, temperature)
        entropy = entropy_from_logits(logits, temperature) if with_entropy else None
        return log_probs, entropy

    @torch.no_grad()
    def compute_log_prob(self, batch: Batch, micro_batch_size: int, temperature: float, with_entropy: bool = False,
                         max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """No-grad log-probs [B, R] (0 past each response) in micro-batches of ``micro_batch_size`` or ``max_tokens``."""
        was_training = self.model.training
        self.model.eval()
        n, width = len(batch), batch.tensors["responses"].shape[1]
        lps = torch.zeros(n, width, device=self.device)
        ents = torch.zeros(n, width, device=self.device) if with_entropy else None
        try:
            for idx, micro in micro_batches(batch, micro_batch_size, max_tokens):
                lp, ent = self.forward(micro, temperature, with_entropy)
                rows = as_slice(idx) or torch.as_tensor(idx, device=self.device)
                lps[rows, :lp.shape[1]] = lp
                if ents is not None and ent is not None:
                    ents[rows, :ent.shape[1]] = ent
        finally:
            self.reshard()
        self.model.train(was_training)
        return lps, ents

    # -- weights ------------------------------------------------------------------------
    def push_names(self, skip_static: bool = False) -> list[tuple[str, int, bool]]:
        """(engine name, numel, static) of every tensor ``iter_full_params`` yields, in order."""
        return [(o.name, o.numel, o.static) for group in self._push_plan for o in group if not (skip_static and o.static)]

    def iter_full_params(self, dtype: torch.dtype | None = None, skip_static: bool = False,
                         prefetch: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(engine name, full tensor in ``dtype``) for every unique weight, a few module groups per collective.

        Consecutive module groups are merged up to ``self.push_gather_bytes`` and
        each merged chunk is one all-gather per (process group, dtype).
        ``skip_static`` leaves out outputs that depend only on frozen parameters
        (with LoRA: embeddings, norms, untargeted linears), and groups left empty
        are not gathered at all. With ``prefetch`` (default: ``self.push_prefetch``)
        the next chunk's all-gather is issued before the current chunk is copied
        out and handed over, so the collectives run back to back while the
        consumer copies, at the cost of one more chunk in memory. Every rank must
        iterate to the end (collectives).
        """
        dtype = dtype or self.compute_dtype
        prefetch = self.push_prefetch if prefetch is None else prefetch
        chunks = self._gather_chunks(dtype, skip_static)
        depth = 2 if prefetch else 1
        with torch.no_grad():
            pending: deque[_PendingGather] = deque()
            launched = 0
            try:
                for chunk in chunks:
                    while launched < len(chunks) and len(pending) < depth:
                        pending.append(_PendingGather(chunks[launched]))
                        launched += 1
                    full = pending.popleft().wait()
                    for o in chunk.outputs:
                        yield o.name, _materialise(o, full, dtype)
                    del full
            finally:
                for p in pending:  # an abandoned iteration must not leave a collective half-done
                    p.wait()

    def _gather_chunks(self, dtype: torch.dtype, skip_static: bool) -> list[_Chunk]:
        """The push layout for (dtype, skip_static): built once, since the sharding never changes."""
        key = (dtype, skip_static, self.push_gather_bytes)
        chunks = self._gather_plans.get(key)
        if chunks is None:
            groups = [[o for o in g if not (skip_static and o.static)] for g in self._push_plan]
            groups = [g for g in groups if g]
            adapter_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
            esize = torch.empty((), dtype=dtype).element_size()
            chunks = [_build_chunk(g, dtype, adapter_dtype) for g in _coalesce(groups, self.push_gather_bytes, esize)]
            self._gather_plans[key] = chunks
        return chunks

    # -- offload ------------------------------------------------------------------------
    def _move(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t.to(device, non_blocking=True, copy=self.offload_copy)

    @torch.no_grad()
    def offload(self, params: bool = True, optimizer: bool = True) -> None:
        """Move the sharded parameters (+ gradients) and/or the optimizer state to ``offload_device``."""
        if params and not self.params_offloaded:
            # nn.Module._apply swaps DTensor parameters in place (the optimizer's
            # references stay valid) and FSDP2's _apply re-registers the new shards.
            self.model._apply(lambda t: self._move(t, self.offload_device))
            self.params_offloaded = True
        if optimizer and self.optimizer is not None and not self._offloaded_opt_state:
            for p, state in self.optimizer.state.items():
                for key, value in state.items():
                    # Adam's scalar `step` already lives on CPU (non-capturable): leave it.
                    if isinstance(value, torch.Tensor) and (value.device != self.offload_device or self.offload_copy):
                        self._offloaded_opt_state[(id(p), key)] = value.device
                        state[key] = self._move(value, self.offload_device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # hand the freed blocks to the engine's allocator

    @property
    def optimizer_offloaded(self) -> bool:
        return bool(self._offloaded_opt_state)

    @torch.no_grad()
    def onload(self) -> None:
        """Undo ``offload``: everything that was moved comes back to ``device``."""
        if self.params_offloaded:
            self.model._apply(lambda t: self._move(t, self.device))
            self.params_offloaded = False
        if self._offloaded_opt_state and self.optimizer is not None:
            for p, state in self.optimizer.state.items():
                for key, value in state.items():
                    home = self._offloaded_opt_state.get((id(p), key))
                    if home is not None:
                        state[key] = self._move(value, home)
            self._offloaded_opt_state.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# --------------------------------------------------------------------------- reference
class FrozenReference:
    """Full fine-tuning's reference policy: a frozen (FSDP2) copy, optionally parked on CPU between uses."""

    def __init__(self, engine: TrainingEngine, offload: bool = False):
        self.engine = engine
        self.offload = offload
        if offload:
            engine.offload(params=True, optimizer=False)

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    def compute_log_prob(self, batch: Batch, micro_batch_size: int, temperature: float, with_entropy: bool = False,
                         max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.offload:
            self.engine.onload()
        try:
            return self.engine.compute_log_prob(batch, micro_batch_size, temperature, with_entropy, max_tokens)
        finally:
            if self.offload:
                self.engine.offload(params=True, optimizer=False)


class AdapterDisabledReference:
    """LoRA's reference policy: the actor itself with its adapters switched off (no second copy)."""

    def __init__(self, actor: TrainingEngine):
        if not hasattr(actor.model, "disable_adapter"):
            raise TypeError("AdapterDisabledReference needs a peft model (model.lora.rank > 0)")
        self.actor = actor

    @property
    def model(self) -> torch.nn.Module:
        return self.actor.model

    def compute_log_prob(self, batch: Batch, micro_batch_size: int, temperature: float, with_entropy: bool = False,
                         max_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        trainable = [p for p in self.actor.model.parameters() if p.requires_grad]
        with self.actor.model.disable_adapter():
            # peft's disable_adapter also sets requires_grad=False on the adapters. Were this the model's first forward,
            # FSDP2's lazy init would see no trainable parameters and skip the fp32 gradient reduction for good
            # (bf16 grads for fp32 masters, an error at the first backward). Disabling works through peft's flag alone.
            for p in trainable:
                p.requires_grad_(True)
            return self.actor.compute_log_prob(batch, micro_batch_size, temperature, with_entropy, max_tokens)
