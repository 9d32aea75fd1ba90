"""The one config tree: typed dataclasses, YAML loading, dotted overrides, validation.

Every recipe in ``recipes/`` mirrors this tree 1:1. Loading is strict: an
unknown key is an error naming its full dotted path and the closest valid one,
a value of the wrong type is an error naming the key and the expected type, and
``validate`` checks the cross-field facts (divisibility of batch sizes, GRPO
group sizes) with messages that say what to change. The choices of an
extension point (``algorithm.adv_estimator``, ``rollout.name``) are the names
in its registry (``hybrid_rl.registry``), checked like a ``Literal`` when the
value is loaded, so a registered plug-in is valid config. Validation never rewrites
a value; derived quantities are properties. Left out on purpose: Hydra-style
interpolation and config composition (one flat YAML per recipe is the whole UI).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from hybrid_rl.data.arith import ArithConfig
from hybrid_rl.data.arith import check_config as check_arith


class ConfigError(ValueError):
    """A bad recipe or override; the message names the dotted key and the fix."""


# --------------------------------------------------------------------------- tree
@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank; 0 trains the full model."""
    alpha: int = 16
    """LoRA scaling numerator (scale = alpha / rank)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Module names that get adapters."""
    dropout: float = 0.0
    """Dropout on the adapter input."""


@dataclass
class ModelConfig:
    path: str = "builtin:tiny-qwen2"
    """Hub id, local directory, or ``builtin:tiny-qwen2`` (built locally, no download)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer location when it differs from ``path``."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Training/inference dtype; ``auto`` is bf16 on GPU and fp32 on CPU."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (≈ half the activation memory)."""
    use_liger: bool = False
    """Liger-Kernel's fused Triton kernels (RMSNorm, SwiGLU, rotary embeddings) in the actor and the reference
    (``hybrid_rl/kernels.py``); CUDA only, needs ``pip install 'hybrid_rl[liger]'``. Same math, fewer kernels."""
    trust_remote_code: bool = False
    """Passed to ``from_pretrained``."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters via peft."""


@dataclass
class DataConfig:
    train_path: str = "synthetic:successor"
    """A local .jsonl/.parquet file, a ``datasets`` hub name (e.g. ``openai/gsm8k``), or ``synthetic:<task>``."""
    val_path: Optional[str] = None
    """Validation prompts, same forms as ``train_path``; none skips validation."""
    task: Literal["gsm8k", "successor", "arith"] = "successor"
    """How rows become chat prompts and ground truths (``arith``: arithmetic with a held-out test set)."""
    hub_config: Optional[str] = None
    """``datasets`` config name for hub datasets (``main`` for openai/gsm8k)."""
    train_split: str = "train"
    """Split name for hub datasets."""
    val_split: str = "test"
    """Split name for hub datasets."""
    max_val_samples: int = 256
    """Cap on validation prompts (0 = all)."""
    val_batch_size: Optional[int] = None
    """Validation prompts per generate call on each rank (default: ``data.train_batch_size``). A large value lets
    vLLM schedule the whole validation set at once (the engine still caps concurrency at ``rollout.max_num_seqs``)."""
    train_batch_size: int = 32
    """Prompts per step, across all ranks."""
    max_prompt_length: int = 512
    """Prompt tokens after the chat template."""
    max_response_length: int = 256
    """Maximum new tokens per response."""
    truncation: Literal["error", "filter", "left", "right"] = "filter"
    """What to do with prompts longer than ``max_prompt_length``."""
    shuffle: bool = True
    """Reshuffle the prompts each epoch (seeded)."""
    system_prompt: Optional[str] = None
    """Optional system message prepended to every prompt."""
    num_synthetic: int = 2048
    """Rows generated for ``synthetic:<task>`` training data (validation: the task's held-out test set where it has
    one, otherwise a quarter as many rows with another seed)."""
    arith: ArithConfig = field(default_factory=ArithConfig)
    """The ``arith`` task's problems: families, digits, list length, test set size."""


