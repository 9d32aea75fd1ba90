"""Resolve ``reward.function`` to a callable and score a batch of responses with it.

A reward function is any ``fn(response: str, ground_truth: str) -> float``.
``get_reward_fn`` maps ``auto`` to the task's own reward, a built-in name to
the function registered under it in ``BUILTIN_REWARDS`` (a new built-in is one
function plus one ``register_reward("name")``), and ``module:function`` (or
``path/to/file.py:function``) to user code. ``score_responses`` is the one place user reward code runs, so it
is where failures are turned into a one-line error naming the sample, or into
counted zeros when ``reward.on_error=zero``. Left out: model-based rewards,
async/batched reward calls, and extra per-sample metadata beyond the ground
truth (verl's ``extra_info``).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from ..registry import Registry
from . import gsm8k, successor

RewardFn = Callable[[str, str], float]


class RewardError(ValueError):
    """A bad ``reward.*`` setting or a failing reward function; the message names the key and the fix."""


BUILTIN_REWARDS: Registry[RewardFn] = Registry("reward.function")
"""Built-in reward functions by the name ``reward.function`` (or a task's ``default_reward``) takes."""


def register_reward(name: str, fn: RewardFn | None = None) -> Any:
    """Register ``fn`` as the built-in reward ``name``: ``register_reward("name", fn)``, or as a decorator.
    A duplicate name is an error; so is ``auto`` or a name with ``:`` (those mean something else in reward.function)."""
    if name == "auto" or ":" in name:
        raise ValueError(f"reward name {name!r} would be read as {'the task default' if name == 'auto' else 'module:function'}; "
                         "choose another name")
    return BUILTIN_REWARDS.add(name, fn)


register_reward("gsm8k", gsm8k.compute_score)
register_reward("successor", successor.compute_score)


def get_reward_fn(name: str, task: str) -> RewardFn:
    """The reward callable for ``reward.function=name`` under ``data.task=task``."""
    if name == "auto":
        from ..data.tasks import TASKS

        if task not in TASKS:
            raise RewardError(f"reward.function=auto uses the task's own reward, but data.task={task!r} is not a known task; "
                              f"use one of {sorted(TASKS)} or set reward.function")
        name = TASKS[task].default_reward
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    module_name, sep, attr = name.rpartition(":")
    if not sep or not module_name or not attr:
        raise RewardError(f"reward.function={name!r} is not 'auto', a built-in ({', '.join(sorted(BUILTIN_REWARDS))}) "
                          f"or 'module:function'; fix reward.function")
    module = _import(module_name, name)
    if not hasattr(module, attr):
        raise RewardError(f"reward.function={name!r}: module {module_name!r} has no attribute {attr!r}; fix the function name")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"reward.function={name!r}: {attr!r} in {module_name!r} is a {type(fn).__name__}, not a function; "
                          f"point reward.function at a callable fn(response, ground_truth) -> float")
    return fn


def _import(module_name: str, name: str) -> Any:
    if module_name.endswith(".py"):
        # A file path: load it under a private module name so it cannot shadow
        # an installed package of the same stem.
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise RewardError(f"reward.function={name!r}: no such file {module_name!r}; fix the path in reward.function")
        spec = importlib.util.spec_from_file_location(f"_hybrid_rl_reward_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise RewardError(f"reward.function={name!r}: cannot load {module_name!r} as Python; fix reward.function")
        module = importlib.util.module_from_spec(spec)
        try:
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(spec.name, None)
            raise RewardError(f"reward.function={name!r}: importing {module_name!r} failed ({type(e).__name__}: {_first_line(e)}); "
                              f"fix that file") from e
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise RewardError(f"reward.function={name!r}: cannot import module {module_name!r} ({_first_line(e)}); "
                          f"put its directory on PYTHONPATH or fix reward.function") from e
    except Exception as e:  # the module exists but raised while importing
        raise RewardError(f"reward.function={name!r}: importing {module_name!r} failed ({type(e).__name__}: {_first_line(e)}); "
                          f"fix that module") from e


def score_responses(fn: RewardFn, responses: list[str], ground_truths: list[str],
                    on_error: str = "raise") -> tuple[list[float], int]:
    """Scores for every (response, ground truth) pair and the number of failed samples scored 0.

    A failure is an exception from ``fn``, a return value that is not a number
    (a mapping with a ``"score"`` key, as verl reward functions may return, is
    accepted), or a NaN/inf score.
    """
    if on_error not in ("raise", "zero"):
        raise RewardError(f"reward.on_error={on_error!r} must be 'raise' or 'zero'")
    if len(responses) != len(ground_truths):
        raise ValueError(f"score_responses got {len(responses)} responses but {len(ground_truths)} ground truths")
    scores: list[float] = []
    num_failed = 0
    for i, (response, truth) in enumerate(zip(responses, ground_truths)):
        try:
            result = fn(response, truth)
            if isinstance(result, Mapping) and "score" in result:
                result = result["score"]
            if isinstance(result, (str, bytes)):
                # float("1") would succeed, but a string score is almost
                # certainly a bug in the reward function, not a number.
                raise TypeError(f"returned a {type(result).__name__} {result!r}, not a number")
            score = float(result)
            if not math.isfinite(score):
                raise ValueError(f"returned {score}, not a finite number")
        except Exception as e:
            if on_error == "raise":
                raise RewardError(
                    f"reward function {_fn_name(fn)} failed on sample {i} ({type(e).__name__}: {_first_line(e)}); "
                    f"response={_short(response)!r}, ground_truth={_short(truth)!r}; fix the function, or set "
                    f"reward.on_error=zero to score such samples 0 and count them") from e
            score = 0.0
            num_failed += 1
        scores.append(score)
    return scores, num_failed


def _fn_name(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    return f"{module}.{name}" if module else str(name)


def _first_line(e: BaseException, limit: int = 160) -> str:
    lines = str(e).strip().splitlines()
    return _short(lines[0] if lines else "", limit)


def _short(text: Any, limit: int = 60) -> str:
    # Keep both ends: a response's final answer is usually at its end.
    text = str(text)
    if len(text) <= limit:
        return text
    head = (limit - 3) // 2
    return text[:head] + "..." + text[-(limit - 3 - head):]
