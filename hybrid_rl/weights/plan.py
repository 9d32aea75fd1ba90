"""The weight push plan: stream the actor's full tensors out of FSDP2 a few module groups per collective.

The sharding manager (and split placement's broadcast) need every weight as a
full tensor in the engine's dtype and under the base model's HF name, without
the full state dict ever existing at once. ``PushPlan`` works that out once per
model: the model is cut into gather groups (decoder blocks, or the root's
embeddings + final norm); consecutive groups are merged up to a byte budget,
every rank casts its local dim-0 shards of the merged chunk to the engine dtype
into one flat buffer (one ``_foreach_copy_``) and a single
``all_gather_into_tensor`` brings it over; one ``split_with_sizes_copy`` lays it
out parameter-major and every full tensor is a view of that buffer. The next
chunk's gather is issued before the current one is copied out, so the
collectives run back to back while the consumer loads. The layout (which
collective, which slot, which view) is computed once per (dtype, skip_static,
budget): a push only looks up the local shards. Names are the base model's HF
names: peft prefixes and ``.base_layer`` are stripped, tied duplicates come
once, and LoRA-wrapped linears are merged on the fly (W + scale·B@A, the actor
is never mutated). Outputs that only depend on frozen parameters are marked
static so the caller can skip them once the engine holds them.

``TrainingEngine.iter_full_params`` is the thin entry point (the sharding
manager's ``WeightSource`` protocol calls it); this module knows nothing about
optimizers, losses or rollout engines.

Left out: HSDP / 2-D meshes and non-dim-0 sharding take the slow per-parameter
``full_tensor()`` path, and LoRA variants other than plain linear adapters
(DoRA, LoRA on embeddings/convolutions, lora_bias) are refused at set-up.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

# Name segments that wrappers insert and the engine's (HF) names do not have.
_PEFT_ROOT = "base_model.model."
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", "base_layer.")


def decoder_layer_classes(model: torch.nn.Module) -> set[str]:
    """Class names of the model's decoder blocks (HF's ``_no_split_modules``): the FSDP units and gather groups."""
    names = getattr(model, "_no_split_modules", None) or []
    return set(names)


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

    layer_classes = decoder_layer_classes(model)
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



# --------------------------------------------------------------------------- the plan
class PushPlan:
    """One model's push: its outputs by gather group, and the gather chunks per (dtype, skip_static, budget).

    Built after sharding (it holds the DTensor parameters themselves); the chunk
    layouts are built on first use and kept, since the sharding never changes.
    """

    def __init__(self, model: torch.nn.Module, fsdp: bool):
        self.groups = build_push_plan(model, fsdp)
        self._chunks: dict[tuple, list[_Chunk]] = {}

    def names(self, skip_static: bool = False) -> list[tuple[str, int, bool]]:
        """(engine name, numel, static) of every tensor ``iter_full_params`` yields, in order."""
        return [(o.name, o.numel, o.static) for group in self.groups for o in group if not (skip_static and o.static)]

    def chunks(self, dtype: torch.dtype, skip_static: bool, gather_bytes: int) -> list[_Chunk]:
        """The push layout for (dtype, skip_static, gather_bytes): built once."""
        key = (dtype, skip_static, gather_bytes)
        chunks = self._chunks.get(key)
        if chunks is None:
            groups = [[o for o in g if not (skip_static and o.static)] for g in self.groups]
            groups = [g for g in groups if g]
            adapter_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
            esize = torch.empty((), dtype=dtype).element_size()
            chunks = [_build_chunk(g, dtype, adapter_dtype) for g in _coalesce(groups, gather_bytes, esize)]
            self._chunks[key] = chunks
        return chunks

    def iter_full_params(self, dtype: torch.dtype, skip_static: bool, prefetch: bool,
                         gather_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(engine name, full tensor in ``dtype``) for every unique weight, a few module groups per collective.

        Consecutive module groups are merged up to ``gather_bytes`` and each
        merged chunk is one all-gather per (process group, dtype). ``skip_static``
        leaves out outputs that depend only on frozen parameters (with LoRA:
        embeddings, norms, untargeted linears), and groups left empty are not
        gathered at all. With ``prefetch`` the next chunk's all-gather is issued
        before the current chunk is copied out and handed over, so the
        collectives run back to back while the consumer copies, at the cost of
        one more chunk in memory. Every rank must iterate to the end (collectives).
        """
        chunks = self.chunks(dtype, skip_static, gather_bytes)
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
