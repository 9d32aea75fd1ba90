"""Process-group set-up and the few collectives the SPMD driver needs.

Every rank runs the same loop (no Ray, no controller). Under torchrun the
process group comes from the environment (NCCL on GPU, gloo on CPU), even for
one rank, so the actor takes the FSDP2 path; a plain ``python -m hybrid_rl``
run is a world of one without a process group. Metrics are reduced as (sum, count) pairs so that means are weighted by
how many samples or tokens each rank saw. The collectives here run over a
*data-parallel group*, carried in ``DistInfo.group``: the whole world (None),
except under ``trainer.placement=split`` where the trainer ranks and the
rollout ranks each reduce among themselves (``placement.make_placement``). Left out: multi-node launch helpers (torchrun's rendezvous
already does that).
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: "dist.ProcessGroup | None" = None
    """The data-parallel group this rank trains in (FSDP mesh, loss denominators, metrics); None = the world."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_pref: str = "auto", timeout_s: float | None = None,
                     expandable_segments: bool = False) -> DistInfo:
    """Join torchrun's process group when launched by it; otherwise a world of one. ``timeout_s``: how long a
    collective waits for the other ranks before it raises (torch's default when None). ``expandable_segments``: see
    ``use_expandable_segments`` (CUDA only)."""
    use_cuda = torch.cuda.is_available() if device_pref == "auto" else device_pref == "cuda"
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible; set trainer.device=cpu or auto")
    if use_cuda and expandable_segments:
        use_expandable_segments()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # Under torchrun (even with one rank) join a process group so the actor is
    # FSDP2-wrapped on one code path; a plain `python -m hybrid_rl` run skips it.
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=device if use_cuda else None, **kwargs)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def use_expandable_segments() -> bool:
    """PyTorch's expandable segments for this process's CUDA allocations (``trainer.expandable_segments``): segments
    grow and shrink in place instead of one cached block per size, against the fragmentation of packed micro-batches
    whose sizes change every call. Set in ``PYTORCH_CUDA_ALLOC_CONF`` as well, where vLLM looks for it to turn it off
    around its sleep-mode pools (the two are incompatible: pytorch#147851). An explicit ``expandable_segments`` in
    the user's ``PYTORCH_CUDA_ALLOC_CONF`` wins. Returns whether it is on."""
    conf = os.environ.get(ALLOC_CONF, "")
    if "expandable_segments" in conf:
        return "expandable_segments:True" in conf
    os.environ[ALLOC_CONF] = ",".join(filter(None, [conf, "expandable_segments:True"]))
    if torch.cuda.is_initialized():  # the allocator read the variable already: tell it directly
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return True


Group = "dist.ProcessGroup | None"


def world_size(group: Group = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _reduce(t: torch.Tensor, op, group: Group) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def all_reduce_sum(t: torch.Tensor, group: Group = None) -> torch.Tensor:
    return _reduce(t, dist.ReduceOp.SUM, group)


def all_reduce_max(t: torch.Tensor, group: Group = None) -> torch.Tensor:
    """In place; a CPU tensor is moved to the group's device for NCCL and back."""
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return t
    if dist.get_backend(group) == "nccl" and t.device.type != "cuda":
        t.copy_(_reduce(t.to("cuda"), dist.ReduceOp.MAX, group))
        return t
    return _reduce(t, dist.ReduceOp.MAX, group)


def reduce_weighted_means(stats: dict[str, tuple[float, float]], device: torch.device,
                          group: Group = None) -> dict[str, float]:
    """Global means from per-rank (sum, count) pairs."""
    if not stats:
        return {}
    keys = sorted(stats)
    t = torch.tensor([[float(stats[k][0]), float(stats[k][1])] for k in keys], dtype=torch.float64, device=device)
    all_reduce_sum(t, group)
    return {k: (t[i, 0] / t[i, 1]).item() if t[i, 1] > 0 else 0.0 for i, k in enumerate(keys)}


def reduce_max(values: dict[str, float], device: torch.device, group: Group = None) -> dict[str, float]:
    if not values:
        return {}
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    all_reduce_max(t, group)
    return {k: t[i].item() for i, k in enumerate(keys)}


def barrier(group: Group = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def destroy(finished: bool = False) -> None:
    """Tear the process groups down while the interpreter is fully alive.

    ``finished``: every rank got here normally. They then meet at a barrier first, so no rank closes its
    connections while another still talks on them, and the trainer's reference cycles (FSDP modules, pending
    collective handles holding tensors) are collected before the groups go. A gloo rank that left them to
    interpreter finalization aborted once after a finished run ("terminate called without an active exception",
    CI, 2-rank LoRA + offload). After a failure no barrier: the other ranks may be gone.
    """
    if not dist.is_initialized():
        return
    if finished:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()
