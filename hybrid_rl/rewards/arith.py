"""Reward for the arithmetic task: the exact integer answer.

The rule: a response's answer is the **last number** in it (an optional minus sign; thousands separators
``1,234`` allowed; a trailing period is punctuation), and it scores 1.0 when that number is an integer equal to
the ground truth, else 0.0. So ``82``, ``The answer is 82.`` and ``37 + 45 = 82`` all score 1.0, while ``82.5``,
``82 or 83`` and a response with no number score 0.0. ``strict`` accepts only a response that is the number and
nothing else (surrounding whitespace and one trailing period allowed): the form the prompt asks for, logged as
``reward/format_exact`` beside the score. Left out: spelled-out numbers ("eighty-two"), fractions and units.
"""

from __future__ import annotations

import re
from typing import Literal, Optional

_NUM_RE = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_EXACT_RE = re.compile(r"\s*(-?(?:\d{1,3}(?:,\d{3})+|\d+))\.?\s*")


def extract_integer(text: str, method: Literal["strict", "flexible"] = "flexible") -> Optional[int]:
    """The response's integer answer under the rule above, or None (no number, or not an integer)."""
    text = text.replace("\u2212", "-")  # a Unicode minus sign, as some tokenizers decode it
    if method == "strict":
        m = _EXACT_RE.fullmatch(text)
        return int(m.group(1).replace(",", "")) if m else None
    if method != "flexible":
        raise ValueError(f"extract_integer method must be 'strict' or 'flexible', got {method!r}")
    numbers = _NUM_RE.findall(text)
    if not numbers:
        return None
    whole, _, frac = numbers[-1].replace(",", "").partition(".")
    if frac.strip("0"):
        return None  # 82.5 is not an integer answer
    return int(whole)


def compute_score(response: str, ground_truth: str) -> float:
    """1.0 when the response's last number is the integer ``ground_truth``, else 0.0."""
    answer = extract_integer(response)
    return 1.0 if answer is not None and answer == int(ground_truth) else 0.0


def compute_score_strict(response: str, ground_truth: str) -> float:
    """1.0 only for a response that is exactly the number (whitespace and a trailing period allowed)."""
    answer = extract_integer(response, "strict")
    return 1.0 if answer is not None and answer == int(ground_truth) else 0.0
