"""GSM8K scoring: the final number of a response against the ground truth.

The answer is read by ``hybrid_rl.data.answers.extract_answer`` (``strict``: a
``#### <number>`` line only; ``flexible``: also ``\\boxed{...}``, "the answer is
X", and finally the last number in the text). ``compute_score`` uses
``flexible`` by default (verl's own GSM8K reward defaults to strict; pass
``method="strict"`` to match it). Numbers are compared as floats, so
``$1,000.00`` matches ``1000``. Left out: partial credit for format (the score
is 0 or 1).
"""

from __future__ import annotations

import math
import re
from typing import Literal, Optional

from ..data.answers import extract_answer


def compute_score(response: str, ground_truth: str, method: Literal["strict", "flexible"] = "flexible") -> float:
    """1.0 when the extracted answer equals ``ground_truth`` (numerically when both are numbers), else 0.0."""
    answer = extract_answer(response, method)
    if answer is None:
        return 0.0
    a, b = _to_float(answer), _to_float(ground_truth)
    if a is not None and b is not None:
        # an absolute tolerance only: "18.0" answers "18", but 192,000,001 does not answer 192,000,000
        return 1.0 if abs(a - b) <= 1e-6 else 0.0
    return 1.0 if _norm(answer) == _norm(ground_truth) else 0.0


def _to_float(text: str) -> Optional[float]:
    t = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = float(t)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _norm(text: str) -> str:
    return re.sub(r"[\s$,]", "", text).rstrip(".").lower()
