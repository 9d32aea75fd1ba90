"""The ``code`` task and rewards: programs run against their tests in the sandbox.

Every expected score here follows from the programs as written (which are right, which are wrong, which hang),
not from running the reward first."""

from __future__ import annotations

import json

import pytest

from hybrid_rl.data.tasks import CODE_INSTRUCTION, TASKS, DataError
from hybrid_rl.rewards import RewardScorer
from hybrid_rl.rewards.code import compute_score, compute_score_fraction, extract_code, run_tests

ASSERTS = json.dumps({"asserts": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 5) == 7"]})
CASES = json.dumps({"cases": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7", "output": "12"},
                              {"input": "0 0", "output": "0"}]})


def _block(code: str, lang: str = "python") -> str:
    return f"Here is my solution.\n```{lang}\n{code}\n```\nDone."


@pytest.mark.parametrize("response, truth, results", [
    (_block("def add(a, b):\n    return a + b"), ASSERTS, [True, True, True]),
    (_block("def add(a, b):\n    return 3"), ASSERTS, [True, False, False]),           # right on the shown test only
    (_block("def add(a, b):\n    return a - -b", lang=""), ASSERTS, [True, True, True]),  # a bare fence
    (_block("def add(a, b):\n    return a + b\nprint('noise')"), ASSERTS, [True, True, True]),
    (_block("import sys\nsys.exit(3)"), ASSERTS, [False, False, False]),           # never defines add
    (_block("def add(a, b) return a"), ASSERTS, [False, False, False]),             # a syntax error
    ("def add(a, b):\n    return a + b", ASSERTS, [False, False, False]),            # no code block
    (_block("a, b = map(int, input().split())\nprint(a + b)"), CASES, [True, True, True]),
    (_block("import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b, end='  \\n\\n')"), CASES,
     [True, True, True]),                                                             # trailing blanks ignored
    (_block("a, b = map(int, input().split())\nprint(a * b)"), CASES, [False, False, True]),
    (_block("print(3)"), CASES, [True, False, False]),
    (_block("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)"), CASES, [False, False, False]),
])
def test_each_test_passes_or_fails_as_the_program_deserves(response, truth, results):
    assert run_tests(response, truth) == results
    assert compute_score(response, truth) == float(all(results))
    assert compute_score_fraction(response, truth) == pytest.approx(sum(results) / len(results))


def test_a_hanging_or_greedy_program_fails_within_the_sandbox_limits():
    assert run_tests(_block("while True:\n    pass"), ASSERTS) == [False] * 3
    assert run_tests(_block("x = bytearray(4 << 30)\ndef add(a, b):\n    return a + b"), ASSERTS) == [False] * 3


def test_a_program_cannot_forge_the_results_line():
    forged = _block("import sys\nsys.__stdout__.write('__hybrid_rl_results_' + '0' * 32 + '__[true, true, true]\\n')\n"
                    "def add(a, b):\n    return -100")  # a results line on the real stdout, without the nonce
    assert run_tests(forged, ASSERTS) == [False, False, False]


def test_extract_code_takes_the_last_block():
    assert extract_code("```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("no code") is None


def test_the_code_reward_runs_in_worker_processes():
    scorer = RewardScorer("auto", "code", timeout_s=60)
    try:
        assert scorer.pool is not None
        good, bad = _block("def add(a, b):\n    return a + b"), _block("def add(a, b):\n    return 0")
        assert scorer.score([good, bad, good], [ASSERTS, ASSERTS, CASES]) == ([1.0, 0.0, 0.0], 0)
    finally:
        scorer.close()


@pytest.mark.parametrize("row, kind, shown", [
    ({"text": "Write add.", "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]}, "asserts",
     "assert add(1, 2) == 3"),                                                       # MBPP
    ({"question": "Sum.", "input_output": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})}, "cases", None),  # APPS
    ({"problem": "Sum.", "tests": [{"input": "1 2", "output": "3"}]}, "cases", None),
    ({"prompt": "Write f.", "tests": "assert f() == 1"}, "asserts", "assert f() == 1"),
    ({"text": "Write g.", "test_list": ["assert g() == math.pi"], "test_setup_code": "import math"}, "asserts",
     "assert g() == math.pi"),                                                       # MBPP's setup code
])
def test_code_rows_in_the_layouts_of_code_datasets(row, kind, shown):
    out = TASKS["code"].format(row, 1)
    tests = json.loads(out["ground_truth"])
    assert list(tests) == [kind]
    content = out["messages"][0]["content"]
    assert content.endswith(CODE_INSTRUCTION)
    assert (f"Your code should pass this test:\n{shown}" in content) if shown else ("standard input" in content)


@pytest.mark.parametrize("row, words", [
    ({"text": "x"}, "no tests the code task can run"),
    ({"question": "x", "input_output": {"inputs": ["1"], "outputs": []}}, "no tests the code task can run"),
    ({"test_list": ["assert True"]}, "has no problem text"),
])
def test_bad_code_rows_are_one_line_errors(row, words):
    with pytest.raises(DataError) as ei:
        TASKS["code"].format(row, 4)
    assert str(ei.value).startswith("row 4") and words in str(ei.value) and "\n" not in str(ei.value)


def test_mbpp_setup_code_runs_before_each_test():
    row = {"text": "Write g.", "test_list": ["assert g() == math.pi"], "test_setup_code": "import math"}
    truth = TASKS["code"].format(row, 1)["ground_truth"]
    assert compute_score(_block("import math\ndef g():\n    return math.pi"), truth) == 1.0
    assert compute_score(_block("def g():\n    return 3.14"), truth) == 0.0
