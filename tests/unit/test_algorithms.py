"""Tests for hybrid_rl.algorithms against hand-computed values.

Expected numbers are literals worked out by hand (arithmetic in the
comments), never re-derived with the formula under test.
"""

from __future__ import annotations

import math
from functools import partial
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

try:
    import hybrid_rl  # noqa: F401
except ModuleNotFoundError:  # run without an install / pytest pythonpath config
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hybrid_rl.algorithms import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    apply_kl_in_reward,
    decoupled_ppo_loss,
    dr_grpo_advantage,
    entropy_from_logits,
    gae_advantage,
    grpo_advantage,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_loss,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    ppo_clip_loss,
    reinforce_pp_advantage,
    rloo_advantage,
)
from hybrid_rl.algorithms.policy_loss import gspo_loss
from hybrid_rl.algorithms.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    make_correction,
    sequence_mask,
    sequence_truncate,
    token_mask,
    token_truncate,
)
from hybrid_rl.config.algorithm import RolloutCorrectionConfig

LN = math.log


def t(x, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


def close(actual, expected, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    expected_t = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(torch.as_tensor(actual).double(), expected_t, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------
# core: masked helpers
# ---------------------------------------------------------------------------

X = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
XM = [[1, 1, 0], [1, 0, 0]]  # selects 1, 2, 4


def test_masked_sum_and_mean():
    x, m = t(X), t(XM)
    close(masked_sum(x, m), 7.0)  # 1 + 2 + 4
    close(masked_sum(x, m, dim=-1), [3.0, 4.0])
    close(masked_mean(x, m), 7.0 / 3)
    close(masked_mean(x, m, dim=-1), [1.5, 4.0])
    close(masked_mean(x, m.bool(), dim=0), [2.5, 2.0, 0.0])  # empty column -> 0, not NaN


def test_masked_sum_ignores_nan_in_padding():
    x = t([[1.0, 2.0, float("nan")], [4.0, float("inf"), 0.0]])
    close(masked_sum(x, t(XM)), 7.0)


def test_masked_var_and_whiten():
    x, m = t(X), t(XM)
    # values 1, 2, 4; mean 7/3; squared deviations 16/9 + 1/9 + 25/9 = 42/9
    close(masked_var(x, m, unbiased=False), 42 / 9 / 3)  # 14/9
    close(masked_var(x, m), 42 / 9 / 2)  # 7/3
    # (v - 7/3) / sqrt(7/3), sqrt(7/3) = 1.5275252
    w = masked_whiten(x, m)
    close(w[m.bool()], [-0.8728716, -0.2182179, 1.0910895])
    w = masked_whiten(x, m, shift_mean=False)  # + 7/3
    close(w[m.bool()], [1.4604618, 2.1151154, 3.4244228])


def test_masked_var_rejects_degenerate_masks():
    with pytest.raises(ValueError):
        masked_var(t([1.0, 2.0]), t([1, 0]))
    with pytest.raises(ValueError):
        masked_var(t([1.0, 2.0]), t([0, 0]), unbiased=False)


# ---------------------------------------------------------------------------
# core: logprobs / entropy
# ---------------------------------------------------------------------------


def test_logprobs_from_logits_hand_values():
    logits = t(
        [
            [[0.0, LN(3), 0.0], [0.0, LN(3), 0.0]],  # probs 1/5, 3/5, 1/5
            [[LN(2), 0.0, 0.0], [LN(2) + 10, 10.0, 10.0]],  # probs 1/2, 1/4, 1/4 (shift-invariant)
        ]
    )
    labels = torch.tensor([[1, 0], [0, 2]])
    out = logprobs_from_logits(logits, labels)
    assert out.shape == (2, 2) and out.dtype == torch.float32
    close(out, [[LN(0.6), LN(0.2)], [LN(0.5), LN(0.25)]])  # -0.5108, -1.6094, -0.6931, -1.3863


def test_logprobs_from_logits_bf16_computed_in_float32():
    # V = 1000 equal logits: log p = -ln 1000 = -6.9077553. A bf16 logsumexp
    # would round to 6.90625 (off by 1.5e-3), so the tolerance checks float32 math.
    logits = torch.full((2, 3, 1000), 100.0, dtype=torch.bfloat16)
    labels = torch.tensor([[0, 5, 999], [1, 2, 3]])
    out = logprobs_from_logits(logits, labels)
    assert out.dtype == torch.float32
    close(out, torch.full((2, 3), -6.9077553), atol=1e-5)


def test_logprobs_from_logits_many_rows_and_grad():
    # 2 * 1300 rows: more than one internal chunk. Uniform over 4 -> ln(1/4).
    logits = torch.zeros(2, 1300, 4, requires_grad=True)
    labels = torch.zeros(2, 1300, dtype=torch.long)
    out = logprobs_from_logits(logits, labels)
    close(out, torch.full((2, 1300), LN(0.25)))
    out.sum().backward()
    # d log p_0 / d logits = onehot(0) - p = [0.75, -0.25, -0.25, -0.25]
    close(logits.grad[1, 1299], [0.75, -0.25, -0.25, -0.25])


def test_logprobs_and_entropy_gradcheck():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[0, 4, 2], [1, 1, 3]])
    assert torch.autograd.gradcheck(lambda x: logprobs_from_logits(x, labels), (logits,))
    assert torch.autograd.gradcheck(entropy_from_logits, (logits,))


def test_entropy_grad_hand_value():
    # probs .2, .6, .2 ; E[l] = .6 ln 3 ; dH/dl_i = -p_i (l_i - E[l])
    #   = [-.2 * (-.6 ln3), -.6 * (.4 ln3), -.2 * (-.6 ln3)] = [.1318335, -.2636669, .1318335]
    logits = t([[[0.0, LN(3), 0.0]]]).requires_grad_(True)
    entropy_from_logits(logits).sum().backward()
    close(logits.grad, [[[0.1318335, -0.2636669, 0.1318335]]])


def test_bf16_backward_and_masked_vocab():
    logits = torch.tensor([[[0.0, 0.0, float("-inf"), 0.0]]], dtype=torch.bfloat16, requires_grad=True)
    lp = logprobs_from_logits(logits, torch.tensor([[1]]))
    ent = entropy_from_logits(logits)
    close(lp, [[LN(1 / 3)]])  # uniform over the 3 finite logits
    close(ent, [[LN(3)]])
    (lp + ent).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    # logprob grad: onehot(1) - p = [-1/3, 2/3, 0, -1/3]; entropy grad: all l_i = E[l] -> 0
    close(logits.grad, [[[-1 / 3, 2 / 3, 0.0, -1 / 3]]], atol=4e-3)


def test_logprobs_from_logits_shape_mismatch():
    with pytest.raises(ValueError):
        logprobs_from_logits(torch.zeros(2, 3, 4), torch.zeros(2, 2, dtype=torch.long))


def test_entropy_from_logits():
    logits = t(
        [
            [[0.0] * 5, [0.0, LN(3), 0.0, -1e9, -1e9]],  # uniform over 5; probs .2, .6, .2, 0, 0
            [[100.0, 0.0, 0.0, 0.0, 0.0], [7.0] * 5],  # one-hot-ish; uniform again
        ]
    )
    out = entropy_from_logits(logits)
    assert out.shape == (2, 2) and out.dtype == torch.float32
    # ln 5 = 1.6094379; -(2 * .2 ln .2 + .6 ln .6) = 0.9502705; ~0
    close(out, [[LN(5), 0.9502705], [0.0, LN(5)]], atol=1e-5)


def test_entropy_from_logits_bf16():
    out = entropy_from_logits(torch.zeros(1, 2, 1000, dtype=torch.bfloat16))
    assert out.dtype == torch.float32
    close(out, [[6.9077553, 6.9077553]], atol=1e-5)  # ln 1000


# ---------------------------------------------------------------------------
# core: agg_loss
# ---------------------------------------------------------------------------

L = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
LM = [[1, 1, 0], [1, 1, 1]]


def test_agg_loss_modes():
    loss, m = t(L), t(LM)
    close(agg_loss(loss, m, "token-mean"), 18 / 5)  # (1+2+4+5+6)/5 = 3.6
    close(agg_loss(loss, m, "seq-mean-token-sum"), 9.0)  # (3 + 15) / 2
    close(agg_loss(loss, m, "seq-mean-token-mean"), 3.25)  # (1.5 + 5) / 2
    close(agg_loss(loss, m, "seq-mean-token-sum-norm"), 3.0)  # 18 / (2 * 3)
    close(agg_loss(loss, m, "seq-mean-token-sum-norm", norm_length=4), 2.25)  # 18 / (2 * 4)
    close(agg_loss(loss, m, "token-mean", num_tokens=9), 2.0)  # 18 / 9
    close(agg_loss(loss, m, "seq-mean-token-sum", num_seqs=3), 6.0)  # 18 / 3


def test_agg_loss_empty_sequence():
    loss, m = t(L), t([[0, 0, 0], [1, 1, 1]])
    close(agg_loss(loss, m, "seq-mean-token-mean"), 2.5)  # (0 + 5) / 2
    close(agg_loss(loss, m, "token-mean"), 5.0)  # 15 / 3
    close(agg_loss(loss, torch.zeros(2, 3), "token-mean"), 0.0)  # nothing masked in -> 0, not NaN


def test_agg_loss_rejects_bad_arguments():
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-sum-norm"):
        agg_loss(t(L), t(LM), "seq-mean")
    with pytest.raises(ValueError):
        agg_loss(t(L), t([[1, 1], [1, 1]]), "token-mean")
    with pytest.raises(ValueError):
        agg_loss(t(L), t(LM), "token-mean", num_tokens=0)
    assert LOSS_AGG_MODES == ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# [4, 3] mini-batch; 1 + 3 + 2 + 3 = 9 tokens.
MB_LOSS = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [10.0, 11.0, 12.0]]
MB_MASK = [[1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]]
# masked sums per seq: 1, 15, 15, 33 (total 64); masked means: 1, 5, 7.5, 11 (total 24.5)
MB_EXPECTED = {
    "token-mean": 64 / 9,
    "seq-mean-token-sum": 64 / 4,
    "seq-mean-token-mean": 24.5 / 4,
    "seq-mean-token-sum-norm": 64 / (4 * 3),
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_micro_batch_invariance(mode):
    loss, m = t(MB_LOSS), t(MB_MASK)
    whole = agg_loss(loss, m, mode)
    close(whole, MB_EXPECTED[mode])
    halves = [
        agg_loss(loss[s], m[s], mode, num_tokens=9, num_seqs=4) for s in (slice(0, 2), slice(2, 4))
    ]
    close(halves[0] + halves[1], MB_EXPECTED[mode])


def test_agg_loss_local_denominators_are_not_invariant():
    # Why the overrides exist: per-micro-batch token means, averaged, give
    # (16/4 + 48/5) / 2 = 6.8 instead of 64/9 = 7.11.
    loss, m = t(MB_LOSS), t(MB_MASK)
    local = (agg_loss(loss[:2], m[:2], "token-mean") + agg_loss(loss[2:], m[2:], "token-mean")) / 2
    close(local, 6.8)


# ---------------------------------------------------------------------------
# advantages
# ---------------------------------------------------------------------------

# 4 sequences: "p0" has 3 samples, "p1" only one. Scores (masked reward sums):
#   seq0 1+1 = 2, seq1 0, seq2 4, seq3 0.7 (the 9 sits on a padded token).
ADV_REWARDS = [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 4.0], [0.0, 0.7, 9.0]]
ADV_MASK = [[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]]
ADV_INDEX = np.array(["p0", "p0", "p0", "p1"])