@dataclass
class RolloutConfig:
    name: str = "hf"
    """Rollout engine registered in ``hybrid_rl.rollout.ROLLOUT_ENGINES``: ``hf`` (transformers, anywhere) or ``vllm`` (GPU)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """The engine's weight dtype (the push casts the actor's weights to it): ``auto`` = ``model.dtype``, except that
    vLLM runs a float32 model in bfloat16 (vLLM 0.26 in float32 crashed in generate on H200)."""
    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are computed at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    val_temperature: float = 0.0
    """Temperature for validation (0 = greedy pass@1)."""
    max_num_seqs: int = 256
    """Sequences generated at once by the engine (the hf engine chunks by this)."""
    weight_sync_bucket_mb: int = 512
    """Bucket size for pushing weights into the engine."""
    weight_load_replay: bool = True
    """Record where the engine's ``load_weights`` copies each tensor on the first push and replay later pushes
    as one fused copy per bucket (falls back to the real loader whenever the recording is not a plain copy)."""
    free_cache_engine: bool = True
    """Put the engine to sleep between rollouts (frees its memory for training)."""
    forced_lengths: Optional[str] = None
    """Benchmarks only: ignore EOS and draw response lengths from ``lognormal:MEAN:SIGMA`` or ``fixed:N`` (capped at max_response_length)."""
    sleep_level: Literal[1, 2] = 1
    """Engine sleep depth: 1 offloads its weights to CPU, 2 discards them (re-pushed on wake)."""
    gpu_memory_utilization: float = 0.5
    """vLLM: fraction of GPU memory the engine may take (weights + KV cache)."""
    tensor_parallel_size: int = 1
    """vLLM: GPUs per engine; ranks form data-parallel groups of this size."""
    max_num_batched_tokens: int = 8192
    """vLLM: tokens per scheduler step."""
    max_model_len: Optional[int] = None
    """vLLM: context length (default: max_prompt_length + max_response_length)."""
    enforce_eager: bool = False
    """vLLM: skip CUDA graphs (faster start, slower decode)."""
    enable_prefix_caching: bool = True
    """vLLM: reuse KV for shared prompt prefixes (the n samples of a prompt)."""
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    """vLLM: the KV cache's dtype (``auto``: the engine's). ``fp8`` stores keys and values in 8 bits with per-tensor
    scales of 1.0 (no calibration; the weights arrive after start-up): half the KV memory and half the KV reads per
    decode step, which bound decoding many long sequences at once (split placement with partial rollouts at mean 4k
    keeps ~400 running per rollout GPU). The engine's log-probs then differ more from the trainer's: the decoupled loss
    takes the engine's as the behaviour policy, and ``rollout/logprob_diff`` shows the gap: 0.040 on average against
    ~0.014 with a bf16 cache (1xH200, ``benchmarks/results/gpu_tests_H200x1_fp8kv_reusekv.json``). Its throughput
    in a training run has not been measured."""
    reuse_stale_kv: bool = False
    """vLLM, partial rollouts: keep the prefix cache across weight pushes for the rounds, so that a carried sample
    resumes on the keys and values its earlier tokens left (computed under the weights they were sampled with)
    instead of re-prefilling its whole context under the new ones (PipelineRL's in-flight updates keep the cache the
    same way; AReaL recomputes it). The tokens a round samples then come from old keys and new weights: the engine's
    log-probs are still those it sampled with, and the decoupled loss takes them as the behaviour policy. A new
    prompt may hit an older prompt's cached opening too, so the cache is still reset once every
    ``trainer.max_staleness`` pushes (no cached key or value is older than the staleness bound allows; a shared
    opening would otherwise keep its first weights' for good), and by validation and foreground generation.
    ``benchmarks/partial_model.py`` (``--reuse-kv``) puts the saving at ~8% of a step at ahead 3, mean 4k, split
    2:2 (23.8 → 22.0 s); ``rollout/prefix_cache_hit`` shows the share served from the cache. On 1xH200
    (``tests/gpu/test_gpu_partial.py``) continuations read 91% of their context from it after a push, and after a
    deliberately large step their log-probs were 0.48 from the new weights' (0.003 with the cache reset;
    ``benchmarks/results/gpu_tests_H200x1_fp8kv_reusekv.json``). Its throughput in a training run has not been
    measured."""
    cuda_stream: Literal["shared", "own", "high"] = "shared"
    """Which CUDA stream generation runs on (``hybrid_rl.rollout.base.GenerationStream``): ``shared``, the calling
    thread's, which in overlap mode colocated is the trainer's too (vLLM 0.26's runner caches one stream), so the two
    never run kernels at the same time;
    ``own``, a stream of the engine's own; ``high``, that at the highest priority. Matters in overlap mode with
    colocated placement. On SmolLM2-135M (1xH200, overlap) ``high`` was no faster than ``shared``: median step 1.44
    against 1.37 s (``benchmarks/results/learning_smollm2_H200x1_overlong.json``); other models and lengths have not
    been measured."""
    engine_process: bool = False
    """vLLM: run the engine core (scheduler and model runner) in a process of its own on this rank's GPU, instead of
    in the trainer's process (vLLM's multiprocessing front end, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``). In overlap
    mode the trainer then no longer shares one Python interpreter with the engine: on SmolLM2-135M the trainer's
    passes ran 2.3-5x slower beside the in-process engine thread. Weights are pushed as CUDA IPC handles (no copy
    through the host); the engine's own memory is not in this process's ``perf/`` figures. Needs
    ``tensor_parallel_size=1`` and ``cuda_stream=shared``; costs a second CUDA context (~0.5 GB) per GPU."""


@dataclass
class ActorConfig:
    lr: float = 1e-6
    """AdamW peak learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """Schedule after warm-up."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of ``lr``."""
    ppo_epochs: int = 1
    """Passes over each batch."""
    ppo_mini_batch_size: int = 16
    """Prompts per optimizer step, across all ranks (each brings ``rollout.n`` samples)."""
    ppo_micro_batch_size_per_device: int = 8
    """Sequences per forward/backward on one device (gradient accumulation fills the mini-batch); unused with
    ``use_dynamic_bsz``, whose token budget cuts the micro-batches instead."""
    log_prob_micro_batch_size_per_device: int = 16
    """Sequences per forward when computing log-probs (likewise unused with ``use_dynamic_bsz``)."""
    use_dynamic_bsz: bool = False
    """Cut micro-batches by padded tokens (``max_token_len_per_device``) instead of a sequence count, in every pass."""
    max_token_len_per_device: int = 16384
    """Token budget of one micro-batch with ``use_dynamic_bsz`` (prompt + response, padded)."""
    use_remove_padding: Optional[bool] = None
    """Pack each micro-batch's sequences into one row without padding (per-sequence positions, attention that never
    crosses sequences: flash-attention varlen on CUDA, one SDPA call per sequence elsewhere); token budgets count real
    tokens. Also used by the reference policy. Default (null): on for CUDA, off on CPU, where the per-sequence attention
    costs more than the padding (the CPU recipe's update: 0.9 s packed vs 0.3 s padded)."""
    fused_logprob: Optional[bool] = None
    """Log-probs and entropy straight from the last hidden states and the LM head, in row chunks recomputed in
    backward: the [tokens × vocabulary] logits are never materialised (the reference policy too). Default (null): on
    for CUDA, off on CPU (a small vocabulary gains nothing there and the recomputation costs)."""
    share_prompts: Optional[bool] = None
    """With ``use_remove_padding``: each distinct prompt of a micro-batch passes through the model once and its
    responses attend to that one copy (``workers/packed.py``'s ``pack_shared``), in the actor's passes and the
    reference's. Exact (a prompt never sees its responses); with GRPO's n samples per prompt it removes (n-1)/n of the
    prompt tokens from every training pass (GSM8K, n=8: about half of all tokens). ``perf/mfu_*`` count the FLOPs the
    shared passes run; ``perf/mfu_*_equiv`` count every sample's sequence on its own (the work the unshared passes
    do), and ``perf/update_token_share`` is the update's tokens run per token of the batch. Default (null): on
    wherever the run packs on CUDA (4xH200, flagship shapes, no recomputation: update 7.3 -> 5.4 s, log-prob 2.1 ->
    1.5 s), off on CPU."""
    use_torch_compile: bool = False
    """``torch.compile`` each decoder block's forward (dynamic shapes) in the actor: fused kernels for a loop that is
    launch-bound (small models, many micro-batches); the first pass of each mode (train/eval) pays the compile."""
    accumulate_unsharded: bool = False
    """FSDP2: keep the parameters gathered and the gradients unreduced across the micro-batches of a pass, so a
    mini-batch costs one all-gather and one reduce-scatter per block instead of two all-gathers and one
    reduce-scatter per micro-batch (``reshard_after_forward=False``; gradient sync and resharding on the last
    micro-batch only). The reference policy's pass keeps its blocks gathered likewise. Costs a full compute-dtype
    copy of the parameters and full fp32 gradients per GPU during a pass: right for small models and many
    micro-batches, wrong where sharding is what makes the model fit."""
    policy_loss: str = "auto"
    """The actor's loss, a name in ``hybrid_rl.algorithms.POLICY_LOSSES`` (``ppo``, ``decoupled_ppo``, ``gspo``, or
    one a plug-in registers); ``auto`` = ``decoupled_ppo`` when the rollout correction is on, else ``ppo``. ``gspo``
    clips one length-normalised ratio per sequence: set ``actor.clip_ratio_low=3e-4 actor.clip_ratio_high=4e-4
    actor.loss_agg_mode=seq-mean-token-mean`` (the paper's)."""
    clip_ratio_low: float = 0.2
    """PPO clip ε below 1."""
    clip_ratio_high: float = 0.2
    """PPO clip ε above 1 (DAPO uses 0.28)."""
    clip_ratio_c: Optional[float] = None
    """Dual-clip bound for negative advantages (> 1; none = off)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How token losses are averaged."""
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
    param_offload: bool = False
    """Move actor parameters (and gradients) to CPU while the engine generates."""
    optimizer_offload: bool = False
    """Move AdamW state to CPU while the engine generates."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 = off)."""
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


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_device: int = 16
    """Sequences per forward when computing reference log-probs."""
    offload: bool = False
    """Keep the frozen reference on CPU between uses (full fine-tuning only; LoRA reuses the base)."""


