"""Record-and-replay weight loading: the engine's Python loader runs once per bucket layout, later pushes replay its copies.

A rollout engine's ``load_weights`` maps names, stacks q/k/v and gate/up into
fused parameters, narrows TP shards and finally ``copy_``s every incoming
tensor (or a view of it) into a view of a parameter. For a given list of
(name, shape, stride, dtype, device) that work is the same on every push; only
the values differ. So the first time a bucket arrives the real loader runs
under a ``TorchDispatchMode`` that records every ``aten.copy_`` (and
``_foreach_copy_``) whose source lies inside an incoming tensor: which incoming
tensor, the source view relative to it (storage offset delta, sizes, strides:
a TP ``narrow`` of the source replays correctly), and the destination view
(kept as a plain tensor over the engine's storage). Later buckets with the same
signature skip the loader: their source views are rebuilt on the new tensors
(the tensor itself when the copy read all of it) and one
``torch._foreach_copy_`` writes them all.

A recording becomes a plan only when replaying it is provably the same as
loading:

* incoming tensors were only viewed and copied: any other op that reads one
  (a cast, ``mul``, ``cat``, ``clone``, ``.item()``) marks the plan invalid,
  and so does a write into one;
* every incoming tensor was copied at least once (under TP a rank copies only
  its shard, so "consumed" means read by a copy, not every element read);
* the recorded destinations are pairwise disjoint, and no other op of the
  loader read or wrote them (a later ``param.mul_(2)`` or a copy out of a
  destination would not be replayed);
* incoming tensors do not overlap each other.

Other engine-side work the loader did (e.g. vLLM zero-filling vocab padding
rows) is not replayed: it only touched memory the copies do not, and that
memory keeps its contents as long as the engine keeps its weights.
That is why a plan is dropped when the engine may have lost or moved them:
``invalidate()`` after a level-2 sleep, and ``release_stale()`` (also run at
the start of every push) when a destination storage changed address or size or
is no longer held by anyone but the plan (``param.data = new`` on a sleep or
wake). Invalid recordings are remembered too, so a loader that cannot be
replayed costs one recording per signature, after which it is called plainly.
A recording that was dropped before it was ever replayed (an engine that
reallocates on every sleep) makes the next 1, 3, 7, ... pushes load plainly
without recording, so such engines pay the recording cost rarely.

The engine's own bookkeeping in ``load_weights`` (a "sleeping engine" guard,
"new weights: reset the prefix cache" flags) is not a tensor op and cannot be
recorded. So the first replayed bucket of each push still hands one tensor, the
smallest, to the real ``load_weights``; its copies are left out of the replay.

Left out: loaders that transform weights (casts, transposes into new tensors,
quantisation) always take the real path; loaders that hand the tensors to
another process or thread are not observed (nothing is recorded, so they fall
back too); replay is per bucket, so a change in bucket composition records
again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_rl.weights.buckets import Bucket
Span = tuple[Any, int, int]
"""(device, first byte, one past the last byte) of the memory a tensor view can touch."""

_aten = torch.ops.aten
# ops that only look at metadata even when dispatched (tensor subclasses with custom sizes)
_METADATA_OPS = {_aten.sym_size, _aten.sym_stride, _aten.sym_numel, _aten.sym_storage_offset, _aten.size,
                 _aten.stride, _aten.numel, _aten.dim, _aten.is_same_size, _aten.is_contiguous,
                 _aten._has_compatible_shallow_copy_type}
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


# --------------------------------------------------------------------------- memory spans
def _span(t: torch.Tensor) -> Span | None:
    """The bytes ``t`` can touch, or None for an empty tensor (it touches nothing)."""
    if t.numel() == 0:
        return None
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return t.device, start, start + extent * t.element_size()


def _overlap(a: Span, b: Span) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _inside(inner: Span, outer: Span) -> bool:
    return inner[0] == outer[0] and outer[1] <= inner[1] and inner[2] <= outer[2]


def _any_overlap(spans: list[Span]) -> bool:
    """Whether any two spans intersect (sorted sweep per device)."""
    ordered = sorted(spans, key=lambda s: (str(s[0]), s[1]))
    return any(a[0] == b[0] and b[1] < a[2] for a, b in zip(ordered, ordered[1:]))


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v


def _plain_view(t: torch.Tensor) -> torch.Tensor:
    """A plain ``torch.Tensor`` over ``t``'s memory (drops Parameter / vLLM parameter subclasses and autograd)."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


