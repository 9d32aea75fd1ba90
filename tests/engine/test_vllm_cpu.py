"""CPU tests of the vLLM backend's own code: the missing-vLLM error, prompt un-padding, sampling
arguments, output assembly, the sleep/wake/push state machine, the worker→model adapter, and the
throughput benchmark's bookkeeping (``benchmarks/vllm_bench.py`` driven by the fake engine).

vLLM itself is never imported here: the fakes below stand in for ``vllm.LLM`` and its output
objects so that *our* conversion code is what is tested. They mirror vLLM 0.26's classes field for
field (``vllm.logprobs.Logprob``/``FlatLogprobs``, ``vllm.outputs.CompletionOutput``/``RequestOutput``,
read from the 0.26 wheel), including how vLLM's ``LogprobsProcessor`` fills them: the sampled
token first at each position, then the top-k. The fast post-processing is checked bit for bit
against the previous implementation, kept below as ``ref_*``. The real engine is exercised by
``tests/gpu/test_vllm_gpu.py`` on a GPU machine.

``python tests/engine/test_vllm_cpu.py`` prints a CPU micro-benchmark of the post-processing (512
sequences × 512 tokens) for the reference and the current code.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import random
import sys
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hybrid_rl.batch import Batch  # noqa: E402
from hybrid_rl.config import ConfigError, load_config  # noqa: E402
from hybrid_rl.distributed import DistInfo  # noqa: E402
from hybrid_rl.models import ModelLoadError  # noqa: E402
from hybrid_rl.rollout import vllm as vr  # noqa: E402
from hybrid_rl.rollout import vllm_process as vp  # noqa: E402
from hybrid_rl.rollout.base import Continuation, GenerationStream, SamplingParams, assemble_rollout  # noqa: E402
from hybrid_rl.weights.sharding_manager import ShardingManager  # noqa: E402

EOS, PAD = 7, 0


# --------------------------------------------------------------------------- fakes of vLLM's objects
@dataclass
class FakeLogprob:
    """vllm.logprobs.Logprob (0.26)."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FakeFlatLogprobs:
    """vllm.logprobs.FlatLogprobs (0.26): flat lists plus per-position [start, end); a sequence of dicts."""
    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append(self, logprobs_one_position: dict[int, FakeLogprob] | None) -> None:
        self.start_indices.append(len(self.logprobs))
        if logprobs_one_position:
            for token_id, logprob in logprobs_one_position.items():
                self.token_ids.append(token_id)
                self.logprobs.append(logprob.logprob)
                self.ranks.append(logprob.rank)
                self.decoded_tokens.append(logprob.decoded_token)
        self.end_indices.append(len(self.logprobs))

    def append_fast(self, token_ids, logprobs, ranks, decoded_tokens) -> None:
        self.start_indices.append(len(self.logprobs))
        for token_id, logprob, rank, decoded_token in zip(token_ids, logprobs, ranks, decoded_tokens):
            self.token_ids.append(token_id)
            self.logprobs.append(logprob)
            self.ranks.append(rank)
            self.decoded_tokens.append(decoded_token)
        self.end_indices.append(len(self.logprobs))

    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, index: int) -> dict[int, FakeLogprob]:
        return {self.token_ids[i]: FakeLogprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
                for i in range(self.start_indices[index], self.end_indices[index])}

    def __iter__(self):
        for i in range(len(self.start_indices)):
            yield self[i]


@dataclass
class FakeCompletionOutput:
    """vllm.outputs.CompletionOutput (0.26)."""
    index: int
    text: str
    token_ids: Any
    cumulative_logprob: float | None
    logprobs: Any
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None


@dataclass
class FakeRequestOutput:
    """vllm.outputs.RequestOutput (0.26), the fields our code could touch."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[FakeCompletionOutput]
    finished: bool = True


def sample_logprobs(tokens, lps, flat=True, topk=0, seed=0):
    """A sequence's log-probs as vLLM's LogprobsProcessor builds them with ``logprobs=topk``:
    per position the sampled token (rank computed from the fake top-k), then the top-k tokens."""
    rng = random.Random(seed)
    container = FakeFlatLogprobs() if flat else []
    for tok, lp in zip(tokens, lps):
        top = [(rng.randrange(150000, 151000), lp + rng.random()) for _ in range(topk)]  # never the sampled id
        ids, vals = [tok] + [t for t, _ in top], [lp] + [v for _, v in top]
        ranks = [1 + sum(v > lp for _, v in top)] + list(range(1, topk + 1))
        if flat:
            container.append_fast(ids, vals, iter(ranks), iter([None] * len(ids)))
        else:  # vLLM builds the dict the same way: a top-k entry with the sampled id overwrites it
            container.append({t: FakeLogprob(v, r, None) for t, v, r in zip(ids, vals, ranks)})
    return container


def completion(index, tokens, flat=True, topk=0, as_tuple=False):
    lps = [-(0.1 * (i + 1) + 0.01 * t) for i, t in enumerate(tokens)]
    lp = sample_logprobs(tokens, lps, flat=flat, topk=topk, seed=index)
    toks = tuple(tokens) if as_tuple else list(tokens)
    return FakeCompletionOutput(index=index, text="", token_ids=toks, cumulative_logprob=None, logprobs=lp), lps


def request_output(completions, i=0) -> FakeRequestOutput:
    return FakeRequestOutput(request_id=str(i), prompt=None, prompt_token_ids=[1, 2], prompt_logprobs=None,
                             outputs=list(completions))


class FakeLLM:
    """Records calls; ``generate`` answers with scripted completions (token i of sample s = 10*s + i + 20,
    with EOS placed where ``eos_at`` says)."""

    def __init__(self, eos_at=None, length=5):
        self.calls: list[tuple] = []
        self.eos_at = eos_at or {}
        self.length = length
        self.loaded: list[list[tuple[str, torch.Tensor]]] = []
        self.model = torch.nn.Linear(2, 2)

    def collective_rpc(self, fn, args=(), kwargs=None):
        self.calls.append(("rpc", fn.__name__))
        worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: self.model))
        if fn is vr._rpc_load_weights:
            self.loaded.append(list(args[0]))
            return [len(args[0])]
        return [fn(worker, *args, **(kwargs or {}))]

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags) if tags else None))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True

    def generate(self, prompts, sp, use_tqdm=False):
        self.calls.append(("generate", [p["prompt_token_ids"] for p in prompts], sp))
        sps = sp if isinstance(sp, list) else [sp] * len(prompts)  # vLLM accepts one per request too
        outs = []
        for pi, (_, one) in enumerate(zip(prompts, sps)):
            comps = []
            for s in reversed(range(one["n"])):  # out of order on purpose: the engine must sort by index
                toks = [20 + 10 * s + i for i in range(min(self.length, one.get("max_tokens", self.length)))]
                cut = self.eos_at.get((pi, s))
                if cut is not None:
                    toks = toks[:cut] + [EOS]
                comps.append(completion(s, toks)[0])
            outs.append(request_output(comps, pi))
        return outs


def make_engine(llm=None, **kw):
    return vr.VLLMRolloutEngine(llm or FakeLLM(), [EOS], PAD, torch.device("cpu"), make_sampling_params=dict, **kw)


def prompts_batch():
    ids = torch.tensor([[PAD, PAD, 3, 4], [5, 6, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    return Batch({"input_ids": ids, "attention_mask": mask})


# --------------------------------------------------------------------------- missing vLLM
def _cfg(*overrides):
    return load_config(None, ["rollout.name=vllm", "model.dtype=bfloat16", *overrides])


def test_missing_vllm_is_one_line_model_load_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ModuleNotFoundError
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ModelLoadError) as ei:
        vr.VLLMRolloutEngine.from_config(_cfg(), dist, SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD))
    msg = str(ei.value)
    assert msg == "rollout.name=vllm needs vLLM: pip install -e '.[vllm]' (tested: vllm 0.26), or use rollout.name=hf"
    assert "\n" not in msg


def test_broken_vllm_import_names_the_cause(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "vllm":
            raise ImportError("libcudart.so.13: cannot open shared object file")
        return real_import(name, *a, **k)

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ModelLoadError) as ei:
        vr.import_vllm()
    assert "libcudart" in str(ei.value) and "rollout.name=hf" in str(ei.value) and "\n" not in str(ei.value)


def test_half_installed_vllm_is_not_reported_as_missing(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "vllm":
            raise ModuleNotFoundError("No module named 'vllm._C'", name="vllm._C")
        return real_import(name, *a, **k)

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ModelLoadError, match=r"importing vLLM failed .*vllm\._C"):
        vr.import_vllm()


def test_worker_builds_vllm_engine_through_from_config(monkeypatch):
    """The worker's hook (`rollout.name=vllm`) reaches from_config and its error."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    w = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
    w.cfg = _cfg()
    w.dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    w.tokenizer = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
    with pytest.raises(ModelLoadError, match="needs vLLM"):
        w._build_rollout()


