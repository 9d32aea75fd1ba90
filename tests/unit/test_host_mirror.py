"""``HostMirror``: offload in place. The bytes of each storage go to one host buffer and the storage is freed; the
tensors (and views of them) stay the same objects and get their bytes back; the buffer is allocated once per set of
storage sizes and reused."""

from __future__ import annotations

import torch

from hybrid_rl.workers.offload import ALIGN, HostMirror


def _tensors():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(37, 5, generator=g)
    b = torch.randint(-9, 9, (11,), generator=g, dtype=torch.int64)
    c = torch.randn(3, generator=g, dtype=torch.float64)
    return a, b, c


def test_a_round_trip_frees_the_storages_and_restores_every_byte_in_the_same_tensors():
    a, b, c = _tensors()
    view, tied = a[2:7], a  # a view and a second reference share a's storage: offloaded once
    want = [a.clone(), b.clone(), c.clone()]
    m = HostMirror(torch.device("cpu"))
    m.offload([a, None, view, b, tied, c, torch.empty(0)])
    assert m.offloaded and [s.nbytes() for s in (a.untyped_storage(), b.untyped_storage(), c.untyped_storage())] == [0, 0, 0]
    # one buffer of the three storages, each from a multiple of ALIGN: 740 + 88 + 24 bytes at 0, 1024, 1536
    assert m.host_bytes == 3 * ALIGN + 24 and not m.pinned
    m.offload([a])  # while away: nothing
    m.onload()
    assert not m.offloaded
    assert torch.equal(a, want[0]) and torch.equal(b, want[1]) and torch.equal(c, want[2])
    assert torch.equal(view, want[0][2:7])


def test_the_buffer_is_kept_for_the_same_storages_and_made_again_for_others():
    a, b, c = _tensors()
    m = HostMirror(torch.device("cpu"))
    m.offload([a, b])
    buffer = m.buffer.data_ptr()
    m.onload()
    a.mul_(2)  # new values, the same sizes: the same buffer carries them
    want = a.clone()
    m.offload([a, b])
    assert m.buffer.data_ptr() == buffer
    m.onload()
    assert torch.equal(a, want)
    m.offload([a, b, c])  # another set: a buffer of its size
    assert m.host_bytes == 3 * ALIGN + 24
    m.onload()
    assert torch.equal(c, _tensors()[2])


def test_a_cuda_buffer_is_page_locked_over_whole_pages_from_a_page_boundary(monkeypatch):
    """What is registered for a CUDA device (the registration itself is stubbed: no CUDA here; the GPU test runs it):
    a page-aligned range of whole pages that holds the buffer."""
    from hybrid_rl.workers import offload

    seen = []
    monkeypatch.setattr(offload, "_register", lambda t: seen.append((t.data_ptr(), t.numel())) or True)
    m = HostMirror(torch.device("cuda", 0))
    for total in (1, offload.PAGE, 3 * offload.PAGE + 17):
        m._allocate(total)
        (ptr, n), = seen[-1:]
        assert m.pinned and m.buffer.numel() == total
        assert ptr % offload.PAGE == 0 and n % offload.PAGE == 0  # whole pages from a boundary
        assert ptr <= m.buffer.data_ptr() and m.buffer.data_ptr() + total <= ptr + n < ptr + total + offload.PAGE
        m.pinned = False  # (release would unregister through CUDA)
    assert len(seen) == 3


def test_unchanged_storages_are_freed_without_copying_them_out_again():
    a, b, _ = _tensors()
    want = a.clone()
    m = HostMirror(torch.device("cpu"))
    m.offload([a, b], unchanged=True)  # the first time the bytes are copied whatever the caller says
    m.onload()
    assert torch.equal(a, want)
    a.mul_(2)  # a change the caller does not vouch for is lost: the buffer keeps the last round trip's bytes
    m.offload([a, b], unchanged=True)
    m.onload()
    assert torch.equal(a, want)
    a.mul_(2)
    m.offload([a, b])  # without the promise the bytes are copied
    m.onload()
    assert torch.equal(a, want * 2)
