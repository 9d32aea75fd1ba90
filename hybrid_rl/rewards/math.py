"""The ``math`` reward: 1.0 when the response's last ``\\boxed{}`` answer equals the ground truth mathematically.

The boxed answer (``data.answers.last_boxed``) and the ground truth are compared first as strings after a light
normalisation (spaces, ``\\left``/``\\right``, ``\\dfrac``/``\\tfrac``, a trailing period, ``\\text{}`` around a
word), then, when those differ, by math-verify (Hugging Face's LaTeX → SymPy grader, the one TRL's and Open-R1's
accuracy rewards use): ``\\frac{1}{2}`` equals ``0.5``, ``x = 3`` equals ``3``, ``(1, 2)`` an open interval,
``1,2`` the set ``{1, 2}``. A response without a closed ``\\boxed{}`` scores 0.

math-verify bounds its parsing and its comparison with ``signal.alarm`` (5 s each), which works only in a
process's main thread; this reward runs in reward worker processes by default (``reward.num_workers=-1``), where
it is, and ``reward.timeout_s`` abandons a call past it. Called from another thread, the alarm is left off.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from ..data.answers import last_boxed

MATH_VERIFY_TIMEOUT_S = 5
_SPACES = re.compile(r"\s+|\\[,;:! ]")
_TEXT_WORD = re.compile(r"\\text\{([^{}]*)\}")


def normalize(answer: str) -> str:
    """The light string normalisation both sides get before the fast compare."""
    s = _TEXT_WORD.sub(r"\1", answer)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\$", "")
    s = _SPACES.sub("", s)
    return s.rstrip(".")


def compute_score(response: str, ground_truth: str) -> float:
    """1.0 when the last ``\\boxed{}`` of ``response`` is ``ground_truth`` (a LaTeX answer, with or without its own
    ``\\boxed{}``), else 0.0."""
    answer = last_boxed(response)
    if answer is None:
        return 0.0
    truth = last_boxed(ground_truth) or ground_truth.strip()
    if normalize(answer) == normalize(truth):
        return 1.0
    return 1.0 if _equivalent(truth, answer) else 0.0


def _equivalent(truth: str, answer: str) -> bool:
    from math_verify import parse, verify

    timeout: Any = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{truth}}}", parsing_timeout=timeout)
    if not gold:  # a ground truth math-verify cannot read is compared as text (done above)
        return False
    pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
    return bool(pred) and bool(verify(gold, pred, timeout_seconds=timeout))

