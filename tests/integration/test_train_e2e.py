"""End to end on CPU: the default recipe learns, runs repeat step for step, and the run directory is complete."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import trailing_means, train_until_learned

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_successor.yaml"


def _train(out: Path, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "hybrid_rl", "train", str(RECIPE), f"trainer.output_dir={out}",
           "trainer.logger=[jsonl,tensorboard]", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


REQUIRED = ["step", "reward/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac",
            "rollout/response_length_mean", "rollout/logprob_diff", "timing/gen", "timing/sync_weights", "timing/reward",
            "timing/old_log_prob", "timing/update", "timing/step", "perf/tokens_per_s"]


@pytest.mark.slow
@pytest.mark.learning
def test_default_recipe_learns(tmp_path):
    """The default recipe's bar: reward/mean ≤ 0.3 over the first 3 steps and greedy validation ≤ 0.3 before
    training; within the recipe's 250 steps, ≥ 0.8 over 3 consecutive steps and ≥ 0.8 on validation (every 10
    steps here; the run is stopped once both hold)."""
    out = tmp_path / "run"
    rows = train_until_learned([sys.executable, "-m", "hybrid_rl", "train", str(RECIPE), f"trainer.output_dir={out}",
                                "trainer.logger=[jsonl,tensorboard]", "trainer.test_freq=10"], out, val_bar=0.8)
    train = [r for r in rows if "reward/mean" in r]
    first = sum(r["reward/mean"] for r in train[:3]) / 3
    assert first <= 0.3, first
    assert max(trailing_means([r["reward/mean"] for r in train])) >= 0.8, [r["reward/mean"] for r in train]
    val = [r["val/reward_mean"] for r in rows if "val/reward_mean" in r]
    assert val[0] <= 0.3 and val[-1] >= 0.8, val
    for key in REQUIRED:
        assert key in train[-1], key
    # engine and trainer agree on the sampled tokens' log-probs every step (fp32)
    assert max(r["rollout/logprob_diff"] for r in train) < 1e-5
    assert (tmp_path / "run" / "config.yaml").exists()
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_same_seed_same_metrics(tmp_path):
    # a CPU "peak" of 1 TFLOP/s (2 cores reach a few %) so that MFU is logged here too (GPUs are looked up by name)
    a = _train(tmp_path / "a", "trainer.total_steps=3", "trainer.test_freq=0", "trainer.val_before_train=false",
               "trainer.peak_tflops=1")
    b = _train(tmp_path / "b", "trainer.total_steps=3", "trainer.test_freq=0", "trainer.val_before_train=false")
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/"))} for r in rows]
    assert strip(a) == strip(b)
    for row in a:  # MFU of each pass, and the step's time outside its named phases
        assert 0 < row["perf/mfu_update"] < 1 and 0 < row["perf/mfu_log_prob"] < 1, row
        assert 0 <= row["timing/switch"] and 0 <= row["timing/other"] < row["timing/step"]
    assert "perf/mfu_update" not in b[0]  # an unknown device and no trainer.peak_tflops: not logged
    c = _train(tmp_path / "c", "trainer.total_steps=3", "trainer.test_freq=0", "trainer.val_before_train=false",
               "trainer.seed=1")
    assert strip(a) != strip(c)
