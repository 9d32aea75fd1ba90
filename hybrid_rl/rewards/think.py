"""The ``think_format`` reward: 1.0 for a response shaped as reasoning in a think block, then an answer.

Shaped means: an optional ``<think>`` at the very start (a template such as R1-Zero's puts it in the prompt, so the
response begins inside the block), some reasoning, exactly one ``</think>``, then a non-empty answer, and no other
think tag anywhere. A format reward to add beside an answer's (``reward.extra_functions=[think_format]`` with a small
``reward.extra_weights``), as TRL's ``think_format_reward``.
"""

from __future__ import annotations

import re

_SHAPE = re.compile(r"\A\s*(?:<think>)?(?P<thought>.*?)</think>(?P<answer>.*)\Z", re.S)


def compute_score(response: str, ground_truth: str) -> float:
    """1.0 when ``response`` is one think block followed by an answer (the module's rule), else 0.0."""
    m = _SHAPE.match(response)
    if m is None or not m.group("thought").strip() or not m.group("answer").strip():
        return 0.0
    if "<think>" in m.group("thought") or "<think>" in m.group("answer") or "</think>" in m.group("answer"):
        return 0.0
    return 1.0