# --------------------------------------------------------------------------- pure helpers
def test_unpad_prompts_drops_left_and_right_padding():
    b = prompts_batch()
    assert vr.unpad_prompts(b.tensors["input_ids"], b.tensors["attention_mask"]) == [[3, 4], [5, 6, 8, 9]]
    right = vr.unpad_prompts(torch.tensor([[1, 2, PAD]]), torch.tensor([[1, 1, 0]]))
    assert right == [[1, 2]]


def test_unpad_prompts_rejects_empty_rows_and_shape_mismatch():
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        vr.unpad_prompts(torch.tensor([[1, 2], [0, 0]]), torch.tensor([[1, 1], [0, 0]]))
    with pytest.raises(ValueError, match="differ"):
        vr.unpad_prompts(torch.tensor([[1, 2]]), torch.tensor([[1]]))


def test_sampling_kwargs_sampled_and_greedy():
    kw = vr.sampling_kwargs(SamplingParams(n=8, temperature=0.7, top_p=0.9, top_k=50, max_tokens=32), [EOS, 9])
    assert kw == dict(n=8, temperature=0.7, top_p=0.9, top_k=50, max_tokens=32, stop_token_ids=[EOS, 9],
                      ignore_eos=False, logprobs=0, flat_logprobs=True, detokenize=False)
    g = vr.sampling_kwargs(SamplingParams(n=1, temperature=0.0, top_p=0.5, top_k=3, max_tokens=4), [EOS], ignore_eos=True)
    assert (g["temperature"], g["top_p"], g["top_k"], g["ignore_eos"], g["stop_token_ids"]) == (0.0, 1.0, 0, True, [])
    assert vr.sampling_kwargs(SamplingParams(top_k=0), [EOS])["top_k"] == 0


def test_sampling_kwargs_without_logprobs_asks_for_none():
    kw = vr.sampling_kwargs(SamplingParams(n=2, logprobs=False), [EOS])
    assert kw["logprobs"] is None and "flat_logprobs" not in kw


def test_collect_outputs_without_logprobs_returns_the_tokens_only():
    a0 = FakeCompletionOutput(index=0, text="", token_ids=[11, 12], cumulative_logprob=None, logprobs=None)
    a1 = FakeCompletionOutput(index=1, text="", token_ids=[21, 22, 23], cumulative_logprob=None, logprobs=None)
    resp, lps = vr.collect_outputs([request_output([a0, a1])], n=2, pad_token_id=PAD, logprobs=False)
    assert resp.tolist() == [[11, 12, PAD], [21, 22, 23]] and lps is None
    with pytest.raises(RuntimeError, match="no log-probs"):  # asked for, absent: an error, not zeros
        vr.collect_outputs([request_output([a0, a1])], n=2, pad_token_id=PAD)


@pytest.mark.parametrize("flat", [True, False])
def test_sampled_logprobs_flat_and_dict_forms(flat):
    c, lps = completion(0, [4, 5, 6], flat=flat)
    assert vr.sampled_logprobs(c.token_ids, c.logprobs) == pytest.approx(lps)


def test_sampled_logprobs_finds_sampled_token_among_topk_and_checks_lengths():
    lp = FakeFlatLogprobs()
    lp.append({9: FakeLogprob(-0.5), 4: FakeLogprob(-1.5)})  # sampled token listed second
    assert vr.sampled_logprobs([4], lp) == [-1.5]
    with pytest.raises(RuntimeError, match="positions"):
        vr.sampled_logprobs([4, 5], lp)
    with pytest.raises(RuntimeError, match="no log-probs"):
        vr.sampled_logprobs([4], None)


def test_collect_outputs_orders_by_index_and_right_pads():
    a0, lp_a0 = completion(0, [11, 12, 13])
    a1, lp_a1 = completion(1, [21])
    b0, lp_b0 = completion(0, [31, 32])
    b1, lp_b1 = completion(1, [41, 42, 43, 44])
    outs = [request_output([a1, a0]), request_output([b0, b1])]
    resp, lps = vr.collect_outputs(outs, n=2, pad_token_id=PAD)
    assert resp.tolist() == [[11, 12, 13, PAD], [21, PAD, PAD, PAD], [31, 32, PAD, PAD], [41, 42, 43, 44]]
    assert lps[0, :3].tolist() == pytest.approx(lp_a0) and lps[1, 1:].abs().sum() == 0
    assert lps[3].tolist() == pytest.approx(lp_b1) and lps.dtype == torch.float32
    with pytest.raises(RuntimeError, match="expected n=3"):
        vr.collect_outputs(outs, n=3, pad_token_id=PAD)


# --------------------------------------------------------------------------- fast path == the previous code
def ref_unpad_prompts(input_ids, attention_mask):
    """The previous ``unpad_prompts``: one masked ``tolist`` per row."""
    return [row[m].tolist() for row, m in zip(input_ids.cpu(), attention_mask.cpu().bool())]


def ref_sampled_logprobs(token_ids, logprobs):
    """The previous ``sampled_logprobs``: a Python loop over positions in both formats."""
    starts = getattr(logprobs, "start_indices", None)
    if starts is not None:
        flat_ids, flat_lps, ends = logprobs.token_ids, logprobs.logprobs, logprobs.end_indices
        out = []
        for i, tok in enumerate(token_ids):
            s, e = starts[i], ends[i]
            j = s if s < e and flat_ids[s] == tok else next(k for k in range(s, e) if flat_ids[k] == tok)
            out.append(float(flat_lps[j]))
        return out
    return [float(pos[tok].logprob) for pos, tok in zip(logprobs, token_ids)]


def ref_collect_outputs(request_outputs, n, pad_token_id):
    """The previous ``collect_outputs``: sorted completions, one small tensor per row copied into the padded one."""
    rows = []
    for ro in request_outputs:
        for o in sorted(ro.outputs, key=lambda o: o.index):
            toks = list(o.token_ids)
            rows.append((toks, ref_sampled_logprobs(toks, o.logprobs)))
    width = max((len(t) for t, _ in rows), default=0)
    responses = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (toks, lps) in enumerate(rows):
        if toks:
            responses[i, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            logprobs[i, :len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return responses, logprobs


def ref_assemble_rollout(prompts, responses, logprobs, n, eos_token_ids, pad_token_id, response_lengths=None):
    """The previous ``assemble_rollout``."""
    rep = prompts.repeat_interleave(n)
    prompt_ids, prompt_mask = rep.tensors["input_ids"], rep.tensors["attention_mask"]
    is_eos = torch.zeros_like(responses, dtype=torch.bool)
    for e in eos_token_ids:
        is_eos |= responses == e
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    response_mask = (eos_before == 0).long()
    if response_lengths is not None:
        lengths = torch.tensor(response_lengths, device=responses.device)[:, None]
        response_mask = (torch.arange(responses.shape[1], device=responses.device)[None, :] < lengths).long()
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_token_id))
    logprobs = logprobs.float() * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (torch.cumsum(attention_mask, dim=1) - 1).clamp(min=0)
    prompt_len = prompt_mask.sum(dim=1, keepdim=True)
    position_ids[:, prompt_ids.shape[1]:] = prompt_len + torch.arange(responses.shape[1], device=responses.device)[None, :]
    uid = np.repeat(np.arange(len(prompts)), n)
    if "uid" in prompts.non_tensors:
        uid = np.repeat(prompts.non_tensors["uid"], n)
    return rep.union(tensors=dict(prompts=prompt_ids, responses=responses, response_mask=response_mask,
                                  input_ids=torch.cat([prompt_ids, responses], dim=1), attention_mask=attention_mask,
                                  position_ids=position_ids, rollout_log_probs=logprobs), non_tensors=dict(uid=uid))


