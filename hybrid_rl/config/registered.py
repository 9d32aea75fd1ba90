"""Config keys whose choices are the names in an extension point's registry (``hybrid_rl.registry.Registry``).

Checked when a value is loaded (like a ``Literal``) and again by ``Config.validate``; the registries are imported
lazily, so that loading a config imports neither torch nor any engine. A key in ``_AUTO_KEYS`` also takes ``auto``
(never looked up), one in ``_OPTIONAL_KEYS`` also null.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from hybrid_rl.config.errors import ConfigError

REGISTERED_KEYS = {"algorithm.adv_estimator": ("hybrid_rl.algorithms.advantages", "ADV_ESTIMATORS"),
                   "rollout.name": ("hybrid_rl.rollout", "ROLLOUT_ENGINES"),
                   "actor.policy_loss": ("hybrid_rl.algorithms.policy_loss", "POLICY_LOSSES"),
                   "algorithm.rollout_correction.method": ("hybrid_rl.algorithms.rollout_correction",
                                                           "ROLLOUT_CORRECTIONS"),
                   "env.name": ("hybrid_rl.envs.base", "ENVS"),
                   "env.call_format": ("hybrid_rl.envs.calls", "CALL_FORMATS")}
_AUTO_KEYS = frozenset({"actor.policy_loss"})
_OPTIONAL_KEYS = frozenset({"env.name"})
"""Keys that also take null (the feature off)."""


def registry(key: str) -> Any:
    """The registry whose names ``key`` takes."""
    module, attr = REGISTERED_KEYS[key]
    return getattr(importlib.import_module(module), attr)


def check_choice(key: str, value: Any) -> None:
    """``value`` is a name registered for ``key``; ConfigError with the closest name otherwise."""
    if key in _AUTO_KEYS and value == "auto" or key in _OPTIONAL_KEYS and value is None:
        return
    names = registry(key)
    if value not in names:
        if key not in _AUTO_KEYS:
            raise ConfigError(names.unknown_message(value))
        choices = ["auto", *names.names()]
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"{key}={value!r} is not one of {choices}{hint}")


def check_registered(cfg: Any) -> None:
    """Every registered key of ``cfg`` (a ``Config``) names a registered object."""
    for key in REGISTERED_KEYS:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        check_choice(key, value)
