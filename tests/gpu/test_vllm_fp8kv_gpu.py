"""GPU test of the vLLM engine with an fp8 KV cache (``rollout.vllm.kv_cache_dtype=fp8``), in a module of its own: vLLM's
cuMem allocator allows one engine per process, and the other modules' engine keeps the default cache dtype.

Run on a CUDA machine with vLLM 0.26 installed:  pytest -m gpu tests/gpu/test_vllm_fp8kv_gpu.py
Skips cleanly without CUDA or without vLLM.

The engine is built as the worker builds it (the Qwen2.5-0.5B shape with random weights, pushed from the trainer),
its cache is fp8, and the log-probs it reports for the tokens it sampled stay near the trainer's forward of the
same tokens: the decoupled loss takes them as the behaviour policy, so the test bounds what fp8 keys and values
(scales 1.0, uncalibrated) cost them, and prints it. After a real optimizer step and a push the engine's log-probs
of the same tokens move as the trainer's did.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

pytestmark = pytest.mark.gpu

from helpers import require_vllm_gpu  # noqa: E402

vllm = require_vllm_gpu()

from helpers import (engine_score, masked_mean, raise_sampled_log_probs,  # noqa: E402
                     random_token_prompts as random_prompts, trainer_logprobs, vllm_hybrid)
from hybrid_rl.rollout.base import SamplingParams  # noqa: E402

BF16_TOL = 2e-2  # test_vllm_gpu.py's bound for a bf16 cache
FP8_TOL = 1e-1


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    h = vllm_hybrid(tmp_path_factory, ["rollout.vllm.gpu_memory_utilization=0.3", "rollout.vllm.engine_kwargs.kv_cache_dtype=fp8",
                                       "data.max_response_length=64"], free_cache_engine=True, sleep_level=1)
    yield h
    h.engine.shutdown()


def test_fp8_kv_cache_log_probs_stay_near_the_trainers(hybrid):
    h = hybrid
    assert h.engine.llm.llm_engine.vllm_config.cache_config.cache_dtype == "fp8"
    prompts = random_prompts(8, 12, 40, seed=1)
    with h.sm as eng:
        batch = eng.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=48))
    t = batch.tensors
    mask = t["response_mask"]
    assert int(mask.sum()) > 0.9 * 32 * 48
    diff = masked_mean((t["rollout_log_probs"] - trainer_logprobs(h, batch, 1.0)).abs(), mask)
    print(f"fp8 KV cache: engine vs trainer mean|Δ log-prob| = {diff:.5f} (bf16 cache bound {BF16_TOL})")
    assert diff <= FP8_TOL

    # a real optimizer step and a push: the engine's log-probs of the same tokens follow the trainer's
    with h.sm as eng:
        engine_before = engine_score(eng, batch)
    trainer_before = trainer_logprobs(h, batch, 1.0)
    raise_sampled_log_probs(h, batch)  # one real AdamW step, and the version bump
    trainer_after = trainer_logprobs(h, batch, 1.0)
    with h.sm as eng:
        assert h.sm.last_sync_bytes > 0
        engine_after = engine_score(eng, batch)
    moved_trainer = masked_mean(trainer_after - trainer_before, mask)
    moved_engine = masked_mean(engine_after - engine_before, mask)
    parity_after = masked_mean((engine_after - trainer_after).abs(), mask)
    print(f"fp8 KV cache after a step: trainer moved {moved_trainer:+.4f}, engine moved {moved_engine:+.4f}, "
          f"parity after {parity_after:.5f}")
    assert moved_trainer > 10 * BF16_TOL, "the optimizer step did not change the policy enough to test anything"
    assert parity_after <= FP8_TOL
    assert abs(moved_engine - moved_trainer) <= FP8_TOL + 0.05 * abs(moved_trainer)
