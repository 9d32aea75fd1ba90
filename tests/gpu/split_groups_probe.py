"""Run under torchrun on CUDA: build split placement's groups (``split.make_layout``) and use each one once.

    torchrun --nproc_per_node=4 tests/gpu/split_groups_probe.py --rollout-ranks 2
    torchrun --nproc_per_node=4 tests/gpu/split_groups_probe.py --rollout-ranks 2 --unpatched   # the old groups

Every rank prints one ``probe ok`` line. ``--unpatched`` creates the groups as make_layout did before the fix (the
gloo weight-metadata group created by every rank, the NCCL groups left to connect at their first collective): with
a device bound to the world group, the ranks outside that gloo group wait in a no-colour ``ncclCommSplit`` that no
other rank makes, so this variant hangs at its first barrier (the caller's timeout ends it).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/: helpers

from helpers import old_split_groups  # noqa: E402
from hybrid_rl.distributed import init_distributed  # noqa: E402
from hybrid_rl.modes.split import make_layout  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollout-ranks", type=int, required=True)
    ap.add_argument("--unpatched", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    info = init_distributed("cuda", 60)
    sp = (old_split_groups if args.unpatched else make_layout)(args.rollout_ranks)
    dist.barrier(group=sp.obj_group)  # where every 2 + 2 and 1 + 3 run hung (4xH200)
    x = torch.ones(1, device=info.device)
    if sp.is_rollout:
        dist.all_reduce(x, group=sp.rollout_group)
    else:
        dist.all_reduce(x, group=sp.trainer_group)
    side = x.item()
    if sp.is_rollout or sp.rank == sp.leader:  # the weight transfer's two groups
        msg = [{"version": 7} if sp.rank == sp.leader else None]
        dist.broadcast_object_list(msg, src=sp.leader, group=sp.meta_group)
        w = torch.full((4,), float(sp.rank == sp.leader), device=info.device)
        dist.broadcast(w, src=sp.leader, group=sp.bcast_group)
        assert msg[0] == {"version": 7} and w.sum().item() == 4.0, (msg, w)
    dist.barrier(group=sp.obj_group)
    print(f"probe ok rank {sp.rank} ({'rollout' if sp.is_rollout else 'trainer'}, side size {side:.0f}) "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    main()
