"""Every consumer of ``response_mask`` on a multi-turn trajectory, whose mask has holes where observations sit.

A trajectory here: 3 sampled tokens, 4 observation tokens, 2 sampled tokens, then padding. Expected values are
worked out by hand (or by a plain loop over the sampled tokens only) in each test; each would differ if the code
assumed the mask to be a prefix (the score on position ``mask.sum() - 1`` = 4, an observation; a length of 5; the
reward-to-go restarting inside the hole; packing widths cut at 5 columns).
"""

from __future__ import annotations

import numpy as np
import torch

from hybrid_rl.algorithms import gae_advantage, reinforce_pp_advantage, response_extent
from hybrid_rl.batch import Batch
from hybrid_rl.telemetry.metrics import cut_at_cap, outcome_sums
from hybrid_rl.micro_batching import trim_padding

from hybrid_rl.rewards.overlong import overlong_penalty
from hybrid_rl.phases.reward import answer_mask, sparse_scores

#                      sampled  | observation | sampled | pad
HOLEY = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
                      [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]])  # a single-turn row beside it
INSIDE = torch.tensor([[1] * 9 + [0, 0], [1, 1] + [0] * 9])  # the attention mask's response part
TURNS = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 2, 2, 0, 0], [1, 1] + [0] * 9])


def test_the_score_sits_on_the_last_sampled_token():
    out = sparse_scores(torch.tensor([2.0, 3.0]), HOLEY)
    assert out[0, 8] == 2.0 and out[0].sum() == 2.0  # position 8, not mask.sum() - 1 = 4 (an observation)
    assert out[1, 1] == 3.0 and out[1].sum() == 3.0


def test_lengths_count_the_trajectory_up_to_its_last_sampled_token():
    assert response_extent(HOLEY).tolist() == [9, 2]
    assert cut_at_cap(HOLEY, 9).tolist() == [True, False]  # 9 tokens of a 9-token budget: cut
    assert cut_at_cap(HOLEY, 10).tolist() == [False, False]
    sums = outcome_sums(torch.tensor([1.0, 0.0]), HOLEY, 9)
    assert sums["length"] == 11.0 and sums["clipped"] == 1.0 and sums["clipped_score"] == 1.0
    assert overlong_penalty(response_extent(HOLEY), 10, 4, 1.0).tolist() == [-0.75, 0.0]  # 9 - 6 = 3 of 4


def test_a_trajectory_the_budget_ended_counts_as_cut():
    """An observation that would not fit ends its trajectory short of the cap, before the model could answer: cut,
    for the clip ratio and for ``actor.mask_truncated_completions``, like a response that reached the cap."""
    from types import SimpleNamespace

    from hybrid_rl.envs.base import STOPS
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    budget, answer = STOPS.index("budget"), STOPS.index("answer")
    assert cut_at_cap(HOLEY, 10, torch.tensor([budget, answer])).tolist() == [True, False]
    assert cut_at_cap(HOLEY, 10, torch.tensor([answer, answer])).tolist() == [False, False]
    sums = outcome_sums(torch.tensor([0.0, 1.0]), HOLEY, 10, torch.tensor([budget, answer]))
    assert sums["clipped"] == 1.0 and sums["clipped_score"] == 0.0
    worker = SimpleNamespace(cfg=SimpleNamespace(actor=SimpleNamespace(mask_truncated_completions=True),
                                                 data=SimpleNamespace(max_response_length=10)))
    t = {"response_mask": HOLEY, "env_stop": torch.tensor([budget, answer])}
    assert ActorRolloutRefWorker._loss_mask(worker, t).tolist() == [[0.0] * 11, HOLEY[1].float().tolist()]
    worker.cfg.actor.mask_truncated_completions = False
    assert ActorRolloutRefWorker._loss_mask(worker, t).tolist() == HOLEY.float().tolist()


def test_reinforce_pp_returns_carry_through_the_observation():
    rewards = sparse_scores(torch.tensor([1.0, 1.0]), HOLEY)
    gamma = 0.5
    _, returns = reinforce_pp_advantage(rewards, HOLEY.float(), gamma=gamma)
    # over the sampled tokens only (positions 0, 1, 2, 7, 8), discounted once per sampled token
    expected = [gamma ** 4, gamma ** 3, gamma ** 2, 0, 0, 0, 0, gamma, 1.0, 0, 0]
    assert torch.allclose(returns[0], torch.tensor(expected))
    assert torch.allclose(returns[1, :2], torch.tensor([gamma, 1.0]))


def test_gae_skips_the_observation():
    rewards = sparse_scores(torch.tensor([1.0, 0.0]), HOLEY)
    values = torch.arange(11, dtype=torch.float32)[None].repeat(2, 1) / 10 + 5 * (1 - HOLEY)  # junk in the hole
    gamma, lam = 0.9, 0.8
    adv, ret = gae_advantage(rewards, values, HOLEY.float(), gamma=gamma, lam=lam, whiten="none")
    # the same recursion written over the sampled positions of row 0 alone
    pos = [0, 1, 2, 7, 8]
    v = [float(values[0, p]) for p in pos]
    r = [float(rewards[0, p]) for p in pos]
    expect, last, nxt = [0.0] * 5, 0.0, 0.0
    for k in reversed(range(5)):
        last = r[k] + gamma * nxt - v[k] + gamma * lam * last
        nxt = v[k]
        expect[k] = last
    assert torch.allclose(adv[0, pos], torch.tensor(expect), atol=1e-6)
    assert torch.all(adv[0, 3:7] == 0) and torch.all(ret[0, 3:7] == 0)


def test_micro_batches_keep_the_whole_trajectory():
    """Trimming cuts the response columns at the longest trajectory (9), not at the most sampled tokens (5)."""
    prompt_mask = torch.ones(2, 3, dtype=torch.long)
    attention = torch.cat([prompt_mask, INSIDE], dim=1)
    batch = Batch({"prompts": torch.zeros(2, 3, dtype=torch.long), "responses": torch.arange(22).view(2, 11),
                   "response_mask": HOLEY, "attention_mask": attention, "input_ids": torch.zeros(2, 14, dtype=torch.long),
                   "position_ids": torch.arange(14)[None].repeat(2, 1), "turn_ids": TURNS}, {"uid": np.array(["a", "b"])})
    trimmed = trim_padding(batch)
    assert trimmed.tensors["responses"].shape[1] == 9
    assert torch.equal(trimmed.tensors["response_mask"], HOLEY[:, :9])


def test_the_reward_reads_the_last_turn():
    batch = Batch({"response_mask": HOLEY, "turn_ids": TURNS})
    assert answer_mask(batch).long().tolist() == [[0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0], [1, 1] + [0] * 9]
    assert torch.equal(answer_mask(Batch({"response_mask": HOLEY})), HOLEY.bool())  # single-turn: the response
