"""A plug-in for ``benchmarks/agent_loop.py``: ``env.name=tools_latency``, the built-in tool environment with every
tool call taking a simulated remote latency, as a search or code-execution service would.

Each call sleeps a lognormal time of mean ``HYBRID_RL_TOOL_LATENCY_MEAN_S`` seconds (default 0.5) and shape
``HYBRID_RL_TOOL_LATENCY_SIGMA`` (default 1.0: a long tail, a few calls in a hundred past 3× the mean), then
answers as ``env.name=tools`` does. The draw is seeded by the environment's number in this process (environments
are made in the same order, trajectory by trajectory, whatever ``env.scheduler`` is), its turn and the call's
position in the turn, so that two runs of one recipe meet the same latencies slot by slot. Named in ``trainer.imports`` (``trainer.imports=[benchmarks/agent_latency.py]``).
"""

from __future__ import annotations

import itertools
import math
import os
import random
import time
import zlib

from hybrid_rl.envs import register_env
from hybrid_rl.envs.base import StepResult
from hybrid_rl.envs.tool_env import ToolEnv

MEAN_S = float(os.environ.get("HYBRID_RL_TOOL_LATENCY_MEAN_S", "0.5"))
SIGMA = float(os.environ.get("HYBRID_RL_TOOL_LATENCY_SIGMA", "1.0"))


def latency_s(seed_text: str, mean_s: float = MEAN_S, sigma: float = SIGMA) -> float:
    """One call's latency: lognormal with mean ``mean_s`` (mu = ln(mean) − σ²/2), seeded by ``seed_text``."""
    if mean_s <= 0:
        return 0.0
    rng = random.Random(zlib.crc32(seed_text.encode()))
    return rng.lognormvariate(math.log(mean_s) - sigma * sigma / 2, sigma)


@register_env("tools_latency")
class LatencyToolEnv(ToolEnv):
    """``ToolEnv`` whose calls each take ``latency_s`` before their results come back."""

    _made = itertools.count()

    def __init__(self, options, fit=None):
        super().__init__(options, fit)
        self.number = next(LatencyToolEnv._made)

    def step(self, turn: str) -> StepResult:
        self.turn = getattr(self, "turn", 0) + 1
        result = super().step(turn)
        if result.tool_calls:
            time.sleep(sum(latency_s(f"{self.number}/{self.turn}/{k}") for k in range(result.tool_calls)))
        return result
