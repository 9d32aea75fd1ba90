"""Several reward functions: ``reward.function`` plus ``reward.extra_functions`` × ``reward.extra_weights``.

The expected rewards are computed here from each function's own rule, not by the code under test."""

from __future__ import annotations

import pytest

from hybrid_rl.config import ConfigError
from hybrid_rl.config.algorithm import RewardConfig
from hybrid_rl.rewards import RewardError
from hybrid_rl.rewards.weighted import WeightedRewards, check_functions

FORMAT = """
def format_reward(response, ground_truth):
    return 1.0 if response.startswith("<think>") else 0.0

def length_penalty(response, ground_truth):
    return -len(response) / 100
"""


def _cfg(tmp_path, function="math", extra=("format_reward",), weights=(0.5,), **kw) -> RewardConfig:
    path = tmp_path / "fmt.py"
    path.write_text(FORMAT)
    cfg = RewardConfig(function=function, extra_functions=[f"{path}:{e}" for e in extra], extra_weights=list(weights),
                       num_workers=0, **kw)
    cfg.validate()
    return cfg


def test_the_reward_is_the_weighted_sum_and_each_function_is_kept_by_name(tmp_path):
    responses = [r"<think>x</think> \boxed{4}", r"\boxed{4}", "<think>no answer", r"<think>\boxed{5}"]
    truths = ["4", "4", "4", "4"]
    rewards = WeightedRewards.from_config(_cfg(tmp_path, extra=("format_reward", "length_penalty"),
                                               weights=(0.5, 2.0)), "math")
    total, failed, each = rewards.score(responses, truths)
    math_ok = [1.0, 1.0, 0.0, 0.0]
    fmt = [1.0, 0.0, 1.0, 1.0]
    length = [-len(r) / 100 for r in responses]
    assert failed == 0 and list(each) == ["math", "format_reward", "length_penalty"]
    assert each["math"] == math_ok and each["format_reward"] == fmt and each["length_penalty"] == length
    assert total == pytest.approx([m + 0.5 * f + 2.0 * n for m, f, n in zip(math_ok, fmt, length)])


def test_one_function_alone_and_repeated_names(tmp_path):
    alone = WeightedRewards.from_config(_cfg(tmp_path, extra=(), weights=()), "math")
    assert [p[0] for p in alone.parts] == ["math"] and alone.score([r"\boxed{1}"], ["1"])[0] == [1.0]
    twice = WeightedRewards.from_config(_cfg(tmp_path, function="auto", extra=("format_reward", "format_reward"),
                                             weights=()), "math")
    assert [(p[0], p[1]) for p in twice.parts] == [("math", 1.0), ("format_reward", 1.0), ("format_reward_2", 1.0)]
    assert twice.score(["<think>"], ["1"])[0] == [2.0]


def test_a_weight_per_extra_function(tmp_path):
    with pytest.raises(ConfigError) as ei:
        _cfg(tmp_path, extra=("format_reward",), weights=(1.0, 2.0))
    assert "reward.extra_weights has 2 entries for 1 reward.extra_functions" in str(ei.value)


def test_a_bad_extra_function_is_named_by_its_own_key(tmp_path):
    cfg = _cfg(tmp_path, extra=("format_reward", "missing"), weights=())
    with pytest.raises(RewardError) as ei:
        check_functions(cfg, "math")
    msg = str(ei.value)
    assert msg.startswith(f"reward.extra_functions[1]='{tmp_path / 'fmt.py'}:missing': module") and "\n" not in msg
    with pytest.raises(RewardError) as ei:
        WeightedRewards.from_config(cfg, "math")
    assert str(ei.value) == msg


def test_a_failing_extra_function_is_named_by_its_key_when_it_fails(tmp_path):
    path = tmp_path / "raising.py"
    path.write_text("def bad(response, ground_truth):\n    raise KeyError('x')\n")
    cfg = RewardConfig(function="math", extra_functions=[f"{path}:bad"], num_workers=0)
    rewards = WeightedRewards.from_config(cfg, "math")
    with pytest.raises(RewardError) as ei:
        rewards.score([r"\boxed{1}"], ["1"])
    assert str(ei.value).startswith(f"reward.extra_functions[0]='{path}:bad' failed on sample 0 (KeyError")
    total, failed, _ = rewards.score([r"\boxed{1}"], ["1"], on_error="zero")
    assert total == [1.0] and failed == 1


@pytest.mark.parametrize("response, score", [
    ("<think>2 + 2 is 4</think> The answer is 4.", 1.0),
    ("2 + 2 is 4</think>\n4", 1.0),                       # the template opened the block
    ("<think>2 + 2 is 4</think>", 0.0),                   # no answer after it
    ("<think></think> 4", 0.0),                           # no reasoning
    ("The answer is 4.", 0.0),                            # no block
    ("<think>a</think> b </think> c", 0.0),               # two closing tags
    ("<think>a <think> b</think> c", 0.0),                # a nested block
    ("x <think>a</think> c", 0.0),                        # text before the block
])
def test_think_format(response, score):
    from hybrid_rl.rewards import get_reward_fn

    assert get_reward_fn("think_format", "math")(response, "") == score