def random_outputs(num_prompts, n, max_len, flat=True, topk=0, seed=0, shuffle=True, eos_rate=0.0, as_tuple=False):
    """Request outputs with random lengths (0 included), random ids (EOS sometimes), random log-probs."""
    rng = random.Random(seed)
    outs = []
    for b in range(num_prompts):
        comps = []
        for s in range(n):
            length = rng.randrange(0, max_len + 1)
            toks = [EOS if rng.random() < eos_rate else rng.randrange(8, 150000) for _ in range(length)]
            lps = [-rng.random() * 7 for _ in range(length)]
            lp = sample_logprobs(toks, lps, flat=flat, topk=topk, seed=b * n + s)
            comps.append(FakeCompletionOutput(index=s, text="", token_ids=tuple(toks) if as_tuple else toks,
                                              cumulative_logprob=None, logprobs=lp))
        if shuffle:
            rng.shuffle(comps)
        outs.append(request_output(comps, b))
    return outs


def random_prompts(num, width, seed=0, left_pad=True, uid=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(8, 150000, (num, width), generator=g)
    lengths = torch.randint(1, width + 1, (num,), generator=g)
    cols = torch.arange(width)[None, :]
    mask = (cols >= width - lengths[:, None]) if left_pad else (cols < lengths[:, None])
    ids = torch.where(mask, ids, torch.full_like(ids, PAD))
    b = Batch({"input_ids": ids, "attention_mask": mask.long()})
    if uid:
        b.non_tensors["uid"] = np.array([f"p{i}" for i in range(num)], dtype=object)
    return b


def assert_same_batch(a: Batch, b: Batch) -> None:
    assert a.tensors.keys() == b.tensors.keys() and a.non_tensors.keys() == b.non_tensors.keys()
    for k in a.tensors:
        assert a.tensors[k].dtype == b.tensors[k].dtype and torch.equal(a.tensors[k], b.tensors[k]), k
    for k in a.non_tensors:
        assert a.non_tensors[k].tolist() == b.non_tensors[k].tolist(), k


@pytest.mark.parametrize("flat,topk,as_tuple", [(True, 0, False), (False, 0, False), (True, 2, True), (False, 3, False)])
def test_fast_collect_outputs_equals_previous_code(flat, topk, as_tuple):
    outs = random_outputs(9, 3, 40, flat=flat, topk=topk, seed=topk, as_tuple=as_tuple)
    resp, lps = vr.collect_outputs(outs, 3, PAD)
    ref_resp, ref_lps = ref_collect_outputs(outs, 3, PAD)
    assert resp.dtype == torch.long and lps.dtype == torch.float32
    assert torch.equal(resp, ref_resp) and torch.equal(lps, ref_lps)
    # bit for bit, sign of zero included
    assert torch.equal(lps.view(torch.int32), ref_lps.view(torch.int32))


def test_fast_path_takes_the_engines_flat_list_after_checking_it():
    c, lps = completion(0, [4, 5, 6])
    assert vr.sampled_logprobs(c.token_ids, c.logprobs) is c.logprobs.logprobs  # no per-token work
    wrong = FakeFlatLogprobs()
    for t, v in zip([4, 9, 6], lps):  # one entry per position, but not the sampled token at position 1
        wrong.append({t: FakeLogprob(v)})
    with pytest.raises(RuntimeError, match="position 1 do not include the sampled token 5"):
        vr.sampled_logprobs([4, 5, 6], wrong)
    odd = FakeFlatLogprobs(start_indices=[0, 0, 2], end_indices=[0, 2, 3], token_ids=[9, 5, 6], logprobs=[-1.0, -2.0, -3.0],
                           ranks=[None] * 3, decoded_tokens=[None] * 3)  # 3 entries over 3 positions, not 1 each
    with pytest.raises(RuntimeError, match="position 0"):
        vr.sampled_logprobs([4, 5, 6], odd)
    assert vr.sampled_logprobs([], FakeFlatLogprobs()) == []


def test_collect_outputs_at_scale_equals_previous_code():
    """512 sequences, up to 512 tokens, the throughput benchmark's shape."""
    outs = random_outputs(64, 8, 512, seed=3, shuffle=False)
    resp, lps = vr.collect_outputs(outs, 8, PAD)
    ref_resp, ref_lps = ref_collect_outputs(outs, 8, PAD)
    assert resp.shape == ref_resp.shape and torch.equal(resp, ref_resp) and torch.equal(lps, ref_lps)


def test_collect_outputs_empty_and_all_empty():
    resp, lps = vr.collect_outputs([], 2, PAD)
    assert resp.shape == (0, 0) and lps.shape == (0, 0)
    outs = [request_output([completion(0, [])[0], completion(1, [])[0]])]
    resp, lps = vr.collect_outputs(outs, 2, PAD)
    assert resp.shape == (2, 0) and lps.dtype == torch.float32


@pytest.mark.parametrize("left_pad", [True, False])
def test_fast_unpad_equals_previous_code(left_pad):
    b = random_prompts(33, 17, seed=int(left_pad), left_pad=left_pad)
    assert vr.unpad_prompts(b.tensors["input_ids"], b.tensors["attention_mask"]) == \
        ref_unpad_prompts(b.tensors["input_ids"], b.tensors["attention_mask"])
    full = torch.randint(0, 9, (4, 5))
    assert vr.unpad_prompts(full, torch.ones_like(full)) == full.tolist()


@pytest.mark.parametrize("case", ["eos", "two_eos", "no_eos_id", "forced", "uid"])
def test_assemble_rollout_equals_previous_code(case):
    n, prompts = 3, random_prompts(6, 9, seed=5, uid=case == "uid")
    outs = random_outputs(6, n, 20, seed=7, eos_rate=0.15)
    resp, lps = vr.collect_outputs(outs, n, PAD)
    eos = {"two_eos": [EOS, 11], "no_eos_id": []}.get(case, [EOS])
    resp[resp == 11] = 12
    resp[::5, 3] = 11  # a second EOS id in some rows
    lengths = tuple(int(x) for x in torch.randint(0, resp.shape[1] + 1, (len(resp),))) if case == "forced" else None
    got = assemble_rollout(prompts, resp, lps, n, eos, PAD, lengths)
    assert_same_batch(got, ref_assemble_rollout(prompts, resp, lps, n, eos, PAD, lengths))


def test_generate_end_to_end_equals_previous_code():
    """The engine's whole post-processing (unpad → collect → assemble) against the previous functions."""
    prompts = random_prompts(5, 7, seed=2)
    llm = FakeLLM(eos_at={(1, 0): 2, (3, 2): 0}, length=6)
    eng = make_engine(llm)
    eng.load_weights([("w", torch.zeros(2))])
    out = eng.generate(prompts, SamplingParams(n=3, temperature=0.9, max_tokens=6))
    sent = [c for c in llm.calls if c[0] == "generate"][0][1]
    assert sent == ref_unpad_prompts(prompts.tensors["input_ids"], prompts.tensors["attention_mask"])
    ref = ref_assemble_rollout(prompts, *ref_collect_outputs(llm.generate([{"prompt_token_ids": p} for p in sent],
                                                                          {"n": 3})[:5], 3, PAD), 3, [EOS], PAD)
    assert_same_batch(out, ref)


def test_supports_flat_logprobs_reads_the_struct_or_dataclass_fields():
    assert vr.supports_flat_logprobs(type("SP", (), {"__struct_fields__": ("n", "logprobs", "flat_logprobs")}))
    assert not vr.supports_flat_logprobs(type("Old", (), {"__struct_fields__": ("n", "logprobs")}))

    @dataclass
    class DataclassSP:
        flat_logprobs: bool = False

    assert vr.supports_flat_logprobs(DataclassSP) and not vr.supports_flat_logprobs(object)
    kw = vr.sampling_kwargs(SamplingParams(), [EOS], flat_logprobs=False)
    assert "flat_logprobs" not in kw and kw["logprobs"] == 0


def test_engine_without_flat_logprobs_falls_back_to_dicts():
    class DictLLM(FakeLLM):
        def generate(self, prompts, sp, use_tqdm=False):
            assert "flat_logprobs" not in sp
            outs = super().generate(prompts, sp, use_tqdm)
            for ro in outs:
                for o in ro.outputs:
                    o.logprobs = list(o.logprobs)  # FlatLogprobs iterates as dicts: the classic format
            return outs

    flat_eng, dict_eng = make_engine(FakeLLM(length=4)), make_engine(DictLLM(length=4), flat_logprobs=False)
    for e in (flat_eng, dict_eng):
        e.load_weights([("w", torch.zeros(2))])
    params = SamplingParams(n=2, max_tokens=4)
    assert_same_batch(flat_eng.generate(prompts_batch(), params), dict_eng.generate(prompts_batch(), params))


def test_forced_lengths_share_one_sampling_params_per_length():
    made = []
    eng = vr.VLLMRolloutEngine(FakeLLM(length=8), [EOS], PAD, torch.device("cpu"),
                               make_sampling_params=lambda **kw: made.append(kw) or dict(kw))
    eng.load_weights([("w", torch.zeros(2))])
    eng.generate(prompts_batch(), SamplingParams(n=2, max_tokens=8, response_lengths=(3, 5, 3, 3)))
    assert sorted(kw["max_tokens"] for kw in made) == [3, 5]
    sps = [c for c in eng.llm.calls if c[0] == "generate"][0][2]
    assert [sp["max_tokens"] for sp in sps] == [3, 5, 3, 3] and sps[0] is sps[2] is sps[3]


def test_engine_kwargs_from_config():
    cfg = _cfg("data.max_prompt_length=100", "data.max_response_length=28", "rollout.vllm.tensor_parallel_size=2",
               "rollout.vllm.gpu_memory_utilization=0.4", "rollout.vllm.enforce_eager=true", "trainer.seed=5")
    dist = DistInfo(rank=3, world_size=4, local_rank=3, device=torch.device("cpu"))
    kw = vr.engine_kwargs(cfg, dist)
    assert kw["max_model_len"] == 128 and kw["tensor_parallel_size"] == 2
    assert kw["seed"] == 5 + 1000 * 1  # data-parallel rank 1 (ranks 2, 3 form one engine)
    assert vr.engine_kwargs(cfg, DistInfo(2, 4, 2, torch.device("cpu")))["seed"] == kw["seed"]
    assert vr.engine_kwargs(cfg, DistInfo(1, 4, 1, torch.device("cpu")))["seed"] == 5
    assert kw["distributed_executor_backend"] == "external_launcher" and kw["load_format"] == "dummy"
    assert kw["enable_sleep_mode"] and kw["skip_tokenizer_init"] and kw["enforce_eager"]
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["generation_config"] == "vllm"
    assert kw["dtype"] == "bfloat16" and kw["gpu_memory_utilization"] == 0.4
    assert "kv_cache_dtype" not in kw  # vLLM's own default unless passed through
    fp8 = vr.engine_kwargs(_cfg("rollout.vllm.engine_kwargs.kv_cache_dtype=fp8", "rollout.vllm.engine_kwargs.seed=7"), dist)
    assert fp8["kv_cache_dtype"] == "fp8" and fp8["seed"] == 7  # passed through, over the ones built here
    assert vr.engine_kwargs(_cfg("rollout.vllm.max_model_len=4096"), DistInfo(0, 1, 0, torch.device("cpu")))["max_model_len"] == 4096
    with pytest.raises(ValueError, match="must divide"):
        vr.engine_kwargs(cfg, DistInfo(0, 3, 0, torch.device("cpu")))


def test_engine_kwargs_fit_the_kv_cache_to_what_the_engine_holds(tmp_path):
    """``rollout.vllm.fit_kv_cache``: ``kv_cache_memory_bytes`` is ``max_num_seqs`` sequences of ``max_model_len``
    (+ 256 tokens of block rounding) over every layer's keys and values in 16-bit, the key/value heads split over the
    tensor-parallel GPUs; nothing where that would take over half of the share beside the weights, where it is off,
    without a GPU size, or where ``engine_kwargs`` names its own."""
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    h200 = 140 * 2**30
    tiny = ["model.path=builtin:tiny-qwen2", "rollout.max_num_seqs=256", "data.max_prompt_length=32",
            "data.max_response_length=4"]
    # the tiny model: 2 layers x (K, V) x 2 heads x 16 dims x 2 bytes = 256 bytes a token
    assert vr.engine_kwargs(_cfg(*tiny), one, h200)["kv_cache_memory_bytes"] == 256 * (32 + 4 + 256) * 256
    assert "kv_cache_memory_bytes" not in vr.engine_kwargs(_cfg(*tiny), one)  # no GPU: vLLM's own sizing
    assert "kv_cache_memory_bytes" not in vr.engine_kwargs(_cfg(*tiny, "rollout.vllm.fit_kv_cache=false"), one, h200)
    own = vr.engine_kwargs(_cfg(*tiny, "rollout.vllm.engine_kwargs.kv_cache_memory_bytes=1000"), one, h200)
    assert own["kv_cache_memory_bytes"] == 1000
    # Qwen2.5-7B: 28 layers x (K, V) x 4 heads x 128 dims x 2 bytes = 57,344 bytes a token; at tensor parallel 2 each
    # GPU holds 2 of the 4 heads
    seven = ["model.path=builtin:qwen2.5-7b-random", "rollout.max_num_seqs=64", "data.max_prompt_length=512",
             "data.max_response_length=1024", "rollout.vllm.tensor_parallel_size=2"]
    two = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    assert vr.engine_kwargs(_cfg(*seven), two, h200)["kv_cache_memory_bytes"] == 64 * (1536 + 256) * 57344 // 2
    # a config's own head_dim (Qwen3-0.6B: 128, not 1024 / 16): 28 layers x (K, V) x 8 heads x 128 dims x 2 bytes
    qwen3 = tmp_path / "qwen3"
    qwen3.mkdir()
    (qwen3 / "config.json").write_text(json.dumps(dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960)))
    q3 = _cfg(f"model.path={qwen3}", "rollout.max_num_seqs=16", "data.max_prompt_length=512",
              "data.max_response_length=1024")
    assert vr.engine_kwargs(q3, one, h200)["kv_cache_memory_bytes"] == 16 * (1536 + 256) * 28 * 2 * 8 * 128 * 2
    # 256 sequences of 16k tokens (~240 GiB) would not fit half of the share: vLLM fills the share
    longer = _cfg("model.path=builtin:qwen2.5-7b-random", "rollout.max_num_seqs=256", "data.max_response_length=16384")
    assert "kv_cache_memory_bytes" not in vr.engine_kwargs(longer, one, h200)


