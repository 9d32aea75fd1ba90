"""Rollout engines behind one interface (``base.RolloutEngine``), and ``ROLLOUT_ENGINES``: ``rollout.name`` → class.

Every engine class has ``from_config(cfg, dist, tokenizer)``; the worker builds whichever class ``rollout.name``
names, and config validation accepts exactly the registered names. The built-ins are registered by import path,
so importing this package imports neither an engine module nor vLLM (vLLM itself is imported only when its
engine is built, and a missing vLLM is a one-line error there). A new engine is one class plus one
``register_rollout_engine("name")`` decorator on it (or ``register_rollout_engine("name", "module:Class")``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, TypeVar

from hybrid_rl.registry import Registry

if TYPE_CHECKING:
    from hybrid_rl.rollout.base import RolloutEngine

E = TypeVar("E", bound=type)

ROLLOUT_ENGINES: "Registry[type[RolloutEngine]]" = Registry("rollout.name")
"""Every rollout engine class by the name ``rollout.name`` takes (``"module:Class"`` entries import on lookup)."""


def register_rollout_engine(name: str, cls: Optional[str | type] = None) -> Callable[[E], E] | str | type:
    """Register an engine class as ``rollout.name=name``: as a decorator, or with the class or a ``"module:Class"``
    path (imported on first use). A duplicate name is an error."""
    return ROLLOUT_ENGINES.add(name, cls)


def rollout_engine_class(name: str) -> "type[RolloutEngine]":
    """The class registered as ``rollout.name=name`` (imports its module on first use)."""
    return ROLLOUT_ENGINES[name]


register_rollout_engine("hf", "hybrid_rl.rollout.hf:HFRolloutEngine")
register_rollout_engine("vllm", "hybrid_rl.rollout.vllm:VLLMRolloutEngine")
