"""PPO-with-a-critic math by hand: GAE on a worked example, the clipped value loss, the KL controllers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hybrid_rl.algorithms import (AdaptiveKLController, FixedKLController, clipped_value_loss, gae_advantage,
                                  make_kl_controller)
from hybrid_rl.batch import Batch
from hybrid_rl.config import ConfigError, load_config
from hybrid_rl.phases.advantage import compute_advantage, kl_in_reward_stats


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


# --------------------------------------------------------------------------- GAE
def test_gae_worked_example():
    """SEEDS §1: δ_t = r_t + γV_{t+1} − V_t, A_t = Σ(γλ)^k δ_{t+k}, returns = A + V. Sparse outcome reward on the
    last token, γ = 0.99, λ = 0.95, V = [0.2, 0.4, 0.5] (V after the last token is 0):
      δ2 = 1 − 0.5 = 0.5                  A2 = 0.5
      δ1 = 0.99·0.5 − 0.4 = 0.095          A1 = 0.095 + 0.9405·0.5 = 0.56525
      δ0 = 0.99·0.4 − 0.2 = 0.196          A0 = 0.196 + 0.9405·0.56525 = 0.727617625
      returns = A + V = [0.927617625, 0.96525, 1.0]
    A second row, right-padded after two tokens with garbage in the padding, ends its episode there:
      V = [0.1, 0.3], r = [0, 2]: A1 = 2 − 0.3 = 1.7, A0 = 0.99·0.3 − 0.1 + 0.9405·1.7 = 1.79585
    """
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])
    values = t([[0.2, 0.4, 0.5], [0.1, 0.3, float("nan")]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae_advantage(rewards, values, mask, gamma=0.99, lam=0.95)
    raw = [0.727617625, 0.56525, 0.5, 1.79585, 1.7]
    torch.testing.assert_close(ret, t([[0.927617625, 0.96525, 1.0], [1.89585, 2.0, 0.0]]))
    # advantages: the raw A whitened over the 5 real tokens (unbiased std), 0 on padding
    white = (np.array(raw) - np.mean(raw)) / np.std(raw, ddof=1)
    torch.testing.assert_close(adv, t([list(white[:3]), [white[3], white[4], 0.0]]), atol=1e-5, rtol=1e-5)


def test_gae_with_lambda_one_is_return_minus_value():
    """γ = λ = 1 (the CPU recipe): A_t = (sum of the rewards from t on) − V_t, before whitening; returns = reward-to-go."""
    rewards, values, mask = t([[0.0, 0.0, 1.0]]), t([[0.3, 0.6, 0.9]]), t([[1, 1, 1]])
    adv, ret = gae_advantage(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, t([[1.0, 1.0, 1.0]]))
    raw = np.array([0.7, 0.4, 0.1])
    torch.testing.assert_close(adv, t([list((raw - raw.mean()) / raw.std(ddof=1))]), atol=1e-5, rtol=1e-5)


def test_advantage_phase_reads_the_critics_values():
    cfg = load_config(None, ["algorithm.adv_estimator=gae", "algorithm.gamma=0.99", "algorithm.lam=0.95"]).algorithm
    mask = t([[1, 1, 1], [1, 1, 0]])
    batch = Batch(dict(response_mask=mask, token_level_scores=t([[0, 0, 1.0], [0, 2.0, 0]]),
                       values=t([[0.2, 0.4, 0.5], [0.1, 0.3, 0.0]])))
    out, _ = compute_advantage(batch, cfg)
    torch.testing.assert_close(out["returns"][0], t([0.927617625, 0.96525, 1.0]))
    with pytest.raises(ValueError, match="needs the critic's values"):
        compute_advantage(Batch(dict(response_mask=mask, token_level_scores=mask)), cfg)


# --------------------------------------------------------------------------- value loss
def test_value_clipping_by_hand():
    """clip 0.2 around the old values 0.5: token 0 moved up too far (1.0 → 0.7), token 1 down too far (0.0 → 0.3),
    token 2 stayed inside (0.45). Squared errors vs clipped: [1, 0, .0025] vs [1.69, .09, .0025]."""
    vpreds = t([1.0, 0.0, 0.45])[None].requires_grad_(True)
    returns, old, mask = t([[2.0, 0.0, 0.4]]), t([[0.5, 0.5, 0.5]]), t([[1, 1, 1]])
    loss, clipfrac = clipped_value_loss(vpreds, returns, old, mask, cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.09 + 0.0025) / 3)
    assert clipfrac.item() == pytest.approx(2 / 3)  # tokens 0 and 1 take the clipped (larger) error
    loss.backward()
    # the clipped tokens get no gradient (their loss no longer depends on the prediction); token 2: (v − G)/3
    torch.testing.assert_close(vpreds.grad, t([[0.0, 0.0, 0.05 / 3]]))


def test_value_loss_without_clipping_and_with_padding():
    vpreds, returns, old = t([[1.0, 0.0, 9.0]]), t([[2.0, 0.0, 0.0]]), t([[0.5, 0.5, 0.5]])
    mask = t([[1, 1, 0]])  # the third token is padding: ignored
    loss, clipfrac = clipped_value_loss(vpreds, returns, old, mask, cliprange_value=None)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.0) / 2) and clipfrac.item() == 0.0
    # a loose clip range changes nothing; global token counts (gradient accumulation) rescale
    loose, _ = clipped_value_loss(vpreds, returns, old, mask, cliprange_value=100.0)
    assert loose.item() == pytest.approx(loss.item())
    split, _ = clipped_value_loss(vpreds, returns, old, mask, cliprange_value=None, num_tokens=4)
    assert split.item() == pytest.approx(0.5 * 1.0 / 4)


# --------------------------------------------------------------------------- KL controllers
def test_adaptive_kl_controller_update_rule():
    """β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon)."""
    c = AdaptiveKLController(kl_coef=0.1, target_kl=0.05, horizon=1000)
    c.update(current_kl=0.1, n_steps=100)  # error 1.0, clipped to 0.2: ×1.02
    assert c.value == pytest.approx(0.102)
    c.update(current_kl=0.0, n_steps=100)  # error −1, clipped to −0.2: ×0.98
    assert c.value == pytest.approx(0.102 * 0.98)
    before = c.value
    c.update(current_kl=0.055, n_steps=500)  # error 0.1 (inside the clip): ×1.05
    assert c.value == pytest.approx(before * 1.05)
    c.update(current_kl=0.05, n_steps=100)  # on target: unchanged
    assert c.value == pytest.approx(before * 1.05)
    # the state round-trips (checkpoints)
    d = make_kl_controller("adaptive", 1.0, 0.05, 1000)
    d.load_state_dict(c.state_dict())
    assert d.value == c.value


def test_fixed_kl_controller_and_factory():
    f = make_kl_controller("fixed", 0.3)
    assert isinstance(f, FixedKLController) and not isinstance(f, AdaptiveKLController)
    f.update(current_kl=10.0, n_steps=10**6)
    assert f.value == 0.3
    with pytest.raises(ValueError, match="valid: fixed, adaptive"):
        make_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="target_kl > 0"):
        AdaptiveKLController(0.1, 0.0, 100)


def test_kl_in_reward_with_the_controllers_coefficient():
    cfg = load_config(None, ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                             "algorithm.kl_ctrl.kl_coef=0.1"]).algorithm
    mask = t([[1, 1, 0], [1, 0, 0]])
    batch = Batch(dict(response_mask=mask, token_level_scores=t([[0, 1.0, 0], [1.0, 0, 0]]),
                       old_log_probs=t([[-1.0, -1.0, -1.0], [-2.0, 0, 0]]), ref_log_prob=t([[-1.5, -1.5, 0], [-1.0, 0, 0]])),
                  dict(uid=np.array(["a", "b"], dtype=object)))
    out, metrics = compute_advantage(batch, cfg, kl_coef=0.5)  # β from the controller, not kl_ctrl.kl_coef
    # k1 = old − ref: [0.5, 0.5] and [−1.0]; rewards = scores − 0.5·k1
    torch.testing.assert_close(out["token_level_rewards"], t([[-0.25, 0.75, 0.0], [1.5, 0.0, 0.0]]))
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    # what the adaptive controller is fed: the per-sequence mean KL, summed, and the sequence count
    assert kl_in_reward_stats(batch, cfg) == pytest.approx((0.5 + -1.0, 2.0))


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize("overrides, message", [
    (["critic.ppo_mini_batch_size=5"], "critic.ppo_mini_batch_size=5; lower critic.ppo_mini_batch_size"),
    (["critic.ppo_micro_batch_size_per_device=7"], "critic.ppo_micro_batch_size_per_device=7"),
    (["critic.cliprange_value=0"], "critic.cliprange_value=0.0 must be > 0, or null"),
    (["critic.freeze_actor_steps=-1"], "critic.freeze_actor_steps"),
    (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"], "algorithm.kl_ctrl.horizon > 0"),
])
def test_critic_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, ["algorithm.adv_estimator=gae", *overrides]).validate()


def test_gae_config_builds_a_critic_and_grpo_does_not():
    assert load_config(None, ["algorithm.adv_estimator=gae"]).validate().need_critic
    assert not load_config(None, []).validate().need_critic
    assert math.isclose(load_config(None, ["algorithm.kl_ctrl.kl_coef=0.2"]).algorithm.kl_ctrl.kl_coef, 0.2)


def test_gae_normalisation_modes():
    """``algorithm.gae_whiten``: std whitens, mean only centres (small critic errors stay small), none is raw."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    values = torch.tensor([[0.01, -0.02, 0.03], [0.02, 0.01, -0.01]])
    mask = torch.ones(2, 3)
    raw, ret = gae_advantage(rewards, values, mask, gamma=1.0, lam=1.0, whiten="none")
    assert torch.allclose(raw, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]) - values)
    centred, _ = gae_advantage(rewards, values, mask, gamma=1.0, lam=1.0, whiten="mean")
    assert torch.allclose(centred, raw - raw.mean()) and abs(float(centred.mean())) < 1e-6
    whitened, ret_w = gae_advantage(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(whitened, (raw - raw.mean()) / raw.std()) and torch.equal(ret, ret_w)
    # a batch without any reward: whitening blows the critic's errors up to unit scale, centring does not
    zero = torch.zeros(2, 3)
    assert float(gae_advantage(zero, values, mask, 1.0, 1.0)[0].std()) == pytest.approx(1.0, rel=1e-3)
    assert float(gae_advantage(zero, values, mask, 1.0, 1.0, whiten="mean")[0].abs().max()) < 0.05
    floored, _ = gae_advantage(zero, values, mask, 1.0, 1.0, std_floor=0.1)
    assert torch.allclose(floored, (-values - (-values).mean()) / 0.1)  # the noise's std is under the floor
    assert torch.allclose(gae_advantage(rewards, values, mask, 1.0, 1.0, std_floor=0.1)[0], whitened)  # std > floor
    with pytest.raises(ConfigError, match="algorithm.gae_std_floor"):
        load_config(None, ["algorithm.gae_std_floor=-1"]).validate()
    with pytest.raises(ConfigError, match="algorithm.gae_whiten"):
        load_config(None, ["algorithm.gae_whiten=l2"]).validate()