def test_grpo_advantage_with_std():
    adv, ret = grpo_advantage(t(ADV_REWARDS), t(ADV_MASK), ADV_INDEX)
    # p0: scores 2, 0, 4; mean 2; unbiased std sqrt((0 + 4 + 4) / 2) = 2
    #   -> 0/2, -2/2, 2/2 (over 2 + 1e-6)
    # p1 (size 1): mean 0, std 1 -> 0.7 / (1 + 1e-6)
    a = 2 / (2 + 1e-6)
    c = 0.7 / (1 + 1e-6)
    close(adv, [[0, 0, 0], [-a, -a, -a], [a, a, a], [c, c, 0]])
    close(ret, adv)


def test_grpo_advantage_without_std_and_dr_grpo():
    expected = [[0, 0, 0], [-2, -2, -2], [2, 2, 2], [0.7, 0.7, 0]]  # s - mean; size-1 group: s - 0
    adv, ret = grpo_advantage(t(ADV_REWARDS), t(ADV_MASK), ADV_INDEX, norm_by_std=False)
    close(adv, expected)
    adv, ret = dr_grpo_advantage(t(ADV_REWARDS), t(ADV_MASK), ADV_INDEX)
    close(adv, expected)
    close(ret, expected)


def test_grpo_advantage_int_index_and_interleaved_groups():
    # groups 7 = {seq0, seq2} scores 1, 3; 5 = {seq1, seq3} scores 0, 0
    # group 7: mean 2, std sqrt((1 + 1) / 1) = sqrt(2) -> -/+ 1/sqrt(2) = 0.7071068
    # group 5: all equal -> 0 / (0 + eps) = 0
    rewards = t([[1.0, 0.0], [0.0, 0.0], [1.0, 2.0], [0.0, 0.0]])
    adv, _ = grpo_advantage(rewards, torch.ones(4, 2), np.array([7, 5, 7, 5]))
    close(adv, [[-0.7071068] * 2, [0, 0], [0.7071068] * 2, [0, 0]], atol=1e-5)


