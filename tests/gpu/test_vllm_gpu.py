"""GPU tests of the vLLM rollout engine colocated with the FSDP2 trainer (one process, world of one).

Run on a CUDA machine with vLLM 0.26 installed:  pytest -m gpu tests/gpu/test_vllm_gpu.py
Skips cleanly without CUDA or without vLLM.

The model is the Qwen2.5-0.5B architecture (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocab 151936, tied embeddings) with random weights, built from a config and
saved to a temporary directory: no download. One engine serves all tests (vLLM's cuMem allocator
allows one engine per process), so the tests run in file order and share the trainer.

1. parity: the engine's sampled-token log-probs at T=0.7 match the trainer's forward at T=0.7
   (and clearly do not match T=1, so the engine reports temperature-scaled log-probs);
   greedy decoding matches the trainer's argmax and stops on EOS.
2. the engine's weights after a push equal the pushed tensors, read back through the adapter.
3. staleness canary: a real optimizer step, a push, and the engine's log-probs of the same
   tokens move with the trainer's (a silently stale engine fails).
4. sleep frees memory; level 1 keeps the weights; 50 sleep/wake/push cycles do not grow memory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

pytestmark = pytest.mark.gpu

from helpers import require_vllm_gpu  # noqa: E402

vllm = require_vllm_gpu()

from helpers import (engine_score, expected_engine_weight, masked_mean, raise_sampled_log_probs,  # noqa: E402
                     random_token_prompts as random_prompts, trainer_logprobs, vllm_hybrid)
from hybrid_rl.rollout import vllm as vr  # noqa: E402
from hybrid_rl.rollout.base import SamplingParams  # noqa: E402

EOS, PAD = 151645, 151643  # Qwen2.5's <|im_end|> and <|endoftext|>
TOL = 2e-2  # mean |Δ log-prob| allowed between engine and trainer in bf16
GPU_UTIL = 0.3


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """trainer (FSDP2, world of one) + vLLM engine + sharding manager, as the worker builds them."""
    # the KV cache fills the share (not fitted): the sleep test below measures that share freed
    h = vllm_hybrid(tmp_path_factory, [f"rollout.vllm.gpu_memory_utilization={GPU_UTIL}", "rollout.sleep_level=2",
                                       "data.max_response_length=64", "rollout.vllm.fit_kv_cache=false"],
                    free_cache_engine=True, sleep_level=2)
    yield h
    h.engine.shutdown()


# --------------------------------------------------------------------------- 1. parity
def test_parity_sampled_logprobs_at_temperature(hybrid):
    h = hybrid
    prompts = random_prompts(8, 12, 40, seed=1)
    with h.sm as eng:
        batch = eng.generate(prompts, SamplingParams(n=4, temperature=0.7, max_tokens=48))
    t = batch.tensors
    assert t["responses"].shape == (32, 48) and t["input_ids"].shape == (32, 40 + 48)
    assert torch.equal(t["prompts"].cpu(), prompts.tensors["input_ids"].repeat_interleave(4, 0))
    mask = t["response_mask"]
    assert int(mask.sum()) > 0.9 * 32 * 48  # random weights: EOS is rare
    diff = masked_mean((t["rollout_log_probs"] - trainer_logprobs(h, batch, 0.7)).abs(), mask)
    diff_t1 = masked_mean((t["rollout_log_probs"] - trainer_logprobs(h, batch, 1.0)).abs(), mask)
    print(f"parity T=0.7: mean|Δ|={diff:.5f}; vs the T=1 recomputation: {diff_t1:.5f}")
    assert diff <= TOL
    assert diff_t1 > max(5 * diff, 0.05), "engine log-probs are not temperature-scaled (logprobs_mode?)"


def test_greedy_matches_trainer_and_stops_on_eos(hybrid):
    h = hybrid
    prompts = random_prompts(4, 16, 32, seed=2)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=16)
    with h.sm as eng:
        a = eng.generate(prompts, greedy)
        b = eng.generate(prompts, greedy)
        assert torch.equal(a.tensors["responses"], b.tensors["responses"])
        lp = trainer_logprobs(h, a, 1.0)  # greedy reports T=1 log-probs
        mask = a.tensors["response_mask"]
        diff = masked_mean((a.tensors["rollout_log_probs"] - lp).abs(), mask)
        # the engine's greedy token is the trainer's argmax (bf16 near-ties aside)
        width = a.tensors["responses"].shape[1]
        with torch.no_grad():
            out = h.actor.model(input_ids=a.tensors["input_ids"], attention_mask=a.tensors["attention_mask"],
                                position_ids=a.tensors["position_ids"], use_cache=False)
        argmax = out.logits[:, -width - 1:-1].argmax(-1)
        agree = float((argmax == a.tensors["responses"]).float().mean())
        print(f"greedy: mean|Δ|={diff:.5f}, argmax agreement={agree:.3f}")
        assert diff <= TOL and agree >= 0.9
        # make row 0's 4th greedy token the EOS: generation must stop there, right-padded after it
        row = a.tensors["responses"][0].tolist()
        eos = next(tok for k, tok in enumerate(row[3:], 3) if tok not in row[:k])
        stop_at = row.index(eos)
        eng.eos_token_ids = [eos]
        try:
            c = eng.generate(prompts, greedy)
        finally:
            eng.eos_token_ids = [EOS]
    r0 = c.tensors["responses"][0].tolist()
    assert r0[:stop_at + 1] == row[:stop_at + 1] and all(x == PAD for x in r0[stop_at + 1:])
    assert int(c.tensors["response_mask"][0].sum()) == stop_at + 1
    assert float(c.tensors["rollout_log_probs"][0, stop_at + 1:].abs().sum()) == 0.0


# --------------------------------------------------------------------------- 2. weights read back
def test_adapter_and_pushed_weights(hybrid):
    """If this fails after a vLLM upgrade, hybrid_rl.rollout.vllm.engine_model is the place to fix."""
    h = hybrid
    names = h.engine.llm.collective_rpc(lambda w: type(vr.engine_model(w)).__name__)
    assert names == ["Qwen2ForCausalLM"]
    pushed = {n: t.detach().cpu() for n, t in h.actor.iter_full_params(torch.bfloat16)}
    with h.sm as eng:
        engine_w = dict(eng.named_weights())

    assert len(engine_w) == 1 + 24 * 7 + 1  # embed, 24 × (qkv w+b, o, gate_up, down, 2 norms), final norm
    for name, w in engine_w.items():
        ref = expected_engine_weight(pushed, name)
        assert w.dtype == torch.bfloat16 and torch.equal(w[:ref.shape[0]], ref), name


# --------------------------------------------------------------------------- 3. staleness canary
def test_staleness_canary_real_optimizer_step(hybrid):
    h = hybrid
    prompts = random_prompts(8, 16, 32, seed=3)
    with h.sm as eng:
        batch = eng.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=32))
        engine_before = engine_score(eng, batch)
    mask = batch.tensors["response_mask"]
    trainer_before = trainer_logprobs(h, batch, 1.0)
    assert masked_mean((engine_before - trainer_before).abs(), mask) <= TOL
    raise_sampled_log_probs(h, batch)  # one real AdamW step, and the version bump
    trainer_after = trainer_logprobs(h, batch, 1.0)
    with h.sm as eng:
        assert h.sm.last_sync_bytes > 0  # the new version was pushed
        engine_after = engine_score(eng, batch)
    moved_trainer = masked_mean(trainer_after - trainer_before, mask)
    moved_engine = masked_mean(engine_after - engine_before, mask)
    parity_after = masked_mean((engine_after - trainer_after).abs(), mask)
    stale_gap = masked_mean((engine_after - trainer_before).abs(), mask)
    print(f"canary: trainer moved {moved_trainer:+.4f}, engine moved {moved_engine:+.4f}, "
          f"parity after {parity_after:.5f}, |engine - old trainer| {stale_gap:.4f}")
    assert moved_trainer > 10 * TOL, "the optimizer step did not change the policy enough to test anything"
    assert parity_after <= TOL
    assert stale_gap > 5 * TOL, "engine log-probs still match the old weights"
    assert abs(moved_engine - moved_trainer) <= TOL + 0.05 * abs(moved_trainer)


# --------------------------------------------------------------------------- 4. memory
def test_sleep_level1_keeps_weights(hybrid):
    h = hybrid
    prompts = random_prompts(4, 16, 32, seed=4)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=16)
    h.sm.sleep_level = 1
    try:
        with h.sm as eng:
            a = eng.generate(prompts, greedy)
        assert h.engine.weights_version == h.version[0]  # offloaded, still the pushed version
        with h.sm as eng:
            assert h.sm.last_sync_bytes == 0  # nothing re-pushed
            b = eng.generate(prompts, greedy)
    finally:
        h.sm.sleep_level = 2
    assert torch.equal(a.tensors["responses"], b.tensors["responses"])


def test_sleep_frees_memory_and_50_cycles_do_not_grow(hybrid):
    h = hybrid
    total = torch.cuda.mem_get_info()[1]
    prompts = random_prompts(2, 8, 16, seed=5)
    with h.sm as eng:
        eng.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=8))
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]
    free_asleep = torch.cuda.mem_get_info()[0]
    freed = free_asleep - free_awake
    print(f"sleep(2) freed {freed / 2**30:.2f} GiB (awake free {free_awake / 2**30:.2f}, asleep {free_asleep / 2**30:.2f})")
    assert freed >= 0.25 * GPU_UTIL * total
    free_trace, alloc_trace = [], []
    pushes = h.sm.num_pushes
    for _ in range(50):
        h.version[0] += 1
        with h.sm as eng:
            eng.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=8))
        assert h.engine.weights_version is None  # level 2 discarded them
        torch.cuda.synchronize()
        free_trace.append(torch.cuda.mem_get_info()[0])
        alloc_trace.append(torch.cuda.memory_allocated())
    assert h.sm.num_pushes == pushes + 50
    growth = free_trace[0] - min(free_trace)
    alloc_growth = max(alloc_trace) - alloc_trace[0]
    print(f"50 cycles: free-memory drop {growth / 2**20:.1f} MiB, allocated growth {alloc_growth / 2**20:.1f} MiB")
    assert growth <= 256 * 2**20 and alloc_growth <= 64 * 2**20
    # and the engine still answers correctly afterwards
    with h.sm as eng:
        batch = eng.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=16))
    diff = masked_mean((batch.tensors["rollout_log_probs"] - trainer_logprobs(h, batch, 1.0)).abs(),
                       batch.tensors["response_mask"])
    assert diff <= TOL


# --------------------------------------------------------------------------- 5. rollout.cuda_stream
def _main_stream_of(worker):
    """Runs on the vLLM worker: the model runner's cached ``main_stream`` (None before it was cached)."""
    return vars(vr.model_runner(worker)).get("main_stream")