# --------------------------------------------------------------------------- recording
@dataclass
class _Recorded:
    """One copy seen while recording."""

    index: int
    """Which incoming tensor the source lies in."""
    offset: int
    """Source storage offset minus the incoming tensor's."""
    size: tuple[int, ...]
    stride: tuple[int, ...]
    whole: bool
    """The source is exactly the incoming tensor (no view needed on replay)."""
    dst: torch.Tensor
    dst_span: Span
    non_blocking: bool


class _Recorder(TorchDispatchMode):
    """Watches one real ``load_weights`` call; see the module docstring for what makes a recording replayable."""

    def __init__(self, incoming: Sequence[torch.Tensor]):
        super().__init__()
        self.incoming = list(incoming)
        self.spans = [_span(t) for t in incoming]
        self.copies: list[_Recorded] = []
        self.reads: list[Span] = []
        self.writes: list[Span] = []
        self.invalid: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.invalid is None:
            try:
                with torch._C.DisableTorchFunctionSubclass():
                    self._inspect(func, args, kwargs)
            except Exception as e:  # never break the real load: an op we cannot classify means no replay
                self.invalid = f"could not classify {func}: {type(e).__name__}: {e}"
        return func(*args, **kwargs)

    # -- classification -------------------------------------------------------------
    def _inspect(self, func, args: tuple, kwargs: dict) -> None:
        if func.is_view or func.overloadpacket in _METADATA_OPS:
            return  # a view reads nothing; its later use is what counts
        if func is _aten.copy_.default:
            self._on_copy(args[0], args[1], bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False)))
        elif func is _aten._foreach_copy_.default:
            nb = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
            for dst, src in zip(args[0], args[1]):
                self._on_copy(dst, src, nb)
        else:
            self._on_other(func, args, kwargs)

    def _owner(self, span: Span) -> int | None:
        """Index of the incoming tensor that holds ``span``; None if it touches none; marks partial overlaps invalid."""
        for i, s in enumerate(self.spans):
            if s is not None and _overlap(span, s):
                if _inside(span, s):
                    return i
                self.invalid = "a copy source straddles the edge of an incoming tensor"
                return None
        return None

    def _on_copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        dspan = _span(dst)
        if dspan is None:
            return
        if any(s is not None and _overlap(dspan, s) for s in self.spans):
            self.invalid = "the loader writes into an incoming tensor"
            return
        if src.shape != dst.shape:
            src = src.expand_as(dst)  # copy_ broadcasts; record the broadcast view
        sspan = _span(src)
        index = self._owner(sspan) if sspan is not None else None
        if index is None:  # an engine-internal copy: a read and a write the replay does not repeat
            if sspan is not None:
                self.reads.append(sspan)
            self.writes.append(dspan)
            return
        base = self.incoming[index]
        offset = src.storage_offset() - base.storage_offset()
        size, stride = tuple(src.shape), tuple(src.stride())
        whole = offset == 0 and size == tuple(base.shape) and stride == tuple(base.stride())
        self.copies.append(_Recorded(index, offset, size, stride, whole, _plain_view(dst), dspan, non_blocking))

    def _on_other(self, func, args: tuple, kwargs: dict) -> None:
        schema = func._schema
        values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
        for arg, value in zip(schema.arguments, values):
            written = arg.alias_info is not None and arg.alias_info.is_write
            for t in _tensors(value):
                span = _span(t)
                if span is None:
                    continue
                if any(s is not None and _overlap(span, s) for s in self.spans):
                    verb = "writes" if written else "reads"
                    self.invalid = f"{func} {verb} an incoming tensor (only views and copies can be replayed)"
                    return
                (self.writes if written else self.reads).append(span)

    # -- result -----------------------------------------------------------------------
    def verdict(self) -> str | None:
        """None when the recording can be replayed, else why not."""
        if self.invalid is not None:
            return self.invalid
        if _any_overlap([s for s in self.spans if s is not None]):
            return "incoming tensors share memory"
        copied = {c.index for c in self.copies}
        missing = [i for i, s in enumerate(self.spans) if s is not None and i not in copied]
        if missing:
            return f"incoming tensor #{missing[0]} was never copied (skipped, or consumed out of sight)"
        dsts = [c.dst_span for c in self.copies]
        if _any_overlap(dsts):
            return "two copies write overlapping destinations"
        touched = self.reads + self.writes
        if any(_overlap(t, d) for t in touched for d in dsts):
            return "the loader read or wrote a destination outside the recorded copies"
        return None


