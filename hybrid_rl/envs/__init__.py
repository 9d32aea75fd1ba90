"""Environments and tools for multi-turn, tool-using rollouts.

An environment starts from a data row and answers each model turn with an observation, an optional reward and
whether the trajectory is done; a tool is a typed Python function the model calls in its chat template's tool format.
The multi-turn rollout loop keeps a trajectory as one token sequence: the engine's sampled ids as sampled, each
observation encoded once and appended, with a response mask that is 1 on sampled tokens only.

- ``base``: the ``Env`` interface (``init`` / ``step`` / ``close``), ``ENVS`` (``env.name``), the fault kinds;
- ``tools``: ``tool`` / ``register_tool`` (a typed, documented function → a schema), ``TOOLS`` (``env.tools``),
  ``run_tool`` (arguments checked, a timeout, any result or fault as text);
- ``calls``: the call formats (``env.call_format``: ``hermes``, ``tags``), parsing a turn into calls and faults;
- ``tool_env``: ``ToolEnv`` (``env.name=tools``), tool calls in, results out;
- ``builtin``: the ``calculator`` and ``lookup`` tools and the ``lookup`` environment;
- ``render``: exact continuity, an observation as the chat template's own tokens;
- ``multiturn``: the turn loop on the engine's ``generate_interruptible`` and the batch it hands the trainer;
- ``deadline``: running tool and environment code with a time limit; ``metrics``: the ``env/`` metrics.

The registries are imported from here without torch (the config loader reads their names). Left out: a code sandbox
(a ``python`` tool is a plain function calling one, registered like any other).
"""

from hybrid_rl.envs.base import ENVS, Env, EnvRow, StepResult, register_env
from hybrid_rl.envs.calls import CALL_FORMATS
from hybrid_rl.envs.tools import TOOLS, Tool, register_tool, tool

__all__ = ["CALL_FORMATS", "ENVS", "TOOLS", "Env", "EnvRow", "StepResult", "Tool", "register_env", "register_tool",
           "tool"]
