"""Ulysses sequence parallelism for the packed training passes (``actor.ulysses_sequence_parallel_size``).

The ranks are cut into groups of ``sp`` consecutive ranks. The members of one group hold the same rows and run the
same micro-batches; each keeps a contiguous ``1/sp`` slice of the packed row (``shard``), so activations per rank
shrink by ``sp``. Everything but attention is per position and runs on the slice. Attention needs the whole row: the
``all_to_all`` before it trades "my positions, all heads" for "all positions, my heads" (queries, keys and values;
key/value heads are repeated first when there are fewer of them than ranks), attention runs with the full
``cu_seqlens`` on ``heads / sp`` heads, and the inverse exchange brings the output back to the slice. The LM head
runs on the positions of the slice that predict a response token; ``ShardedRow.gather`` collects every rank's values
into the full per-token tensor, so all members compute the same loss.

The members' rows come together in the driver (``phases/group_rows.py``).

Gradients: the all-to-all's backward is the inverse all-to-all, and the gather's backward hands each rank the
gradient of its own values only. Each member's parameter gradient is then the share of one loss its slice
computed, and their sum over the group is that loss's gradient: FSDP2's reduction (a mean over all ranks) with the
loss scaled by the world size gives exactly the update without sequence parallelism, provided the loss denominators
count each row once (the worker divides its all-reduced counts by the group size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybrid_rl.batch import to_device

if TYPE_CHECKING:  # packed.py's attention calls in here
    from hybrid_rl.workers.packed import Packed


SP_KEY = "actor.ulysses_sequence_parallel_size"


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in the sequence-parallel layout."""

    size: int = 1
    """Ranks per group (1: off)."""
    rank: int = 0
    """This rank's index within its group: which slice of a packed row it keeps."""
    group: "dist.ProcessGroup | None" = None
    """The group's process group (None when ``size`` is 1)."""
    dp_rank: int = 0
    """Which data-parallel share of the batch this rank's group holds."""
    dp_size: int = 1
    """Groups, i.e. distinct shares of the batch: the training ranks / ``size``."""


def data_parallel(rank: int, world: int) -> SequenceParallel:
    """The layout without sequence parallelism: every rank its own share."""
    return SequenceParallel(dp_rank=rank, dp_size=world)


