"""``actor.optimizer_offload``: the actor's optimizer state is on its device only while the update runs (the trainer
wraps the update in ``optimizer_trip``); generation, the push and the log-prob passes run without it, and the run
computes what one that never offloads computes.

The offload is a real round trip on CPU too: the state's bytes go to a host buffer and its storage is freed, then
back."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.telemetry.tracking import Timer
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

from helpers import actor_params, cpu_dist, generate_batch, make_cfg, score_batch


def _worker(offload: bool) -> ActorRolloutRefWorker:
    torch.manual_seed(0)
    w = ActorRolloutRefWorker(make_cfg(f"actor.optimizer_offload={str(offload).lower()}"), cpu_dist(),
                              total_training_steps=10)
    return w


def _state(w) -> list[torch.Tensor]:
    return [v for s in w.actor.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\(\)` has been overridden")
def test_the_optimizer_state_is_on_the_device_for_the_update_only(tiny_model_path):
    plain, off = _worker(False), _worker(True)
    seen: list[bool] = []  # per optimizer step of the offloading actor: its state offloaded at that moment?
    step = off.actor.optimizer.step

    def watched(*args, **kwargs):
        seen.append(off.actor.optimizer_offloaded)
        return step(*args, **kwargs)

    off.actor.optimizer.step = watched
    for i in range(2):
        batches = [score_batch(w, generate_batch(w), seed=i) for w in (plain, off)]
        assert torch.equal(batches[0]["responses"], batches[1]["responses"])  # the same weights generated both
        # after the switch: the parameters are back, the state (from step 2 on, when there is one) still away
        assert not off.actor.params_offloaded and off.actor.optimizer_offloaded == (i > 0)
        timer = Timer()
        with plain.optimizer_trip(timer):
            plain.update_actor(batches[0])
        with off.optimizer_trip(timer):
            off.update_actor(batches[1])
        # the trip's two legs timed on their own, once each: the offloading actor's only
        assert set(timer.pop()) == {"timing/optimizer_onload", "timing/optimizer_offload"}
        assert off.actor.optimizer_offloaded and not plain.actor.optimizer_offloaded
        assert all(t.untyped_storage().nbytes() == 0 for t in _state(off))  # freed in place after the update
    assert seen == [False] * len(seen) and len(seen) >= 2  # every step ran with the state on the device
    a, b = actor_params(plain), actor_params(off)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)  # bit for bit
    off.actor.onload(params=False, optimizer=True)  # to read the state
    sa, sb = plain.actor.optimizer.state_dict()["state"], off.actor.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]) for k in sa)
