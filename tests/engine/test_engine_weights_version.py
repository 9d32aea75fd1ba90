"""The rollout engine owns its weight version and its sampling RNG state (``hybrid_rl.rollout.base``).

A push brackets its loads with ``begin_weight_update`` (no known version from
then on, so a push that fails half-way leaves none) and ``finish_weight_update``
(the engine sets the version once the last tensor is in); nobody outside the
engine writes ``weights_version``. ``sync_weights`` pushes without waking the KV
cache. The HF engine's sampling RNG round-trips through ``rng_state``.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.rollout.base import RolloutEngine, SamplingParams
from hybrid_rl.weights.sharding_manager import ShardingManager


class RecordingEngine(RolloutEngine):
    """Keeps what it is given and the order of calls (with the version it held at each)."""

    def __init__(self):
        self.weights: dict[str, torch.Tensor] = {}
        self.calls: list[tuple[str, object]] = []

    def load_weights(self, weights):
        for name, t in weights:
            self.calls.append(("load", self.weights_version))
            self.weights[name] = t.clone()

    def begin_weight_update(self):
        self.calls.append(("begin", self.weights_version))
        super().begin_weight_update()

    def finish_weight_update(self, version):
        self.calls.append(("finish", version))
        super().finish_weight_update(version)

    def generate(self, prompts, params):
        raise NotImplementedError

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        if level >= 2:
            self._weights_version = None

    def wake_up(self, tags=None) -> None:
        self.calls.append(("wake_up", tuple(tags) if tags else None))


class Source:
    """A WeightSource yielding two tensors of value ``version``; ``fail_after`` raises after that many."""

    def __init__(self, version: list[int], fail_after: int | None = None):
        self.version, self.fail_after = version, fail_after

    def iter_full_params(self, dtype=None, skip_static=False):
        for i, name in enumerate(["a", "b"]):
            if self.fail_after is not None and i >= self.fail_after:
                raise RuntimeError("gather failed")
            yield name, torch.full((2,), float(self.version[0]))

    def offload(self, params=True, optimizer=True):
        pass

    def onload(self, params=True, optimizer=True):
        pass


def manager(engine, source, **kw) -> ShardingManager:
    kw.setdefault("free_cache_engine", False)
    return ShardingManager(source, engine, lambda: source.version[0], dtype=torch.float32, bucket_mb=1, **kw)


def test_version_is_set_by_the_engine_at_the_end_of_a_push():
    eng, version = RecordingEngine(), [3]
    sm = manager(eng, Source(version))
    assert eng.weights_version is None  # nothing pushed yet
    with sm:
        pass
    assert eng.weights_version == 3
    pushes = [c for c in eng.calls if c[0] in ("begin", "load", "finish")]
    # cleared before the first load, still unknown while loading, set by the engine once every tensor is in
    assert pushes == [("begin", None), ("load", None), ("load", None), ("finish", 3)]
    with sm:  # unchanged version: no push, the engine keeps it
        pass
    assert eng.weights_version == 3 and sm.num_pushes == 1


def test_weights_version_is_read_only():
    eng = RecordingEngine()
    with pytest.raises(AttributeError):
        eng.weights_version = 1  # only the engine sets it (finish_weight_update)


def test_begin_and_a_failed_push_leave_no_known_version():
    eng, version = RecordingEngine(), [0]
    source = Source(version)
    sm = manager(eng, source)
    sm.push()
    assert eng.weights_version == 0
    eng.begin_weight_update()
    assert eng.weights_version is None
    sm.push()
    assert eng.weights_version == 0
    version[0], source.fail_after = 1, 1  # θ_1's gather breaks after one tensor
    with pytest.raises(RuntimeError, match="gather failed"):
        sm.push()
    assert eng.weights_version is None  # the engine may hold part of θ_1 over θ_0: neither version
    assert eng.calls[-1] == ("begin", 0)  # cleared up front, never finished
    source.fail_after = None
    sm.push()
    assert eng.weights_version == 1 and eng.weights["b"][0] == 1


def test_invalidate_clears_the_version():
    eng, version = RecordingEngine(), [2]
    sm = manager(eng, Source(version))
    sm.push()
    sm.invalidate()
    assert eng.weights_version is None
    sm.push()
    assert eng.weights_version == 2 and sm.num_pushes == 2


def test_sync_weights_pushes_without_waking_the_kv_cache():
    eng, version = RecordingEngine(), [5]
    sm = manager(eng, Source(version))
    sm.sync_weights()
    assert eng.weights_version == 5 and sm.num_pushes == 1
    assert [c for c in eng.calls if c[0] in ("wake_up", "sleep")] == [("wake_up", ("weights",))]
    sm.sync_weights()  # unchanged version: nothing pushed
    assert sm.num_pushes == 1
    # an engine that sleeps between rollouts goes back to sleep after the push
    sleepy, v2 = RecordingEngine(), [1]
    sm2 = manager(sleepy, Source(v2), free_cache_engine=True, sleep_level=1)
    sm2.sync_weights()
    assert sleepy.weights_version == 1 and ("sleep", 1) in sleepy.calls
    assert ("wake_up", ("kv_cache",)) not in sleepy.calls


def test_engine_defaults_rng_not_capturable_and_shutdown():
    eng = RecordingEngine()
    assert eng.rng_state() is None
    with pytest.raises(NotImplementedError):
        eng.set_rng_state({"kind": "torch", "state": torch.get_rng_state()})
    assert dict(eng.last_generate_stats) == {}
    eng.shutdown()  # nothing to release


def test_hf_engine_rng_state_round_trip(tiny_model_path):
    from hybrid_rl.batch import Batch
    from hybrid_rl.models import load_causal_lm
    from hybrid_rl.rollout.hf import HFRolloutEngine

    eng = HFRolloutEngine(load_causal_lm(tiny_model_path, torch.float32), eos_token_ids=[0], pad_token_id=0,
                          device=torch.device("cpu"), seed=11)
    prompts = Batch(tensors=dict(input_ids=torch.tensor([[5, 6, 7]]), attention_mask=torch.ones(1, 3, dtype=torch.long)))
    params = SamplingParams(n=4, temperature=1.0, max_tokens=4, response_lengths=(4, 4, 4, 4))
    state = eng.rng_state()
    assert state["kind"] == "torch"  # the entry checkpoint.capture_rng writes for a torch.Generator
    first = eng.generate(prompts, params).tensors["responses"]
    eng.set_rng_state(state)
    again = eng.generate(prompts, params).tensors["responses"]
    assert torch.equal(first, again)
