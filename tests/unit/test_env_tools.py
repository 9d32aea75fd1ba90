"""Tools and their faults: a typed function becomes a schema, calls are read in both formats, and every bad call or
misbehaving tool becomes an observation of a counted kind instead of an exception (the table of bad calls).

The expected texts and kinds are written out here, from the formats' documented syntax, not read from the code.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest

from hybrid_rl.config import load_config
from hybrid_rl.envs.base import ERROR_KINDS, EnvRow
from hybrid_rl.envs.builtin import evaluate
from hybrid_rl.envs.calls import CALL_FORMATS, Call, CallError
from hybrid_rl.envs.tool_env import ToolEnv
from hybrid_rl.envs.tools import TOOLS, ArgumentError, ToolDefinitionError, check_arguments, register_tool, tool

ROW = EnvRow(index=3, ground_truth="8", data_source="lookup", info={"value": 7})
RELEASE = threading.Event()  # lets the hanging tool's abandoned thread end when the module is done


def add(a: int, b: float = 1.0) -> float:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def boom(text: str) -> str:
    """Raise.

    Args:
        text: Anything.
    """
    raise RuntimeError("kaput " + text)


def hang(text: str) -> str:
    """Never return in time.

    Args:
        text: Anything.
    """
    RELEASE.wait(30)
    return "late"


def flood(text: str) -> str:
    """A hundred megabytes.

    Args:
        text: Anything.
    """
    return "x" * 100_000_000


def raw_bytes(text: str) -> bytes:
    """Bytes that are not UTF-8.

    Args:
        text: Anything.
    """
    return b"ok \xff\xfe end"


class Reported:
    """A result object with its own error, as a sandbox returns."""

    error_kind = "exit_code"

    def observation(self) -> str:
        return "exit code 3\nstderr: oops"


def reported(text: str) -> Reported:
    """A result that reports an error.

    Args:
        text: Anything.
    """
    return Reported()


def quits(text: str) -> str:
    """Call sys.exit.

    Args:
        text: Anything.
    """
    raise SystemExit(3)


def square(n: int) -> int:
    """Square a number.

    Args:
        n: The number.
    """
    return n * n


class SlowToPrint:
    """A value whose text takes longer than the tool's timeout."""

    def __str__(self) -> str:
        RELEASE.wait(30)
        return "late"


def slow_value(text: str) -> SlowToPrint:
    """Return at once a value that is slow to turn into text.

    Args:
        text: Anything.
    """
    return SlowToPrint()


TEST_TOOLS = [add, boom, hang, flood, raw_bytes, reported, quits, square, slow_value]


@pytest.fixture(scope="module", autouse=True)
def registered():
    for fn in TEST_TOOLS:
        register_tool(fn)
    yield
    RELEASE.set()
    for fn in TEST_TOOLS:
        TOOLS.unregister(fn.__name__)


def _env(call_format: str, tools: list[str], role: str = "tool", timeout: float = 0.5):
    cfg = load_config(None, ["env.name=tools", f"env.tools={json.dumps(tools)}", f"env.call_format={call_format}",
                             f"env.observation_role={role}", f"env.tool_timeout_s={timeout}",
                             "env.max_observation_tokens=64"])
    cfg.validate()
    env = ToolEnv(cfg.env, lambda text: (text[:256], len(text) > 256))  # a stand-in for the token cut: 256 chars
    env.init(ROW)
    return env


# --------------------------------------------------------------------------- schemas
def test_a_typed_documented_function_is_a_schema():
    t = TOOLS["add"]
    params = t.schema["function"]["parameters"]
    assert t.schema["function"]["name"] == "add" and t.description == "Add two numbers."
    assert params["properties"]["a"]["type"] == "integer" and params["properties"]["b"]["type"] == "number"
    assert params["required"] == ["a"]
    # a parameter annotated EnvRow is the trajectory's row, not an argument the model sees
    assert TOOLS["lookup"].row_param == "row" and TOOLS["lookup"].argument_names == []


def test_an_undocumented_argument_is_refused_in_one_line():
    def f(x: int) -> int:
        """No Args section."""
        return x

    with pytest.raises(ToolDefinitionError, match=r"tool .*f: .*'x'.*document it"):
        tool(f)


@pytest.mark.parametrize("args, problem", [
    ({"a": 1, "c": 2}, "takes no argument 'c'"),
    ({"b": 2.0}, "needs the argument 'a'"),
    ({"a": "one"}, "'a' must be integer"),
    ({"a": True}, "'a' must be integer"),  # JSON true is not a number
    ([1, 2], "must be an object"),
])
def test_arguments_that_do_not_fit_the_signature(args, problem):
    with pytest.raises(ArgumentError, match=problem):
        check_arguments(TOOLS["add"], args)
    assert check_arguments(TOOLS["add"], {"a": 1, "b": 2}) == {"a": 1, "b": 2}


