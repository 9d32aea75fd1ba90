"""How much memory one GPU has: the visible device's, or a known card's by name.

The table holds what ``torch.cuda.get_device_properties(i).total_memory`` reports on these cards (a little less
than the marketing figure: the driver keeps its share), in GiB.
"""

from __future__ import annotations

KNOWN_GPUS_GIB: dict[str, float] = {
    "H200": 139.8,      # 141 GB HBM3e
    "H100": 79.2,       # 80 GB (SXM and PCIe)
    "A100-80GB": 79.2,
    "A100-40GB": 39.4,
}
"""Usable memory of one card, GiB, by the name ``--gpu`` takes."""


def visible_gpu() -> tuple[str, float] | None:
    """(name, total GiB) of CUDA device 0, or None without one."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory / 2**30


def visible_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def card_memory_gib(name: str) -> float:
    """The table's figure for ``name`` (case-insensitive); ValueError listing the names otherwise."""
    for key, gib in KNOWN_GPUS_GIB.items():
        if key.lower() == name.lower():
            return gib
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(KNOWN_GPUS_GIB)} (or give --gpu-memory-gb)")
