"""``UpdateConfig``: the settings every trained role's update shares (``actor.*`` and ``critic.*``).

The actor and the critic each train with AdamW under a warm-up-then-constant-or-cosine LR schedule, over ``ppo_epochs``
passes of mini-batches of ``ppo_mini_batch_size`` prompts cut into micro-batches, and can offload their state
between phases. These keys are spelt the same in both sections and checked by one ``validate_update``; what differs
(the actor's policy loss and log-prob passes, the critic's value head and clipping) is each section's own. The batch
geometry these keys make is ``geometry.py``'s. Left out: other optimisers (AdamW is the only one the engines build).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hybrid_rl.config.errors import ConfigError, require_positive
from hybrid_rl.config.fields import harmless

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@dataclass
class UpdateConfig:
    lr: float = 1e-6
    """AdamW peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    lr_warmup_steps: int = 0
    """Linear LR warm-up, in this role's optimizer steps."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """LR schedule after warm-up."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of ``lr``."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    ppo_mini_batch_size: int = 16
    """Prompts per optimizer step, across all ranks (each brings ``rollout.n`` samples)."""
    ppo_micro_batch_size_per_device: int = harmless(8)
    """Sequences per forward/backward on one device (gradient accumulation fills the mini-batch); unused with
    ``use_dynamic_bsz``, whose token budget cuts the micro-batches instead."""
    use_dynamic_bsz: bool = harmless(False)
    """Cut this role's micro-batches by a token budget (``max_token_len_per_device``) instead of a sequence count, in
    every pass."""
    max_token_len_per_device: int = harmless(16384)
    """Token budget of one micro-batch with ``use_dynamic_bsz`` (prompt + response: real tokens where the role packs,
    else padded)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How the per-token losses are averaged."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 = off)."""
    param_offload: bool = harmless(False)
    """Move this role's parameters (and gradients) to CPU between its phases (e.g. while the engine generates)."""
    optimizer_offload: bool = harmless(False)
    """Keep this role's AdamW state on CPU except while it is needed: the actor's for its update alone (generation,
    the push and the log-prob passes run without it; ``timing/optimizer_onload`` / ``_offload`` time the moves), the
    critic's from its value pass to the end of its update."""
    optimizer_impl: Literal["fused", "foreach", "for_loop"] = harmless("fused")
    """``torch.optim.AdamW``'s kernels: ``fused`` updates every tensor in a few kernels without temporaries (as HF
    Trainer's and torchtitan's default); ``foreach`` holds a copy of the second-moment state (4 bytes per trainable
    parameter on each rank) through the step; ``for_loop`` one tensor at a time, a tensor's copy at most. Same update
    up to rounding."""

    def validate_update(self, section: str) -> None:
        """The shared keys' checks; errors name ``<section>.<key>``."""
        require_positive(self, section, ["ppo_mini_batch_size", "ppo_micro_batch_size_per_device", "ppo_epochs"])
        if self.lr_warmup_steps < 0:
            raise ConfigError(f"{section}.lr_warmup_steps={self.lr_warmup_steps} must be >= 0")
        if len(self.betas) != 2:
            raise ConfigError(f"{section}.betas must hold two numbers, got {self.betas}")
