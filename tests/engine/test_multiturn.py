"""Multi-turn rollouts on the transformers engine: exact token continuity across turns, the layout of the batch, and
the trainer's view of it.

1. At every turn the ids sent to the engine are an exact prefix of the final trajectory, with the tiny model's
   template, a Qwen2.5-style tool template (its Jinja below, on the tiny tokenizer) and SmolLM2's (``slow``, where
   the model can be had); and the whole trajectory, decoded, is the template's rendering of the conversation in one
   go (an independent check of the glue).
2. Observation positions get no gradient: changing their sampling log-probs, old log-probs or advantages leaves the
   update's gradient as it was, while the same change on a sampled position moves it.
3. The trainer's log-probs over a multi-turn trajectory equal one forward pass of the plain HF model on the
   concatenated sequence.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import cpu_dist, make_cfg
from hybrid_rl.data import PromptDataset, collate_prompts
from hybrid_rl.envs.base import ENVS, StepResult
from hybrid_rl.envs.tool_env import ToolEnv
from hybrid_rl.envs.multiturn import MultiTurnRollout, check_template, env_prompt
from hybrid_rl.envs.render import TemplateError
from hybrid_rl.models import load_causal_lm, load_tokenizer
from hybrid_rl.rollout.base import RolloutEngine, SamplingParams
from hybrid_rl.rollout.hf import HFRolloutEngine
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

TURNS = 3
MT = ["env.name=echo", f"env.max_turns={TURNS}", "env.max_turn_tokens=5", "data.max_response_length=160",
      "data.task=successor", "actor.ppo_micro_batch_size_per_device=4"]


class EchoEnv(ToolEnv):
    """Answers every turn with ``obs <turn>`` until the last: every turn exercises the glue, whatever the model
    wrote (the tools of ``env.tools`` still reach the prompt, as ToolEnv's)."""

    def step(self, turn: str) -> StepResult:
        self.turns = getattr(self, "turns", 0) + 1
        return StepResult(observations=[f"obs {self.turns}"], done=False, tool_calls=1)


@pytest.fixture(scope="module", autouse=True)
def echo_env():
    ENVS.register("echo", EchoEnv)
    yield
    ENVS.unregister("echo")


class Recording:
    """The engine, recording the context of every continuation it is sent (prompt + tokens so far), per call."""

    def __init__(self, engine):
        self.engine, self.sent = engine, []
        self.eos_token_ids = engine.eos_token_ids

    def generate_interruptible(self, requests, params, interrupt=None, on_finish=None):
        self.sent.append([list(r.prompt) + list(r.tokens) for r in requests])
        return self.engine.generate_interruptible(requests, params, interrupt, on_finish)

    def turn_stream(self, params, interrupt=None):  # the batched stream every engine has, over the recording
        return RolloutEngine.turn_stream(self, params, interrupt)


# a Qwen2.5-Instruct-style template: tools in the system message, tool results grouped into one user message
QWEN_TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# a template that rewrites earlier turns (as Qwen3's drops earlier <think> blocks): not append-only
REWRITING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and not loop.last %}{{- '<|im_start|>assistant\\n[earlier]<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _tokenizer(path: str, template: str | None):
    tok = load_tokenizer(path)
    if template is not None:
        tok.chat_template = template
    return tok


def _prompts(cfg, tok, texts=("7", "3")):
    system, kwargs = env_prompt(cfg)
    ds = PromptDataset([{"digit": int(t)} for t in texts], "successor", tok, 2048, system_prompt=system,
                       template_kwargs=kwargs, keep_messages=True)
    batch = collate_prompts([ds[i] for i in range(len(ds))], tok.pad_token_id)
    return batch, ds


def _run(model_path: str, template: str | None, overrides=(), n: int = 3, seed: int = 0):
    cfg = make_cfg(*MT, f"rollout.n={n}", *overrides)
    tok = _tokenizer(model_path, template)
    model = load_causal_lm(model_path, torch.float32)
    engine = Recording(HFRolloutEngine(model, [tok.eos_token_id], tok.pad_token_id, torch.device("cpu"), seed=seed,
                                       tokenizer=tok))
    prompts, ds = _prompts(cfg, tok)
    loop = MultiTurnRollout(cfg, tok, engine.eos_token_ids)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=cfg.data.max_response_length)
    batch = loop.generate(engine, prompts, params, version=5)
    return cfg, tok, engine, batch, ds


def _trajectories(batch) -> list[list[int]]:
    """Each sample's prompt + everything after it, without padding."""
    t = batch.tensors
    width = t["prompts"].shape[1]
    mask = t["attention_mask"].bool()
    return [t["input_ids"][i][mask[i]].tolist() for i in range(len(batch))] if width else []


def _check_continuity(tok, engine, batch, turns: int = TURNS) -> None:
    t = batch.tensors
    full = _trajectories(batch)
    plen = t["prompts"].shape[1]
    prompt_lens = t["attention_mask"][:, :plen].sum(1).tolist()
    turn_count = t["env_turns"].long().tolist()
    assert max(turn_count) == turns and len(engine.sent) == turns
    for k, sent in enumerate(engine.sent, start=1):
        # the trajectories still going at turn k, in the order the loop sent them
        active = [i for i in range(len(batch)) if turn_count[i] >= k]
        assert len(sent) == len(active)
        for ctx, i in zip(sent, active):
            starts = (t["turn_ids"][i] == k).nonzero().flatten().tolist()
            assert ctx == full[i][:len(ctx)], f"turn {k} of sample {i}: the context sent is not a prefix"
            assert len(ctx) == prompt_lens[i] + starts[0]  # the turn's tokens follow the context at once
    # masks: sampled tokens (and only those) are trained; observation log-probs are 0
    inside = t["attention_mask"][:, plen:].bool()
    assert torch.equal(t["response_mask"].bool(), (t["turn_ids"] > 0) & inside)
    assert torch.all(t["rollout_log_probs"][~t["response_mask"].bool()] == 0)
    assert torch.all(t["token_weight_version"] == 5)


def _check_rendering(tok, batch, kwargs) -> None:
    """Decoded, a trajectory is the template's rendering of its conversation (observations ``obs 1``, ``obs 2``, ...
    after each turn but the last), every turn's text as the model sampled it."""
    t = batch.tensors
    full = _trajectories(batch)
    plen = t["prompts"].shape[1]
    eos = tok.eos_token_id
    for i in range(len(batch)):
        messages = json.loads(batch.non_tensors["messages"][i])
        resp = t["responses"][i]
        turns = int(t["env_turns"][i])
        for k in range(1, turns + 1):
            ids = resp[t["turn_ids"][i] == k].tolist()
            text = tok.decode(ids[:-1] if ids and ids[-1] == eos else ids, skip_special_tokens=False)
            if k == turns:
                expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs) \
                    + tok.decode(ids, skip_special_tokens=False)
            messages = messages + [{"role": "assistant", "content": text}, {"role": "tool", "content": f"obs {k}"}]
        got = tok.decode(full[i], skip_special_tokens=False)
        assert got == expected, (got, expected)
        assert int(t["attention_mask"][i, plen:].sum()) == len(full[i]) - int(t["attention_mask"][i, :plen].sum())


