"""The asynchronous agent loop (``env.scheduler=async``) on vLLM's stream, without vLLM: ``MultiTurnRollout`` over a
``VLLMRolloutEngine`` whose ``LLMEngine`` is the scripted stand-in of ``fake_vllm`` (each step, every running request
samples one token that depends only on its context, so what a trajectory holds does not depend on the order the
loop sends turns in).

1. A slow tool holds only its own trajectory: while one trajectory's tool call waits, another's next turn is
   generated and answered (the slow tool is released by that answer); under ``env.scheduler=turns`` the same
   tool waits out its full time, because every trajectory's next turn waits for every answer.
2. Both schedulers hand the trainer the same batch (tokens, masks, turn ids, counts) from the same engine and
   environments.
3. The rollout's time bound ends turns in flight where they are (the engine's requests aborted, their tokens kept)
   and abandons environments still working.
4. ``VLLMTurnStream`` on its own: requests added while others run, finished ones returned by key, an abort keeps
   what the unfinished ones sampled.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import fake_vllm
from helpers import make_cfg
from hybrid_rl.data import PromptDataset, collate_prompts
from hybrid_rl.envs.base import ENVS, STOPS, StepResult
from hybrid_rl.envs.multiturn import MultiTurnRollout, env_prompt
from hybrid_rl.envs.tool_env import ToolEnv
from hybrid_rl.models import load_tokenizer
from hybrid_rl.rollout.base import Continuation, SamplingParams
from hybrid_rl.rollout.hf import HFRolloutEngine

TURNS = 3
BASE = ["env.name=gate", f"env.max_turns={TURNS}", "env.max_turn_tokens=4", "data.max_response_length=200",
        "data.task=successor", "rollout.n=2", "actor.ppo_micro_batch_size_per_device=4"]
HOLD_S = 2.0
"""How long the slow tool waits for its release before it answers anyway."""


class GateEnv(ToolEnv):
    """Answers every turn with ``obs <turn>`` until the last. The first prompt's trajectories are slow at their first
    turn: the tool waits (up to ``HOLD_S``) for ``GATE``, which the other prompt's trajectories set when their
    second turn is answered; ``RELEASED`` records, per slow call, whether the gate opened before the wait ran out."""

    GATE = threading.Event()
    RELEASED: list[bool] = []

    def step(self, turn: str) -> StepResult:
        self.turns = getattr(self, "turns", 0) + 1
        if self.row.index == 0 and self.turns == 1:
            GateEnv.RELEASED.append(GateEnv.GATE.wait(HOLD_S))
        elif self.row.index == 1 and self.turns == 2:
            GateEnv.GATE.set()
        return StepResult(observations=[f"obs {self.turns}"], done=False, tool_calls=1)


class SlowEnv(ToolEnv):
    def step(self, turn: str) -> StepResult:
        time.sleep(30)
        return StepResult(observations=["late"], done=False)


@pytest.fixture(autouse=True)
def envs():
    ENVS.register("gate", GateEnv)
    ENVS.register("slow_async", SlowEnv)
    GateEnv.GATE.clear()
    GateEnv.RELEASED.clear()
    yield
    ENVS.unregister("gate")
    ENVS.unregister("slow_async")


@pytest.fixture
def engine(monkeypatch):
    return fake_vllm.fixture(monkeypatch)


def _rollout(tiny_model_path, eng, *overrides):
    cfg = make_cfg(*BASE, *overrides)
    tok = load_tokenizer(tiny_model_path)
    system, kwargs = env_prompt(cfg)
    ds = PromptDataset([{"digit": d} for d in (7, 3)], "successor", tok, 2048, system_prompt=system,
                       template_kwargs=kwargs, keep_messages=True)
    prompts = collate_prompts([ds[i] for i in range(len(ds))], tok.pad_token_id)
    loop = MultiTurnRollout(cfg, tok, eng.eos_token_ids)
    params = SamplingParams(n=cfg.rollout.n, temperature=1.0, max_tokens=cfg.data.max_response_length)
    start = time.monotonic()
    batch = loop.generate(eng, prompts, params, version=3)
    return batch, time.monotonic() - start


def test_a_slow_tool_holds_only_its_own_trajectory(tiny_model_path, engine):
    batch, _ = _rollout(tiny_model_path, engine(), "env.scheduler=async")
    assert GateEnv.RELEASED == [True, True]  # the other prompt's second turn was answered during the slow call
    t = batch.tensors
    assert torch.all(t["env_turns"] == TURNS) and torch.all(t["env_stop"] == STOPS.index("max_turns"))


def test_under_the_turn_scheduler_every_turn_waits_for_every_answer(tiny_model_path, engine):
    _rollout(tiny_model_path, engine(), "env.scheduler=turns")
    assert GateEnv.RELEASED == [False, False]  # nobody's second turn ran before the slow calls ended


def test_both_schedulers_hand_the_trainer_the_same_batch(tiny_model_path, engine):
    GateEnv.GATE.set()  # no waiting: the batches alone are compared
    a, _ = _rollout(tiny_model_path, engine(), "env.scheduler=async")
    b, _ = _rollout(tiny_model_path, engine(), "env.scheduler=turns")
    assert set(a.tensors) == set(b.tensors)
    for key in a.tensors:
        assert torch.equal(a.tensors[key], b.tensors[key]), key
    # each turn's tokens follow from its context as the stand-in samples them: 100 + context length + position
    t = a.tensors
    plen = t["prompts"].shape[1]
    for i in range(len(a)):
        ctx = int(t["attention_mask"][i, :plen].sum())
        for k in range(1, TURNS + 1):
            where = (t["turn_ids"][i] == k).nonzero().flatten()
            start = int(where[0])
            assert t["responses"][i, where].tolist() == [100 + ctx + start + j for j in range(4)]
            assert torch.allclose(t["rollout_log_probs"][i, where], -0.01 * t["responses"][i, where].float())


def test_the_time_bound_ends_turns_in_flight_and_abandons_environments(tiny_model_path, engine, monkeypatch):
    eng = engine()
    fake = eng.llm.llm_engine
    step = fake.step
    monkeypatch.setattr(fake, "step", lambda: time.sleep(0.01) or step())
    # turns of up to 10,000 tokens at 10 ms a step: still running when the bound (0.5 s) comes
    batch, took = _rollout(tiny_model_path, eng, "env.scheduler=async", "env.max_turn_tokens=10000",
                           "data.max_response_length=20000", "env.max_rollout_s=0.5")
    t = batch.tensors
    assert took < 10
    assert torch.all(t["env_stop"] == STOPS.index("timeout")) and torch.all(t["env_turns"] == 1)
    sampled = t["response_mask"].sum(dim=1)
    assert torch.all(sampled > 0) and torch.all(sampled < 10000)  # what each turn sampled before the bound, kept
    assert not fake.live and len(fake.aborted) == 4
    # an environment still working at the bound is abandoned: its trajectory ends there, counted as a timeout
    batch, took = _rollout(tiny_model_path, engine(), "env.scheduler=async", "env.name=slow_async",
                           "env.max_rollout_s=1.0")
    t = batch.tensors
    assert took < 10
    assert torch.all(t["env_stop"] == STOPS.index("timeout")) and torch.all(t["env_errors_env_timeout"] == 1)
    assert torch.all(t["env_turns"] == 1)


def test_auto_is_async_on_vllm_and_turns_on_the_transformers_engine(tiny_model_path, engine):
    assert make_cfg(*BASE).env.scheduler == "turns"  # the default
    cfg = make_cfg(*BASE, "env.scheduler=auto")
    loop = MultiTurnRollout(cfg, load_tokenizer(tiny_model_path), [fake_vllm.EOS])
    assert loop._asynchronous(engine())
    hf = HFRolloutEngine.__new__(HFRolloutEngine)
    assert not loop._asynchronous(hf)
    loop.options.scheduler = "async"
    assert loop._asynchronous(hf)  # the batched stream every engine has


def test_the_vllm_stream_takes_requests_while_others_run(engine):
    eng = engine({1: 1})  # the second request added samples EOS at its second step
    fake = eng.llm.llm_engine
    with eng.turn_stream(SamplingParams(temperature=0.5)) as stream:
        a = stream.add(Continuation([5, 6], (), 3))
        b = stream.add(Continuation([7], (40,), 5))
        assert stream.step() == [] and stream.running == 2
        c = stream.add(Continuation([9], (), 2))  # joins while a and b run
        got = dict(stream.step())  # b: EOS
        assert list(got) == [b] and got[b].tokens == [102, fake_vllm.EOS] and got[b].finished
        got = dict(stream.step())  # a: its third token; c: its second
        assert sorted(got) == sorted([a, c])
        assert got[a].tokens == [102, 103, 104] and got[c].tokens == [101, 102]
        assert got[c].logprobs == pytest.approx([-1.01, -1.02])
        d = stream.add(Continuation([8], (), 50))
        stream.step()
        stream.step()
    assert fake.added[2][1] == [9] and fake.added[1][1] == [7, 40]
    assert fake.aborted == [fake.added[3][0]] and not fake.live  # d, aborted on exit
    assert eng.last_generate_stats["num_sequences"] == 4
    assert eng.last_generate_stats["num_tokens"] == 2 + 3 + 2 + 2  # d's two tokens before the abort count


def test_the_vllm_stream_abort_keeps_the_partial_tokens(engine):
    eng = engine()
    with eng.turn_stream(SamplingParams()) as stream:
        k = stream.add(Continuation([5], (), 10))
        stream.step()
        stream.step()
        (key, seg), = stream.abort()
    assert key == k and seg.tokens == [101, 102] and not seg.finished and len(seg.logprobs) == 2
    with pytest.raises(ValueError, match="max_tokens=0"):
        with eng.turn_stream(SamplingParams()) as stream:
            stream.add(Continuation([5], (), 0))
    eng.tp_group = object()
    with pytest.raises(NotImplementedError, match="tensor_parallel_size"):
        with eng.turn_stream(SamplingParams()):
            pass


def test_the_call_pool_collects_outcomes_as_they_end_on_at_most_its_workers():
    from hybrid_rl.envs.deadline import CallPool

    pool = CallPool(3, name="pooltest")
    gate = threading.Event()
    peak = []

    def call(i):
        def run():
            peak.append(sum(t.name.startswith("hybrid_rl-pooltest") for t in threading.enumerate()))
            if i == 0:
                gate.wait(5)
            if i == 1:
                raise KeyError("boom")
            return i * 10
        return run

    for i in range(6):
        pool.submit(f"k{i}", call(i))
    got = {}
    while len(got) < 5:  # everything but the held call ends while it waits
        got.update(pool.collect(5.0))
    assert pool.pending == 1 and "k0" not in got
    assert isinstance(got["k1"].error, KeyError) and got["k4"].value == 40
    gate.set()
    ((key, out),) = pool.collect(5.0)
    assert key == "k0" and out.value == 0 and pool.pending == 0
    assert max(peak) <= 3 and pool.collect(0.0) == []
    pool.close()
