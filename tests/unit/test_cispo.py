"""CISPO (``actor.policy_loss=cispo``): REINFORCE weighted by the importance ratio capped from above and detached.

The expected loss and gradients are written out here from the definition, per token."""

from __future__ import annotations

import pytest
import torch

from helpers import cpu_dist, generate_batch, make_cfg, score_batch
from hybrid_rl.algorithms.policy_loss import POLICY_LOSSES, cispo_loss, ppo_clip_loss
from hybrid_rl.config import ConfigError


def _inputs():
    torch.manual_seed(0)
    old = -torch.rand(3, 5) * 2
    log_prob = (old + torch.tensor([[0.0, 0.1, 2.0, -0.5, 0.0], [1.7, 0.0, 0.3, 0.0, 0.0],
                                    [0.0, -1.0, 0.0, 0.2, 0.4]])).requires_grad_()
    adv = torch.tensor([[1.0] * 5, [-0.5] * 5, [2.0] * 5])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float32)
    return log_prob, old, adv, mask


def test_loss_and_gradient_are_the_capped_weight_times_the_advantage():
    log_prob, old, adv, mask = _inputs()
    high = 0.5
    loss, metrics = cispo_loss(log_prob, old, adv, mask, clip_ratio_high=high)
    loss.backward()
    n = mask.sum()
    want_grad = torch.zeros_like(old)
    want_loss = 0.0
    capped = 0
    for b in range(3):
        for t in range(5):
            if mask[b, t]:
                r = float(torch.exp(log_prob[b, t].detach() - old[b, t]))
                w = min(r, 1 + high)
                capped += r > 1 + high
                want_grad[b, t] = -w * adv[b, t] / n
                want_loss += -w * float(adv[b, t]) * float(log_prob[b, t].detach()) / float(n)
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-5)
    assert torch.allclose(log_prob.grad, want_grad, atol=1e-6)
    assert float(metrics["pg_clipfrac"]) == pytest.approx(capped / float(n))


def test_a_token_far_outside_the_trust_region_keeps_its_gradient_unlike_ppo():
    log_prob, old, adv, mask = _inputs()
    cispo_loss(log_prob, old, adv, mask, clip_ratio_high=0.2)[0].backward()
    cispo_grad = log_prob.grad.clone()
    log_prob.grad = None
    ppo_clip_loss(log_prob, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)[0].backward()
    # token (0, 2): ratio e^2 with A > 0, clipped by PPO (no gradient), capped by CISPO (gradient -(1.2) A / n)
    assert float(log_prob.grad[0, 2]) == 0.0
    assert float(cispo_grad[0, 2]) == pytest.approx(-1.2 * 1.0 / float(mask.sum()), rel=1e-6)


def test_the_worker_trains_with_cispo_and_refuses_a_dual_clip():
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    seen = []
    info = POLICY_LOSSES.info("cispo")
    POLICY_LOSSES.unregister("cispo")
    POLICY_LOSSES.register("cispo", lambda **kw: seen.append(kw["clip_ratio_high"]) or cispo_loss(**kw), info)
    try:
        cfg = make_cfg("actor.policy_loss=cispo", "actor.clip_ratio_high=4.0")
        worker = ActorRolloutRefWorker(cfg, cpu_dist())
        metrics = worker.update_actor(score_batch(worker, generate_batch(worker)))
    finally:
        POLICY_LOSSES.unregister("cispo")
        POLICY_LOSSES.register("cispo", cispo_loss, info)
    assert seen == [4.0] and "actor/pg_loss" in metrics
    with pytest.raises(ConfigError, match=r"actor.policy_loss=cispo has no dual clip"):
        make_cfg("actor.policy_loss=cispo", "actor.clip_ratio_c=3.0")

