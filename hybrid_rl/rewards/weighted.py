"""Several reward functions at once: ``reward.function`` plus ``reward.extra_functions``, each with its weight.

The reward of a sample is ``function``'s score plus ``Σ extra_weights[i] × extra_functions[i]``'s, as TRL sums its
``reward_funcs`` by ``reward_weights``: an answer's reward beside a format reward, say. Each function is a
``RewardScorer`` of its own (its own worker processes for user code, the same ``reward.timeout_s`` and
``reward.on_error``), scored in the order listed; each one's mean score before its weight is logged as
``reward/function/<name>`` (``val/function/<name>``) when there are several. ``<name>`` is the function's own name
(``format_reward`` for ``rewards.py:format_reward``, ``math`` for the built-in; ``auto`` is the task's reward's name),
with ``_2``, ``_3`` after a name met before.
"""

from __future__ import annotations

from typing import Any

from .call import SampleInfo
from .registry import RewardError, RewardScorer, get_reward_fn, resolve_name


def _specs(reward_cfg: Any) -> list[tuple[str, str, float]]:
    """(key as messages name it, function, weight) per reward function of ``reward.*``."""
    r = reward_cfg
    weights = r.extra_weights or [1.0] * len(r.extra_functions)
    return [("reward.function", r.function, 1.0)] + [(f"reward.extra_functions[{i}]", f, float(w))
                                                     for i, (f, w) in enumerate(zip(r.extra_functions, weights))]


def _named(e: RewardError, key: str) -> RewardError:
    """``e`` with its key ``reward.function`` replaced by ``key`` (an entry of ``reward.extra_functions``)."""
    return e if key == "reward.function" else RewardError(str(e).replace("reward.function", key))


def check_functions(reward_cfg: Any, task: str) -> None:
    """Every function of ``reward.*`` resolves and can be called as samples are scored (a one-line RewardError
    naming its key otherwise)."""
    for key, function, _ in _specs(reward_cfg):
        try:
            get_reward_fn(function, task)
        except RewardError as e:
            raise _named(e, key) from None


def function_label(function: str, task: str) -> str:
    """The short name of ``reward.function``-style ``function`` in metric keys."""
    return resolve_name(function, task).rpartition(":")[2]


def function_labels(rewards: Any) -> list[str]:
    """The names ``compute_scores`` logs each function's mean under (``<prefix>/function/<name>``): those of a
    ``WeightedRewards`` of several functions, else none."""
    if isinstance(rewards, WeightedRewards) and len(rewards.parts) > 1:
        return [label for label, _, _ in rewards.parts]
    return []


class WeightedRewards:
    """``parts``: (name, weight, scorer) per function; the reward is the weighted sum of their scores."""

    def __init__(self, parts: list[tuple[str, float, RewardScorer]]):
        if not parts:
            raise ValueError("WeightedRewards needs at least one reward function")
        self.parts = parts

    @classmethod
    def from_config(cls, reward_cfg: Any, task: str) -> "WeightedRewards":
        r = reward_cfg
        parts: list[tuple[str, float, RewardScorer]] = []
        seen: dict[str, int] = {}
        try:
            for key, function, weight in _specs(r):
                name = function_label(function, task)
                seen[name] = seen.get(name, 0) + 1
                label = name if seen[name] == 1 else f"{name}_{seen[name]}"
                try:
                    scorer = RewardScorer(function, task, r.on_error, r.timeout_s, r.num_workers)
                except RewardError as e:
                    raise _named(e, key) from None
                if key != "reward.function":
                    scorer.who = f"{key}={function!r}"
                parts.append((label, weight, scorer))
        except BaseException:
            for _, _, scorer in parts:
                scorer.close()
            raise
        return cls(parts)

    def score(self, responses: list[str], ground_truths: list[str], on_error: str | None = None,
              infos: list[SampleInfo] | None = None) -> tuple[list[float], int, dict[str, list[float]]]:
        """The weighted sum per sample, the failed calls scored 0 (all functions), and each function's own scores
        by name."""
        total = [0.0] * len(responses)
        failed = 0
        each: dict[str, list[float]] = {}
        for label, weight, scorer in self.parts:
            scores, n = scorer.score(responses, ground_truths, on_error, infos)
            failed += n
            each[label] = scores
            total = [t + weight * s for t, s in zip(total, scores)]
        return total, failed, each

    def close(self) -> None:
        for _, _, scorer in self.parts:
            scorer.close()
