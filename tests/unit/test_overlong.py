"""DAPO's soft overlong punishment (reward.overlong_buffer_len): the penalty's shape, where it lands in the batch,
that it reaches the advantage, and the config's one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid_rl.batch import Batch
from hybrid_rl.config import ConfigError, load_config
from hybrid_rl.rewards.overlong import overlong_penalty
from hybrid_rl.phases.reward import shape_overlong


def test_penalty_is_zero_before_the_buffer_then_linear_to_the_factor_at_the_cap():
    lengths = torch.tensor([10, 192, 200, 224, 256])
    got = overlong_penalty(lengths, max_response_length=256, buffer_len=64, penalty_factor=1.0)
    assert got.tolist() == [0.0, 0.0, -0.125, -0.5, -1.0]
    assert overlong_penalty(lengths, 256, 64, 0.5)[-1].item() == -0.5


def _batch(lengths: list[int], scores: list[float], width: int = 8) -> Batch:
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    token_scores = torch.zeros(len(lengths), width)
    for i, (n, s) in enumerate(zip(lengths, scores)):
        token_scores[i, n - 1] = s
    return Batch(tensors=dict(response_mask=mask, token_level_scores=token_scores, scores=torch.tensor(scores)),
                 non_tensors=dict(ground_truth=np.array(["1"] * len(lengths), dtype=object)))


def test_shaping_moves_the_token_scores_not_the_task_scores():
    """A lucky answer cut at the cap earns nothing; a finished one keeps its point; ``scores`` (reward/mean) is the
    reward function's own."""
    out, stats = shape_overlong(_batch([4, 8, 8], [1.0, 1.0, 0.0]), max_response_length=8, buffer_len=4,
                                penalty_factor=1.0)
    t = out.tensors
    assert t["token_level_scores"].sum(-1).tolist() == [1.0, 0.0, -1.0]
    assert t["token_level_scores"][1, 7].item() == 0.0 and t["token_level_scores"][2, 7].item() == -1.0
    assert t["scores"].tolist() == [1.0, 1.0, 0.0]
    assert stats == {"reward/overlong_penalty": (-2.0, 3.0)}


def test_grpo_prefers_the_finished_answer_to_the_lucky_clipped_one():
    """Two correct samples of one prompt, one finished and one cut at the cap: GRPO's advantages tie without the
    shaping and favour the finished one with it."""
    from hybrid_rl.algorithms.advantages import grpo_advantage

    batch = _batch([4, 8], [1.0, 1.0])
    index = np.array([0, 0])
    mask = batch.tensors["response_mask"]
    plain, _ = grpo_advantage(batch.tensors["token_level_scores"], mask, index)
    shaped_batch, _ = shape_overlong(batch, 8, 4, 1.0)
    shaped, _ = grpo_advantage(shaped_batch.tensors["token_level_scores"], mask, index)
    assert plain[0, 0] == plain[1, 0] == 0
    assert shaped[0, 0] > 0 > shaped[1, 0]


@pytest.mark.parametrize("override, key", [("reward.overlong_buffer_len=-1", "reward.overlong_buffer_len"),
                                           ("reward.overlong_buffer_len=64", "data.max_response_length"),
                                           ("reward.overlong_penalty_factor=-1", "reward.overlong_penalty_factor")])
def test_bad_overlong_settings_fail_in_one_line_naming_the_key(override, key):
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "cpu_successor.yaml"
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_config(recipe, ["data.max_response_length=16", override]).validate()
    assert "\n" not in str(e.value)
