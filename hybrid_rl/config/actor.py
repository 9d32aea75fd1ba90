"""The ``actor``, ``ref`` and ``critic`` sections: the trained policy, its frozen reference, and the value model.

The actor and the critic share their optimiser, schedule, mini/micro-batch and offload keys (``UpdateConfig``,
``update.py``); each section adds its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from hybrid_rl.config.errors import ConfigError, require_positive
from hybrid_rl.config.fields import harmless
from hybrid_rl.config.update import UpdateConfig


@dataclass
class ActorConfig(UpdateConfig):
    log_prob_micro_batch_size_per_device: int = harmless(16)
    """Sequences per forward when computing log-probs (unused with ``use_dynamic_bsz``, as the update's)."""
    use_remove_padding: Optional[bool] = harmless(None)
    """Pack each micro-batch's sequences into one row without padding (per-sequence positions, attention that never
    crosses sequences: flash-attention varlen on CUDA, one SDPA call per sequence elsewhere); token budgets count real
    tokens. Also used by the reference policy. Default (null): on for CUDA with a 16-bit ``model.dtype`` (PyTorch's
    flash-attention varlen kernel); off on CPU and for float32 models, whose packed attention runs one SDPA call per
    sequence and costs more than the padding it saves (the CPU recipe's update: 0.9 s packed vs 0.3 s padded; on CUDA
    thousands of small kernel launches a step for its 1,024 short sequences)."""
    fused_logprob: Optional[bool] = harmless(None)
    """Log-probs and entropy straight from the last hidden states and the LM head, in row chunks recomputed in
    backward: the [tokens × vocabulary] logits are never materialised (the reference policy too). Default (null): on
    for CUDA, off on CPU (a small vocabulary gains nothing there and the recomputation costs)."""
    share_prompts: Optional[bool] = harmless(None)
    """With ``use_remove_padding``: each distinct prompt of a micro-batch passes through the model once and its
    responses attend to that one copy (``workers/packed.py``'s ``pack_shared``), in the actor's passes and the
    reference's. Exact (a prompt never sees its responses); with GRPO's n samples per prompt it removes (n-1)/n of the
    prompt tokens from every training pass (GSM8K, n=8: about half of all tokens). ``perf/mfu_*`` count the FLOPs the
    shared passes run; ``perf/mfu_*_equiv`` count every sample's sequence on its own (the work the unshared passes
    do), and ``perf/update_token_share`` is the update's tokens run per token of the batch. Default (null): on
    wherever the run packs by default (4xH200, flagship shapes, no recomputation: update 7.3 -> 5.4 s, log-prob 2.1 ->
    1.5 s), off on CPU."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence parallelism: groups of this many consecutive ranks hold the same rows, and each packed row of
    the actor's and the reference's passes is cut in that many slices, one per rank; attention exchanges slices for
    heads (all-to-all) around it, so every rank keeps 1/size of the activations (``workers/ulysses.py``). For long
    responses whose activations do not fit one GPU. Needs ``use_remove_padding=true``; must divide the training ranks
    and the model's attention heads. The update is that of size 1 on the same batch; the batch geometry
    (``ppo_mini_batch_size``) divides across ranks / size. A packing critic cuts its rows the same way
    (``critic.use_remove_padding``)."""
    use_torch_compile: bool = harmless(False)
    """``torch.compile`` each decoder block's forward (dynamic shapes) in the actor: fused kernels for a loop that is
    launch-bound (small models, many micro-batches); the first pass of each mode (train/eval) pays the compile."""
    accumulate_unsharded: bool = harmless(False)
    """FSDP2: keep the parameters gathered and the gradients unreduced across the micro-batches of a pass, so a
    mini-batch costs one all-gather and one reduce-scatter per block instead of two all-gathers and one
    reduce-scatter per micro-batch (``reshard_after_forward=False``; gradient sync and resharding on the last
    micro-batch only). The reference policy's pass keeps its blocks gathered likewise. Costs a full compute-dtype
    copy of the parameters and full fp32 gradients per GPU during a pass: right for small models and many
    micro-batches, wrong where sharding is what makes the model fit."""
    policy_loss: str = "auto"
    """The actor's loss, a name in ``hybrid_rl.algorithms.POLICY_LOSSES`` (``ppo``, ``decoupled_ppo``, ``gspo``,
    ``cispo``, or one a plug-in registers); ``auto`` = ``decoupled_ppo`` when the rollout correction is on, else
    ``ppo``. ``gspo`` clips one length-normalised ratio per sequence: set ``actor.clip_ratio_low=3e-4
    actor.clip_ratio_high=4e-4 actor.loss_agg_mode=seq-mean-token-mean`` (the paper's). ``cispo`` weights each
    token's log-prob gradient by its importance ratio capped at ``1 + actor.clip_ratio_high`` (set it to 4, as
    ScaleRL) and detached: no token loses its gradient."""
    clip_ratio_low: float = 0.2
    """PPO clip ε below 1."""
    clip_ratio_high: float = 0.2
    """PPO clip ε above 1 (DAPO uses 0.28)."""
    clip_ratio_c: Optional[float] = None
    """Dual-clip bound for negative advantages (> 1; none = off)."""
    mask_truncated_completions: bool = False
    """Leave the responses cut at ``data.max_response_length`` out of the actor's loss and its denominators (DAPO's
    overlong filtering; TRL's ``GRPOConfig.mask_truncated_completions``): a ramble cut at the cap is neither
    rewarded nor punished, where ``reward.overlong_buffer_len`` punishes it. They still count in their group's
    advantage baseline. A response of exactly the cap's length counts as cut, as in ``rollout/response_clip_ratio``."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient."""
    use_kl_loss: bool = False
    """Add a KL(π‖π_ref) term to the loss (needs the reference policy)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss term."""
    kl_loss_type: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator for the loss term."""
    shuffle_mini_batches: bool = False
    """Shuffle samples before cutting mini-batches (seeded)."""
    old_log_prob: Literal["auto", "recompute", "engine"] = "auto"
    """Where π_old (PPO's ratio denominator; the proximal policy in overlap mode) comes from. ``recompute``: a separate
    no-grad forward of the actor over the batch before the update. ``auto``: the update's first mini-batch takes π_old
    from its own forward, detached (the weights have not moved yet: ratio 1, the same gradient), and the pass runs on
    the other mini-batches only: none with one mini-batch per epoch (``ppo_mini_batch_size = data.train_batch_size``),
    1/M less with M; later epochs read what that forward left. Exact, so it is the default; it falls back to the whole
    pass when π_old is read before the update (KL-in-reward) or the actor does not update this step. With stale
    samples (overlap mode, partial rollouts) that forward is θ_k's, the proximal policy, as the pass's would be.
    ``engine``: never run the pass, use the rollout engine's log-probs (an approximation: engine and trainer numerics
    differ; in overlap mode proximal = behaviour). Metric ``actor/old_log_prob_skipped``: the share skipped."""

    def validate(self) -> None:
        self.validate_update("actor")
        require_positive(self, "actor", ["log_prob_micro_batch_size_per_device", "ulysses_sequence_parallel_size"])
        if self.ulysses_sequence_parallel_size > 1 and self.use_remove_padding is False:
            raise ConfigError(f"actor.ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size} cuts packed "
                              "rows: set actor.use_remove_padding=true")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ConfigError(f"actor.clip_ratio_c={self.clip_ratio_c} must be > 1 (dual clip), or null to turn it off")
        if not (0 <= self.clip_ratio_low < 1 and self.clip_ratio_high >= 0):
            raise ConfigError("actor.clip_ratio_low must be in [0, 1) and actor.clip_ratio_high >= 0")


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_device: int = harmless(16)
    """Sequences per forward when computing reference log-probs."""
    offload: bool = harmless(False)
    """Keep the frozen reference on CPU between uses (full fine-tuning only; LoRA reuses the base)."""


    def validate(self) -> None:
        require_positive(self, "ref", ["log_prob_micro_batch_size_per_device"])


@dataclass
class CriticConfig(UpdateConfig):
    model_path: Optional[str] = None
    """Where the value model's backbone comes from: null = the actor's ``model.path``; a causal LM (its LM head is
    dropped and a fresh scalar value head added)."""
    enable_gradient_checkpointing: bool = harmless(False)
    """Recompute the critic's activations in the backward pass."""
    lr: float = 1e-5
    """AdamW peak learning rate of the critic."""
    freeze_actor_steps: int = 0
    """The first N trainer steps update only the critic: the actor stays frozen while the value model learns the
    returns of the initial policy."""
    forward_micro_batch_size_per_device: int = harmless(16)
    """Sequences per no-grad forward when computing values."""
    use_remove_padding: Optional[bool] = harmless(None)
    """Pack each critic micro-batch into one row without padding, as ``actor.use_remove_padding`` does for the actor.
    A packing critic also shares prompts when the actor does (``actor.share_prompts``) and cuts its rows over the
    actor's sequence-parallel groups (``actor.ulysses_sequence_parallel_size``); one that does not pack runs each
    group's rows whole on every rank of the group. Default (null): as the actor."""
    accumulate_unsharded: Optional[bool] = harmless(None)
    """FSDP2: the critic's parameters stay gathered and its gradients unreduced across the micro-batches of a pass, as
    ``actor.accumulate_unsharded`` keeps the actor's: one all-gather per block for the value pass and, per mini-batch
    of the update, one all-gather and one reduce-scatter per block. Default (null): as the actor."""
    cliprange_value: Optional[float] = 0.5
    """Value clipping: a prediction may move at most this far from the values the batch was scored with (null = off)."""

    def accumulates_unsharded(self, actor: ActorConfig) -> bool:
        """``accumulate_unsharded`` resolved: null follows ``actor.accumulate_unsharded``."""
        return actor.accumulate_unsharded if self.accumulate_unsharded is None else self.accumulate_unsharded

    def validate(self) -> None:
        """Checked only where a critic is built (``Config.need_critic``)."""
        self.validate_update("critic")
        require_positive(self, "critic", ["forward_micro_batch_size_per_device"])
        if self.cliprange_value is not None and self.cliprange_value <= 0:
            raise ConfigError(f"critic.cliprange_value={self.cliprange_value} must be > 0, or null to turn value "
                              f"clipping off")
        if self.freeze_actor_steps < 0:
            raise ConfigError(f"critic.freeze_actor_steps={self.freeze_actor_steps} must be >= 0")


MOVED_KEYS = {"actor.warmup_steps": "actor.lr_warmup_steps", "critic.warmup_steps": "critic.freeze_actor_steps"}
"""Former names of these sections' keys: ``actor.warmup_steps`` was the actor's LR warm-up (the critic's name for it,
``lr_warmup_steps``, is both roles'), ``critic.warmup_steps`` the steps that freeze the actor (not an LR warm-up)."""
