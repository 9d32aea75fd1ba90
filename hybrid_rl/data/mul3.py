"""Three-digit by three-digit multiplication with a held-out test set (``synthetic:mul3``): a calculator's task.

``What is 482 * 317?``: both factors in 100-999, so the product has five or six digits, beyond what a 135M model
computes unaided and one ``calculator`` call away. **Train and test never share a problem**: a problem's identity
is its unordered pair of factors (``482 * 317`` and ``317 * 482`` are one problem), and a fixed hash of that pair
puts a tenth of all pairs in the test split, so no seed or row count can leak a test problem into training in
either order. The test set is the same for every run (its own seed, ``TEST_SIZE`` distinct pairs, each in a random
order); training rows are drawn with replacement from the other pairs, in either order.

Rows are plain dicts (``question``, ``answer``); ``Mul3Task`` in ``tasks.py`` turns them into chat prompts and
scores them with the exact-integer reward. Left out: other sizes (``data.arith`` has one-digit times two-digit).
"""

from __future__ import annotations

import hashlib

import numpy as np

LOW, HIGH = 100, 999
TEST_BUCKETS = 10
"""A pair is held out when the hash of its identity is 0 modulo this: a tenth of the pairs."""
TEST_SEED = 20260303
TEST_SIZE = 1000
"""Problems in the fixed test set (``data.val_path: synthetic:mul3``; ``data.max_val_samples`` takes a prefix)."""


def identity(a: int, b: int) -> tuple[int, int]:
    """The problem ``a * b`` is: its unordered pair of factors."""
    return (a, b) if a <= b else (b, a)


def is_held_out(a: int, b: int) -> bool:
    """Whether ``a * b`` (in either order) belongs to the test split; a fixed hash, the same on every machine."""
    lo, hi = identity(a, b)
    digest = hashlib.sha256(f"mul3:{lo}:{hi}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0


def row(a: int, b: int) -> dict[str, object]:
    return {"question": f"What is {a} * {b}?", "answer": a * b, "a": a, "b": b}


def _draw(rng: np.random.Generator, count: int, held_out: bool, distinct: bool) -> list[dict[str, object]]:
    rows, seen = [], set()
    while len(rows) < count:
        a, b = (int(x) for x in rng.integers(LOW, HIGH + 1, size=2))
        if is_held_out(a, b) != held_out or distinct and identity(a, b) in seen:
            continue
        seen.add(identity(a, b))
        rows.append(row(a, b))
    return rows


def training_rows(num: int, seed: int) -> list[dict[str, object]]:
    """``num`` training problems (with replacement, never a test pair in either order), seeded."""
    if num <= 0:
        raise ValueError(f"data.num_synthetic={num} must be a positive number of rows")
    return _draw(np.random.default_rng(seed), num, held_out=False, distinct=False)


def held_out_rows() -> list[dict[str, object]]:
    """The fixed test set: ``TEST_SIZE`` distinct held-out pairs."""
    return _draw(np.random.default_rng(TEST_SEED), TEST_SIZE, held_out=True, distinct=True)
