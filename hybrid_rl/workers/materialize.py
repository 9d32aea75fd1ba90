"""Weights read on one rank: the group's first rank loads the checkpoint, the others build an empty model.

A model trained or held frozen under FSDP2 over several ranks is loaded whole on the host by the data-parallel group's
first rank only; every other rank builds the same module on the ``meta`` device (shapes without storage, from the
config: ``models.load_causal_lm(..., on_meta=True)``). ``TrainingEngine`` then takes the first rank's weights
(``take_weights``, which leaves that rank's module on ``meta`` too), shards the empty module on every rank, gives
each shard storage on the device and fills it from the first rank (``load_from_first_rank``). The host holds one
full copy of the weights instead of one per rank, and no device ever holds the whole model.

Buffers are sent as well, non-persistent ones included (the rotary embedding's ``inv_freq``): a module built on
``meta`` computed none of them, and they are not in a checkpoint's state dict. What the first rank's module holds
beyond the checkpoint (LoRA's initial adapters, the critic's zero-initialised value head) reaches every rank the same
way. With one rank, or without ``torch.distributed``, nothing here runs: the engine moves the loaded model as it is.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

Weights = dict[str, torch.Tensor]


def shared_over_ranks(group=None) -> bool:
    """Whether a model sharded over ``group`` takes its weights from the group's first rank (FSDP over > 1 ranks)."""
    return dist.is_initialized() and dist.get_world_size(group) > 1


def reads_weights(group=None) -> bool:
    """Whether this rank loads the checkpoint itself: the group's first rank, or every rank of a world of one."""
    return not shared_over_ranks(group) or dist.get_rank(group) == 0


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter (a tied one once, by its first name) and every buffer (non-persistent ones included)."""
    return [*model.named_parameters(), *model.named_buffers(remove_duplicate=False)]


@torch.no_grad()
def take_weights(model: nn.Module, group=None) -> Weights | None:
    """The first rank's parameters and buffers by name (where they are, on the host), None on the other ranks; every
    rank's ``model`` is left on ``meta`` with its tied parameters still tied, ready to be sharded."""
    weights = {name: t.detach() for name, t in _tensors(model)} if dist.get_rank(group) == 0 else None
    owners: dict[nn.Parameter, list[tuple[nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            owners[p].append((module, name))
    model.to_empty(device="meta")  # a new parameter per module: the ties are put back below
    for places in owners.values():
        first, name = places[0]
        for module, other in places[1:]:
            setattr(module, other, getattr(first, name))
    return weights


@torch.no_grad()
def load_from_first_rank(model: nn.Module, weights: Weights | None, device: torch.device, group=None) -> None:
    """Give the sharded ``model`` (on ``meta``, after ``fully_shard``) storage on ``device`` and fill every shard and
    buffer from the first rank's ``weights`` (``take_weights``): one tensor at a time, broadcast whole over
    ``group`` and sliced to this rank's shard."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    model.to_empty(device=device)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for name, t in _tensors(model):
        if weights is not None:
            full = weights[name].to(device=device, dtype=t.dtype)
        else:
            full = torch.empty(t.shape, dtype=t.dtype, device=device)
        dist.broadcast(full, src=src, group=group)
        if isinstance(t, DTensor):
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            full = full[tuple(slice(o, o + n) for n, o in zip(shape, offset))]
            t = t.to_local()
        t.copy_(full)
