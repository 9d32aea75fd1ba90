"""Partial rollouts (``trainer.partial_rollouts``, ``hybrid_rl/modes/partial.py``) through the trainer on the tiny CPU recipe.

1. In-process, with the round run lazily when the trainer takes it (so the interrupt lands as soon as a step's
   groups are complete) and long-tailed forced lengths: groups are carried and continued, every token is within
   ``trainer.max_staleness``, π_old is θ_k's (the update's own first forward), and every prompt drawn is trained
   exactly once.
2. Two gloo ranks under torchrun with the real background thread, a checkpoint and a resume: it completes, logs
   the new metrics, and the resumed run goes on.
3. The invalid combinations are one-line config errors naming the key and the fix.
4. ``benchmarks/modes_sweep.py --cpu-smoke`` runs the ``overlap_partial`` and ``split_partial`` modes.
5. Under split placement: 1 rollout + 1 trainer rank equal the colocated one-rank run step for step (rounds
   interrupted at the same points through ``lazy_rounds.py``); 2 + 1 ranks checkpoint and resume their pools.
6. (learning, excluded by default) overlap with partial rollouts still learns the successor task.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import ROOT, LazyExecutor, cpu_dist, run_checked, trailing_means, train_until_learned
from hybrid_rl.config import partial_pool_steps

RECIPE = ROOT / "recipes" / "cpu_successor.yaml"
PARTIAL = ["trainer.mode=overlap", "trainer.max_staleness=2", "trainer.partial_rollouts=true"]
SMALL = ["data.num_synthetic=256", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
         "actor.ppo_micro_batch_size_per_device=16", "trainer.logger=[jsonl]", "trainer.test_freq=0",
         "trainer.val_before_train=false"]
NEW_METRICS = ("rollout/partial_carried", "rollout/partial_resumed_tokens", "rollout/token_staleness_mean",
               "rollout/token_staleness_max", "rollout/partial_context_tokens", "rollout/partial_cached_tokens")


@pytest.mark.parametrize("extra, bound", [([], 2), (["trainer.partial_rollout_ahead=2", "trainer.max_staleness=3"], 3)],
                         ids=["ahead0.25", "ahead2"])
def test_carry_over_through_the_trainer(tmp_path, monkeypatch, tiny_model_path, extra, bound):
    """(ahead 2: a pool of three steps' groups, all started at once, max_staleness 3.)"""
    from hybrid_rl.modes import overlap as pipeline
    from hybrid_rl.config import load_config
    from hybrid_rl.data.feed import PromptFeed
    from hybrid_rl.trainer import Trainer

    monkeypatch.setattr(pipeline, "ThreadPoolExecutor", lambda **kw: LazyExecutor())
    drawn, trained = [], []
    real_next, real_train = PromptFeed.__call__, Trainer.train_on

    def recording_next(self):
        batch = real_next(self)
        drawn.extend(batch["uid"].tolist())
        return batch

    def recording_train(self, batch, timer):
        trained.extend(batch["uid"][::self.cfg.rollout.n].tolist())
        return real_train(self, batch, timer)

    monkeypatch.setattr(PromptFeed, "__call__", recording_next)
    monkeypatch.setattr(Trainer, "train_on", recording_train)
    cfg = load_config(RECIPE, [*SMALL, *PARTIAL, *extra, "trainer.total_steps=6", "trainer.save_freq=-1",
                               "rollout.forced_lengths=lognormal:4:1.0", "data.max_response_length=24",
                               f"trainer.output_dir={tmp_path / 'run'}"]).validate()
    rows = Trainer(cfg, cpu_dist()).fit()
    assert len(rows) == 6
    for r in rows:
        assert all(k in r for k in NEW_METRICS), sorted(r)
        assert r["rollout/token_staleness_max"] <= bound and r["rollout/staleness_max"] <= bound
        # one mini-batch: π_prox (θ_k) is the update's own first forward, over tokens of every version
        assert r["actor/old_log_prob_skipped"] == 1.0
    assert all(r["rollout/partial_carried"] > 0 for r in rows[1:-1]) and rows[-1]["rollout/partial_carried"] == 0
    assert sum(r["rollout/partial_resumed_tokens"] for r in rows) > 0  # unfinished samples did continue
    # the rounds submitted contexts (a step the pool already held ran none); the hf engine has no prefix cache
    assert rows[0]["rollout/partial_context_tokens"] > 0 and not any(r["rollout/partial_cached_tokens"] for r in rows)
    assert all(r.get("rollout/prefix_cache_hit") == (0.0 if r["rollout/partial_context_tokens"] else None) for r in rows)
    assert max(r["rollout/token_staleness_max"] for r in rows) == bound  # carried tokens do reach the bound
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
    ([*PARTIAL, "actor.old_log_prob=engine"], "set actor.old_log_prob=auto"),
    ([*PARTIAL, "rollout.name=vllm", "rollout.vllm.tensor_parallel_size=2"], "rollout.vllm.tensor_parallel_size=1"),
    (["trainer.mode=overlap", "trainer.max_staleness=2"], "only with trainer.partial_rollouts=true"),
    ([*PARTIAL, "trainer.partial_rollout_ahead=25"], "must be in \\(0, 4\\].*not a percentage"),
    ([*PARTIAL, "trainer.partial_rollout_ahead=0"], "partial_rollout_ahead=0.0 must be in"),
    ([*PARTIAL, "trainer.partial_rollout_ahead=2"], "keeps 3 steps' groups in flight.*set trainer.max_staleness=3"),
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
    load_config(None, [*PARTIAL, "trainer.partial_rollout_ahead=2", "trainer.max_staleness=3"]).validate()
    load_config(None, [*PARTIAL, "trainer.placement=split"]).validate(world_size=2)


SPLIT_CMP = ["model.path=builtin:tiny-qwen2", "trainer.resume=never", "trainer.save_freq=-1", "trainer.total_steps=6",
             "rollout.forced_lengths=lognormal:4:1.0", "data.max_response_length=24"]


@pytest.mark.slow
def test_split_placement_equals_colocated(tmp_path, tiny_model_path):
    """Partial rollouts under split placement (1 rollout + 1 trainer rank) are the colocated one-rank run, step for
    step, with rounds interrupted at the same points (``lazy_rounds.py``): the rollout rank's round runs until the
    trainer rank is ready, is cut at a step's complete groups, θ_k arrives by broadcast before the next round, and
    the carried groups, their versions and the counts reach the trainer rank."""
    split, colo = tmp_path / "split", tmp_path / "colo"
    lazy = [str(ROOT / "tests" / "integration" / "lazy_rounds.py"), "train", str(RECIPE), *SMALL, *PARTIAL, *SPLIT_CMP]
    run_checked(_torchrun(2) + lazy + ["trainer.placement=split", f"trainer.output_dir={split}"], timeout=600)
    run_checked(_torchrun(1) + lazy + [f"trainer.output_dir={colo}"], timeout=600)
    a, b = _metrics(split), _metrics(colo)
    assert [r["step"] for r in a] == list(range(1, 7)) == [r["step"] for r in b]
    assert any(r["actor/grad_norm"] > 0 for r in a)
    assert all(r["rollout/partial_carried"] > 0 for r in a[1:-1]) and sum(r["rollout/partial_resumed_tokens"] for r in a)
    assert max(r["rollout/token_staleness_max"] for r in a) == 2
    for x, y in zip(a, b):
        keys = {k for k in y if not k.startswith(("timing/", "perf/")) and k != "rollout/weight_sync_bytes"}
        assert keys <= set(x), keys - set(x)
        diff = {k: (x[k], y[k]) for k in keys if abs(x[k] - y[k]) > 1e-6}
        assert not diff, f"step {x['step']}: {diff}"


@pytest.mark.slow
def test_split_placement_two_rollout_ranks_checkpoint_and_resume(tmp_path, tiny_model_path):
    """2 rollout + 1 trainer rank with the real background rounds: the rollout ranks' pools are checkpointed whole
    (every group complete) and a resumed run trains on them; each step's carried count is the rollout ranks' sum."""
    out = tmp_path / "run"
    args = ["-m", "hybrid_rl", "train", str(RECIPE), *SMALL, *PARTIAL, "trainer.placement=split",
            "trainer.rollout_ranks=2", "trainer.save_freq=2", f"trainer.output_dir={out}",
            "rollout.forced_lengths=lognormal:4:1.0", "data.max_response_length=16"]
    run_checked(_torchrun(3) + args + ["trainer.total_steps=4"], timeout=600)
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3, 4]
    import torch

    step2 = out / "checkpoints" / "step_00000002"
    for rank in (0, 1):  # each rollout rank: two steps' groups (4 per rollout rank × n=4), all finished
        pool = torch.load(step2 / f"extra_rank{rank}.pt", weights_only=True)["pending_batch"]
        assert len(pool["tensors"]["responses"]) == 2 * 4 * 4
        assert bool(pool["tensors"]["response_mask"].sum(1).ge(1).all())
    run_checked(_torchrun(3) + args + ["trainer.total_steps=5", f"trainer.resume={step2}"], timeout=600)
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        assert all(k in r for k in NEW_METRICS) and r["rollout/token_staleness_max"] <= 2
    assert rows[2]["rollout/partial_carried"] == 8  # step 3 took 4 of each rollout rank's 8 restored groups