@dataclass
class RolloutCorrectionConfig:
    apply: Literal["auto", "always", "never"] = "auto"
    """Decoupled PPO (π_θ/π_prox clipped, weighted by π_prox/π_behav); ``auto`` = only in overlap mode with staleness ≥ 1."""
    level: Literal["token", "sequence"] = "token"
    """Importance weight per token, or one per sequence (product of token ratios)."""
    mode: Literal["truncate", "mask"] = "truncate"
    """Weights above ``cap`` are cut to ``cap`` (truncate) or drop their tokens/sequences (mask)."""
    cap: Optional[float] = 2.0
    """Upper bound on π_prox/π_behav (null = none)."""


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    """``fixed``: β stays ``kl_coef``. ``adaptive``: β is scaled after every step towards ``target_kl`` (Ziegler et al.)."""
    kl_coef: float = 0.001
    """β for the reward penalty (the starting value under ``adaptive``)."""
    target_kl: float = 0.1
    """``adaptive``: the per-sequence mean KL β steers towards."""
    horizon: int = 10000
    """``adaptive``: sequences over which β may change by the full ±20% proportional error."""


@dataclass
class CriticConfig:
    model_path: Optional[str] = None
    """Where the value model's backbone comes from: null = the actor's ``model.path``; a causal LM (its LM head is
    dropped and a fresh scalar value head added)."""
    enable_gradient_checkpointing: bool = False
    """Recompute the critic's activations in the backward pass."""
    lr: float = 1e-5
    """AdamW peak learning rate of the critic."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    lr_warmup_steps: int = 0
    """Linear LR warm-up, in critic optimizer steps."""
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    """LR schedule after warm-up."""
    min_lr_ratio: float = 0.0
    """Cosine floor as a fraction of ``lr``."""
    warmup_steps: int = 0
    """Critic warm-up: the first N trainer steps update only the critic (the actor does not move)."""
    ppo_epochs: int = 1
    """Passes of the critic over each batch."""
    ppo_mini_batch_size: int = 16
    """Prompts per critic optimizer step, across all ranks (each brings ``rollout.n`` samples)."""
    ppo_micro_batch_size_per_device: int = 8
    """Sequences per critic forward/backward on one device."""
    forward_micro_batch_size_per_device: int = 16
    """Sequences per no-grad forward when computing values."""
    use_dynamic_bsz: bool = False
    """Cut the critic's micro-batches by padded tokens (``max_token_len_per_device``) instead of a sequence count."""
    max_token_len_per_device: int = 16384
    """Token budget of one critic micro-batch with ``use_dynamic_bsz``."""
    cliprange_value: Optional[float] = 0.5
    """Value clipping: a prediction may move at most this far from the values the batch was scored with (null = off)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How the per-token value losses are averaged."""
    grad_clip: float = 1.0
    """Max global gradient norm of the critic (0 = off)."""
    param_offload: bool = False
    """Move the critic's parameters (and gradients) to CPU between its phases (e.g. while the engine generates)."""
    optimizer_offload: bool = False
    """Move the critic's AdamW state to CPU between its updates."""


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO's dynamic sampling: drop the GRPO groups whose ``rollout.n`` rewards are all equal (zero advantage, no
    policy gradient) and generate more groups until every rank holds its share of ``data.train_batch_size``
    informative ones. Needs ``trainer.mode=sync`` with colocated placement and no partial rollouts (the reward must be
    known before the step's batch is final), and a group estimator (grpo, dr_grpo, rloo). Metrics:
    ``rollout/filtered_groups`` (groups dropped), ``rollout/filter_rounds`` (refill generations),
    ``rollout/filter_short_groups`` (target slots still holding an all-equal group after ``max_rounds``)."""
    metric: Literal["seq_reward", "score"] = "seq_reward"
    """What must differ within a group: ``seq_reward``, the sequence's training reward (the score plus the overlong
    penalty, what the advantage sees), or ``score``, the reward function's own value."""
    max_rounds: int = 10
    """Refill generations per step at most (each of a full step's prompts, on every rank); past them the step trains
    on the informative groups it has, the remaining slots keeping all-equal groups (counted in
    ``rollout/filter_short_groups``), so the batch's shape is the same as every step's."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator registered in ``hybrid_rl.algorithms.ADV_ESTIMATORS``: grpo, dr_grpo, rloo, reinforce_pp, gae."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group's std."""
    gamma: float = 1.0
    """Discount."""
    lam: float = 1.0
    """GAE λ."""
    gae_whiten: Literal["std", "mean", "none"] = "std"
    """How GAE advantages are normalised over the batch's tokens: ``std`` whitens (verl), ``mean`` only subtracts the
    mean (keeps the critic's small errors small when a batch holds no reward at all), ``none`` leaves them raw."""
    gae_std_floor: float = 0.0
    """With ``gae_whiten=std``: divide by max(std, this) so that a batch whose advantages are only the critic's noise
    (no reward in it) is not blown up to unit scale; 0 = plain whitening."""
    use_kl_in_reward: bool = False
    """Subtract β·KL(π_old‖π_ref) from the token rewards (needs the reference policy)."""
    kl_penalty: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator for the reward penalty."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """β of the reward penalty: fixed, or adapted towards a target KL."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Off-policy correction between the rollout engine's policy and the trainer's."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling: train only on groups whose rewards differ, generating more to fill the batch."""


@dataclass
class RewardConfig:
    function: str = "auto"
    """``auto`` (the task's own), a built-in name (``gsm8k``, ``successor``), or ``module:function``."""
    on_error: Literal["raise", "zero"] = "raise"
    """A raising reward function (or one past ``timeout_s``) stops the run (``raise``) or scores 0 and is counted
    (``zero``, metric ``reward/errors``)."""
    timeout_s: float = 30.0
    """Seconds one reward call may run before it is abandoned and fails as ``on_error`` says (0 = no limit). Needs
    worker processes: with ``num_workers=0`` a long call is only reported."""
    num_workers: int = -1
    """Processes that score a batch: -1 = auto (min(8, CPUs per rank) for a ``module:function``, none for the
    built-ins, which take microseconds), 0 = the training process, N = N processes. Scores are the same either way."""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong punishment on the training reward (verl ``overlong_buffer.len``): a response within this
    many tokens of ``data.max_response_length`` loses reward linearly, up to ``overlong_penalty_factor`` at the cap
    (0 = off). Validation scores are left as they are."""
    overlong_penalty_factor: float = 1.0
    """The reward a response cut at the length cap loses (with ``overlong_buffer_len`` > 0)."""


@dataclass
class TrainerConfig:
    output_dir: str = "runs/default"
    """Run directory: resolved config, metrics.jsonl, tensorboard events."""
    seed: int = 0
    """Seeds data order, sampling and init; CPU runs repeat step for step."""
    total_steps: int = 0
    """Training steps; 0 = ``total_epochs`` passes over the data."""
    total_epochs: int = 1
    """Epochs when ``total_steps`` is 0."""
    test_freq: int = 0
    """Validate every N steps and after the last (0 = never, except ``val_before_train``)."""
    val_before_train: bool = False
    """Validate once before the first step."""
    logger: list[Literal["console", "tensorboard", "jsonl"]] = field(default_factory=lambda: ["console", "tensorboard", "jsonl"])
    """Metric sinks."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` uses CUDA when present."""
    mode: Literal["sync", "overlap"] = "sync"
    """``sync``: generate then train. ``overlap``: generate batch k+1 while batch k trains."""
    max_staleness: int = 1
    """Overlap mode: the most weight versions a trained-on sample may lag (0 = sync semantics); 0 or 1, or >= 2
    with ``partial_rollouts`` (a carried sample's oldest tokens are used two versions later)."""
    partial_rollouts: bool = False
    """Overlap mode, colocated: interrupt the round in flight once this rank has a step's complete GRPO groups
    and carry the rest (unfinished samples with their partial responses) into the next round, where they continue
    under the newer weights (AReaL-style). Needs ``max_staleness >= 2``; tokens record their own weight version
    (``token_weight_version``). Checkpoints let the round finish first, so nothing partial is saved."""
    partial_rollout_ahead: float = 0.25
    """Partial rollouts: how much is generated beyond the step's own groups, as a fraction of a step. A round
    holds the pool's oldest ``(1 + ahead) × per-step`` groups (the newer ones wait unstarted), and the trainer takes
    the first per-step groups to complete: the default leaves the slowest fifth of a round's groups, the long tail, to
    the next round (about a quarter of the trained samples then have oldest-token staleness 2, the rest 1). 1.0 starts
    every group of a two-step pool at once: more slack for the tail, but nearly every sample is carried once
    (staleness 2). Above 1 the pool grows to the window (up to 4: five steps' groups in flight), so more complete
    groups are at hand at each boundary; a group that reaches ``max_staleness`` is still waited for."""
    save_freq: int = 0
    """Checkpoint every N steps (0 = only at the end, -1 = never, e.g. for benchmarks)."""
    keep_last: int = 2
    """Complete checkpoints kept (older ones pruned after a new one is complete; 0 = all)."""
    resume: str = "auto"
    """``auto`` (newest complete checkpoint in output_dir, else fresh), ``never``, or a checkpoint path."""
    max_skipped_updates: int = 3
    """Stop after this many consecutive steps whose update was skipped for a non-finite loss/grad norm."""
    stale_policy: Literal["drop", "error"] = "drop"
    """A batch beyond ``max_staleness`` is regenerated under the current weights (drop) or stops the run (error)."""
    validation_data_dir: str = ""
    """Write every validation's samples (dataset index, prompt, response, its length in tokens, ground truth, score)
    as JSON lines to ``<dir>/step_<N>_rank<R>.jsonl`` ("" = off, as verl's key of the same name; a relative path is
    inside ``output_dir``). For reading what the model writes, and for a paired before/after comparison per question."""
    profile_steps: list[int] = field(default_factory=list)
    """Steps to run under ``torch.profiler``; each rank writes its top ops by CUDA and CPU time to
    ``<output_dir>/profile/step_<N>_rank<R>.txt`` (e.g. ``trainer.profile_steps=[5]``)."""
    peak_tflops: Optional[float] = None
    """The device's dense bf16 peak in TFLOP/s for ``perf/mfu_*`` (default: looked up by GPU name in
    ``hybrid_rl.perf``; MFU is not logged for devices it does not know)."""
    stall_dump_s: float = 0.0
    """A step (or the run's set-up) running longer than this many seconds dumps every thread's Python stack to
    stderr, and again every as many seconds (0 = off): the first thing to look at when a multi-rank run hangs."""
    expandable_segments: bool = False
    """CUDA: PyTorch's expandable segments for the trainer's allocations (``PYTORCH_CUDA_ALLOC_CONF``; vLLM turns
    them off around its own pools). Packed micro-batches change size every call, and the caching allocator fragments:
    on 4xH200 the flagship with 16k-token micro-batches peaked at ~135 GB reserved per GPU for ~68 GB allocated
    (``perf/max_memory_*`` less vLLM's sleeping 70 GB pool, which they count) and made 718 ``cudaFree`` calls in one
    profiled step. Off by default: on the flagship recipe (4xH200) it made the step slower, 19.3 against 17.3 s
    (``benchmarks/results/flagship_H200x4.json``)."""
    collective_timeout_s: int = 1800
    """How long a rank waits in a collective for the others before it fails the run (a hung or dead rank then ends the
    run with an error instead of waiting forever); raise it if a phase is legitimately that uneven across ranks."""
    placement: Literal["colocated", "split"] = "colocated"
    """``colocated``: every rank trains and generates. ``split``: ranks ``0..R-1`` only generate, the rest only train
    (weights broadcast over NCCL after each update)."""
    rollout_ranks: int = 0
    """Split placement: R, the number of generate-only ranks (0 = half the world, rounded down)."""
    allow_config_change: bool = False
    """Resume a checkpoint even though settings that change what is trained differ from the run that wrote it
    (model, data, algorithm, optimiser, sampling, mode, placement, seed); off, such a resume stops and lists them."""
    imports: list[str] = field(default_factory=list)
    """Plug-in modules every process imports before the rest of the config is read: module names (on
    ``sys.path``/``PYTHONPATH``) or ``path/to/file.py``. Their registrations (``register_estimator``,
    ``register_policy_loss``, ``register_rollout_engine``, ``register_reward``) make their names valid in
    ``algorithm.adv_estimator``, ``actor.policy_loss``, ``rollout.name`` and ``reward.function``, on every rank that
    ``train --nproc`` starts (the command line's ``--import MODULE`` does the same)."""

    @property
    def partial_pool_steps(self) -> int:
        """``partial_pool_steps(partial_rollout_ahead)``."""
        return partial_pool_steps(self.partial_rollout_ahead)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy checkpoint, dtype and LoRA."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt datasets, batch size and lengths."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The generation engine and its sampling."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Optimiser and PPO update."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference policy (built only when a KL term needs it)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (built only when ``algorithm.adv_estimator`` needs one, e.g. gae)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and KL-in-reward."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function and its failure policy."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The driver loop: steps, validation, logging, output."""

    # -- derived -------------------------------------------------------------------
    @property
    def use_rollout_correction(self) -> bool:
        """Whether the actor loss is decoupled PPO (behaviour = engine log-probs) instead of plain PPO."""
        rc = self.algorithm.rollout_correction.apply
        if rc == "auto":
            return self.trainer.mode == "overlap" and self.trainer.max_staleness > 0
        return rc == "always"

    @property
    def engine_sleeps(self) -> bool:
        """The engine releases its memory after each rollout: sync mode only (in overlap mode it generates while training)."""
        return self.rollout.free_cache_engine and self.trainer.mode == "sync"

    @property
    def staleness_bound(self) -> int:
        """Versions a sample may lag the trainer: 0 in sync mode."""
        return self.trainer.max_staleness if self.trainer.mode == "overlap" else 0

    @property
    def rollout_dtype(self) -> str:
        """The engine's dtype name (``rollout.dtype`` resolved): see that field's docstring."""
        r = self.rollout
        if r.dtype != "auto":
            return r.dtype
        if r.name == "vllm" and self.model.dtype in ("float32", "auto"):
            return "bfloat16"  # vLLM 0.26 in float32 crashed on H200 (not reproduced on H100); the push casts
        return self.model.dtype

    @property
    def policy_loss(self) -> str:
        """The actor's loss, a name in ``hybrid_rl.algorithms.POLICY_LOSSES``: ``actor.policy_loss``, where ``auto``
        is decoupled PPO under rollout correction, else PPO."""
        if self.actor.policy_loss != "auto":
            return self.actor.policy_loss
        return "decoupled_ppo" if self.use_rollout_correction else "ppo"

    @property
    def need_critic(self) -> bool:
        """A critic is only built for an estimator registered with ``needs_critic`` (gae)."""
        return _registry("algorithm.adv_estimator").info(self.algorithm.adv_estimator).needs_critic

    @property
    def need_ref(self) -> bool:
        """A reference policy is only built when a KL term uses it."""
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def split_layout(self, world_size: int) -> tuple[int, int]:
        """(rollout ranks, trainer ranks) of ``trainer.placement=split`` on ``world_size`` ranks."""
        n = self.trainer.rollout_ranks or world_size // 2
        return n, world_size - n

    def validate(self, world_size: int = 1) -> "Config":
        """Cross-field checks; raises ConfigError naming the key and the fix."""
        d, a, r = self.data, self.actor, self.rollout
        world = world_size
        if self.trainer.placement == "split":
            world_size = self._validate_split(world)  # the trainer ranks: what batch sizes must divide
        _positive(self, ["data.train_batch_size", "data.max_prompt_length", "data.max_response_length", "rollout.n",
                         "actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size_per_device", "actor.ppo_epochs",
                         "actor.log_prob_micro_batch_size_per_device", "ref.log_prob_micro_batch_size_per_device",
                         "rollout.max_num_seqs", "rollout.weight_sync_bucket_mb"])
        import_plugins(self.trainer.imports, "trainer.imports")  # a Config built in code never went through the loader
        _check_registered(self)
        estimators = _registry("algorithm.adv_estimator")
        est = estimators.info(self.algorithm.adv_estimator)
        rw = self.reward
        if not 0 <= rw.overlong_buffer_len < d.max_response_length:
            raise ConfigError(f"reward.overlong_buffer_len={rw.overlong_buffer_len} must be >= 0 and below "
                              f"data.max_response_length={d.max_response_length} (0 = off; DAPO used 4k of 20k)")
        if rw.overlong_penalty_factor < 0:
            raise ConfigError(f"reward.overlong_penalty_factor={rw.overlong_penalty_factor} must be >= 0 "
                              f"(the reward a response cut at the cap loses)")
        if self.algorithm.gae_std_floor < 0:
            raise ConfigError(f"algorithm.gae_std_floor={self.algorithm.gae_std_floor} must be >= 0 (0 = plain whitening)")
        if est.needs_groups and r.n < 2:
            alone = [n for n in estimators if not (estimators.info(n).needs_groups or estimators.info(n).needs_critic)]
            raise ConfigError(f"algorithm.adv_estimator={self.algorithm.adv_estimator} compares the samples of one prompt, "
                              f"so rollout.n must be >= 2 (got {r.n}); raise rollout.n or use {_or(alone)}")
        if d.train_batch_size % world_size:
            raise ConfigError(f"data.train_batch_size={d.train_batch_size} must be divisible by the {world_size} ranks "
                              f"(a prompt's samples stay on one rank); set it to a multiple of {world_size}")
        if d.train_batch_size % a.ppo_mini_batch_size:
            raise ConfigError(f"data.train_batch_size={d.train_batch_size} must be divisible by actor.ppo_mini_batch_size="
                              f"{a.ppo_mini_batch_size}; lower actor.ppo_mini_batch_size to a divisor")
        if a.ppo_mini_batch_size % world_size:
            raise ConfigError(f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} must be divisible by the {world_size} ranks; "
                              f"set it to a multiple of {world_size}")
        seqs_per_rank = a.ppo_mini_batch_size // world_size * r.n
        if not a.use_dynamic_bsz and seqs_per_rank % a.ppo_micro_batch_size_per_device:  # a token budget cuts otherwise
            raise ConfigError(f"a mini-batch holds {seqs_per_rank} sequences per device (actor.ppo_mini_batch_size / ranks × rollout.n), "
                              f"not divisible by actor.ppo_micro_batch_size_per_device={a.ppo_micro_batch_size_per_device}; use a divisor of {seqs_per_rank}")
        if est.needs_critic:
            self._validate_critic(world_size)
        kc = self.algorithm.kl_ctrl
        if kc.kl_coef < 0:
            raise ConfigError(f"algorithm.kl_ctrl.kl_coef={kc.kl_coef} must be >= 0")
        if kc.type == "adaptive" and (kc.target_kl <= 0 or kc.horizon <= 0):
            raise ConfigError(f"algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.target_kl > 0 and "
                              f"algorithm.kl_ctrl.horizon > 0 (got {kc.target_kl} and {kc.horizon})")
        if not 0 < r.gpu_memory_utilization < 1:
            raise ConfigError(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} must be in (0, 1); 0.3-0.6 leaves room for training")
        if r.forced_lengths is not None:
            parse_forced_lengths(r.forced_lengths)
        if r.name == "vllm" and r.dtype == "float32":
            raise ConfigError("rollout.dtype=float32 with rollout.name=vllm: vLLM 0.26 in float32 crashed in step 2's "
                              "generate (CUDA illegal memory access, on H200); use rollout.dtype=auto (a bfloat16 engine, "
                              "the actor keeps model.dtype) or rollout.name=hf")
        if r.tensor_parallel_size < 1 or world % r.tensor_parallel_size:
            raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} must divide the {world} ranks")
        if r.reuse_stale_kv:
            missing = [k for k, ok in (("rollout.name=vllm", r.name == "vllm"),
                                       ("trainer.partial_rollouts=true", self.trainer.partial_rollouts),
                                       ("rollout.enable_prefix_caching=true", r.enable_prefix_caching)) if not ok]
            if missing:
                raise ConfigError(f"rollout.reuse_stale_kv=true keeps vLLM's prefix cache for partial rollouts' carried "
                                  f"samples: set {' '.join(missing)}, or rollout.reuse_stale_kv=false")
        if r.kv_cache_dtype != "auto" and r.name != "vllm":
            raise ConfigError(f"rollout.kv_cache_dtype={r.kv_cache_dtype} is for rollout.name=vllm (got {r.name!r}); "
                              "set rollout.kv_cache_dtype=auto")
        if r.engine_process:
            if r.name != "vllm":
                raise ConfigError(f"rollout.engine_process=true is for rollout.name=vllm (got {r.name!r}); "
                                  f"set rollout.engine_process=false")
            if r.tensor_parallel_size != 1:
                raise ConfigError(f"rollout.engine_process=true needs rollout.tensor_parallel_size=1 (got "
                                  f"{r.tensor_parallel_size}): one engine process per GPU; set rollout.engine_process=false")
            if r.cuda_stream != "shared":
                raise ConfigError(f"rollout.cuda_stream={r.cuda_stream} with rollout.engine_process=true: the engine "
                                  f"runs on its own streams in its own process; set rollout.cuda_stream=shared")
        if not 0 < r.top_p <= 1:
            raise ConfigError(f"rollout.top_p={r.top_p} must be in (0, 1]")
        if r.temperature <= 0:
            raise ConfigError(f"rollout.temperature={r.temperature} must be > 0 for training rollouts; "
                              "use rollout.val_temperature=0 for greedy validation")
        if a.use_dynamic_bsz and a.max_token_len_per_device < d.max_prompt_length + d.max_response_length:
            raise ConfigError(f"actor.max_token_len_per_device={a.max_token_len_per_device} must hold one full sequence: raise it "
                              f"to at least data.max_prompt_length + data.max_response_length = {d.max_prompt_length + d.max_response_length}")
        if self.policy_loss == "gspo" and a.clip_ratio_c is not None:
            raise ConfigError(f"actor.clip_ratio_c={a.clip_ratio_c}: actor.policy_loss=gspo has no dual clip; set "
                              f"actor.clip_ratio_c=null")
        if a.clip_ratio_c is not None and a.clip_ratio_c <= 1:
            raise ConfigError(f"actor.clip_ratio_c={a.clip_ratio_c} must be > 1 (dual clip), or null to turn it off")
        if not (0 <= a.clip_ratio_low < 1 and a.clip_ratio_high >= 0):
            raise ConfigError("actor.clip_ratio_low must be in [0, 1) and actor.clip_ratio_high >= 0")
        if len(a.betas) != 2:
            raise ConfigError(f"actor.betas must hold two numbers, got {a.betas}")
        if self.model.lora.rank < 0:
            raise ConfigError("model.lora.rank must be >= 0 (0 = full fine-tuning)")
        if self.trainer.save_freq < -1 or self.trainer.keep_last < 0 or self.trainer.max_skipped_updates < 1:
            raise ConfigError("trainer.save_freq must be >= -1 (-1 = never), trainer.keep_last >= 0, "
                              "trainer.max_skipped_updates >= 1")
        fg = self.algorithm.filter_groups
        if fg.enable:
            if self.trainer.mode != "sync" or self.trainer.placement != "colocated" or self.trainer.partial_rollouts:
                raise ConfigError("algorithm.filter_groups.enable=true needs trainer.mode=sync (colocated, no "
                                  "partial rollouts): refills are generated after the step's rewards are known")
            if not est.needs_groups:
                raise ConfigError(f"algorithm.filter_groups.enable=true drops groups of equal rewards, which only a group "
                                  f"estimator gives no gradient; algorithm.adv_estimator={self.algorithm.adv_estimator} "
                                  f"is not one: use grpo, dr_grpo or rloo, or algorithm.filter_groups.enable=false")
            if fg.max_rounds < 0:
                raise ConfigError(f"algorithm.filter_groups.max_rounds={fg.max_rounds} must be >= 0 (refill generations "
                                  f"per step; 0 = none, the batch trains as generated and the counts are logged)")
        if self.trainer.partial_rollouts:
            self._validate_partial()
        elif self.trainer.max_staleness not in (0, 1):
            raise ConfigError(f"trainer.max_staleness={self.trainer.max_staleness}: one-step overlap supports 0 or 1 "
                              "(deeper pipelines are not built yet; >= 2 only with trainer.partial_rollouts=true)")
        if self.trainer.mode == "overlap" and (a.param_offload or a.optimizer_offload):
            raise ConfigError("actor.param_offload/actor.optimizer_offload need trainer.mode=sync: in overlap mode the actor "
                              "trains while the engine generates, so there is no idle phase to offload in")
        rc = self.algorithm.rollout_correction
        if rc.cap is not None and rc.cap <= 1:
            raise ConfigError(f"algorithm.rollout_correction.cap={rc.cap} must be > 1 (or null for no cap)")
        t = self.trainer
        if t.rollout_ranks < 0:
            raise ConfigError(f"trainer.rollout_ranks={t.rollout_ranks} must be >= 0 (0 = half the ranks under placement=split)")
        if t.collective_timeout_s <= 0:
            raise ConfigError(f"trainer.collective_timeout_s={t.collective_timeout_s} must be > 0 seconds")
        if self.reward.timeout_s < 0:
            raise ConfigError(f"reward.timeout_s={self.reward.timeout_s} must be >= 0 seconds (0 = no limit)")
        if self.reward.num_workers < -1:
            raise ConfigError(f"reward.num_workers={self.reward.num_workers} must be -1 (auto), 0 (score in the training "
                              f"process) or a number of worker processes")
        if t.stall_dump_s < 0:
            raise ConfigError(f"trainer.stall_dump_s={t.stall_dump_s} must be >= 0 seconds (0 = off)")
        if t.peak_tflops is not None and t.peak_tflops <= 0:
            raise ConfigError(f"trainer.peak_tflops={t.peak_tflops} must be > 0 (the GPU's dense bf16 TFLOP/s), or null to "
                              f"look it up by GPU name")
        if d.val_batch_size is not None and d.val_batch_size < 1:
            raise ConfigError(f"data.val_batch_size={d.val_batch_size} must be a positive number of prompts (or null "
                              "for data.train_batch_size)")
        if any(step < 1 for step in t.profile_steps):
            raise ConfigError(f"trainer.profile_steps={t.profile_steps} must list step numbers >= 1, e.g. [5]")
        if self.trainer.total_steps < 0 or self.trainer.total_epochs < 1:
            raise ConfigError("trainer.total_steps must be >= 0 and trainer.total_epochs >= 1")
        if d.train_path.startswith("synthetic:") and d.train_path.split(":", 1)[1] != d.task:
            raise ConfigError(f"data.train_path={d.train_path} is a synthetic task but data.task={d.task}; set data.task to the synthetic task's name")
        try:
            check_arith(d.arith)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return self

    def _validate_partial(self) -> None:
        """``trainer.partial_rollouts``: overlap mode (either placement), a staleness bound that a carried sample fits."""
        t, r = self.trainer, self.rollout
        if not 0.0 < t.partial_rollout_ahead <= 4.0:
            raise ConfigError(f"trainer.partial_rollout_ahead={t.partial_rollout_ahead} must be in (0, 4] (steps' "
                              "groups generated beyond this step's, e.g. 0.25 or 1.0); not a percentage")
        if t.mode != "overlap":
            raise ConfigError(f"trainer.partial_rollouts=true needs trainer.mode=overlap (got {t.mode}): set "
                              "trainer.mode=overlap trainer.max_staleness=2, or trainer.partial_rollouts=false")
        if t.max_staleness < 2:
            raise ConfigError(f"trainer.partial_rollouts=true needs trainer.max_staleness >= 2 (got {t.max_staleness}): "
                              "a carried sample's oldest tokens are used two weight versions later; set "
                              "trainer.max_staleness=2")
        pool_steps = t.partial_pool_steps
        if t.max_staleness < pool_steps:
            raise ConfigError(f"trainer.partial_rollout_ahead={t.partial_rollout_ahead:g} keeps {pool_steps} steps' groups "
                              f"in flight, started together, so the last is trained {pool_steps} versions later: set "
                              f"trainer.max_staleness={pool_steps} (got {t.max_staleness}) or a smaller ahead")
        if self.actor.old_log_prob == "engine":
            raise ConfigError("trainer.partial_rollouts=true with actor.old_log_prob=engine would make the proximal "
                              "policy the mixed-version behaviour one (no correction); set actor.old_log_prob=auto")
        if r.name == "vllm" and r.tensor_parallel_size > 1:
            raise ConfigError(f"trainer.partial_rollouts=true with rollout.name=vllm needs rollout.tensor_parallel_size"
                              f"=1 (got {r.tensor_parallel_size}): the ranks of one engine cannot agree on an interrupt "
                              "yet; set trainer.partial_rollouts=false")

    def _validate_critic(self, world_size: int) -> None:
        """The critic's batch sizes divide like the actor's; its knobs are in range."""
        c, d, n = self.critic, self.data, self.rollout.n
        _positive(self, ["critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_device", "critic.ppo_epochs",
                         "critic.forward_micro_batch_size_per_device"])
        if d.train_batch_size % c.ppo_mini_batch_size:
            raise ConfigError(f"data.train_batch_size={d.train_batch_size} must be divisible by critic.ppo_mini_batch_size="
                              f"{c.ppo_mini_batch_size}; lower critic.ppo_mini_batch_size to a divisor")
        if c.ppo_mini_batch_size % world_size:
            raise ConfigError(f"critic.ppo_mini_batch_size={c.ppo_mini_batch_size} must be divisible by the {world_size} "
                              f"ranks; set it to a multiple of {world_size}")
        seqs = c.ppo_mini_batch_size // world_size * n
        if not c.use_dynamic_bsz and seqs % c.ppo_micro_batch_size_per_device:
            raise ConfigError(f"a critic mini-batch holds {seqs} sequences per device (critic.ppo_mini_batch_size / ranks × "
                              f"rollout.n), not divisible by critic.ppo_micro_batch_size_per_device="
                              f"{c.ppo_micro_batch_size_per_device}; use a divisor of {seqs}")
        if c.cliprange_value is not None and c.cliprange_value <= 0:
            raise ConfigError(f"critic.cliprange_value={c.cliprange_value} must be > 0, or null to turn value clipping off")
        if c.warmup_steps < 0 or c.lr_warmup_steps < 0:
            raise ConfigError("critic.warmup_steps and critic.lr_warmup_steps must be >= 0")
        if len(c.betas) != 2:
            raise ConfigError(f"critic.betas must hold two numbers, got {c.betas}")
        if c.use_dynamic_bsz and c.max_token_len_per_device < d.max_prompt_length + d.max_response_length:
            raise ConfigError(f"critic.max_token_len_per_device={c.max_token_len_per_device} must hold one full sequence: "
                              f"raise it to at least {d.max_prompt_length + d.max_response_length}")

    def _validate_split(self, world: int) -> int:
        t, d, r = self.trainer, self.data, self.rollout
        if world < 2:
            raise ConfigError("trainer.placement=split needs at least 2 ranks (one generates, one trains); "
                              "launch more processes (make train GPUS=2) or use trainer.placement=colocated")
        n_roll, n_train = self.split_layout(world)
        if not 0 < n_roll < world:
            raise ConfigError(f"trainer.rollout_ranks={t.rollout_ranks} must be in 1..{world - 1} on {world} ranks")
        if d.train_batch_size % n_roll:
            raise ConfigError(f"data.train_batch_size={d.train_batch_size} must be divisible by the {n_roll} rollout ranks "
                              f"(trainer.rollout_ranks); set it to a multiple of {n_roll}")
        if n_roll % r.tensor_parallel_size:
            raise ConfigError(f"rollout.tensor_parallel_size={r.tensor_parallel_size} must divide the {n_roll} rollout ranks")
        if self.actor.param_offload or self.actor.optimizer_offload:
            raise ConfigError("trainer.placement=split keeps the actor on its own GPUs, so actor.param_offload/"
                              "optimizer_offload have nothing to give way to; set them to false")
        return n_train


def partial_pool_steps(ahead: float) -> int:
    """Partial rollouts: how many steps' groups the pool keeps in flight at ``trainer.partial_rollout_ahead`` =
    ``ahead``, max(2, ⌈1 + ahead⌉), and so the least ``trainer.max_staleness`` it allows (the last of them is
    trained that many versions after it started). The pool shrinks only over a run's last that many steps (there
    are no prompts beyond the end to start)."""
    return max(2, math.ceil(1 + ahead))


def parse_forced_lengths(spec: str) -> tuple[str, list[float]]:
    """``lognormal:MEAN:SIGMA`` or ``fixed:N`` → (kind, numbers); ConfigError naming the key otherwise."""
    kind, _, rest = spec.partition(":")
    try:
        nums = [float(x) for x in rest.split(":")] if rest else []
    except ValueError:
        nums = []
    if (kind, len(nums)) not in (("lognormal", 2), ("fixed", 1)) or any(x <= 0 for x in nums):
        raise ConfigError(f"rollout.forced_lengths={spec!r} must be 'lognormal:MEAN:SIGMA' or 'fixed:N' with positive numbers")
    return kind, nums


# Keys whose valid values are the names in an extension point's registry (``hybrid_rl.registry.Registry``),
# checked when a value is loaded (like a Literal) and again by ``validate``; imported lazily, so that loading a
# config imports neither torch nor any engine. A key in _AUTO_KEYS also takes ``auto`` (never looked up).
_REGISTERED_KEYS = {"algorithm.adv_estimator": ("hybrid_rl.algorithms.advantages", "ADV_ESTIMATORS"),
                    "rollout.name": ("hybrid_rl.rollout", "ROLLOUT_ENGINES"),
                    "actor.policy_loss": ("hybrid_rl.algorithms.policy_loss", "POLICY_LOSSES")}
_AUTO_KEYS = frozenset({"actor.policy_loss"})


def _registry(key: str) -> Any:
    import importlib

    module, attr = _REGISTERED_KEYS[key]
    return getattr(importlib.import_module(module), attr)


def _check_choice(key: str, value: Any) -> None:
    if key in _AUTO_KEYS and value == "auto":
        return
    registry = _registry(key)
    if value not in registry:
        if key not in _AUTO_KEYS:
            raise ConfigError(registry.unknown_message(value))
        names = ["auto", *registry.names()]
        close = difflib.get_close_matches(str(value), names, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{key}={value!r} is not one of {names}{hint}")


_IMPORTED_FILES: dict[Path, types.ModuleType] = {}
"""Plug-in files already imported, by resolved path: a file is executed once per process, however often a config
naming it is loaded or validated."""


def import_plugins(modules: list[str] | tuple[str, ...], source: str = "trainer.imports") -> None:
    """Import each plug-in module (a module name, or ``path/to/file.py``) so that its registrations run.

    ``source`` is where the names came from (``trainer.imports`` or ``--import``), named in the error. A module
    already imported is not imported again. Raises ConfigError with one line naming the module and the fix.
    """
    import importlib
    import importlib.util
    import sys

    for name in modules:
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"{source}: {name!r} is not a module name or a path/to/file.py; fix {source}")
        name = name.strip()
        try:
            if name.endswith(".py"):
                path = Path(name).expanduser().resolve()
                if path in _IMPORTED_FILES:
                    continue
                if not path.is_file():
                    raise ConfigError(f"{source}: no such file {name!r}; fix the path in {source}")
                # a private module name, so that the file cannot shadow an installed package of the same stem
                spec = importlib.util.spec_from_file_location(f"hybrid_rl_plugin_{path.stem}", path)
                if spec is None or spec.loader is None:
                    raise ConfigError(f"{source}: cannot load {name!r} as Python; give a .py file or a module name")
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    sys.modules.pop(spec.name, None)
                    raise
                _IMPORTED_FILES[path] = module
            else:
                importlib.import_module(name)
        except ConfigError:
            raise
        except ModuleNotFoundError as e:
            if e.name and (name == e.name or name.startswith(e.name + ".")):  # the plug-in itself is missing, not a module it imports
                raise ConfigError(f"{source}: cannot import module {name!r} ({_line(e)}); put its directory on "
                                  f"PYTHONPATH, give its file as path/to/{name.rsplit('.', 1)[-1]}.py, or fix {source}") from e
            raise ConfigError(f"{source}: importing {name!r} failed ({type(e).__name__}: {_line(e)}); install what it "
                              f"imports or fix that module") from e
        except Exception as e:  # the module exists but raised while importing (e.g. a duplicate registration)
            raise ConfigError(f"{source}: importing {name!r} failed ({type(e).__name__}: {_line(e)}); fix that "
                              f"module") from e


def _line(e: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(e).split()) or type(e).__name__


def _check_registered(cfg: Config) -> None:
    for key in _REGISTERED_KEYS:
        section, name = key.split(".")
        _check_choice(key, getattr(getattr(cfg, section), name))


def _or(names: list[str]) -> str:
    """``a, b or c``."""
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def _positive(cfg: Config, keys: list[str]) -> None:
    for key in keys:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value <= 0:
            raise ConfigError(f"{key}={value} must be a positive integer")


# --------------------------------------------------------------------------- resume
RESUME_IGNORED = frozenset({"trainer.output_dir", "trainer.resume", "trainer.allow_config_change"})
"""Where a run lives and how it resumes, not what it trains: never compared on resume."""

RESUME_HARMLESS = frozenset({
    # how long, how often, where to log and what to diagnose
    "trainer.total_steps", "trainer.total_epochs", "trainer.test_freq", "trainer.val_before_train", "trainer.logger",
    "trainer.save_freq", "trainer.keep_last", "trainer.max_skipped_updates", "trainer.stale_policy",
    "trainer.profile_steps", "trainer.validation_data_dir", "trainer.imports", "trainer.stall_dump_s", "trainer.peak_tflops", "trainer.collective_timeout_s", "trainer.expandable_segments", "trainer.device", "reward.on_error",
    "reward.timeout_s", "reward.num_workers",
    # validation only
    "data.val_path", "data.val_split", "data.max_val_samples", "data.val_batch_size", "rollout.val_temperature",
    # memory/speed knobs that compute the same update (micro-batching, recomputation, offload, engine memory)
    "model.enable_gradient_checkpointing", "model.use_liger", "model.trust_remote_code",
    "actor.ppo_micro_batch_size_per_device", "actor.log_prob_micro_batch_size_per_device", "actor.use_dynamic_bsz",
    "actor.max_token_len_per_device", "actor.use_remove_padding", "actor.fused_logprob", "actor.share_prompts", "actor.use_torch_compile", "actor.accumulate_unsharded", "actor.param_offload",
    "actor.optimizer_offload", "ref.log_prob_micro_batch_size_per_device", "ref.offload",
    "critic.enable_gradient_checkpointing", "critic.ppo_micro_batch_size_per_device",
    "critic.forward_micro_batch_size_per_device", "critic.use_dynamic_bsz", "critic.max_token_len_per_device",
    "critic.param_offload", "critic.optimizer_offload",
    "rollout.max_num_seqs", "rollout.weight_sync_bucket_mb", "rollout.weight_load_replay", "rollout.free_cache_engine",
    "rollout.sleep_level", "rollout.gpu_memory_utilization", "rollout.max_num_batched_tokens", "rollout.max_model_len",
    "rollout.enforce_eager", "rollout.enable_prefix_caching", "rollout.cuda_stream", "rollout.engine_process",
})
"""Keys that may differ between a checkpoint's run and the run resuming it (each difference is warned about).
Every other key changes what is trained or the data order/shapes (model, data, algorithm, optimiser, sampling,
mode, placement, seed) and stops the resume unless ``trainer.allow_config_change=true``; a key added to the tree
is in that strict class until it is listed here."""


def resume_config_diff(saved: dict[str, Any], cfg: Config) -> tuple[list[str], list[str]]:
    """Compare a checkpoint's resolved config (a nested dict) with ``cfg``, key by key.

    Returns (differences that change what is trained, harmless differences), each as
    ``"key (checkpoint: old, now: new)"``. A key the saved config lacks (written before the key existed) is
    compared as its default; keys the tree no longer has are skipped.
    """
    now = _flatten(cfg.to_dict())
    before = {**_flatten(Config().to_dict()), **_flatten(saved)}
    strict, harmless = [], []
    for key, value in now.items():
        if key in RESUME_IGNORED or before[key] == value:
            continue
        line = f"{key} (checkpoint: {_fmt_value(before[key])}, now: {_fmt_value(value)})"
        (harmless if key in RESUME_HARMLESS else strict).append(line)
    return strict, harmless


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _fmt_value(v: Any) -> str:
    """A value as it is spelt in an override (``sync``, ``[jsonl]``, ``null``)."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return "[" + ",".join(_fmt_value(x) for x in v) + "]"
    if isinstance(v, bool) or v is None:
        return {True: "true", False: "false", None: "null"}[v]
    return repr(v)


