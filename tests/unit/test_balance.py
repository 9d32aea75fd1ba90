"""``phases/balance.py``'s plan: which rank trains which group after balancing, checked against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hybrid_rl.phases.balance import group_spans, imbalance, plan_balance


def test_group_spans():
    assert group_spans(np.array(["a", "a", "b", "b", "c", "c"])) == [(0, 2), (2, 4), (4, 6)]
    assert group_spans(np.array(["a", "b", "a"])) is None  # a group split in two runs


def _best_max(groups: list[float], world: int, per_rank: int) -> float:
    """The smallest possible largest rank load of one mini-batch, by trying every assignment."""
    best = float("inf")
    for labels in itertools.product(range(world), repeat=len(groups)):
        if all(labels.count(r) == per_rank for r in range(world)):
            best = min(best, max(sum(g for g, l in zip(groups, labels) if l == r) for r in range(world)))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_keeps_mini_batches_and_counts_and_evens_the_tokens(seed):
    rng = np.random.default_rng(seed)
    world, n_groups, chunk = 2 + seed % 2, 4, 2
    loads = [list(rng.lognormal(5, 1, n_groups)) for _ in range(world)]
    plan = plan_balance(loads, chunk)
    assert sorted(x for p in plan for x in p) == [(r, g) for r in range(world) for g in range(n_groups)]
    for dst in range(world):
        assert len(plan[dst]) == n_groups
        for j in range(0, n_groups, chunk):  # mini-batch j keeps its groups: every rank's j-th share
            assert all(j <= g < j + chunk for _, g in plan[dst][j:j + chunk])
    for j in range(0, n_groups, chunk):
        groups = [loads[r][g] for r in range(world) for g in range(j, j + chunk)]
        got = max(sum(loads[r][g] for r, g in plan[dst][j:j + chunk]) for dst in range(world))
        before = max(sum(loads[r][j:j + chunk]) for r in range(world))
        best = _best_max(groups, world, chunk)
        assert got <= before + 1e-9 and got <= best * 4 / 3 + 1e-9  # largest-first's bound
    assert imbalance(loads, plan, chunk) <= imbalance(loads, None, chunk) + 1e-12


def test_a_skewed_batch_is_evened_out():
    loads = [[100, 100, 100, 100], [1, 1, 1, 1]]
    plan = plan_balance(loads, 4)
    assert imbalance(loads, None, 4) == pytest.approx(400 / 202)  # the largest rank over the mean
    assert imbalance(loads, plan, 4) == pytest.approx(1.0)
    assert sorted(r for r, _ in plan[0]) == [0, 0, 1, 1] and sorted(r for r, _ in plan[1]) == [0, 0, 1, 1]