# --------------------------------------------------------------------------- the engine around a fake LLM
def test_generate_builds_the_same_layout_as_assemble_rollout():
    llm = FakeLLM(eos_at={(0, 1): 2}, length=4)
    eng = make_engine(llm)
    eng.load_weights([("w", torch.zeros(2))])
    out = eng.generate(prompts_batch(), SamplingParams(n=2, temperature=0.8, max_tokens=4))
    gen = [c for c in llm.calls if c[0] == "generate"][0]
    assert gen[1] == [[3, 4], [5, 6, 8, 9]]  # left padding stripped
    assert gen[2]["temperature"] == 0.8 and gen[2]["stop_token_ids"] == [EOS] and gen[2]["logprobs"] == 0
    # sample 1 of prompt 0 stopped at EOS after 2 tokens: EOS kept in the mask, padding after it
    assert out.tensors["responses"][1].tolist() == [30, 31, EOS, PAD]
    assert out.tensors["response_mask"][1].tolist() == [1, 1, 1, 0]
    assert out.tensors["responses"][0].tolist() == [20, 21, 22, 23]
    # identical to assembling the scripted responses directly (the hf engine's path)
    resp, lps = vr.collect_outputs(llm.generate([{"prompt_token_ids": [0]}] * 2, {"n": 2})[:2], 2, PAD)
    ref = assemble_rollout(prompts_batch(), resp, lps, 2, [EOS], PAD)
    for k in ("input_ids", "attention_mask", "position_ids", "response_mask", "responses", "rollout_log_probs", "prompts"):
        assert torch.equal(out.tensors[k], ref.tensors[k]), k
    assert out.non_tensors["uid"].tolist() == [0, 0, 1, 1]
    assert eng.last_generate_stats["num_tokens"] == 4 + 3 + 4 + 4 and eng.last_generate_stats["num_sequences"] == 4