def test_generation_on_its_own_stream_beside_training_work(hybrid):
    """``rollout.cuda_stream=high``: generate from a background thread, as overlap mode does, on the engine's own
    stream while the main thread keeps its stream busy. vLLM's runner hands its outputs over from that stream, and
    the sampled log-probs still match the trainer's (a race between the streams would not). Before, in the default
    ``shared`` mode, it prints which stream vLLM cached and whether it is the trainer thread's."""
    from concurrent.futures import ThreadPoolExecutor

    from hybrid_rl.rollout.base import GenerationStream

    h = hybrid
    prompts = random_prompts(8, 12, 40, seed=6)
    params = SamplingParams(n=4, temperature=0.7, max_tokens=48)
    with h.sm as eng, ThreadPoolExecutor(1) as pool:
        pool.submit(eng.generate, prompts, params).result()
        main = torch.cuda.current_stream()
    cached = h.engine.llm.collective_rpc(_main_stream_of)[0]
    print(f"shared: vLLM's main_stream {cached}, the trainer thread's {main}: one stream = {cached == main}")
    h.engine.use_stream(GenerationStream(h.dist.device, "high"))
    try:
        assert h.engine.runner_stream_pinned
        a = torch.randn(4096, 4096, device=h.dist.device)
        with h.sm as eng, ThreadPoolExecutor(1) as pool:
            pending = pool.submit(eng.generate, prompts, params)
            for _ in range(100):  # the trainer's stream stays busy while the engine generates
                a = torch.tanh(a @ a)
            batch = pending.result()
            torch.cuda.synchronize()
        assert h.engine.llm.collective_rpc(_main_stream_of)[0] is h.engine.gen_stream.stream
        t = batch.tensors
        assert t["responses"].shape == (32, 48)
        diff = masked_mean((t["rollout_log_probs"] - trainer_logprobs(h, batch, 0.7)).abs(), t["response_mask"])
        print(f"own stream (high priority) beside training work: parity mean|Δ|={diff:.5f}")
        assert diff <= TOL
    finally:
        h.engine.use_stream(GenerationStream(h.dist.device, "shared"))
    assert h.engine.llm.collective_rpc(_main_stream_of)[0] is None  # vLLM's own again