# --------------------------------------------------------------------------- plans
@dataclass
class ReplayPlan:
    """What one bucket signature needs on replay (``valid=False``: call the loader plainly)."""

    valid: bool
    reason: str = ""
    copies: list[tuple[int, bool, tuple[int, ...], tuple[int, ...], int]] = field(default_factory=list)
    """(incoming index, whole, size, stride, offset) per copy, in recording order."""
    dsts: list[torch.Tensor] = field(default_factory=list)
    non_blocking: bool = False
    sentinel: int = -1
    """Incoming index handed to the real loader on the first bucket of a push (the smallest tensor)."""
    rest: tuple[list, list] = field(default_factory=lambda: ([], []))
    """(copies, dsts) without the sentinel's copies."""
    replays: int = 0


def _make_plan(recorder: _Recorder) -> ReplayPlan:
    reason = recorder.verdict()
    if reason is not None:
        return ReplayPlan(valid=False, reason=reason)
    copies = [(c.index, c.whole, c.size, c.stride, c.offset) for c in recorder.copies]
    dsts = [c.dst for c in recorder.copies]
    sizes = {c.index: recorder.incoming[c.index].numel() for c in recorder.copies}
    sentinel = min(sizes, key=lambda i: (sizes[i], i))
    keep = [k for k, c in enumerate(copies) if c[0] != sentinel]
    return ReplayPlan(valid=True, copies=copies, dsts=dsts, non_blocking=all(c.non_blocking for c in recorder.copies),
                      sentinel=sentinel, rest=([copies[k] for k in keep], [dsts[k] for k in keep]))


