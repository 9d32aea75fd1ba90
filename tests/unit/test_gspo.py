"""GSPO (``actor.policy_loss=gspo``): one clipped importance ratio per sequence, in its GSPO-token form.

Every expected number below is written out by hand (math.exp on the sequence's mean log-ratio), not taken from the
code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import cpu_dist, generate_batch, make_cfg, score_batch
from hybrid_rl.algorithms.policy_loss import POLICY_LOSSES, gspo_loss
from hybrid_rl.config import ConfigError

# Four sequences, response width 3; clip 1 - 0.1 .. 1 + 0.2.
LOW, HIGH = 0.1, 0.2
OLD = [[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0], [-0.5, 0.0, 0.0], [-1.0, -1.5, 0.0]]
DIFF = [[0.3, -0.1, 0.0], [0.5, 0.4, 0.3], [-0.05, 0.0, 0.0], [-0.4, -0.2, 0.0]]  # log_prob - old_log_prob
MASK = [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
ADV = [1.0, 2.0, -1.0, -0.5]  # one advantage per sequence, on every token (GRPO)

# s_i = exp(mean_t diff): the length-normalised sequence ratio.
S0 = math.exp((0.3 - 0.1) / 2)  # 1.1052: A > 0, inside (0.9, 1.2) -> unclipped, loss -A s = -1.1052
S1 = math.exp((0.5 + 0.4 + 0.3) / 3)  # 1.4918: A > 0, above 1.2 -> clipped, loss -2 * 1.2 = -2.4
S2 = math.exp(-0.05)  # 0.9512: A < 0, inside -> unclipped, loss -A s = +0.9512
S3 = math.exp((-0.4 - 0.2) / 2)  # 0.7408: A < 0, below 0.9 -> clipped, loss max(0.5 * 0.7408, 0.5 * 0.9) = 0.45
SEQ_LOSS = [-1.0 * S0, -2.0 * 1.2, 1.0 * S2, 0.5 * 0.9]
LENGTHS = [2, 3, 1, 2]


def tensors():
    old = torch.tensor(OLD, dtype=torch.float64)
    mask = torch.tensor(MASK, dtype=torch.float64)
    log_prob = (old + torch.tensor(DIFF, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor(ADV, dtype=torch.float64).unsqueeze(-1) * mask
    return log_prob, old, adv, mask


def test_registered_and_hand_values_seq_mean_token_mean():
    assert POLICY_LOSSES["gspo"] is gspo_loss
    log_prob, old, adv, mask = tensors()
    loss, m = gspo_loss(log_prob, old, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                        loss_agg_mode="seq-mean-token-mean")
    # every token of a sequence carries its sequence's loss, so each token mean is the sequence's loss
    assert loss.item() == pytest.approx(sum(SEQ_LOSS) / 4, rel=1e-12)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 4)  # sequences 1 and 3 clipped
    assert m["pg_clipfrac_lower"].item() == 0.0
    assert m["ppo_kl"].item() == pytest.approx(-(0.3 - 0.1 + 0.5 + 0.4 + 0.3 - 0.05 - 0.4 - 0.2) / 8)

    loss.backward()
    # d loss / d log_prob_t = -s_i A_i / (|y_i| * num_seqs) when unclipped, 0 when clipped (and on padding)
    want = [[-S0 * 1.0 / (2 * 4)] * 2 + [0.0], [0.0] * 3, [S2 * 1.0 / (1 * 4), 0.0, 0.0], [0.0] * 3]
    torch.testing.assert_close(log_prob.grad, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_token_mean_weighs_sequences_by_length():
    log_prob, old, adv, mask = tensors()
    loss, _ = gspo_loss(log_prob, old, adv, mask, clip_ratio_low=LOW, clip_ratio_high=HIGH, loss_agg_mode="token-mean")
    assert loss.item() == pytest.approx(sum(n * x for n, x in zip(LENGTHS, SEQ_LOSS)) / 8, rel=1e-12)
    loss.backward()
    want = [[-S0 / 8] * 2 + [0.0], [0.0] * 3, [S2 / 8, 0.0, 0.0], [0.0] * 3]
    torch.testing.assert_close(log_prob.grad, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-15)


def test_global_denominators_and_gspo_sequence_gradient():
    """With the mini-batch's num_seqs the micro-batch losses add up, and the token gradients equal GSPO's own
    sequence-level gradient (autograd through exp(mean log-ratio)) under seq-mean-token-mean."""
    log_prob, old, adv, mask = tensors()
    halves = [gspo_loss(log_prob[rows], old[rows], adv[rows], mask[rows], clip_ratio_low=LOW, clip_ratio_high=HIGH,
                        loss_agg_mode="seq-mean-token-mean", num_seqs=4)[0] for rows in (slice(0, 1), slice(1, 4))]
    assert sum(h.item() for h in halves) == pytest.approx(sum(SEQ_LOSS) / 4, rel=1e-12)
    sum(halves).backward()
    token_form = log_prob.grad.clone()

    # Sequence GSPO written directly: -min(s A, clip(s) A), averaged over sequences.
    lp = log_prob.detach().clone().requires_grad_(True)
    a = torch.tensor(ADV, dtype=torch.float64)
    s = torch.exp(((lp - old) * mask).sum(-1) / mask.sum(-1))
    seq_loss = -torch.minimum(s * a, torch.clamp(s, 1 - LOW, 1 + HIGH) * a)
    seq_loss.mean().backward()
    torch.testing.assert_close(token_form, lp.grad, rtol=1e-12, atol=1e-15)


def test_equal_policies_and_argument_checks():
    # log_prob == old: every s_i = 1, nothing clipped, loss = -mean_i A_i
    _, old, adv, mask = tensors()
    loss, m = gspo_loss(old.clone(), old, adv, mask)  # defaults: 3e-4 / 4e-4, seq-mean-token-mean
    assert loss.item() == pytest.approx(-sum(ADV) / 4) and m["pg_clipfrac"].item() == 0.0
    with pytest.raises(ValueError, match="dual clip"):
        gspo_loss(old, old, adv, mask, clip_ratio_c=3.0)
    with pytest.raises(ValueError, match="same shape"):
        gspo_loss(old, old[:, :2], adv, mask)


def test_worker_trains_with_gspo():
    """actor.policy_loss=gspo: the worker's one loss call picks it by name and reports its sequence clip fraction."""
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    seen = []
    info = POLICY_LOSSES.info("gspo")
    POLICY_LOSSES.unregister("gspo")  # a spy in its place, with its registration's inputs
    POLICY_LOSSES.register("gspo", lambda **kw: seen.append(1) or gspo_loss(**kw), info)
    try:
        cfg = make_cfg("actor.policy_loss=gspo", "actor.clip_ratio_low=3e-4", "actor.clip_ratio_high=4e-4",
                       "actor.loss_agg_mode=seq-mean-token-mean")
        assert cfg.policy_loss == "gspo"
        worker = ActorRolloutRefWorker(cfg, cpu_dist())
        metrics = worker.update_actor(score_batch(worker, generate_batch(worker)))
    finally:
        POLICY_LOSSES.unregister("gspo")
        POLICY_LOSSES.register("gspo", gspo_loss, info)
    assert seen == [1]
    total, weight = metrics["actor/pg_clipfrac"]  # (weighted sum, weight), reduced by the driver
    assert "actor/pg_loss" in metrics and weight > 0 and 0.0 <= total / weight <= 1.0


def test_dual_clip_is_a_config_error():
    with pytest.raises(ConfigError, match=r"actor.clip_ratio_c=3.0: actor.policy_loss=gspo has no dual clip; set "
                                          r"actor.clip_ratio_c=null"):
        make_cfg("actor.policy_loss=gspo", "actor.clip_ratio_c=3.0")
