"""Where this rank stands in the run, decided before its worker exists: ``Placement`` and the split set-up order.

``trainer.placement=colocated``: every rank does everything (role ``actor_rollout_ref``). ``split``: the process
groups of ``split.make_layout``, and this rank's side, ``rollout`` or ``actor_ref``, with its data-parallel world
(the trainer ranks' own world on that side) and which rank logs. ``meet_at_engines`` is the order in which split
ranks start vLLM before any of them builds a model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as tdist

from hybrid_rl.config import Config
from hybrid_rl.distributed import DistInfo
from hybrid_rl.rollout import engine_info, rollout_engine_class
from hybrid_rl.modes.split import make_layout


@dataclass
class Placement:
    """This rank's part in the run, decided before the worker is built."""

    layout: Any  # split.SplitLayout under trainer.placement=split, else None
    role: str
    """The worker's role: ``actor_rollout_ref`` colocated; ``rollout`` / ``actor_ref`` under split placement."""
    sampler_rank: int
    sampler_world: int
    dist: DistInfo
    """The data-parallel world this rank trains (or generates) in: the trainer ranks' own world under split."""
    worker_dist: DistInfo
    is_logger: bool

    @property
    def dcp_group(self):
        """The process group the actor checkpoints over (None = the world)."""
        return self.layout.trainer_group if self.layout is not None else None

    def stop_check(self, device: torch.device) -> tuple[torch.device, Any]:
        """(device, group) of the per-step stop check (``GracefulStop.agreed``), an all-reduce over every rank.
        Split placement: the CPU and the gloo world group. A rollout rank waits in that check for the trainer ranks'
        update while its next round generates in the background; on NCCL the wait would also hold its current CUDA
        stream, and with it the engine's kernels queued behind, stretching each step's generation by about one update
        (plain split's generation at mean 4k on 4xH200, 45 s a step, is about that much longer than its tail)."""
        if self.layout is None:
            return device, None
        return torch.device("cpu"), self.layout.obj_group

    def describe(self) -> str:
        if self.layout is None:
            return "colocated"
        n = self.layout.n_rollout
        return f"split ({n} rollout + {self.layout.world - n} trainer ranks)"


def make_placement(cfg: Config, dist: DistInfo) -> Placement:
    """Colocated: every rank does everything. Split: build the groups and pick this rank's side."""
    if cfg.trainer.placement != "split":
        return Placement(None, "actor_rollout_ref", dist.rank, dist.world_size, dist, dist, dist.is_main)
    sp = make_layout(cfg.split_layout(dist.world_size)[0])
    is_logger = sp.rank == sp.leader
    if sp.is_rollout:  # global rank and world (vLLM's launcher needs them), reductions among the rollout ranks
        rollout_dist = replace(dist, group=sp.rollout_group)
        return Placement(sp, "rollout", sp.index, sp.n_rollout, rollout_dist, rollout_dist, is_logger)
    trainer_dist = DistInfo(rank=sp.index, world_size=sp.side_size, local_rank=dist.local_rank, device=dist.device,
                            group=sp.trainer_group)
    # the trainer ranks read the prompts the rollout ranks sampled: their own sampler only keeps the position
    return Placement(sp, "actor_ref", 0, sp.n_rollout, trainer_dist, trainer_dist, is_logger)


def meet_at_engines(cfg: Config, placement: Placement, global_dist: DistInfo, tokenizer) -> Any:
    """Split placement: every rank starts the engines' set-up at the same point, before any rank has built a model.

    An engine whose launcher creates process groups over the whole world (``EngineInfo.split_twin``: vLLM's
    external launcher) needs the trainer ranks to build one too (a twin, released at once: sleep level 2 frees its
    weights and KV cache) for those collectives to pair up. All ranks meet at a barrier (gloo), then the trainer
    ranks build the twin first and the rollout ranks their worker, whose first GPU work is the engine: nobody waits
    in the engine's group creation for a rank still loading a model. Returns the twin (kept for the run: its groups
    belong to the world) or None."""
    sp = placement.layout
    if sp is None:
        return None
    tdist.barrier(group=sp.obj_group)
    if not engine_info(cfg.rollout.name).split_twin or sp.is_rollout:
        return None
    twin = rollout_engine_class(cfg.rollout.name).from_config(cfg, global_dist, tokenizer)
    twin.sleep(level=2)
    return twin
