"""The batch container that travels between the driver's phases.

A ``Batch`` is verl's ``DataProto`` reduced to what the loop needs: a dict of
tensors sharing the leading (sample) dimension, a dict of numpy arrays for
non-tensor per-sample data (ground truths, group ids, text), and ``meta`` for
per-batch facts (weight version, temperature). Each phase returns a new batch
with more keys instead of mutating its input, so a phase can be re-run or
skipped without surprises. Left out: padding to a multiple of the world size
(groups never straddle ranks here) and serialisation over RPC (there is none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.non_tensors.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the batch size: {sizes}")
        for k, v in self.non_tensors.items():
            if not isinstance(v, np.ndarray):
                self.non_tensors[k] = _as_object_array(v)

    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for v in self.non_tensors.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors[key]
        return self.non_tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    # -- construction ---------------------------------------------------------------
    def union(self, tensors: dict[str, torch.Tensor] | None = None, non_tensors: dict[str, Any] | None = None, **meta: Any) -> "Batch":
        """A new batch with extra fields added (same samples)."""
        return Batch({**self.tensors, **(tensors or {})}, {**self.non_tensors, **(non_tensors or {})}, {**self.meta, **meta})

    def select(self, keys: Iterable[str]) -> "Batch":
        keys = list(keys)
        return Batch({k: self.tensors[k] for k in keys if k in self.tensors},
                     {k: self.non_tensors[k] for k in keys if k in self.non_tensors}, dict(self.meta))

    def index(self, idx: slice | Sequence[int] | torch.Tensor | np.ndarray) -> "Batch":
        """Rows ``idx`` of every field (a slice, or integer indices)."""
        if not isinstance(idx, slice):
            n_idx = np.asarray(idx.cpu() if isinstance(idx, torch.Tensor) else idx, dtype=np.int64)
            idx = as_slice(n_idx) or n_idx
        if isinstance(idx, slice):
            return Batch({k: v[idx] for k, v in self.tensors.items()},
                         {k: v[idx] for k, v in self.non_tensors.items()}, dict(self.meta))
        # one host-to-device copy of the indices per device
        on_device: dict[torch.device, torch.Tensor] = {}
        for v in self.tensors.values():
            if v.device not in on_device:
                on_device[v.device] = to_device(torch.as_tensor(idx), v.device)
        return Batch({k: v[on_device[v.device]] for k, v in self.tensors.items()},
                     {k: v[idx] for k, v in self.non_tensors.items()}, dict(self.meta))

    def split(self, size: int) -> list["Batch"]:
        """Consecutive chunks of ``size`` samples (the last may be smaller)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    def chunk(self, n: int) -> list["Batch"]:
        """``n`` equal chunks; the batch size must divide evenly."""
        if len(self) % n:
            raise ValueError(f"cannot chunk a batch of {len(self)} into {n} equal parts")
        return self.split(len(self) // n)

    def repeat_interleave(self, n: int) -> "Batch":
        """Each sample repeated ``n`` times in place (prompt → its n rollouts)."""
        idx = np.repeat(np.arange(len(self)), n)
        return self.index(idx)

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        if not batches:
            raise ValueError("cannot concat an empty list of batches")
        first = batches[0]
        tensors = {k: _cat_padded([b.tensors[k] for b in batches]) for k in first.tensors}
        non = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors}
        return Batch(tensors, non, dict(first.meta))

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors/lists/scalars (loadable with ``torch.load(weights_only=True)``), for checkpoints."""
        meta = {k: (v.state_dict() if isinstance(v, Batch) else v) for k, v in self.meta.items()}
        return {"tensors": {k: v.cpu() for k, v in self.tensors.items()},
                "non_tensors": {k: v.tolist() for k, v in self.non_tensors.items()},
                "meta": meta, "nested": [k for k, v in self.meta.items() if isinstance(v, Batch)]}

    @staticmethod
    def from_state_dict(state: dict[str, Any]) -> "Batch":
        meta = {k: (Batch.from_state_dict(v) if k in state["nested"] else v) for k, v in state["meta"].items()}
        return Batch(dict(state["tensors"]), {k: _as_object_array(v) for k, v in state["non_tensors"].items()}, meta)

    def to(self, device: torch.device | str) -> "Batch":
        device = torch.device(device)
        return Batch({k: to_device(v, device) for k, v in self.tensors.items()}, dict(self.non_tensors), dict(self.meta))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; host → GPU copies go through pinned memory without blocking.

    A copy from pageable host memory first waits for the GPU's queue to drain, so a training loop that moves
    each micro-batch's inputs that way stalls at every micro-batch: with a host-bound loop (a 0.5B model on an
    H200 launches kernels slower than the GPU runs them) the GPU then idles while the host catches up. From
    pinned memory the copy is queued like a kernel; the caching host allocator keeps the pinned buffer alive
    until the copy has run.
    """
    if t.device == device or device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    # contiguous first: pin_memory keeps the strides, and an expanded (stride-0) tensor cannot be copied into
    return t.contiguous().pin_memory().to(device, non_blocking=True)


def as_slice(idx: np.ndarray) -> slice | None:
    """``idx`` as a slice when it is a run of consecutive ascending integers (a view instead of a gather)."""
    if idx.ndim != 1 or len(idx) == 0:
        return None
    start = int(idx[0])
    if start >= 0 and np.array_equal(idx, np.arange(start, start + len(idx))):
        return slice(start, start + len(idx))
    return None


def row_index(idx: np.ndarray, device: torch.device) -> slice | torch.Tensor:
    """Host row indices as something to index a device tensor with: a slice when they are a run, else a tensor
    copied without a sync (``torch.as_tensor(idx, device=...)`` copies from pageable memory and waits for the GPU)."""
    idx = np.asarray(idx, dtype=np.int64)
    return as_slice(idx) or to_device(torch.from_numpy(idx), torch.device(device))


def _as_object_array(values: Any) -> np.ndarray:
    arr = np.empty(len(values), dtype=object)
    arr[:] = list(values)
    return arr


def _cat_padded(ts: list[torch.Tensor]) -> torch.Tensor:
    if ts[0].dim() >= 2 and len({t.shape[1:] for t in ts}) > 1:
        raise ValueError(f"cannot concat tensors of widths {[tuple(t.shape) for t in ts]}; pad them to one width first")
    return torch.cat(ts, dim=0)
