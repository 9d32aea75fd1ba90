"""``critic.param_offload`` / ``critic.optimizer_offload``: the critic makes one round trip a step, onto its device for
the value pass and off it after the update, and computes what a critic that never leaves its device computes.

The offload is a real round trip on CPU too: the state's bytes go to a host buffer and its storage is freed, then
back."""

from __future__ import annotations

import torch

from hybrid_rl.data import collate_prompts
from hybrid_rl.phases.advantage import compute_advantage
from hybrid_rl.phases.reward import sparse_scores
from hybrid_rl.rollout.base import assemble_rollout
from hybrid_rl.workers.critic import CriticWorker

from helpers import cpu_dist, make_cfg

CRITIC = ("algorithm.adv_estimator=gae", "rollout.n=2", "actor.ppo_micro_batch_size_per_device=8",
          "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size_per_device=2", "critic.lr=1e-3")


def _batch():
    """4 prompts (one shorter, so left-padded) x 2 samples of 6 random tokens, one ended early, scored 0/1."""
    g = torch.Generator().manual_seed(0)
    items = [dict(input_ids=torch.randint(3, 100, (5 - (i == 1) * 2,), generator=g).tolist(), ground_truth="1",
                  data_source="successor", index=i) for i in range(4)]
    responses = torch.randint(3, 100, (8, 6), generator=g)
    responses[2, 3] = 1  # an EOS: a shorter response
    batch = assemble_rollout(collate_prompts(items, 0), responses, torch.zeros(responses.shape), 2, [1], 0)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    return batch.union(tensors=dict(token_level_scores=sparse_scores(scores, batch["response_mask"])))


def _critic(offload: bool) -> CriticWorker:
    torch.manual_seed(0)
    flag = str(offload).lower()
    critic = CriticWorker(make_cfg(*CRITIC, f"critic.param_offload={flag}", f"critic.optimizer_offload={flag}"),
                          cpu_dist())
    return critic


def _count_moves(critic: CriticWorker) -> dict[str, int]:
    """Counts the onloads and offloads of the critic's parameters that move them (a call with nothing to move is
    not one)."""
    counts = {"onload": 0, "offload": 0}
    engine = critic.engine
    onload, offload = engine.onload, engine.offload

    def counted_onload():
        counts["onload"] += engine.params_offloaded
        onload()

    def counted_offload(params=True, optimizer=True):
        counts["offload"] += params and not engine.params_offloaded
        offload(params, optimizer)

    engine.onload, engine.offload = counted_onload, counted_offload
    return counts


def test_an_offloaded_critic_makes_one_round_trip_a_step_and_computes_the_same(tiny_model_path):
    batch = _batch()
    resident, offloaded = _critic(False), _critic(True)
    assert offloaded.engine.params_offloaded  # between steps
    counts = _count_moves(offloaded)
    for step in range(3):  # AdamW's state exists from the first update on: later steps move it as well
        want = compute_advantage(resident.compute_values(batch), resident.cfg.algorithm)[0]
        want_stats = resident.update_critic(want)
        scored = offloaded.compute_values(batch)
        assert not offloaded.engine.params_offloaded  # kept on its device for the update
        scored = compute_advantage(scored, offloaded.cfg.algorithm)[0]
        stats = offloaded.update_critic(scored)
        assert offloaded.engine.params_offloaded and offloaded.engine.optimizer_offloaded
        assert counts == {"onload": step + 1, "offload": step + 1}, step
        assert torch.equal(scored["values"], want["values"]), step
        assert stats == want_stats, step
    assert want["values"][want["response_mask"].bool()].abs().max() > 0  # the updates moved the critic's values
