"""The rows a sequence-parallel group trains on (``actor.ulysses_sequence_parallel_size``, ``workers/ulysses.py``).

Each rank generates and scores its own rollouts; the members of a group must then hold the same rows for the
training passes. ``gather_group_rows`` (after the reward phase) gives every member all its members' rows, ordered
so that the group's mini-batches are the union of the members' mini-batches without sequence parallelism;
``per_member`` runs what is computed over a rank's batch as a whole (the advantage's whitening) on each member's
rows alone; ``own_rows`` takes a rank's own rows back for the step's metrics. With a group of one they hand the batch
through.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from hybrid_rl.batch import Batch
from hybrid_rl.distributed import all_reduce_max
from hybrid_rl.micro_batching import pad_widths
from hybrid_rl.workers.ulysses import SequenceParallel

T = TypeVar("T")


def gather_group_rows(batch: Batch, sp: SequenceParallel, pad_token_id: int, chunk: int
                      ) -> tuple[Batch, list[np.ndarray]]:
    """Every member's rows on every member of the group (padded to the group's widths; ``batch``'s own meta), and
    where each member's rows are in it. A collective over the group.

    The rows come in turns of ``chunk`` per member (a member's share of one mini-batch), so the group's mini-batch
    j holds its members' mini-batches j: the mini-batches without sequence parallelism."""
    if sp.size == 1:
        return batch, [np.arange(len(batch))]
    t = batch.tensors
    widths = torch.tensor([t["prompts"].shape[1], t["responses"].shape[1]], device=t["responses"].device)
    all_reduce_max(widths, sp.group)
    own = pad_widths(Batch(t, batch.non_tensors), int(widths[0]), int(widths[1]), pad_token_id).to("cpu")
    parts: list = [None] * sp.size
    dist.all_gather_object(parts, own.state_dict(), group=sp.group)
    rows = Batch.concat([Batch.from_state_dict(part) for part in parts]).to(t["responses"].device)
    sizes = [len(part["tensors"]["responses"]) for part in parts]
    starts = np.cumsum([0] + sizes[:-1])
    turns = [(j, m) for j in range(0, max(sizes), chunk) for m in range(sp.size) if j < sizes[m]]
    order = np.concatenate([starts[m] + np.arange(j, min(j + chunk, sizes[m])) for j, m in turns])
    members = [np.flatnonzero((order >= s) & (order < s + n)) for s, n in zip(starts, sizes)]
    rows = rows.index(order)
    return Batch(rows.tensors, rows.non_tensors, dict(batch.meta)), members


def own_rows(batch: Batch, where: np.ndarray) -> Batch:
    """A member's rows, in its order, of a batch ``gather_group_rows`` built (``where``: one of its ``members``)."""
    return batch if len(where) == len(batch) else batch.index(where)


def per_member(batch: Batch, members: list[np.ndarray], own: int,
               fn: Callable[[Batch], tuple[Batch, T]]) -> tuple[Batch, T]:
    """``fn`` on each member's rows of a gathered batch alone (what that member computes without sequence
    parallelism), the rows put back in place; with ``fn``'s second answer for member ``own``."""
    if len(members) == 1:
        return fn(batch)
    outs = [fn(own_rows(batch, rows)) for rows in members]
    joined = Batch.concat([b for b, _ in outs]).index(np.argsort(np.concatenate(members)))
    return Batch(joined.tensors, joined.non_tensors, dict(batch.meta)), outs[own][1]
