"""Split placement: ranks ``0..R-1`` only generate, ranks ``R..W-1`` only train.

The colocated hybrid engine time-shares every GPU; split placement gives the
rollout engine GPUs of its own (as verl's one-step-off policy and AReaL do),
inside the same torchrun world. Each step moves two things, always in the same
order on both sides, so the collectives pair up:

1. the generated batch, rollout ranks → trainer ranks (pickled CPU tensors over a
   gloo group; every trainer rank keeps its share of the prompt groups);
2. the trainer's weights, trainer ranks → rollout ranks (``broadcast_weights`` /
   ``receive_weights``, in ``hybrid_rl.weights.broadcast``): the first trainer
   rank broadcasts flat buckets of the engine dtype over NCCL, the rollout
   ranks load them into their engine bucket by bucket.

With ``trainer.mode=overlap`` the rollout ranks generate batch k+1 with θ_k
in a background thread while the trainer ranks update on batch k (staleness ≤ 1,
as colocated overlap), so their step ends and the per-step collectives after it
pair up at once; a trainer rank's wait for that batch falls in its next step's
``timing/wait_gen``. With ``sync`` each side waits for the other. vLLM's ``external_launcher`` builds
its process groups over the whole world, so with ``rollout.name=vllm`` the
trainer ranks build an engine too and put it to sleep at level 2 (weights and
KV cache released) right away; it only exists so the group creation pairs up.
Every rank meets at a barrier first and the trainer ranks build it before
their models (``placement.meet_at_engines``). The groups themselves are made so
that every rank takes part in the same NCCL splits (``make_layout``), without
which a layout whose gloo group leaves ranks out never finishes its set-up.

Validation pushes θ_k to the rollout ranks, which generate greedily and hand
the reduced figures to the logging trainer rank. Checkpoints: the trainer ranks
save the actor through DCP over their own group, every rank writes its extra
(the rollout ranks: sampler, RNGs and the batch generated ahead), and a resumed
run re-sends θ before its first step. With ``trainer.partial_rollouts`` the rollout
ranks run partial rollouts' pool (``rollout_source.SplitSource``; staleness up to 2).
Left out: more staleness otherwise, and resizing R at run time (a checkpoint
resumes on the same layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from hybrid_rl.batch import Batch
from hybrid_rl.micro_batching import pad_widths
from hybrid_rl.modes.partial import COUNTS


@dataclass
class SplitLayout:
    rank: int
    n_rollout: int
    world: int
    trainer_group: dist.ProcessGroup
    rollout_group: dist.ProcessGroup
    obj_group: dist.ProcessGroup
    """gloo over the whole world: batches and bucket metadata."""
    bcast_group: dist.ProcessGroup
    """The first trainer rank plus every rollout rank: the weight broadcast (NCCL on GPU)."""
    meta_group: dist.ProcessGroup | None
    """Same ranks as ``bcast_group``, on gloo: the bucket metadata (None on the other trainer ranks)."""

    @property
    def is_rollout(self) -> bool:
        return self.rank < self.n_rollout

    @property
    def leader(self) -> int:
        """The first trainer rank: it broadcasts the weights and logs the metrics."""
        return self.n_rollout

    @property
    def index(self) -> int:
        """This rank's index inside its side (rollout or trainer)."""
        return self.rank if self.is_rollout else self.rank - self.n_rollout

    @property
    def side_size(self) -> int:
        return self.n_rollout if self.is_rollout else self.world - self.n_rollout


def make_layout(n_rollout: int) -> SplitLayout:
    """Create the groups (every rank calls this, in the same order).

    With a device bound to the default group (``init_distributed`` binds one on CUDA, for eager NCCL set-up),
    torch creates every subgroup by ``ncclCommSplit`` of the world's communicator, a collective of all ranks:
    members split with a colour, and a rank outside the new group makes a no-colour split instead, *whatever the
    new group's backend*. So a gloo group that leaves ranks out makes those ranks split while its members do not:
    under 2 + 2 (and 1 + 3) the trainer ranks outside the weight-metadata group would wait in that split for ever,
    and the others for them in the first collective after it (under 1 + 1 and 3 + 1 that group holds every rank,
    and every rank splits alike). Here every NCCL group connects at creation
    (``_nccl_group``: one split per group on every rank), and the gloo group with non-members is created by
    its members alone (``_members_only_gloo``)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    rollout_ranks, trainer_ranks = list(range(n_rollout)), list(range(n_rollout, world))
    trainer_group = _nccl_group(trainer_ranks)
    rollout_group = _nccl_group(rollout_ranks)
    obj_group = dist.new_group(list(range(world)), backend="gloo")  # every rank a member: nothing to split
    bcast_ranks = [n_rollout, *rollout_ranks]
    bcast_group = _nccl_group(bcast_ranks)
    meta_group = _members_only_gloo(bcast_ranks, rank)
    return SplitLayout(rank, n_rollout, world, trainer_group, rollout_group, obj_group, bcast_group, meta_group)


def _nccl_group(ranks: list[int]):
    """A group on the world's backend. With a device bound (CUDA), it connects at creation, so that its split
    pairs with the other ranks' no-colour splits made in the same call (a member left to connect at its first
    collective would split then, out of step with them); gloo (CPU) makes no splits."""
    device = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    return dist.new_group(ranks, backend=dist.get_backend(), **({"device_id": device} if device is not None else {}))


def _members_only_gloo(ranks: list[int], rank: int):
    """A gloo group over ``ranks``, created by its members only (``use_local_synchronization``): a non-member
    calling ``new_group`` would make a no-colour NCCL split that no member makes (see ``make_layout``)."""
    if len(set(ranks)) == dist.get_world_size():
        return dist.new_group(ranks, backend="gloo")
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True) if rank in ranks else None


# --------------------------------------------------------------------------- batches
def send_batch(layout: SplitLayout, batch: Batch | None, widths: tuple[int, int], pad_token_id: int) -> Batch | None:
    """Collective over the world: the rollout ranks contribute their batch, every trainer rank gets its share.

    Rollout batches are padded to ``widths`` (max prompt, max response) so they
    concatenate; the trainer trims padding per micro-batch anyway.
    """
    payload = None
    if layout.is_rollout:
        meta = {k: v for k, v in batch.meta.items() if not isinstance(v, Batch)}
        payload = Batch(batch.tensors, batch.non_tensors, meta)
        payload = pad_widths(payload.to("cpu"), *widths, pad_token_id).state_dict()
    parts: list = [None] * layout.world
    dist.all_gather_object(parts, payload, group=layout.obj_group)
    if layout.is_rollout:
        return None
    batches = [Batch.from_state_dict(p) for p in parts[:layout.n_rollout]]
    full = Batch.concat(batches)
    full.meta["gen_s"] = max(b.meta.get("gen_s", 0.0) for b in batches)
    versions = [b.meta.get("weight_version") for b in batches]
    full.meta["weight_version"] = None if None in versions else min(versions)
    # every trainer rank takes a contiguous slice of whole prompt groups (n samples each)
    share = len(full) // layout.side_size
    mine = full.index(slice(layout.index * share, (layout.index + 1) * share))
    for key in COUNTS:  # partial rollouts' per-rank counts: summed over the rollout ranks, held by one trainer rank
        if key in full.meta:
            mine.meta[key] = sum(b.meta.get(key, 0) for b in batches) if layout.index == 0 else 0
    return mine

