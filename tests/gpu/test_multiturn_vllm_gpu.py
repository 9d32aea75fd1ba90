"""Multi-turn rollouts on the vLLM engine (GPU): the same continuity the CPU tests check on the transformers engine.

Run on a CUDA machine with vLLM 0.26 installed (its own process: vLLM allows one engine per process):
    pytest -m gpu tests/gpu/test_multiturn_vllm_gpu.py
Skips cleanly without CUDA or without vLLM.

The tiny model (trainer and vLLM engine colocated, a world of one on cuda:0) with an environment that answers
every turn, so every turn goes through the template's glue:

1. at every turn the ids sent to vLLM are an exact prefix of the final trajectory, and the trajectory decodes to
   the template's rendering of the whole conversation;
2. the engine's log-probs of the sampled tokens match the trainer's recomputation over the whole trajectory
   (bf16), observation positions holding 0;
3. the same under ``env.scheduler=async`` (each turn added to the running engine as its environment answers);
4. a stop string spanning several tokens ends a continuation at the token that completes it, as the greedy run
   without the stop string shows (vLLM matches it on detokenized text, keeps it, and keeps the ids as sampled).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

pytestmark = pytest.mark.gpu

from helpers import require_vllm_gpu  # noqa: E402

vllm = require_vllm_gpu()

from helpers import cuda_world_of_one  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.data import PromptDataset, collate_prompts  # noqa: E402
from hybrid_rl.envs.base import ENVS, StepResult  # noqa: E402
from hybrid_rl.envs.multiturn import env_prompt  # noqa: E402
from hybrid_rl.envs.tool_env import ToolEnv  # noqa: E402
from hybrid_rl.rollout.base import Continuation, SamplingParams  # noqa: E402
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402

TURNS = 3
TOL = 2e-2  # mean |Δ log-prob| between engine and trainer in bf16


class EchoEnv(ToolEnv):
    """Answers every turn with ``obs <turn>``: every turn exercises the glue, whatever the model wrote."""

    def step(self, turn: str) -> StepResult:
        self.turns = getattr(self, "turns", 0) + 1
        return StepResult(observations=[f"obs {self.turns}"], done=False, tool_calls=1)


class Recording:
    def __init__(self, engine):
        self.engine, self.sent, self.device = engine, [], engine.device

    def generate_interruptible(self, requests, params, interrupt=None, on_finish=None):
        self.sent.append([list(r.prompt) + list(r.tokens) for r in requests])
        return self.engine.generate_interruptible(requests, params, interrupt, on_finish)


@pytest.fixture(scope="module")
def worker():
    ENVS.register("echo_gpu", EchoEnv)
    dist = cuda_world_of_one()
    cfg = load_config(None, ["model.path=builtin:tiny-qwen2", "trainer.device=cuda", "rollout.name=vllm",
                             "rollout.vllm.enforce_eager=true", "rollout.vllm.max_model_len=512",
                             "data.max_prompt_length=256",
                             "rollout.vllm.gpu_memory_utilization=0.2", "rollout.max_num_seqs=64", "rollout.n=4",
                             "data.train_batch_size=2", "actor.ppo_mini_batch_size=2",
                             "actor.ppo_micro_batch_size_per_device=8", "data.max_response_length=160",
                             "env.name=echo_gpu", f"env.max_turns={TURNS}", "env.max_turn_tokens=6",
                             "trainer.logger=[jsonl]"]).validate()
    w = ActorRolloutRefWorker(cfg, dist, total_training_steps=2)
    yield w
    w.rollout.shutdown()
    ENVS.unregister("echo_gpu")


def _prompts(w):
    system, kwargs = env_prompt(w.cfg)
    ds = PromptDataset([{"digit": 7}, {"digit": 3}], "successor", w.tokenizer, 256, system_prompt=system,
                       template_kwargs=kwargs, keep_messages=True)
    return collate_prompts([ds[i] for i in range(len(ds))], w.tokenizer.pad_token_id)


def test_vllm_turns_continue_the_trajectory_exactly(worker):
    w = worker
    prompts = _prompts(w)
    engine = Recording(w.rollout)
    params = w.sampling_params()
    with w.rollout_mode():
        batch = w.multi_turn.generate(engine, prompts, params, w.rollout.weights_version)
    # (what worker.generate adds around the rollout: the temperature the log-probs are taken at)
    batch = batch.union(temperature=params.logprob_temperature)
    assert batch.tensors["responses"].device == batch.tensors["prompts"].device == w.rollout.device
    t = {k: v.cpu() for k, v in batch.tensors.items()}
    plen = t["prompts"].shape[1]
    full = [t["input_ids"][i][t["attention_mask"][i].bool()].tolist() for i in range(len(batch))]
    turns = t["env_turns"].long().tolist()
    assert max(turns) == TURNS and len(engine.sent) == TURNS
    for k, sent in enumerate(engine.sent, start=1):
        active = [i for i in range(len(batch)) if turns[i] >= k]
        for ctx, i in zip(sent, active):
            assert ctx == full[i][:len(ctx)], f"turn {k} of sample {i}"
            assert len(ctx) == int(t["attention_mask"][i, :plen].sum()) + int((t["turn_ids"][i] == k).nonzero()[0])
    _check_rendering_and_log_probs(w, batch)


def _check_rendering_and_log_probs(w, batch) -> None:
    """Each trajectory decodes to the template's rendering of its conversation, and the trainer's log-probs over it
    match the engine's on the sampled tokens."""
    tok = w.tokenizer
    t = {k: v.cpu() for k, v in batch.tensors.items()}
    full = [t["input_ids"][i][t["attention_mask"][i].bool()].tolist() for i in range(len(batch))]
    turns = t["env_turns"].long().tolist()
    for i in range(len(batch)):
        messages = json.loads(batch.non_tensors["messages"][i])
        resp = t["responses"][i]
        for k in range(1, turns[i]):
            ids = resp[t["turn_ids"][i] == k].tolist()
            text = tok.decode(ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids, skip_special_tokens=False)
            messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": f"obs {k}"}]
        last = resp[t["turn_ids"][i] == turns[i]].tolist()
        expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + \
            tok.decode(last, skip_special_tokens=False)
        assert tok.decode(full[i], skip_special_tokens=False) == expected
    # the trainer's log-probs over the whole trajectory match the engine's on the sampled tokens
    scored = w.compute_log_prob(batch)
    mask = scored.tensors["response_mask"].bool()
    diff = (scored.tensors["old_log_probs"] - scored.tensors["rollout_log_probs"]).abs()[mask]
    assert float(diff.mean()) < TOL
    assert torch.all(scored.tensors["rollout_log_probs"][~mask] == 0)