@pytest.mark.parametrize("template", [None, QWEN_TOOL_TEMPLATE], ids=["tiny", "qwen2.5-tools"])
def test_every_turn_sends_a_prefix_of_the_final_trajectory(tiny_model_path, template):
    overrides = ["env.tools=[calculator]"] if template else []  # the Qwen template renders the tools' schemas
    cfg, tok, engine, batch, _ = _run(tiny_model_path, template, overrides)
    _check_continuity(tok, engine, batch)
    _, kwargs = env_prompt(cfg)
    assert ("tools" in kwargs) == bool(template)
    _check_rendering(tok, batch, kwargs)


def test_the_async_scheduler_sends_each_turn_once_as_a_prefix_of_its_trajectory(tiny_model_path):
    """``env.scheduler=async`` on the transformers engine (its batched stream: each step generates the turns
    queued since the last): every turn of every trajectory is sent exactly once, as the exact prefix of its final
    trajectory, and the trajectory is the template's rendering of its conversation."""
    cfg, tok, engine, batch, _ = _run(tiny_model_path, None, ["env.scheduler=async"])
    t = batch.tensors
    full = _trajectories(batch)
    plen = t["prompts"].shape[1]
    expected = []
    for i in range(len(batch)):
        prompt_len = int(t["attention_mask"][i, :plen].sum())
        for k in range(1, int(t["env_turns"][i]) + 1):
            start = int((t["turn_ids"][i] == k).nonzero()[0])
            expected.append(full[i][:prompt_len + start])
    sent = [ctx for call in engine.sent for ctx in call]
    assert sorted(sent) == sorted(expected)
    assert max(t["env_turns"].tolist()) == TURNS
    _check_rendering(tok, batch, env_prompt(cfg)[1])


