"""Tools: typed Python functions the model may call, and ``TOOLS``: the names ``env.tools`` takes.

A tool is a plain function with type hints and a Google-style docstring (a summary, then ``Args:`` with one line per
argument); ``tool(fn)`` turns it into a ``Tool`` whose JSON schema (transformers' ``get_json_schema``, the format
chat templates render with ``tools=``) is what the model is shown. One parameter may instead be annotated
``EnvRow``: it receives the trajectory's data row and is never shown to the model (a tool that reveals a value of
the row). ``register_tool`` adds a tool under its name; a plug-in registers its own in a module named in
``trainer.imports``::

    from hybrid_rl.envs.tools import register_tool

    @register_tool
    def word_count(text: str) -> int:
        \"\"\"Count the words of a text.

        Args:
            text: The text.
        \"\"\"
        return len(text.split())

``run_tool`` is the one place a tool runs: arguments checked against the schema, the call in a thread of its own
with ``env.tool_timeout_s`` (``deadline.py``), and whatever it returns or raises turned into text for the model with
the fault's kind (``base.ERROR_KINDS``). A result is a ``str``, ``bytes`` (UTF-8; anything else is decoded with
replacement), an object with ``observation()`` (its text; a non-empty ``error_kind`` attribute counts as the tool's
own error, as a sandbox's result has), or anything JSON can write. Left out: asynchronous tools, tools with state
across calls (give the environment the state instead), and streaming results.
"""

from __future__ import annotations

import inspect
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from hybrid_rl.envs.base import EnvRow
from hybrid_rl.envs.deadline import call_with_timeout
from hybrid_rl.envs.sandbox import decode_utf8
from hybrid_rl.registry import Registry


class ToolDefinitionError(ValueError):
    """A function that cannot be a tool (undocumented argument, untyped parameter); the message names the fix."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call."""

    name: str
    description: str
    fn: Callable[..., Any]
    schema: Mapping[str, Any]
    """``{"type": "function", "function": {"name", "description", "parameters"}}``: what the template renders."""
    row_param: Optional[str] = None
    """The parameter that receives the trajectory's ``EnvRow`` (hidden from the model), if any."""

    @property
    def parameters(self) -> Mapping[str, Any]:
        """The JSON schema of the arguments: ``{"type": "object", "properties": {...}, "required": [...]}``."""
        return self.schema["function"].get("parameters", {"type": "object", "properties": {}})

    @property
    def argument_names(self) -> list[str]:
        return list(self.parameters.get("properties", {}))

    def signature_text(self) -> str:
        """``name(a: integer, b: string = ...)``: a one-line description for prompts without a tool template."""
        props, required = self.parameters.get("properties", {}), set(self.parameters.get("required", []))
        args = [f"{k}: {v.get('type', 'any')}" + ("" if k in required else " (optional)") for k, v in props.items()]
        return f"{self.name}({', '.join(args)})"


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """``Tool`` from a typed, documented function (``@tool`` or ``@tool(name=...)``); ToolDefinitionError naming the
    function and what to add otherwise."""
    if fn is None:
        return lambda f: tool(f, name=name)
    from transformers.utils import get_json_schema

    label = getattr(fn, "__qualname__", repr(fn))
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:
        raise ToolDefinitionError(f"tool {label}: cannot read its type hints ({e}); annotate every parameter") from None
    sig = inspect.signature(fn)
    row = [p for p, t in hints.items() if t is EnvRow and p in sig.parameters]
    shown = [p for p in sig.parameters.values() if p.name not in row]
    proxy = _shown_signature(fn, shown, {k: v for k, v in hints.items() if k not in row})
    try:
        schema = get_json_schema(proxy)
    except Exception as e:
        raise ToolDefinitionError(f"tool {label}: {e}; document it Google-style (a summary line, then 'Args:' with "
                                  f"'name: description' for each argument the model sees)") from None
    schema = json.loads(json.dumps(schema))  # plain dicts and lists only
    schema["function"].pop("return", None)
    final = name or fn.__name__
    schema["function"]["name"] = final
    return Tool(final, schema["function"].get("description", ""), fn, schema, row[0] if row else None)