def test_forced_lengths_become_one_request_per_sample():
    """Benchmarks impose each sample's length: n=1 requests with their own max_tokens and EOS ignored."""
    llm = FakeLLM(eos_at={}, length=8)
    eng = make_engine(llm)
    eng.load_weights([("w", torch.zeros(2))])
    lengths = (3, 1, 5, 2)
    out = eng.generate(prompts_batch(), SamplingParams(n=2, max_tokens=8, response_lengths=lengths))
    gen = [c for c in llm.calls if c[0] == "generate"][0]
    assert gen[1] == [[3, 4], [3, 4], [5, 6, 8, 9], [5, 6, 8, 9]]
    assert [sp["max_tokens"] for sp in gen[2]] == list(lengths)
    assert all(sp["n"] == 1 and sp["ignore_eos"] and sp["stop_token_ids"] == [] for sp in gen[2])
    assert out.tensors["response_mask"].sum(dim=1).tolist() == list(lengths)
    assert out.non_tensors["uid"].tolist() == [0, 0, 1, 1]


def test_generate_refuses_dummy_weights_and_sleeping_engine():
    eng = make_engine()
    with pytest.raises(RuntimeError, match="before any weights"):
        eng.generate(prompts_batch(), SamplingParams(max_tokens=2))
    eng.load_weights([("w", torch.zeros(2))])
    eng.sleep(2)
    with pytest.raises(RuntimeError, match="sleeping"):
        eng.generate(prompts_batch(), SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="sleeping engine"):
        eng.load_weights([("w", torch.zeros(2))])


def test_sleep_levels_and_weights_version():
    llm = FakeLLM()
    eng = make_engine(llm)
    eng.load_weights([("w", torch.zeros(2))])
    eng.finish_weight_update(3)
    eng.sleep(1)
    assert eng.weights_version == 3  # level 1 keeps (offloads) the weights
    eng.sleep(1)  # already asleep: no second call into vLLM
    assert [c for c in llm.calls if c[0] == "sleep"] == [("sleep", 1)]
    eng.wake_up(None)
    assert ("wake_up", ("kv_cache", "weights")) in llm.calls
    eng.generate(prompts_batch(), SamplingParams(max_tokens=2))  # weights still real after level 1
    eng.sleep(2)
    assert eng.weights_version is None
    eng.wake_up(["weights"])
    with pytest.raises(ValueError, match="tags"):
        eng.wake_up(["scheduling"])
    eng.wake_up(["weights"])  # already awake: no call
    assert [c for c in llm.calls if c[0] == "wake_up"][-1] == ("wake_up", ("weights",))
    with pytest.raises(ValueError, match="level"):
        eng.sleep(0)


def test_sleep_when_half_awake_wakes_the_rest_first():
    llm = FakeLLM()
    eng = make_engine(llm)
    eng.sleep(2)
    eng.wake_up(["weights"])
    eng.sleep(2)
    assert [c[0] for c in llm.calls] == ["sleep", "wake_up", "wake_up", "sleep"]


def test_prefix_cache_reset_after_new_weights_only():
    llm = FakeLLM()
    eng = make_engine(llm)
    eng.load_weights([("a", torch.zeros(1))])
    eng.load_weights([("b", torch.zeros(1))])
    eng.generate(prompts_batch(), SamplingParams(max_tokens=2))
    eng.generate(prompts_batch(), SamplingParams(max_tokens=2))
    names = [c[0] for c in llm.calls]
    assert names.count("reset_prefix_cache") == 1 and names.index("reset_prefix_cache") < names.index("generate")
    # with a sleep in between the reset happens at wake_up(kv_cache), before any generate
    eng.sleep(1)
    eng.wake_up(["weights"])
    eng.load_weights([("a", torch.zeros(1))])
    eng.wake_up(["kv_cache"])
    assert [c[0] for c in llm.calls][-2:] == ["wake_up", "reset_prefix_cache"]


def test_sharding_manager_cycle_with_vllm_engine():
    llm = FakeLLM()
    eng = make_engine(llm)
    params = [("model.embed_tokens.weight", torch.ones(4, 2)), ("model.norm.weight", torch.ones(2))]

    class Source:  # the WeightSource protocol, as TrainingEngine implements it
        def iter_full_params(self, dtype=None, skip_static=False):
            return iter(params)

        def offload(self, params=True, optimizer=True):
            pass

        def onload(self, params=True, optimizer=True):
            pass

    version = [0]
    sm = ShardingManager(Source(), eng, lambda: version[0], dtype=torch.float32, bucket_mb=1, sleep_level=2)
    with sm as e:
        e.generate(prompts_batch(), SamplingParams(max_tokens=2))
    assert eng.weights_version is None and sm.num_pushes == 1  # level 2 discarded them
    with sm:
        pass
    assert sm.num_pushes == 2 and len(llm.loaded) == 2
    seq = [c[0] if c[0] != "wake_up" else f"wake_up{c[1]}" for c in llm.calls]
    # second entry: weights woken, pushed through collective_rpc, cache reset with the kv wake, then asleep
    assert seq[-5:] == ["wake_up('weights',)", "rpc", "wake_up('kv_cache',)", "reset_prefix_cache", "sleep"]
    sm.sleep_level = 1
    with sm:
        pass
    with sm:
        pass
    assert sm.num_pushes == 3 and sm.last_sync_bytes == 0  # level 1 kept version 0: no re-push


# --------------------------------------------------------------------------- the adapter
def test_engine_model_adapter_paths():
    m = torch.nn.Linear(1, 1)
    assert vr.engine_model(SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: m))) is m
    assert vr.engine_model(SimpleNamespace(model_runner=SimpleNamespace(model=m))) is m  # older releases
    wrapped = SimpleNamespace(worker=SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: m)))
    assert vr.engine_model(wrapped) is m
    with pytest.raises(RuntimeError, match="needs updating"):
        vr.engine_model(SimpleNamespace())
    with pytest.raises(RuntimeError, match="needs updating"):
        vr.engine_model(SimpleNamespace(model_runner=SimpleNamespace(model=None)))


def test_rpc_helpers_go_through_the_adapter():
    m = torch.nn.Linear(2, 1)
    loaded = []
    m.load_weights = lambda weights: loaded.extend(weights) or {n for n, _ in weights}
    worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: m))
    assert vr._rpc_load_weights(worker, [("weight", torch.zeros(1, 2))]) == 1 and loaded[0][0] == "weight"
    reply = vr._rpc_read_weights(worker, ["bias"])
    assert isinstance(reply, bytes)  # an engine process's msgpack replies turn nested tensors into lists
    got = dict(torch.load(io.BytesIO(reply), weights_only=True))
    assert list(got) == ["bias"] and got["bias"].device.type == "cpu"
    got["bias"].add_(1)  # a copy, not the live parameter
    assert not torch.equal(got["bias"], m.bias.detach())


