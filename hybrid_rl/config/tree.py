"""``Config``: the root of the tree (one field per section), its derived quantities, and ``validate``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hybrid_rl.config import checks
from hybrid_rl.config.actor import ActorConfig, CriticConfig, RefConfig
from hybrid_rl.config.algorithm import AlgorithmConfig, RewardConfig
from hybrid_rl.config.env import EnvConfig
from hybrid_rl.config.model import DataConfig, ModelConfig
from hybrid_rl.config.plugins import import_plugins
from hybrid_rl.config.registered import check_registered, registry
from hybrid_rl.config.rollout import RolloutConfig
from hybrid_rl.config.trainer import TrainerConfig
from hybrid_rl.rollout import engine_info


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
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn, tool-using rollouts (off unless ``env.name`` is set)."""
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
    def engine_logprobs(self) -> bool:
        """Whether training generations return the engine's log-probs (``rollout.logprobs``; ``auto``: where a phase
        reads them)."""
        if self.rollout.logprobs == "always":
            return True
        return (self.trainer.mode == "overlap" or self.use_rollout_correction or self.actor.old_log_prob == "engine"
                or self.policy_loss not in ("ppo", "gspo", "cispo") or self.env.name is not None)

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
        float32_as = engine_info(r.name).float32_as  # the push casts the actor's weights to it
        if float32_as is not None and self.model.dtype in ("float32", "auto"):
            return float32_as
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
        return registry("algorithm.adv_estimator").info(self.algorithm.adv_estimator).needs_critic

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
        """Every section's own keys, then the facts that span sections; raises ConfigError naming the key and the fix.
        ``world_size``: all ranks (under split placement the batch sizes divide across the trainer ranks)."""
        train_world = checks.check_split(self, world_size) if self.trainer.placement == "split" else world_size
        for section in (self.data, self.rollout, self.actor, self.ref):
            section.validate()
        import_plugins(self.trainer.imports, "trainer.imports")  # a Config built in code never went through the loader
        check_registered(self)
        for section in (self.model, self.algorithm, self.reward, self.trainer, self.env):
            section.validate()
        checks.check_overlong(self)
        checks.check_reward_source(self)
        checks.check_val_only(self)
        checks.check_groups(self)
        checks.check_prompt_shares(self, train_world)
        checks.check_sequence_parallel(self, train_world)
        checks.check_update_batches(self, "actor", train_world)
        if self.need_critic:
            self.critic.validate()
            checks.check_update_batches(self, "critic", train_world)
        checks.check_token_budgets(self)
        checks.check_engines(self, world_size)
        checks.check_policy_loss(self)
        checks.check_filter_groups(self)
        checks.check_partial(self)
        checks.check_multi_turn(self)
        checks.check_offload(self)
        return self
