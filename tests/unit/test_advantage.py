"""The driver's advantage phase dispatches each estimator with its config knobs, and applies KL in reward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid_rl.phases.advantage import compute_advantage
from hybrid_rl.phases.reward import sparse_scores
from hybrid_rl.batch import Batch
from hybrid_rl.config import load_config


def _batch() -> Batch:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    scores = sparse_scores(torch.tensor([1.0, 0.0, 1.0, 1.0]), mask)
    assert scores[0].tolist() == [0.0, 1.0, 0.0] and scores[1].tolist() == [0.0, 0.0, 0.0]
    lp = torch.full((4, 3), -1.0)
    return Batch(dict(response_mask=mask, token_level_scores=scores, old_log_probs=lp, ref_log_prob=lp - 0.5),
                 dict(uid=np.array(["a", "a", "b", "b"], dtype=object)))


# _batch's sequence scores are 1, 0 (group a) and 1, 1 (group b), on the last real token of each response.
_STD = (1.74 / 7) ** 0.5  # reinforce_pp: see the arithmetic below
EXPECTED = {
    # no std division: score − group mean = 1 − 0.5, 0 − 0.5 (group a) and 1 − 1 twice (group b), on real tokens
    "grpo": [[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
    "dr_grpo": [[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
    # score − mean of the others in the group: 1 − 0 = 1, 0 − 1 = −1 (group a); 1 − 1 = 0 twice (group b)
    "rloo": [[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
    # reward-to-go with γ = 0.9 on the real tokens: [0.9, 1], [0, 0, 0], [1], [0.9, 1]; their mean is 4.8 / 8 = 0.6,
    # deviations 0.3, 0.4 | −0.6 ×3 | 0.4 | 0.3, 0.4, squared sum 2·0.09 + 3·0.16 + 3·0.36 = 1.74, unbiased
    # variance 1.74 / 7; advantage = deviation / std (1e-8 of eps is below the tolerance)
    "reinforce_pp": [[0.3 / _STD, 0.4 / _STD, 0.0], [-0.6 / _STD] * 3, [0.4 / _STD, 0.0, 0.0],
                     [0.3 / _STD, 0.4 / _STD, 0.0]],
}


@pytest.mark.parametrize("est", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_each_estimator_is_dispatched(est):
    cfg = load_config(None, [f"algorithm.adv_estimator={est}", "algorithm.norm_adv_by_std_in_grpo=false",
                             "algorithm.gamma=0.9"]).algorithm
    out, metrics = compute_advantage(_batch(), cfg)
    assert torch.allclose(out["advantages"], torch.tensor(EXPECTED[est]), atol=1e-6) and metrics == {}


@pytest.mark.parametrize("uid", [np.array(["0-1", "0-1", "0-2", "0-2"], dtype=object), np.array([3, 3, 4, 4]),
                                 torch.tensor([3, 3, 4, 4]), [3, 3, 4, 4]], ids=["object_str", "numpy_int", "tensor", "list"])
@pytest.mark.parametrize("est", ["grpo", "rloo"])
def test_uid_types_group_the_same(est, uid):
    """A tensor uid lands in the Batch as an object array of 0-dim tensors (hashed by identity): still grouped."""
    cfg = load_config(None, [f"algorithm.adv_estimator={est}", "algorithm.norm_adv_by_std_in_grpo=false"]).algorithm
    b = _batch()
    out, _ = compute_advantage(Batch(b.tensors, dict(uid=uid)), cfg)
    # groups {0, 1} scores 1, 0 and {2, 3} scores 1, 1: GRPO ±0.5, 0; RLOO ±1, 0
    top = 0.5 if est == "grpo" else 1.0
    assert out["advantages"][:, 0].tolist() == [top, -top, 0.0, 0.0]


def test_kl_in_reward_penalises_token_rewards():
    cfg = load_config(None, ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.kl_penalty=k1"]).algorithm
    out, metrics = compute_advantage(_batch(), cfg)
    # k1 = old − ref = 0.5 on every real token; reward = score − 0.1·0.5
    assert torch.allclose(out["token_level_rewards"][0], torch.tensor([-0.05, 0.95, 0.0]))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5)