def _shown_signature(fn: Callable[..., Any], params: list[inspect.Parameter], hints: dict[str, Any]) -> Callable:
    """A stand-in with ``fn``'s name and docstring and only the parameters the model sees (for the schema)."""
    def proxy(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("a schema stand-in is never called")
    proxy.__name__ = fn.__name__
    proxy.__doc__ = fn.__doc__
    proxy.__annotations__ = hints
    proxy.__signature__ = inspect.Signature(params, return_annotation=hints.get("return", inspect.Signature.empty))
    return proxy


TOOLS: "Registry[Tool]" = Registry("env.tools")
"""Every tool by the name ``env.tools`` lists (``"module:attr"`` entries import on lookup)."""


def register_tool(obj: Tool | Callable[..., Any] | str | None = None, *, name: str | None = None) -> Any:
    """Register a tool: ``@register_tool`` / ``@register_tool(name=...)`` on a function, a ``Tool``, or a
    ``"module:attr"`` path with ``name`` (imported on first use). A duplicate name is an error. Returns what it got."""
    if obj is None:
        return lambda f: register_tool(f, name=name)
    if isinstance(obj, str):
        if not name:
            raise ValueError("register_tool('module:attr') needs name=")
        TOOLS.register(name, obj)
        return obj
    made = obj if isinstance(obj, Tool) else tool(obj, name=name)
    TOOLS.register(name or made.name, made)
    return obj


# --------------------------------------------------------------------------- calling one
class ArgumentError(ValueError):
    """Arguments a call gave that do not fit the tool's parameters; the message is shown to the model."""


_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                             "boolean": (bool,), "array": (list, tuple), "object": (dict,),
                                             "null": (type(None),)}


def check_arguments(t: Tool, args: Any) -> dict[str, Any]:
    """``args`` (a mapping from the call) checked against ``t``'s schema: known names, required ones present, each of
    its JSON type. Returns them as keyword arguments; ArgumentError with what is wrong otherwise."""
    if not isinstance(args, Mapping):
        raise ArgumentError(f"the arguments of {t.name} must be an object of named values, got {type(args).__name__}")
    props, required = t.parameters.get("properties", {}), t.parameters.get("required", [])
    unknown = [k for k in args if k not in props]
    if unknown:
        raise ArgumentError(f"{t.name} takes no argument {unknown[0]!r} (its arguments: {', '.join(props) or 'none'})")
    missing = [k for k in required if k not in args]
    if missing:
        raise ArgumentError(f"{t.name} needs the argument {missing[0]!r}")
    for k, v in args.items():
        kinds = props[k].get("type")
        names = kinds if isinstance(kinds, list) else [kinds] if kinds else []
        allowed = tuple(c for n in names for c in _JSON_TYPES.get(n, (object,)))
        if props[k].get("nullable"):
            allowed += (type(None),)
        bad_bool = isinstance(v, bool) and "boolean" not in names  # JSON true is not an integer
        if allowed and (not isinstance(v, allowed) or bad_bool):
            raise ArgumentError(f"{t.name}: argument {k!r} must be {' or '.join(names)}, got {json.dumps(v)[:60]}")
    return dict(args)


@dataclass
class ToolOutcome:
    """What a call gave the model: the text, and the kinds of fault it had (none: it worked)."""

    text: str
    errors: list[str] = field(default_factory=list)


def run_tool(t: Tool, args: Mapping[str, Any], row: EnvRow, timeout_s: float, max_chars: int) -> ToolOutcome:
    """Call ``t`` with ``args`` (already checked) and the trajectory's ``row``, in a thread of its own for at most
    ``timeout_s`` seconds; its result or fault as text of at most ``max_chars`` characters (the caller cuts it to
    tokens)."""
    kwargs = dict(args)
    if t.row_param:
        kwargs[t.row_param] = row
    # The result is turned into text inside the timeout too: a value that is slow to print is the tool's fault.
    out = call_with_timeout(lambda: result_text(t.fn(**kwargs), max_chars), timeout_s, name=f"tool-{t.name}")
    if out.timed_out:
        return ToolOutcome(f"error: {t.name} did not finish within {timeout_s:g} s", ["tool_timeout"])
    if out.error is not None:
        e = out.error
        return ToolOutcome(f"error: {t.name} raised {type(e).__name__}: {_short(str(e), 300)}", ["tool_raised"])
    return out.value


def result_text(value: Any, max_chars: int) -> ToolOutcome:
    """A tool's return value as text for the model (see the module docstring), cut to ``max_chars``."""
    errors: list[str] = []
    cut = False
    if hasattr(value, "observation") and callable(value.observation):
        if getattr(value, "error_kind", None):
            errors.append("tool_reported")
        if getattr(value, "invalid_utf8", False):  # a sandbox's output had bytes that are not UTF-8
            errors.append("non_utf8_output")
        value = value.observation()
    if isinstance(value, (bytes, bytearray)):
        raw = bytes(value[: max_chars * 4])  # no character takes more than 4 bytes
        cut = len(value) > len(raw)
        text, invalid = decode_utf8(raw, cut)
        if invalid:
            errors.append("non_utf8_output")
    elif isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            text = str(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates (e.g. from os.fsdecode): no tokenizer takes them
        text = text.encode("utf-8", errors="replace").decode("utf-8")
        errors.append("non_utf8_output")
    if cut or len(text) > max_chars:
        text = text[:max_chars] + f" ...[cut at {max_chars} characters]"
        errors.append("output_truncated")
    return ToolOutcome(text, errors)


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


register_tool("hybrid_rl.envs.builtin:calculator", name="calculator")
register_tool("hybrid_rl.envs.builtin:python", name="python")
register_tool("hybrid_rl.envs.builtin:lookup", name="lookup")
