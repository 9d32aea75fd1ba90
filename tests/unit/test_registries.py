"""The extension story: a new advantage estimator, rollout engine, policy loss or reward is one function or class
plus one registration, config validation accepts exactly the registered names, and a name registers once.

Every registration made here is undone by a fixture, so other tests see the built-ins only.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import chat_prompts, cpu_dist, generate_batch, make_cfg, score_batch
from hybrid_rl import algorithms as alg
from hybrid_rl.algorithms import ADV_ESTIMATORS, POLICY_LOSSES, register_estimator, register_policy_loss
from hybrid_rl.config import Config, ConfigError, load_config
from hybrid_rl.rewards import BUILTIN_REWARDS, get_reward_fn, register_reward
from hybrid_rl.rollout import ROLLOUT_ENGINES, register_rollout_engine
from hybrid_rl.rollout.hf import HFRolloutEngine

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_successor.yaml"
SMALL = ["data.num_synthetic=64", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
         "actor.ppo_micro_batch_size_per_device=16", "data.max_val_samples=4", "trainer.logger=[jsonl]",
         "trainer.total_steps=1", "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=-1"]


# --------------------------------------------------------------------------- a new advantage estimator
CALLS: list[dict] = []


@torch.no_grad()
def mean_baseline_advantage(token_level_rewards, response_mask, scale: float = 1.0):
    """Sequence score minus the batch's mean score (no groups, no critic): the whole plug-in."""
    scores = (token_level_rewards * response_mask).sum(-1)  # [B]
    adv = scale * (scores - scores.mean()).unsqueeze(-1) * response_mask  # [B, R]
    CALLS.append(dict(adv=adv.clone(), mask=response_mask.clone(), scale=scale))
    return adv, adv.clone()


@pytest.fixture
def mean_baseline():
    CALLS.clear()
    register_estimator("mean_baseline", config=lambda algorithm: {"scale": algorithm.gamma})(mean_baseline_advantage)
    try:
        yield
    finally:
        ADV_ESTIMATORS.unregister("mean_baseline")


def parity_reward(response: str, ground_truth: str) -> float:
    """A reward that varies between random responses (the untrained model rarely gets the task right)."""
    return float(sum(map(ord, response)) % 2)


def test_registered_estimator_trains_a_step_through_the_config(mean_baseline, tmp_path, monkeypatch):
    from hybrid_rl.trainer import Trainer
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    updated_on = []

    def spy(update):
        def spy_update(self, batch, *a, **k):
            updated_on.append(batch["advantages"].clone())
            return update(self, batch, *a, **k)
        return spy_update

    monkeypatch.setattr(ActorRolloutRefWorker, "update_policy", spy(ActorRolloutRefWorker.update_policy))
    register_reward("parity", parity_reward)
    try:
        cfg = load_config(RECIPE, [*SMALL, f"trainer.output_dir={tmp_path / 'run'}", "reward.function=parity",
                                   "algorithm.adv_estimator=mean_baseline", "algorithm.gamma=0.5"]).validate()
        rows = Trainer(cfg, cpu_dist()).fit()
    finally:
        BUILTIN_REWARDS.unregister("parity")
    assert len(CALLS) == 1  # the driver's advantage phase called it, once for the step's batch
    adv, mask = CALLS[0]["adv"], CALLS[0]["mask"]
    assert CALLS[0]["scale"] == 0.5  # its config knob arrived (scale = algorithm.gamma)
    assert adv.shape[0] == 4 * 4 and adv.abs().sum() > 0  # 4 prompts × n=4 samples, rewards not all equal
    # its advantages are the ones the update trained on, and the ones logged (token mean; ~0 for a mean baseline)
    assert len(updated_on) == 1 and torch.equal(updated_on[0], adv)
    assert rows[-1]["actor/advantages_mean"] == pytest.approx(float(adv.sum() / mask.sum()), abs=1e-6)