# --------------------------------------------------------------------------- loading
def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a recipe YAML (or defaults when ``path`` is None) and apply ``key.sub=value`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(_missing_recipe(str(path)))
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe {str(path)!r} is not valid YAML: {_yaml_problem(e)}; fix the syntax "
                              f"there") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"recipe {str(path)!r} must be a mapping of sections (model, data, ...)")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key.sub=value (e.g. trainer.total_steps=10)")
        _set_dotted(raw, key.strip(), _parse_scalar(value))
    trainer = raw.get("trainer")
    if isinstance(trainer, dict) and "imports" in trainer:  # plug-ins register their names before the keys are checked
        import_plugins(_coerce(list[str], trainer["imports"], "trainer.imports"), "trainer.imports")
    return _build(Config, raw, "")


RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
"""The recipes of the checkout (``make train RECIPE=<name>`` runs ``recipes/<name>.yaml``)."""


def _missing_recipe(path: str) -> str:
    """A missing recipe's line, naming the recipes there (in the folder ``path`` names, else the checkout's)."""
    folder = Path(path).parent
    if not folder.is_dir() or not any(folder.glob("*.yaml")):
        folder = RECIPES_DIR
    names = sorted(p.stem for p in folder.glob("*.yaml"))
    if not names:
        return f"recipe {path!r} does not exist; pass the path of a recipe YAML file"
    try:
        shown = str(folder.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = str(folder)
    example = "cpu_successor" if "cpu_successor" in names else names[0]  # the CPU default, where it is there
    return (f"recipe {path!r} does not exist; the recipes in {shown}/ are {', '.join(names)}: pick one by name "
            f"(make train RECIPE={example}) or pass its file ({shown}/{example}.yaml)")


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error on one line, each part with its line and column (1-based, as editors count them)."""
    if not isinstance(e, yaml.MarkedYAMLError):
        return " ".join(str(e).split())
    parts = []
    for what, mark in ((e.context, e.context_mark), (e.problem, e.problem_mark)):
        if what:
            parts.append(f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark is not None else what)
    return "; ".join(parts) or " ".join(str(e).split())


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every valid dotted key (sections and leaves)."""
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out.append(key)
        if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else _resolve(cls, f.name)):
            out.extend(all_keys(_resolve(cls, f.name), key + "."))
    return out


def _parse_scalar(text: str) -> Any:
    # YAML rules give ints, floats, bools, null and [lists] the way recipes spell them.
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[:i + 1])} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def _resolve(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else "; see hybrid_rl/config.py for the valid keys"
    return ConfigError(f"unknown config key '{key}'{hint}")


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"'{prefix.rstrip('.')}' must be a section (a mapping), got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise _unknown(f"{prefix}{key}")
    kwargs = {}
    for name in names:
        if name not in raw:
            continue
        kwargs[name] = _coerce(hints[name], raw[name], f"{prefix}{name}")
        if f"{prefix}{name}" in _REGISTERED_KEYS:
            _check_choice(f"{prefix}{name}", kwargs[name])
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key)
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{key}={value!r} is not one of {list(args)}{hint}")
        return value
    if origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):
                try:
                    return float(value)  # YAML 1.1 reads "1e-6" as a string
                except ValueError:
                    pass
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return str(value)
    return value