def make_groups(size: int, parent: "dist.ProcessGroup | None" = None) -> SequenceParallel:
    """Groups of ``size`` consecutive ranks of ``parent`` (None: the world); each rank creates its own group only."""
    ranks = dist.get_process_group_ranks(parent) if parent is not None else list(range(dist.get_world_size()))
    me = ranks.index(dist.get_rank())
    if size == 1:
        return data_parallel(me, len(ranks))
    if len(ranks) % size:
        raise ValueError(f"{SP_KEY}={size} must divide the {len(ranks)} training ranks")
    first = me - me % size
    group = dist.new_group(ranks[first:first + size], use_local_synchronization=True)
    return SequenceParallel(size, me % size, group, me // size, len(ranks) // size)


def check_heads(config, size: int, key: str) -> None:
    """The model's attention heads split evenly over ``size`` ranks (key/value heads: evenly, or repeated)."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % size or (kv % size and size % kv):
        raise ValueError(f"{key}={size} must divide the model's {heads} attention heads and divide or be a multiple "
                         f"of its {kv} key/value heads; choose a size that does")


# --------------------------------------------------------------------------- collectives with gradients
def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, sp: SequenceParallel) -> torch.Tensor:
    """``x`` cut in ``sp.size`` chunks along ``scatter_dim``, chunk j sent to rank j; what arrives is joined along
    ``gather_dim`` in rank order."""
    send = torch.stack(x.chunk(sp.size, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=sp.group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter_dim: int, gather_dim: int, sp: SequenceParallel) -> torch.Tensor:
        ctx.dims, ctx.sp = (scatter_dim, gather_dim), sp
        return _exchange(x, scatter_dim, gather_dim, sp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad.contiguous(), gather_dim, scatter_dim, ctx.sp), None, None, None


def seq_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[T / sp, H, D] (this rank's positions, every head) -> [T, H / sp, D] (every position, this rank's heads)."""
    return _AllToAll.apply(x, 1, 0, sp)


def heads_to_seq(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """The inverse of ``seq_to_heads``: [T, H / sp, D] -> [T / sp, H, D]."""
    return _AllToAll.apply(x, 0, 1, sp)


class _GatherRows(torch.autograd.Function):
    """[m] on each rank (padded to a common m) -> [sp, m]; backward: each rank's own row of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        ctx.sp = sp
        out = x.new_empty(sp.size * x.shape[0])
        dist.all_gather_into_tensor(out, x.contiguous(), group=sp.group)
        return out.view(sp.size, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # every member computed the same loss from the same gathered values: its own row is its share
        return grad[ctx.sp.rank].contiguous(), None


def repeat_kv_heads(k: torch.Tensor, size: int) -> torch.Tensor:
    """[T, Hkv, D] with each head repeated so there are at least ``size`` (the query heads a rank keeps after the
    exchange then use the copies of their own key/value heads)."""
    heads = k.shape[1]
    return k if heads >= size else k.repeat_interleave(size // heads, dim=1)


# --------------------------------------------------------------------------- a packed row cut in slices
@dataclass
class ShardedRow:
    """This rank's slice of a packed row and what it needs to take part in the whole row's forward."""

    sp: SequenceParallel
    input_ids: torch.Tensor  # [1, T / sp] this rank's slice (the row padded to a multiple of sp)
    position_ids: torch.Tensor  # [1, T / sp]
    real_tokens: int
    """Positions of the unpadded row: the padding after them attends to nothing (its output is 0)."""
    keep: torch.Tensor  # [m] slice positions whose next token is a response token
    targets: torch.Tensor  # [m] those tokens
    counts: list[int]
    """LM-head rows of every rank's slice."""
    order: torch.Tensor  # [n] the row's LM-head entries (``Packed.keep`` order) as the ranks' slices list them

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """[m] per-token values of this slice -> [n] of the whole row in ``Packed.keep`` order, on every rank."""
        width = max(self.counts)
        rows = _GatherRows.apply(F.pad(values, (0, width - values.shape[0])), self.sp)  # [sp, width]
        flat = torch.cat([rows[r, :c] for r, c in enumerate(self.counts)])
        return flat.new_empty(flat.shape).index_copy(0, self.order, flat)


def shard(p: Packed, sp: SequenceParallel) -> ShardedRow:
    """This rank's contiguous slice of the packed row ``p`` (padded with token 0 at position 0 to a multiple of
    ``sp.size``), and the LM-head rows that fall in it."""
    real = p.input_ids.shape[1]
    width = -(-real // sp.size)
    pad = width * sp.size - real
    ids, pos = (F.pad(x, (0, pad)) for x in (p.input_ids, p.position_ids))
    lo = sp.rank * width
    keep = p.keep_host if p.keep_host is not None else p.keep.cpu()
    owner = torch.div(keep, width, rounding_mode="floor")  # [n] which slice each LM-head row is in
    order = torch.argsort(owner, stable=True)
    counts = torch.bincount(owner, minlength=sp.size).tolist()  # the same on every rank: it is the whole row's
    start = sum(counts[:sp.rank])
    mine = order[start:start + counts[sp.rank]]
    order, mine = (to_device(x, p.keep.device) for x in (order, mine))
    return ShardedRow(sp, ids[:, lo:lo + width], pos[:, lo:lo + width], real, p.keep[mine] - lo, p.targets[mine],
                      counts, order)


def sharded_attention(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: ShardedRow) -> torch.Tensor:
    """``attend(q, k, v)`` over the whole unpadded row ([T, H, D] each) for this rank's slices q/k/v [T / sp, H, D]:
    the exchanges around it, the padding's output 0. Returns [T / sp, Hq, D]."""
    sp = row.sp
    q = seq_to_heads(q, sp)
    k, v = (seq_to_heads(repeat_kv_heads(x, sp.size), sp) for x in (k, v))
    real = row.real_tokens
    out = attend(q[:real], k[:real], v[:real])
    if out.shape[0] < q.shape[0]:
        out = torch.cat([out, out.new_zeros(q.shape[0] - real, *out.shape[1:])])
    return heads_to_seq(out, sp)