def test_estimator_metadata_drives_validation(mean_baseline):
    # no groups: one sample per prompt is fine
    load_config(None, ["algorithm.adv_estimator=mean_baseline", "rollout.n=1"]).validate()
    register_estimator("grouped_mean", needs_groups=True)(mean_baseline_advantage)
    register_estimator("valued_mean", needs_critic=True)(mean_baseline_advantage)
    try:
        with pytest.raises(ConfigError, match=r"adv_estimator=grouped_mean compares the samples of one prompt, so rollout.n "
                                              r"must be >= 2 \(got 1\); raise rollout.n or use reinforce_pp or mean_baseline"):
            load_config(None, ["algorithm.adv_estimator=grouped_mean", "rollout.n=1"]).validate()
        # dynamic sampling's hint names the group estimators registered now, the plug-in among them
        with pytest.raises(ConfigError, match=r"is not one: use grpo, dr_grpo, rloo or grouped_mean, or "
                                              r"algorithm.filter_groups.enable=false$"):
            load_config(None, ["algorithm.adv_estimator=mean_baseline", "algorithm.filter_groups.enable=true"]).validate()
        # an estimator that needs a critic gets one (the critic's batch sizes are then checked too)
        assert load_config(None, ["algorithm.adv_estimator=valued_mean"]).validate().need_critic
        with pytest.raises(ConfigError, match="critic.ppo_mini_batch_size"):
            load_config(None, ["algorithm.adv_estimator=valued_mean", "critic.ppo_mini_batch_size=5"]).validate()
    finally:
        ADV_ESTIMATORS.unregister("grouped_mean")
        ADV_ESTIMATORS.unregister("valued_mean")


# --------------------------------------------------------------------------- a new rollout engine
class RecordingEngine(HFRolloutEngine):
    """The transformers engine, counting how it was built and used."""

    built_with: list = []

    @classmethod
    def from_config(cls, cfg, dist, tokenizer):
        cls.built_with.append((cfg.rollout.name, dist.rank))
        return super().from_config(cfg, dist, tokenizer)

    def generate(self, prompts, params):
        self.generated = getattr(self, "generated", 0) + 1
        return super().generate(prompts, params)


@pytest.fixture
def recording_engine():
    RecordingEngine.built_with = []
    register_rollout_engine("recording_hf", RecordingEngine)
    try:
        yield RecordingEngine
    finally:
        ROLLOUT_ENGINES.unregister("recording_hf")


def test_worker_builds_the_registered_engine_by_name(recording_engine):
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(make_cfg("rollout.name=recording_hf"), cpu_dist())
    assert type(worker.rollout) is RecordingEngine and RecordingEngine.built_with == [("recording_hf", 0)]
    with worker.rollout_mode():  # the sharding manager pushes into it and the worker generates with it
        batch = worker.generate(chat_prompts(worker))
    assert worker.rollout.generated == 1 and len(batch) == 4 * 4


def test_engine_registered_by_path_is_imported_on_first_use(recording_engine):
    register_rollout_engine("by_path", "test_registries:RecordingEngine")
    try:
        assert ROLLOUT_ENGINES["by_path"] is RecordingEngine
    finally:
        ROLLOUT_ENGINES.unregister("by_path")


