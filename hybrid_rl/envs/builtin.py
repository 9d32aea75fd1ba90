"""The built-in tools, ``calculator`` (arithmetic, evaluated safely), ``python`` (a snippet run in the subprocess
sandbox of ``sandbox.py``, Linux only) and ``lookup`` (a value hidden in the row), and the ``lookup`` environment
that scores the lookup task.

``calculator`` parses the expression with ``ast`` and evaluates only numbers, parentheses and the arithmetic
operators (``+ - * / // % **``, unary ``+ -``): no names, calls or attributes, so nothing but arithmetic can run,
and powers and integer sizes are bounded so that ``9**9**9`` is an error instead of a hang. ``lookup`` returns the
``value`` the task keeps for the environment in the row (``env_info``; the ``lookup`` task hides its answer there),
so that the reward can only be earned by calling it; ``LookupEnv`` (``env.name=lookup``) pays for the
answer only after the tool revealed it. All are registered by path (``tools.py``, ``base.py``); this module is
imported when a run names one. Left out: functions (``sqrt``, ``sin``) and variables.
"""

from __future__ import annotations

import ast
import math
import operator

from hybrid_rl.envs.base import EnvRow, StepResult
from hybrid_rl.envs.calls import Call
from hybrid_rl.envs.sandbox import SandboxResult, run_python
from hybrid_rl.envs.tool_env import ToolEnv
from hybrid_rl.envs.tools import tool

MAX_INT_BITS = 4096
"""Integers beyond this size (about 1,200 digits) are refused: a product chain must not eat the host's memory."""
MAX_EXPONENT = 1024
MAX_EXPRESSION_CHARS = 500

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression``; ValueError naming what is not allowed (or ZeroDivisionError)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression.strip()[:80]!r} is not an arithmetic expression") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponents above {MAX_EXPONENT} are not allowed")
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0 and \
                left.bit_length() * right > MAX_INT_BITS:
            raise ValueError("the result is too large")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
            raise ValueError("the result is too large")
        if isinstance(value, complex):
            raise ValueError("the result is not a real number")
        return value
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


def format_number(value: int | float) -> str:
    """An integer as is; a float with at most 12 significant digits, without a trailing ``.0``."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not finite")
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return its value.

    Args:
        expression: The expression, with numbers, + - * / // % ** and parentheses, e.g. 123*456.
    """
    return format_number(evaluate(expression))


@tool
def python(code: str) -> SandboxResult:
    """Run a short Python program (standard library only) and return what it prints.

    Args:
        code: The program; print the values you need, e.g. print(123*456).
    """
    return run_python(code)


@tool
def lookup(row: EnvRow) -> str:
    """Look up the hidden value of this question."""
    if "value" not in row.info:
        raise KeyError(f"row {row.index} has no hidden value (its task keeps none)")
    return str(row.info["value"])


class LookupEnv(ToolEnv):
    """``ToolEnv`` that scores the ``lookup`` task: 1 for an answer equal to the row's ground truth once a ``lookup``
    call revealed it in this trajectory, else 0. A guess earns nothing, even a right one: the value is only known
    through the tool (with ``env.tools=[]`` nothing can reveal it). The task's reward function is ``none``, so this
    is the whole score."""

    def __init__(self, options, fit=None):
        super().__init__(options, fit)
        self.revealed = False

    def _run(self, call: Call) -> tuple[str, list[str]]:
        text, errors = super()._run(call)
        self.revealed |= call.name == "lookup" and not errors
        return text, errors

    def step(self, turn: str) -> StepResult:
        result = super().step(turn)
        if result.done:
            result.reward = float(self.revealed and turn.strip() == self.row.ground_truth)
        return result
