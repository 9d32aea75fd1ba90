"""Partial rollouts (``trainer.partial_rollouts``, ``hybrid_rl/partial.py``) through the trainer on the tiny CPU recipe.

1. In-process, with the round run lazily when the trainer takes it (so the interrupt lands as soon as a step's
   groups are complete) and long-tailed forced lengths: groups are carried and continued, every token is within
   ``trainer.max_staleness``, π_old is θ_k's (the update's own first forward), and every prompt drawn is trained
   exactly once.
2. Two gloo ranks under torchrun with the real background thread, a checkpoint and a resume: it completes, logs
   the new metrics, and the resumed run goes on.
3. The invalid combinations are one-line config errors naming the key and the fix.
4. ``benchmarks/modes_sweep.py --cpu-smoke`` runs the ``overlap_partial`` mode.
5. (learning, excluded by default) overlap with partial rollouts still learns the successor task.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest

from helpers import ROOT, cpu_dist, run_checked

RECIPE = ROOT / "recipes" / "cpu_successor.yaml"
PARTIAL = ["trainer.mode=overlap", "trainer.max_staleness=2", "trainer.partial_rollouts=true"]
SMALL = ["data.num_synthetic=256", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
         "actor.ppo_micro_batch_size_per_device=16", "trainer.logger=[jsonl]", "trainer.test_freq=0",
         "trainer.val_before_train=false"]
NEW_METRICS = ("rollout/partial_carried", "rollout/partial_resumed_tokens", "rollout/token_staleness_mean",
               "rollout/token_staleness_max")


class _LazyExecutor:
    """Runs a submitted round when its result is asked for, i.e. when the trainer takes it (after arming the
    interrupt): the order of events of a trainer that is always faster than the engine."""

    def submit(self, fn, *args):
        class Lazy(Future):
            def result(self, timeout=None):
                if not self.done():
                    self.set_result(fn(*args))
                return super().result(timeout)

        return Lazy()

    def shutdown(self, wait: bool = True) -> None:
        pass


def test_carry_over_through_the_trainer(tmp_path, monkeypatch, tiny_model_path):
    from hybrid_rl import pipeline
    from hybrid_rl.config import load_config
    from hybrid_rl.trainer import Trainer

    monkeypatch.setattr(pipeline, "ThreadPoolExecutor", lambda **kw: _LazyExecutor())
    drawn, trained = [], []
    real_next, real_train = Trainer.next_prompts, Trainer.train_on

    def recording_next(self):
        batch = real_next(self)
        drawn.extend(batch["uid"].tolist())
        return batch

    def recording_train(self, batch, timer):
        trained.extend(batch["uid"][::self.cfg.rollout.n].tolist())
        return real_train(self, batch, timer)

    monkeypatch.setattr(Trainer, "next_prompts", recording_next)
    monkeypatch.setattr(Trainer, "train_on", recording_train)
    cfg = load_config(RECIPE, [*SMALL, *PARTIAL, "trainer.total_steps=6", "trainer.save_freq=-1",
                               "rollout.forced_lengths=lognormal:4:1.0", "data.max_response_length=24",
                               f"trainer.output_dir={tmp_path / 'run'}"]).validate()
    rows = Trainer(cfg, cpu_dist()).fit()
    assert len(rows) == 6
    for r in rows:
        assert all(k in r for k in NEW_METRICS), sorted(r)
        assert r["rollout/token_staleness_max"] <= 2 and r["rollout/staleness_max"] <= 2
        # one mini-batch: π_prox (θ_k) is the update's own first forward, over tokens of every version
        assert r["actor/old_log_prob_skipped"] == 1.0
    assert all(r["rollout/partial_carried"] > 0 for r in rows[1:-1]) and rows[-1]["rollout/partial_carried"] == 0
    assert sum(r["rollout/partial_resumed_tokens"] for r in rows) > 0  # unfinished samples did continue
    assert max(r["rollout/token_staleness_max"] for r in rows) == 2
    assert sorted(trained) == sorted(drawn) and len(set(trained)) == len(trained) == 6 * 8


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_two_ranks_checkpoint_and_resume(tmp_path, tiny_model_path):
    """Background thread, two ranks, a checkpoint at step 2 (the round in flight finishes first and the whole pool,
    complete groups only, is saved), then a resume from it that trains on that pool."""
    out = tmp_path / "run"
    args = ["-m", "hybrid_rl", "train", str(RECIPE), *SMALL, *PARTIAL, "trainer.save_freq=2",
            f"trainer.output_dir={out}", "rollout.forced_lengths=lognormal:4:1.0", "data.max_response_length=16"]
    run_checked(_torchrun(2) + args + ["trainer.total_steps=4"], timeout=600)
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3, 4]
    import torch

    step2 = out / "checkpoints" / "step_00000002"
    pool = torch.load(step2 / "extra_rank0.pt", weights_only=True)["pending_batch"]
    assert len(pool["tensors"]["responses"]) == 2 * 4 * 4  # two steps' groups (4 per rank × n=4)
    assert bool(pool["tensors"]["response_mask"].sum(1).ge(1).all())  # every sample finished: nothing partial
    run_checked(_torchrun(2) + args + ["trainer.total_steps=5", f"trainer.resume={step2}"], timeout=600)
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        assert all(k in r for k in NEW_METRICS) and r["rollout/token_staleness_max"] <= 2
    assert rows[2]["rollout/partial_carried"] == 8  # step 3 took 4 of each rank's 8 restored groups


@pytest.mark.parametrize("overrides, match", [
    (["trainer.partial_rollouts=true", "trainer.max_staleness=2"], "needs trainer.mode=overlap"),
    (["trainer.partial_rollouts=true", "trainer.mode=overlap"], "needs trainer.max_staleness >= 2"),
    ([*PARTIAL, "trainer.placement=split"], "needs trainer.placement=colocated"),
    ([*PARTIAL, "actor.old_log_prob=engine"], "set actor.old_log_prob=auto"),
    ([*PARTIAL, "rollout.name=vllm", "rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size=1"),
    (["trainer.mode=overlap", "trainer.max_staleness=2"], "only with trainer.partial_rollouts=true"),
])
def test_invalid_combinations_are_config_errors(overrides, match):
    from hybrid_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=match) as err:
        load_config(None, overrides).validate(world_size=2)
    assert "\n" not in str(err.value)


def test_valid_combination_and_default_off():
    from hybrid_rl.config import load_config

    assert load_config(None, []).trainer.partial_rollouts is False
    load_config(None, PARTIAL).validate()
    load_config(None, [*PARTIAL, "trainer.max_staleness=3"]).validate()


@pytest.mark.slow
def test_modes_sweep_cpu_smoke_runs_overlap_partial(tmp_path, tiny_model_path):
    import subprocess

    from helpers import subprocess_env

    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "modes_sweep.py"), "--cpu-smoke", "--out",
                           str(tmp_path), "--lengths", "24", "--modes", "sync,overlap_partial"], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [p["mode"] for p in printed] == ["sync", "overlap_partial"]
    assert all("step_s" in p and "skipped" not in p for p in printed), printed
    doc = json.loads((tmp_path / "modes_sweep_cpux2_tiny-qwen2.json").read_text())
    assert doc["points"][0]["speedup"]["overlap_partial"] is not None


@pytest.mark.slow
@pytest.mark.learning
def test_overlap_with_partial_rollouts_still_learns(tmp_path):
    """The default CPU recipe in overlap mode with partial rollouts (staleness 2), 150 steps: reward rises."""
    out = tmp_path / "partial"
    run_checked([sys.executable, "-m", "hybrid_rl", "train", str(RECIPE), *PARTIAL, f"trainer.output_dir={out}",
                 "trainer.logger=[jsonl]", "trainer.total_steps=150", "trainer.test_freq=0",
                 "trainer.val_before_train=false", "trainer.save_freq=-1"], timeout=1500)
    train = [r for r in _metrics(out) if "reward/mean" in r]
    assert sum(r["reward/mean"] for r in train[:3]) / 3 <= 0.3
    last = sum(r["reward/mean"] for r in train[-3:]) / 3
    print(f"partial rollouts: mean reward over the last 3 of {len(train)} steps = {last:.3f}")
    assert last >= 0.8, [round(r["reward/mean"], 2) for r in train[-10:]]
    assert max(r["rollout/token_staleness_max"] for r in train) == 2