# Group-id containers: torch tensors (also 0-dim tensors in a list or object array, which hash by
# identity), numpy int/str/object arrays (uids look like "0-12"), and plain lists.
GROUP_INDEXES = {
    "torch_long": lambda: torch.tensor([7, 5, 7, 5]),
    "torch_float": lambda: torch.tensor([7.0, 5.0, 7.0, 5.0]),
    "list_of_0dim_tensors": lambda: list(torch.tensor([7, 5, 7, 5])),
    "object_array_of_tensors": lambda: np.array(list(torch.tensor([7, 5, 7, 5])) + [None], dtype=object)[:4],
    "numpy_int": lambda: np.array([7, 5, 7, 5]),
    "numpy_str": lambda: np.array(["0-7", "0-5", "0-7", "0-5"]),
    "numpy_object_str": lambda: np.array(["0-7", "0-5", "0-7", "0-5"], dtype=object),
    "list_int": lambda: [7, 5, 7, 5],
    "list_numpy_scalars": lambda: list(np.array([7, 5, 7, 5])),
    "list_str": lambda: ["0-7", "0-5", "0-7", "0-5"],
}


@pytest.mark.parametrize("kind", GROUP_INDEXES)
def test_group_index_types_give_the_same_groups(kind):
    # groups {seq0, seq2} scores 1, 3 and {seq1, seq3} scores 0, 0 (as in the interleaved test above)
    rewards = t([[1.0, 0.0], [0.0, 0.0], [1.0, 2.0], [0.0, 0.0]])
    mask = torch.ones(4, 2)
    s = 0.7071068  # (3 - 2) / sqrt(2)
    close(grpo_advantage(rewards, mask, GROUP_INDEXES[kind]())[0], [[-s] * 2, [0, 0], [s] * 2, [0, 0]], atol=1e-5)
    close(dr_grpo_advantage(rewards, mask, GROUP_INDEXES[kind]())[0], [[-1] * 2, [0, 0], [1] * 2, [0, 0]])
    close(rloo_advantage(rewards, mask, GROUP_INDEXES[kind]())[0], [[-2] * 2, [0, 0], [2] * 2, [0, 0]])  # 1 - 3, 3 - 1