def test_named_weights_reads_through_collective_rpc():
    llm = FakeLLM()
    eng = make_engine(llm)
    names = [n for n, _ in eng.named_weights()]
    assert names == ["weight", "bias"] and ("rpc", "_rpc_read_weights") in llm.calls


def test_memory_budget_is_checked_before_vllm_starts():
    gib = 2**30
    vr.check_memory_budget(0.5, free_bytes=60 * gib, total_bytes=80 * gib)  # 40 GiB of 60 free: fine
    with pytest.raises(ModelLoadError, match=r"rollout.vllm.gpu_memory_utilization=0.9 asks for 72.0 GiB but only 30.0 GiB") as e:
        vr.check_memory_budget(0.9, free_bytes=30 * gib, total_bytes=80 * gib)
    assert "lower it (e.g. 0.32)" in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------- benchmarks/vllm_bench.py's bookkeeping
@pytest.fixture(scope="module")
def vb():
    """benchmarks/vllm_bench.py as a module (its environment defaults undone afterwards)."""
    import os

    saved = dict(os.environ)
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_bench.py"
    spec = importlib.util.spec_from_file_location("vllm_bench", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return module


def _no_sync():
    pass


def _bench_args(**kw):
    return SimpleNamespace(**{**dict(n=2, response_length=5, prompts=3, prompt_length=4, tp=1), **kw})


class _FakeSP:
    """Stands in for vllm.SamplingParams: a msgspec Struct with the flat_logprobs field, built from kwargs."""
    __struct_fields__ = ("n", "logprobs", "flat_logprobs")

    def __new__(cls, **kw):
        return dict(kw)


def test_bench_throughput_runs_time_our_whole_path_and_the_same_kwargs(vb):
    llm = FakeLLM(length=9)
    eng = make_engine(llm)
    eng.load_weights([("w", torch.zeros(2))])
    args = _bench_args()
    prompts = random_prompts(3, 4, seed=1)
    raw_ids = vr.unpad_prompts(prompts.tensors["input_ids"], prompts.tensors["attention_mask"])
    raw_kwargs = vb.raw_sampling_kwargs(args, _FakeSP)
    res = vb.throughput_runs(eng, prompts, raw_ids, vb.bench_params(args), raw_kwargs, _FakeSP, repeats=2,
                             warmup_tokens=3, sync=_no_sync)
    assert res["engine_sampling_kwargs"] == raw_kwargs  # like with like: logprobs=0, flat, EOS ignored
    assert raw_kwargs["logprobs"] == 0 and raw_kwargs["flat_logprobs"] and raw_kwargs["ignore_eos"]
    gens = [c for c in llm.calls if c[0] == "generate"]
    assert [g[2]["max_tokens"] for g in gens] == [3, 5, 5, 5, 5]  # untimed warm-up first, then the timed pairs
    assert all(g[1] == raw_ids for g in gens)  # every run sends the same prompts
    assert [c[0] for c in llm.calls].count("reset_prefix_cache") == 1 + 4  # after the push, then before each run
    for run in res["in_engine"] + res["raw"]:
        assert run["tokens"] == 3 * 2 * 5 and run["seconds"] > 0 and run["tok_per_s"] > 0
        assert set(run["gc_collections"]) <= set(range(1000)) and run["gc_s"] >= 0
    for run in res["in_engine"]:
        assert run["masked_tokens"] == 30 and 0 <= run["vllm_seconds"] <= run["seconds"]
        assert run["postprocess_s"] == pytest.approx(run["seconds"] - run["vllm_seconds"])
    assert eng.ignore_eos is False and eng.make_sampling_params is dict  # restored


def test_bench_standalone_runs_warm_up_then_time(vb):
    llm = FakeLLM(length=9)
    args = _bench_args()
    ids = [[1, 2], [3], [4, 5, 6]]
    res = vb.standalone_runs(llm, _FakeSP, ids, vb.raw_sampling_kwargs(args, _FakeSP), repeats=3, warmup_tokens=2,
                             sync=_no_sync)
    assert [g[2]["max_tokens"] for g in llm.calls if g[0] == "generate"] == [2, 5, 5, 5]
    assert len(res["runs"]) == 3 and all(r["tokens"] == 30 for r in res["runs"]) and res["warmup_s"] >= 0


def test_bench_summarize_per_run_slowest_rank(vb):
    r0 = [dict(tokens=100, seconds=1.0, postprocess_s=0.1), dict(tokens=100, seconds=2.0, postprocess_s=0.3)]
    r1 = [dict(tokens=100, seconds=1.25, postprocess_s=0.2), dict(tokens=100, seconds=0.5, postprocess_s=0.1)]
    dp = vb.summarize([r0, r1], tp=1, replicated=False, expected_tokens=200)
    assert [r["tok_per_s"] for r in dp["runs"]] == [160, 100]  # 200 tokens over the slowest rank's time
    assert dp["tok_per_s_median"] == 130 and dp["tok_per_s_best"] == 160 and dp["tokens_as_expected"]
    assert dp["postprocess_s_median"] == pytest.approx(0.25) and dp["tok_per_s_per_gpu_median"] == 65
    tp = vb.summarize([r0, r1], tp=2, replicated=True, expected_tokens=200)  # one engine: count its tokens once
    assert tp["runs"][0]["tokens"] == 100 and not tp["tokens_as_expected"]
    with pytest.raises(ValueError, match="no timed runs"):
        vb.summarize([[]], 1, True, 0)


def test_bench_like_for_like_and_ratio(vb):
    a = dict(device="H200x1", sampling_kwargs=dict(logprobs=0, flat_logprobs=True), n=8)
    assert vb.like_for_like(a, dict(a)) == []
    diff = vb.like_for_like(a, dict(a, sampling_kwargs=dict(logprobs=None)))
    assert len(diff) == 1 and diff[0].startswith("sampling_kwargs:")
    assert vb.ratio(95, 100) == 0.95 and vb.ratio(1, 0) != vb.ratio(1, 0)  # nan


def test_bench_gc_timer_counts_collections(vb):
    import gc

    with vb.GcTimer() as g:
        gc.collect()
    assert g.collections[2] >= 1 and g.seconds > 0
    assert g._callback not in gc.callbacks


@pytest.mark.parametrize("argv,msg", [(["--only", "parity,bogus"], "unknown sections"),
                                      (["--repeats", "0"], "must be >= 1"), (["--tp", "3"], "divisible")])
def test_bench_cli_rejects_bad_arguments(vb, argv, msg, capsys):
    with pytest.raises(SystemExit):
        vb.main(argv)
    assert msg in capsys.readouterr().err


def test_bench_standalone_then_hybrid_end_to_end_on_cpu(vb, tmp_path, monkeypatch):
    """The whole benchmark (every section) on CPU: a fake ``vllm`` module, a tiny model of a small vocabulary."""
    import os

    made = []

    class FakeVllm(SimpleNamespace):
        pass

    def make_llm(**kwargs):
        made.append(kwargs)
        return FakeLLM(length=9)

    monkeypatch.setitem(sys.modules, "vllm", FakeVllm(LLM=make_llm, SamplingParams=_FakeSP, __version__="0.26.0-fake"))
    arch = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True, rms_norm_eps=1e-6, vocab_size=128)
    monkeypatch.setattr(vb, "QWEN25_05B", arch)
    monkeypatch.setattr(vb, "EOS", 127)
    monkeypatch.setattr(vb, "PAD", 126)
    monkeypatch.setattr(vb, "PROMPT_ID_HIGH", 100)
    monkeypatch.setattr(vb, "device_tag", lambda world: f"CPUx{world}")
    monkeypatch.setattr(vb, "free_mem", lambda: 0)
    monkeypatch.setattr(vb._Tok, "eos_token_id", 127)
    monkeypatch.setattr(vb._Tok, "pad_token_id", 126)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "cpu")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    common = ["--model-dir", str(tmp_path / "model"), "--standalone-json", str(tmp_path / "sa.json"), "--out", str(tmp_path),
              "--prompts", "4", "--n", "2", "--prompt-length", "8", "--response-length", "6", "--repeats", "2",
              "--warmup-tokens", "2", "--cycles", "2", "--pushes", "1"]
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    saved = dict(os.environ)
    try:
        monkeypatch.setattr(vb, "init_distributed", lambda pref: dist)
        vb.main(common + ["--standalone"])
        vb.main(common)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert made[0] == made[1] and made[0]["load_format"] == "dummy"  # same engine arguments in both processes
    thr = json.loads((tmp_path / "vllm_CPUx1_throughput.json").read_text())
    fig = thr["figures"]
    assert fig["like_for_like"] == [] and fig["engine_sampling_kwargs_equal_raw"]
    assert fig["sampling_kwargs"]["logprobs"] == 0 and fig["sampling_kwargs"]["flat_logprobs"]
    expected = 4 * 2 * 6
    for key in ("in_engine", "same_llm_raw", "standalone", "in_engine_after_wake"):
        assert fig[key]["tokens_as_expected"] and fig[key]["expected_tokens"] == expected, key
    assert len(fig["in_engine"]["runs"]) == 2 and len(fig["in_engine_after_wake"]["runs"]) == 1
    assert fig["in_engine_over_standalone"] > 0 and fig["target"] == 0.95 and "meets_target" in fig
    assert thr["device"] == "CPUx1" and thr["world_size"] == 1
    for what in ("parity", "push", "sleep", "cycles"):
        assert (tmp_path / f"vllm_CPUx1_{what}.json").exists(), what


