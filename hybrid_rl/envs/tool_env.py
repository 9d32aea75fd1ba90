"""``ToolEnv`` (``env.name=tools``): answer each model turn with the results of the tool calls in it.

A turn with calls gets one observation per call, in the order written: the tool's result, or an error message
(malformed call, unknown tool, wrong arguments, a tool that raised, hung past ``env.tool_timeout_s`` or returned
too much or non-UTF-8 output), each fault counted by kind. A turn without calls is the trajectory's answer: the
environment is done and the reward function scores that turn. The tools are the ones ``env.tools`` names, written
and read in ``env.call_format``. Left out: rewards of its own (the reward function scores the answer) and calls
run concurrently within a turn.
"""

from __future__ import annotations

from typing import Any, Optional

from hybrid_rl.envs.base import Env, StepResult
from hybrid_rl.envs.calls import CALL_FORMATS, Call, CallFormat
from hybrid_rl.envs.tools import TOOLS, ArgumentError, Tool, check_arguments, run_tool


def offered_tools(options: Any) -> dict[str, Tool]:
    """The tools ``env.tools`` names, by name."""
    return {name: TOOLS[name] for name in options.tools}


def call_format(options: Any) -> CallFormat:
    return CALL_FORMATS[options.call_format]


class ToolEnv(Env):
    """Tool calls in, tool results out; done at the first turn without a call."""

    def __init__(self, options: Any, fit=None):
        super().__init__(options, fit)
        self.tools = offered_tools(options)
        self.format = call_format(options)

    def step(self, turn: str) -> StepResult:
        calls = self.format.parse(turn, self.tools)
        if not calls:
            return StepResult(done=True)
        result = StepResult(done=False)
        for call in calls:
            result.tool_calls += 1  # every call written, readable or not
            if isinstance(call, Call):
                text, errors = self._run(call)
            else:
                text, errors = f"error: {call.message}", [call.kind]
            text, cut = self.fit(text)
            if cut and "output_truncated" not in errors:
                errors.append("output_truncated")
            result.observations.append(self.format.result_content(call.name, text, self.options.observation_role))
            result.errors += errors
        return result

    def _run(self, call: Call) -> tuple[str, list[str]]:
        t = self.tools[call.name]
        try:
            args = check_arguments(t, call.args)
        except ArgumentError as e:
            return f"error: {e}", ["bad_arguments"]
        opts = self.options
        out = run_tool(t, args, self.row, opts.tool_timeout_s, opts.max_observation_tokens * 8)
        return out.text, out.errors

    @classmethod
    def template_kwargs(cls, options: Any) -> dict[str, Any]:
        return call_format(options).template_kwargs(offered_tools(options)) if options.describe_tools else {}

    @classmethod
    def system_prompt(cls, options: Any) -> Optional[str]:
        return call_format(options).describe(offered_tools(options)) if options.describe_tools else None

    @classmethod
    def stop_strings(cls, options: Any) -> tuple[str, ...]:
        return call_format(options).stop_strings(offered_tools(options))