def test_loading_a_vllm_config_imports_no_engine():
    """vLLM is registered by path: naming it in a config imports neither vLLM nor its engine module (nor torch)."""
    modules = ("vllm", "hybrid_rl.rollout.vllm", "hybrid_rl.rollout.hf", "torch")
    code = ("import sys; from hybrid_rl.config import load_config; load_config(None, ['rollout.name=vllm']); "
            f"print(sorted(m for m in {modules} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


# --------------------------------------------------------------------------- policy losses by name
def test_worker_computes_the_loss_through_the_registry(monkeypatch):
    """The worker's one loss call goes through POLICY_LOSSES by name, with the loss's own inputs."""
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    seen = []

    def spy_ppo(old_log_prob, **kw):
        seen.append(old_log_prob.shape)
        return alg.ppo_clip_loss(old_log_prob=old_log_prob, **kw)

    register_policy_loss("spy_ppo", inputs=lambda t, cfg: {"old_log_prob": t["old_log_probs"]})(spy_ppo)
    try:
        monkeypatch.setattr(Config, "policy_loss", property(lambda self: "spy_ppo"))
        worker = ActorRolloutRefWorker(make_cfg(), cpu_dist())
        metrics = worker.update_actor(score_batch(worker, generate_batch(worker)))
    finally:
        POLICY_LOSSES.unregister("spy_ppo")
    assert len(seen) == 1 and "actor/pg_loss" in metrics


def test_policy_loss_follows_rollout_correction():
    assert make_cfg().policy_loss == "ppo"
    assert make_cfg("algorithm.rollout_correction.apply=always").policy_loss == "decoupled_ppo"
    assert make_cfg("trainer.mode=overlap").policy_loss == "decoupled_ppo"  # apply=auto with staleness 1
    assert set(POLICY_LOSSES) >= {"ppo", "decoupled_ppo"}


# --------------------------------------------------------------------------- rewards
def test_registered_reward_is_a_builtin_name():
    def exact(response: str, ground_truth: str) -> float:
        return float(response.strip() == ground_truth)

    register_reward("exact")(exact)
    try:
        assert get_reward_fn("exact", "successor") is exact
        with pytest.raises(ValueError, match="module:function"):
            register_reward("my:reward", exact)
    finally:
        BUILTIN_REWARDS.unregister("exact")
    assert "exact" not in BUILTIN_REWARDS


# --------------------------------------------------------------------------- one name, one registration
@pytest.mark.parametrize("register", [
    lambda: register_estimator("grpo")(mean_baseline_advantage),
    lambda: register_policy_loss("ppo", inputs=lambda t, cfg: {})(alg.ppo_clip_loss),
    lambda: register_rollout_engine("hf", RecordingEngine),
    lambda: register_rollout_engine("vllm")(RecordingEngine),
    lambda: register_reward("gsm8k", lambda r, g: 0.0),
], ids=["estimator", "policy_loss", "engine", "engine_decorator", "reward"])
def test_a_duplicate_name_is_an_error_and_changes_nothing(register):
    before = {r.key: dict(r) for r in (ADV_ESTIMATORS, POLICY_LOSSES, ROLLOUT_ENGINES, BUILTIN_REWARDS)}
    with pytest.raises(ValueError, match="is already registered"):
        register()
    assert {r.key: dict(r) for r in (ADV_ESTIMATORS, POLICY_LOSSES, ROLLOUT_ENGINES, BUILTIN_REWARDS)} == before


# --------------------------------------------------------------------------- validation reads the registries
@pytest.mark.parametrize("key, registry", [("algorithm.adv_estimator", ADV_ESTIMATORS),
                                           ("rollout.name", ROLLOUT_ENGINES)])
def test_config_accepts_exactly_the_registered_names(key, registry):
    for name in registry:
        assert getattr(getattr(load_config(None, [f"{key}={name}"]), key.split(".")[0]), key.split(".")[1]) == name
    with pytest.raises(ConfigError) as ei:
        load_config(None, [f"{key}=not_registered"])
    assert str(ei.value) == f"{key}='not_registered' is not one of {registry.names()}"
    # validate() checks too (a Config built in code never went through the loader)
    cfg = Config()
    setattr(getattr(cfg, key.split(".")[0]), key.split(".")[1], "not_registered")
    with pytest.raises(ConfigError, match="is not one of"):
        cfg.validate()


def test_a_registered_name_becomes_valid_and_unregistering_removes_it(mean_baseline, recording_engine):
    cfg = load_config(None, ["algorithm.adv_estimator=mean_baseline", "rollout.name=recording_hf"]).validate()
    assert (cfg.algorithm.adv_estimator, cfg.rollout.name) == ("mean_baseline", "recording_hf")
    assert ADV_ESTIMATORS.names()[-1] == "mean_baseline" and ROLLOUT_ENGINES.names()[-1] == "recording_hf"
    ADV_ESTIMATORS.unregister("mean_baseline")
    try:
        with pytest.raises(ConfigError, match=r"algorithm.adv_estimator='mean_baseline' is not one of \['grpo', "
                                              r"'dr_grpo', 'rloo', 'reinforce_pp', 'gae'\]"):
            load_config(None, ["algorithm.adv_estimator=mean_baseline"])
    finally:
        register_estimator("mean_baseline")(mean_baseline_advantage)  # the fixture unregisters it again
