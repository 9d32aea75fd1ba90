"""``critic.use_remove_padding``: the critic's packed passes (each micro-batch one row of real tokens, prompts shared
or not) compute what its padded passes compute: the values of every response token, and the whole critic update
(parameters after the optimizer step), on ragged lengths with several samples per prompt and a token budget that cuts
prompt groups apart."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.phases.advantage import compute_advantage
from hybrid_rl.phases.reward import sparse_scores
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybrid_rl.workers.critic import CriticWorker

from helpers import chat_prompts, cpu_dist, generate_batch, grads_at_step, make_cfg

RAGGED = ("data.max_response_length=10", "rollout.forced_lengths=lognormal:4:0.8", "algorithm.adv_estimator=gae",
          "critic.ppo_mini_batch_size=2", "critic.lr=1e-3")
PROMPTS = ("7", "a longer prompt with several words", "3")
LAYOUTS = {"padded": (False, False), "packed": (True, False), "packed_shared": (True, True)}


def _critic(packs: bool, share: bool, *extra: str) -> CriticWorker:
    torch.manual_seed(0)
    cfg = make_cfg(*RAGGED, f"critic.use_remove_padding={str(packs).lower()}", *extra)
    return CriticWorker(cfg, cpu_dist(), share_prompts=share)


@pytest.fixture(scope="module")
def batch(tiny_model_path):
    w = ActorRolloutRefWorker(make_cfg(*RAGGED), cpu_dist())
    b = generate_batch(w, chat_prompts(w, PROMPTS))  # 3 prompts x rollout.n=4 samples, ragged
    assert len(set(b["response_mask"].sum(1).tolist())) >= 3
    scores = torch.randint(0, 2, (len(b),), generator=torch.Generator().manual_seed(0)).float()
    return b.union(tensors=dict(token_level_scores=sparse_scores(scores, b["response_mask"]), scores=scores))


@pytest.mark.parametrize("budget", [[], ["critic.use_dynamic_bsz=true", "critic.max_token_len_per_device=48",
                                         "data.max_prompt_length=38"]], ids=["eight_per_micro_batch", "token_budget"])
def test_packed_values_and_update_equal_padded(batch, budget):
    values, params, stats = {}, {}, {}
    for name, (packs, share) in LAYOUTS.items():
        critic = _critic(packs, share, *budget)
        assert critic.engine.remove_padding is packs and critic.engine.share_prompts is share
        # a value head away from zero (it starts at 0), so that the values depend on the hidden states
        with torch.no_grad():
            critic.model.value_head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        scored = critic.compute_values(batch)
        values[name] = scored["values"]
        scored, _ = compute_advantage(scored, critic.cfg.algorithm)
        stats[name] = {k: s / max(c, 1e-12) for k, (s, c) in critic.update_critic(scored).items()}
        params[name] = {n: p.detach().clone() for n, p in critic.model.named_parameters()}
    mask = batch["response_mask"].bool()
    want = values["padded"]
    assert want[mask].abs().min() > 0 and (want[~mask] == 0).all()
    start = _critic(False, False)
    for name in ("packed", "packed_shared"):
        assert (values[name] - want).abs().max() < 1e-5, name
        moved = max((params["padded"][n] - p).abs().max().item() for n, p in start.model.named_parameters())
        assert moved > 1e-4  # the update moved the critic
        for key in ("critic/grad_norm", "critic/vf_loss", "critic/vpred_mean"):
            assert stats[name][key] == pytest.approx(stats["padded"][key], rel=1e-5), (name, key)
        # AdamW divides by the gradient's running scale, so rounding differences in gradients near 0 move a parameter
        # by up to ~lr: the step itself is compared to 1% of lr
        for n, p in params[name].items():
            assert (p - params["padded"][n]).abs().max() < 1e-2 * 1e-3, (name, n)


def test_the_critic_update_frees_the_gradients_its_step_took(batch):
    """Every trainable parameter of the critic has a gradient at the optimizer step, and none after the update."""
    critic = _critic(True, False)
    scored, _ = compute_advantage(critic.compute_values(batch), critic.cfg.algorithm)
    trainable = [n for n, p in critic.engine.model.named_parameters() if p.requires_grad]
    with grads_at_step(critic.engine) as steps:
        critic.update_critic(scored)
    assert steps and all(sorted(g) == sorted(trainable) for g in steps)
    assert all(p.grad is None for p in critic.engine.model.parameters() if p.requires_grad)


def test_packing_follows_the_actor_unless_set(tiny_model_path):
    cfg = make_cfg(*RAGGED)
    assert CriticWorker(cfg, cpu_dist(), actor_packs=True).engine.remove_padding
    assert not CriticWorker(cfg, cpu_dist(), actor_packs=False).engine.remove_padding
    off = make_cfg(*RAGGED, "critic.use_remove_padding=false")
    critic = CriticWorker(off, cpu_dist(), actor_packs=True, share_prompts=True)
    assert not critic.engine.remove_padding and not critic.engine.share_prompts