@pytest.mark.slow
def test_smollm2_template_keeps_continuity(smollm2_path):
    cfg, tok, engine, batch, _ = _run(smollm2_path, None, ["env.observation_role=user"], n=2)
    _check_continuity(tok, engine, batch)
    _check_rendering_role(tok, batch)


def _check_rendering_role(tok, batch) -> None:
    """``_check_rendering`` with the observations in ``user`` messages (SmolLM2's template has no tool role)."""
    t = batch.tensors
    full = _trajectories(batch)
    for i in range(len(batch)):
        messages = json.loads(batch.non_tensors["messages"][i])
        turns = int(t["env_turns"][i])
        resp = t["responses"][i]
        for k in range(1, turns):
            ids = resp[t["turn_ids"][i] == k].tolist()
            text = tok.decode(ids[:-1] if ids and ids[-1] == tok.eos_token_id else ids, skip_special_tokens=False)
            messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": f"obs {k}"}]
        last = resp[t["turn_ids"][i] == turns].tolist()
        expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + \
            tok.decode(last, skip_special_tokens=False)
        assert tok.decode(full[i], skip_special_tokens=False) == expected


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_model_path):
    cfg = make_cfg(*MT)
    tok = _tokenizer(tiny_model_path, REWRITING_TEMPLATE)
    _, ds = _prompts(cfg, tok)
    with pytest.raises(TemplateError, match=r"^env: the chat template of model.path=\S+ is not append-only "):
        check_template(cfg, tok, ds[0]["messages"])
    check_template(cfg, _tokenizer(tiny_model_path, None), ds[0]["messages"])  # the tiny template appends


# --------------------------------------------------------------------------- the trainer's view
@pytest.fixture(scope="module")
def trained(tiny_model_path):
    """A worker with the echo environment and one multi-turn batch through reward, old log-prob and advantage."""
    from hybrid_rl.phases.advantage import compute_advantage
    from hybrid_rl.phases.reward import sparse_scores

    torch.manual_seed(0)
    cfg = make_cfg(*MT, "rollout.n=4", "data.train_batch_size=2", "actor.ppo_mini_batch_size=2")
    worker = ActorRolloutRefWorker(cfg, cpu_dist(), total_training_steps=4)
    prompts, _ = _prompts(cfg, worker.tokenizer)
    with worker.rollout_mode():
        batch = worker.generate(prompts)
    scores = torch.tensor([1.0, 0.0] * (len(batch) // 2))
    batch = batch.union(tensors=dict(token_level_scores=sparse_scores(scores, batch["response_mask"]), scores=scores))
    batch = worker.compute_log_prob(batch)
    batch, _ = compute_advantage(batch, cfg.algorithm)
    return worker, batch


def test_trainer_log_probs_are_one_forward_pass_of_the_whole_trajectory(trained, tiny_model_path):
    worker, batch = trained
    t = batch.tensors
    model = load_causal_lm(tiny_model_path, torch.float32)  # the actor's weights: it has not stepped yet
    plen = t["prompts"].shape[1]
    temperature = batch.meta["temperature"]
    for i, seq in enumerate(_trajectories(batch)):
        p = int(t["attention_mask"][i, :plen].sum())
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0].float() / temperature  # [L, V], one plain pass
        expected = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)[p - 1:]
        n = len(seq) - p
        got = t["old_log_probs"][i, :n]
        assert torch.allclose(got, expected, atol=2e-5), i
        # and the engine sampled its tokens with the same log-probs (observation positions hold 0)
        sampled = t["response_mask"][i, :n].bool()
        assert torch.allclose(t["rollout_log_probs"][i, :n][sampled], expected[sampled], atol=2e-5)
    assert bool((t["response_mask"].sum(1) < t["attention_mask"][:, plen:].sum(1)).all())  # observations exist


def _update_grads(worker, batch) -> dict[str, torch.Tensor]:
    """The gradient of one PPO loss (the whole batch as one micro-batch) at the worker's current weights."""
    a = worker.cfg.actor
    worker.actor.zero_grad()
    mask = worker._loss_mask(batch.tensors)
    loss, _, _ = worker._micro_batch_loss(batch, float(mask.sum()), float(len(batch)))
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in worker.actor.model.named_parameters() if p.grad is not None}