def test_tensor_group_index_two_rows():
    # the reported case: a tensor index used to put each row in its own group -> [1, 0] and RLOO zeros
    r, m = t([[1.0], [0.0]]), torch.ones(2, 1)
    close(grpo_advantage(r, m, torch.tensor([0, 0]))[0], [[0.7071068], [-0.7071068]], atol=1e-5)
    close(rloo_advantage(r, m, torch.tensor([0, 0]))[0], [[1.0], [-1.0]])


def test_group_index_must_be_one_id_per_sequence():
    r, m = t([[1.0], [0.0]]), torch.ones(2, 1)
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantage(r, m, torch.zeros(2, 1))
    with pytest.raises(ValueError, match="scalar"):
        grpo_advantage(r, m, [torch.tensor([0, 1]), torch.tensor([0, 1])])


def test_grpo_advantage_index_length_mismatch():
    with pytest.raises(ValueError):
        grpo_advantage(t(ADV_REWARDS), t(ADV_MASK), ["a", "b"])


def test_rloo_advantage():
    adv, ret = rloo_advantage(t(ADV_REWARDS), t(ADV_MASK), ADV_INDEX)
    # seq0: 2 - (0 + 4)/2 = 0; seq1: 0 - (2 + 4)/2 = -3; seq2: 4 - (2 + 0)/2 = 3; seq3 alone -> 0
    close(adv, [[0, 0, 0], [-3, -3, -3], [3, 3, 3], [0, 0, 0]])
    close(ret, adv)


