"""The checks that span sections of the config tree, each a small function of the whole ``Config``.

A section's own keys are checked by its ``validate``; what lives here relates keys of several sections (batch
sizes that must divide across ranks, a mode that another section's option needs). Each raises ConfigError naming
the keys and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybrid_rl.config.errors import ConfigError, join_or
from hybrid_rl.config.geometry import data_parallel_size, mini_batch_seqs
from hybrid_rl.config.registered import registry

if TYPE_CHECKING:
    from hybrid_rl.config.tree import Config


def check_split(cfg: "Config", world: int) -> int:
    """``trainer.placement=split`` on ``world`` ranks; returns the trainer ranks (what batch sizes must divide)."""
    t, d = cfg.trainer, cfg.data
    if world < 2:
        raise ConfigError("trainer.placement=split needs at least 2 ranks (one generates, one trains); "
                          "launch more processes (make train GPUS=2) or use trainer.placement=colocated")
    n_roll, n_train = cfg.split_layout(world)
    if not 0 < n_roll < world:
        raise ConfigError(f"trainer.rollout_ranks={t.rollout_ranks} must be in 1..{world - 1} on {world} ranks")
    if d.train_batch_size % n_roll:
        raise ConfigError(f"data.train_batch_size={d.train_batch_size} must be divisible by the {n_roll} rollout ranks "
                          f"(trainer.rollout_ranks); set it to a multiple of {n_roll}")
    if cfg.actor.param_offload or cfg.actor.optimizer_offload:
        raise ConfigError("trainer.placement=split keeps the actor on its own GPUs, so actor.param_offload/"
                          "optimizer_offload have nothing to give way to; set them to false")
    return n_train


def check_groups(cfg: "Config") -> None:
    """A group estimator needs several samples per prompt."""
    estimators = registry("algorithm.adv_estimator")
    if estimators.info(cfg.algorithm.adv_estimator).needs_groups and cfg.rollout.n < 2:
        alone = [n for n in estimators if not (estimators.info(n).needs_groups or estimators.info(n).needs_critic)]
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares the samples of one prompt, "
                          f"so rollout.n must be >= 2 (got {cfg.rollout.n}); raise rollout.n or use {join_or(alone)}")


def check_overlong(cfg: "Config") -> None:
    """The overlong buffer fits inside the response length."""
    buffer, cap = cfg.reward.overlong_buffer_len, cfg.data.max_response_length
    if not 0 <= buffer < cap:
        raise ConfigError(f"reward.overlong_buffer_len={buffer} must be >= 0 and below "
                          f"data.max_response_length={cap} (0 = off; DAPO used 4k of 20k)")


def check_prompt_shares(cfg: "Config", world: int) -> None:
    """Every training rank holds whole prompts (a prompt's samples stay on one rank)."""
    tbs = cfg.data.train_batch_size
    if tbs % world:
        raise ConfigError(f"data.train_batch_size={tbs} must be divisible by the {world} ranks "
                          f"(a prompt's samples stay on one rank); set it to a multiple of {world}")


def check_sequence_parallel(cfg: "Config", world: int) -> None:
    """``actor.ulysses_sequence_parallel_size`` groups the ``world`` training ranks evenly."""
    sp = cfg.actor.ulysses_sequence_parallel_size
    if world % sp:
        raise ConfigError(f"actor.ulysses_sequence_parallel_size={sp} must divide the {world} training ranks")


def check_update_batches(cfg: "Config", key: str, world: int) -> None:
    """The ``actor`` or ``critic`` (``key``) mini-batches divide the batch, the data-parallel shares of the ``world``
    training ranks, and into micro-batches."""
    section, tbs = getattr(cfg, key), cfg.data.train_batch_size
    dp = data_parallel_size(cfg, world)
    mini, micro = section.ppo_mini_batch_size, section.ppo_micro_batch_size_per_device
    if tbs % mini:
        raise ConfigError(f"data.train_batch_size={tbs} must be divisible by {key}.ppo_mini_batch_size={mini}; "
                          f"lower {key}.ppo_mini_batch_size to a divisor")
    if mini % dp:
        raise ConfigError(f"{key}.ppo_mini_batch_size={mini} must be divisible by the {dp} data-parallel ranks "
                          f"(ranks / actor.ulysses_sequence_parallel_size); set it to a multiple of {dp}")
    seqs = mini_batch_seqs(section, dp, cfg.rollout.n)
    if not section.use_dynamic_bsz and seqs % micro:  # a token budget cuts otherwise
        what = "a mini-batch" if key == "actor" else f"a {key} mini-batch"
        raise ConfigError(f"{what} holds {seqs} sequences per device ({key}.ppo_mini_batch_size / data-parallel ranks "
                          f"× rollout.n), not divisible by {key}.ppo_micro_batch_size_per_device={micro}; use a "
                          f"divisor of {seqs}")


def check_token_budgets(cfg: "Config") -> None:
    """A token budget (``use_dynamic_bsz``) holds one full sequence."""
    d, a, c = cfg.data, cfg.actor, cfg.critic
    full = d.max_prompt_length + d.max_response_length
    if a.use_dynamic_bsz and a.max_token_len_per_device < full:
        raise ConfigError(f"actor.max_token_len_per_device={a.max_token_len_per_device} must hold one full sequence: "
                          f"raise it to at least data.max_prompt_length + data.max_response_length = {full}")
    if cfg.need_critic and c.use_dynamic_bsz and c.max_token_len_per_device < full:
        raise ConfigError(f"critic.max_token_len_per_device={c.max_token_len_per_device} must hold one full sequence: "
                          f"raise it to at least {full}")


def check_engines(cfg: "Config", world: int) -> None:
    """Each engine's options (``rollout.<name>``), checked by the engine: in full for the one ``rollout.name`` picks."""
    for name, options in cfg.rollout.engine_options().items():
        try:
            options.validate(cfg, world, in_use=name == cfg.rollout.name)
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None


def check_policy_loss(cfg: "Config") -> None:
    """GSPO clips one ratio per sequence and CISPO caps a weight: neither has a dual clip."""
    if cfg.policy_loss in ("gspo", "cispo") and cfg.actor.clip_ratio_c is not None:
        raise ConfigError(f"actor.clip_ratio_c={cfg.actor.clip_ratio_c}: actor.policy_loss={cfg.policy_loss} has no "
                          f"dual clip; set actor.clip_ratio_c=null")


def check_filter_groups(cfg: "Config") -> None:
    """Dynamic sampling needs the rewards before the batch is final, and a group estimator."""
    t, alg = cfg.trainer, cfg.algorithm
    if not alg.filter_groups.enable:
        return
    if t.mode != "sync" or t.placement != "colocated" or t.partial_rollouts:
        raise ConfigError("algorithm.filter_groups.enable=true needs trainer.mode=sync (colocated, no "
                          "partial rollouts): refills are generated after the step's rewards are known")
    estimators = registry("algorithm.adv_estimator")
    if not estimators.info(alg.adv_estimator).needs_groups:
        groups = [name for name in estimators.names() if estimators.info(name).needs_groups]
        raise ConfigError(f"algorithm.filter_groups.enable=true drops groups of equal rewards, which only a group "
                          f"estimator gives no gradient; algorithm.adv_estimator={alg.adv_estimator} "
                          f"is not one: use {join_or(groups)}, or algorithm.filter_groups.enable=false")


def check_partial(cfg: "Config") -> None:
    """Partial rollouts mix weight versions in a sample: the engine's log-probs cannot be the proximal policy."""
    if cfg.trainer.partial_rollouts and cfg.actor.old_log_prob == "engine":
        raise ConfigError("trainer.partial_rollouts=true with actor.old_log_prob=engine would make the proximal "
                          "policy the mixed-version behaviour one (no correction); set actor.old_log_prob=auto")


def check_multi_turn(cfg: "Config") -> None:
    """Multi-turn rollouts build each trajectory turn by turn in one generate call: no partial rollouts (a carried
    trajectory would need its environment carried too) and no forced lengths."""
    e, t = cfg.env, cfg.trainer
    if e.name is None:
        return
    if t.partial_rollouts:
        raise ConfigError(f"trainer.partial_rollouts=true with env.name={e.name}: partial rollouts would carry a "
                          f"trajectory's environment between steps, which multi-turn rollouts do not; set "
                          f"trainer.partial_rollouts=false (overlap mode and split placement work with env.name)")
    if cfg.rollout.forced_lengths is not None:
        raise ConfigError(f"rollout.forced_lengths with env.name={e.name}: forced lengths ignore where a turn ends; "
                          f"set rollout.forced_lengths=null")
    if cfg.rollout.name == "vllm" and cfg.rollout.vllm.tensor_parallel_size > 1:
        raise ConfigError(f"env.name={e.name} with rollout.vllm.tensor_parallel_size="
                          f"{cfg.rollout.vllm.tensor_parallel_size}: the turns run on vLLM's interruptible path, "
                          f"which the ranks of one engine cannot share; set rollout.vllm.tensor_parallel_size=1")
    if e.max_turn_tokens is not None and e.max_turn_tokens > cfg.data.max_response_length:
        raise ConfigError(f"env.max_turn_tokens={e.max_turn_tokens} is more than the whole trajectory may hold "
                          f"(data.max_response_length={cfg.data.max_response_length}); lower it or set it to null")


def check_offload(cfg: "Config") -> None:
    """Offloading the actor needs the idle phase of sync mode."""
    if cfg.trainer.mode == "overlap" and (cfg.actor.param_offload or cfg.actor.optimizer_offload):
        raise ConfigError("actor.param_offload/actor.optimizer_offload need trainer.mode=sync: in overlap mode the actor "
                          "trains while the engine generates, so there is no idle phase to offload in")


def check_reward_source(cfg: "Config") -> None:
    """A ``chat`` task has no answers to score: its reward comes from a reward model, an environment or a function."""
    r = cfg.reward
    if (cfg.data.task == "chat" and r.function in ("auto", "none") and r.model.path is None and cfg.env.name is None
            and not r.extra_functions and r.remote.url is None):
        raise ConfigError(f"data.task=chat has no answers and reward.function={r.function} scores nothing (the chat "
                          f"task's own is 'none'), so every reward would be 0; set reward.model.path to a reward model "
                          f"(a sequence classifier) or reward.function to a function of the response")


def check_val_only(cfg: "Config") -> None:
    """``trainer.val_only`` validates, so it needs validation prompts."""
    if cfg.trainer.val_only and not cfg.data.val_path:
        raise ConfigError("trainer.val_only=true validates and stops, but data.val_path is null; set data.val_path "
                          "to the prompts to validate on")
