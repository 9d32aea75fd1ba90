"""The training engine: one model, FSDP2-sharded when a process group exists, plus its optimizer.

Narrow on purpose (verl's newer ``engine/base.py`` shape): ``forward`` for
log-probs/entropy of response tokens, ``compute_log_prob`` for no-grad passes
in micro-batches, ``backward``/``optimizer_step`` for training,
``iter_full_params`` for the sharding manager and ``offload``/``onload`` for
handing the GPU to the rollout engine. It knows nothing about PPO; the worker
composes losses on top. With ``torch.distributed`` initialised the model is
wrapped with ``fully_shard`` per decoder block and at the root (bf16 compute,
fp32 gradient reduction on GPU); a world of one without a process group runs
the plain module, with bf16 autocast on GPU. Sharded over more than one rank,
the model is sharded empty and its shards filled from the group's first rank,
the only one that loaded the weights (``hybrid_rl.workers.materialize``).

The weight push (``iter_full_params``) is planned and run by
``hybrid_rl.weights.plan.PushPlan`` (a few FSDP module groups per all-gather,
LoRA merged on the fly, HF names); the engine only holds the plan and its two
knobs, ``push_gather_bytes`` and ``push_prefetch``.

Left out: CPU offload is the explicit ``offload``/``onload`` pair (FSDP2's always-on
``CPUOffloadPolicy`` trains on CPU-resident shards, which is not what a
colocated engine wants).
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
import torch.distributed as dist

from hybrid_rl.algorithms import entropy_from_logits, logprobs_from_logits
from hybrid_rl.batch import Batch, row_index
from hybrid_rl.micro_batching import HOST_META, micro_batches
from hybrid_rl.telemetry.perf import Work
from hybrid_rl.workers.materialize import load_from_first_rank, shared_over_ranks, take_weights
from hybrid_rl.workers.offload import HostMirror, local
from hybrid_rl.workers.packed import (Packed, logprob_head, pack, pack_shared, split_head_output, unpack,
                                      use_varlen_attention)
from hybrid_rl.workers.ulysses import SequenceParallel, ShardedRow, shard
from hybrid_rl.weights.plan import PushPlan, decoder_layer_classes

IMPLS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for_loop": dict(foreach=False)}
"""``optimizer_impl`` → ``torch.optim.AdamW``'s keyword."""


def _compile_blocks(model: torch.nn.Module) -> int:
    """``torch.compile`` each decoder block's ``forward`` (dynamic shapes: one graph for every sequence length).

    Only the body is compiled: the module's hooks (FSDP2's gather and reshard, checkpointing) stay eager around
    it. Fewer, fused kernels for a loop that is launch-bound at small models; the first pass pays the compile.
    """
    layer_classes = decoder_layer_classes(model)
    blocks = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not blocks:
        raise ValueError(f"actor.use_torch_compile: no decoder blocks found in {type(model).__name__} (its "
                         "_no_split_modules names none); set actor.use_torch_compile=false for this model")
    for block in blocks:
        block.forward = torch.compile(block.forward, dynamic=True)
    return len(blocks)