def test_reinforce_pp_advantage_discount_and_padding():
    rewards = t([[1.0, 0.0, 2.0], [0.0, 4.0, 7.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])  # seq1 is right-padded; its 7 must be ignored
    adv, ret = reinforce_pp_advantage(rewards, mask, gamma=0.5)
    # seq0: G2 = 2, G1 = 0 + .5*2 = 1, G0 = 1 + .5*1 = 1.5
    # seq1: G1 = 4, G0 = 0 + .5*4 = 2
    close(ret, [[1.5, 1.0, 2.0], [2.0, 4.0, 0.0]])
    # whiten 1.5, 1, 2, 2, 4: mean 2.1, unbiased var 5.2/4 = 1.3, std 1.1401754
    # -0.6/std, -1.1/std, -0.1/std, -0.1/std, 1.9/std
    close(adv, [[-0.5262348, -0.9647638, -0.0877058], [-0.0877058, 1.6664102, 0.0]])


def test_gae_advantage_single_sequence():
    # gamma .9, lam .5; V = [.5, .8], r = [0, 1]
    # delta1 = 1 + .9*0 - .8 = .2 ; delta0 = 0 + .9*.8 - .5 = .22
    # A1 = .2 ; A0 = .22 + .45*.2 = .31 ; returns = A + V = [.81, 1.0]
    # whitened two values: +-(a-b)/2 / (|a-b|/sqrt2) = -+0.7071068
    adv, ret = gae_advantage(t([[0.0, 1.0]]), t([[0.5, 0.8]]), t([[1, 1]]), gamma=0.9, lam=0.5)
    close(ret, [[0.81, 1.0]])
    close(adv, [[0.7071068, -0.7071068]], atol=1e-5)


def test_gae_advantage_with_right_padding():
    rewards = t([[0.0, 1.0], [2.0, 5.0]])
    values = t([[0.5, 0.8], [1.0, 3.0]])
    mask = t([[1, 1], [1, 0]])
    adv, ret = gae_advantage(rewards, values, mask, gamma=0.9, lam=0.5)
    # seq0 as above: A = [.31, .2]; seq1: V after its last token is 0 (the 3.0 is padding):
    #   delta0 = 2 + .9*0 - 1 = 1 -> A0 = 1, return 2
    close(ret, [[0.81, 1.0], [2.0, 0.0]])
    # whiten .31, .2, 1: mean .5033333, unbiased var .1880333, std .4336281
    close(adv, [[-0.4458505, -0.6995241], [1.1453747, 0.0]], atol=1e-5)


def test_adv_estimators_registry():
    assert set(ADV_ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"}
    assert ADV_ESTIMATORS["grpo"] is grpo_advantage


# ---------------------------------------------------------------------------
# policy loss
# ---------------------------------------------------------------------------

# clip_ratio_low .2, clip_ratio_high .3 -> ratio clipped to [0.8, 1.3]
#   a: A= 1, r=1.5 -> max(-1.5, -1.3) = -1.3  clipped (above)
#   b: A=-1, r=0.5 -> max( 0.5,  0.8) =  0.8  clipped (below)
#   c: A= 2, r=1.1 -> max(-2.2, -2.2) = -2.2  in range
#   d: A= 1, r=0.5 -> max(-0.5, -0.8) = -0.5  not clipped (A>0 may go down freely)
#   e: A=-1, r=1.5 -> max( 1.5,  1.3) =  1.5  not clipped (A<0 may go up freely)
#   pad: huge ratio, masked out
PPO_OLD = [[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]]
PPO_RATIO = [[1.5, 0.5, 1.1], [0.5, 1.5, math.exp(3.0)]]
PPO_ADV = [[1.0, -1.0, 2.0], [1.0, -1.0, 5.0]]
PPO_MASK = [[1, 1, 1], [1, 1, 0]]


def _ppo_inputs(requires_grad: bool = False):
    old = t(PPO_OLD)
    log_prob = (old + torch.log(t(PPO_RATIO))).requires_grad_(requires_grad)
    return log_prob, old, t(PPO_ADV), t(PPO_MASK)


def test_ppo_clip_loss_asymmetric_clip_and_metrics():
    log_prob, old, adv, mask = _ppo_inputs()
    loss, metrics = ppo_clip_loss(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.3)
    close(loss, -0.34)  # (-1.3 + 0.8 - 2.2 - 0.5 + 1.5) / 5 = -1.7 / 5
    close(metrics["pg_clipfrac"], 0.4)  # a, b out of 5
    close(metrics["pg_clipfrac_lower"], 0.0)
    # mean(old - new) = -(ln1.5 + ln.5 + ln1.1 + ln.5 + ln1.5) / 5 = 0.0960108
    close(metrics["ppo_kl"], 0.0960108)
    # seq-mean-token-sum: (-1.3 + 0.8 - 2.2 + -0.5 + 1.5) / 2 = -0.85
    loss, _ = ppo_clip_loss(
        log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.3, loss_agg_mode="seq-mean-token-sum"
    )
    close(loss, -0.85)
    # global denominator passes through: -1.7 / 10
    loss, _ = ppo_clip_loss(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.3, num_tokens=10)
    close(loss, -0.17)


def test_ppo_clip_loss_gradient_zero_on_clipped_tokens():
    log_prob, old, adv, mask = _ppo_inputs(requires_grad=True)
    loss, _ = ppo_clip_loss(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.3)
    loss.backward()
    # unclipped token: d(-A r)/d logp / 5 = -A r / 5
    #   c: -2*1.1/5 = -0.44 ; d: -1*0.5/5 = -0.1 ; e: 1*1.5/5 = 0.3 ; a, b clipped, pad masked: 0
    close(log_prob.grad, [[0.0, 0.0, -0.44], [-0.1, 0.3, 0.0]])


def test_ppo_clip_loss_dual_clip():
    # clip [0.8, 1.2], c = 3
    #   A=-1,  r=4 -> max(4, 1.2) = 4 ; dual min(4, 3) = 3      (dual active)
    #   A=-.5, r=2 -> max(1, .6)  = 1 ; dual min(1, 1.5) = 1   (not active)
    #   A= 1,  r=4 -> max(-4, -1.2) = -1.2 ; no dual for A > 0 (clipped)
    old = t([[-2.0, -2.0, -2.0]])
    log_prob = (old + torch.log(t([[4.0, 2.0, 4.0]]))).requires_grad_(True)
    adv, mask = t([[-1.0, -0.5, 1.0]]), torch.ones(1, 3)
    loss, metrics = ppo_clip_loss(log_prob, old, adv, mask, clip_ratio_c=3.0)
    close(loss, 0.9333333)  # (3 + 1 - 1.2) / 3 = 2.8 / 3
    close(metrics["pg_clipfrac"], 1 / 3)  # only the third token (-1.2 > -4)
    close(metrics["pg_clipfrac_lower"], 1 / 3)  # only the first
    loss.backward()
    # token 2: d(-A r)/dlogp / 3 = .5 * 2 / 3 ; tokens 1, 3 capped/clipped -> 0
    close(log_prob.grad, [[0.0, 1 / 3, 0.0]])
    loss_no_dual, _ = ppo_clip_loss(log_prob, old, adv, mask)
    close(loss_no_dual, 1.2666667)  # (4 + 1 - 1.2) / 3


def test_ppo_clip_loss_validation():
    log_prob, old, adv, mask = _ppo_inputs()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip_loss(log_prob, old, adv, mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError):
        ppo_clip_loss(log_prob, old, adv[:, :2], mask)
    with pytest.raises(ValueError):
        ppo_clip_loss(log_prob, old, adv, mask, loss_agg_mode="nope")


@pytest.mark.parametrize("method", list(ROLLOUT_CORRECTIONS))
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
def test_decoupled_equals_ppo_when_behaviour_is_proximal(method, loss_agg_mode):
    g = torch.Generator().manual_seed(0)
    prox = -torch.rand(3, 5, generator=g) * 3
    log_prob = (prox + torch.randn(3, 5, generator=g) * 0.4).requires_grad_(True)
    log_prob2 = log_prob.detach().clone().requires_grad_(True)
    adv = torch.randn(3, 5, generator=g)
    mask = t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    kw = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=loss_agg_mode)
    ppo, ppo_m = ppo_clip_loss(log_prob, prox, adv, mask, **kw)
    correction = make_correction(RolloutCorrectionConfig(method=method))  # its default knobs
    dec, dec_m = decoupled_ppo_loss(log_prob2, prox, prox.clone(), adv, mask, correction=correction, **kw)
    assert torch.equal(ppo, dec)
    ppo.backward()
    dec.backward()
    assert torch.equal(log_prob.grad, log_prob2.grad)
    for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        assert torch.equal(ppo_m[k], dec_m[k])
    close(dec_m["is_ratio_mean"], 1.0)
    close(dec_m["is_ratio_max"], 1.0)
    close(dec_m.get("is_truncated_frac", 0.0), 0.0)
    close(dec_m.get("is_masked_frac", 0.0), 0.0)
    assert ("is_masked_frac" in dec_m) != ("is_truncated_frac" in dec_m)  # the one share the correction changes


# log_prob == proximal, so ratio 1 and the per-token PPO loss is just -A.
# Behaviour weights w = pi_prox / pi_behav = [[3, 1], [1.5, (pad) 10]];
# A = [[1, 2], [-1, 1]] -> per-token loss -A = [[-1, -2], [1, -1 (pad)]]; 3 real tokens.
DEC_PROX = [[-1.0, -1.5], [-0.5, -2.0]]
DEC_W = [[3.0, 1.0], [1.5, 10.0]]
DEC_ADV = [[1.0, 2.0], [-1.0, 1.0]]
DEC_MASK = [[1, 1], [1, 0]]


def _decoupled(correction):
    prox = t(DEC_PROX)
    behav = prox - torch.log(t(DEC_W))
    return decoupled_ppo_loss(prox.clone(), prox, behav, t(DEC_ADV), t(DEC_MASK), correction=correction)


def test_decoupled_token_level_truncate_and_mask():
    loss, m = _decoupled(partial(token_truncate, cap=2.0))
    # weights min(w, 2) = 2, 1, 1.5 -> (-1*2 - 2*1 + 1*1.5) / 3 = -2.5 / 3
    close(loss, -0.8333333)
    close(m["is_ratio_mean"], 1.8333333)  # (3 + 1 + 1.5) / 3
    close(m["is_ratio_max"], 3.0)  # the padded 10 is ignored
    close(m["is_truncated_frac"], 1 / 3)
    assert "is_masked_frac" not in m
    loss, m = _decoupled(partial(token_mask, low=0.0, high=2.0))
    # weights 0 (3 > 2), 1, 1.5 -> (0 - 2 + 1.5) / 3; denominator stays 3 tokens
    close(loss, -0.1666667)
    close(m["is_masked_frac"], 1 / 3)
    assert "is_truncated_frac" not in m
    loss, m = _decoupled(partial(token_mask, low=1.2, high=2.0))
    # the band [1.2, 2] also drops the ratio-1 token: weights 0, 0, 1.5 -> 1.5 / 3
    close(loss, 0.5)
    close(m["is_masked_frac"], 2 / 3)


def test_decoupled_sequence_level_truncate_and_mask():
    # seq weights: seq0 3 * 1 = 3, seq1 1.5 (the padded 10 is not in the product)
    loss, m = _decoupled(partial(sequence_truncate, cap=2.0))
    # seq0 weight 2: (-1 - 2) * 2 = -6 ; seq1: 1 * 1.5 -> -4.5 / 3
    close(loss, -1.5)
    close(m["is_ratio_mean"], 2.5)  # per token: 3, 3, 1.5
    close(m["is_ratio_max"], 3.0)
    close(m["is_truncated_frac"], 2 / 3)  # both tokens of seq0
    loss, m = _decoupled(partial(sequence_mask, cap=2.0))
    close(loss, 0.5)  # seq0 dropped: 1.5 / 3
    close(m["is_masked_frac"], 2 / 3)
    assert "is_truncated_frac" not in m


def test_decoupled_no_cap_and_validation():
    prox = t(DEC_PROX)
    behav = prox - torch.log(t(DEC_W))
    loss, m = _decoupled(partial(token_truncate, cap=None))
    close(loss, -1.1666667)  # (-3 - 2 + 1.5) / 3
    close(m["is_truncated_frac"], 0.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        _decoupled(partial(token_truncate, cap=0.0))
    with pytest.raises(ValueError, match="0 <= low < high"):
        _decoupled(partial(token_mask, low=2.0, high=1.0))


def test_decoupled_weights_are_detached():
    prox = t(DEC_PROX)
    behav = (prox - torch.log(t(DEC_W))).requires_grad_(True)
    log_prob = prox.clone().requires_grad_(True)
    loss, _ = decoupled_ppo_loss(log_prob, prox, behav, t(DEC_ADV), t(DEC_MASK))  # default: token_truncate, cap 2
    loss.backward()
    assert behav.grad is None
    # truncate: d(-A r w)/dlogp / 3 at r = 1 -> -A w / 3 = [-2/3, -2/3, 1.5/3], pad 0
    close(log_prob.grad, [[-2 / 3, -2 / 3], [0.5, 0.0]])


def test_policy_losses_registry():
    from hybrid_rl.algorithms.policy_loss import cispo_loss

    assert POLICY_LOSSES == {"ppo": ppo_clip_loss, "decoupled_ppo": decoupled_ppo_loss, "gspo": gspo_loss,
                             "cispo": cispo_loss}


# ---------------------------------------------------------------------------
# KL
# ---------------------------------------------------------------------------


def test_kl_estimators_hand_values():
    logp = t([[-1.0, -2.0, -30.0]])
    ref = t([[-2.0, -1.0, 0.0]])
    close(kl_k1(logp, ref), [[1.0, -1.0, -30.0]])
    close(kl_k2(logp, ref), [[0.5, 0.5, 450.0]])  # .5 * 30^2
    # k3 with x = ref - logp: e^x - x - 1
    #   x = -1: e^-1 = 0.3678794 ; x = 1: e - 2 = 0.7182818 ; x = 30 -> clamped to 20 -> huge -> 10
    close(kl_k3(logp, ref), [[0.3678794, 0.7182818, 10.0]])
    close(kl_penalty(logp, ref, "k3"), [[0.3678794, 0.7182818, 10.0]])
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(logp, ref, "k4")


def test_kl_loss():
    logp = t([[-1.0, -2.0, -30.0], [-1.0, -1.0, -1.0]])
    ref = t([[-2.0, -1.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # k3 masked: .3678794, .7182818, 0 -> token-mean 1.0861612 / 3
    close(kl_loss(logp, ref, mask), 0.3620537)
    # seq-mean-token-mean: (1.0861612 / 2 + 0) / 2
    close(kl_loss(logp, ref, mask, loss_agg_mode="seq-mean-token-mean"), 0.2715403)
    close(kl_loss(logp, ref, mask, kind="k1"), 0.0)  # (1 - 1 + 0) / 3


def test_losses_pass_norm_length_so_trimming_changes_nothing():
    """seq-mean-token-sum-norm divides by a fixed norm_length, not by the width of the (trimmed) tensor."""
    # log_prob == old: ratio 1, per-token loss -A; real tokens A = 1, 2 | 3 -> sum -6; k1 = 1 per real token.
    adv = t([[1.0, 2.0, 0.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0, 0.0]])
    mask = t([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    lp = torch.full((2, 5), -1.0)
    kw = dict(loss_agg_mode="seq-mean-token-sum-norm", num_seqs=2, norm_length=5)
    for width in (5, 3, 2):  # the full width and two trimmed widths
        a, m, p = adv[:, :width], mask[:, :width], lp[:, :width]
        close(ppo_clip_loss(p, p, a, m, **kw)[0], -0.6)  # -6 / (2 * 5)
        close(decoupled_ppo_loss(p, p, p, a, m, **kw)[0], -0.6)
        close(kl_loss(p, p - 1.0, m, kind="k1", **kw), 0.3)  # 3 / (2 * 5)
    # without norm_length the divisor is the width: -6 / (2 * 3) on the trimmed tensor
    close(ppo_clip_loss(lp[:, :3], lp[:, :3], adv[:, :3], mask[:, :3], loss_agg_mode="seq-mean-token-sum-norm")[0], -1.0)


def test_apply_kl_in_reward():
    scores = t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = t([[-1.0, -2.0, -1.0], [-1.0, -1.0, -5.0]])
    ref = t([[-2.0, -1.0, -1.0], [-1.5, -1.0, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    rewards, kl_mean = apply_kl_in_reward(scores, old, ref, mask, kl_coef=0.1)
    # k1 = [[1, -1, 0], [.5, 0, (pad) -5]]; rewards = scores - .1 * k1 on real tokens
    close(rewards, [[-0.1, 0.1, 1.0], [-0.05, 2.0, 0.0]])
    assert isinstance(kl_mean, float)
    close(kl_mean, 0.1)  # (1 - 1 + 0 + .5 + 0) / 5


def test_temperature_inside_the_chunked_kernels_matches_dividing_first():
    """logprobs/entropy at temperature T applied chunk by chunk equal the same ops on logits / T, values and grads."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 5))
    for t in (1.0, 0.7, 1.3):
        a = logits.clone().requires_grad_(True)
        b = logits.clone().requires_grad_(True)
        lp_a, ent_a = logprobs_from_logits(a, labels, t), entropy_from_logits(a, t)
        lp_b, ent_b = logprobs_from_logits(b / t, labels), entropy_from_logits(b / t)
        assert torch.allclose(lp_a, lp_b, atol=1e-12) and torch.allclose(ent_a, ent_b, atol=1e-12)
        (lp_a.sum() + 0.5 * ent_a.sum()).backward()
        (lp_b.sum() + 0.5 * ent_b.sum()).backward()
        assert torch.allclose(a.grad, b.grad, atol=1e-12)
