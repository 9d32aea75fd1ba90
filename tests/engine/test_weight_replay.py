"""Record-and-replay weight loading (``hybrid_rl.weights.replay``) against real and vLLM-like loaders.

Every test pushes several weight versions and compares the engine, bit for bit,
with what the real loader produces (or with an independent reference), while
counting how many tensors went through the engine's Python loader: all of them
on the recording push, one (the per-push sentinel) on a replayed push.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_rl.rollout.base import RolloutEngine
from hybrid_rl.weights.replay import WeightReplayer
from hybrid_rl.weights.sharding_manager import ShardingManager

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- a vLLM-like engine
class FusedEngine(RolloutEngine):
    """vLLM's Qwen2 loading in miniature, for tensor-parallel rank ``tp_rank`` of ``tp_size``.

    q/k/v go into ``qkv_proj`` and gate/up into ``gate_up_proj`` through
    ``param.data.narrow(0, offset, rows).copy_(w.narrow(0, tp_rank * rows, rows))``
    (QKVParallelLinear / MergedColumnParallelLinear), o/down are row-parallel
    (the source narrowed on dim 1), the embedding fills its padding rows with
    zeros (VocabParallelEmbedding), norms are copied whole.
    """

    H, I, V, V_PAD = 8, 12, 10, 12
    STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, tp_rank: int = 0, tp_size: int = 1):
        h, i, tp = self.H, self.I, tp_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.sizes = {"qkv_proj": [h, h // 2, h // 2], "gate_up_proj": [i, i]}
        shapes = {"model.embed_tokens.weight": (self.V_PAD, h), "model.norm.weight": (h,)}
        for layer in range(2):
            p = f"model.layers.{layer}."
            shapes.update({p + "self_attn.qkv_proj.weight": (2 * h // tp, h), p + "self_attn.qkv_proj.bias": (2 * h // tp,),
                           p + "self_attn.o_proj.weight": (h, h // tp), p + "mlp.gate_up_proj.weight": (2 * i // tp, h),
                           p + "mlp.down_proj.weight": (h, i // tp), p + "input_layernorm.weight": (h,)})
        # -1 marks memory no load has written yet
        self.params = {n: torch.nn.Parameter(torch.full(s, -1.0), requires_grad=False) for n, s in shapes.items()}
        self.loaded = 0  # tensors that went through the Python loader

    def load_weights(self, weights):
        with torch.no_grad():
            for name, w in weights:
                self.loaded += 1
                self.load_one(name, w)

    def load_one(self, name: str, w: torch.Tensor) -> None:
        for part, (fused, shard) in self.STACKED.items():
            if f".{part}." in name:
                param = self.params[name.replace(part, fused)]
                sizes = self.sizes[fused]
                rows = sizes[shard] // self.tp_size
                offset = sum(sizes[:shard]) // self.tp_size
                param.data.narrow(0, offset, rows).copy_(w.narrow(0, self.tp_rank * rows, rows))
                return
        param = self.params[name]
        if "embed_tokens" in name:
            param[:w.shape[0]].data.copy_(w)
            param[w.shape[0]:].data.fill_(0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            cols = param.shape[1]
            param.data.copy_(w.narrow(1, self.tp_rank * cols, cols))
        else:
            param.data.copy_(w)

    def named_weights(self):
        return self.params.items()

    def generate(self, prompts, params):
        raise NotImplementedError

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self, tags=None) -> None:
        pass


def hf_weights(seed: int, view_of_one_buffer: bool = True) -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors for ``FusedEngine``; by default views into one flat buffer, as the gather yields them."""
    h, i, v = FusedEngine.H, FusedEngine.I, FusedEngine.V
    shapes = [("model.embed_tokens.weight", (v, h))]
    for layer in range(2):
        p = f"model.layers.{layer}."
        shapes += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (h // 2, h)),
                   (p + "self_attn.v_proj.weight", (h // 2, h)), (p + "self_attn.q_proj.bias", (h,)),
                   (p + "self_attn.k_proj.bias", (h // 2,)), (p + "self_attn.v_proj.bias", (h // 2,)),
                   (p + "self_attn.o_proj.weight", (h, h)), (p + "mlp.gate_proj.weight", (i, h)),
                   (p + "mlp.up_proj.weight", (i, h)), (p + "mlp.down_proj.weight", (h, i)),
                   (p + "input_layernorm.weight", (h,))]
    shapes.append(("model.norm.weight", (h,)))
    g = torch.Generator().manual_seed(seed)
    total = sum(torch.Size(s).numel() for _, s in shapes)
    flat = torch.randn(total + 7, generator=g)
    out, off = [], 3 + seed % 4  # a different offset every version: views are rebuilt relative to each tensor
    for name, shape in shapes:
        n = torch.Size(shape).numel()
        t = flat[off:off + n].view(shape)
        out.append((name, t if view_of_one_buffer else t.clone()))
        off += n
    return out


def fused_reference(weights, tp_rank: int = 0, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """What ``FusedEngine`` must hold, computed with cat/chunk instead of the loader."""
    w = dict(weights)
    ref = {"model.embed_tokens.weight": torch.cat([w["model.embed_tokens.weight"], torch.zeros(2, FusedEngine.H)]),
           "model.norm.weight": w["model.norm.weight"]}
    shard = lambda t, dim=0: t.chunk(tp_size, dim)[tp_rank]  # noqa: E731
    for layer in range(2):
        p = f"model.layers.{layer}."
        for kind in ("weight", "bias"):
            ref[p + f"self_attn.qkv_proj.{kind}"] = torch.cat([shard(w[p + f"self_attn.{x}_proj.{kind}"]) for x in "qkv"])
        ref[p + "mlp.gate_up_proj.weight"] = torch.cat([shard(w[p + "mlp.gate_proj.weight"]), shard(w[p + "mlp.up_proj.weight"])])
        ref[p + "self_attn.o_proj.weight"] = shard(w[p + "self_attn.o_proj.weight"], 1)
        ref[p + "mlp.down_proj.weight"] = shard(w[p + "mlp.down_proj.weight"], 1)
        ref[p + "input_layernorm.weight"] = w[p + "input_layernorm.weight"]
    return ref


def assert_engine_equals(engine, ref: dict[str, torch.Tensor]) -> None:
    got = dict(engine.named_weights())
    assert sorted(got) == sorted(ref)
    bad = [n for n in ref if not torch.equal(got[n], ref[n])]
    assert bad == [], bad


class ListSource:
    """A WeightSource that yields ``make(version)``."""

    def __init__(self, make, version):
        self.make, self.version = make, version

    def iter_full_params(self, dtype=None, skip_static=False):
        return iter(self.make(self.version[0]))

    def offload(self, params=True, optimizer=True):
        pass

    def onload(self, params=True, optimizer=True):
        pass


def make_manager(engine, make, bucket_bytes: int | None = None, **kw) -> tuple[ShardingManager, list[int]]:
    version = [0]
    sm = ShardingManager(ListSource(make, version), engine, lambda: version[0], dtype=torch.float32, **kw)
    if bucket_bytes is not None:
        sm.bucket_bytes = bucket_bytes
    return sm, version


def cycle(sm: ShardingManager, version: list[int]) -> None:
    version[0] += 1
    with sm:
        pass


# --------------------------------------------------------------------------- vLLM-like loader
@pytest.mark.parametrize("tp_rank,tp_size", [(0, 1), (1, 2), (0, 2)])
def test_fused_loader_replays_bit_identically(tp_rank, tp_size):
    engine = FusedEngine(tp_rank, tp_size)
    sm, version = make_manager(engine, hf_weights, bucket_bytes=600)  # several buckets, q/k/v split across some
    n = len(hf_weights(0))
    for step in range(4):
        cycle(sm, version)
        assert_engine_equals(engine, fused_reference(hf_weights(version[0]), tp_rank, tp_size))
    st = sm.replayer.stats
    assert st.recorded >= 3 and st.invalid == 0 and st.replayed == 3 * st.recorded
    # the first push went through the loader; each later one handed it a single sentinel tensor
    assert engine.loaded == n + 3
    assert sm.last_sync_tensors == n and sm.last_sync_replayed == n - 1


def test_separate_tensors_and_offsets_change_between_pushes():
    engine = FusedEngine()
    sm, version = make_manager(engine, lambda v: hf_weights(v, view_of_one_buffer=v % 2 == 0))
    for _ in range(4):  # alternately views of one buffer (varying offsets) and standalone tensors
        cycle(sm, version)
        assert_engine_equals(engine, fused_reference(hf_weights(version[0])))
    assert sm.replayer.stats.replayed == 3 and sm.replayer.stats.recorded == 1


# --------------------------------------------------------------------------- the HF engine
def test_hf_engine_replay_equals_real_loader(tiny_model_path):
    from hybrid_rl.models import load_causal_lm
    from hybrid_rl.rollout.hf import HFRolloutEngine

    def engine():
        return HFRolloutEngine(load_causal_lm(tiny_model_path, torch.float32), [0], 0, torch.device("cpu"))

    replayed, plain = engine(), engine()
    shapes = [(n, p.shape) for n, p in replayed.model.named_parameters()]  # tied lm_head comes once

    def make(v):
        g = torch.Generator().manual_seed(v)
        return [(n, torch.randn(s, generator=g)) for n, s in shapes]

    calls = []
    real = replayed.load_weights
    replayed.load_weights = lambda ws: calls.append(len(ws)) or real(ws)
    sm, version = make_manager(replayed, make, bucket_bytes=64 * 1024)
    sm_plain, version_plain = make_manager(plain, make, replay=False)
    for step in range(3):
        cycle(sm, version)
        cycle(sm_plain, version_plain)
        want = dict(plain.named_weights())
        got = dict(replayed.named_weights())
        assert all(torch.equal(got[n], want[n]) for n in want)
        assert torch.equal(replayed.model.lm_head.weight, want["model.embed_tokens.weight"])
        assert all(torch.equal(got[n], t) for n, t in make(version[0]))
    buckets = sm.replayer.stats.recorded
    assert buckets > 1 and sum(calls[:buckets]) == len(shapes)  # first push: every tensor through the loader
    assert calls[buckets:] == [1, 1]  # later pushes: the sentinel only
    assert sm_plain.replayer is None and sm.last_sync_replayed == len(shapes) - 1


def test_hf_level2_sleep_invalidates_and_records_again(tiny_model_path):
    from hybrid_rl.models import load_causal_lm
    from hybrid_rl.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(load_causal_lm(tiny_model_path, torch.float32), [0], 0, torch.device("cpu"))
    shapes = [(n, p.shape) for n, p in engine.model.named_parameters()]
    make = lambda v: [(n, torch.full(s, float(v))) for n, s in shapes]  # noqa: E731
    sm, version = make_manager(engine, make)
    cycle(sm, version)
    cycle(sm, version)
    assert sm.replayer.stats.replayed == 1 and sm.replayer.plans == 1
    sm.sleep_level = 2  # the engine re-allocates its weights on every wake: plans must go
    for _ in range(5):
        version[0] += 1
        with sm:
            assert all(torch.equal(p, t) for (_, p), (_, t) in zip(engine.model.named_parameters(), make(version[0])))
    st = sm.replayer.stats
    # the first level-2 cycle still replays (the plan is dropped when the engine sleeps), then every wake
    # re-allocates: a recording that was never used makes the next 1, then 3 pushes load without recording
    assert st.replayed == 2 and sm.replayer.plans == 0
    assert st.recorded == 3 and st.plain == 2


# --------------------------------------------------------------------------- fallbacks
class TransformingEngine(FusedEngine):
    """A loader that computes on the incoming tensor (a scale, a cat): not replayable."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def load_one(self, name, w):
        if name == "model.norm.weight" and self.how == "mul":
            self.params[name].data.copy_(w * 2)
        elif name == "model.norm.weight" and self.how == "cat":
            self.params[name].data.copy_(torch.cat([w[:4], w[4:]]))
        elif name == "model.norm.weight" and self.how == "skip":
            pass
        elif name == "model.norm.weight" and self.how == "read_dst":  # computes with a destination afterwards
            self.params[name].data.copy_(w)
            self.params[name].data.add_(self.params["model.layers.0.input_layernorm.weight"])
        elif name == "model.norm.weight" and self.how == "overlap":  # two sources into one place
            self.params["model.layers.0.input_layernorm.weight"].data.copy_(w)
        else:
            super().load_one(name, w)


@pytest.mark.parametrize("how,reason", [("mul", "reads an incoming"), ("cat", "reads an incoming"),
                                        ("skip", "never copied"), ("read_dst", "outside the recorded"),
                                        ("overlap", "overlapping destinations")])
def test_unreplayable_loaders_fall_back(how, reason):
    engine, twin = TransformingEngine(how), TransformingEngine(how)
    sm, version = make_manager(engine, hf_weights)
    n = len(hf_weights(0))
    for _ in range(3):
        cycle(sm, version)
        twin.load_weights(hf_weights(version[0]))
        assert_engine_equals(engine, dict(twin.named_weights()))
    st = sm.replayer.stats
    assert st.recorded == 1 and st.invalid == 1 and st.replayed == 0 and st.plain == 2
    assert reason in st.last_reason
    assert engine.loaded == 3 * n and sm.last_sync_replayed == 0


def test_reallocated_destination_records_again():
    engine = FusedEngine()
    sm, version = make_manager(engine, hf_weights)
    cycle(sm, version)
    cycle(sm, version)
    assert sm.replayer.stats.replayed == 1
    qkv = engine.params["model.layers.1.self_attn.qkv_proj.weight"]
    qkv.data = torch.full_like(qkv, -1.0)  # the engine swapped in new storage (e.g. on a wake-up)
    cycle(sm, version)
    assert_engine_equals(engine, fused_reference(hf_weights(version[0])))
    st = sm.replayer.stats
    assert st.recorded == 2 and st.dropped == 1
    cycle(sm, version)
    assert_engine_equals(engine, fused_reference(hf_weights(version[0])))
    assert sm.replayer.stats.replayed == 2


def test_release_stale_after_sleep_frees_moved_weights():
    engine = FusedEngine()
    sm, version = make_manager(engine, hf_weights)
    cycle(sm, version)

    def move_all(level=1):  # an engine whose sleep moves its weights (hf on CUDA: model.to("cpu"))
        for p in engine.params.values():
            p.data = p.data.clone()

    engine.sleep = move_all
    version[0] += 1
    with sm:
        assert sm.replayer.plans == 1
    assert sm.replayer.plans == 0  # dropped at sleep: the old storages are not kept alive


def test_signature_change_records_again_and_both_plans_replay():
    engine = FusedEngine()
    replayer = WeightReplayer(engine.load_weights)
    full, part = hf_weights(1), hf_weights(2)[:5]
    for step in range(3):
        replayer.begin_push()
        assert replayer.load(full, first=True) == ("recorded" if step == 0 else "replayed")
        assert replayer.load(part) == ("recorded" if step == 0 else "replayed")
    assert replayer.plans == 2 and replayer.stats.replayed == 4
    ref = fused_reference(full)
    got = dict(engine.named_weights())
    assert torch.equal(got["model.embed_tokens.weight"], torch.cat([dict(part)["model.embed_tokens.weight"],
                                                                    torch.zeros(2, FusedEngine.H)]))
    assert torch.equal(got["model.norm.weight"], ref["model.norm.weight"])


def test_sentinel_keeps_the_engine_guard(tiny_model_path):
    """A replayed push still calls the engine's load_weights once, so its 'sleeping engine' check still fires."""
    from hybrid_rl.models import load_causal_lm
    from hybrid_rl.rollout.hf import HFRolloutEngine

    engine = HFRolloutEngine(load_causal_lm(tiny_model_path, torch.float32), [0], 0, torch.device("cpu"))
    bucket = [(n, torch.zeros(p.shape)) for n, p in engine.model.named_parameters()]
    replayer = WeightReplayer(engine.load_weights)
    assert replayer.load(bucket, first=True) == "recorded"
    engine._weights_present = False  # as after sleep(2), before wake_up
    with pytest.raises(RuntimeError, match="sleeping engine"):
        replayer.load(bucket, first=True)


# --------------------------------------------------------------------------- 2 ranks, FSDP2 gathers
@pytest.mark.slow
def test_two_rank_pushes_replay_bit_for_bit(tiny_model_path, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "engine" / "multirank" / "checks.py"), str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MULTIRANK_CHECKS="replay")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert res["replay_full_mismatches"] == [[], [], []]
        assert res["replay_full_counts"] == [(26, 0), (26, 25), (26, 25)]
        assert res["replay_lora_mismatches"] == [[], [], []]
        # LoRA: a full push (recorded), the merged targets only (a new layout: recorded), then replayed
        assert res["replay_lora_counts"] == [(26, 0), (4, 0), (4, 3)]
        for tag in ("full", "lora"):
            assert res[f"replay_{tag}_stats"]["invalid"] == 0
