"""Offload in place on a CUDA device (``hybrid_rl/workers/offload.py``): the device memory is freed, the host buffer
is page-locked, every byte comes back, and an actor that offloads its parameters and optimizer state between updates
trains bit for bit as one that does not. One GPU, no vLLM; skips without CUDA.

    pytest -m gpu tests/gpu/test_offload_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.workers.offload import HostMirror, local

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_a_round_trip_frees_the_device_memory_into_a_pinned_buffer_and_restores_it():
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(4096, 1024, device=dev, generator=g)  # 16 MiB
    b = torch.randn(1000, device=dev, generator=g, dtype=torch.bfloat16)
    want = [a.clone(), b.clone()]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    m = HostMirror(dev)
    m.offload([a, a[10:20], b])
    assert m.pinned and m.buffer.is_pinned()
    assert before - torch.cuda.memory_allocated(dev) >= a.numel() * 4  # a's 16 MiB given back
    m.onload()
    torch.cuda.synchronize()
    assert torch.equal(a, want[0]) and torch.equal(b, want[1])
    ptr = m.buffer.data_ptr()
    m.offload([a, b])  # the same storages: the same buffer
    assert m.buffer.data_ptr() == ptr
    m.onload()
    torch.cuda.synchronize()
    assert torch.equal(a, want[0])
    m.release()


def _shard_bytes_on(engine, device) -> int:
    """The bytes of FSDP2's own sharded parameters of ``engine`` on ``device`` (whatever the module holds now)."""
    from helpers import fsdp_params

    return sum(s.nbytes() for fp in fsdp_params(engine.model)
               for s in [local(fp.sharded_param).untyped_storage()] if s.device == device)


def test_an_actor_offloaded_between_updates_trains_as_one_that_is_not(tiny_model_path):
    """FSDP2 over a world of one on cuda:0, the transformers engine: three steps on one rollout, each through the
    switch (parameters and optimizer state offloaded), the reference pass (the reference offloaded) and the update
    (the optimizer state brought on and put back), give the log-probs and weights of three steps without offload, up
    to the kernels' own run-to-run noise (an offload that lost bytes is off by far more)."""
    from helpers import chat_prompts, cuda_world_of_one, make_cfg, score_batch
    from hybrid_rl.telemetry.tracking import Timer
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    dist = cuda_world_of_one()

    def worker(offload: bool):
        torch.manual_seed(0)
        flag = str(offload).lower()
        cfg = make_cfg("trainer.device=cuda", "rollout.name=hf", "actor.use_kl_loss=true", f"ref.offload={flag}",
                       f"actor.param_offload={flag}", f"actor.optimizer_offload={flag}")
        return ActorRolloutRefWorker(cfg, dist, total_training_steps=10)

    plain, off = worker(False), worker(True)
    with plain.rollout_mode():
        rollout = plain.generate(chat_prompts(plain))
    for step in range(3):
        batches = []
        for w in (plain, off):
            with w.rollout_mode():
                if w is off:  # inside the switch: the actor's state off the device (no optimizer state before step 1)
                    assert w.actor.params_offloaded and w.actor.optimizer_offloaded == (step > 0)
            batches.append(w.compute_ref_log_prob(score_batch(w, rollout, seed=step)))
        for key in ("old_log_probs", "ref_log_prob"):
            torch.testing.assert_close(batches[1][key], batches[0][key], rtol=1e-4, atol=1e-5)
        for w, b in zip((plain, off), batches):
            with w.optimizer_trip(Timer()):
                w.update_actor(b)
        assert off.actor.optimizer_offloaded and off.ref.engine.params_offloaded
        assert _shard_bytes_on(off.ref.engine, dist.device) == 0  # after its pass: the root's shards too
    a, b = (dict(w.actor.model.named_parameters()) for w in (plain, off))
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(local(b[n]).detach(), local(a[n]).detach(), rtol=1e-4, atol=1e-5)
