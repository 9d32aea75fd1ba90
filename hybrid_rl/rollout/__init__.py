"""Rollout engines behind one interface (``base.RolloutEngine``), and ``ROLLOUT_ENGINES``: ``rollout.name`` → class.

Every engine class has ``from_config(cfg, dist, tokenizer)``; the worker builds whichever class ``rollout.name``
names, and config validation accepts exactly the registered names. The built-ins are registered by import path,
so importing this package imports neither an engine module nor vLLM (vLLM itself is imported only when its
engine is built, and a missing vLLM is a one-line error there). A new engine is one class plus one
``register_rollout_engine("name")`` decorator on it (or ``register_rollout_engine("name", "module:Class")``).

What the rest of the system must know of an engine before importing it is its registry entry's ``EngineInfo``
(the package it needs, its dtype for a float32 model, whether split placement needs a twin of it); an engine with
options of its own has them as the section ``rollout.<name>`` of the config tree, whose ``validate`` checks them,
whose ``memory()`` tells the planner how much GPU memory they make it take (``EngineMemory``), and whose fields say
which of them a resume may change. A plug-in engine needs none of that: ``EngineInfo()`` describes an engine that
needs nothing, and ``EngineMemory()`` one that holds what it computes with. No module outside this package branches
on an engine's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

from hybrid_rl.registry import Registry

if TYPE_CHECKING:
    from hybrid_rl.rollout.base import RolloutEngine

E = TypeVar("E", bound=type)


@dataclass(frozen=True)
class EngineInfo:
    """An engine's needs, read without importing it."""

    package: Optional[str] = None
    """The package it imports (checked before a run starts), e.g. ``vllm``; None: nothing beyond hybrid_rl's own."""
    package_label: str = ""
    """That package's name in messages, e.g. ``vLLM``."""
    pip_extra: str = ""
    """The extra of ``pip install -e '.[extra]'`` that installs it."""
    tested_with: str = ""
    """The version it was tested with, e.g. ``vllm 0.26``."""
    gpu_only: bool = False
    """It generates on NVIDIA GPUs only."""
    float32_as: Optional[str] = None
    """The dtype it runs a float32 model in under ``rollout.dtype=auto`` (None: the model's own)."""
    split_twin: bool = False
    """Split placement: its set-up creates process groups over the whole world, so the trainer ranks build one too
    (a twin, released at once) for those collectives to pair up."""


@dataclass(frozen=True)
class EngineMemory:
    """An engine's GPU memory as its options set it, for the memory planner (``hybrid_rl.planner``); the options
    section ``rollout.<name>`` returns it from ``memory()``. The default describes an engine without such a section:
    it holds what it computes with (its weights, KV cache and one step's logits), on one GPU."""

    gpu_share: Optional[float] = None
    """The fraction of a GPU's memory the awake engine reserves up front, its weights and KV cache within it (None:
    it holds what it computes with)."""
    gpu_share_key: str = ""
    """The dotted key that sets ``gpu_share``: the planner's fix when a phase does not fit."""
    tensor_parallel: int = 1
    """GPUs one engine's weights are split over."""
    fitted_kv_bytes: Optional[Callable[..., Optional[int]]] = field(default=None, compare=False)
    """``(cfg, shape, gpu_bytes) -> bytes or None``: the KV cache per GPU when the engine sizes it to what it can
    hold at once rather than to its share (None from the call: the share; no callable: the engine never does)."""


ROLLOUT_ENGINES: "Registry[type[RolloutEngine]]" = Registry("rollout.name")
"""Every rollout engine class by the name ``rollout.name`` takes (``"module:Class"`` entries import on lookup)."""


def register_rollout_engine(name: str, cls: Optional[str | type] = None,
                            info: Optional[EngineInfo] = None) -> Callable[[E], E] | str | type:
    """Register an engine class as ``rollout.name=name``: as a decorator, or with the class or a ``"module:Class"``
    path (imported on first use). ``info``: what it needs (default: nothing). A duplicate name is an error."""
    return ROLLOUT_ENGINES.add(name, cls, info or EngineInfo())


def rollout_engine_class(name: str) -> "type[RolloutEngine]":
    """The class registered as ``rollout.name=name`` (imports its module on first use)."""
    return ROLLOUT_ENGINES[name]


def engine_info(name: str) -> EngineInfo:
    """The ``EngineInfo`` registered with ``rollout.name=name`` (imports nothing)."""
    return ROLLOUT_ENGINES.info(name) or EngineInfo()


register_rollout_engine("hf", "hybrid_rl.rollout.hf:HFRolloutEngine")
register_rollout_engine("vllm", "hybrid_rl.rollout.vllm:VLLMRolloutEngine",
                        EngineInfo(package="vllm", package_label="vLLM", pip_extra="vllm", tested_with="vllm 0.26",
                                   gpu_only=True, split_twin=True,
                                   float32_as="bfloat16"))  # vLLM 0.26's float32 generate crashes on H200
