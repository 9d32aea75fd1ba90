"""Group a stream of (name, full tensor) pairs into buckets of a byte budget.

Both transports hand weights over bucket by bucket (the sharding manager to
``engine.load_weights``, split placement to one NCCL broadcast per bucket), so
only one bucket of full tensors is alive at a time and the full state dict
never exists at once. Left out: splitting a tensor across buckets (a tensor
larger than the budget goes alone) and reordering to pack buckets tighter
(the order is the push order, which replay signatures depend on).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

Bucket = list[tuple[str, torch.Tensor]]


def bucketize(params: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group (name, tensor) pairs into lists of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    bucket: Bucket = []
    size = 0
    for name, t in params:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket
