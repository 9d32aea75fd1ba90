"""``trainer.balance_batch`` on two CPU ranks: the groups move, the training does not change.

Forced response lengths (lognormal) make the ranks' token counts differ; a reward that varies with the response
gives non-zero advantages. Two runs of 3 steps (2 mini-batches each), one balancing and one not, must log the same
figures (up to the order of float sums), while the balanced one reports a smaller token imbalance."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import ROOT, run_checked

pytestmark = pytest.mark.slow
SKIP = ("timing/", "perf/")


def _run(out: Path, reward: Path, balance: bool) -> list[dict]:
    run_checked([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                 "-m", "hybrid_rl", "train", str(ROOT / "recipes" / "cpu_successor.yaml"),
                 f"trainer.output_dir={out}", "trainer.logger=[jsonl]", "trainer.save_freq=-1", "trainer.total_steps=3",
                 "trainer.test_freq=0", "trainer.val_before_train=false", "data.train_batch_size=8", "rollout.n=4",
                 "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_device=4",
                 "data.max_response_length=24", "rollout.forced_lengths=lognormal:8:0.9",
                 f"reward.function={reward}:score", "reward.num_workers=0", f"trainer.balance_batch={str(balance).lower()}"],
                timeout=400)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_balancing_moves_groups_but_not_the_update(tmp_path):
    reward = tmp_path / "r.py"
    reward.write_text("def score(response, ground_truth):\n    return response.count(ground_truth) / (1 + len(response))\n")
    on, off = _run(tmp_path / "on", reward, True), _run(tmp_path / "off", reward, False)
    assert [r["step"] for r in on] == [1, 2, 3] == [r["step"] for r in off]
    assert any(r["actor/grad_norm"] > 0 for r in off)  # or equality would say nothing
    for a, b in zip(on, off):
        keys = {k for k in b if not k.startswith(SKIP)}
        assert keys <= set(a)
        diff = {k: (a[k], b[k]) for k in keys if abs(a[k] - b[k]) > 1e-5 * max(1.0, abs(b[k]))}
        assert not diff, f"step {a['step']}: {diff}"
        assert a["perf/dp_token_imbalance"] <= a["perf/dp_token_imbalance_before"] + 1e-9
        assert "perf/dp_token_imbalance" not in b
    assert any(r["perf/dp_token_imbalance"] < r["perf/dp_token_imbalance_before"] - 1e-3 for r in on)
