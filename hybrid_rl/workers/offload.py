"""Offload to host memory in place: a tensor's bytes go to one host buffer and its storage shrinks to nothing, then
back.

``HostMirror.offload(tensors)`` copies the storage behind each tensor (a DTensor's local shard; views and tied
parameters count once) into one host buffer and resizes the storage to 0 bytes, freeing its device memory;
``onload()`` resizes each storage back and copies its bytes in. The tensor objects stay what they were: parameters,
FSDP2's views of its shards, the optimizer's references to its state all hold, on the same device, so nothing has to
be re-registered; only the bytes travel (FSDP2 frees its gathered parameters the same way). Like those, an offloaded
tensor must not be read until it is back: the engine onloads before every pass.

The host buffer is allocated once, at the first offload, with the bytes of that set of storages (a later offload of
storages of other sizes allocates it again) and kept: every later round trip copies into the same memory, with no
allocation and no page faults. From a CUDA device it is page-locked in place (``cudaHostRegister`` over whole pages,
where torch's pinned allocator would round each block up to a power of two), so both copies are asynchronous DMA;
where registering fails the buffer stays pageable (the copies are then synchronous) and a warning says so once.
"""

from __future__ import annotations

import mmap
import sys

import torch

ALIGN = 512
"""Each storage's bytes start at a multiple of this in the host buffer."""
PAGE = mmap.PAGESIZE


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _register(buffer: torch.Tensor) -> bool:
    """Page-lock ``buffer`` (page-aligned, whole pages) in place for CUDA copies; False where that fails."""
    rc = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    return int(rc) == 0


class HostMirror:
    """One group of storages (an engine's parameters and gradients, or its optimizer state) and its host buffer."""

    warned = False

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer: torch.Tensor | None = None
        self._locked: torch.Tensor | None = None
        """The page-locked whole pages that hold ``buffer`` (CUDA)."""
        self.pinned = False
        self.filled = False
        """Whether the buffer holds the bytes of a completed offload (of the storages of ``sizes``)."""
        self.sizes: list[int] = []
        self.away: list[tuple[torch.UntypedStorage, int, int]] = []
        """(storage, offset in the buffer, bytes) of every storage now offloaded."""

    @property
    def offloaded(self) -> bool:
        return bool(self.away)

    @property
    def host_bytes(self) -> int:
        return self.buffer.numel() if self.buffer is not None else 0

    def offload(self, tensors, unchanged: bool = False) -> None:
        """The storages behind ``tensors`` (None and empty ones skipped, each storage once) into the host buffer, then
        freed on the device. Nothing happens while a previous offload is still away. ``unchanged``: the caller vouches
        that the bytes are those of the last round trip (frozen weights), so where the buffer already holds these
        storages they are freed without copying them out again."""
        if self.away:
            return
        storages, seen = [], set()
        for t in tensors:
            if t is None:
                continue
            s = local(t).untyped_storage()
            key = (s.data_ptr(), s.device)
            if s.nbytes() == 0 or key in seen:
                continue
            if not s.resizable():
                raise RuntimeError(f"offload: a storage of {s.nbytes()} bytes on {s.device} cannot be resized; it "
                                   f"cannot be offloaded in place")
            seen.add(key)
            storages.append(s)
        if not storages:
            return
        sizes = [s.nbytes() for s in storages]
        offsets = [0]
        for n in sizes[:-1]:
            offsets.append(offsets[-1] + -(-n // ALIGN) * ALIGN)
        total = offsets[-1] + sizes[-1]
        held = unchanged and self.filled and sizes == self.sizes and self.buffer is not None
        if sizes != self.sizes or self.buffer is None:
            self._allocate(total)
            self.sizes = sizes
        async_copy = self.pinned
        for s, off, n in zip(storages, offsets, sizes) if not held else ():
            self.buffer[off:off + n].copy_(bytes_view(s), non_blocking=async_copy)
        self.filled = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the bytes are on the host before the device memory is given up
        for s in storages:
            s.resize_(0)
        self.away = list(zip(storages, offsets, sizes))

    def onload(self) -> None:
        """Every offloaded storage back to its size on its device, its bytes copied in (asynchronously from pinned
        memory: the caller synchronizes before reading the host side again)."""
        for s, off, n in self.away:
            s.resize_(n)
            bytes_view(s).copy_(self.buffer[off:off + n], non_blocking=self.pinned)
        self.away = []

    def _allocate(self, total: int) -> None:
        self.release()
        self.pinned = self.filled = False
        if self.device.type != "cuda" or not total:
            self.buffer = torch.empty(total, dtype=torch.uint8)
            return
        # whole pages from a page boundary (an anonymous mapping): what page-locking works in on every driver, and the
        # storage itself starts there, so torch sees the tensor as pinned (``is_pinned`` asks about the storage)
        self._locked = torch.frombuffer(mmap.mmap(-1, -(-total // PAGE) * PAGE), dtype=torch.uint8)
        self.buffer = self._locked[:total]
        self.pinned = _register(self._locked)
        if not self.pinned and not HostMirror.warned:
            HostMirror.warned = True
            print(f"hybrid_rl: warning: offload: page-locking {total / 2**30:.1f} GiB of host memory failed; "
                  f"offloading through pageable memory (slower copies)", file=sys.stderr, flush=True)

    def release(self) -> None:
        """Give the host buffer up (unregistering it first); only while nothing is away."""
        assert not self.away, "release() with storages still offloaded"
        if self.buffer is not None and self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._locked.data_ptr())
        self.buffer, self._locked, self.pinned, self.sizes = None, None, False, []

    def __del__(self) -> None:
        try:
            if not self.away:
                self.release()
        except Exception:  # noqa: BLE001  (interpreter shutdown: CUDA may be gone already)
            pass
