"""GPU tests of ``rollout.vllm.engine_process=true``: the vLLM engine core in a process of its own beside the FSDP2 trainer.

Run on a CUDA machine with vLLM 0.26:  pytest -m gpu tests/gpu/test_vllm_process_gpu.py   (skips without either)

Same random Qwen2.5-0.5B-shaped model as ``test_vllm_gpu.py``, in a module of its own: that module builds an
in-process engine, which freezes vLLM's environment for the rest of its process. What is checked here is what the
other process changes: weights pushed as CUDA IPC handles arrive exactly (read back), the engine's log-probs match
the trainer's, an optimizer step reaches the engine through the next push, sleep/wake/push cycles leave the
trainer's memory flat (the handles' blocks come back), and generation in the engine process does not hold the
trainer's Python thread: training steps run beside it at close to their own speed.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

pytestmark = pytest.mark.gpu

from helpers import require_vllm_gpu  # noqa: E402

vllm = require_vllm_gpu()

from helpers import (engine_score, expected_engine_weight, masked_mean, raise_sampled_log_probs, random_token_prompts,  # noqa: E402
                     trainer_logprobs, vllm_hybrid)
from hybrid_rl.rollout.base import SamplingParams  # noqa: E402

TOL = 2e-2  # mean |Δ log-prob| allowed between engine and trainer in bf16


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    h = vllm_hybrid(tmp_path_factory, ["rollout.vllm.gpu_memory_utilization=0.3", "rollout.sleep_level=2",
                                       "data.max_response_length=64", "rollout.vllm.engine_process=true"],
                    free_cache_engine=True, sleep_level=2)
    yield h
    h.engine.shutdown()


def test_engine_runs_in_another_process(hybrid):
    import os

    pids = hybrid.engine.llm.collective_rpc(lambda worker: os.getpid())
    assert hybrid.engine.in_process is False and pids[0] != os.getpid()
    assert hybrid.sm.replayer is None  # record-and-replay cannot see copies made in another process


def test_pushed_weights_arrive_exactly(hybrid):
    h = hybrid
    pushed = {n: t.detach().cpu() for n, t in h.actor.iter_full_params(torch.bfloat16)}
    with h.sm as eng:
        engine_w = dict(eng.named_weights())
    for name, w in engine_w.items():
        ref = expected_engine_weight(pushed, name)
        assert w.dtype == torch.bfloat16 and torch.equal(w[:ref.shape[0]], ref), name
    assert len(engine_w) == 1 + 24 * 7 + 1


def test_parity_and_an_optimizer_step_reaches_the_engine(hybrid):
    h = hybrid
    prompts = random_token_prompts(8, 12, 40, seed=1)
    with h.sm as eng:
        batch = eng.generate(prompts, SamplingParams(n=2, temperature=0.7, max_tokens=32))
    mask = batch.tensors["response_mask"]
    parity = masked_mean((batch.tensors["rollout_log_probs"] - trainer_logprobs(h, batch, 0.7)).abs(), mask)
    before = trainer_logprobs(h, batch, 1.0)
    raise_sampled_log_probs(h, batch)
    after = trainer_logprobs(h, batch, 1.0)
    with h.sm as eng:
        engine_after = engine_score(eng, batch)
    print(f"engine process: parity T=0.7 {parity:.5f}; after a step, |engine - trainer| "
          f"{masked_mean((engine_after - after).abs(), mask):.5f}, |engine - old trainer| "
          f"{masked_mean((engine_after - before).abs(), mask):.4f}")
    assert parity <= TOL
    assert masked_mean((engine_after - after).abs(), mask) <= TOL
    assert masked_mean((engine_after - before).abs(), mask) > 5 * TOL, "the engine still has the old weights"


def test_sleep_wake_push_cycles_keep_trainer_memory_flat(hybrid):
    h = hybrid
    prompts = random_token_prompts(4, 16, 32, seed=4)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=16)
    with h.sm as eng:
        first = eng.generate(prompts, greedy).tensors["responses"].clone()
    torch.cuda.synchronize()
    reserved = []
    for i in range(20):
        h.version[0] += 1  # a new version: every entry pushes all weights again
        with h.sm as eng:
            out = eng.generate(prompts, greedy).tensors["responses"]
        reserved.append(torch.cuda.memory_reserved())
    print(f"trainer reserved after cycles 1, 10, 20: {[round(reserved[i] / 2**30, 2) for i in (0, 9, 19)]} GiB")
    assert torch.equal(out, first)  # same weights pushed 20 times: same greedy answer
    assert reserved[-1] - reserved[1] < 256 * 2**20


def test_training_beside_generation_keeps_its_speed(hybrid):
    """The point of the mode: matmul-and-launch-heavy trainer work on the main thread while the engine process
    generates. Reported: the trainer work's time alone and beside generation (a GPU shared by two processes
    time-slices, so some slow-down is expected; the in-process engine thread measured 2.3-5x on SmolLM2)."""
    h = hybrid
    prompts = random_token_prompts(64, 32, 64, seed=5)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=64)
    x = torch.randn(512, 512, device="cuda")

    def trainer_work() -> float:  # launch-bound on purpose: many small kernels from Python
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3000):
            y = x @ x
            y = torch.relu(y) + 1
        torch.cuda.synchronize()
        return time.perf_counter() - t

    trainer_work()
    alone = trainer_work()
    with h.sm as eng:
        eng.generate(prompts, params)  # warm
        t = time.perf_counter()
        eng.generate(prompts, params)
        gen_alone = time.perf_counter() - t
        done = {}
        th = threading.Thread(target=lambda: done.setdefault("gen", eng.generate(prompts, params)))
        th.start()
        beside = trainer_work()
        th.join()
    print(f"engine process: trainer work alone {alone:.3f} s, beside generation {beside:.3f} s "
          f"({beside / alone:.2f}x); generation alone {gen_alone:.3f} s")
    assert "gen" in done
    assert beside < 2.0 * alone
