"""Keys that moved or were removed, gathered from the sections that own them (an engine's own from its options module).

A recipe or override naming an old key is told the new one (``loading.py``); a checkpoint's saved config is read
under the new names before a resume compares it (``resume.py``).
"""

from __future__ import annotations

from hybrid_rl.config.actor import MOVED_KEYS as _ACTOR_MOVED
from hybrid_rl.config.algorithm import REMOVED_KEYS as _ALGORITHM_REMOVED
from hybrid_rl.rollout.vllm_options import MOVED_KEYS as _VLLM_MOVED
from hybrid_rl.rollout.vllm_options import REMOVED_KEYS as _VLLM_REMOVED

MOVED_KEYS = {**_VLLM_MOVED, **_ACTOR_MOVED}
"""Old dotted key → its new one."""
REMOVED_KEYS = {**_VLLM_REMOVED, **_ALGORITHM_REMOVED}
"""Old dotted key → why it went and what to use instead."""

__all__ = ["MOVED_KEYS", "REMOVED_KEYS"]
