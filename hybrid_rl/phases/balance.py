"""Balancing the update's rows over the data-parallel ranks by their tokens (``trainer.balance_batch``).

Each rank generates its own prompts' samples, so one rank can hold far more tokens than another (a long tail of
long responses), and every optimizer step waits for the rank with the most. Before the updates (critic and actor)
the ranks exchange whole groups (a prompt's samples stay together) so that, within each mini-batch, every rank
trains a similar number of tokens: the groups of the step's mini-batch j (every rank's j-th share) are dealt out
again, largest first, each to the rank with the fewest tokens so far that still has room, every rank keeping its
number of groups. A mini-batch keeps its samples, and the losses are normalised by global token counts, so the update
is the one without balancing up to the order of floating-point sums; the advantages were computed before, on each
rank's own rows. Metrics: ``perf/dp_token_imbalance`` and ``perf/dp_token_imbalance_before`` (the largest rank's
tokens over the mean, summed over the mini-batches; 1 is even), ``timing/balance``.

Each group travels once, from the rank that generated it to the rank that trains it: one ``all_to_all`` per tensor
on the ranks' device (NCCL on GPUs), and the per-row texts (uids, ground truths) gathered on the host. Left out: balancing before the log-prob passes (the advantages and their per-rank
statistics would then change), and sequence-parallel groups (their members already share rows).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from hybrid_rl.batch import Batch
from hybrid_rl.distributed import DistInfo, all_reduce_max
from hybrid_rl.micro_batching import pad_widths


def group_spans(uids: np.ndarray) -> list[tuple[int, int]] | None:
    """[start, end) of each run of equal ``uid``s (a prompt's samples); None when a uid comes back in a later run."""
    spans: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(uids) + 1):
        if i == len(uids) or uids[i] != uids[start]:
            spans.append((start, i))
            start = i
    return spans if len({uids[s] for s, _ in spans}) == len(spans) else None


def plan_balance(loads: list[list[float]], chunk: int) -> list[list[tuple[int, int]]]:
    """For each rank, the (source rank, group) pairs it trains, mini-batch by mini-batch.

    ``loads[r][g]``: the tokens of rank ``r``'s ``g``-th group (every rank the same number of groups); ``chunk``:
    groups of one mini-batch on each rank. Within mini-batch j the groups of every rank's j-th chunk are dealt
    largest first (ties by source rank, then group) to the rank with the fewest tokens of that mini-batch so far and
    room left; each rank gets as many as it had. Deterministic: every rank computes the same plan."""
    world = len(loads)
    n_groups = len(loads[0])
    plan: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for j in range(0, n_groups, chunk):
        members = [(r, g) for r in range(world) for g in range(j, min(j + chunk, n_groups))]
        members.sort(key=lambda rg: (-loads[rg[0]][rg[1]], rg[0], rg[1]))
        room = [min(j + chunk, n_groups) - j] * world
        tokens = [0.0] * world
        taken: list[list[tuple[int, int]]] = [[] for _ in range(world)]
        for r, g in members:
            dst = min((k for k in range(world) if room[k]), key=lambda k: (tokens[k], k))
            taken[dst].append((r, g))
            tokens[dst] += loads[r][g]
            room[dst] -= 1
        for dst in range(world):
            plan[dst] += sorted(taken[dst])
    return plan


def imbalance(loads: list[list[float]], plan: list[list[tuple[int, int]]] | None, chunk: int) -> float:
    """Σ over mini-batches of the largest rank's tokens ÷ Σ of the mean rank's (1 = even); ``plan`` None: as
    generated."""
    world, n_groups = len(loads), len(loads[0])
    worst = mean = 0.0
    for j in range(0, n_groups, chunk):
        if plan is None:
            per_rank = [sum(loads[r][j:j + chunk]) for r in range(world)]
        else:
            k = min(j + chunk, n_groups) - j
            per_rank = [sum(loads[r][g] for r, g in plan[dst][j:j + k]) for dst in range(world)]
        worst += max(per_rank)
        mean += sum(per_rank) / world
    return worst / mean if mean else 1.0


