"""Fits or not, and the one setting to change: each candidate change is planned again and the first that fits is named.

Candidates come in the order of what they cost: for the engine's phases the engine's share, then offloading the
trainer's states; for the training passes the fused head (free), the micro-batch of the phase at its peak (the
largest value that fits), ``actor.accumulate_unsharded=false`` (``critic.accumulate_unsharded=false`` for the
critic's phases), sequence parallelism for the actor's passes (the
smallest size the ranks and heads allow), recomputation, offloading the reference. When no
single change fits, changes are combined, one at a time, up to ``MAX_COMBINED``: each round takes the first candidate
that makes it fit, else the one that leaves the lowest phases (the peak first, then the next), and plans again; a
combination that fits is named whole (7B on one H200: the optimizer's and the reference's offload together). When
none fits either, the single change that lowers the peak most is named, with what it leaves.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Iterator

from hybrid_rl.planner.estimate import CONTEXT_GIB, GIB, Phase, phases, seq_len
from hybrid_rl.planner.shape import ModelShape
from hybrid_rl.workers.ulysses import SP_KEY, check_heads

if TYPE_CHECKING:
    from hybrid_rl.config import Config

ENGINE_PHASES = ("weight push", "generation", "generation (rollout ranks)")
MAX_COMBINED = 4
"""The most settings a combined fix changes."""


@dataclass
class Verdict:
    fits: bool
    peak: Phase
    gpu_bytes: float
    fix: str | None
    """The one setting to change (``None`` when it fits)."""

    @property
    def line(self) -> str:
        gib, mem = self.peak.total / GIB, self.gpu_bytes / GIB
        if self.fits:
            return f"fits: peak {gib:.1f} GiB ({self.peak.name}) + {CONTEXT_GIB:g} GiB context of {mem:.1f} GiB per GPU"
        return f"does not fit: {self.peak.name} needs {gib:.1f} GiB + {CONTEXT_GIB:g} GiB context of {mem:.1f} GiB per GPU; {self.fix}"


def peak_of(all_phases: list[Phase]) -> Phase:
    return max(all_phases, key=lambda p: p.total)


def fits(all_phases: list[Phase], gpu_bytes: float) -> bool:
    return peak_of(all_phases).total + CONTEXT_GIB * GIB <= gpu_bytes


def with_settings(cfg: "Config", settings: dict[str, object]) -> "Config":
    """A copy of ``cfg`` with dotted keys set."""
    out = copy.deepcopy(cfg)
    for key, value in settings.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = getattr(node, part)
        setattr(node, last, value)
    return out


def _halvings(value: int, floor: int) -> Iterator[int]:
    while value // 2 >= floor:
        value //= 2
        yield value


def _lower(key: str, value: int, floor: int) -> list[dict[str, object]]:
    return [{key: v} for v in _halvings(value, floor)]


def _micro_batch_keys(cfg: "Config", phase: str) -> list[dict[str, object]]:
    """The phase's micro-batch (or token budget) lowered step by step, largest first."""
    a, cr = cfg.actor, cfg.critic
    if phase.startswith("critic"):
        if cr.use_dynamic_bsz:
            return _lower("critic.max_token_len_per_device", cr.max_token_len_per_device, seq_len(cfg))
        key = "ppo_micro_batch_size_per_device" if phase == "critic update" else "forward_micro_batch_size_per_device"
        return _lower(f"critic.{key}", getattr(cr, key), 1)
    if a.use_dynamic_bsz:
        return _lower("actor.max_token_len_per_device", a.max_token_len_per_device, seq_len(cfg))
    if phase == "actor update":
        return _lower("actor.ppo_micro_batch_size_per_device", a.ppo_micro_batch_size_per_device, 1)
    if phase == "ref log-prob":
        return _lower("ref.log_prob_micro_batch_size_per_device", cfg.ref.log_prob_micro_batch_size_per_device, 1)
    return _lower("actor.log_prob_micro_batch_size_per_device", a.log_prob_micro_batch_size_per_device, 1)


