"""A scripted stand-in for vLLM 0.26's ``LLMEngine`` (``add_request`` / ``step`` / ``abort_request`` /
``has_unfinished_requests``, CUMULATIVE ``RequestOutput``s with the classic per-position log-prob dicts), and a maker
of ``VLLMRolloutEngine``s over it: our side of the contract with vLLM, checked without vLLM."""

from __future__ import annotations

import enum
import sys
import types
from types import SimpleNamespace

import torch

from hybrid_rl.rollout import vllm as vr

EOS = 2


class Kind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class FakeLLMEngine:
    """Each step every live request gets one token: its context length + step (EOS where ``eos_at`` says)."""

    def __init__(self, eos_at: dict[int, int]):
        self.live: dict[str, dict] = {}
        self.added: list[tuple[str, list[int], dict]] = []
        self.aborted: list[str] = []
        self.eos_at = eos_at  # request index → the step at which it samples EOS
        self.cached = 0  # context tokens each request finds in the prefix cache (RequestOutput.num_cached_tokens)

    def add_request(self, rid, prompt, params):
        assert params["output_kind"] is Kind.CUMULATIVE and params["n"] == 1
        self.added.append((rid, list(prompt["prompt_token_ids"]), params))
        self.live[rid] = dict(ctx=list(prompt["prompt_token_ids"]), toks=[], lps=[], params=params,
                              index=len(self.added) - 1)

    def has_unfinished_requests(self):
        return bool(self.live)

    def abort_request(self, ids, internal=False):
        self.aborted += ids
        for rid in ids:
            self.live.pop(rid, None)

    def step(self):
        outs = []
        for rid, r in list(self.live.items()):
            step = len(r["toks"])
            eos = self.eos_at.get(r["index"]) == step and not r["params"]["ignore_eos"]
            tok = EOS if eos else 100 + len(r["ctx"]) + step
            r["toks"].append(tok)
            r["lps"].append({tok: SimpleNamespace(logprob=-0.01 * tok)})
            finished = eos or len(r["toks"]) >= r["params"]["max_tokens"]
            comp = SimpleNamespace(token_ids=r["toks"], logprobs=r["lps"], index=0,
                                   finish_reason="stop" if finished else None)
            outs.append(SimpleNamespace(request_id=rid, outputs=[comp], finished=finished,
                                        num_cached_tokens=min(self.cached, len(r["ctx"]))))
            if finished:
                del self.live[rid]
        return outs


def fixture(monkeypatch):
    """A maker of ``VLLMRolloutEngine``s over ``FakeLLMEngine`` (``vllm.sampling_params`` stubbed for the test)."""
    fake_mod = types.ModuleType("vllm.sampling_params")
    fake_mod.RequestOutputKind = Kind
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", fake_mod)

    def make(eos_at=None):
        llm = SimpleNamespace(llm_engine=FakeLLMEngine(eos_at or {}))
        eng = vr.VLLMRolloutEngine(llm, [EOS], 0, torch.device("cpu"), make_sampling_params=lambda **kw: kw,
                                   flat_logprobs=False)
        eng._weights_real = True
        return eng

    return make
