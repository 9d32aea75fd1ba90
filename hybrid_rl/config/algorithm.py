"""The ``algorithm`` and ``reward`` sections: advantages, KL terms, off-policy correction, and the reward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from hybrid_rl.config.errors import ConfigError
from hybrid_rl.config.fields import harmless


@dataclass
class RolloutCorrectionConfig:
    apply: Literal["auto", "always", "never"] = "auto"
    """Decoupled PPO (π_θ/π_prox clipped, weighted by π_prox/π_behav); ``auto`` = only in overlap mode with staleness ≥ 1."""
    method: str = "token_truncate"
    """How the behaviour ratio ρ = π_prox/π_behav weighs each token's loss, a name in
    ``hybrid_rl.algorithms.ROLLOUT_CORRECTIONS``: ``token_truncate`` min(ρ_t, cap) (AReaL, TIS); ``sequence_truncate``
    min(∏ρ_t, cap) per sequence; ``sequence_mask`` ∏ρ_t, the sequence dropped above ``cap``; ``geo_mask`` weight 1, the
    sequence dropped when the geometric mean of its ρ_t leaves [1 − ``geo_delta``, 1 + ``geo_delta``] (SkyRL);
    ``token_mask`` ρ_t, the token dropped outside [``band_low``, ``band_high``] (IcePop). Metric: the share of
    response tokens truncated (``rollout/is_truncated_frac``, the truncations) or masked (``rollout/is_masked_frac``)."""
    cap: Optional[float] = 2.0
    """``token_truncate``, ``sequence_truncate``: the bound on the weight; ``sequence_mask``: the sequence ratio above
    which a sequence is dropped (null = no bound: plain importance weights)."""
    geo_delta: float = 0.01
    """``geo_mask``: δ, the band [1 − δ, 1 + δ] a sequence's geometric-mean ratio must stay in (SkyRL: 0.01)."""
    band_low: float = 0.5
    """``token_mask``: tokens with ρ_t below this are dropped (IcePop's α = 0.5; 0 = no lower bound)."""
    band_high: float = 5.0
    """``token_mask``: tokens with ρ_t above this are dropped (IcePop's β = 5)."""


    def validate(self) -> None:
        key = "algorithm.rollout_correction"
        if self.cap is not None and self.cap <= 1:
            raise ConfigError(f"{key}.cap={self.cap} must be > 1 (or null for no cap)")
        if not 0 < self.geo_delta < 1:
            raise ConfigError(f"{key}.geo_delta={self.geo_delta} must be in (0, 1): sequences are kept while their "
                              f"geometric-mean ratio is within [1 - geo_delta, 1 + geo_delta] (SkyRL uses 0.01)")
        if not 0 <= self.band_low < 1 < self.band_high:
            raise ConfigError(f"{key}.band_low={self.band_low}, {key}.band_high={self.band_high}: the band must hold "
                              f"1 (0 <= band_low < 1 < band_high), or on-policy tokens would be dropped; IcePop uses "
                              f"0.5 and 5")


REMOVED_KEYS = {f"algorithm.rollout_correction.{k}": "replaced by algorithm.rollout_correction.method (token_truncate, "
                "sequence_truncate, sequence_mask, geo_mask, token_mask); delete the key and name the method"
                for k in ("level", "mode")}
"""Keys of this section that no longer exist, with what to do instead."""


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


    def validate(self) -> None:
        if self.kl_coef < 0:
            raise ConfigError(f"algorithm.kl_ctrl.kl_coef={self.kl_coef} must be >= 0")
        if self.type == "adaptive" and (self.target_kl <= 0 or self.horizon <= 0):
            raise ConfigError(f"algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.target_kl > 0 and "
                              f"algorithm.kl_ctrl.horizon > 0 (got {self.target_kl} and {self.horizon})")


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


    def validate(self) -> None:
        if self.enable and self.max_rounds < 0:
            raise ConfigError(f"algorithm.filter_groups.max_rounds={self.max_rounds} must be >= 0 (refill generations "
                              f"per step; 0 = none, the batch trains as generated and the counts are logged)")


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


    def validate(self) -> None:
        if self.gae_std_floor < 0:
            raise ConfigError(f"algorithm.gae_std_floor={self.gae_std_floor} must be >= 0 (0 = plain whitening)")
        self.kl_ctrl.validate()
        self.rollout_correction.validate()
        self.filter_groups.validate()


