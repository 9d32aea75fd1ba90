"""CPU tests of the vLLM backend's own code: the missing-vLLM error, prompt un-padding, sampling
arguments, output assembly, the sleep/wake/push state machine and the worker→model adapter.

vLLM itself is never imported here: the fakes below stand in for ``vllm.LLM`` and its output
objects so that *our* conversion code is what is tested. The real engine is exercised by
``tests/test_vllm_gpu.py`` on a GPU machine.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_rl.batch import Batch  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.distributed import DistInfo  # noqa: E402
from hybrid_rl.models import ModelLoadError  # noqa: E402
from hybrid_rl.rollout import vllm as vr  # noqa: E402
from hybrid_rl.rollout.base import SamplingParams, assemble_rollout  # noqa: E402
from hybrid_rl.sharding_manager import ShardingManager  # noqa: E402

EOS, PAD = 7, 0


# --------------------------------------------------------------------------- fakes of vLLM's objects
@dataclass
class FakeLogprob:
    logprob: float


@dataclass
class FakeFlatLogprobs:
    """The shape of vllm.logprobs.FlatLogprobs: flat lists plus per-position [start, end)."""
    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def append(self, entries: list[tuple[int, float]]) -> None:
        self.start_indices.append(len(self.logprobs))
        for t, lp in entries:
            self.token_ids.append(t)
            self.logprobs.append(lp)
        self.end_indices.append(len(self.logprobs))

    def __len__(self) -> int:
        return len(self.start_indices)


def completion(index, tokens, flat=True):
    lps = [-(0.1 * (i + 1) + 0.01 * t) for i, t in enumerate(tokens)]
    if flat:
        lp = FakeFlatLogprobs()
        for t, v in zip(tokens, lps):
            lp.append([(t, v)])
    else:
        lp = [{t: FakeLogprob(v)} for t, v in zip(tokens, lps)]
    return SimpleNamespace(index=index, token_ids=tuple(tokens), logprobs=lp), lps


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
            outs.append(SimpleNamespace(outputs=comps))
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


@pytest.mark.parametrize("flat", [True, False])
def test_sampled_logprobs_flat_and_dict_forms(flat):
    c, lps = completion(0, [4, 5, 6], flat=flat)
    assert vr.sampled_logprobs(c.token_ids, c.logprobs) == pytest.approx(lps)


def test_sampled_logprobs_finds_sampled_token_among_topk_and_checks_lengths():
    lp = FakeFlatLogprobs()
    lp.append([(9, -0.5), (4, -1.5)])  # sampled token listed second
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
    outs = [SimpleNamespace(outputs=[a1, a0]), SimpleNamespace(outputs=[b0, b1])]
    resp, lps = vr.collect_outputs(outs, n=2, pad_token_id=PAD)
    assert resp.tolist() == [[11, 12, 13, PAD], [21, PAD, PAD, PAD], [31, 32, PAD, PAD], [41, 42, 43, 44]]
    assert lps[0, :3].tolist() == pytest.approx(lp_a0) and lps[1, 1:].abs().sum() == 0
    assert lps[3].tolist() == pytest.approx(lp_b1) and lps.dtype == torch.float32
    with pytest.raises(RuntimeError, match="expected n=3"):
        vr.collect_outputs(outs, n=3, pad_token_id=PAD)


def test_engine_kwargs_from_config():
    cfg = _cfg("data.max_prompt_length=100", "data.max_response_length=28", "rollout.tensor_parallel_size=2",
               "rollout.gpu_memory_utilization=0.4", "rollout.enforce_eager=true", "trainer.seed=5")
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
    assert vr.engine_kwargs(_cfg("rollout.max_model_len=4096"), DistInfo(0, 1, 0, torch.device("cpu")))["max_model_len"] == 4096
    with pytest.raises(ValueError, match="must divide"):
        vr.engine_kwargs(cfg, DistInfo(0, 3, 0, torch.device("cpu")))


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
    eng.weights_version = 3
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

        def onload(self):
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
    got = dict(vr._rpc_read_weights(worker, ["bias"]))
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
    with pytest.raises(ModelLoadError, match=r"rollout.gpu_memory_utilization=0.9 asks for 72.0 GiB but only 30.0 GiB") as e:
        vr.check_memory_budget(0.9, free_bytes=30 * gib, total_bytes=80 * gib)
    assert "lower it (e.g. 0.32)" in str(e.value) and "\n" not in str(e.value)