ENGINE_MARGIN_GIB = 1.0
"""Beside its weights and one sequence's KV cache, what an engine's share must leave for its activations and graphs."""


def engine_floor(cfg: "Config", shape: ModelShape) -> float:
    """The least bytes a reserving engine can run in: its 16-bit weights and the KV cache of one sequence of the
    longest length (vLLM refuses to start without room for it), both split over its tensor-parallel GPUs, and
    ``ENGINE_MARGIN_GIB``."""
    tp = cfg.rollout.engine_memory().tensor_parallel
    kv_one = seq_len(cfg) * shape.layers * 2 * shape.kv_dim * 2
    return (shape.params * 2 + kv_one) / tp + ENGINE_MARGIN_GIB * GIB


def _engine_share(cfg: "Config", shape: ModelShape | None = None,
                  gpu_bytes: float | None = None) -> list[dict[str, object]]:
    """Smaller shares of the GPU for an engine that reserves one, in steps of 5%, largest first; with the shape and
    the GPU's memory, none below what the engine can run in (``engine_floor``)."""
    mem = cfg.rollout.engine_memory()
    if mem.gpu_share is None:
        return []
    steps = int(round(mem.gpu_share * 20))
    floor = engine_floor(cfg, shape) / gpu_bytes if shape is not None and gpu_bytes else 0.0
    return [{mem.gpu_share_key: k / 20} for k in range(steps - 1, 1, -1) if k / 20 >= floor]


def _sequence_parallel(cfg: "Config", shape: ModelShape | None, gpus: int | None) -> list[dict[str, object]]:
    """Larger ``actor.ulysses_sequence_parallel_size`` values, smallest first, that the config accepts on ``gpus``
    ranks and the model's heads divide (``workers/ulysses.check_heads``)."""
    from hybrid_rl.config import ConfigError

    if shape is None or gpus is None or cfg.actor.use_remove_padding is False:
        return []
    out = []
    size = cfg.actor.ulysses_sequence_parallel_size * 2
    while size <= gpus:
        trial = {"actor.ulysses_sequence_parallel_size": size}
        heads = SimpleNamespace(num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads)
        try:
            check_heads(heads, size, SP_KEY)
            with_settings(cfg, trial).validate(gpus)
            out.append(trial)
        except (ConfigError, ValueError):
            pass
        size *= 2
    return out


def candidates(cfg: "Config", peak: str, shape: ModelShape | None = None, gpus: int | None = None,
               gpu_bytes: float | None = None) -> Iterator[list[dict[str, object]]]:
    """Groups of alternative single-setting changes, in the order they are tried; inside a group, the mildest first."""
    a, sync = cfg.actor, cfg.engine_sleeps
    offloads = [[{k: True}] for k, on in (("actor.param_offload", a.param_offload and sync),
                                          ("actor.optimizer_offload", a.optimizer_offload and sync),
                                          ("ref.offload", cfg.ref.offload or not cfg.need_ref or cfg.model.lora.rank > 0))
                if not on and (sync or k == "ref.offload")]
    if cfg.model.lora.rank > 0 and cfg.model.lora.base_dtype != "compute" and not peak.startswith("critic"):
        yield [{"model.lora.base_dtype": "compute"}]  # the same update in fewer bytes: tried first
    if peak in ENGINE_PHASES:
        yield _engine_share(cfg, shape, gpu_bytes)
        yield from offloads
        return
    impl = cfg.critic.optimizer_impl if peak.startswith("critic") else a.optimizer_impl
    if peak in ("actor update", "critic update") and impl != "fused":
        yield [{f"{peak.split()[0]}.optimizer_impl": "fused"}]
    if a.fused_logprob is False and not peak.startswith("critic"):
        yield [{"actor.fused_logprob": True}]
    yield _micro_batch_keys(cfg, peak)
    if peak.startswith("critic"):
        if cfg.critic.accumulates_unsharded(a):
            yield [{"critic.accumulate_unsharded": False}]
    elif a.accumulate_unsharded:
        yield [{"actor.accumulate_unsharded": False}]
    if peak in ("actor update", "old log-prob", "ref log-prob"):
        yield _sequence_parallel(cfg, shape, gpus)
    if peak == "actor update" and not cfg.model.enable_gradient_checkpointing:
        yield [{"model.enable_gradient_checkpointing": True}]
    if peak == "critic update" and not cfg.critic.enable_gradient_checkpointing:
        yield [{"critic.enable_gradient_checkpointing": True}]
    yield offloads[-1] if offloads and "ref.offload" in offloads[-1][0] else []
    if not sync:
        yield _engine_share(cfg, shape, gpu_bytes)


