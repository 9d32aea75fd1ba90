"""data.val_batch_size: validation generates in calls of that many prompts (default data.train_batch_size)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import cpu_dist
from hybrid_rl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_successor.yaml"
SMALL = ["data.num_synthetic=64", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
         "actor.ppo_micro_batch_size_per_device=8", "data.max_val_samples=10", "trainer.logger=[jsonl]", "trainer.total_steps=1", "trainer.test_freq=0",
         "trainer.val_before_train=true", "trainer.save_freq=-1", "data.max_response_length=4"]


@pytest.mark.parametrize(("extra", "calls"), [([], [4, 4, 2]), (["data.val_batch_size=10"], [10]),
                                              (["data.val_batch_size=3"], [3, 3, 3, 1])])
def test_validation_generates_in_val_batch_size_chunks(tmp_path, monkeypatch, extra, calls):
    from hybrid_rl.trainer import Trainer
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    seen = []
    generate = ActorRolloutRefWorker.generate

    def spy(self, prompts, *a, **k):
        if k.get("validate"):
            seen.append(len(prompts))
        return generate(self, prompts, *a, **k)

    monkeypatch.setattr(ActorRolloutRefWorker, "generate", spy)
    cfg = load_config(RECIPE, [*SMALL, *extra, f"trainer.output_dir={tmp_path / 'run'}"]).validate()
    trainer = Trainer(cfg, cpu_dist())
    try:
        out = trainer.validate()
    finally:
        trainer.close() if hasattr(trainer, "close") else None
    assert seen == calls
    assert 0.0 <= out["val/reward_mean"] <= 1.0


def test_val_batch_size_must_be_positive():
    with pytest.raises(ConfigError, match=r"data.val_batch_size=0 must be a positive number of prompts"):
        load_config(RECIPE, ["data.val_batch_size=0"]).validate()
