"""The hf engine's interruptible generation (partial rollouts): interrupting after m tokens and continuing from
prompt + partial tokens with the same weights gives the uninterrupted generation's tokens and log-probs."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.rollout.base import Continuation, SamplingParams

from helpers import chat_prompts, cpu_dist, make_cfg


class AfterSteps:
    """An interrupt that reads as set once m tokens were sampled: the engine polls once before its (only) chunk,
    then once after every decoding step."""

    def __init__(self, m: int):
        self.m, self.polls = m, 0

    def is_set(self) -> bool:
        self.polls += 1
        return self.polls > self.m


@pytest.fixture(scope="module")
def engine_and_prompts(tiny_model_path):
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    w = ActorRolloutRefWorker(make_cfg("data.max_response_length=12"), cpu_dist())
    with w.rollout_mode():  # the actor's weights in the engine
        pass
    prompts = chat_prompts(w)
    mask = prompts["attention_mask"].bool()
    return w.rollout, [prompts["input_ids"][i][mask[i]].tolist() for i in range(len(prompts))]


GREEDY = SamplingParams(n=1, temperature=0.0)


@pytest.mark.parametrize("m", [1, 3, 7])
def test_interrupt_then_continue_equals_uninterrupted(engine_and_prompts, m):
    engine, prompts = engine_and_prompts
    whole = engine.generate_interruptible([Continuation(p, (), 12, ignore_eos=True) for p in prompts], GREEDY)
    assert all(s.finished and len(s.tokens) == 12 for s in whole)
    first = engine.generate_interruptible([Continuation(p, (), 12, ignore_eos=True) for p in prompts], GREEDY,
                                          interrupt=AfterSteps(m))
    assert all(not s.finished and len(s.tokens) == m for s in first)
    rest = engine.generate_interruptible([Continuation(p, tuple(s.tokens), 12 - m, ignore_eos=True)
                                          for p, s in zip(prompts, first)], GREEDY)
    for w, a, b in zip(whole, first, rest):
        assert b.finished
        assert a.tokens + b.tokens == w.tokens
        assert torch.allclose(torch.tensor(a.logprobs + b.logprobs), torch.tensor(w.logprobs), atol=1e-4)


def test_eos_budget_and_on_finish(engine_and_prompts):
    """Rows stop on EOS (unless forced) or at their own budget; on_finish reports each row once."""
    engine, prompts = engine_and_prompts
    eos = engine.eos_token_ids[0]
    reqs = [Continuation(prompts[0], (), 2), Continuation(prompts[1], (), 5), Continuation(prompts[2], (), 4, True)]
    heard: list[int] = []
    segs = engine.generate_interruptible(reqs, SamplingParams(n=1, temperature=1.0), on_finish=heard.extend)
    assert sorted(heard) == [0, 1, 2] and all(s.finished for s in segs)
    assert len(segs[2].tokens) == 4 and len(segs[0].tokens) <= 2 and len(segs[1].tokens) <= 5
    for s, r in zip(segs[:2], reqs[:2]):
        assert len(s.tokens) == r.max_tokens or s.tokens[-1] == eos
        assert eos not in s.tokens[:-1] and len(s.logprobs) == len(s.tokens)
    with pytest.raises(ValueError, match="max_tokens < 1"):
        engine.generate_interruptible([Continuation(prompts[0], (), 0)], GREEDY)


def test_interrupt_before_a_chunk_leaves_it_empty(engine_and_prompts):
    """Chunks not started when the interrupt is set come back empty and unfinished (nothing invented)."""
    import threading

    engine, prompts = engine_and_prompts
    stop = threading.Event()
    stop.set()
    old = engine.max_num_seqs
    engine.max_num_seqs = 2
    try:
        segs = engine.generate_interruptible([Continuation(p, (), 6, True) for p in prompts], GREEDY, interrupt=stop)
    finally:
        engine.max_num_seqs = old
    assert all(s.tokens == [] and not s.finished for s in segs)
