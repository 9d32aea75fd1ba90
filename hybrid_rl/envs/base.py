"""The environment interface of multi-turn rollouts, and ``ENVS``: ``env.name`` → environment class.

An environment is one trajectory's world: ``init(row)`` starts it from the data row the prompt came from, each
``step(turn)`` answers the model's latest turn (its text) with an observation for the model, an optional reward and
whether the trajectory is done, and ``close()`` releases what it holds. It never sees token ids: the rollout loop
(``multiturn.py``) keeps the trajectory as one token sequence and encodes each observation once, through the chat
template (``render.py``). ``tool_env.ToolEnv`` (``env.name=tools``) is the built-in one: it parses tool calls in the
configured format and answers with the tools' results. A plug-in environment is a subclass registered with
``register_env("name")`` in a module named in ``trainer.imports``.

This module imports neither torch nor transformers: the config loader reads ``ENVS``' names. Left out: environments
that hold state across trajectories or steps (each trajectory gets a fresh instance, closed when it ends), and
several trajectories from one environment (context compression, sub-agents).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, TypeVar

from hybrid_rl.registry import Registry

ERROR_KINDS = ("malformed_call", "unknown_tool", "bad_arguments", "tool_raised", "tool_timeout", "output_truncated",
               "non_utf8_output", "tool_reported", "env_raised", "env_timeout")
"""What a turn's faults are counted as (``env/errors/<kind>``): a call that cannot be parsed, a name no offered tool
has, arguments that do not fit the tool's signature, a tool that raised, ran past ``env.tool_timeout_s``, returned
more than ``env.max_observation_tokens`` (cut) or bytes that are not UTF-8 (decoded with replacement), a tool whose
result reports an error of its own (an object with an ``error_kind``, such as a sandbox's), and an environment whose
``step`` raised or ran past the rollout's time bound (the trajectory then ends)."""


STOPS = ("answer", "max_turns", "budget", "timeout", "env_error")
"""Why a trajectory ended (``env/stop/<reason>``): its environment was done, ``env.max_turns``, its tokens filled
``data.max_response_length``, ``env.max_rollout_s`` ran out, its environment raised or hung."""


@dataclass(frozen=True)
class EnvRow:
    """The data row a trajectory starts from (what its prompt was made of)."""

    index: int
    """The row's position in the dataset."""
    ground_truth: str
    data_source: str
    messages: tuple[Mapping[str, Any], ...] = ()
    """The prompt's chat messages (system prompt included), as the template rendered them."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """What the task keeps for the environment beside the prompt (``Task.format_row``'s ``env_info``), e.g. the
    value only a tool may reveal."""


@dataclass
class StepResult:
    """An environment's answer to one model turn."""

    observations: list[str] = field(default_factory=list)
    """Messages for the model, in order (one per tool result); with none the trajectory ends, whatever ``done``
    says (another turn needs something new to answer)."""
    done: bool = True
    """The trajectory ends after this turn (its last turn is the answer the reward function scores)."""
    reward: float = 0.0
    """Added to the trajectory's score (``scores`` = reward function on the final turn + the environment's rewards)."""
    tool_calls: int = 0
    """Tool calls the turn wrote, readable or not (``env/tool_calls_mean``; ``env/error_rate`` is faults per call)."""
    errors: list[str] = field(default_factory=list)
    """A kind from ``ERROR_KINDS`` per fault of the turn (each also reached the model as an observation)."""


def keep_whole(text: str) -> tuple[str, bool]:
    """The ``fit`` of an environment built outside a rollout: nothing is cut."""
    return text, False


class Env(abc.ABC):
    """One trajectory's environment: ``init`` once, ``step`` per model turn, ``close`` at the end (always called).

    ``options`` is the run's ``env`` config section (tools, limits); an environment reads what it needs. ``fit``
    cuts a text to ``env.max_observation_tokens`` of the model's tokenizer, returning it and whether it was cut (the
    rollout loop passes it in): an environment should fit what it lets a tool write into an observation."""

    def __init__(self, options: Any, fit: Optional[Callable[[str], tuple[str, bool]]] = None):
        self.options = options
        self.fit = fit or keep_whole
        self.row: Optional[EnvRow] = None

    def init(self, row: EnvRow) -> None:
        """Start from ``row``; nothing by default."""
        self.row = row

    @abc.abstractmethod
    def step(self, turn: str) -> StepResult:
        """Answer the model's turn (its text, special tokens included, as sampled)."""

    def close(self) -> None:
        """Release what the trajectory held; nothing by default."""

    @classmethod
    def template_kwargs(cls, options: Any) -> dict[str, Any]:
        """Extra arguments for the chat template on every render of a trajectory (``tools=...``); none by default."""
        return {}

    @classmethod
    def system_prompt(cls, options: Any) -> Optional[str]:
        """Text to put before the data's system prompt (a description of the tools), or None."""
        return None

    @classmethod
    def stop_strings(cls, options: Any) -> tuple[str, ...]:
        """Strings that end a model turn besides EOS (the end of a tool call); none by default."""
        return ()


E = TypeVar("E", bound=type)

ENVS: "Registry[type[Env]]" = Registry("env.name")
"""Every environment class by the name ``env.name`` takes (``"module:Class"`` entries import on lookup)."""


def register_env(name: str, cls: Optional[str | type] = None) -> Callable[[E], E] | str | type:
    """Register an environment class as ``env.name=name``: as a decorator, or with the class or a
    ``"module:Class"`` path. A duplicate name is an error."""
    return ENVS.add(name, cls)


register_env("tools", "hybrid_rl.envs.tool_env:ToolEnv")
register_env("lookup", "hybrid_rl.envs.builtin:LookupEnv")
