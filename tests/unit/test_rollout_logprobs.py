"""``rollout.logprobs``: the engine's log-probs only where training reads them (``auto``), or always."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import cpu_dist
from hybrid_rl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_successor.yaml"


@pytest.mark.parametrize("overrides, expect", [
    (["rollout.logprobs=always"], True),
    (["rollout.logprobs=auto"], False),  # sync PPO: nothing reads them
    (["rollout.logprobs=auto", "actor.policy_loss=gspo"], False),
    (["rollout.logprobs=auto", "trainer.mode=overlap", "trainer.max_staleness=1"], True),  # decoupled PPO
    (["rollout.logprobs=auto", "trainer.mode=overlap", "trainer.max_staleness=0"], True),  # the overlap source
    (["rollout.logprobs=auto", "algorithm.rollout_correction.apply=always"], True),
    (["rollout.logprobs=auto", "actor.old_log_prob=engine"], True),  # π_old is the engine's
    (["rollout.logprobs=auto", "actor.policy_loss=decoupled_ppo"], True),
])
def test_auto_keeps_them_exactly_where_a_phase_reads_them(overrides, expect):
    assert load_config(RECIPE, overrides).validate().engine_logprobs is expect


def test_auto_keeps_them_in_a_multi_turn_environment():
    cfg = load_config(ROOT / "recipes" / "cpu_lookup_tool.yaml", ["rollout.logprobs=auto"]).validate()
    assert cfg.engine_logprobs


@pytest.mark.parametrize("setting", ["always", "auto"])
def test_a_sync_run_logs_the_engine_gap_only_with_the_log_probs(tmp_path, setting):
    from hybrid_rl.trainer import Trainer

    out = tmp_path / "run"
    cfg = load_config(RECIPE, ["data.num_synthetic=32", "data.train_batch_size=4", "rollout.n=2",
                               "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_device=8",
                               "data.max_response_length=4", "trainer.total_steps=2", "trainer.test_freq=0",
                               "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
                               f"rollout.logprobs={setting}", f"trainer.output_dir={out}"]).validate()
    with Trainer(cfg, cpu_dist()) as trainer:
        trainer.fit()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    gap = {"rollout/logprob_diff", "rollout/logprob_diff_max", "rollout/is_ratio_mean", "rollout/is_ratio_max"}
    for r in rows:
        assert "reward/mean" in r and "actor/pg_loss" in r  # trained either way
        assert (gap <= set(r)) if setting == "always" else not (gap & set(r))
        if setting == "always":
            assert 0 <= r["rollout/logprob_diff"] < 1e-3  # fp32 CPU: the engine's and the trainer's agree
