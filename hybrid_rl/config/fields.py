"""How a config field says what a resume may do with it, beside its declaration.

``harmless(default)`` declares a field that may differ between a checkpoint's run and the run resuming it (each
difference is warned about): how long, how often, where to log, what to diagnose, validation only, and memory/speed
knobs that compute the same update. ``not_compared(default)`` declares one that says where a run lives or how it
resumes, not what it trains. A field declared the ordinary way changes what is trained or the data order/shapes
(model, data, algorithm, optimiser, sampling, mode, placement, seed) and stops a resume unless
``trainer.allow_config_change=true``, so a new field is strict until its declaration says otherwise.
``config/resume.py`` reads these marks off the tree. The mark is the field's metadata ``{"resume": "harmless"}``
(or ``"not_compared"``): an engine's options module, which the config package imports, spells it out.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

ResumePolicy = Literal["strict", "harmless", "not_compared"]
_KEY = "resume"


def harmless(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A field a resume may change (warned about)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_KEY: "harmless"})


def not_compared(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A field a resume never compares (where the run lives, how it resumes)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_KEY: "not_compared"})


def resume_policy(f: dataclasses.Field) -> ResumePolicy:
    """What a resume may do with field ``f``: its declaration's mark, else ``strict``."""
    return f.metadata.get(_KEY, "strict")
