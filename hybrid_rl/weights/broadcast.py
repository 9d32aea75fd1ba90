"""Split placement's weight transport: the trainer ranks broadcast θ over NCCL to the rollout ranks.

With split placement (``hybrid_rl.modes.split``) the rollout engine lives on other
GPUs, so the colocated sharding manager's in-process ``load_weights`` is not
available. Instead the trainer ranks stream full tensors out of FSDP2
(``iter_full_params``, a collective among them); the first trainer rank (the
layout's ``leader``) packs each bucket (``weights.buckets``) into one flat
tensor of the engine dtype and broadcasts it over ``bcast_group`` (NCCL on
GPU), after its names and shapes went over the gloo ``meta_group``. Every
rollout rank loads each bucket into its engine as it arrives (through a
``weights.replay.WeightReplayer`` when given), so the full state dict never
exists at once; the engine's version is cleared first and set by
``finish_weight_update`` once the last bucket is in.

Left out: LoRA-only pushes (merged full weights always), skipping frozen
weights after the first push (the sharding manager's ``skip_static``), and any
other topology than one sender (no tree or ring broadcast across nodes).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hybrid_rl.rollout.base import RolloutEngine
from hybrid_rl.modes.split import SplitLayout
from hybrid_rl.weights.buckets import bucketize
from hybrid_rl.weights.replay import WeightReplayer


def broadcast_weights(layout: SplitLayout, source, dtype: torch.dtype, bucket_bytes: int, version: int,
                      device: torch.device) -> tuple[float, int]:
    """Trainer side (every trainer rank calls it): stream θ to the rollout ranks. Returns (seconds, bytes)."""
    start, sent = time.perf_counter(), 0
    lead = layout.rank == layout.leader
    for bucket in bucketize(source.iter_full_params(dtype), bucket_bytes):
        if lead:
            meta = [(name, tuple(t.shape)) for name, t in bucket]
            flat = torch.cat([t.reshape(-1).to(dtype) for _, t in bucket]) if len(bucket) > 1 else bucket[0][1].reshape(-1)
            dist.broadcast_object_list([{"done": False, "meta": meta, "dtype": str(dtype)}], src=layout.leader,
                                       group=layout.meta_group)
            dist.broadcast(flat.contiguous(), src=layout.leader, group=layout.bcast_group)
            sent += flat.numel() * flat.element_size()
        del bucket
    if lead:
        dist.broadcast_object_list([{"done": True, "version": version}], src=layout.leader, group=layout.meta_group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, sent


def receive_weights(layout: SplitLayout, engine: RolloutEngine, device: torch.device,
                    replayer: WeightReplayer | None = None) -> tuple[float, int]:
    """Rollout side: load the broadcast buckets into ``engine`` (through ``replayer`` when given); the engine
    holds no known version until the last bucket is in, then the trainer's. Returns (seconds, bytes)."""
    start, got, first = time.perf_counter(), 0, True
    engine.begin_weight_update()  # a push that fails half-way leaves no known version
    if replayer is not None:
        replayer.begin_push()
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=layout.leader, group=layout.meta_group)
        m = msg[0]
        if m["done"]:
            engine.finish_weight_update(m["version"])
            break
        dtype = getattr(torch, m["dtype"].replace("torch.", ""))
        sizes = [int(torch.Size(shape).numel()) for _, shape in m["meta"]]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src=layout.leader, group=layout.bcast_group)
        views = [(name, t.view(shape)) for (name, shape), t in zip(m["meta"], flat.split(sizes))]
        if replayer is not None:
            replayer.load(views, first=first)
        else:
            engine.load_weights(views)
        first = False
        got += flat.numel() * flat.element_size()
        del flat, views
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, got
