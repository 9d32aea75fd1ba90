"""How a model writes tool calls and reads their results: ``CALL_FORMATS``, the names ``env.call_format`` takes.

``hermes``: the format of Qwen2.5's chat template (and Hermes-style models): a call is
``<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>`` (JSON inside, whitespace
around it allowed), the turn stops at ``</tool_call>``, each result goes back as a message of ``env.observation_role``
with the result's text as its content (Qwen2.5's template wraps a ``tool`` message in ``<tool_response>``), and the
tools' schemas reach the prompt through the template's ``tools=`` argument.

``tags``: for models whose template knows no tools (SmolLM2). A call is the tool's name as a tag around its
argument, ``<calculator>123*456</calculator>``: for a tool of one parameter the stripped text between the tags is
that argument (read as its type: a number, true/false, or JSON for lists and objects), for several a JSON object of
them, and a tool of none is called as ``<lookup/>`` (or with nothing between the tags). The turn stops at the first
closing tag (or ``<name/>``) of an offered tool; each result goes back as its text in a ``tool`` message, or as
``<result>TEXT</result>`` in a ``user`` message (``env.observation_role``), so that it reads apart from what the
user wrote; the tools are
described in a system message (``describe``) when ``env.describe_tools`` is on. A tag that names no offered tool is
ordinary text in this format (there is no way to tell a call to an unknown tool from prose), so unknown tools are a
``hermes`` fault only.

A format parses a turn into ``Call``s and ``CallError``s in the order they were written; a fault (malformed JSON,
an unknown name, an unclosed call, arguments of the wrong shape) becomes an error observation, never an exception.
Left out: Llama's pythonic calls and Mistral's ``[TOOL_CALLS]`` (register a format of your own), and parallel calls
run concurrently (a turn's calls run one after another).
"""

from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from hybrid_rl.envs.tools import Tool
from hybrid_rl.registry import Registry


@dataclass(frozen=True)
class Call:
    """A well-formed call of an offered tool (its arguments not checked yet)."""

    name: str
    args: Any


@dataclass(frozen=True)
class CallError:
    """A call that could not be read: ``kind`` from ``base.ERROR_KINDS``, ``message`` for the model."""

    kind: str
    message: str
    name: Optional[str] = None


class CallFormat(abc.ABC):
    """The syntax of calls and results in one family of chat templates."""

    @abc.abstractmethod
    def parse(self, text: str, tools: Mapping[str, Tool]) -> list[Call | CallError]:
        """The calls of a turn's ``text`` (empty: the turn is an answer, not a call)."""

    @abc.abstractmethod
    def stop_strings(self, tools: Mapping[str, Tool]) -> tuple[str, ...]:
        """Strings that end a turn right after a call."""

    def result_content(self, name: Optional[str], text: str, role: str) -> str:
        """The content of the message (of chat role ``role``) that brings a result (or an error) back."""
        return text

    def describe(self, tools: Mapping[str, Tool]) -> Optional[str]:
        """A system-prompt description of ``tools`` for templates that cannot render them (None: the template does)."""
        return None

    def template_kwargs(self, tools: Mapping[str, Tool]) -> dict[str, Any]:
        """Arguments for ``apply_chat_template`` that put the tools into the prompt."""
        return {}


CALL_FORMATS: "Registry[CallFormat]" = Registry("env.call_format")


class HermesFormat(CallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, tools: Mapping[str, Tool]) -> list[Call | CallError]:
        out: list[Call | CallError] = []
        pos = 0
        while True:
            start = text.find(self.OPEN, pos)
            if start < 0:
                return out
            end = text.find(self.CLOSE, start)
            if end < 0:
                out.append(CallError("malformed_call", f"{self.OPEN} is not closed by {self.CLOSE}"))
                return out
            out.append(self._one(text[start + len(self.OPEN):end], tools))
            pos = end + len(self.CLOSE)

    def _one(self, body: str, tools: Mapping[str, Tool]) -> Call | CallError:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            return CallError("malformed_call", f"the call is not valid JSON ({e.msg} at character {e.pos})")
        except RecursionError:  # nesting deeper than the interpreter's recursion limit
            return CallError("malformed_call", "the call is not valid JSON (nested too deeply)")
        except ValueError:  # an integer past Python's limit on digits
            return CallError("malformed_call", "the call is not valid JSON (a number is too long)")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return CallError("malformed_call", 'a call must be a JSON object with a "name" and "arguments"')
        name, args = call["name"], call.get("arguments", {})
        if name not in tools:
            offered = ", ".join(tools) or "none"
            return CallError("unknown_tool", f"there is no tool {name!r} (the tools: {offered})", name)
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return CallError("bad_arguments", f'the "arguments" of {name} must be a JSON object', name)
        return Call(name, args)

    def stop_strings(self, tools: Mapping[str, Tool]) -> tuple[str, ...]:
        return (self.CLOSE,)

    def template_kwargs(self, tools: Mapping[str, Tool]) -> dict[str, Any]:
        return {"tools": [dict(t.schema) for t in tools.values()]} if tools else {}


