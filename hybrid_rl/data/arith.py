"""Arithmetic problems with a held-out test set, for measuring whether RL makes a real model better at something.

Five families, each a short question with one integer answer:

- ``add``: ``What is 37 + 45?`` (two ``digits``-digit operands)
- ``sub``: ``What is 82 - 37?`` (``digits``-digit operands, the first not smaller: answers are never negative)
- ``mul``: ``What is 7 * 46?`` (a one-digit factor 2-9 and a ``digits``-digit one, in either order)
- ``max``: ``Which number is the largest: 12, 85, 33, 7, 61?`` (``list_length`` distinct numbers below 10**digits)
- ``word``: one-step word problems (``Tom has 37 apples and buys 45 more. ...``) that add, subtract or multiply

**Train and test never share a problem** (``data.arith.split: canonical``, the only split). A problem is its
*canonical identity*: the operation and its operands as that operation sees them, whatever the family, wording or
order. Addition and multiplication are commutative, so their operands count unordered (``7 * 46`` and ``46 * 7`` are
one problem); subtraction's count in order; the largest of a list is the same problem for any order of the list (a
multiset); a word problem is its underlying operation and numbers, whatever the template, names and objects (so
``Tom has 37 apples and buys 45 more`` is the problem ``37 + 45``, the same as the ``add`` family's). A fixed hash of
the canonical identity puts two in five problems in the test split (multiplication has only 720 distinct problems
at two digits: a fifth would not hold its 200 test problems and the word problems' products), so no seed, row
count or family mix can put a test problem, in any wording or order, into training. The test set is the same for
every run (its own fixed seed), distinct canonical problems, families interleaved so that any prefix is balanced
between them. Training rows are drawn with replacement from the rest, the families in turn.

Rows are plain dicts (``family``, ``question``, ``answer``); ``ArithTask`` in ``tasks.py`` turns them into chat
prompts. Left out: carries/borrows as an explicit difficulty knob, division, multi-step problems, and any split
by the problems' text or operand order (a test problem's commuted or reworded twin would be a training row).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import numpy as np

FAMILIES = ("add", "sub", "mul", "max", "word")
SPLITS = ("canonical",)
"""The train/test splits by name (``data.arith.split``): ``canonical``, by the canonical identity above."""
TEST_BUCKETS = 5
"""A problem's hash modulo this picks its bucket; ``TEST_SHARE`` of the buckets are the test split."""
TEST_SHARE = 2
"""Buckets ``0 .. TEST_SHARE - 1`` are held out: two in five canonical problems of every operation."""
TEST_SEED = 20261128
"""The test set's own seed: every run validates on the same problems."""

NAMES = ("Tom", "Anna", "Ravi", "Mia", "Lena", "Omar", "Sara", "Ken", "Ada", "Luis")
ITEMS = ("apples", "stamps", "marbles", "books", "pencils", "cards", "shells", "coins")
# (operation, question template); {n} a name, {i} plural items, {a} and {b} the numbers
WORD_TEMPLATES = (
    ("+", "{n} has {a} {i} and buys {b} more. How many {i} does {n} have now?"),
    ("+", "{n} collected {a} {i} on Monday and {b} {i} on Tuesday. How many {i} did {n} collect in all?"),
    ("-", "{n} has {a} {i} and gives {b} of them to a friend. How many {i} does {n} have left?"),
    ("-", "There are {a} {i} in a box. {n} takes out {b}. How many {i} are still in the box?"),
    ("*", "{n} buys {a} bags with {b} {i} in each bag. How many {i} does {n} buy?"),
)


@dataclass
class ArithConfig:
    families: list[str] = field(default_factory=lambda: list(FAMILIES))
    """Problem families to draw from: ``add``, ``sub``, ``mul``, ``max``, ``word``."""
    digits: int = 2
    """Digits of the operands (``mul``: of its larger factor; ``max``: numbers below 10**digits), 1-6."""
    list_length: int = 5
    """Numbers in a ``max`` problem, 2-20."""
    test_size: int = 1000
    """Held-out problems in the test set (``data.val_path: synthetic:arith``), split evenly over the families."""
    split: Literal["canonical"] = "canonical"
    """How problems are held out: ``canonical``, by operation and operands whatever their order (for + and *) or
    wording (word problems), so no training row is a test problem commuted or reworded (the module's docstring)."""


def canonical_identity(op: str, operands: tuple[int, ...]) -> tuple:
    """The problem ``op`` (``+``, ``-``, ``*``, ``max``) asks of ``operands``, as a tuple: the operands sorted for the
    commutative operations (+, *, and max, whose list is a multiset), in order for subtraction."""
    if op not in ("+", "-", "*", "max"):
        raise ValueError(f"unknown operation {op!r}")
    return (op, *(operands if op == "-" else sorted(operands)))


