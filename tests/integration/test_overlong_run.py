"""reward.overlong_buffer_len moves a policy: with a reward that is always 0, the overlong penalty is the only
signal, and the CPU recipe's tiny model learns to stop early; without it nothing moves (all advantages are 0).
Two 20-step in-process runs, ~10 s each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import cpu_dist
from hybrid_rl.config import load_config
from hybrid_rl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]


def _lengths(tmp_path: Path, name: str, *overrides: str) -> list[float]:
    zero = tmp_path / "zero_reward.py"
    zero.write_text("def score(response, ground_truth):\n    return 0.0\n")
    cfg = load_config(ROOT / "recipes" / "cpu_successor.yaml", [
        f"reward.function={zero}:score", "reward.num_workers=0", "data.max_response_length=8",
        "trainer.total_steps=20", "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=-1",
        "trainer.logger=[jsonl]", f"trainer.output_dir={tmp_path / name}", *overrides]).validate()
    Trainer(cfg, cpu_dist()).fit()
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["rollout/response_length_mean"] for r in rows if "rollout/response_length_mean" in r]


@pytest.mark.slow
def test_the_overlong_penalty_alone_teaches_the_model_to_stop(tmp_path):
    shaped = _lengths(tmp_path, "shaped", "reward.overlong_buffer_len=7")
    plain = _lengths(tmp_path, "plain")
    first, last = sum(shaped[:5]) / 5, sum(shaped[-5:]) / 5
    assert last < first - 1.0, shaped  # measured: 7.7 -> 5.4 over 20 steps (-> 1.5 by step 40); plain 7.7 throughout
    assert abs(sum(plain[-5:]) / 5 - sum(plain[:5]) / 5) < 0.3, plain
