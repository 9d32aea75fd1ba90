"""One call of a reward function: its score as a finite float, or its error as one line (in this process or a worker).

Two ways of calling a reward function, chosen from its parameters:

- hybrid_rl's: ``fn(response, ground_truth)``, with ``data_source=`` and ``extra_info=`` added by keyword when the
  function names them (or takes ``**kwargs``);
- verl's: a function with a ``solution_str`` parameter is called by keyword with those of ``data_source``,
  ``solution_str``, ``ground_truth`` and ``extra_info`` it names, so verl's ``compute_score(data_source,
  solution_str, ground_truth, extra_info=None)`` runs unchanged.

``data_source`` is the row's source name (its ``data_source`` field, or the task's name); ``extra_info`` the row's
``extra_info`` mapping (``{}`` when it has none). A sample's ``info`` travels as ``(data_source, extra_info as
JSON text)``; the JSON is decoded only for a function that asks for it.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from collections.abc import Mapping
from typing import Any, Callable

SampleInfo = tuple  # (data_source: str, extra_info: JSON text)
INFO_NAMES = ("data_source", "extra_info")
VERL_NAMES = ("data_source", "solution_str", "ground_truth", "extra_info")


@functools.lru_cache(maxsize=64)
def _style_cached(fn: Callable) -> tuple[str, tuple[str, ...]]:
    return call_style(fn)


def call_style(fn: Callable) -> tuple[str, tuple[str, ...]]:
    """``("verl", names)``: a function with a ``solution_str`` parameter, called by keyword with ``names`` (those of
    ``VERL_NAMES`` it takes); ``("plain", names)``: ``fn(response, ground_truth, **{n: ... for n in names})``, names
    among ``INFO_NAMES`` it takes by keyword. A callable whose signature cannot be read is plain, without extras."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "plain", ()
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    keyword = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if "solution_str" in keyword:
        return "verl", tuple(n for n in VERL_NAMES if n in keyword or var_kw)
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    taken = set(positional[:2])  # the response and the ground truth, by position
    return "plain", tuple(n for n in INFO_NAMES if (n in keyword and n not in taken) or (var_kw and n not in params))


def _style(fn: Callable) -> tuple[str, tuple[str, ...]]:
    try:
        return _style_cached(fn)
    except TypeError:  # an unhashable callable
        return call_style(fn)


def call_reward(fn: Callable, response: str, truth: str, info: SampleInfo | None = None) -> Any:
    """``fn``'s raw result for one sample, called in its style (``call_style``)."""
    style, names = _style(fn)
    if not names and style == "plain":
        return fn(response, truth)
    source, extra_json = info if info is not None else ("", "{}")
    values = {"data_source": source, "solution_str": response, "ground_truth": truth}
    if "extra_info" in names:
        values["extra_info"] = json.loads(extra_json) if extra_json else {}
    kwargs = {n: values[n] for n in names}
    return fn(**kwargs) if style == "verl" else fn(response, truth, **kwargs)


def score_one(fn: Callable, response: str, truth: str, info: SampleInfo | None = None) -> float:
    """``fn``'s score of one sample as a finite float; raises on an exception, a non-number or NaN/inf. ``info``:
    the sample's ``(data_source, extra_info JSON)``, for a function that takes them."""
    result = call_reward(fn, response, truth, info)
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
