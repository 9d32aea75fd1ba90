"""Reward for the synthetic successor task (show digit d, answer ``(d + 1) % 10``).

The score is 1.0 for the right digit, 0.1 for any other single digit, and 0.0
for anything else. The 0.1 is format shaping: a randomly initialised model
first emits arbitrary characters, and rewarding "answered with one digit"
gives GRPO a gradient towards the answer format even in groups where no sample
is right yet; it is small enough that the right digit always dominates. Left
out: any tolerance for extra text ("8." or "the answer is 8" score 0), because
the point of the task is a crisp signal a tiny model can learn quickly.
Responses must be decoded without special tokens (``skip_special_tokens``).
"""

from __future__ import annotations

FORMAT_BONUS = 0.1


def compute_score(response: str, ground_truth: str) -> float:
    """1.0 for exactly the ground-truth digit, 0.1 for another single digit, else 0.0."""
    answer = response.strip()
    if answer == ground_truth.strip():
        return 1.0
    if len(answer) == 1 and answer in "0123456789":
        return FORMAT_BONUS
    return 0.0