def _sources(copies: list, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for index, whole, size, stride, offset in copies:
        t = tensors[index]
        out.append(t if whole else t.as_strided(size, stride, t.storage_offset() + offset))
    return out


def signature(bucket: Bucket) -> tuple:
    """What must match for a plan to apply: names, shapes, strides, dtypes and devices, in order."""
    return tuple((name, t.shape, t.stride(), t.dtype, t.device) for name, t in bucket)


@dataclass
class ReplayStats:
    """Counters since the replayer was made (the benchmark reports them)."""

    recorded: int = 0
    """Buckets that ran the real loader under the recorder."""
    replayed: int = 0
    """Buckets whose copies were replayed."""
    plain: int = 0
    """Buckets loaded by the real loader without recording (invalid plan, or backing off)."""
    invalid: int = 0
    """Recordings that could not be replayed."""
    dropped: int = 0
    """Times the plans were dropped (invalidate or stale destinations)."""
    last_reason: str = ""
    """Why the latest recording was not replayable."""


class WeightReplayer:
    """Wraps an engine's ``load_weights``: records each new bucket signature, replays the copies afterwards."""

    def __init__(self, load: Callable[[Bucket], Any], max_plans: int = 64):
        self._load = load
        self._plans: OrderedDict[tuple, ReplayPlan] = OrderedDict()
        self._max_plans = max_plans
        self._anchors: list[tuple[torch.UntypedStorage, int, int, int, int]] | None = None
        """(storage, its _cdata, how many plan destinations view it, address, size) per destination storage."""
        self._wasted = 0
        self._skip = 0
        self._record = True
        self.stats = ReplayStats()
        self.push_replayed_tensors = 0
        """Tensors of the current (or last) push whose load was replayed."""

    # -- push life cycle --------------------------------------------------------------
    def begin_push(self) -> None:
        """Call before the first bucket of a push: drops stale plans, decides whether this push may record."""
        self.release_stale()
        self._record = self._skip == 0
        self._skip = max(0, self._skip - 1)
        self.push_replayed_tensors = 0

    def load(self, bucket: Bucket, first: bool = False) -> str:
        """Load one bucket; ``first`` = first bucket of the push. Returns 'replayed', 'recorded' or 'plain'."""
        key = signature(bucket)
        plan = self._plans.get(key)
        if plan is not None and plan.valid:
            self._replay(plan, bucket, first)
            return "replayed"
        if plan is not None or not self._record:
            self._load(bucket)
            self.stats.plain += 1
            return "plain"
        self._remember(key, self._record_load(bucket))
        return "recorded"

    def invalidate(self) -> None:
        """Forget every valid plan (the engine discarded or re-created its weights); invalid ones stay known."""
        valid = [p for p in self._plans.values() if p.valid]
        if valid:
            self._note_dropped(valid)
        self._plans = OrderedDict((k, p) for k, p in self._plans.items() if not p.valid)
        self._anchors = None

    def release_stale(self) -> bool:
        """Drop the plans if a destination storage moved, changed size or is held by nobody but the plans.

        Returns whether they were dropped. Run after the engine slept (so a moved-away
        copy of its weights is freed at once) and before every push.
        """
        if not any(p.valid for p in self._plans.values()):
            return False
        if self._anchors is None:
            self._anchors = self._build_anchors()
        for storage, cdata, ours, ptr, nbytes in self._anchors:
            moved = storage.data_ptr() != ptr or storage.nbytes() != nbytes
            # references: our destination views, the storage object we hold (one), and the engine's tensors
            orphan = _storage_use_count is not None and _storage_use_count(cdata) - 1 <= ours
            if moved or orphan:
                self.invalidate()
                return True
        return False

    @property
    def plans(self) -> int:
        return sum(p.valid for p in self._plans.values())

    # -- internals --------------------------------------------------------------------
    def _record_load(self, bucket: Bucket) -> ReplayPlan:
        recorder = _Recorder([t for _, t in bucket])
        with torch.no_grad(), recorder:
            self._load(bucket)
        plan = _make_plan(recorder)
        self.stats.recorded += 1
        if not plan.valid:
            self.stats.invalid += 1
            self.stats.last_reason = plan.reason
        return plan

    def _replay(self, plan: ReplayPlan, bucket: Bucket, first: bool) -> None:
        tensors = [t for _, t in bucket]
        copies, dsts = plan.copies, plan.dsts
        if first:  # the engine's own bookkeeping runs on one real (small) load per push
            self._load([bucket[plan.sentinel]])
            copies, dsts = plan.rest
        if copies:
            with torch.no_grad():
                torch._foreach_copy_(dsts, _sources(copies, tensors), non_blocking=plan.non_blocking)
        plan.replays += 1
        self._wasted = 0
        self.stats.replayed += 1
        self.push_replayed_tensors += len(bucket) - (1 if first else 0)

    def _remember(self, key: tuple, plan: ReplayPlan) -> None:
        self._plans[key] = plan
        while len(self._plans) > self._max_plans:
            self._plans.popitem(last=False)
        self._anchors = None

    def _note_dropped(self, plans: list[ReplayPlan]) -> None:
        self.stats.dropped += 1
        if not any(p.replays for p in plans):  # recorded for nothing: record less often
            self._wasted += 1
            self._skip = min(2 ** self._wasted - 1, 63)

    def _build_anchors(self) -> list[tuple[torch.UntypedStorage, int, int, int, int]]:
        by_storage: dict[tuple, list] = {}
        for plan in self._plans.values():
            if not plan.valid:
                continue
            for dst in plan.dsts:
                storage = dst.untyped_storage()
                key = (dst.device, storage.data_ptr())
                entry = by_storage.setdefault(key, [storage, storage._cdata, 0, storage.data_ptr(), storage.nbytes()])
                entry[2] += 1
        return [tuple(e) for e in by_storage.values()]