def _describe(settings: dict[str, object]) -> str:
    (key, value), = settings.items()
    if isinstance(value, bool):
        return f"set {key}={str(value).lower()}"
    if key == "actor.ulysses_sequence_parallel_size" or isinstance(value, str):
        return f"set {key}={value}"
    return f"lower {key} to {value:g}"


def _totals(all_phases: list[Phase]) -> list[float]:
    return sorted((p.total for p in all_phases), reverse=True)


def search(cfg: "Config", shape: ModelShape, gpus: int, gpu_bytes: float
           ) -> tuple[dict[str, object] | None, tuple[float, dict[str, object]] | None]:
    """Settings that make ``cfg`` fit, one or several chosen a round at a time (see the module's note), or ``None``;
    and the single change of the first round that lowers the peak most (the peak it leaves, the change)."""
    chosen: dict[str, object] = {}
    single: tuple[float, dict[str, object]] | None = None
    current, now = cfg, phases(cfg, shape, gpus, gpu_bytes)
    for _ in range(MAX_COMBINED):
        best: tuple[list[float], dict[str, object], "Config", list[Phase]] | None = None
        for group in candidates(current, peak_of(now).name, shape, gpus, gpu_bytes):
            for settings in group:
                trial_cfg = with_settings(current, settings)
                trial = phases(trial_cfg, shape, gpus, gpu_bytes)
                if fits(trial, gpu_bytes):
                    return {**chosen, **settings}, single
                if not chosen and (single is None or peak_of(trial).total < single[0]):
                    single = (peak_of(trial).total, settings)
                if best is None or _totals(trial) < best[0]:
                    best = (_totals(trial), settings, trial_cfg, trial)
        if best is None or best[0] >= _totals(now):  # nothing lowers the phases any more
            break
        chosen.update(best[1])
        current, now = best[2], best[3]
    return None, single


def _describe_all(settings: dict[str, object]) -> str:
    parts = [_describe({k: v}) for k, v in settings.items()]
    return " and ".join(parts) + " (together: no single setting fits)"


def judge(cfg: "Config", shape: ModelShape, gpus: int, gpu_bytes: float) -> tuple[list[Phase], Verdict]:
    """The phases and the verdict; a config that does not fit gets the first candidate change that fits, or the
    changes that fit together (``search``)."""
    base = phases(cfg, shape, gpus, gpu_bytes)
    peak = peak_of(base)
    if fits(base, gpu_bytes):
        return base, Verdict(True, peak, gpu_bytes, None)
    fix, best = search(cfg, shape, gpus, gpu_bytes)
    if fix is not None:
        return base, Verdict(False, peak, gpu_bytes, _describe(fix) if len(fix) == 1 else _describe_all(fix))
    if best is None:
        return base, Verdict(False, peak, gpu_bytes, "no single setting makes it fit: use more GPUs or a smaller model")
    return base, Verdict(False, peak, gpu_bytes, f"{_describe(best[1])} (alone it still needs "
                                                 f"{best[0] / GIB:.1f} GiB: use more GPUs as well)")
