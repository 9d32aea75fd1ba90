"""``actor.old_log_prob``: where π_old comes from (fewer training passes).

``auto`` takes π_old for the update's first mini-batch from that mini-batch's own forward, detached (the weights
have not moved yet), and runs the separate no-grad pass on the other mini-batches only (none when there is one
mini-batch per epoch; later epochs read what the first forward left). That must give the same weights and the
same metrics as ``recompute`` (sync and overlap mode, several update shapes); KL-in-reward, which reads π_old
before the update, still runs the whole pass; ``engine`` uses the rollout's log-probs. The driver's choice of
plan is ``phases.old_log_prob``. Tiny in-process runs of the CPU recipe (seconds each).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybrid_rl.batch import Batch
from hybrid_rl.config import ConfigError, load_config
from hybrid_rl.phases.old_log_prob import OldLogProbPlan, plan_old_log_prob
from hybrid_rl.trainer import Trainer
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

from helpers import actor_params, cpu_dist, generate_batch, make_cfg, score_batch

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_successor.yaml"
# one mini-batch per step: 4 prompts × 4 samples, all in one optimizer step
SMALL = ["data.num_synthetic=64", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
         "actor.ppo_micro_batch_size_per_device=16", "actor.log_prob_micro_batch_size_per_device=16",
         "trainer.logger=[jsonl]", "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=-1",
         "trainer.resume=never", "actor.lr=0.01", "reward.num_workers=0"]
# differ by design between the two sources: wall-clock figures and which source ran (actor/ppo_kl is exactly 0 from
# the update's own forward and rounding-sized from a separate pass: compared within the tolerance like the rest)
DIFFERENT = ("timing/", "perf/", "actor/old_log_prob_skipped")


@pytest.fixture(scope="module")
def reward(tmp_path_factory) -> str:
    """A dense reward (the response's length in characters): the random-init model never answers the successor task
    right, and all-zero groups have no advantage, so nothing would be trained and every comparison would be vacuous."""
    path = tmp_path_factory.mktemp("reward") / "length_reward.py"
    path.write_text("def length(response, ground_truth):\n    return float(len(response))\n")
    return f"reward.function={path}:length"


def _run(out: Path, *overrides: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    trainer = Trainer(load_config(RECIPE, [*SMALL, f"trainer.output_dir={out}", *overrides]).validate(), cpu_dist())
    rows = trainer.fit()
    return rows, actor_params(trainer.worker)


# the shapes of update ``auto`` covers: (overrides, the share of the pass it skips)
SHAPES = {
    "one_mini_batch": ([], 1.0),
    "two_epochs": (["actor.ppo_epochs=2"], 1.0),  # epoch 2 reads what epoch 1's first forward left
    "two_mini_batches": (["actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_device=8"], 0.5),
    "four_mini_batches_shuffled_two_epochs": (["actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size_per_device=4",
                                               "actor.shuffle_mini_batches=true", "actor.ppo_epochs=2"], 0.25),
}


@pytest.mark.parametrize("mode,shape", [("sync", "one_mini_batch"), ("overlap", "one_mini_batch"),
                                        ("sync", "two_epochs"), ("sync", "two_mini_batches"),
                                        ("overlap", "two_mini_batches"), ("sync", "four_mini_batches_shuffled_two_epochs")])
def test_auto_skips_the_pass_and_matches_recompute(tmp_path, reward, mode, shape):
    """``auto`` takes the first mini-batch's π_old from the update's own forward (the whole pass when that is the
    only mini-batch, the rest of it otherwise) and gives the weights and metrics of ``recompute``."""
    extra, skipped = SHAPES[shape]
    steps = ["trainer.total_steps=3", f"trainer.mode={mode}", reward, *extra]
    auto_rows, auto_params = _run(tmp_path / "auto", *steps)
    rec_rows, rec_params = _run(tmp_path / "recompute", *steps, "actor.old_log_prob=recompute")
    assert all(r["actor/old_log_prob_skipped"] == skipped for r in auto_rows)
    assert all((r["timing/old_log_prob"] == 0.0) == (skipped == 1.0) for r in auto_rows)
    assert all(r["actor/old_log_prob_skipped"] == 0.0 and r["timing/old_log_prob"] > 0 for r in rec_rows)
    if mode == "overlap":  # the decoupled loss ran on stale batches: proximal (θ_k) ≠ behaviour (θ_{k-1})
        assert all("rollout/is_truncated_frac" in r for r in auto_rows)
        assert max(r["rollout/staleness_max"] for r in auto_rows) == 1
        assert any(r["rollout/logprob_diff"] > 1e-4 for r in auto_rows)
    assert any(r["actor/grad_norm"] > 0 for r in auto_rows)  # the update moved the weights
    for n in rec_params:
        torch.testing.assert_close(auto_params[n], rec_params[n], rtol=0, atol=1e-6, msg=n)
    for a, r in zip(auto_rows, rec_rows, strict=True):
        keys = {k for k in r if not k.startswith(DIFFERENT)}
        assert keys == {k for k in a if not k.startswith(DIFFERENT)}  # the π_old metrics are still logged
        for k in ("rollout/logprob_diff", "rollout/is_ratio_mean", "rollout/is_ratio_max", "actor/entropy_old",
                  "actor/pg_loss", "actor/entropy"):
            assert k in keys, k
        diff = {k: (a[k], r[k]) for k in keys if abs(a[k] - r[k]) > 1e-5}
        assert not diff, f"step {a['step']}: {diff}"


def test_auto_recomputes_when_pi_old_is_read_before_the_update(tmp_path):
    rows, _ = _run(tmp_path / "run", "trainer.total_steps=1", "algorithm.use_kl_in_reward=true")
    assert rows[0]["actor/old_log_prob_skipped"] == 0.0 and rows[0]["timing/old_log_prob"] > 0


def test_engine_uses_the_rollout_log_probs(tmp_path, monkeypatch):
    seen: list[Batch] = []
    real = ActorRolloutRefWorker.update_policy

    def spy(self, batch, plan=None):
        seen.append(batch)
        return real(self, batch, plan)

    monkeypatch.setattr(ActorRolloutRefWorker, "update_policy", spy)
    rows, _ = _run(tmp_path / "run", "trainer.total_steps=2", "actor.old_log_prob=engine",
                   "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_device=8")  # never the pass, even where auto would run it
    assert len(seen) == 2
    for batch in seen:
        assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    for r in rows:
        assert r["actor/old_log_prob_skipped"] == 1.0 and r["timing/old_log_prob"] == 0.0
        assert r["rollout/logprob_diff"] == 0.0 and r["rollout/is_ratio_max"] == 1.0


def test_engine_without_rollout_log_probs_is_an_error():
    cfg = make_cfg("actor.old_log_prob=engine")
    batch = Batch(dict(responses=torch.zeros(2, 3, dtype=torch.long)), {}, {})
    with pytest.raises(ValueError, match="actor.old_log_prob=engine .* returned none"):
        ActorRolloutRefWorker.engine_log_probs_as_old(SimpleNamespace(cfg=cfg), batch)


@pytest.mark.parametrize("log_prob_micro", [4, 16], ids=["same_split", "other_split"])
@pytest.mark.parametrize("correction", ["never", "always"])
def test_update_own_old_equals_pass_then_update(tiny_model_path, correction, log_prob_micro):
    """The worker alone: π_old from the update's forward gives the pass's log-probs and entropy and the same step
    (plain PPO, and decoupled PPO with the proximal from that forward). With the pass cut into the update's
    micro-batches the forwards are the same computation and everything is bitwise equal; cut otherwise, the
    pass's log-probs differ by rounding (~5e-7), and Adam's first step (about lr × sign of the gradient) turns
    that into weight differences of a few 1e-6 at lr 1e-3."""
    results = []
    for own in (False, True):
        torch.manual_seed(0)
        w = ActorRolloutRefWorker(make_cfg(f"algorithm.rollout_correction.apply={correction}",
                                           "actor.ppo_micro_batch_size_per_device=4",
                                           f"actor.log_prob_micro_batch_size_per_device={log_prob_micro}"), cpu_dist())
        if not results:
            scored = score_batch(w, generate_batch(w))  # with old_log_probs from the pass
            stale = scored["rollout_log_probs"] - 0.1 * scored["response_mask"]  # a behaviour policy ≠ proximal
            scored = scored.union(tensors=dict(rollout_log_probs=stale))
            before = actor_params(w)
        if own:
            bare = Batch({k: v for k, v in scored.tensors.items() if k not in ("old_log_probs", "old_entropy")},
                         scored.non_tensors, scored.meta)
            stats, out = w.update_policy(bare, OldLogProbPlan(first_order=w.draw_update_order(len(bare)), skipped=1.0))
        else:
            stats, out = w.update_actor(scored), scored
        results.append((actor_params(w), stats, out))
    (p_rec, s_rec, b_rec), (p_own, s_own, b_own) = results
    exact = log_prob_micro == 4
    atol = 0.0 if exact else 1e-6
    mask = b_rec["response_mask"].bool()
    for key in ("old_log_probs", "old_entropy"):
        torch.testing.assert_close(b_own[key][mask], b_rec[key][mask], rtol=0, atol=atol)
    assert any(not torch.equal(before[n], p_rec[n]) for n in p_rec)  # the step moved the weights
    for n in p_rec:
        torch.testing.assert_close(p_own[n], p_rec[n], rtol=0, atol=0.0 if exact else 1e-5, msg=n)
    assert s_own.keys() == s_rec.keys()
    assert "rollout/is_truncated_frac" in s_own or correction == "never"
    for k in s_rec:
        assert abs(s_own[k][0] / s_own[k][1] - s_rec[k][0] / s_rec[k][1]) <= (0.0 if exact else 1e-5), k


def test_update_own_old_needs_the_other_mini_batches_pass(tiny_model_path):
    w = ActorRolloutRefWorker(make_cfg("actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_device=8"),
                              cpu_dist())
    batch = generate_batch(w)
    with pytest.raises(ValueError, match="covers its first mini-batch only, and this update has 2: call "
                                         r"compute_old_log_probs\(batch, plan\) first"):
        w.update_policy(batch, OldLogProbPlan(first_order=w.draw_update_order(len(batch)), skipped=0.5))


def test_pass_but_first_mini_batch_leaves_exactly_those_rows(tiny_model_path):
    """The partial pass's rows equal the full pass's; the first mini-batch's rows (of the order the update will use,
    shuffled here) are left at 0 for the update to fill."""
    w = ActorRolloutRefWorker(make_cfg("actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_device=8",
                                       "actor.shuffle_mini_batches=true"), cpu_dist())
    batch = generate_batch(w)
    full = w.compute_log_prob(batch)
    plan = plan_old_log_prob(w.cfg, w, batch, actor_updates=True)
    part = w.compute_old_log_probs(batch, plan)
    order = plan.first_order
    assert plan.skipped == 0.5 and plan.runs_pass
    first, rest = order[:len(batch) // 2], order[len(batch) // 2:]
    assert sorted(order) == list(range(len(batch))) and list(order) != list(range(len(batch)))  # drawn, shuffled
    mask = batch["response_mask"].bool()
    for key in ("old_log_probs", "old_entropy"):
        torch.testing.assert_close(part[key][rest][mask[rest]], full[key][rest][mask[rest]], rtol=0, atol=1e-6)
        assert not part[key][first].any()


@pytest.mark.parametrize("setting, kl_in_reward, actor_updates, mini_batches, plan", [
    ("auto", False, True, 1, dict(fills=True, skipped=1.0, engine=False)),  # no pass: the update fills every row
    ("auto", False, True, 3, dict(fills=True, skipped=1 / 3, engine=False)),  # the pass on the other two
    ("auto", True, True, 1, dict(fills=False, skipped=0.0, engine=False)),  # KL-in-reward reads π_old before the update
    ("auto", False, False, 1, dict(fills=False, skipped=0.0, engine=False)),  # the critic's warm-up: no update
    ("recompute", False, True, 1, dict(fills=False, skipped=0.0, engine=False)),
    ("engine", False, True, 3, dict(fills=False, skipped=1.0, engine=True))])
def test_plan_choice(setting, kl_in_reward, actor_updates, mini_batches, plan):
    cfg = SimpleNamespace(actor=SimpleNamespace(old_log_prob=setting),
                          algorithm=SimpleNamespace(use_kl_in_reward=kl_in_reward))
    drawn = []
    worker = SimpleNamespace(num_mini_batches=lambda batch: mini_batches,
                             draw_update_order=lambda rows: drawn.append(rows) or torch.arange(rows).numpy())
    got = plan_old_log_prob(cfg, worker, Batch({}, {}, {}), actor_updates)
    assert (got.update_fills_first, got.skipped, got.from_engine) == (plan["fills"], plan["skipped"], plan["engine"])
    assert got.runs_pass == (plan["skipped"] < 1.0)
    assert len(drawn) == plan["fills"]  # the update's first order is drawn only where the update fills π_old


def test_bad_value_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["actor.old_log_prob=reuse"])
    assert str(e.value) == "actor.old_log_prob='reuse' is not one of ['auto', 'recompute', 'engine']"
