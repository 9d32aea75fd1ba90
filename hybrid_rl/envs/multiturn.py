"""The multi-turn rollout loop: each trajectory's turns on the engine, each answer from its environment.

``MultiTurnRollout.generate`` replaces the engine's ``generate`` when ``env.name`` is set (``worker.generate`` calls
it, so sync and overlap mode, split placement and validation all go through it). Each prompt gets ``rollout.n``
trajectories, each with a fresh environment (``env.name``) started from its data row. A turn is one
``Continuation(prompt, tokens so far)`` on the engine, stopping at EOS or the end of a tool call
(``SamplingParams.stop``/``stop_token_ids``); the sampled ids and their log-probs are appended as sampled. The
environment then answers the turn (on up to ``env.workers`` threads, bounded by what is left of
``env.max_rollout_s``), and its observation is appended as the chat template's own tokens, encoded once
(``render.TurnRenderer``), with ``response_mask`` 0 and log-prob 0. ``env.scheduler`` decides how turns meet the
engine: ``turns`` sends every unfinished trajectory's turn k in one ``generate_interruptible`` call once every
environment has answered turn k − 1 (the default); ``async`` adds each trajectory's next turn to the
engine's running stream (``RolloutEngine.turn_stream``) as soon as its own environment answered, so a slow tool or
a long turn holds only its own trajectory. A trajectory ends when its environment is done (the turn was the
answer), at ``env.max_turns``, when its tokens fill ``data.max_response_length`` (the turn that fills it is still
answered, for its reward; an observation that leaves no room for another turn ends it too), when its environment
fails, or when the rollout's time is up (an engine interrupt ends the turns in flight where they are).

``assemble_trajectories`` lays the trajectories out as ``assemble_rollout`` does a single turn: ``responses`` is
everything after the prompt, ``attention_mask`` covers it all, ``response_mask`` only the sampled tokens, plus
``turn_ids`` (k on the tokens of the k-th model turn, 0 elsewhere: the reward reads the last turn), the per-token
weight version and per-trajectory counts (``env_*``, read by ``env_metrics``). Left out: carrying an unfinished
trajectory into the next step (partial rollouts are refused with an environment), and KV reuse between turns (each
turn prefills its context again; vLLM's prefix cache serves most of it).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from hybrid_rl.batch import Batch
from hybrid_rl.envs.base import ENVS, ERROR_KINDS, STOPS, Env, EnvRow
from hybrid_rl.envs.deadline import CallPool, run_parallel
from hybrid_rl.envs.render import TurnRenderer
from hybrid_rl.rollout.base import Continuation, SamplingParams

@dataclass
class Trajectory:
    """One conversation, as the token sequence after the prompt and as text messages (for the template only)."""

    prompt: list[int]
    row: EnvRow
    env: Env
    messages: list[dict]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    """k on the tokens the model sampled in its k-th turn, 0 on observation and template tokens."""
    turns: int = 0
    tool_calls: int = 0
    errors: Counter = field(default_factory=Counter)
    reward: float = 0.0
    stop: str = ""
    last_turn: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return bool(self.stop)

    def add_turn(self, tokens: Sequence[int], logprobs: Sequence[float]) -> None:
        self.turns += 1
        self.tokens += tokens
        self.logprobs += logprobs
        self.turn_ids += [self.turns] * len(tokens)
        self.last_turn = list(tokens)

    def add_observation(self, ids: Sequence[int]) -> None:
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.turn_ids += [0] * len(ids)


def env_rows(prompts: Batch) -> list[EnvRow]:
    """The data rows of a prompt batch (``collate_prompts`` keeps ``messages``/``env_info`` for environments)."""
    nt = prompts.non_tensors
    if "messages" not in nt:
        raise ValueError("multi-turn rollouts need each prompt's chat messages: build the prompts with "
                         "PromptDataset(..., keep_messages=True) (the trainer does when env.name is set)")
    rows = []
    for i in range(len(prompts)):
        messages = json.loads(nt["messages"][i])
        info = json.loads(nt["env_info"][i]) if "env_info" in nt else {}
        rows.append(EnvRow(int(nt["index"][i]) if "index" in nt else i, str(nt["ground_truth"][i]),
                           str(nt["data_source"][i]) if "data_source" in nt else "", tuple(messages), info))
    return rows


def env_prompt(cfg: Any) -> tuple[str | None, dict[str, Any]]:
    """(system prompt, chat-template arguments) of the prompts under ``cfg``'s environment: the environment's own
    system text before ``data.system_prompt``, and its ``tools=``; (``data.system_prompt``, {}) without one."""
    if cfg.env.name is None:
        return cfg.data.system_prompt, {}
    cls = ENVS[cfg.env.name]
    own = cls.system_prompt(cfg.env)
    parts = [p for p in (own, cfg.data.system_prompt) if p]
    return ("\n\n".join(parts) if parts else None), cls.template_kwargs(cfg.env)


def check_template(cfg: Any, tokenizer: Any, messages_json: str) -> None:
    """TemplateError (one line) now if the chat template cannot append observations after a prompt's messages."""
    _, kwargs = env_prompt(cfg)
    label = f"model.tokenizer_path={cfg.model.tokenizer_path}" if cfg.model.tokenizer_path else \
        f"model.path={cfg.model.path}"
    TurnRenderer(tokenizer, kwargs, cfg.env.observation_role, label, [tokenizer.eos_token_id]).probe(
        json.loads(messages_json))


