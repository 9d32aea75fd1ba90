"""The vLLM engine's interruptible generation without vLLM: ``VLLMRolloutEngine.generate_interruptible`` driving a
scripted stand-in for vLLM 0.26's ``LLMEngine`` (``add_request`` / ``step`` / ``abort_request`` /
``has_unfinished_requests``, CUMULATIVE ``RequestOutput``s with the classic per-position log-prob dicts).
What it checks is our side of the contract: one request per continuation with the right context and budget,
aborts on interrupt keeping the partial tokens, segments in request order, ``on_finish`` as requests end. The
real engine is exercised by ``tests/gpu/test_gpu_partial.py``."""

from __future__ import annotations

import threading

import pytest
import torch

from hybrid_rl.rollout.base import Continuation, SamplingParams

import fake_vllm
from helpers import AfterPolls

EOS = fake_vllm.EOS


@pytest.fixture
def engine(monkeypatch):
    return fake_vllm.fixture(monkeypatch)


def test_requests_continue_from_their_partial_tokens(engine):
    eng = engine({1: 1})
    reqs = [Continuation([5, 6], (), 4), Continuation([7], (), 4), Continuation([8, 9], (40, 41), 2, ignore_eos=True)]
    heard: list[int] = []
    segs = eng.generate_interruptible(reqs, SamplingParams(temperature=0.7), on_finish=heard.extend)
    added = eng.llm.llm_engine.added
    assert [a[1] for a in added] == [[5, 6], [7], [8, 9, 40, 41]]  # context = prompt + partial tokens
    assert [a[2]["max_tokens"] for a in added] == [4, 4, 2] and [a[2]["ignore_eos"] for a in added] == [False] * 2 + [True]
    assert added[0][2]["temperature"] == 0.7 and added[0][2]["logprobs"] == 0
    assert segs[1].tokens == [100 + 1, EOS] and segs[1].finished  # EOS at its second step
    assert segs[0].tokens == [102, 103, 104, 105] and segs[2].tokens == [104, 105]
    assert all(s.finished for s in segs) and sorted(heard) == [0, 1, 2] and heard[0] == 1
    assert segs[0].logprobs == pytest.approx([-1.02, -1.03, -1.04, -1.05])


def test_interrupt_aborts_the_unfinished_and_keeps_their_tokens(engine):
    eng = engine({0: 0})
    reqs = [Continuation([5], (), 8), Continuation([6], (), 8), Continuation([7], (), 8)]
    segs = eng.generate_interruptible(reqs, SamplingParams(), interrupt=AfterPolls(3))
    assert segs[0].finished and segs[0].tokens == [EOS]
    assert [len(s.tokens) for s in segs[1:]] == [3, 3] and not any(s.finished for s in segs[1:])
    assert all(len(s.logprobs) == len(s.tokens) for s in segs)
    assert sorted(eng.llm.llm_engine.aborted) == sorted(r for r, *_ in eng.llm.llm_engine.added[1:])
    assert not eng.llm.llm_engine.live
    stop = threading.Event()
    stop.set()  # set before the first step: nothing sampled, nothing invented
    segs = eng.generate_interruptible(reqs, SamplingParams(), interrupt=stop)
    assert all(s.tokens == [] and not s.finished for s in segs)


def test_refusals(engine):
    eng = engine()
    with pytest.raises(ValueError, match="max_tokens < 1"):
        eng.generate_interruptible([Continuation([5], (), 0)], SamplingParams())
    eng.tp_group = object()
    with pytest.raises(NotImplementedError, match="rollout.vllm.tensor_parallel_size"):
        eng.generate_interruptible([Continuation([5], (), 1)], SamplingParams())


def test_interruptible_generation_runs_inside_the_generation_stream(engine):
    """generate_interruptible enters gen_stream.active() around all its engine steps (``rollout.cuda_stream``)."""
    import contextlib

    from hybrid_rl.rollout.base import GenerationStream

    log: list[str] = []

    class Spy(GenerationStream):
        @contextlib.contextmanager
        def active(self):
            log.append("enter")
            yield
            log.append("exit")

    eng = engine()
    eng.gen_stream = Spy(torch.device("cpu"))
    step = eng.llm.llm_engine.step
    eng.llm.llm_engine.step = lambda: log.append("step") or step()
    eng.generate_interruptible([Continuation([5], (), 2)], SamplingParams())
    assert log[0] == "enter" and log[-1] == "exit" and set(log[1:-1]) == {"step"} and len(log) >= 3


def test_a_round_after_a_push_starts_on_a_reset_prefix_cache(engine):
    """Every round after a weight push resets the prefix cache first (a carried sample's context is prefilled again
    under the new weights); rounds between pushes keep it, and a foreground ``generate`` resets a stale one too."""
    eng = engine()
    eng._weights_real = False
    seen: list[int] = []
    eng.llm.reset_prefix_cache = lambda: seen.append(eng.weights_version) or True
    eng.llm.collective_rpc = lambda fn, args=(), kwargs=None: [len(args[0])]
    for v in range(1, 4):
        eng.begin_weight_update()
        eng.load_weights([("w", torch.zeros(2))])
        eng.finish_weight_update(v)
        eng.generate_interruptible([Continuation([5], (), 2)], SamplingParams())
        eng.generate_interruptible([Continuation([5], (), 2)], SamplingParams())
    assert seen == [1, 2, 3]
    eng.begin_weight_update()
    eng.load_weights([("w", torch.zeros(2))])
    eng.finish_weight_update(4)
    eng._check_ready()  # what generate() does first (validation, the foreground round)
    assert seen == [1, 2, 3, 4]


def test_stats_count_the_context_and_what_the_prefix_cache_served(engine):
    """``last_generate_stats`` of a round: the context tokens (prompt + partial tokens) vLLM read from its prefix
    cache (``RequestOutput.num_cached_tokens``), summed over requests: the pipeline's ``rollout/prefix_cache_hit``."""
    eng = engine()
    reqs = [Continuation([5, 6, 7], (40, 41), 2), Continuation([8], (), 2)]
    eng.generate_interruptible(reqs, SamplingParams())
    assert eng.last_generate_stats["cached_tokens"] == 0
    eng.llm.llm_engine.cached = 4
    eng.generate_interruptible(reqs, SamplingParams(), interrupt=AfterPolls(1))
    assert eng.last_generate_stats["cached_tokens"] == 4 + 1
