"""Overlap mode: staleness 0 is sync, the bound holds, the decoupled loss reduces to PPO, and it still learns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_rl.modes.overlap import RolloutPipeline, StalenessError
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

from helpers import (actor_params, chat_prompts, cpu_dist, generate_batch, make_cfg, score_batch, trailing_means,
                     train_until_learned)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_successor.yaml"
VOLATILE = ("timing/", "perf/")


def _train(out: Path, *overrides: str) -> list[dict]:
    cmd = [sys.executable, "-m", "hybrid_rl", "train", str(RECIPE), f"trainer.output_dir={out}", "trainer.logger=[jsonl]",
           *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE) and k != "timing/wait_gen"} for r in rows]


@pytest.mark.slow
def test_overlap_with_staleness_zero_reproduces_sync(tmp_path):
    common = ["trainer.total_steps=4", "trainer.test_freq=2", "trainer.val_before_train=false"]
    sync = _train(tmp_path / "sync", *common)
    over = _train(tmp_path / "over", *common, "trainer.mode=overlap", "trainer.max_staleness=0")
    assert _stable(sync) == _stable(over)
    assert all(r["rollout/staleness_max"] == 0 for r in over)


@pytest.mark.slow
def test_one_step_overlap_respects_the_bound_and_differs_from_sync(tmp_path):
    common = ["trainer.total_steps=6", "trainer.test_freq=0", "trainer.val_before_train=false", "actor.lr=0.01"]
    over = _train(tmp_path / "over", *common, "trainer.mode=overlap", "trainer.max_staleness=1")
    staleness = [r["rollout/staleness_max"] for r in over]
    assert max(staleness) <= 1
    assert staleness[0] == 0 and all(s == 1 for s in staleness[1:])  # batch k+1 is generated under θ_k
    assert all("rollout/is_truncated_frac" in r for r in over)  # decoupled loss is on (auto)
    sync = _train(tmp_path / "sync", *common)
    assert _stable(sync)[2:] != _stable(over)[2:]


def test_decoupled_loss_equals_ppo_when_behaviour_is_proximal(tiny_model_path):
    """With behaviour log-probs set to the proximal ones, the correction changes nothing."""
    results = []
    for correction in ("never", "always"):
        torch.manual_seed(0)
        w = ActorRolloutRefWorker(make_cfg(f"algorithm.rollout_correction.apply={correction}"), cpu_dist())
        if not results:
            batch = score_batch(w, generate_batch(w))
            batch = batch.union(tensors=dict(rollout_log_probs=batch["old_log_probs"].clone()))
        stats = w.update_actor(batch)
        assert ("rollout/is_truncated_frac" in stats) == (correction == "always")
        results.append(actor_params(w))
    for n in results[0]:
        assert torch.equal(results[0][n], results[1][n]), n


def test_decoupled_loss_reweights_stale_samples(tiny_model_path):
    """A behaviour policy far from the proximal one changes the update (the correction is not a no-op)."""
    results = []
    for shift in (0.0, 0.5):
        torch.manual_seed(0)
        w = ActorRolloutRefWorker(make_cfg("algorithm.rollout_correction.apply=always"), cpu_dist())
        if not results:
            base = score_batch(w, generate_batch(w))
        batch = base.union(tensors=dict(rollout_log_probs=base["old_log_probs"] - shift))
        stats = w.update_actor(batch)
        results.append((actor_params(w), stats))
    (a, _), (b, stats_b) = results
    assert any(not torch.equal(a[n], b[n]) for n in a)
    # exp(0.5) = 1.65 < cap 2: nothing truncated
    assert stats_b["rollout/is_truncated_frac"][0] == 0.0


def test_the_configured_correction_reaches_the_update(tiny_model_path):
    """``algorithm.rollout_correction.method`` picks the loss's correction and its share is logged: behaviour
    log-probs 0.05 below the proximal ones put every sequence's geometric-mean ratio at e^0.05 ≈ 1.051, outside
    geo_mask's [0.99, 1.01] (all dropped), while 0.005 below (≈ 1.005) keeps them all."""
    torch.manual_seed(0)
    w = ActorRolloutRefWorker(make_cfg("algorithm.rollout_correction.apply=always",
                                       "algorithm.rollout_correction.method=geo_mask"), cpu_dist())
    base = score_batch(w, generate_batch(w))
    for shift, masked in ((0.05, 1.0), (0.005, 0.0)):
        stats = w.update_actor(base.union(tensors=dict(rollout_log_probs=base["old_log_probs"] - shift)))
        total, tokens = stats["rollout/is_masked_frac"]  # a (sum, count) pair over the response tokens
        assert tokens > 0 and total / tokens == pytest.approx(masked)
        assert "rollout/is_truncated_frac" not in stats  # a masking rule logs its masks only