@pytest.mark.slow
def test_modes_sweep_cpu_smoke_runs_both_partial_modes(tmp_path, tiny_model_path):
    import subprocess

    from helpers import subprocess_env

    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "modes_sweep.py"), "--cpu-smoke", "--out",
                           str(tmp_path), "--lengths", "24", "--modes", "sync,overlap_partial,split_partial"],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [p["mode"] for p in printed] == ["sync", "overlap_partial", "split_partial"]
    assert all("step_s" in p and "skipped" not in p for p in printed), printed
    # the rounds' prefix-cache share is summarised for the partial modes (the hf engine has no cache)
    assert [p.get("prefix_cache_hit") for p in printed] == [None, 0.0, 0.0]
    doc = json.loads((tmp_path / "modes_sweep_cpux2_tiny-qwen2.json").read_text())
    (point,) = doc["points"]
    assert point["speedup"]["overlap_partial"] is not None and point["speedup"]["split_partial"] is not None
    assert point["best_split_partial"] == {"mode": "split_partial", "ratio": "1:1"}


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.parametrize("placement,ahead,steps", [("colocated", 0.25, 150), ("split", 3.0, 250)])
def test_overlap_with_partial_rollouts_still_learns(tmp_path, placement, ahead, steps):
    """The default CPU recipe in overlap mode with partial rollouts: the reward rises from ≤ 0.3 to a 3-step mean
    ≥ 0.8 (the run is stopped once it gets there). Colocated on one rank at ahead 0.25 (staleness 2), 150 steps; and
    split (1 rollout + 1 trainer rank, the rollout rank's round running beside the update) at ahead 3 (four steps'
    groups in flight, staleness bound 4), the setting measured fastest at 4k (4xH200): samples up to four versions
    old are corrected and the reward still rises, later (one run crossed a 3-step mean of 0.8 at step 124; others
    were at 0.675 after 150 steps and 0.799 after 200), so it gets the recipe's 250 steps."""
    out = tmp_path / "partial"
    launch = [sys.executable] if placement == "colocated" else _torchrun(2)
    bound = partial_pool_steps(ahead)
    rows = train_until_learned(
        launch + ["-m", "hybrid_rl", "train", str(RECIPE), *PARTIAL, f"trainer.output_dir={out}",
                  f"trainer.placement={placement}", "trainer.logger=[jsonl]", f"trainer.total_steps={steps}",
                  f"trainer.partial_rollout_ahead={ahead}", f"trainer.max_staleness={bound}", "trainer.test_freq=0",
                  "trainer.val_before_train=false", "trainer.save_freq=-1"], out)
    train = [r for r in rows if "reward/mean" in r]
    rewards = [r["reward/mean"] for r in train]
    assert sum(rewards[:3]) / 3 <= 0.3
    print(f"partial rollouts ({placement}, ahead {ahead}): best 3-step mean reward {max(trailing_means(rewards)):.3f} "
          f"by step {len(train)}")
    assert max(trailing_means(rewards)) >= 0.8, [round(r, 2) for r in rewards[-10:]]
    assert max(r["rollout/token_staleness_max"] for r in train) == bound
