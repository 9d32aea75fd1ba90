"""``train``'s memory check: before any rank starts, refuse a config predicted to need clearly more than the GPU has.

Only on CUDA (on CPU there is no device memory to compare against) and with ``trainer.check_memory`` on. The
prediction takes every micro-batch at full length, so it errs high where sequences are cut by count; the refusal
waits for ``REFUSE_MARGIN`` beyond the card, so that a config that runs is not refused. A model whose shape cannot
be read here (a hub id not downloaded yet) is not checked: loading it reports its own problems.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybrid_rl.planner.estimate import GIB
from hybrid_rl.planner.gpus import visible_gpu
from hybrid_rl.planner.shape import ShapeError, read_shape
from hybrid_rl.planner.verdict import judge

if TYPE_CHECKING:
    from hybrid_rl.config import Config

REFUSE_MARGIN = 0.05
"""Refuse only when the predicted peak exceeds the GPU's memory by more than this fraction."""


def memory_refusal(cfg: "Config", gpus: int, gpu_bytes: float) -> str | None:
    """The one-line refusal for ``cfg`` on ``gpus`` GPUs of ``gpu_bytes`` each, or None when it may run."""
    try:
        shape = read_shape(cfg.model.path)
    except ShapeError:
        return None
    all_phases, verdict = judge(cfg, shape, gpus, gpu_bytes)
    if verdict.peak.total <= gpu_bytes * (1 + REFUSE_MARGIN):
        return None
    return (f"predicted peak {verdict.peak.total / GIB:.1f} GiB per GPU in the {verdict.peak.name} exceeds the GPU's "
            f"{gpu_bytes / GIB:.1f} GiB: {verdict.fix} (`hybrid-rl plan` shows the terms; trainer.check_memory=false "
            f"skips this check)")


def check_memory(cfg: "Config", nproc: int) -> str | None:
    """``memory_refusal`` on this machine's GPU, or None where the check does not apply."""
    if not cfg.trainer.check_memory or cfg.trainer.device == "cpu":
        return None
    gpu = visible_gpu()
    if gpu is None:
        return None
    return memory_refusal(cfg, nproc, gpu[1] * GIB)
