"""Run under torchrun on 2 CUDA GPUs: does the per-step stop check pause a rollout rank's background generation?

    torchrun --nproc_per_node=2 tests/gpu/stop_check_probe.py            # the check as the trainer makes it
    torchrun --nproc_per_node=2 tests/gpu/stop_check_probe.py --nccl     # the check before the fix: NCCL, the world

Split placement, 1 rollout + 1 trainer rank. The rollout rank (0) starts "generation" in a thread (matmuls on the
thread's current stream, synchronised each iteration, as an engine's decode loop is), then enters the stop check at
once, as it does after handing a batch over; the trainer rank (1) enters it ``--late`` seconds later (its update).
Rank 0 prints one JSON line: how long the thread's work took beside the check, and alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hybrid_rl.distributed import init_distributed  # noqa: E402
from hybrid_rl.interrupt import GracefulStop  # noqa: E402
from hybrid_rl.modes.placement import Placement  # noqa: E402
from hybrid_rl.modes.split import make_layout  # noqa: E402


def work(device: torch.device, iters: int) -> float:
    a = torch.randn(2048, 2048, device=device)
    start = time.perf_counter()
    for _ in range(iters):
        a = torch.tanh(a @ a)
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nccl", action="store_true", help="the check on the default (NCCL) group, as before the fix")
    ap.add_argument("--late", type=float, default=3.0)
    ap.add_argument("--iters", type=int, default=1500)  # ~0.5 s alone on an H100
    args = ap.parse_args()
    info = init_distributed("cuda", 60)
    sp = make_layout(1)
    placement = Placement(sp, "rollout" if sp.is_rollout else "actor_ref", 0, 1, info, info, sp.rank == sp.leader)
    where = (info.device, None) if args.nccl else placement.stop_check(info.device)
    work(info.device, 20)  # warm-up
    alone = work(info.device, args.iters)
    dist.barrier(group=sp.obj_group)
    with GracefulStop() as stop:
        if sp.is_rollout:
            took: list[float] = []
            thread = threading.Thread(target=lambda: took.append(work(info.device, args.iters)))
            thread.start()
            time.sleep(0.05)
            stop.agreed(*where)
            thread.join()
            print(json.dumps({"check": "nccl" if args.nccl else "placement", "device": str(where[0]),
                              "late_s": args.late, "alone_s": round(alone, 3), "beside_s": round(took[0], 3)}),
                  flush=True)
        else:
            time.sleep(args.late)
            stop.agreed(*where)
    dist.barrier(group=sp.obj_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
