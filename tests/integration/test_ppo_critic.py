"""PPO with a critic end to end on CPU: the critic's phases run and are checkpointed, and the default task learns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_rl.checkpoint import find_latest

from helpers import trailing_means, train_until_learned

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_successor_gae.yaml"
VOLATILE = ("timing/", "perf/")
# a small, fast variant of the recipe that exercises every critic switch: warm-up, offload, adaptive KL in reward
SMALL = ["trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[jsonl]", "data.train_batch_size=16",
         "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_device=16", "critic.ppo_mini_batch_size=8",
         "critic.ppo_micro_batch_size_per_device=16",
         "actor.lr=0.01", "critic.lr=0.001", "critic.freeze_actor_steps=1", "critic.param_offload=true",
         "critic.optimizer_offload=true", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
         "algorithm.kl_ctrl.kl_coef=0.05", "algorithm.kl_ctrl.target_kl=0.001", "algorithm.kl_ctrl.horizon=100"]


def _train(out: Path, *overrides: str, recipe: Path = RECIPE) -> list[dict]:
    cmd = [sys.executable, "-m", "hybrid_rl", "train", str(recipe), f"trainer.output_dir={out}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _critic_params(out: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint import FileSystemReader, load

    from hybrid_rl.workers.critic import build_value_model

    model = build_value_model("builtin:tiny-qwen2")
    state = {"critic": {"model": model.state_dict()}}
    load(state, storage_reader=FileSystemReader(str(find_latest(out / "checkpoints"))), no_dist=True)
    return {k: v.clone() for k, v in state["critic"]["model"].items()}


DENSE_REWARD = """
def length(response, ground_truth):
    return len(response) / 4  # dense and easy: every step has returns to regress and advantages to follow
"""


@pytest.mark.slow
def test_critic_phases_warmup_kl_control_and_resume(tmp_path):
    """Step 1 trains only the critic, later steps both; the adaptive β moves; a run stopped at step 2 and resumed
    ends exactly where the uninterrupted run ends (critic weights, AdamW state, schedule, β included)."""
    reward = tmp_path / "dense_reward.py"
    reward.write_text(DENSE_REWARD)
    small = [*SMALL, f"reward.function={reward}:length", "reward.num_workers=0"]
    full = _train(tmp_path / "full", *small, "trainer.total_steps=4", "trainer.save_freq=2")
    for key in ("timing/values", "timing/update_critic", "critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm",
                "critic/values_mean", "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"):
        assert all(key in r for r in full), key
    assert "actor/pg_loss" not in full[0] and "timing/update" not in full[0]  # critic warm-up: the actor waits
    assert all("actor/pg_loss" in r for r in full[1:])
    assert full[0]["rollout/weight_version"] == full[1]["rollout/weight_version"] == 0  # no actor update in step 1
    beta = [r["actor/reward_kl_penalty_coeff"] for r in full]
    assert beta[0] == pytest.approx(0.05) and beta[-1] != beta[0]  # adapted between steps
    assert all(r["critic/skipped_updates"] == 0 and r["critic/grad_norm"] > 0 for r in full)
    assert full[-1]["actor/reward_kl_penalty"] > 0  # the actor has moved away from the reference

    first = _train(tmp_path / "resumed", *small, "trainer.total_steps=2", "trainer.save_freq=2")
    resumed = _train(tmp_path / "resumed", *small, "trainer.total_steps=4", "trainer.save_freq=2")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and _stable(first) == _stable(resumed)[:2]
    assert _stable(resumed) == _stable(full)
    a, b = _critic_params(tmp_path / "full"), _critic_params(tmp_path / "resumed")
    assert a.keys() == b.keys() and any(k.startswith("value_head") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert a["value_head.weight"].abs().sum() > 0  # trained away from its zero init


@pytest.mark.slow
def test_resume_of_a_checkpoint_without_critic_names_the_problem(tmp_path):
    """A GRPO checkpoint cannot silently continue as PPO with a critic (a new critic would start from scratch)."""
    grpo = ROOT / "recipes" / "cpu_successor.yaml"
    common = ["trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.total_steps=1",
              "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4",
              "actor.ppo_micro_batch_size_per_device=32"]
    _train(tmp_path / "run", *common, recipe=grpo)
    cmd = [sys.executable, "-m", "hybrid_rl", "train", str(grpo), f"trainer.output_dir={tmp_path / 'run'}", *common,
           "trainer.total_steps=2", "algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=8", "critic.ppo_micro_batch_size_per_device=32",
           "trainer.allow_config_change=true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode != 0 and "holds no critic" in proc.stderr, proc.stderr[-2000:]


def _learns(rows: list[dict]) -> None:
    train = [r for r in rows if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in train]
    assert sum(rewards[:3]) / 3 <= 0.3 and max(trailing_means(rewards)) >= 0.8, [round(r, 2) for r in rewards[-10:]]
    # the critic explains part of the returns by then (the run stops at the step the bar is reached: the last few)
    assert max(r["critic/vf_explained_var"] for r in train[-5:]) > 0


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_gae_learns_the_default_task(tmp_path, mode):
    """adv_estimator=gae takes the reward from ≤ 0.3 to a 3-step mean ≥ 0.8 within the recipe's steps, in sync and
    overlap mode (the run is stopped once it gets there)."""
    out = tmp_path / mode
    _learns(train_until_learned([sys.executable, "-m", "hybrid_rl", "train", str(RECIPE),
                                 f"trainer.output_dir={out}", f"trainer.mode={mode}", "trainer.test_freq=0",
                                 "trainer.val_before_train=false", "trainer.logger=[jsonl]", "trainer.save_freq=-1"],
                                out))
