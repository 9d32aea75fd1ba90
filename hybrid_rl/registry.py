"""``Registry``: the one table of an extension point (advantage estimators, policy losses, rollout engines, rewards).

Each extension point keeps one ``Registry`` beside the things it registers; config validation reads its names,
and the code that runs them looks them up by name, so a new estimator or engine is one function or class plus
one registration. A registry maps a name to the registered object (a function or a class), and keeps the
metadata the caller needs (``info``: e.g. an estimator's "needs groups") next to it. An object may be given as
``"module:attr"``, imported on first lookup, so that registering an optional backend (vLLM) imports nothing.

Plug-ins: a module of your own registers its names when imported. Name it in ``trainer.imports`` (a module name
or ``path/to/file.py``) or pass ``--import MODULE`` to ``hybrid-rl train``: every process (the launcher and each
rank that ``train --nproc`` starts) imports it before the config's names are checked. Left out on purpose: entry
points / automatic plug-in discovery, and overriding a built-in (a duplicate name is an error; ``unregister`` first).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """Name → registered object of one extension point, in registration order; ``info(name)`` is its metadata."""

    def __init__(self, key: str):
        self.key = key
        """The config key (or derived property) that picks from this registry: named in error messages."""
        self._objects: dict[str, Any] = {}
        self._info: dict[str, Any] = {}

    def register(self, name: str, obj: T | str, info: Any = None) -> T | str:
        """Add ``name``; a name already registered is an error (two plug-ins must not silently shadow each other)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.key}: a registered name must be a non-empty string, got {name!r}")
        if name in self._objects:
            raise ValueError(f"{self.key}: {name!r} is already registered (to {_describe(self._objects[name])}); "
                             "choose another name, or unregister it first")
        self._objects[name] = obj
        self._info[name] = info
        return obj

    def add(self, name: str, obj: T | str | None = None, info: Any = None):
        """``register`` with ``obj`` given; without it, a decorator that registers what it decorates and returns it."""
        if obj is not None:
            return self.register(name, obj, info)

        def decorate(target: T) -> T:
            self.register(name, target, info)
            return target

        return decorate

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests use this to undo their registrations)."""
        if name not in self._objects:
            raise KeyError(f"{self.key}: {name!r} is not registered")
        del self._objects[name], self._info[name]

    def info(self, name: str) -> Any:
        """The metadata registered with ``name``."""
        return self._info[self._check(name)]

    def names(self) -> list[str]:
        return list(self._objects)

    def unknown_message(self, value: Any) -> str:
        """``key='x' is not one of [...]`` with the closest name, as the config loader words a bad choice."""
        close = difflib.get_close_matches(str(value), self.names(), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return f"{self.key}={value!r} is not one of {self.names()}{hint}"

    def _check(self, name: str) -> str:
        if name not in self._objects:
            raise KeyError(self.unknown_message(name))
        return name

    def __getitem__(self, name: str) -> T:
        obj = self._objects[self._check(name)]
        if isinstance(obj, str):  # "module:attr", imported on first use
            module, _, attr = obj.partition(":")
            obj = self._objects[name] = getattr(importlib.import_module(module), attr)
        return obj

    def __iter__(self) -> Iterator[str]:
        return iter(self._objects)

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, name: object) -> bool:
        return name in self._objects

    def __repr__(self) -> str:
        return f"Registry({self.key!r}: {', '.join(self._objects)})"


def _describe(obj: Any) -> str:
    if isinstance(obj, str):
        return obj
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