def test_vllm_async_turns_continue_the_trajectory_exactly(worker):
    """``env.scheduler=async``: each turn joins vLLM's running engine as its environment answers; the trajectories
    are laid out, rendered and scored as under the turn scheduler."""
    w = worker
    w.cfg.env.scheduler = "async"
    try:
        assert w.multi_turn._asynchronous(w.rollout)
        params = w.sampling_params()
        with w.rollout_mode():
            batch = w.multi_turn.generate(w.rollout, _prompts(w), params, w.rollout.weights_version)
    finally:
        w.cfg.env.scheduler = "turns"
    batch = batch.union(temperature=params.logprob_temperature)
    assert int(batch.tensors["env_turns"].max()) == TURNS
    assert w.rollout.last_generate_stats["num_sequences"] == float(batch.tensors["env_turns"].sum())
    _check_rendering_and_log_probs(w, batch)


def test_vllm_stops_at_a_stop_string_spanning_tokens(worker):
    w, tok = worker, worker.tokenizer
    prompt = tok.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    with w.rollout_mode():
        (free,) = w.rollout.generate_interruptible([Continuation(prompt, (), 24)], SamplingParams(temperature=0.0))
        tokens = free.tokens
        assert len(tokens) >= 6
        stop = tok.decode(tokens[2:5], skip_special_tokens=False)
        (cut,) = w.rollout.generate_interruptible([Continuation(prompt, (), 24)],
                                                   SamplingParams(temperature=0.0, stop=(stop,)))
    expected = next(k for k in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:k], skip_special_tokens=False))
    assert cut.tokens == tokens[:expected] and cut.finished
