"""Reading a task's final answer out of a model response, in the formats the task prompts ask for.

The tasks count how responses are shaped (``Task.answer_stats``) and the rewards score them, from the same readers.

GSM8K, ``extract_answer``: ``strict`` accepts only a ``#### <number>`` line (the format the GSM8K prompt asks for;
the line may add units, a ``$``, bold or a trailing period, but a markdown heading such as ``#### 2. Final step`` is
not an answer), ``flexible`` also accepts ``\\boxed{...}``, "the answer is X", and finally the last number anywhere in
the text, because instruct models often ignore the requested format. Where the answer is an expression ("the answer
is 12 * 3 = 36", ``\\boxed{x = 5}``) its result, the number after the last ``=``, is taken. Left out: fractions,
LaTeX arithmetic and spelled-out numbers ("eighteen"), which GSM8K answers never need.

Arithmetic, ``extract_integer``: the answer is the **last number** in the response (an optional minus sign;
thousands separators ``1,234`` allowed; a trailing period is punctuation), and only if it is an integer (``82.5``
is no answer). ``strict`` accepts only a response that is the number and nothing else (surrounding whitespace and
one trailing period allowed): the form the prompt asks for. Left out: spelled-out numbers ("eighty-two"),
fractions and units.

Competition math, ``last_boxed``: the LaTeX inside the response's last ``\\boxed{}``, compared with the ground truth
by ``hybrid_rl.rewards.math``.
"""

from __future__ import annotations

import re
from typing import Literal, Optional

# --------------------------------------------------------------------------- GSM8K
# One number as written in prose: optional sign and dollar sign (either order),
# thousands separators only in groups of three (so "1, 2, 3" stays three
# numbers), optional decimals. The look-behind stops "x2" or "10-3" from
# yielding "2" or "-3": a number must not continue a word, and a minus counts as
# a sign only when it does not follow a digit.
_NUM = r"(?<![\w.])(?:-\$?|\$-?)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUM_RE = re.compile(_NUM)
# The strict form: "#### <number>" and nothing else on the line but optional bold, a % sign, up to three
# lower-case unit words ("18 eggs", "5 per hour") and a trailing period. A markdown heading such as
# "#### 2. Final step" is not an answer.
_STRICT_RE = re.compile(r"(?m)####[ \t]*[*_]*[ \t]*(" + _NUM + r")[ \t]*%?[*_]*(?:[ \t]+[a-z][a-z/-]*){0,3}"
                        r"[ \t]*\.?[*_]*[ \t\r]*$")
# "the answer is <expression>": a number, optionally followed by arithmetic and "= result" steps, so that
# "12 * 3 = 36" answers with 36 (the number after the last "="), not with its first operand.
_OP = r"(?:[-+*/×÷·=x]|\\times|\\cdot|\\div)"
_ANSWER_IS_RE = re.compile(r"(?i)\banswer\b(?:\s+is)?[\s:=*]*(" + _NUM + r"(?:[ \t]*" + _OP + r"[ \t]*" + _NUM + ")*)")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_NUM_RE = re.compile(r"(" + _NUM + r")[^\d]*$")
# LaTeX that wraps or decorates a number inside \boxed{}: \text{...} units, \$,
# thin spaces "\," and the "{,}" thousands separator.
_LATEX_NOISE = [(re.compile(r"\\text\{[^{}]*\}"), " "), (re.compile(r"\\[$%]"), lambda m: m.group(0)[1]),
                (re.compile(r"\{,\}"), ","), (re.compile(r"\\[,;!]"), "")]


def extract_answer(text: str, method: Literal["strict", "flexible"] = "flexible") -> Optional[str]:
    """The final answer in ``text`` as a plain number string (``"$1,000"`` → ``"1000"``), or None."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"extract_answer method must be 'strict' or 'flexible', got {method!r}")
    text = text.replace("\u2212", "-")  # a Unicode minus sign, as some tokenizers decode it
    strict = _STRICT_RE.findall(text)
    if strict:
        return _clean(strict[-1])
    if method == "strict":
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    answer_is = _ANSWER_IS_RE.findall(text)
    if answer_is:
        return _clean(_NUM_RE.search(answer_is[-1].rpartition("=")[2]).group(0))
    numbers = _NUM_RE.findall(text)
    return _clean(numbers[-1]) if numbers else None


def _clean(number: str) -> str:
    negative = "-" in number
    digits = number.replace("$", "").replace(",", "").replace("-", "").strip()
    return "-" + digits if negative else digits


def last_boxed(text: str) -> Optional[str]:
    """The LaTeX inside the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text``, braces balanced, stripped;
    None when there is none or it is not closed (a response cut off inside the box)."""
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    if not starts:
        return None
    start = starts[-1]
    depth, i = 1, start
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    if depth:
        return None
    return text[start:i - 1].strip()


def _last_boxed(text: str) -> Optional[str]:
    content = last_boxed(text)
    if content is None:
        return None
    for pattern, repl in _LATEX_NOISE:
        content = pattern.sub(repl, content)
    content = content.replace("\u2212", "-").strip()
    # "x = 5" answers with its right-hand side; "18 dollars" with its number.
    # Anything else ("\\frac{1}{2}", "x+1") is returned whole for a string
    # compare rather than guessing which of its digits is the answer.
    value = content.rpartition("=")[2].strip()
    number = _BOXED_NUM_RE.match(value)
    if number:
        return _clean(number.group(1))
    return content or None


# --------------------------------------------------------------------------- arithmetic
_INT_RE = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_EXACT_INT_RE = re.compile(r"\s*(-?(?:\d{1,3}(?:,\d{3})+|\d+))\.?\s*")


def extract_integer(text: str, method: Literal["strict", "flexible"] = "flexible") -> Optional[int]:
    """The response's integer answer under the rule above, or None (no number, or not an integer)."""
    text = text.replace("\u2212", "-")  # a Unicode minus sign, as some tokenizers decode it
    if method == "strict":
        m = _EXACT_INT_RE.fullmatch(text)
        return int(m.group(1).replace(",", "")) if m else None
    if method != "flexible":
        raise ValueError(f"extract_integer method must be 'strict' or 'flexible', got {method!r}")
    numbers = _INT_RE.findall(text)
    if not numbers:
        return None
    whole, _, frac = numbers[-1].replace(",", "").partition(".")
    if frac.strip("0"):
        return None  # 82.5 is not an integer answer
    return int(whole)