# --------------------------------------------------------------------------- micro-benchmark: python tests/engine/test_vllm_cpu.py
def _micro_benchmark(reps: int = 7) -> None:
    """Reference vs current post-processing for 64 prompts × n=8 = 512 sequences × 512 tokens (CPU time, 1 thread)."""
    torch.set_num_threads(1)
    prompts = random_prompts(64, 256, seed=0)
    ids, mask = prompts.tensors["input_ids"], prompts.tensors["attention_mask"]

    def cpu_ms(fn):
        times = []
        for _ in range(reps):
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
        return sorted(times)[len(times) // 2] * 1e3

    for fmt in ("flat", "dict"):
        outs = random_outputs(64, 8, 512, flat=fmt == "flat", seed=0, shuffle=False)
        for o in (c for ro in outs for c in ro.outputs):  # fixed lengths, as the throughput benchmark
            o.token_ids = (o.token_ids * (512 // max(len(o.token_ids), 1) + 1))[:512]
            lps = [-(i % 7) / 3 for i in range(512)]
            o.logprobs = sample_logprobs(o.token_ids, lps, flat=fmt == "flat")
        rows = {}
        for name, unpad, collect, assemble in (("before", ref_unpad_prompts, ref_collect_outputs, ref_assemble_rollout),
                                               ("after", vr.unpad_prompts, vr.collect_outputs, assemble_rollout)):
            resp, lps = collect(outs, 8, PAD)
            rows[name] = dict(unpad=cpu_ms(lambda: unpad(ids, mask)), collect=cpu_ms(lambda: collect(outs, 8, PAD)),
                              assemble=cpu_ms(lambda: assemble(prompts, resp, lps, 8, [EOS], PAD)))
            rows[name]["total"] = sum(rows[name].values())
        for name, r in rows.items():
            print(f"{fmt:4s} {name:6s}: unpad {r['unpad']:6.1f} ms  collect_outputs {r['collect']:6.1f} ms  "
                  f"assemble_rollout {r['assemble']:6.1f} ms  total {r['total']:6.1f} ms")


if __name__ == "__main__":
    _micro_benchmark()


def test_vllm_engine_dtype_follows_the_model_except_float32():
    """vLLM 0.26's float32 generate crashes after its first sleep/wake (on H200): a float32 model runs a
    bfloat16 engine (the push casts), an explicit float32 engine is refused before any GPU work, other dtypes pass."""
    cpu = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    fp32 = _cfg("model.dtype=float32")
    assert fp32.rollout_dtype == "bfloat16" and vr.engine_kwargs(fp32, cpu)["dtype"] == "bfloat16"
    assert vr.engine_kwargs(_cfg("model.dtype=float32", "rollout.dtype=float16"), cpu)["dtype"] == "float16"
    assert _cfg("model.dtype=bfloat16").rollout_dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"rollout.dtype=float32 with rollout.name=vllm: .* use rollout.dtype=auto"):
        _cfg("model.dtype=float32", "rollout.dtype=float32").validate()
    # the transformers engine keeps the model's dtype unless told otherwise
    hf = load_config(None, ["rollout.name=hf", "model.dtype=float32"]).validate()
    assert hf.rollout_dtype == "float32"
    assert load_config(None, ["rollout.name=hf", "model.dtype=float32", "rollout.dtype=bfloat16"]).validate().rollout_dtype == "bfloat16"


# --------------------------------------------------------------------------- rollout.cuda_stream
class V2Runner:
    """vLLM 0.26's V2 model runner as far as streams go: ``main_stream`` cached from its first call."""

    calls = 0

    @functools.cached_property
    def main_stream(self):
        V2Runner.calls += 1
        return f"caller's stream {V2Runner.calls}"


def test_runner_main_stream_is_pinned_and_given_back():
    runner = V2Runner()
    worker = SimpleNamespace(worker=SimpleNamespace(model_runner=runner))
    assert runner.main_stream == "caller's stream 1"  # vLLM's first call cached its caller's stream
    assert vr._rpc_pin_main_stream(worker, "engine stream") is True
    assert runner.main_stream == "engine stream"
    assert vr._rpc_pin_main_stream(worker, None) is True
    assert runner.main_stream == "caller's stream 2"  # vLLM's own again: cached anew on the next call
    # the V1 runner reads the current stream on every call: nothing to pin
    assert vr._rpc_pin_main_stream(SimpleNamespace(model_runner=SimpleNamespace(get_model=None)), "s") is False


def test_use_stream_pins_the_runner_and_gives_it_back():
    llm = FakeLLM()
    runner = V2Runner()
    llm.collective_rpc = lambda fn, args=(): [fn(SimpleNamespace(model_runner=runner), *args)]
    eng = make_engine(llm)
    eng.use_stream(GenerationStream(torch.device("cpu"), "high"))  # CPU: no stream, so nothing is pinned
    assert not eng.runner_stream_pinned and "main_stream" not in vars(runner)
    own = GenerationStream(torch.device("cpu"), "own")
    own.stream = "engine stream"  # what a CUDA device would create
    eng.use_stream(own)
    assert eng.runner_stream_pinned and runner.main_stream == "engine stream" and eng.gen_stream is own
    eng.use_stream(GenerationStream(torch.device("cpu"), "shared"))  # back: the runner caches its caller's again
    assert runner.main_stream.startswith("caller's stream")


def test_generation_stream_modes_on_cpu_and_a_bad_mode():
    for mode in ("shared", "own", "high"):
        gs = GenerationStream(torch.device("cpu"), mode)
        assert gs.stream is None
        gs.mark_ready()
        with gs.active():
            pass
    with pytest.raises(ValueError, match="rollout.cuda_stream='fast'"):
        GenerationStream(torch.device("cpu"), "fast")
    with pytest.raises(ConfigError, match="rollout.cuda_stream"):
        load_config(None, ["rollout.cuda_stream=fast"])
    assert load_config(None, ["rollout.cuda_stream=high"]).rollout.cuda_stream == "high"


class SpyStream(GenerationStream):
    """Records what happens to the generation stream: pushes/wakes that mark it ready, and generate calls inside it."""

    def __init__(self, log: list):
        super().__init__(torch.device("cpu"))
        self.log = log

    def mark_ready(self) -> None:
        self.log.append("ready")

    @contextlib.contextmanager
    def active(self):
        self.log.append("enter")
        yield
        self.log.append("exit")


def test_both_engines_generate_inside_the_generation_stream(tiny_model_path):
    """generate runs inside gen_stream.active(), and a push (or a wake-up) marks the stream ready first: the GPU test
    checks the stream itself, this the wiring of both engines."""
    from hybrid_rl.rollout.hf import HFRolloutEngine
    from hybrid_rl.models import load_causal_lm

    log: list[str] = []
    eng = make_engine(FakeLLM(length=3))
    eng.gen_stream = SpyStream(log)
    eng.load_weights([("w", torch.zeros(2))])
    eng.finish_weight_update(1)
    inside = []
    real = eng.llm.generate
    eng.llm.generate = lambda *a, **k: inside.append(log[-1]) or real(*a, **k)
    eng.generate(prompts_batch(), SamplingParams(n=2, max_tokens=3))
    assert log == ["ready", "enter", "exit"] and inside == ["enter"]
    log.clear()
    eng.sleep(1)
    eng.wake_up()
    assert log == ["ready"]

    hf = HFRolloutEngine(load_causal_lm(tiny_model_path, torch.float32), [EOS], PAD, torch.device("cpu"))
    hf.gen_stream = SpyStream(log)
    log.clear()
    hf.finish_weight_update(1)
    out = hf.generate(prompts_batch(), SamplingParams(n=1, max_tokens=2))
    segs = hf.generate_interruptible([Continuation([3, 4], (), 2, True)], SamplingParams(n=1))
    assert log == ["ready", "enter", "exit", "enter", "exit"]
    assert out.tensors["responses"].shape == (2, 2) and len(segs[0].tokens) == 2


# --------------------------------------------------------------------------- rollout.vllm.engine_process
def test_engine_process_config_errors_name_the_key():
    for over, key in ((["rollout.name=hf", "rollout.vllm.engine_process=true"], "rollout.vllm.engine_process=true is for"),
                      (["rollout.name=vllm", "rollout.vllm.engine_process=true", "rollout.cuda_stream=high"],
                       "rollout.cuda_stream=high"),
                      (["rollout.name=vllm", "rollout.vllm.engine_process=true", "rollout.vllm.tensor_parallel_size=2"],
                       "rollout.vllm.tensor_parallel_size=1")):
        with pytest.raises(ConfigError, match=key) as ei:
            load_config(None, ["model.dtype=bfloat16", *over]).validate(world_size=2)
        assert "\n" not in str(ei.value)
    _cfg("rollout.vllm.engine_process=true").validate()


def test_physical_gpu_follows_the_parents_visible_list():
    assert vp.physical_gpu(torch.device("cuda", 2), None) == "2"
    assert vp.physical_gpu(torch.device("cuda", 1), "4, 6") == "6"
    assert vp.physical_gpu(torch.device("cuda", 0), "GPU-abc,GPU-def") == "GPU-abc"
    with pytest.raises(RuntimeError, match="not among"):
        vp.physical_gpu(torch.device("cuda", 3), "0,1")


def test_engine_process_is_spawned_alone_on_its_gpu_and_the_environment_restored(monkeypatch):
    """from_config with rollout.vllm.engine_process: vLLM is built with the uni executor while multiprocessing is on, only
    this rank's GPU is visible and torchrun's variables are hidden; afterwards the environment is as it was (but for
    the serialisation switch the later calls need), and no stream is pinned in a process the engine is not in."""
    seen = {}

    class SpawnLLM(FakeLLM):
        def __init__(self, **kwargs):
            super().__init__()
            seen.update(kwargs=kwargs, env=dict(__import__("os").environ))

        def collective_rpc(self, fn, args=(), kwargs=None):
            if fn is vp._rpc_die_with_parent:  # runs in the engine process; here it would bind this test process
                seen["die_with"] = args
                return [True]
            return super().collective_rpc(fn, args, kwargs)

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=SpawnLLM, SamplingParams=dict))
    for key, value in dict(RANK="1", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                           CUDA_VISIBLE_DEVICES="0,1,2,3", VLLM_ENABLE_V1_MULTIPROCESSING="0").items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    dist = DistInfo(rank=1, world_size=4, local_rank=1, device=torch.device("cpu"))
    monkeypatch.setattr(vp, "physical_gpu", lambda device, visible: visible.split(",")[1])  # cuda:1 on a CPU box
    eng = vr.VLLMRolloutEngine.from_config(_cfg("rollout.vllm.engine_process=true"), dist,
                                           SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD))
    assert seen["kwargs"]["distributed_executor_backend"] == "uni"
    env = seen["env"]
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} & set(env)
    import os
    assert os.environ["RANK"] == "1" and os.environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert eng.in_process is False and not eng.llm.calls and eng.pool_bytes() == 0
    assert seen["die_with"] == (os.getpid(),)
    # the in-process default: the external launcher, and the stream set up as before
    seen.clear()
    eng = vr.VLLMRolloutEngine.from_config(_cfg(), dist, SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD))
    assert seen["kwargs"]["distributed_executor_backend"] == "external_launcher" and eng.in_process
    assert seen["env"]["RANK"] == "1" and seen["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_an_engine_process_under_torchrun_sets_up_its_own_world_of_one(monkeypatch):
    """Regression (4xH200, every rank's engine process hung in its set-up): torchrun sets
    TORCHELASTIC_USE_AGENT_STORE=True, and a child that inherits it connects to a store nobody serves when vLLM's
    worker calls init_process_group(tcp://..., world_size=1). A child spawned inside engine_process_env with
    torchrun's variables around it must build its world of one."""
    import os
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import datetime, torch.distributed as d; d.init_process_group('gloo', init_method='tcp://127.0.0.1:%d', "
            "world_size=1, rank=0, timeout=datetime.timedelta(seconds=15)); print('world', d.get_world_size())" % port)
    torchrun_env = dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port + 1),
                        TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID="r", TORCHELASTIC_RESTART_COUNT="0")
    for key, value in torchrun_env.items():
        monkeypatch.setenv(key, value)
    with vp.engine_process_env(torch.device("cuda", 1)):
        hidden = {k for k in torchrun_env if k in os.environ}
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert {k: os.environ[k] for k in torchrun_env} == torchrun_env  # the trainer's own environment is back
    assert not hidden
    assert child.returncode == 0 and child.stdout.split() == ["world", "1"], child.stderr[-800:]