def problem_is_held_out(identity: tuple) -> bool:
    """Whether the problem with this canonical identity belongs to the test split (a fixed hash: the same on every
    machine and Python)."""
    digest = hashlib.blake2b(repr(identity).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % TEST_BUCKETS < TEST_SHARE


def check_config(cfg: ArithConfig, key: str = "data.arith") -> None:
    """ValueError naming the key and the fix for settings no problem can be drawn from."""
    unknown = [f for f in cfg.families if f not in FAMILIES]
    if unknown or not cfg.families:
        raise ValueError(f"{key}.families={cfg.families}: use a non-empty list of {list(FAMILIES)}")
    if len(set(cfg.families)) != len(cfg.families):
        raise ValueError(f"{key}.families={cfg.families} names a family twice; list each once")
    if not 1 <= cfg.digits <= 6:
        raise ValueError(f"{key}.digits={cfg.digits} must be 1-6")
    if not 2 <= cfg.list_length <= 20:
        raise ValueError(f"{key}.list_length={cfg.list_length} must be 2-20")
    if "max" in cfg.families and cfg.list_length > 10 ** cfg.digits - 1:
        raise ValueError(f"{key}.list_length={cfg.list_length} distinct numbers below {10 ** cfg.digits} do not exist; "
                         f"raise {key}.digits or lower {key}.list_length")
    if cfg.split not in SPLITS:
        raise ValueError(f"{key}.split={cfg.split!r} is not a split; use one of {list(SPLITS)}")
    if cfg.test_size < len(cfg.families):
        raise ValueError(f"{key}.test_size={cfg.test_size} must be at least one problem per family "
                         f"({len(cfg.families)})")


def _operand(rng: np.random.Generator, digits: int) -> int:
    return int(rng.integers(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits))


def _add(rng: np.random.Generator, cfg: ArithConfig) -> tuple[tuple, str, int]:
    a, b = _operand(rng, cfg.digits), _operand(rng, cfg.digits)
    return canonical_identity("+", (a, b)), f"What is {a} + {b}?", a + b


def _sub(rng: np.random.Generator, cfg: ArithConfig) -> tuple[tuple, str, int]:
    a, b = sorted((_operand(rng, cfg.digits), _operand(rng, cfg.digits)), reverse=True)
    return canonical_identity("-", (a, b)), f"What is {a} - {b}?", a - b


def _mul(rng: np.random.Generator, cfg: ArithConfig) -> tuple[tuple, str, int]:
    small, big = int(rng.integers(2, 10)), _operand(rng, cfg.digits)
    a, b = (small, big) if rng.integers(2) else (big, small)
    return canonical_identity("*", (a, b)), f"What is {a} * {b}?", a * b


def _max(rng: np.random.Generator, cfg: ArithConfig) -> tuple[tuple, str, int]:
    nums = [int(x) + 1 for x in rng.choice(10 ** cfg.digits - 1, size=cfg.list_length, replace=False)]
    question = f"Which number is the largest: {', '.join(map(str, nums))}?"
    return canonical_identity("max", tuple(nums)), question, max(nums)


def _word(rng: np.random.Generator, cfg: ArithConfig) -> tuple[tuple, str, int]:
    t = int(rng.integers(len(WORD_TEMPLATES)))
    op, template = WORD_TEMPLATES[t]
    if op == "*":
        a, b = int(rng.integers(2, 10)), _operand(rng, cfg.digits)
        answer = a * b
    else:
        a, b = _operand(rng, cfg.digits), _operand(rng, cfg.digits)
        if op == "-":
            a, b = max(a, b), min(a, b)
        answer = a + b if op == "+" else a - b
    text = template.format(n=NAMES[int(rng.integers(len(NAMES)))], i=ITEMS[int(rng.integers(len(ITEMS)))], a=a, b=b)
    return canonical_identity(op, (a, b)), text, answer


DRAW: dict[str, Callable[[np.random.Generator, ArithConfig], tuple[tuple, str, int]]] = {
    "add": _add, "sub": _sub, "mul": _mul, "max": _max, "word": _word}


def _row(family: str, question: str, answer: int) -> dict[str, Any]:
    return {"family": family, "question": question, "answer": str(answer)}


def training_rows(num: int, seed: int, cfg: ArithConfig) -> list[dict[str, Any]]:
    """``num`` training rows (families in turn), none of them a test problem; duplicates allowed."""
    check_config(cfg)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(num):
        family = cfg.families[i % len(cfg.families)]
        while True:  # three in five draws are training problems
            identity, question, answer = DRAW[family](rng, cfg)
            if not problem_is_held_out(identity):
                break
        rows.append(_row(family, question, answer))
    return rows


def held_out_rows(cfg: ArithConfig) -> list[dict[str, Any]]:
    """The held-out test set: ``cfg.test_size`` problems of distinct canonical identities (across families too: a word
    problem is never an ``add`` test problem reworded), the families in turn (the same for every run)."""
    check_config(cfg)
    rng = np.random.default_rng(TEST_SEED)
    per_family = {f: [] for f in cfg.families}
    seen: set[tuple] = set()
    for k, family in enumerate(cfg.families):
        want = cfg.test_size // len(cfg.families) + (k < cfg.test_size % len(cfg.families))
        tries = 0
        while len(per_family[family]) < want and tries < 200 * want * TEST_BUCKETS:  # gives up when they run out
            tries += 1
            identity, question, answer = DRAW[family](rng, cfg)
            if problem_is_held_out(identity) and identity not in seen:
                seen.add(identity)
                per_family[family].append(_row(family, question, answer))
        if len(per_family[family]) < want:
            raise ValueError(f"data.arith.test_size={cfg.test_size} asks for {want} held-out {family!r} problems, but "
                             f"data.arith.digits={cfg.digits} leaves only {len(per_family[family])}; lower "
                             f"data.arith.test_size or raise data.arith.digits")
    width = max(len(v) for v in per_family.values())
    return [rows[i] for i in range(width) for rows in per_family.values() if i < len(rows)]