def balance_rows(batch: Batch, dist_info: DistInfo, pad_token_id: int, rows_per_mini_batch: int
                 ) -> tuple[Batch, dict[str, float]]:
    """This rank's rows after balancing (``plan_balance``) and the imbalance before and after. A collective over
    ``dist_info.group``; a world of one, or a batch whose groups are not whole runs of equal size, is handed back."""
    if dist_info.world_size == 1:
        return batch, {}
    t = batch.tensors
    spans = group_spans(np.asarray(batch.non_tensors["uid"]))
    sizes = {e - s for s, e in spans} if spans else set()
    # every rank must agree to balance: the group size and count, the same on all
    size = next(iter(sizes)) if len(sizes) == 1 else 0
    shape = torch.tensor([size, len(spans or []), -size, -len(spans or [])], dtype=torch.float64,
                         device=t["responses"].device)
    all_reduce_max(shape, dist_info.group)
    if size == 0 or shape[0] != -shape[2] or shape[1] != -shape[3] or rows_per_mini_batch % size:
        return batch, {}
    n_groups = len(spans)
    tokens = t["attention_mask"].sum(dim=1).double()
    own = torch.stack([tokens[s:e].sum() for s, e in spans])
    gathered = [torch.zeros_like(own) for _ in range(dist_info.world_size)]
    dist.all_gather(gathered, own, group=dist_info.group)
    loads = [g.tolist() for g in gathered]
    chunk = rows_per_mini_batch // size
    plan = plan_balance(loads, chunk)
    stats = {"perf/dp_token_imbalance_before": imbalance(loads, None, chunk),
             "perf/dp_token_imbalance": imbalance(loads, plan, chunk)}
    widths = torch.tensor([t["prompts"].shape[1], t["responses"].shape[1]], device=t["responses"].device)
    all_reduce_max(widths, dist_info.group)
    padded = pad_widths(batch, int(widths[0]), int(widths[1]), pad_token_id)
    out = _exchange(padded, plan, size, dist_info)
    assert len(out) == n_groups * size
    return Batch(out.tensors, out.non_tensors, dict(batch.meta)), stats


def _exchange(batch: Batch, plan: list[list[tuple[int, int]]], size: int, dist_info: DistInfo) -> Batch:
    """This rank's rows under ``plan``, each group sent once from its rank to the rank that trains it: one
    ``all_to_all`` per tensor (on the group's device) and one gather of the per-row texts (uids, ground truths)."""
    world, me = dist_info.world_size, dist_info.rank
    send = [[g for r, g in plan[dst] if r == me] for dst in range(world)]  # in the order dst trains them
    recv = [[g for r, g in plan[me] if r == src] for src in range(world)]
    send_rows = np.array([row for groups in send for g in groups for row in range(g * size, (g + 1) * size)],
                         dtype=np.int64)
    in_splits = [len(groups) * size for groups in send]
    out_splits = [len(groups) * size for groups in recv]
    # the received rows come by source rank; put them in the plan's order
    first = np.cumsum([0] + out_splits[:-1])
    slot = {(src, g): first[src] + k * size for src in range(world) for k, g in enumerate(recv[src])}
    order = np.array([slot[(r, g)] + i for r, g in plan[me] for i in range(size)], dtype=np.int64)
    tensors = {}
    idx = torch.as_tensor(send_rows)
    for key, t in batch.tensors.items():
        flat = t.to(dist_info.device)
        as_bytes = flat.dtype == torch.bool
        flat = flat.to(torch.uint8) if as_bytes else flat
        sent = flat.index_select(0, idx.to(flat.device)).contiguous()
        got = flat.new_empty((sum(out_splits), *flat.shape[1:]))
        dist.all_to_all_single(got, sent, output_split_sizes=out_splits, input_split_sizes=in_splits,
                               group=dist_info.group)
        got = got.index_select(0, torch.as_tensor(order, device=got.device))
        tensors[key] = (got.bool() if as_bytes else got).to(t.device)
    # per-row texts and ids (uids, ground truths, ...), small beside the tensors: each rank's rows for each
    # destination, gathered everywhere; a destination's rows from a source come in the order it trains them
    outgoing = []
    start = 0
    for dst in range(world):
        rows = send_rows[start:start + in_splits[dst]]
        start += in_splits[dst]
        outgoing.append({k: [v[row] for row in rows] for k, v in batch.non_tensors.items()})
    gathered: list = [None] * world
    dist.all_gather_object(gathered, outgoing, group=dist_info.group)
    non_tensors = {}
    for key, values in batch.non_tensors.items():
        received = [v for src in range(world) for v in gathered[src][me][key]]
        non_tensors[key] = _like(values, [received[i] for i in order])
    return Batch(tensors, non_tensors, dict(batch.meta))


def _like(values, items: list):
    """``items`` in the container kind of ``values`` (a numpy array of the same dtype, or a list)."""
    if isinstance(values, np.ndarray):
        out = np.empty(len(items), dtype=values.dtype)
        out[:] = items
        return out
    return list(items)