@dataclass
class RewardModelConfig:
    path: Optional[str] = None
    """A reward model scoring each response in its conversation: a Hugging Face sequence-classification checkpoint
    with one output (``AutoModelForSequenceClassification``, ``num_labels=1``; a hub name, a local directory or
    ``builtin:tiny-qwen2-rm``). Its score times ``weight`` is added to ``reward.function``'s (``reward.function=none``:
    the model's alone). null: no reward model."""
    tokenizer_path: Optional[str] = None
    """The reward model's tokenizer, when not in ``path``. Its chat template formats the conversation it scores (the
    prompt's messages, then the response as the assistant's turn); without one, the prompt text and the response."""
    weight: float = 1.0
    """The factor on the reward model's score in the reward (``reward/model_mean`` logs the score before it)."""
    micro_batch_size: int = harmless(8)
    """Conversations per forward pass of the reward model."""
    max_length: int = 4096
    """Tokens of a scored conversation; a longer one keeps its last ``max_length`` (the response's end, where the
    score is read), counted in ``reward/model_truncated``."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """``auto``: bf16 on GPUs, fp32 on CPU."""
    offload: bool = harmless(True)
    """On GPUs: the weights wait in page-locked host memory between reward phases and are on the GPU only while
    they score (on CPU runs they stay where they are)."""
    trust_remote_code: bool = harmless(False)
    """Run the reward model's own modelling code from its checkpoint (as ``model.trust_remote_code``)."""

    def validate(self) -> None:
        if self.path is None:
            return
        if self.micro_batch_size < 1:
            raise ConfigError(f"reward.model.micro_batch_size={self.micro_batch_size} must be >= 1 (conversations "
                              f"per forward pass)")
        if self.max_length < 2:
            raise ConfigError(f"reward.model.max_length={self.max_length} must be >= 2 tokens")


@dataclass
class RemoteRewardConfig:
    url: Optional[str] = None
    """A reward server's endpoint (OpenRLHF's remote reward model protocol, ``rewards/remote.py``): each batch
    posted as ``{"query", "prompts", "responses", "labels"}``, answered with ``{"rewards": [...]}``; its score times
    ``weight`` adds to ``reward.function``'s. null: none."""
    weight: float = 1.0
    """The factor on the server's reward (``reward/remote_mean`` logs it before the factor)."""
    batch_size: int = harmless(64)
    """Samples per request."""
    max_concurrency: int = harmless(4)
    """Requests in flight at once from each rank."""
    timeout_s: float = harmless(60.0)
    """Seconds one request may take before it fails (and is tried again, ``retries`` times)."""
    retries: int = harmless(2)
    """Further tries of a failed request, after 0.5, 1, 2 ... s."""

    def validate(self) -> None:
        if self.url is None:
            return
        if self.batch_size < 1 or self.max_concurrency < 1 or self.retries < 0 or not self.timeout_s > 0:
            raise ConfigError("reward.remote: batch_size and max_concurrency must be >= 1, retries >= 0 and "
                              "timeout_s > 0")


@dataclass
class RewardConfig:
    function: str = "auto"
    """``auto`` (the task's own), a built-in name (``gsm8k``, ``math``, ``successor``, ``none``), or
    ``module:function`` / ``path/to/file.py:function``."""
    extra_functions: list[str] = field(default_factory=list)
    """More reward functions (the same forms as ``function``), each scoring every sample; the reward is
    ``function``'s score plus each one's times its ``extra_weights`` entry (e.g. a format reward beside the answer's).
    Each function's mean is logged as ``reward/function/<name>``."""
    extra_weights: list[float] = field(default_factory=list)
    """One weight per ``extra_functions`` entry (empty: 1 each)."""
    on_error: Literal["raise", "zero"] = harmless("raise")
    """A raising reward function (or one past ``timeout_s``) stops the run (``raise``) or scores 0 and is counted
    (``zero``, metric ``reward/errors``)."""
    timeout_s: float = harmless(30.0)
    """Seconds one reward call may run before it is abandoned and fails as ``on_error`` says (0 = no limit). Needs
    worker processes: with ``num_workers=0`` a long call is only reported."""
    num_workers: int = harmless(-1)
    """Processes that score a batch: -1 = auto (min(8, CPUs per rank) for a ``module:function`` and the ``math``
    built-in, none for the other built-ins, which take microseconds), 0 = the training process, N = N processes.
    Scores are the same either way."""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong punishment on the training reward (verl ``overlong_buffer.len``): a response within this
    many tokens of ``data.max_response_length`` loses reward linearly, up to ``overlong_penalty_factor`` at the cap
    (0 = off). Validation scores are left as they are."""
    overlong_penalty_factor: float = 1.0
    """The reward a response cut at the length cap loses (with ``overlong_buffer_len`` > 0)."""
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A reward model (sequence classification) whose score adds to the function's."""
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    """A reward server over HTTP whose score adds to the function's."""


    def validate(self) -> None:
        self.model.validate()
        self.remote.validate()
        if self.extra_weights and len(self.extra_weights) != len(self.extra_functions):
            raise ConfigError(f"reward.extra_weights has {len(self.extra_weights)} entries for "
                              f"{len(self.extra_functions)} reward.extra_functions; give one weight per function "
                              f"(or none: 1 each)")
        if self.overlong_penalty_factor < 0:
            raise ConfigError(f"reward.overlong_penalty_factor={self.overlong_penalty_factor} must be >= 0 "
                              f"(the reward a response cut at the cap loses)")
        if self.timeout_s < 0:
            raise ConfigError(f"reward.timeout_s={self.timeout_s} must be >= 0 seconds (0 = no limit)")
        if self.num_workers < -1:
            raise ConfigError(f"reward.num_workers={self.num_workers} must be -1 (auto), 0 (score in the training "
                              f"process) or a number of worker processes")
