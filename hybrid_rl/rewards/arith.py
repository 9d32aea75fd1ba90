"""Reward for the arithmetic task: the exact integer answer.

The rule: a response's answer is the **last number** in it (``hybrid_rl.data.answers.extract_integer``: an optional
minus sign; thousands separators ``1,234`` allowed; a trailing period is punctuation), and it scores 1.0 when that
number is an integer equal to the ground truth, else 0.0. So ``82``, ``The answer is 82.`` and ``37 + 45 = 82``
all score 1.0, while ``82.5``, ``82 or 83`` and a response with no number score 0.0. ``strict`` accepts only a response that is the number and
nothing else (surrounding whitespace and one trailing period allowed): the form the prompt asks for, logged as
``reward/format_exact`` beside the score. Left out: spelled-out numbers ("eighty-two"), fractions and units.
"""

from __future__ import annotations

from ..data.answers import extract_integer


def compute_score(response: str, ground_truth: str) -> float:
    """1.0 when the response's last number is the integer ``ground_truth``, else 0.0."""
    answer = extract_integer(response)
    return 1.0 if answer is not None and answer == int(ground_truth) else 0.0


def compute_score_strict(response: str, ground_truth: str) -> float:
    """1.0 only for a response that is exactly the number (whitespace and a trailing period allowed)."""
    answer = extract_integer(response, "strict")
    return 1.0 if answer is not None and answer == int(ground_truth) else 0.0
