"""Reward for the synthetic successor task (show digit d, answer ``(d + 1) % 10``).

The score is 1.0 for exactly the right digit and 0.0 for anything else. No
format shaping on purpose: on the tiny model a 0.1 bonus for "any single
digit" makes GRPO collapse onto one constant digit within ~30 steps (entropy
→ 0, reward stuck near 0.2), while the plain 0/1 reward explores long enough
to learn the prompt-conditional mapping. Left out: any tolerance for
extra text ("8." or "the answer is 8" score 0). Responses must be decoded
without special tokens (``skip_special_tokens``).
"""

from __future__ import annotations


def compute_score(response: str, ground_truth: str) -> float:
    """1.0 for exactly the ground-truth digit, else 0.0."""
    return 1.0 if response.strip() == ground_truth.strip() else 0.0
