"""``algorithm.filter_groups``: DAPO's dynamic sampling. Groups whose ``rollout.n`` rewards are all equal are dropped
after the reward phase and fresh groups generated until the batch holds ``data.train_batch_size`` informative ones
(``phases.reward.fill_informative``, called by ``RewardPhase.filter_groups`` in sync mode)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import cpu_dist
from hybrid_rl.batch import Batch
from hybrid_rl.config import ConfigError, load_config
from hybrid_rl.phases.reward import fill_informative, informative_groups, sparse_scores

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_successor.yaml"
PAD = 0


def scored(groups: list[list[float]], tag: str, r_width: int = 3, p_width: int = 2) -> Batch:
    """A scored batch: one group per list of rewards (its samples' scores), uids ``<tag><g>``; each reward sits on
    the last token of a full-width response, the prompt ids hold the group's number."""
    rows = [(g, s) for g, scores in enumerate(groups) for s in scores]
    scores = torch.tensor([s for _, s in rows])
    level = torch.zeros(len(rows), r_width)
    level[:, -1] = scores
    return Batch(dict(prompts=torch.tensor([[g + 1] * p_width for g, _ in rows]),
                      responses=torch.ones(len(rows), r_width, dtype=torch.long),
                      response_mask=torch.ones(len(rows), r_width, dtype=torch.long),
                      token_level_scores=level, scores=scores),
                 dict(uid=np.array([f"{tag}{g}" for g, _ in rows], dtype=object)), dict(trainer_version=7))


def uids_of(batch: Batch) -> list[str]:
    """Each group's uid once, in batch order."""
    return list(dict.fromkeys(batch.non_tensors["uid"].tolist()))


def test_informative_groups_by_metric():
    b = scored([[1, 1, 1], [1, 0, 0], [0, 0, 0], [0, 1, 1]], "a")
    keep, drop = informative_groups(b, "score")
    assert [r.tolist() for r in keep] == [[3, 4, 5], [9, 10, 11]] and [r.tolist() for r in drop] == [[0, 1, 2], [6, 7, 8]]
    # seq_reward reads token_level_scores: an overlong penalty on one sample of group 0 makes it informative
    b.tensors["token_level_scores"][1, 0] = -0.5
    assert [r.tolist() for r in informative_groups(b, "seq_reward")[0]] == [[0, 1, 2], [3, 4, 5], [9, 10, 11]]
    assert len(informative_groups(b, "score")[0]) == 2


def test_refill_until_full():
    """4 groups a rank; the first batch has 2 informative (a1, a3), the first refill 3 (b0, b2, b3): 2 are taken."""
    first = scored([[1, 1, 1], [1, 0, 0], [0, 0, 0], [0, 1, 1]], "a")
    refills = iter([scored([[0, 1, 0], [1, 1, 1], [1, 0, 1], [0, 0, 1]], "b", r_width=5, p_width=4)])
    calls = []

    def more():
        calls.append(1)
        return next(refills)

    out, stats = fill_informative(first, more, target=4, max_rounds=3, metric="score", pad_token_id=PAD,
                                  device=torch.device("cpu"))
    assert len(calls) == 1
    assert stats == {"rollout/filtered_groups": 3.0, "rollout/filter_rounds": 1.0, "rollout/filter_short_groups": 0.0}
    assert uids_of(out) == ["a1", "a3", "b0/r1", "b2/r1"]  # a refill's uids are tagged with its round
    assert out.tensors["scores"].tolist() == [1, 0, 0, 0, 1, 1, 0, 1, 0, 1, 0, 1]
    assert out.meta == {"trainer_version": 7}  # the first batch's meta
    # widths: the widest prompt (4, left-padded) and response (5, right-padded) of the parts
    assert out.tensors["prompts"].shape == (12, 4) and out.tensors["responses"].shape == (12, 5)
    assert out.tensors["prompts"][0].tolist() == [PAD, PAD, 2, 2] and out.tensors["response_mask"][0].tolist() == [1, 1, 1, 0, 0]
    for rows in informative_groups(out, "score")[1]:
        raise AssertionError(f"an all-equal group was trained on: rows {rows}")


def test_full_at_once_generates_nothing():
    first = scored([[1, 0], [0, 1]], "a")
    out, stats = fill_informative(first, lambda: pytest.fail("no refill needed"), target=2, max_rounds=3,
                                  metric="score", pad_token_id=PAD, device=torch.device("cpu"))
    assert uids_of(out) == ["a0", "a1"] and stats["rollout/filter_rounds"] == 0.0


def test_after_max_rounds_all_equal_groups_fill_the_open_slots():
    first = scored([[1, 1], [1, 0], [0, 0], [0, 0]], "a")
    refills = iter([scored([[1, 1], [0, 0], [0, 1], [1, 1]], "b"), scored([[0, 0]] * 4, "c")])
    out, stats = fill_informative(first, lambda: next(refills), target=4, max_rounds=2, metric="score",
                                  pad_token_id=PAD, device=torch.device("cpu"))
    # informative: a1, b2; dropped: a0 a2 a3 + b0 b1 b3 + all of c; the 2 open slots take the first dropped, a0 and a2
    assert stats == {"rollout/filtered_groups": 10.0, "rollout/filter_rounds": 2.0, "rollout/filter_short_groups": 2.0}
    assert uids_of(out) == ["a1", "b2/r1", "a0", "a2"] and len(out) == 8
    # max_rounds=0: nothing is generated, the batch trains as it came (informative groups first)
    out, stats = fill_informative(first, lambda: pytest.fail("max_rounds=0"), target=4, max_rounds=0, metric="score",
                                  pad_token_id=PAD, device=torch.device("cpu"))
    assert uids_of(out) == ["a1", "a0", "a2", "a3"] and stats["rollout/filter_short_groups"] == 3.0


@pytest.mark.parametrize(("overrides", "match"), [
    (["trainer.mode=overlap"], "needs trainer.mode=sync"),
    (["algorithm.adv_estimator=reinforce_pp"], "only a group estimator"),
    (["algorithm.filter_groups.max_rounds=-1"], "must be >= 0"),
    (["algorithm.filter_groups.metric=acc"], "algorithm.filter_groups.metric"),
])
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(RECIPE, ["algorithm.filter_groups.enable=true", *overrides]).validate()
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- the trainer's step, tiny model on CPU
SMALL = ["data.num_synthetic=64", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
         "actor.ppo_micro_batch_size_per_device=16", "trainer.logger=[jsonl]", "trainer.total_steps=1",
         "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=-1",
         "algorithm.filter_groups.enable=true"]
# Scores by generate call and group (4 groups of 4 samples each call).
SCRIPT = [[[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 1, 0]],   # informative: 1, 3
          [[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]],   # none
          [[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1], [1, 0, 0, 0]]]   # informative: 0, 2, 3


def test_trainer_step_trains_only_informative_groups(tmp_path, monkeypatch):
    import hybrid_rl.phases.reward as reward_phase
    import hybrid_rl.trainer as trainer_mod
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    calls, trained, generated = [], [], []

    def scripted(batch, tokenizer, fn, on_error, task=None, prefix="reward", reward_model=None, remote=None):
        scores = torch.tensor(SCRIPT[len(calls)], dtype=torch.float32).flatten()
        calls.append(batch.non_tensors["uid"].tolist())
        return (batch.union(tensors=dict(token_level_scores=sparse_scores(scores, batch.tensors["response_mask"]),
                                         scores=scores)), {f"{prefix}/errors": (0.0, 1.0)})

    real = ActorRolloutRefWorker.update_policy

    def spy(self, batch, plan=None):
        trained.append(batch)
        return real(self, batch, plan)

    monkeypatch.setattr(ActorRolloutRefWorker, "update_policy", spy)
    generate = ActorRolloutRefWorker.generate
    monkeypatch.setattr(ActorRolloutRefWorker, "generate",
                        lambda self, prompts, *a, **k: generated.append(len(prompts)) or generate(self, prompts, *a, **k))
    monkeypatch.setattr(reward_phase, "compute_scores", scripted)
    cfg = load_config(RECIPE, [*SMALL, f"trainer.output_dir={tmp_path / 'run'}"]).validate()
    trainer = trainer_mod.Trainer(cfg, cpu_dist())
    try:
        metrics = trainer.step(last=True)
    finally:
        trainer.close()
    assert generated == [4, 4, 4] and len(calls) == 3  # the first batch and two refills of a step's 4 prompts
    assert metrics["rollout/filtered_groups"] == 2 + 4 + 1
    assert metrics["rollout/filter_rounds"] == 2 and metrics["rollout/filter_short_groups"] == 0
    (batch,) = trained
    group = lambda call, g: calls[call][4 * g] + (f"/r{call}" if call else "")  # noqa: E731
    assert uids_of(batch) == [group(0, 1), group(0, 3), group(2, 0), group(2, 2)]
    assert batch.tensors["scores"].tolist() == [1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 1, 1, 1]
    adv = batch.tensors["advantages"].sum(-1)
    assert all(adv[4 * g:4 * g + 4].abs().sum() > 0 for g in range(4))  # every trained group has a gradient
    assert metrics["reward/mean"] == pytest.approx((1 + 2 + 2 + 3) / 16)  # the batch trained on


# --------------------------------------------------------------------------- two ranks agree on the rounds (gloo)
TWO_RANKS = r"""
import json, sys
import torch, torch.distributed as dist
torch.set_num_threads(1)
store, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
sys.path[:0] = sys.argv[3:5]  # tests/unit (this module), tests (its helpers)
from test_filter_groups import scored
from hybrid_rl.phases.reward import fill_informative
# rank 0 is full at once; rank 1 needs two refills (the first brings nothing)
script = {0: [[[1, 0], [0, 1]], [[1, 1], [1, 1]], [[0, 1], [1, 1]]],
          1: [[[1, 1], [1, 0]], [[0, 0], [1, 1]], [[1, 1], [0, 1]]]}[rank]
calls = []
def more():
    calls.append(1)
    return scored(script[len(calls)], "r%d-" % rank)
out, stats = fill_informative(scored(script[0], "r%d-" % rank), more, target=2, max_rounds=5, metric="score",
                              pad_token_id=0, device=torch.device("cpu"))
uids = list(dict.fromkeys(out.non_tensors["uid"].tolist()))
print("RESULT " + json.dumps(dict(calls=len(calls), stats=stats, uids=uids)))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_ranks_take_the_same_number_of_refill_rounds(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    here = Path(__file__).resolve().parent
    procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(tmp_path / "store"), str(r), str(here),
                               str(here.parent)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    res = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        res.append(json.loads(out.split("RESULT ", 1)[1]))
    assert [r["calls"] for r in res] == [2, 2]  # rank 0 generates (and discards) while rank 1 is short
    # dropped: rank 0 (1, 1) in refill 1, (1, 1) in refill 2 = 3; rank 1: (1, 1) first, (0, 0) and (1, 1), (1, 1) = 4
    assert res[0]["stats"] == res[1]["stats"] == {"rollout/filtered_groups": 7.0, "rollout/filter_rounds": 2.0,
                                                 "rollout/filter_short_groups": 0.0}
    assert res[0]["uids"] == ["r0-0", "r0-1"] and res[1]["uids"] == ["r1-1", "r1-1/r2"]