def test_observation_positions_get_no_gradient(trained):
    worker, batch = trained
    t = batch.tensors
    obs = (~t["response_mask"].bool()) & t["attention_mask"][:, t["prompts"].shape[1]:].bool()
    assert int(obs.sum()) > 0
    base = _update_grads(worker, batch)
    # scramble everything the loss could read at observation positions: sampling and old log-probs, advantages
    g = torch.Generator().manual_seed(1)
    noise = lambda: torch.randn(t["advantages"].shape, generator=g) * 5
    changed = batch.union(tensors={k: torch.where(obs, noise(), t[k]) for k in
                                   ("advantages", "old_log_probs", "rollout_log_probs")})
    after = _update_grads(worker, changed)
    assert any(float(v.abs().max()) > 0 for v in base.values())
    for n in base:
        assert torch.equal(base[n], after[n]), n
    # the same change on sampled positions does move the gradient (the check can fail)
    sampled = t["response_mask"].bool()
    moved = batch.union(tensors={"advantages": torch.where(sampled, noise(), t["advantages"])})
    assert any(not torch.equal(base[n], v) for n, v in _update_grads(worker, moved).items())


def test_the_loss_has_zero_gradient_with_respect_to_observation_log_probs(trained):
    """The policy loss as a function of the per-token log-probs: its gradient is 0 at every observation position."""
    import hybrid_rl.algorithms as alg

    worker, batch = trained
    t = batch.tensors
    lp = t["old_log_probs"].clone().requires_grad_(True)
    mask = worker._loss_mask(t)
    cfg = worker.cfg
    own = alg.POLICY_LOSSES.info(cfg.policy_loss).inputs(t, cfg)
    loss, _ = alg.POLICY_LOSSES[cfg.policy_loss](log_prob=lp, advantages=t["advantages"], response_mask=mask,
                                                 clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None,
                                                 loss_agg_mode=cfg.actor.loss_agg_mode, num_tokens=float(mask.sum()),
                                                 num_seqs=float(len(batch)), norm_length=cfg.data.max_response_length,
                                                 **own)
    loss.backward()
    assert torch.all(lp.grad[~t["response_mask"].bool()] == 0)
    assert float(lp.grad[t["response_mask"].bool()].abs().sum()) > 0


# --------------------------------------------------------------------------- environments that fail
class SlowEnv(ToolEnv):
    """A step that takes longer than the rollout's time bound."""

    def step(self, turn: str) -> StepResult:
        import time

        time.sleep(30)
        return StepResult(observations=["late"], done=False)


class RaisingEnv(ToolEnv):
    """A step that raises."""

    def step(self, turn: str) -> StepResult:
        raise RuntimeError("the environment broke")


@pytest.mark.parametrize("name, cls, stop, kind", [("slow_env", SlowEnv, "timeout", "env_timeout"),
                                                   ("raising_env", RaisingEnv, "env_error", "env_raised")])
def test_a_failing_environment_ends_its_trajectories_not_the_rollout(tiny_model_path, name, cls, stop, kind):
    import time

    from hybrid_rl.envs.base import STOPS

    ENVS.register(name, cls)
    try:
        start = time.monotonic()
        _, _, _, batch, _ = _run(tiny_model_path, None, [f"env.name={name}", "env.max_rollout_s=4.0"])
        took = time.monotonic() - start
    finally:
        ENVS.unregister(name)
    t = batch.tensors
    assert torch.all(t["env_stop"] == STOPS.index(stop))
    assert torch.all(t[f"env_errors_{kind}"] == 1) and torch.all(t["env_turns"] == 1)
    assert took < 25  # the slow steps (30 s each) were abandoned at the 4 s bound
    assert torch.equal(t["response_mask"].bool(), t["turn_ids"] > 0)


class PayingEnv(ToolEnv):
    """Done at the first turn, paying 1 for it whatever it says."""

    def step(self, turn: str) -> StepResult:
        return StepResult(observations=[], done=True, reward=1.0)


def test_a_turn_that_fills_the_budget_is_still_answered(tiny_model_path):
    """A budget of 5 tokens and turns of up to 5: the random model fills the budget in its first turn. The
    environment still answers that turn, so its reward counts (as a single-turn response cut at the cap is still
    scored), and the trajectory ends as an answer."""
    from hybrid_rl.envs.base import STOPS

    ENVS.register("paying", PayingEnv)
    try:
        _, _, _, batch, _ = _run(tiny_model_path, None, ["env.name=paying", "data.max_response_length=5",
                                                         "env.max_turn_tokens=5"], n=4)
    finally:
        ENVS.unregister("paying")
    t = batch.tensors
    full = t["response_mask"].sum(dim=1) == 5
    assert int(full.sum()) > 0  # the premise: some trajectories filled the budget
    assert torch.all(t["env_reward"] == 1.0) and torch.all(t["env_stop"] == STOPS.index("answer"))
    assert torch.all(t["env_turns"] == 1)
