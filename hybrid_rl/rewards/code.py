"""The ``code`` rewards: run the response's Python against the problem's tests in the sandbox.

The program is the last fenced code block of the response (```` ```python ```` or a bare ```` ``` ````). The
ground truth (``data.task=code`` writes it) is JSON of one of two kinds of test:

- ``{"asserts": [...]}``: Python statements run after the program in its namespace, each on its own (MBPP's
  ``test_list``); a test passes when its statement does not raise;
- ``{"cases": [{"input": ..., "output": ...}, ...]}``: the program run as ``__main__`` once per case with the
  case's standard input; a test passes when its standard output equals the expected one, line by line with
  trailing whitespace ignored (APPS, TACO, Codeforces-style problems).

All of a sample's tests run in one sandboxed interpreter (``envs/sandbox.py``: a fresh process, its own temporary
directory, an empty environment, CPU, memory, file, process and output limits, the process group killed after
``LIMITS.timeout_s``); a program that hangs or crashes the interpreter fails every test. The harness reports the
results on a line tagged with a random nonce; a program would have to read the harness's own source to forge it.
``code`` is 1.0 when every test passes (DeepCoder's and verl's sparse reward), ``code_fraction`` the share passed.

Not a security boundary (``envs/sandbox.py`` says what it leaves open); for untrusted code at scale use a sandbox
service through a reward function of your own.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

LIMITS = dict(timeout_s=10.0, cpu_s=8, memory_mb=1024, max_output_bytes=1 << 20)
"""What one sample's program and all its tests may use together (``envs.sandbox.SandboxLimits``)."""
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.S | re.I)

_HARNESS = r'''
import io, json, sys
_SRC = {src!r}
_TESTS = json.loads({tests!r})
_REAL_OUT = sys.stdout
_results = []
def _norm(s):
    return [line.rstrip() for line in s.strip().splitlines()]
if "asserts" in _TESTS:
    _ns = {{"__name__": "__solution__"}}
    try:
        sys.stdout = io.StringIO()
        exec(compile(_SRC, "solution.py", "exec"), _ns)
        _loaded = True
    except BaseException:
        _loaded = False
    for _t in _TESTS["asserts"]:
        ok = False
        if _loaded:
            try:
                exec(compile(_t, "test.py", "exec"), _ns)
                ok = True
            except BaseException:
                ok = False
        _results.append(ok)
else:
    _code = compile(_SRC, "solution.py", "exec")
    for _case in _TESTS["cases"]:
        sys.stdin = io.StringIO(str(_case["input"]))
        _buf = io.StringIO()
        sys.stdout = _buf
        try:
            exec(_code, {{"__name__": "__main__"}})
            ran = True
        except SystemExit as e:
            ran = e.code in (None, 0)
        except BaseException:
            ran = False
        _results.append(ran and _norm(_buf.getvalue()) == _norm(str(_case["output"])))
sys.stdout = _REAL_OUT
print({tag!r} + json.dumps(_results))
'''


def extract_code(response: str) -> str | None:
    """The last fenced code block of ``response`` (a ```python or bare ``` fence), or None."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else None


def normalize_tests(raw: Any) -> dict[str, list] | None:
    """Tests in any of the layouts datasets use, as ``{"asserts": [...]}`` or ``{"cases": [{"input", "output"}]}``:
    a list of assertion texts (MBPP's ``test_list``), one assertion, ``{"inputs": [...], "outputs": [...]}`` (APPS'
    and TACO's ``input_output``, also as JSON text), a list of ``{"input", "output"}``, or already normalised. None
    when ``raw`` is none of these."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return {"asserts": [raw]} if raw.strip() else None
    if isinstance(raw, dict) and ("asserts" in raw or "cases" in raw):
        return raw
    if isinstance(raw, dict) and isinstance(raw.get("inputs"), list) and isinstance(raw.get("outputs"), list):
        if len(raw["inputs"]) != len(raw["outputs"]) or not raw["inputs"]:
            return None
        return {"cases": [{"input": _io_text(i), "output": _io_text(o)} for i, o in zip(raw["inputs"], raw["outputs"])]}
    if isinstance(raw, list) and raw and all(isinstance(t, dict) and "input" in t and "output" in t for t in raw):
        return {"cases": [{"input": _io_text(t["input"]), "output": _io_text(t["output"])} for t in raw]}
    if isinstance(raw, list) and raw and all(isinstance(t, str) and t.strip() for t in raw):
        return {"asserts": list(raw)}
    return None


def _io_text(value: Any) -> str:
    """A case's input or output as text (APPS keeps some as lists of lines)."""
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def run_tests(response: str, ground_truth: str) -> list[bool]:
    """Whether each test of ``ground_truth`` passed with the response's program (all False without one)."""
    tests = normalize_tests(ground_truth)
    if tests is None:
        raise ValueError(f"the ground truth is not tests the code reward can run ({ground_truth[:80]!r}); give "
                         f"assertions or input/output cases (rewards/code.py)")
    n = len(tests.get("asserts", tests.get("cases", [])))
    code = extract_code(response)
    if code is None or n == 0:
        return [False] * n
    tag = f"__hybrid_rl_results_{secrets.token_hex(16)}__"
    script = _HARNESS.format(src=code, tests=json.dumps(tests), tag=tag)
    try:
        compile(code, "solution.py", "exec")
    except (SyntaxError, ValueError):
        return [False] * n
    from ..envs.sandbox import SandboxLimits, run_python  # the envs package only where a program runs

    result = run_python(script, limits=SandboxLimits(**LIMITS))
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(tag):
            passed = json.loads(line[len(tag):])
            return [bool(p) for p in passed] if len(passed) == n else [False] * n
    return [False] * n


def compute_score(response: str, ground_truth: str) -> float:
    """1.0 when the response's program passes every test, else 0.0."""
    results = run_tests(response, ground_truth)
    return 1.0 if results and all(results) else 0.0


def compute_score_fraction(response: str, ground_truth: str) -> float:
    """The share of the tests the response's program passes."""
    results = run_tests(response, ground_truth)
    return sum(results) / len(results) if results else 0.0
