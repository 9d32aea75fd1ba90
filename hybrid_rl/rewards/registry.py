"""Resolve ``reward.function`` to a callable and score a batch of responses with it.

A reward function is any ``fn(response: str, ground_truth: str) -> float`` (or verl's ``compute_score(data_source,
solution_str, ground_truth, extra_info)``).
``get_reward_fn`` maps ``auto`` to the task's own reward, a built-in name to
the function registered under it in ``BUILTIN_REWARDS`` (a new built-in is one
function plus one ``register_reward("name")``), and ``module:function`` (or
``path/to/file.py:function``) to user code. ``RewardScorer`` is the one place user reward code runs (through
``score_responses`` in this process, or a ``RewardPool`` of worker processes), so it is where failures and
calls past ``reward.timeout_s`` are turned into a one-line error naming the sample, or into counted zeros when
``reward.on_error=zero``, and where a long call is reported while it runs. The built-ins (microseconds per sample)
are scored in this process unless ``reward.num_workers`` asks for workers: a pool round trip would cost more than
the scoring (except ``POOLED_BUILTINS``: ``math``, milliseconds of SymPy per sample, and ``code``, a sandboxed
interpreter per sample). A sample's ``data_source`` and
``extra_info`` reach a function that names them, and a verl reward function runs unchanged (``call.py``). A reward
model's score is ``rewards/model.py``'s, added beside this. Left out: batched reward calls.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..data.tasks import TASKS
from ..pyfile import exec_file_module
from ..registry import Registry
from . import arith, code, gsm8k, successor, think
from . import math as math_reward
from .call import SampleInfo, call_style, score_one
from .pool import PoolFailure, RewardPool, WorkerInitError, worker_count

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
register_reward("arith", arith.compute_score)
register_reward("arith_strict", arith.compute_score_strict)
register_reward("math", math_reward.compute_score)
register_reward("code", code.compute_score)
register_reward("code_fraction", code.compute_score_fraction)
register_reward("think_format", think.compute_score)

POOLED_BUILTINS = frozenset({"math", "code", "code_fraction"})
"""Built-ins slow enough (milliseconds of SymPy, or a sandboxed interpreter, per sample) to run in reward worker
processes under ``reward.num_workers=-1``, where a call can be abandoned at ``reward.timeout_s``."""
NEEDS = {"math": ("math_verify", "math-verify", "math")}
"""Built-ins that need an optional package: (module, PyPI name, this package's extra)."""


def no_reward(response: str, ground_truth: str) -> float:
    """0 for every response: the score is the multi-turn environment's own rewards (``env.name``; the lookup task's
    default, ``reward.function=none``)."""
    return 0.0


register_reward("none", no_reward)


def get_reward_fn(name: str, task: str) -> RewardFn:
    """The reward callable for ``reward.function=name`` under ``data.task=task``."""
    requested = name
    if name == "auto":
        if task not in TASKS:
            raise RewardError(f"reward.function=auto uses the task's own reward, but data.task={task!r} is not a known task; "
                              f"use one of {sorted(TASKS)} or set reward.function")
        name = TASKS[task].default_reward
    if name in BUILTIN_REWARDS:
        _check_needs(name, requested, task)
        fn = BUILTIN_REWARDS[name]
        check_signature(fn, name)
        return fn
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
    check_signature(fn, name)
    return fn


def resolve_name(name: str, task: str) -> str:
    """``reward.function`` with ``auto`` replaced by the task's own reward's name."""
    if name == "auto" and task in TASKS:
        return TASKS[task].default_reward
    return name


def _check_needs(name: str, requested: str, task: str) -> None:
    if name not in NEEDS:
        return
    import importlib.util

    module, dist, extra = NEEDS[name]
    if importlib.util.find_spec(module) is None:
        raise RewardError(f"{reward_label(requested, task)} needs the {dist} package, which is not "
                          f"installed; install it with pip install -e '.[{extra}]' (or pip install {dist})")


def check_signature(fn: Any, name: str) -> None:
    """``fn`` can be called the way every sample is scored (``call.call_reward``): ``fn(response, ground_truth)``
    (with ``data_source``/``extra_info`` by keyword where it names them), or verl's keywords for a function with a
    ``solution_str`` parameter; RewardError naming ``reward.function=name`` otherwise. A callable whose signature
    cannot be read passes."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have none
        return
    style, names = call_style(fn)
    attr = name.rpartition(":")[2] or name
    try:
        if style == "verl":
            sig.bind(**{n: n for n in names})
        else:
            sig.bind("response", "ground_truth", **{n: n for n in names})
    except TypeError as e:
        if style == "verl":
            raise RewardError(f"reward.function={name!r}: {attr}{sig} takes solution_str, so it is called as verl "
                              f"calls a reward function, by keyword with those of data_source, solution_str, "
                              f"ground_truth and extra_info it names, and that fails ({e}); give every other "
                              f"parameter a default") from None
        raise RewardError(f"reward.function={name!r}: {attr}{sig} cannot be called as {attr}(response, ground_truth) "
                          f"({e}), which is how every sample is scored; define it as def {attr}(response, "
                          f"ground_truth) -> float (any further parameters need defaults; data_source and extra_info "
                          f"are passed by keyword to a function that names them)") from None


def _import(module_name: str, name: str) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise RewardError(f"reward.function={name!r}: no such file {module_name!r}; fix the path in reward.function")
        try:
            module = exec_file_module(path, f"_hybrid_rl_reward_{path.stem}")
        except Exception as e:
            raise RewardError(f"reward.function={name!r}: importing {module_name!r} failed ({type(e).__name__}: {_first_line(e)}); "
                              f"fix that file") from e
        if module is None:
            raise RewardError(f"reward.function={name!r}: cannot load {module_name!r} as Python; fix reward.function")
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise RewardError(f"reward.function={name!r}: cannot import module {module_name!r} ({_first_line(e)}); "
                          f"put its directory on PYTHONPATH or fix reward.function") from e
    except Exception as e:  # the module exists but raised while importing
        raise RewardError(f"reward.function={name!r}: importing {module_name!r} failed ({type(e).__name__}: {_first_line(e)}); "
                          f"fix that module") from e


STALL_S = 10.0
"""A reward call running longer than this is reported (every STALL_S seconds) naming the sample."""


def score_responses(fn: RewardFn, responses: list[str], ground_truths: list[str],
                    on_error: str = "raise", who: str | None = None,
                    infos: list[SampleInfo] | None = None) -> tuple[list[float], int]:
    """Scores for every (response, ground truth) pair and the number of failed samples scored 0, in this process.
    ``who`` names the function in messages (``RewardScorer.who``; default: its module and name); ``infos``: each
    sample's ``(data_source, extra_info JSON)`` for a function that takes them (``call.call_reward``).

    A failure is an exception from ``fn``, a return value that is not a number
    (a mapping with a ``"score"`` key, as verl reward functions may return, is
    accepted), or a NaN/inf score. A call still running after ``STALL_S`` is
    reported on stderr; it cannot be abandoned here (``RewardScorer`` with workers can).
    """
    _check_args(on_error, responses, ground_truths, infos)
    who = who or describe_fn(fn)
    scores: list[float] = []
    num_failed = 0
    current = [0, time.monotonic()]  # the sample being scored and since when, for the stall reporter
    with _StallReporter(who, responses, ground_truths, current):
        for i, (response, truth) in enumerate(zip(responses, ground_truths)):
            current[:] = [i, time.monotonic()]
            try:
                score = score_one(fn, response, truth, infos[i] if infos is not None else None)
            except Exception as e:
                if on_error == "raise":
                    raise RewardError(_failed_message(who, i, f"{type(e).__name__}: {_first_line(e)}", response, truth)) from e
                score = 0.0
                num_failed += 1
            scores.append(score)
    return scores, num_failed


def _check_args(on_error: str, responses: list[str], ground_truths: list[str],
                infos: list[SampleInfo] | None = None) -> None:
    if on_error not in ("raise", "zero"):
        raise RewardError(f"reward.on_error={on_error!r} must be 'raise' or 'zero'")
    if len(responses) != len(ground_truths):
        raise ValueError(f"score_responses got {len(responses)} responses but {len(ground_truths)} ground truths")
    if infos is not None and len(infos) != len(responses):
        raise ValueError(f"score_responses got {len(responses)} responses but {len(infos)} sample infos")


def _failed_message(who: str, i: int, what: str, response: str, truth: str) -> str:
    return (f"{who} failed on sample {i} ({what}); "
            f"response={_short(response)!r}, ground_truth={_short(truth)!r}; fix the function, or set "
            f"reward.on_error=zero to score such samples 0 and count them")


def _timeout_message(who: str, i: int, timeout_s: float, response: str, truth: str) -> str:
    return (f"{who} did not return within reward.timeout_s={timeout_s:g} on sample {i} "
            f"(response={_short(response)!r}, ground_truth={_short(truth)!r}); the call was abandoned: fix the hang "
            f"or make it faster, raise reward.timeout_s, or set reward.on_error=zero to score such samples 0 and count them")


def _stall_message(who: str, i: int, running_s: float, done: int, total: int, timeout_s: float, in_process: bool,
                   response: str, truth: str) -> str:
    if timeout_s > 0:
        limit = f"reward.timeout_s={timeout_s:g} abandons it at {timeout_s:g} s"
    elif in_process:
        limit = ("no time limit: it runs in the training process (a built-in, or reward.num_workers=0), where a call "
                 "cannot be abandoned")
    else:
        limit = "no time limit (reward.timeout_s=0); set reward.timeout_s to abandon such calls"
    return (f"warning: {who} has been running for {running_s:.0f} s on sample {i} "
            f"(response={_short(response)!r}, ground_truth={_short(truth)!r}; {done}/{total} samples scored); {limit}")


class _StallReporter:
    """In-process scoring: a thread that reports the sample ``current`` = [index, since] every ``STALL_S``."""

    def __init__(self, who: str, responses: list[str], truths: list[str], current: list):
        self.args = who, responses, truths, current
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "_StallReporter":
        self._thread = threading.Thread(target=self._run, name="hybrid_rl-reward-stall", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()

    def _run(self) -> None:
        who, responses, truths, current = self.args
        reported = (-1, 0)
        while not self._done.wait(STALL_S / 4):
            i, since = current
            running = time.monotonic() - since
            times = int(running // STALL_S)
            if times >= 1 and (i, times) != reported and not self._done.is_set():
                reported = (i, times)
                console_line(_stall_message(who, i, running, i, len(responses), 0.0, True, responses[i], truths[i]))


class RewardScorer:
    """``reward.*`` resolved once: scores a batch in this process or in worker processes, with the timeout.

    ``num_workers=-1`` (auto): a user function (``module:function``, ``file.py:function``) runs in
    ``worker_count`` processes, a built-in in this process. Scores and their order are the same either way.
    """

    def __init__(self, function: str = "auto", task: str = "gsm8k", on_error: str = "raise", timeout_s: float = 30.0,
                 num_workers: int = -1):
        if timeout_s < 0:
            raise RewardError(f"reward.timeout_s={timeout_s} must be >= 0 seconds (0 = no limit)")
        if num_workers < -1:
            raise RewardError(f"reward.num_workers={num_workers} must be -1 (auto), 0 (this process) or a number of processes")
        self.fn = get_reward_fn(function, task)  # a bad reward.function fails here, in the parent, at start-up
        self.who = reward_label(function, task)
        """How messages name the function: the key and the value the user wrote (``reward.function='f.py:score'``)."""
        self.on_error, self.timeout_s = on_error, timeout_s
        builtin = function == "auto" or function in BUILTIN_REWARDS
        in_process = builtin and resolve_name(function, task) not in POOLED_BUILTINS
        workers = worker_count(num_workers) if not (num_workers == -1 and in_process) else 0
        self.pool: RewardPool | None = None
        self._lock = threading.Lock()  # one batch at a time through the pool
        if workers > 0:
            self.pool = RewardPool(self._fn_ref(function, task, builtin, num_workers), workers)

    @classmethod
    def from_config(cls, reward_cfg: Any, task: str) -> "RewardScorer":
        r = reward_cfg
        return cls(r.function, task, r.on_error, r.timeout_s, r.num_workers)

    def _fn_ref(self, function: str, task: str, builtin: bool, num_workers: int) -> tuple:
        if not builtin:
            module, _, attr = function.rpartition(":")
            if module.endswith(".py"):  # workers start in this directory, but a later chdir must not matter
                function = f"{Path(module).expanduser().resolve()}:{attr}"
            return ("spec", function, task)
        try:
            pickle.dumps(self.fn)
        except Exception as e:
            raise RewardError(f"reward.num_workers={num_workers} sends the reward function to worker processes, but "
                              f"{self.who} cannot be sent ({type(e).__name__}: {_first_line(e)}); define it at "
                              f"module level, or set reward.num_workers=0 to score in this process") from e
        return ("object", self.fn)

    def score(self, responses: list[str], ground_truths: list[str], on_error: str | None = None,
              infos: list[SampleInfo] | None = None) -> tuple[list[float], int]:
        """Scores for every pair and the number of failed samples scored 0 (``reward.on_error=zero``); ``infos``:
        each sample's ``(data_source, extra_info JSON)``."""
        on_error = on_error or self.on_error
        if self.pool is None:
            return score_responses(self.fn, responses, ground_truths, on_error, self.who, infos)
        _check_args(on_error, responses, ground_truths, infos)
        failed = [0]

        def on_failure(f: PoolFailure) -> None:
            r, t = responses[f.index], ground_truths[f.index]
            if on_error == "raise":
                msg = (_timeout_message(self.who, f.index, self.timeout_s, r, t) if f.timed_out
                       else _failed_message(self.who, f.index, f.detail, r, t))
                raise RewardError(msg)
            failed[0] += 1

        def on_stall(i: int, running: float, done: int, total: int) -> None:
            console_line(_stall_message(self.who, i, running, done, total, self.timeout_s, False, responses[i],
                                        ground_truths[i]))

        with self._lock:
            try:
                scores = self.pool.score(responses, ground_truths, self.timeout_s, on_failure, on_stall, STALL_S, infos)
            except WorkerInitError as e:
                raise RewardError(f"{self.who} could not be loaded in a reward worker process "
                                  f"({e}); make it importable from a fresh Python (module level, on PYTHONPATH), or set "
                                  f"reward.num_workers=0 to score in the training process") from None
        return scores, failed[0]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def reward_label(function: str, task: str) -> str:
    """``reward.function`` as the user wrote it, for messages; ``auto`` adds the task's reward it stands for."""
    if function == "auto" and task in TASKS:
        return f"reward.function='auto' (the {task} task's {TASKS[task].default_reward!r})"
    return f"reward.function={function!r}"


def describe_fn(fn: Any) -> str:
    """A bare reward function (given as an object, not through ``reward.function``) for messages."""
    return f"reward function {_fn_name(fn)}"


def console_line(msg: str) -> None:
    """A warning on stderr on a line of its own, above the progress bar when one is drawn (``tqdm.write``)."""
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)
    sys.stderr.flush()


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