class MultiTurnRollout:
    """The loop for one rank's engine under ``cfg.env``; ``tokenizer`` is the model's."""

    def __init__(self, cfg: Any, tokenizer: Any, eos_token_ids: Sequence[int]):
        self.options = cfg.env
        self.env_cls = ENVS[cfg.env.name]
        self.tokenizer = tokenizer
        self.budget = cfg.data.max_response_length
        self.eos = list(eos_token_ids)
        label = f"model.tokenizer_path={cfg.model.tokenizer_path}" if cfg.model.tokenizer_path else \
            f"model.path={cfg.model.path}"
        _, kwargs = env_prompt(cfg)
        self.renderer = TurnRenderer(tokenizer, kwargs, cfg.env.observation_role, label, self.eos)
        self.stop_strings, self.stop_ids = self._stops(self.env_cls.stop_strings(cfg.env))

    def _stops(self, strings: Sequence[str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The strings that end a turn, and the ids of those that are one token (an engine checks ids cheaply)."""
        ids = []
        for s in strings:
            enc = self.renderer.encode(s)
            if len(enc) == 1 and self.tokenizer.decode(enc, skip_special_tokens=False) == s:
                ids.append(enc[0])
        return tuple(strings), tuple(ids)

    def _fit(self, text: str) -> tuple[str, bool]:
        """``text`` cut to ``env.max_observation_tokens`` tokens, and whether it was."""
        cap = self.options.max_observation_tokens
        ids = self.renderer.encode(text)
        if len(ids) <= cap:
            return text, False
        return self.tokenizer.decode(ids[:cap], skip_special_tokens=False) + \
            f" ...[cut: {len(ids) - cap} more tokens]", True

    def _start(self, prompts: Batch, n: int) -> list[Trajectory]:
        ids, mask = prompts.tensors["input_ids"].cpu(), prompts.tensors["attention_mask"].cpu().bool()
        trajs = []
        for i, row in enumerate(env_rows(prompts)):
            prompt = ids[i][mask[i]].tolist()
            for _ in range(n):
                env = self.env_cls(self.options, self._fit)
                trajs.append(Trajectory(prompt, row, env, [dict(m) for m in row.messages]))
        for t in trajs:
            try:
                t.env.init(t.row)
            except Exception:
                t.errors["env_raised"] += 1
                t.stop = "env_error"
        return trajs

    def generate(self, engine: Any, prompts: Batch, params: SamplingParams, version: int | None) -> Batch:
        """``rollout.n`` trajectories per prompt of ``prompts`` (left-padded, with the rows' ``messages``), generated
        on ``engine`` under ``params``; the batch ``assemble_trajectories`` lays out. ``version``: the engine's weight
        version (recorded on every token)."""
        opts = self.options
        trajs = self._start(prompts, params.n)
        turn_params = dataclasses.replace(params, n=1, response_lengths=None, stop=self.stop_strings,
                                          stop_token_ids=self.stop_ids)
        start = time.monotonic()
        deadline = start + opts.max_rollout_s if opts.max_rollout_s > 0 else None
        interrupt = threading.Event()
        timer = threading.Timer(opts.max_rollout_s, interrupt.set) if deadline is not None else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            if self._asynchronous(engine):
                self._run_async(engine, trajs, turn_params, deadline, interrupt)
            else:
                self._run_turns(engine, trajs, turn_params, deadline, interrupt)
        finally:
            if timer is not None:
                timer.cancel()
            for t in trajs:
                try:
                    t.env.close()
                except Exception:
                    t.errors["env_raised"] += 1
        # on the engine's device, as a single-turn rollout's batch is (the trainer's log-probs land there)
        device = getattr(engine, "device", prompts.tensors["input_ids"].device)
        return assemble_trajectories(prompts.to(device), trajs, params.n, self.tokenizer.pad_token_id,
                                     -1 if version is None else version)

    def _asynchronous(self, engine: Any) -> bool:
        mode = self.options.scheduler
        return mode == "async" or mode == "auto" and bool(getattr(engine, "streams_requests", False))

    def _run_turns(self, engine: Any, trajs: list[Trajectory], params: SamplingParams, deadline: float | None,
                   interrupt: threading.Event) -> None:
        """``env.scheduler=turns``: turn k of every unfinished trajectory in one engine call, then their
        environments, then turn k + 1."""
        opts = self.options
        for turn in range(1, opts.max_turns + 1):
            active = [t for t in trajs if not t.done]
            if not active or interrupt.is_set():
                for t in active:
                    t.stop = "timeout"
                return
            segments = engine.generate_interruptible([self._request(t) for t in active], params, interrupt)
            for t, seg in zip(active, segments):
                self._take_turn(t, seg)
            # a turn that filled the budget is still answered (its reward, its calls counted), as a single-turn
            # response cut at the cap is still scored; no observation can follow it (``_answer``)
            stepping = [t for t in active if not t.done]
            outcomes = run_parallel([lambda t=t: t.env.step(self.renderer.turn_text(t.last_turn))
                                     for t in stepping], opts.workers, deadline)
            for t, out in zip(stepping, outcomes):
                self._answer(t, out, last=turn == opts.max_turns)

    def _run_async(self, engine: Any, trajs: list[Trajectory], params: SamplingParams, deadline: float | None,
                   interrupt: threading.Event) -> None:
        """``env.scheduler=async``: each trajectory's turn goes to the engine's stream as soon as its environment
        answered the previous one, and each finished turn to the environments at once; the engine steps while any
        turn runs, and otherwise the loop waits for the next answer. At the interrupt the running turns end where
        they are and the environments still working are abandoned, as the turn loop's are."""
        opts = self.options
        pool = CallPool(opts.workers)
        running: dict[int, Trajectory] = {}
        try:
            with engine.turn_stream(params, interrupt) as stream:
                for t in trajs:
                    if not t.done:
                        running[stream.add(self._request(t))] = t
                while running or pool.pending:
                    if interrupt.is_set():
                        break
                    if running:
                        finished = stream.step()
                        answers = pool.collect(0.0)
                    else:  # every trajectory is with its environment: wait for the first answer
                        finished = []
                        answers = pool.collect(None if deadline is None else max(0.0, deadline - time.monotonic()))
                    for key, seg in finished:
                        t = running.pop(key)
                        self._take_turn(t, seg)
                        if not t.done:
                            pool.submit(t, lambda t=t: t.env.step(self.renderer.turn_text(t.last_turn)))
                    for t, out in answers:
                        self._answer(t, out, last=t.turns >= opts.max_turns)
                        if not t.done:
                            running[stream.add(self._request(t))] = t
                for key, seg in stream.abort():  # the interrupt: what the running turns sampled so far
                    self._take_turn(running.pop(key), seg)
        finally:
            pool.close()
        for t in trajs:  # still with an environment at the interrupt
            if not t.done:
                t.errors["env_timeout"] += 1
                t.stop = "timeout"

    @staticmethod
    def _take_turn(t: Trajectory, seg: Any) -> None:
        t.add_turn(seg.tokens, seg.logprobs)
        if not seg.finished:  # the rollout's time ran out during this turn
            t.stop = "timeout"

    def _request(self, t: Trajectory) -> Continuation:
        left = self.budget - len(t.tokens)
        cap = self.options.max_turn_tokens
        return Continuation(t.prompt, tuple(t.tokens), min(left, cap) if cap else left)

    def _answer(self, t: Trajectory, out: Any, last: bool) -> None:
        """Apply an environment's answer to ``t``: its counts, and the observation appended (or the end)."""
        if out.timed_out:
            t.errors["env_timeout"] += 1
            t.stop = "timeout"
            return
        if out.error is not None:
            t.errors["env_raised"] += 1
            t.stop = "env_error"
            return
        res = out.value
        t.reward += float(res.reward)
        t.tool_calls += int(res.tool_calls)
        t.errors.update(k for k in res.errors if k in ERROR_KINDS)
        if res.done or not res.observations:
            t.stop = "answer"
            return
        if last:
            t.stop = "max_turns"
            return
        ids, t.messages = self.renderer.glue(t.messages, t.last_turn, res.observations)
        if len(t.tokens) + len(ids) >= self.budget:  # no room left for another turn
            t.stop = "budget"
            return
        t.add_observation(ids)


COUNTS = ("turns", "tool_calls", "reward")


def assemble_trajectories(prompts: Batch, trajs: Sequence[Trajectory], n: int, pad_token_id: int,
                          version: int) -> Batch:
    """The trainer-facing batch of ``trajs`` (``n`` per prompt of ``prompts``, in order): the layout of
    ``rollout.base.assemble_rollout`` with the observation tokens inside ``responses`` and ``attention_mask`` but
    outside ``response_mask``, plus ``turn_ids``, ``token_weight_version`` and the ``env_*`` counts."""
    rep = prompts.repeat_interleave(n)
    prompt_ids, prompt_mask = rep.tensors["input_ids"], rep.tensors["attention_mask"]
    device = prompt_ids.device
    width = max(1, max(len(t.tokens) for t in trajs))
    b = len(trajs)
    responses = torch.full((b, width), int(pad_token_id), dtype=torch.long)
    logprobs = torch.zeros((b, width), dtype=torch.float32)
    turn_ids = torch.zeros((b, width), dtype=torch.long)
    lengths = torch.tensor([len(t.tokens) for t in trajs], dtype=torch.long)
    for row, t in enumerate(trajs):
        if t.tokens:
            responses[row, :len(t.tokens)] = torch.as_tensor(t.tokens, dtype=torch.long)
            logprobs[row, :len(t.tokens)] = torch.as_tensor(t.logprobs, dtype=torch.float32)
            turn_ids[row, :len(t.tokens)] = torch.as_tensor(t.turn_ids, dtype=torch.long)
    response_mask = (turn_ids > 0).long()
    steps = torch.arange(width)[None, :]
    inside = (steps < lengths[:, None]).long()
    responses, logprobs, turn_ids, response_mask, inside = (x.to(device) for x in
                                                            (responses, logprobs * response_mask, turn_ids,
                                                             response_mask, inside))
    prompt_len = prompt_mask.sum(dim=1, keepdim=True)
    position_ids = torch.cat([(torch.cumsum(prompt_mask, dim=1) - 1).clamp(min=0),
                              prompt_len + steps.to(device)], dim=1)
    uid = np.repeat(prompts.non_tensors["uid"], n) if "uid" in prompts.non_tensors else \
        np.repeat(np.arange(len(prompts)), n)
    counts = {f"env_{k}": torch.tensor([float(getattr(t, k)) for t in trajs], device=device) for k in COUNTS}
    counts.update({f"env_errors_{k}": torch.tensor([float(t.errors[k]) for t in trajs], device=device)
                   for k in ERROR_KINDS})
    counts["env_stop"] = torch.tensor([STOPS.index(t.stop or "answer") for t in trajs], device=device)
    return rep.union(
        tensors=dict(prompts=prompt_ids, responses=responses, response_mask=response_mask,
                     input_ids=torch.cat([prompt_ids, responses], dim=1),
                     attention_mask=torch.cat([prompt_mask, inside], dim=1), position_ids=position_ids,
                     rollout_log_probs=logprobs, turn_ids=turn_ids,
                     token_weight_version=torch.full((b, width), int(version), dtype=torch.long, device=device),
                     **counts),
        non_tensors=dict(uid=uid))
