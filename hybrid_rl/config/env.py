"""The ``env`` section: multi-turn, tool-using rollouts (off unless ``env.name`` is set).

With ``env.name`` set every rollout (training and validation) is a conversation: the model's turn, the
environment's answer (``hybrid_rl/envs/``), the model's next turn, until the environment is done or a limit ends it.
The whole trajectory after the prompt, sampled and observation tokens together, fits in ``data.max_response_length``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from hybrid_rl.config.errors import ConfigError, require_positive


@dataclass
class EnvConfig:
    name: Optional[str] = None
    """The environment registered in ``hybrid_rl.envs.ENVS`` (``tools``: tool calls answered by ``env.tools``, or a
    plug-in's, named in ``trainer.imports``); null: single-turn rollouts."""
    tools: list[str] = field(default_factory=list)
    """Tools offered to the model, by their names in ``hybrid_rl.envs.TOOLS`` (``calculator``, ``lookup``, or a
    plug-in's)."""
    call_format: str = "hermes"
    """How calls and results are written (``hybrid_rl.envs.CALL_FORMATS``): ``hermes`` (Qwen2.5's
    ``<tool_call>{json}</tool_call>``) or ``tags`` (``<calculator>123*456</calculator>``, for templates without tools)."""
    observation_role: Literal["tool", "user"] = "tool"
    """The chat role of the messages that bring results back (``user`` for a template without a tool role)."""
    describe_tools: bool = True
    """Show the tools to the model: through the template's ``tools=`` (hermes) or a system message (tags)."""
    max_turns: int = 4
    """Model turns per trajectory (the last may still call a tool; nothing answers it)."""
    max_turn_tokens: Optional[int] = None
    """Tokens one model turn may sample (null: what is left of ``data.max_response_length``)."""
    max_observation_tokens: int = 256
    """Tokens of one tool result or error (cut beyond, with a marker; the template's own tokens come on top)."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may run before it is abandoned and the model is told it timed out."""
    max_rollout_s: float = 600.0
    """Seconds one rollout (every trajectory of a generate call, all turns) may take: trajectories still unfinished
    then end where they are, so that one slow trajectory cannot hold the ranks (0 = no bound)."""
    workers: int = 8
    """Threads that run the environments' steps (tool calls) concurrently."""
    scheduler: Literal["turns", "async", "auto"] = "turns"
    """How trajectories' turns meet the engine. ``turns``: every unfinished trajectory's next turn in one engine
    call, once every environment has answered the previous one (a slow tool or a long turn holds all the others;
    the samples do not depend on timing). ``async``: each trajectory's next turn joins the running engine as soon
    as its own environment has answered (as verl's agent loop and SkyRL's async generator do): tool calls overlap
    generation, at the price of samples that depend on when tools return. ``auto``: ``async`` on an engine that
    takes requests while it runs (vLLM), ``turns`` on the transformers engine (which decodes a fixed batch to its
    end, so it would gain little)."""

    def validate(self) -> None:
        if self.name is None:
            return
        from hybrid_rl.envs.tools import TOOLS  # imports no tool module: the built-ins are registered by path

        for t in self.tools:
            if t not in TOOLS:
                raise ConfigError(f"env.tools: {TOOLS.unknown_message(t).split('=', 1)[1]}; list registered tools "
                                  f"(a plug-in's are registered by a module in trainer.imports)")
        if len(set(self.tools)) != len(self.tools):
            raise ConfigError(f"env.tools={self.tools} names a tool twice; list each once")
        require_positive(self, "env", ["max_turns", "max_observation_tokens", "workers"])
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ConfigError(f"env.max_turn_tokens={self.max_turn_tokens} must be a positive number of tokens (or "
                              f"null for what is left of data.max_response_length)")
        if self.tool_timeout_s <= 0:
            raise ConfigError(f"env.tool_timeout_s={self.tool_timeout_s} must be > 0 seconds")
        if self.max_rollout_s < 0:
            raise ConfigError(f"env.max_rollout_s={self.max_rollout_s} must be >= 0 seconds (0 = no bound)")