def test_ipc_handles_are_opened_with_the_engine_process_device_index():
    """A handle's storage device is the trainer's index (cuda:3); the engine process sees the GPU as 0."""
    args = tuple(range(15))
    out = vp.rebuild_ipc((lambda *a: a, args), device_index=0)
    assert out[vp._IPC_DEVICE_ARG] == 0 and out[:6] == args[:6] and out[7:] == args[7:]
    with pytest.raises(ValueError, match="CUDA tensor"):
        vp.cuda_ipc_handle(torch.zeros(2))


def test_an_engine_process_is_born_deaf_to_sigterm_and_sigint():
    """Spawned inside ``signals_blocked``, a child starts with SIGTERM and SIGINT blocked (a stop signal to the whole
    process group leaves the engine running while the trainer finishes its step); this thread's mask comes back."""
    import signal
    import subprocess

    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    with vp.signals_blocked():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        blocked = int(next(line.split()[1] for line in open(f"/proc/{child.pid}/status") if line.startswith("SigBlk")), 16)
        assert blocked & (1 << (signal.SIGTERM - 1)) and blocked & (1 << (signal.SIGINT - 1))
    finally:
        child.kill()
        child.wait()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


@pytest.mark.slow
def test_an_engine_process_dies_with_its_parent():
    """``_rpc_die_with_parent`` sets the kernel's parent-death signal to SIGKILL (read back with PR_GET_PDEATHSIG)."""
    import subprocess

    code = ("import ctypes, os; from hybrid_rl.rollout.vllm_process import _rpc_die_with_parent as f; ok = f(None, os.getppid()); "
            "v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v), 0, 0, 0); print(ok, v.value)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == ["True", "9"], out.stderr[-500:]