# --------------------------------------------------------------------------- the table of bad calls
HERMES = "hermes"
TAGS = "tags"


def call(name: str, **args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


# (format, tools offered, the model's turn, the observations it gets, the fault kinds counted)
TABLE = [
    (HERMES, ["add"], call("add", a=2, b=3.5), ["5.5"], []),
    # the JSON's position 37 is the "}" after the trailing comma
    (HERMES, ["add"], "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 2,}}</tool_call>",
     ["error: the call is not valid JSON (Expecting property name enclosed in double quotes at character 37)"],
     ["malformed_call"]),
    (HERMES, ["add"], "<tool_call>[1, 2]</tool_call>",
     ['error: a call must be a JSON object with a "name" and "arguments"'], ["malformed_call"]),
    (HERMES, ["add"], "<tool_call>{\"name\": \"add\"", ["error: <tool_call> is not closed by </tool_call>"],
     ["malformed_call"]),
    (HERMES, ["add"], call("sub", a=1), ["error: there is no tool 'sub' (the tools: add)"], ["unknown_tool"]),
    (HERMES, ["add"], call("add", x=1), ["error: add takes no argument 'x' (its arguments: a, b)"], ["bad_arguments"]),
    (HERMES, ["add"], call("add", a="2"), ['error: add: argument \'a\' must be integer, got "2"'], ["bad_arguments"]),
    (HERMES, ["boom"], call("boom", text="now"), ["error: boom raised RuntimeError: kaput now"], ["tool_raised"]),
    (HERMES, ["quits"], call("quits", text="x"), ["error: quits raised SystemExit: 3"], ["tool_raised"]),
    (HERMES, ["hang"], call("hang", text="x"), ["error: hang did not finish within 0.5 s"], ["tool_timeout"]),
    (HERMES, ["raw_bytes"], call("raw_bytes", text="x"), ["ok \ufffd\ufffd end"], ["non_utf8_output"]),
    (HERMES, ["slow_value"], call("slow_value", text="x"), ["error: slow_value did not finish within 0.5 s"],
     ["tool_timeout"]),
    (HERMES, ["reported"], call("reported", text="x"), ["exit code 3\nstderr: oops"], ["tool_reported"]),
    # two calls in one turn: two observations, in order, each with its own fault
    (HERMES, ["add", "boom"], call("add", a=1) + " and " + call("boom", text="!"),
     ["2.0", "error: boom raised RuntimeError: kaput !"], ["tool_raised"]),
    (TAGS, ["calculator"], "<calculator>123*456</calculator>", ["56088"], []),
    (TAGS, ["calculator"], "<calculator> 7 // 2 </calculator>", ["3"], []),
    (TAGS, ["calculator"], "<calculator>1/0</calculator>",
     ["error: calculator raised ZeroDivisionError: division by zero"], ["tool_raised"]),
    (TAGS, ["calculator"], "<calculator>__import__('os').system('ls')</calculator>",
     ["error: calculator raised ValueError: only numbers and + - * / // % ** ( ) are allowed, not Call"],
     ["tool_raised"]),
    (TAGS, ["calculator"], "<calculator>9**9**9</calculator>",
     ["error: calculator raised ValueError: exponents above 1024 are not allowed"], ["tool_raised"]),
    (TAGS, ["calculator"], "<calculator>12*", ["error: <calculator> is not closed by </calculator>"],
     ["malformed_call"]),
    (TAGS, ["lookup"], "<lookup/>", ["7"], []),
    (TAGS, ["lookup"], "<lookup>x</lookup>", ["error: lookup takes no argument: call it as <lookup/>"],
     ["bad_arguments"]),
    (TAGS, ["add"], "<add>{\"a\": 1</add>",
     ["error: add takes several arguments: write them as a JSON object between <add> and </add>"], ["bad_arguments"]),
    (TAGS, ["add"], "<add>{\"a\": 4, \"b\": 0.5}</add>", ["4.5"], []),
    # a tag no offered tool has is text in the tag format: the turn is an answer
    (TAGS, ["calculator"], "<search>x</search> 42", [], []),
]


@pytest.mark.parametrize("fmt, tools, turn, observations, kinds", TABLE)
def test_bad_calls_become_observations(fmt, tools, turn, observations, kinds):
    start = time.monotonic()
    result = _env(fmt, tools).step(turn)
    assert result.observations == observations
    assert sorted(result.errors) == sorted(kinds)
    assert set(result.errors) <= set(ERROR_KINDS)
    assert result.done == (not observations)
    assert result.tool_calls == turn.count("<tool_call>") if fmt == HERMES else True
    assert time.monotonic() - start < 5  # the hung tool is abandoned at its timeout


DEEP = "[" * 5000  # deeper than Python's recursion limit: json.loads raises RecursionError, not ValueError


@pytest.mark.parametrize("fmt, tools, turn, kind", [
    (HERMES, ["add"], "<tool_call>" + DEEP + "</tool_call>", "malformed_call"),
    # an integer of more digits than int() converts (4300): json.loads raises a plain ValueError
    (HERMES, ["add"], '<tool_call>{"name": "add", "arguments": {"a": ' + "1" * 5000 + "}}</tool_call>",
     "malformed_call"),
    (HERMES, ["add"], "<tool_call>" + json.dumps({"name": "add", "arguments": DEEP}) + "</tool_call>",
     "bad_arguments"),
    (TAGS, ["add"], "<add>" + DEEP + "</add>", "bad_arguments"),
    (TAGS, ["square"], "<square>" + DEEP + "</square>", "bad_arguments"),
])
def test_unreadably_deep_or_long_json_is_a_fault_of_the_call(fmt, tools, turn, kind):
    result = _env(fmt, tools).step(turn)
    (text,) = result.observations
    assert text.startswith("error: ") and result.errors == [kind] and not result.done


def test_huge_output_is_cut_and_counted():
    result = _env(HERMES, ["flood"]).step(call("flood", text="x"))
    (text,) = result.observations
    assert len(text) <= 256 and text.startswith("xxxx")
    assert result.errors == ["output_truncated"]


def test_tag_results_in_a_user_message_are_marked():
    result = _env(TAGS, ["calculator"], role="user").step("<calculator>2+2</calculator>")
    assert result.observations == ["<result>4</result>"]


def test_stop_strings_end_a_turn_at_the_call():
    tools = {n: TOOLS[n] for n in ("calculator", "lookup")}
    assert CALL_FORMATS[HERMES].stop_strings(tools) == ("</tool_call>",)
    # a tool without arguments also stops at its self-closing tag; one with arguments only at its closing tag
    assert set(CALL_FORMATS[TAGS].stop_strings(tools)) == {"</calculator>", "</lookup>", "<lookup/>"}


def test_formats_parse_in_written_order():
    tools = {n: TOOLS[n] for n in ("calculator", "lookup")}
    got = CALL_FORMATS[TAGS].parse("<lookup/> then <calculator>1+1</calculator> and <calculator>2", tools)
    assert got == [Call("lookup", {}), Call("calculator", {"expression": "1+1"}),
                   CallError("malformed_call", "<calculator> is not closed by </calculator>", "calculator")]


# --------------------------------------------------------------------------- the calculator's evaluator
@pytest.mark.parametrize("expression, value", [("123*456", 56088), ("(1+2)*3/4", 2.25), ("-7 % 3", 2),
                                               ("2**10", 1024), ("482 × 317", 152794), ("10 ÷ 4", 2.5)])
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "x + 1", "(1).real", "[1, 2]", "1 if 1 else 2",
                                        "2**4000 * 2**4000", "9**9**9", "lambda: 1", "1" * 600])
