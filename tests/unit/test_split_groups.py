"""``split.make_layout``'s groups against torch's rule for a device-bound world (what hung 2 + 2 and 1 + 3 on 4xH200).

With a device bound to the default group (``init_distributed`` binds one on CUDA), torch 2.11-2.13 make each
``new_group`` call an ``ncclCommSplit`` of the world's communicator, a collective of every rank: a member of a new
NCCL group splits with a colour when the group connects (at creation when it gets a ``device_id``, else at its first
collective), and a rank that calls ``new_group`` without being a member makes a no-colour split at once, *whatever
the new group's backend* (``_new_process_group_helper``). A gloo group that leaves ranks out thus makes only those
ranks split. CPU has no NCCL, so this test runs ``make_layout`` on every rank of a simulated world and replays its
calls through that rule: every rank must make the same number of splits at creation, none left to a first use.
The GPU side of the same check is ``tests/gpu/test_split_groups_gpu.py`` (4xH100: passes; the old groups hang).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as tdist

from hybrid_rl.modes import split

NON_MEMBER = object()


def _simulate(monkeypatch, world: int, n_rollout: int, bound: bool = True) -> list[list[tuple]]:
    """Run make_layout as each rank; per rank, the splits it makes at creation and the groups left to connect."""
    traces = []
    for rank in range(world):
        calls: list[tuple] = []

        def new_group(ranks, backend=None, device_id=None, use_local_synchronization=False, _rank=rank, _calls=calls):
            if use_local_synchronization and _rank not in ranks:
                raise AssertionError("a non-member must not call new_group with use_local_synchronization")
            member = _rank in ranks
            if member and backend == "nccl" and bound and device_id is None:
                _calls.append(("lazy", tuple(ranks)))  # splits at its first collective, out of step with the others
            elif member and backend == "nccl" and bound:
                _calls.append(("split", tuple(ranks)))
            elif not member and bound:
                _calls.append(("nocolor", tuple(ranks)))  # torch does this for gloo groups too
            return SimpleNamespace(ranks=tuple(ranks), backend=backend) if member else NON_MEMBER

        monkeypatch.setattr(tdist, "new_group", new_group)
        monkeypatch.setattr(tdist, "get_world_size", lambda: world)
        monkeypatch.setattr(tdist, "get_rank", lambda _r=rank: _r)
        monkeypatch.setattr(tdist, "get_backend", lambda group=None: "nccl")
        default = SimpleNamespace(bound_device_id=f"cuda:{rank}" if bound else None)
        monkeypatch.setattr(tdist.distributed_c10d, "_get_default_group", lambda _d=default: _d)
        layout = split.make_layout(n_rollout)
        assert layout.rank == rank
        if rank < n_rollout or rank == n_rollout:  # the weight transfer's members hold its metadata group
            assert layout.meta_group is not None and layout.meta_group is not NON_MEMBER
        traces.append(calls)
    return traces


@pytest.mark.parametrize("world,n_rollout", [(2, 1), (4, 1), (4, 2), (4, 3), (8, 2), (8, 5)])
def test_every_rank_makes_the_same_splits_at_creation(monkeypatch, world, n_rollout):
    traces = _simulate(monkeypatch, world, n_rollout)
    assert all(kind != "lazy" for t in traces for kind, _ in t), traces
    counts = {len(t) for t in traces}
    assert counts == {3}, traces  # trainer, rollout and broadcast groups: one split each on every rank
    # the k-th split of every rank belongs to the same group (members with its colour, the rest without)
    for k in range(3):
        assert len({t[k][1] for t in traces}) == 1, [t[k] for t in traces]


def test_the_old_groups_fail_the_rule(monkeypatch):
    """The groups as made before the fix: 2 + 2 leaves the second trainer rank with one more split than the others."""

    from helpers import old_split_groups

    monkeypatch.setattr(split, "make_layout", old_split_groups)
    traces = _simulate(monkeypatch, 4, 2)
    assert [len(t) for t in traces] == [3, 3, 3, 4]  # rank 3, outside the gloo metadata group, splits once more
    assert traces[3][-1] == ("nocolor", (2, 0, 1))
    assert any(kind == "lazy" for kind, _ in traces[0])  # and members were left to split at a first collective


def test_no_bound_device_means_plain_groups(monkeypatch):
    assert _simulate(monkeypatch, 4, 2, bound=False) == [[], [], [], []]