def test_engine_stays_awake_in_overlap_mode(tiny_model_path):
    """The background rollout needs the engine resident: overlap mode never puts it to sleep."""
    from hybrid_rl.config import ConfigError, load_config

    sync = ActorRolloutRefWorker(make_cfg("rollout.sleep_level=2"), cpu_dist())
    generate_batch(sync)
    assert sync.rollout.weights_version is None  # slept at level 2 after the rollout
    over = ActorRolloutRefWorker(make_cfg("rollout.sleep_level=2", "trainer.mode=overlap"), cpu_dist())
    generate_batch(over)
    assert over.rollout.weights_version == 0  # still holds θ_0, awake
    with pytest.raises(ConfigError, match="need trainer.mode=sync"):
        load_config(None, ["trainer.mode=overlap", "actor.param_offload=true"]).validate()


def test_pipeline_regenerates_or_refuses_stale_batches(tiny_model_path):
    w = ActorRolloutRefWorker(make_cfg("trainer.mode=overlap"), cpu_dist())
    pipe = RolloutPipeline(w, max_staleness=1, stale_policy="drop")
    pipe.start(chat_prompts(w))  # engine not pushed yet: weights_version None → recorded as -1
    with w.rollout_mode():
        pass
    pipe.pending.result()
    batch = pipe.take(lambda: None)
    assert int(batch["weight_version"].min()) == 0
    w.weight_version = 3  # the trainer moved on by three versions
    fresh = pipe.check_staleness(batch, w.weight_version)
    assert pipe.dropped == 1 and int(fresh["weight_version"].min()) == 3 and fresh.meta["trainer_version"] == 3
    strict = RolloutPipeline(w, max_staleness=1, stale_policy="error")
    with pytest.raises(StalenessError, match="trainer.max_staleness=1"):
        strict.check_staleness(batch, 5)
    pipe.close()
    strict.close()


@pytest.mark.slow
@pytest.mark.learning
def test_overlap_mode_still_learns(tmp_path):
    """Overlap mode (staleness 1) takes the default task's reward from ≤ 0.3 to a 3-step mean ≥ 0.8 within the
    recipe's 250 steps (the run is stopped once it gets there)."""
    out = tmp_path / "over"
    rows = train_until_learned([sys.executable, "-m", "hybrid_rl", "train", str(RECIPE), f"trainer.output_dir={out}",
                                "trainer.logger=[jsonl]", "trainer.mode=overlap", "trainer.test_freq=0",
                                "trainer.val_before_train=false", "trainer.save_freq=-1"], out)
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert sum(rewards[:3]) / 3 <= 0.3
    assert max(trailing_means(rewards)) >= 0.8, [round(r, 2) for r in rewards[-10:]]
    assert max(r["rollout/staleness_max"] for r in rows if "reward/mean" in r) == 1


class _InlineExecutor:
    """Runs a submitted generation at once in the caller's thread: overlap mode's order of events, no concurrency."""

    def submit(self, fn, *args):
        from concurrent.futures import Future

        done = Future()
        done.set_result(fn(*args))
        return done

    def shutdown(self, wait: bool = True) -> None:
        pass


def test_background_generation_matches_inline_generation(tmp_path, monkeypatch):
    """The generation thread shares nothing with the trainer that changes results (RNG streams, weights, engine state):
    overlap mode with the rollout in a background thread and with the same calls made inline, in the same order, give
    identical metrics, validation included. (The overlap plateau at a large learning rate: it was the learning rate, not a
    race; see recipes/cpu_successor.yaml.)"""
    import threading

    from hybrid_rl.modes import overlap as pipeline
    from hybrid_rl.config import load_config
    from hybrid_rl.trainer import Trainer

    threads: list[str] = []
    real_generate = pipeline.RolloutPipeline._generate

    def recording(self, prompts):
        threads.append(threading.current_thread().name)
        return real_generate(self, prompts)

    monkeypatch.setattr(pipeline.RolloutPipeline, "_generate", recording)
    small = ["data.num_synthetic=256", "data.train_batch_size=16", "rollout.n=8", "actor.ppo_mini_batch_size=8",
             "actor.ppo_micro_batch_size_per_device=64", "data.max_val_samples=16", "trainer.logger=[jsonl]",
             "trainer.total_steps=8", "trainer.test_freq=4", "trainer.val_before_train=false", "trainer.mode=overlap",
             "trainer.save_freq=-1"]
    run = lambda out: Trainer(load_config(RECIPE, [*small, f"trainer.output_dir={out}"]).validate(), cpu_dist()).fit()
    threaded = run(tmp_path / "threaded")
    in_thread = [t for t in threads if t != threading.main_thread().name]
    assert len(in_thread) == 7, threads  # steps 2..8 were generated in the background
    threads.clear()
    monkeypatch.setattr(pipeline, "ThreadPoolExecutor", lambda **kw: _InlineExecutor())
    inline = run(tmp_path / "inline")
    assert all(t == threading.main_thread().name for t in threads)
    assert _stable(threaded) == _stable(inline)
    assert any("val/reward_mean" in r for r in inline)