def test_calculator_refuses_anything_but_bounded_arithmetic(expression):
    with pytest.raises(ValueError):
        evaluate(expression)


# --------------------------------------------------------------------------- the python tool (the sandbox)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox runs on Linux only")
@pytest.mark.parametrize("code, text, kinds", [
    ("print(123 * 456)", "56088", []),                   # 56088 worked by hand
    ("while True: pass", "error:", ["tool_reported"]),  # killed at its CPU or wall-clock limit
    ("raise SystemExit(3)", "error:", ["tool_reported"]),
    ("import sys; sys.stdout.buffer.write(b'ok \\xff end')", "ok \ufffd end", ["non_utf8_output"]),
])
def test_python_tool_runs_in_the_sandbox_and_faults_are_observations(code, text, kinds):
    from hybrid_rl.envs.tools import run_tool

    t = TOOLS.get("python")
    args = check_arguments(t, {"code": code})
    start = time.monotonic()
    out = run_tool(t, args, ROW, timeout_s=30.0, max_chars=2000)
    assert time.monotonic() - start < 20
    assert text in out.text and out.errors == kinds


@pytest.mark.parametrize("value, max_chars, text, kinds", [
    # 'é' is 0xc3 0xa9: 1 character keeps 4 bytes, a c3 a9 c3, which end inside the second 'é'; that half is
    # dropped, not an error (without the cut it would be U+FFFD and non_utf8_output)
    ("aééb".encode(), 1, "a ...[cut at 1 characters]", ["output_truncated"]),
    ("aé".encode() + b"\xc3", 100, "aé\ufffd", ["non_utf8_output"]),  # a last character that is simply incomplete
    (b"ok \xff end", 100, "ok \ufffd end", ["non_utf8_output"]),
    ("plain é".encode(), 100, "plain é", []),
])
def test_bytes_from_a_tool_are_decoded_once_and_flagged_only_when_invalid(value, max_chars, text, kinds):
    from hybrid_rl.envs.tools import result_text

    out = result_text(value, max_chars)
    assert (out.text, out.errors) == (text, kinds)
