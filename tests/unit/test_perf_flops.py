"""The FLOPs behind ``perf/mfu_*`` are the ones the passes ran, and ``perf/gen_tokens_per_s`` is the engine's throughput.

1. With ``actor.share_prompts`` on, a tiny model's pass over two GRPO groups is counted by hand (each prompt once,
   responses attending to their prompt's copy, the LM head over the response tokens) and compared with what the
   engine counted and ``perf`` turns into FLOPs and MFU; the worker records each pass's count.
2. Under partial rollouts a batch holds tokens sampled in earlier rounds: the generated-token count and the generate
   time of a step are those of the rounds finished since the previous batch was taken (a scripted engine on a fake
   clock).
"""

from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybrid_rl.batch import Batch
from hybrid_rl.telemetry.perf import ModelFlops, Work, step_perf_metrics
from helpers import LazyFuture

# two GRPO groups of n = 3: prompt lengths P and each sample's response length R_i
PROMPTS = {"g0": (5, (4, 2, 3)), "g1": (3, (1, 5, 2))}
PAD = 0


def explicit_batch(vocab: int) -> Batch:
    """Left-padded prompts and right-padded responses of the lengths in ``PROMPTS`` (distinct prompt tokens)."""
    p_width = max(p for p, _ in PROMPTS.values())
    r_width = max(max(rs) for _, rs in PROMPTS.values())
    g = torch.Generator().manual_seed(0)
    rows, uids = [], []
    for k, (uid, (p, rs)) in enumerate(PROMPTS.items()):
        prompt = torch.randint(1, vocab, (p,), generator=g)
        prompt[0] = k + 1  # the groups' prompts differ
        for r in rs:
            rows.append((prompt, torch.randint(1, vocab, (r,), generator=g)))
            uids.append(uid)
    b = len(rows)
    prompts, responses = torch.full((b, p_width), PAD), torch.full((b, r_width), PAD)
    p_mask, r_mask = torch.zeros(b, p_width, dtype=torch.long), torch.zeros(b, r_width, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        prompts[i, p_width - len(p):], p_mask[i, p_width - len(p):] = p, 1
        responses[i, :len(r)], r_mask[i, :len(r)] = r, 1
    mask = torch.cat([p_mask, r_mask], 1)
    return Batch({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                  "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0), "response_mask": r_mask},
                 {"uid": np.array(uids, dtype=object), "index": np.arange(b)}, {"temperature": 1.0})


# The hand count, for layers 2, hidden 16, intermediate 24, 4 heads of 4 (2 key/value heads), vocabulary 64, untied.
BODY = 2 * ((16 * 16 + 16) + 2 * (16 * 8 + 8) + 16 * 16 + 3 * 16 * 24 + 2 * 16) + 16  # q, k, v, o, MLP, norms; final norm
HEAD = 64 * 16
ATTN = 2 * 4 * 4  # layers × heads × head_dim
TOKENS = (5 + 3) + (4 + 2 + 3) + (1 + 5 + 2)  # each prompt once, then every response: 25
PAIRS = (5 * 6 // 2 + 3 * 4 // 2  # each prompt causal over itself
         + (4 * 5 + 4 * 5 // 2) + (2 * 5 + 2 * 3 // 2) + (3 * 5 + 3 * 4 // 2)  # g0's responses: r·P + r(r+1)/2
         + (1 * 3 + 1 * 2 // 2) + (5 * 3 + 5 * 6 // 2) + (2 * 3 + 2 * 3 // 2))  # g1's: 128 in all
HEAD_ROWS = 4 + 2 + 3 + 1 + 5 + 2  # the response tokens: 17
FORWARD = 2 * BODY * TOKENS + 2 * HEAD * HEAD_ROWS + 4 * ATTN * PAIRS
# every sample's sequence on its own (P + R_i tokens, (P + R_i)(P + R_i + 1)/2 pairs): the equivalent count
EQUIV = 2 * BODY * (3 * 5 + 3 * 3 + HEAD_ROWS) + 2 * HEAD * HEAD_ROWS \
    + 4 * ATTN * (9 * 10 // 2 + 7 * 8 // 2 + 8 * 9 // 2 + 4 * 5 // 2 + 8 * 9 // 2 + 5 * 6 // 2)


def test_hand_count_is_explicit():
    assert (BODY, TOKENS, PAIRS, HEAD_ROWS) == (3984, 25, 128, 17)
    assert FORWARD == 250400 and EQUIV == 383264


@pytest.fixture
def shared_engine():
    from hybrid_rl.workers.fsdp_engine import TrainingEngine

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False)
    return TrainingEngine(Qwen2ForCausalLM(cfg), torch.device("cpu"), torch.float32, trainable=True,
                          remove_padding=True, share_prompts=True)


@pytest.mark.parametrize("micro_batch", [6, 3], ids=["one_micro_batch", "a_group_per_micro_batch"])
def test_shared_prompt_pass_flops_equal_the_hand_count(shared_engine, micro_batch):
    engine, batch = shared_engine, explicit_batch(64)
    flops = ModelFlops.of(engine.model)
    assert (flops.body_params, flops.head_params, flops.attn_width) == (BODY, HEAD, ATTN)
    engine.compute_log_prob(batch, micro_batch, 1.0)
    assert (engine.work.tokens, engine.work.attn_pairs, engine.work.head_rows) == (TOKENS, PAIRS, HEAD_ROWS)
    assert flops.pass_flops(engine.work) == FORWARD
    assert flops.forward(batch["attention_mask"].sum(1), float(batch["response_mask"].sum())) == EQUIV
    # the update: forward, then input and weight gradients of every matmul, attention's backward twice its forward
    engine.work = Work()
    lp, _ = engine.forward(batch, 1.0)
    lp.sum().backward()
    assert flops.pass_flops(engine.work, backward=True) == 3 * FORWARD
    # logged: FLOPs run ÷ (time × GPUs × peak), and the equivalent figure beside it
    out = {"timing/step": 10.0, "timing/gen": 1.0, "timing/update": 2.0, "timing/old_log_prob": 0.5,
           "timing/ref": 0.0, "perf/total_tokens": 41.0, "perf/response_tokens": 17.0, "perf/forward_flops": EQUIV,
           **{f"perf/work/old_log_prob/{k}": v for k, v in zip(("tokens", "attn_pairs", "head_rows"),
                                                                (TOKENS, PAIRS, HEAD_ROWS))},
           **{f"perf/work/update/{k}": v for k, v in zip(("tokens", "attn_pairs", "head_rows"),
                                                          (TOKENS, PAIRS, HEAD_ROWS))},
           **{f"perf/work/ref/{k}": 0.0 for k in ("tokens", "attn_pairs", "head_rows")}}
    step_perf_metrics(out, world=1, gpus_all=1, flops=flops, peak=1e6, ppo_epochs=1, device=torch.device("cpu"))
    assert out["perf/mfu_log_prob"] == pytest.approx(250400 / (0.5 * 1e6))
    assert out["perf/mfu_update"] == pytest.approx(3 * 250400 / (2.0 * 1e6))
    assert out["perf/mfu_update_equiv"] == pytest.approx(3 * 383264 / (2.0 * 1e6))
    assert out["perf/mfu_log_prob_equiv"] == pytest.approx(383264 / (0.5 * 1e6))
    assert "perf/mfu_ref" not in out and not any(k.startswith("perf/work/") for k in out)


def test_lora_backward_counts_the_adapters_weight_gradients_only():
    flops = ModelFlops(body_params=1000, head_params=100, attn_width=8, trainable_body_params=10, head_trainable=False)
    work = Work(tokens=7, attn_pairs=20, head_rows=3)
    forward = 2 * 1000 * 7 + 2 * 100 * 3 + 4 * 8 * 20
    backward = 2 * 1000 * 7 + 2 * 10 * 7 + 2 * 100 * 3 + 8 * 8 * 20  # input gradients, adapters' weights, attention
    assert flops.pass_flops(work, backward=True) == forward + backward


def test_the_worker_counts_each_pass(tiny_model_path):
    """Through the worker on the built-in tiny model: the log-prob pass and the update record the hand count."""
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    from helpers import cpu_dist, make_cfg, score_batch

    cfg = make_cfg("actor.use_remove_padding=true", "actor.share_prompts=true", "rollout.n=3",
                   "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "actor.ppo_epochs=2",
                   "actor.ppo_micro_batch_size_per_device=6", "actor.log_prob_micro_batch_size_per_device=6")
    w = ActorRolloutRefWorker(cfg, cpu_dist())
    batch = score_batch(w, explicit_batch(100))  # runs the log-prob pass
    w.update_actor(batch)
    work = w.take_pass_work()
    counts = {k: (v.tokens, v.attn_pairs, v.head_rows) for k, v in work.items()}
    assert counts == {"old_log_prob": (TOKENS, PAIRS, HEAD_ROWS), "update": (2 * TOKENS, 2 * PAIRS, 2 * HEAD_ROWS)}
    assert w.take_pass_work() == {}


# --------------------------------------------------------------------------- partial rollouts' generate throughput
class ClockedEngine:
    """Lock-step decoding on a fake clock: each step every unfinished request gets one token and 0.5 s pass."""

    def __init__(self, clock: list[float]):
        self.clock, self.rng = clock, random.Random(3)
        self.weights_version = 0
        self.eos_token_ids = [2]
        self.last_generate_stats: dict[str, float] = {}
        self.rounds: list[tuple[int, float]] = []
        """(tokens sampled, seconds) of every call."""

    def generate_interruptible(self, requests, params, interrupt=None, on_finish=None):
        from hybrid_rl.rollout.base import Segment

        start, segs, live = self.clock[0], [Segment() for _ in requests], list(range(len(requests)))
        while live:
            self.clock[0] += 0.5
            ended = []
            for i in live:
                tok = 2 if self.rng.random() < 0.15 else self.rng.randint(3, 50)
                segs[i].tokens.append(tok)
                segs[i].logprobs.append(-1.0)
                if tok == 2 or len(segs[i].tokens) >= requests[i].max_tokens:
                    segs[i].finished = True
                    ended.append(i)
            live = [i for i in live if i not in ended]
            if ended and on_finish:
                on_finish(ended)
            if interrupt is not None and interrupt.is_set():
                break
        self.rounds.append((sum(len(s.tokens) for s in segs), self.clock[0] - start))
        return segs


def test_partial_rollouts_gen_throughput_counts_the_steps_rounds(monkeypatch):
    from hybrid_rl.modes import partial
    from hybrid_rl.modes.partial import PartialRolloutPipeline
    from hybrid_rl.rollout.base import SamplingParams

    clock = [0.0]
    monkeypatch.setattr(partial, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    engine = ClockedEngine(clock)
    per_step, n, max_len = 2, 3, 10
    cfg = SimpleNamespace(rollout=SimpleNamespace(n=n, forced_lengths=None),
                          data=SimpleNamespace(max_response_length=max_len))
    worker = SimpleNamespace(cfg=cfg, rollout=engine, device=torch.device("cpu"), weight_version=0,
                             tokenizer=SimpleNamespace(pad_token_id=PAD),
                             sampling_params=lambda validate=False: SamplingParams(n=n, max_tokens=max_len))

    def push():  # the engine takes the trainer's weights
        engine.weights_version = worker.weight_version

    worker.sharding_manager = SimpleNamespace(sync_weights=push)
    worker.rollout_mode = lambda: contextlib.nullcontext(push())
    pipe = PartialRolloutPipeline(worker, max_staleness=2, stale_policy="error", per_step=per_step, ahead=0.5)
    pipe.executor = SimpleNamespace(submit=LazyFuture, shutdown=lambda wait=True: None)
    counter = iter(range(10**6))

    def next_prompts() -> Batch:
        idx = [next(counter) for _ in range(per_step)]
        ids = torch.tensor([[3 + i % 40, 4, 5] for i in idx])
        return Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                     {"index": np.array(idx), "uid": np.array([str(i) for i in idx], dtype=object)})

    steps, seen, batches, several = 8, 0, [], []
    for step in range(1, steps + 1):
        batch = pipe.take(next_prompts, worker.weight_version, final=step == steps)
        rounds, seen = engine.rounds[seen:], len(engine.rounds)
        several.append(len(rounds) > 1)
        assert batch.meta["partial_gen_tokens"] == sum(t for t, _ in rounds), step
        assert batch.meta["gen_s"] == pytest.approx(sum(s for _, s in rounds)), step
        batches.append(batch)
        if step == steps:
            break
        pipe.start(next_prompts, steps_left=steps - step)
        if step == 3:
            pipe.wait()  # validation: the round finishes uninterrupted, and counts towards the next batch
        if step == 5:
            pipe.peek()  # a checkpoint: the round finishes and the groups outside the window are generated
        worker.weight_version += 1
    assert sum(b.meta["partial_gen_tokens"] for b in batches) == sum(t for t, _ in engine.rounds)
    assert several[5]  # the checkpoint's rounds (the one in flight, then the groups outside the window) count once
    trained = [int(b["response_mask"].sum()) for b in batches]
    assert any(t != b.meta["partial_gen_tokens"] for t, b in zip(trained, batches))  # carried tokens: not the same
    # the metric: the tokens sampled in the step's rounds over those rounds' generate time (one rank here)
    b = batches[4]
    out = {"timing/step": 1.0, "timing/gen": b.meta["gen_s"], "perf/total_tokens": 1.0,
           "perf/response_tokens": float(trained[4]), "rollout/partial_gen_tokens": float(b.meta["partial_gen_tokens"])}
    step_perf_metrics(out, world=1, gpus_all=1, flops=None, peak=None, ppo_epochs=1, device=torch.device("cpu"))
    assert out["perf/gen_tokens_per_s"] == pytest.approx(b.meta["partial_gen_tokens"] / b.meta["gen_s"])
