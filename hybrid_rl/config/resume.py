"""Resuming under a changed config: which keys may differ from the checkpoint's run, and the key-by-key diff.

Which keys may differ is not listed here: each field's declaration says it (``harmless`` / ``not_compared``,
``fields.py``), and the sets below are read off the tree, an engine's own options section included.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hybrid_rl.config.fields import resume_policy
from hybrid_rl.config.moved import MOVED_KEYS
from hybrid_rl.config.tree import Config


def _policies(cls: type, prefix: str = "") -> dict[str, str]:
    """Dotted leaf key → what a resume may do with it, as each field's declaration says (``fields.py``)."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            out.update(_policies(type(value), f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = resume_policy(f)
    return out


_POLICIES = _policies(Config)

RESUME_IGNORED = frozenset(k for k, p in _POLICIES.items() if p == "not_compared")
"""Where a run lives and how it resumes, not what it trains: never compared on resume."""

RESUME_HARMLESS = frozenset(k for k, p in _POLICIES.items() if p == "harmless")
"""Keys that may differ between a checkpoint's run and the run resuming it (each difference is warned about).
Every other key changes what is trained or the data order/shapes and stops the resume unless
``trainer.allow_config_change=true``."""


def resume_config_diff(saved: dict[str, Any], cfg: Config) -> tuple[list[str], list[str]]:
    """Compare a checkpoint's resolved config (a nested dict) with ``cfg``, key by key.

    Returns (differences that change what is trained, harmless differences), each as
    ``"key (checkpoint: old, now: new)"``. A key the saved config lacks (written before the key existed) is
    compared as its default; a key that moved is compared at its new place; keys the tree no longer has are skipped.
    """
    now = _flatten(cfg.to_dict())
    before = {**_flatten(Config().to_dict()), **{MOVED_KEYS.get(k, k): v for k, v in _flatten(saved).items()}}
    strict, harmless = [], []
    for key, value in now.items():
        if key in RESUME_IGNORED or before[key] == value:
            continue
        line = f"{key} (checkpoint: {_fmt_value(before[key])}, now: {_fmt_value(value)})"
        (harmless if key in RESUME_HARMLESS else strict).append(line)
    return strict, harmless


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted key → value; a mapping that is a value (``rollout.vllm.engine_kwargs``) stays one value."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and f"{prefix}{k}" in _SECTIONS:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _sections(cls: type, prefix: str = "") -> set[str]:
    """The dotted keys of the tree's sections (its nested dataclasses)."""
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            out |= {f"{prefix}{f.name}", *_sections(type(value), f"{prefix}{f.name}.")}
    return out


_SECTIONS = _sections(Config)


def _fmt_value(v: Any) -> str:
    """A value as it is spelt in an override (``sync``, ``[jsonl]``, ``null``)."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return "[" + ",".join(_fmt_value(x) for x in v) + "]"
    if isinstance(v, bool) or v is None:
        return {True: "true", False: "false", None: "null"}[v]
    return repr(v)

