"""One call of a reward function: its score as a finite float, or its error as one line (in this process or a worker)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable


def score_one(fn: Callable[[str, str], Any], response: str, truth: str) -> float:
    """``fn(response, truth)`` as a finite float; raises on an exception, a non-number or NaN/inf."""
    result = fn(response, truth)
    if isinstance(result, Mapping) and "score" in result:
        result = result["score"]
    if isinstance(result, (str, bytes)):
        # float("1") would succeed, but a string score is almost certainly a bug in the reward function
        raise TypeError(f"returned a {type(result).__name__} {result!r}, not a number")
    score = float(result)
    if not math.isfinite(score):
        raise ValueError(f"returned {score}, not a finite number")
    return score


def describe_error(e: BaseException, limit: int = 160) -> str:
    """``Type: first line`` of ``e``, its middle cut past ``limit`` (as the in-process message words it)."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) > limit:
        head = (limit - 3) // 2
        text = text[:head] + "..." + text[-(limit - 3 - head):]
    return f"{type(e).__name__}: {text}"
