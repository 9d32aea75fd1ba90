"""Rule-based rewards: built-in scorers (``gsm8k``, ``successor``, ``arith``, ``math``, ``code``, ``think_format``), resolution of
``reward.function`` and batch scoring with ``reward.on_error`` handling (``registry``), in worker processes with
a per-call ``reward.timeout_s`` for user functions and ``math`` (``pool``, each worker running ``worker``); one
call's score or error as one line, in hybrid_rl's or verl's signature (``call``); ``reward.extra_functions`` beside
``reward.function`` by their weights (``weighted``). The answers the built-ins score are read by
``hybrid_rl.data.answers``; a reward model is ``model``.
"""

from .registry import BUILTIN_REWARDS, RewardError, RewardFn, get_reward_fn, register_reward, RewardScorer, score_responses

__all__ = ["RewardError", "RewardFn", "BUILTIN_REWARDS", "get_reward_fn", "register_reward", "RewardScorer",
           "score_responses"]