class TrainingEngine:
    def __init__(self, model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype, trainable: bool,
                 gradient_checkpointing: bool = False, accumulate_unsharded: bool = False, compile_blocks: bool = False,
                 group=None, remove_padding: bool = False, fused_logprob: bool = False, share_prompts: bool = False,
                 sp: SequenceParallel | None = None, frozen_dtype: torch.dtype | None = None):
        self.device = device
        self.sp = sp or SequenceParallel()
        """Ulysses sequence parallelism: each packed row is cut in slices over ``sp.group`` (``workers/ulysses.py``)."""
        if self.sp.size > 1 and not remove_padding:
            raise ValueError("sequence parallelism cuts packed rows: it needs use_remove_padding=true")
        self.remove_padding = remove_padding
        """Every forward packs its micro-batch into one row without padding (``hybrid_rl.workers.packed``)."""
        self.share_prompts = share_prompts
        """Packed rows hold each distinct prompt once, its responses attending to that copy (``pack_shared``)."""
        self.packed_tokens = [0, 0]
        """(tokens the packed forwards ran, tokens of their micro-batches): with ``share_prompts`` the first is less;
        the update reports the ratio as ``perf/update_token_share``."""
        self.work = Work()
        """What the forwards computed since the worker last reset it (tokens, attention pairs, LM-head rows), for
        ``perf/mfu_*``; the worker reads it per pass."""
        self.fused_logprob = fused_logprob
        """Log-probs and entropy come from the LM head in row chunks; the [tokens × vocabulary] logits never exist."""
        self.group = group
        """The data-parallel process group the model is sharded over (None = the world)."""
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
        dtype: torch.dtype | None = torch.float32 if trainable else compute_dtype
        if trainable and frozen_dtype is not None and self.fsdp:
            # LoRA's frozen base: FSDP2 casts every parameter to the compute dtype for each pass (its mixed-precision
            # policy), so a frozen one kept in that dtype computes the same in fewer bytes
            model.to(dtype=dtype)
            for p in model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(frozen_dtype)
            dtype = None  # each parameter in its own dtype from here
        # Sharded over several ranks, the weights are the group's first rank's, loaded into the shards after
        # sharding (``workers/materialize.py``); what the other ranks passed in (an empty model on meta) is not read.
        from_first_rank = self.fsdp and shared_over_ranks(group)
        if from_first_rank:
            weights = take_weights(model.to(dtype=dtype) if dtype is not None else model, group)
        else:
            model.to(device=device, dtype=dtype)
        if remove_padding:
            use_varlen_attention(model)
        if compile_blocks:
            _compile_blocks(model)
        if self.fsdp:
            self._shard(model)
        if from_first_rank:
            load_from_first_rank(model, weights, device, group)
            del weights
        self.model = model
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        # after sharding: the plan holds the (DTensor) parameters themselves
        self._push_plan = PushPlan(model, self.fsdp)
        self.push_prefetch = True
        self._logits_to_keep = True
        self.push_gather_bytes = 256 * 2**20
        """Consecutive module groups are gathered in one collective up to this many bytes (engine dtype)."""
        self._host = {"params": HostMirror(device), "optimizer": HostMirror(device)}
        """Where ``offload`` puts the parameters (+ gradients) and the optimizer state (``workers/offload.py``)."""

    def _shard(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = None
        if self.compute_dtype != torch.float32:  # bf16 compute, fp32 masters and gradient reduction
            mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        # An explicit mesh on the training device: without it fully_shard picks CUDA
        # whenever a GPU is visible, which breaks trainer.device=cpu on a GPU host.
        # Split placement shards over the trainer ranks only (the data-parallel group).
        group = self.group
        mesh = (DeviceMesh.from_group(group, self.device.type) if group is not None
                else init_device_mesh(self.device.type, (dist.get_world_size(),)))
        kwargs: dict = {"mesh": mesh}
        if self.accumulate_unsharded:  # otherwise torch's default (the root is not resharded after forward)
            kwargs["reshard_after_forward"] = False
        if mp is not None:
            kwargs["mp_policy"] = mp
        layer_classes = decoder_layer_classes(model)
        for module in model.modules():
            if type(module).__name__ in layer_classes:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)

    # -- optimisation -------------------------------------------------------------------
    def configure_optimizer(self, lr: float, betas: tuple[float, float], weight_decay: float, warmup_steps: int,
                            schedule: str, total_steps: int, min_lr_ratio: float, impl: str = "fused") -> None:
        """AdamW over the trainable parameters (``impl``: ``fused``, ``foreach`` or ``for_loop``, the config's
        ``optimizer_impl``) under a warm-up-then-constant-or-cosine schedule."""
        if impl not in IMPLS:
            raise ValueError(f"optimizer implementation {impl!r}: choose from {', '.join(IMPLS)}")
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, **IMPLS[impl])

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

    def reshard(self, always: bool = False) -> None:
        """Free the gathered parameters a no-grad pass left behind: with ``accumulate_unsharded`` every block's, and
        with ``always`` also the root's (FSDP2 keeps the root's gathered after a forward, for a backward that a
        no-grad pass never runs: its embedding, final norm and LM head)."""
        if self.fsdp and (always or self.accumulate_unsharded):
            from torch.distributed.fsdp import FSDPModule

            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def zero_grad(self) -> None:
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, grad_clip: float) -> tuple[float, bool]:
        """Clip and step. Returns (grad_norm, stepped); a non-finite norm skips the step.

        Either way the gradients are freed (set to None) before returning: they are held only
        from the mini-batch's first backward to its step, not through the phases that follow."""
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
        self.optimizer.zero_grad(set_to_none=True)
        return norm_value, True

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer else 0.0

    # -- forward ------------------------------------------------------------------------
    def autocast(self):
        """Autocast to the compute dtype for a plain (unsharded) module on CUDA; FSDP2 casts by its own policy."""
        if not self.fsdp and self.device.type == "cuda" and self.compute_dtype != torch.float32:
            return torch.autocast("cuda", dtype=self.compute_dtype)
        return nullcontext()

    def forward(self, micro: Batch, temperature: float, with_entropy: bool = False,
                entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of the response tokens of ``micro`` at ``temperature``: [b, R], float32.
        ``entropy_grad=False``: the entropy is for metrics only, and the fused head's backward skips it."""
        t = micro.to(self.device).tensors
        if self.remove_padding:
            return self._forward_packed(t, temperature, with_entropy, entropy_grad, micro.meta.get(HOST_META))
        responses = t["responses"]
        resp_len = responses.shape[1]
        kwargs = dict(input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"],
                      use_cache=False)
        mask = t["attention_mask"]  # the work counted: real tokens only (a left-padded prompt and right-padded
        lengths = mask.sum(1)  # response are contiguous and causal); the LM head's real rows are added below
        self.work.add(Work(lengths.sum(), (lengths * (lengths + 1) // 2).sum()))
        if self.fused_logprob:
            # the R positions ending one before the last predict the response tokens
            width = t["input_ids"].shape[1]
            keep = torch.arange(width - resp_len - 1, width - 1, device=self.device)
            self.work.head_rows += mask[:, keep].sum()
            with self.autocast(), logprob_head(self.model, responses.reshape(-1), temperature, with_entropy,
                                                entropy_grad):
                out = self._call(kwargs, keep)
            lp, ent = split_head_output(out.logits)
            return lp.view_as(responses), ent.view_as(responses) if with_entropy else None
        with self.autocast():
            if self._logits_to_keep:
                # only the response positions go through the LM head (the prompt's logits are never used)
                try:
                    out = self.model(**kwargs, logits_to_keep=resp_len + 1)
                except TypeError:  # a remote-code model without the argument
                    self._logits_to_keep = False
            if not self._logits_to_keep:
                out = self.model(**kwargs)
        self.work.head_rows += mask[:, -resp_len - 1:].sum() if self._logits_to_keep else lengths.sum()
        # logits at position i predict token i+1: the response tokens are predicted
        # by the R positions ending one before the last. They stay in the compute
        # dtype; the temperature and float32 are applied chunk by chunk inside.
        logits = out.logits[:, -resp_len - 1:-1, :]  # [b, R, V]
        log_probs = logprobs_from_logits(logits, responses, temperature)
        entropy = entropy_from_logits(logits, temperature) if with_entropy else None
        return log_probs, entropy

    def _call(self, kwargs: dict, keep: torch.Tensor):
        """The model on ``kwargs`` with only the ``keep`` positions going through the LM head."""
        try:
            return self.model(**kwargs, logits_to_keep=keep)
        except TypeError as e:
            if "logits_to_keep" not in str(e):
                raise
            raise ValueError(f"{type(self.model).__name__} has no logits_to_keep argument (a remote-code model?): set "
                             "actor.use_remove_padding=false and actor.fused_logprob=false for it") from e

    def packed_inputs(self, t: dict[str, torch.Tensor], host: dict[str, torch.Tensor] | None = None
                      ) -> tuple[Packed, ShardedRow | None, dict]:
        """The micro-batch ``t`` packed into one row (``host``: its mask and ids already on the host), this rank's
        slice of it under sequence parallelism (None without), and the model's keyword arguments for that row. The
        positions whose outputs are wanted are ``row.keep`` (sliced) or ``packed.keep``; ``row.gather`` then
        ``unpack`` bring per-position results back to [b, R]. Counts the forward's work in ``self.work``."""
        p = pack_shared(t, host) if self.share_prompts else pack(t, host)
        self.packed_tokens[0] += p.input_ids.shape[1]
        self.packed_tokens[1] += p.shared.tokens_unshared if p.shared is not None else p.input_ids.shape[1]
        work = p.work
        if self.sp.size > 1:  # the group shares the row's work
            work = Work(*(x / self.sp.size for x in (work.tokens, work.attn_pairs, work.head_rows)))
        self.work.add(work)
        row = shard(p, self.sp) if self.sp.size > 1 else None
        ids, positions = (row.input_ids, row.position_ids) if row is not None else (p.input_ids, p.position_ids)
        kwargs = dict(input_ids=ids, position_ids=positions, use_cache=False, hybrid_cu_seqlens=p.cu_seqlens,
                      hybrid_max_seqlen=p.max_seqlen)
        if p.shared is not None:
            kwargs["hybrid_shared"] = p.shared
        if row is not None:
            kwargs["hybrid_sp"] = row
        return p, row, kwargs

    def _forward_packed(self, t: dict[str, torch.Tensor], temperature: float, with_entropy: bool,
                        entropy_grad: bool = True, host: dict[str, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward`` on the micro-batch packed into one row: only real tokens pass through the model (``host``: the
        micro-batch's mask and ids already on the host, see ``micro_batching.HOST_META``)."""
        p, row, kwargs = self.packed_inputs(t, host)
        keep, targets = (row.keep, row.targets) if row is not None else (p.keep, p.targets)
        with self.autocast():
            if self.fused_logprob:
                with logprob_head(self.model, targets, temperature, with_entropy, entropy_grad):
                    lp, ent = split_head_output(self._call(kwargs, keep).logits)
            else:
                logits = self._call(kwargs, keep).logits  # [1, n, V]
                lp = logprobs_from_logits(logits, targets[None], temperature)[0]
                ent = entropy_from_logits(logits, temperature)[0] if with_entropy else None
        if row is not None:  # every rank of the group: the whole row's values
            lp, ent = row.gather(lp), row.gather(ent) if ent is not None else None
        return unpack(lp, p), unpack(ent, p) if with_entropy else None

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
            for idx, micro in micro_batches(batch, micro_batch_size, max_tokens, self.group, self.remove_padding,
                                            self.share_prompts):
                lp, ent = self.forward(micro, temperature, with_entropy)
                rows = row_index(idx, self.device)
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
        return self._push_plan.names(skip_static)

    def iter_full_params(self, dtype: torch.dtype | None = None, skip_static: bool = False,
                         prefetch: bool | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(engine name, full tensor in ``dtype``, default the compute dtype) for every unique weight.

        ``skip_static`` leaves out outputs that depend only on frozen parameters;
        ``prefetch`` (default ``self.push_prefetch``) overlaps the next chunk's
        all-gather with handing out the current one. Every rank must iterate to
        the end (collectives). See ``hybrid_rl.weights.plan.PushPlan``.
        """
        yield from self._push_plan.iter_full_params(dtype or self.compute_dtype, skip_static,
                                                    self.push_prefetch if prefetch is None else prefetch,
                                                    self.push_gather_bytes)

    # -- offload ------------------------------------------------------------------------
    @torch.no_grad()
    def offload(self, params: bool = True, optimizer: bool = True) -> None:
        """The sharded parameters (+ any gradients, None after ``optimizer_step``) and/or the optimizer state to host
        memory, in place (``HostMirror``: the tensors stay, their device storage is freed)."""
        if params:
            self.reshard(always=True)  # the sharded parameters are the ones to offload, and the only ones kept
            for p in self.model.parameters():
                s = p.untyped_storage() if local(p) is p else None  # (FSDP2's shards are its own allocations)
                if s is not None and s.nbytes() and not s.resizable():  # memory-mapped from the checkpoint file
                    p.data = p.data.clone()  # (an unsharded model on CPU): a copy of its own, which it can give up
            self._host["params"].offload(t for p in self.model.parameters() for t in (p, p.grad))
        if optimizer and self.optimizer is not None:
            self._host["optimizer"].offload(v for state in self.optimizer.state.values() for v in state.values()
                                            if isinstance(v, torch.Tensor) and v.device == self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks to the engine's allocator

    @property
    def params_offloaded(self) -> bool:
        return self._host["params"].offloaded

    @property
    def optimizer_offloaded(self) -> bool:
        return self._host["optimizer"].offloaded

    @torch.no_grad()
    def onload(self, params: bool = True, optimizer: bool = True) -> None:
        """Undo ``offload``: what was offloaded (of the parameters and/or the optimizer state) is back on ``device``."""
        if params:
            self._host["params"].onload()
        if optimizer:
            self._host["optimizer"].onload()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def optimizer_on_device(self, offload_after: bool = True) -> Iterator[None]:
        """The optimizer state on ``device`` for the block (an update's steps); back in host memory after it
        when ``offload_after`` (``optimizer_offload``: the state is on the GPU only while the update runs)."""
        self.onload(params=False, optimizer=True)
        try:
            yield
        finally:
            if offload_after:
                self.offload(params=False, optimizer=True)


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
    def engine(self) -> TrainingEngine:
        """The engine its passes run on (the actor's)."""
        return self.actor

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
