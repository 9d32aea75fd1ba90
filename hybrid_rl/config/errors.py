"""``ConfigError`` and the small checks every section's ``validate`` shares."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A bad recipe or override; the message names the dotted key and the fix."""


def require_positive(section: Any, prefix: str, names: list[str]) -> None:
    """Each of ``section``'s ``names`` is a positive integer; the error names ``prefix.name``."""
    for name in names:
        value = getattr(section, name)
        if value <= 0:
            raise ConfigError(f"{prefix}.{name}={value} must be a positive integer")


def join_or(names: list[str]) -> str:
    """``a, b or c``."""
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
