"""A reward model through the trainer, end to end on CPU (``recipes/cpu_reward_model.yaml``).

- The reward of a run is ``reward.model.weight`` × the model's score (``reward.function=none``), in training and in
  validation, from a file of ``chat`` prompts too, in sync and overlap mode.
- ``rollout.val_n``: validation's mean@n and best@n, recomputed from the samples the run wrote.
- Learning (``learning``): the tiny policy learns what the tiny reward model prefers: its mean score over the last
  steps is above the best score of any response the untrained policy sampled in its first step, and the greedy
  validation score rises.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import ROOT, run_checked

RECIPE = ROOT / "recipes" / "cpu_reward_model.yaml"


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _train(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "hybrid_rl", "train", str(RECIPE), f"trainer.output_dir={out}",
            "trainer.logger=[jsonl]", "trainer.save_freq=-1", *overrides]


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_the_reward_is_the_weighted_model_score(tmp_path, mode):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": str(d)} if d % 2 else
                                          {"messages": [{"role": "user", "content": str(d)}]}) + "\n"
                               for d in range(10)))
    out = tmp_path / "run"
    run_checked(_train(out, f"trainer.mode={mode}", "trainer.total_steps=3", "trainer.test_freq=3",
                       "reward.model.weight=0.5", "data.task=chat", f"data.train_path={prompts}",
                       f"data.val_path={prompts}", "data.train_batch_size=8", "rollout.n=4",
                       "actor.ppo_mini_batch_size=8",
                       "actor.ppo_micro_batch_size_per_device=32"), timeout=300)
    rows = _rows(out)
    train = [r for r in rows if "reward/mean" in r]
    val = [r for r in rows if "val/reward_mean" in r]
    assert len(train) == 3 and len(val) == 2  # before training and at step 3
    for r in train:
        assert r["reward/mean"] == pytest.approx(0.5 * r["reward/model_mean"], abs=1e-6)
        assert r["reward/model_truncated"] == 0.0 and r["reward/model_mean"] != 0.0
    for r in val:
        assert r["val/reward_mean"] == pytest.approx(0.5 * r["val/model_mean"], abs=1e-6)


def test_validation_with_n_samples_reports_mean_and_best_of_n(tmp_path):
    """``rollout.val_n=4`` at temperature 1: ``val/reward_mean`` and ``val/reward_best_of_n`` are the mean of every
    sample's score and the mean of each prompt's best, as recomputed from the samples the run wrote."""
    out = tmp_path / "val_n"
    run_checked(_train(out, "trainer.total_steps=1", "trainer.test_freq=1", "rollout.val_n=4",
                       "rollout.val_temperature=1.0", "data.max_val_samples=20", "trainer.validation_data_dir=val"),
                timeout=300)
    vals = [r for r in _rows(out) if "val/reward_mean" in r]
    assert len(vals) == 2
    for row, step in zip(vals, (0, 1)):
        samples = [json.loads(line) for line in (out / "val" / f"step_{step:08d}_rank0.jsonl").read_text().splitlines()]
        by_prompt: dict[int, list[float]] = {}
        for s in samples:
            by_prompt.setdefault(s["index"], []).append(s["score"])
        assert len(samples) == 80 and sorted(len(v) for v in by_prompt.values()) == [4] * 20
        assert row["val/reward_mean"] == pytest.approx(sum(s["score"] for s in samples) / 80, abs=1e-5)
        assert row["val/reward_best_of_n"] == pytest.approx(sum(max(v) for v in by_prompt.values()) / 20, abs=1e-5)
        assert row["val/reward_best_of_n"] > row["val/reward_mean"]


@pytest.mark.slow
@pytest.mark.learning
def test_the_policy_learns_what_the_reward_model_prefers(tmp_path):
    out = tmp_path / "learn"
    run_checked(_train(out), timeout=900)
    rows = _rows(out)
    train = [r for r in rows if "reward/model_mean" in r]
    val = [r["val/model_mean"] for r in rows if "val/model_mean" in r]
    assert len(train) == 80
    last = sum(r["reward/model_mean"] for r in train[-10:]) / 10
    # the mean of the last steps beats the best single response of the first step's 1,024 samples
    assert last > train[0]["reward/max"], (last, train[0]["reward/max"], [round(r["reward/model_mean"], 3)
                                                                         for r in train[::10]])
    assert val[-1] > val[0], val