class TagsFormat(CallFormat):
    """``<name>argument</name>`` and ``<name/>`` (see the module docstring)."""

    def parse(self, text: str, tools: Mapping[str, Tool]) -> list[Call | CallError]:
        if not tools:
            return []
        names = "|".join(re.escape(n) for n in sorted(tools, key=len, reverse=True))
        pattern = re.compile(rf"<({names})\s*/>|<({names})>(.*?)</\2>|<({names})>", re.DOTALL)
        out: list[Call | CallError] = []
        for m in pattern.finditer(text):
            if m.group(1):
                out.append(self._one(m.group(1), "", tools[m.group(1)]))
            elif m.group(2):
                out.append(self._one(m.group(2), m.group(3), tools[m.group(2)]))
            else:
                name = m.group(4)
                out.append(CallError("malformed_call", f"<{name}> is not closed by </{name}>", name))
                break  # everything after an unclosed tag is its body
        return out

    @staticmethod
    def _one(name: str, body: str, t: Tool) -> Call | CallError:
        params = t.parameters.get("properties", {})
        body = body.strip()
        if not params:
            if body:
                return CallError("bad_arguments", f"{name} takes no argument: call it as <{name}/>", name)
            return Call(name, {})
        if len(params) > 1:
            try:
                args = json.loads(body)
            except (ValueError, RecursionError):
                return CallError("bad_arguments", f"{name} takes several arguments: write them as a JSON object "
                                 f"between <{name}> and </{name}>", name)
            return Call(name, args)
        (arg, spec), = params.items()
        value = _read_as(body, spec.get("type", "string"))
        if value is _UNREADABLE:
            return CallError("bad_arguments", f"{name}: {body[:60]!r} is not a {spec.get('type')} ({arg})", name)
        return Call(name, {arg: value})

    def stop_strings(self, tools: Mapping[str, Tool]) -> tuple[str, ...]:
        return tuple(s for n, t in tools.items() for s in (f"</{n}>",) + ((f"<{n}/>",) if not t.argument_names else ()))

    def result_content(self, name: Optional[str], text: str, role: str) -> str:
        return f"<result>{text}</result>" if role == "user" else text

    def describe(self, tools: Mapping[str, Tool]) -> Optional[str]:
        if not tools:
            return None
        lines = ["You can use tools. To call one, write its call and stop; its result comes back to you."]
        for t in tools.values():
            params = t.argument_names
            call = f"<{t.name}/>" if not params else f"<{t.name}>{params[0].upper() if len(params) == 1 else 'JSON'}" \
                                                   f"</{t.name}>"
            lines.append(f"- {call}: {t.description}")
        return "\n".join(lines)


_UNREADABLE = object()


def _read_as(text: str, kind: Any) -> Any:
    """``text`` as a value of JSON type ``kind`` (or the first of a list of them that reads), else ``_UNREADABLE``."""
    for k in kind if isinstance(kind, list) else [kind]:
        if k == "string":
            return text
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            continue
        if k == "integer" and isinstance(value, int) and not isinstance(value, bool) or \
                k == "number" and isinstance(value, (int, float)) and not isinstance(value, bool) or \
                k == "boolean" and isinstance(value, bool) or k == "array" and isinstance(value, list) or \
                k == "object" and isinstance(value, dict):
            return value
    return _UNREADABLE


CALL_FORMATS.register("hermes", HermesFormat())
CALL_FORMATS.register("tags", TagsFormat())
