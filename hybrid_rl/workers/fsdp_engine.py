"""The training engine: one model, FSDP2-sharded when a process group exists, plus its optimizer.

Narrow on purpose (verl's newer ``engine/base.py`` shape): ``forward`` for
log-probs/entropy of response tokens, ``compute_log_prob`` for no-grad passes
in micro-batches, ``backward``/``optimizer_step`` for training, and
``iter_full_params`` for the sharding manager. It knows nothing about PPO;
the worker composes losses on top. With ``torch.distributed`` initialised the
model is wrapped with ``fully_shard`` per decoder block and at the root
(bf16 compute, fp32 gradient reduction on GPU); a world of one without a
process group runs the plain module, with bf16 autocast on GPU.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Iterator

import torch
import torch.distributed as dist

from hybrid_rl.algorithms import entropy_from_logits, logprobs_from_logits
from hybrid_rl.batch import Batch


def _decoder_layer_classes(model: torch.nn.Module) -> set[str]:
    names = getattr(model, "_no_split_modules", None) or []
    return set(names)


class TrainingEngine:
    def __init__(self, model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype, trainable: bool,
                 gradient_checkpointing: bool = False):
        self.device = device
        self.compute_dtype = compute_dtype
        self.trainable = trainable
        self.fsdp = dist.is_initialized()
        if gradient_checkpointing and trainable:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()
        if not trainable:
            for p in model.parameters():
                p.requires_grad_(False)
        # Keep fp32 masters for training; the compute dtype is applied by FSDP's
        # mixed-precision policy (or autocast without FSDP).
        model.to(device=device, dtype=torch.float32 if trainable else compute_dtype)
        if self.fsdp:
            self._shard(model)
        self.model = model
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None

    def _shard(self, model: torch.nn.Module) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = None
        if self.device.type == "cuda" and self.compute_dtype != torch.float32:
            mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        kwargs = {"mp_policy": mp} if mp is not None else {}
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
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
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
        with self._autocast():
            out = self.model(input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"], use_cache=False)
        # logits at position i predict token i+1: the response tokens are predicted
        # by the R positions ending one before the last.
        logits = out.logits[:, -resp_len - 1:-1, :].float() / temperature  # [b, R, V]
        log_probs = logprobs_from_logits(logits, responses)
        entropy = entropy_from_logits(logits) if with_entropy else None
        return log_probs, entropy

    @torch.no_grad()
    def compute_log_prob(self, batch: Batch, micro_batch_size: int, temperature: float,
                         with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        was_training = self.model.training
        self.model.eval()
        lps, ents = [], []
        for micro in batch.split(micro_batch_size):
            lp, ent = self.forward(micro, temperature, with_entropy)
            lps.append(lp)
            if ent is not None:
                ents.append(ent)
        self.model.train(was_training)
        return torch.cat(lps), (torch.cat(ents) if ents else None)

    # -- weights ------------------------------------------------------------------------
    def iter_full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every unique parameter, gathered from shards one at a time."""
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            yield name, (full.to(dtype) if dtype is not None else full)
