"""CISPO through the trainer: ``actor.policy_loss=cispo`` learns the default task (``learning``)."""

from __future__ import annotations

import sys

import pytest

from helpers import ROOT, trailing_means, train_until_learned


@pytest.mark.slow
@pytest.mark.learning
def test_cispo_learns_the_default_task(tmp_path):
    """``actor.policy_loss=cispo`` (weight cap 1 + 4) takes the default task's reward from ≤ 0.3 to a 3-step mean
    ≥ 0.8 within the recipe's 250 steps (stopped once there; about 150 steps on 2 cores)."""
    out = tmp_path / "cispo"
    rows = train_until_learned([sys.executable, "-m", "hybrid_rl", "train", str(ROOT / "recipes" / "cpu_successor.yaml"),
                                f"trainer.output_dir={out}", "trainer.logger=[jsonl]", "trainer.test_freq=0",
                                "trainer.val_before_train=false", "trainer.save_freq=-1", "actor.policy_loss=cispo",
                                "actor.clip_ratio_high=4.0"], out)
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert sum(rewards[:3]) / 3 <= 0.3
    assert max(trailing_means(rewards)) >= 0.8, [round(r, 2) for r in rewards[-10:]]
