"""Split placement's set-up order with vLLM (``placement.meet_at_engines``): every rank meets at a barrier, then the
trainer ranks build vLLM's twin before any model, so that no rank waits in vLLM's group creation for one still
loading a model. (The 2 + 2 hangs in set-up had another cause: ``tests/unit/test_split_groups.py``.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybrid_rl.modes import placement


class FakeEngine:
    def __init__(self, events):
        self.events = events

    def sleep(self, level=1):
        self.events.append(("sleep", level))


@pytest.fixture
def events(monkeypatch):
    log: list = []
    import torch.distributed as tdist

    from hybrid_rl.rollout import vllm as vllm_rollout

    monkeypatch.setattr(tdist, "barrier", lambda group=None: log.append(("barrier", group)))
    monkeypatch.setattr(vllm_rollout.VLLMRolloutEngine, "from_config",
                        classmethod(lambda cls, cfg, dist, tok: log.append(("twin", dist.rank)) or FakeEngine(log)))
    return log


def _placement(is_rollout: bool | None):
    layout = None if is_rollout is None else SimpleNamespace(is_rollout=is_rollout, obj_group="world-gloo")
    return SimpleNamespace(layout=layout)


def _cfg(name: str):
    return SimpleNamespace(rollout=SimpleNamespace(name=name))


def test_trainer_rank_builds_the_twin_after_the_barrier_and_releases_it(events):
    twin = placement.meet_at_engines(_cfg("vllm"), _placement(False), SimpleNamespace(rank=3), tokenizer=None)
    assert isinstance(twin, FakeEngine)  # kept by the trainer for the run
    assert events == [("barrier", "world-gloo"), ("twin", 3), ("sleep", 2)]


def test_rollout_rank_only_meets(events):
    assert placement.meet_at_engines(_cfg("vllm"), _placement(True), SimpleNamespace(rank=0), None) is None
    assert events == [("barrier", "world-gloo")]  # its engine is the worker's first GPU work


def test_hf_split_meets_without_a_twin_and_colocated_does_nothing(events):
    assert placement.meet_at_engines(_cfg("hf"), _placement(False), SimpleNamespace(rank=1), None) is None
    assert events == [("barrier", "world-gloo")]
    events.clear()
    assert placement.meet_at_engines(_cfg("vllm"), _placement(None), SimpleNamespace(rank=0), None) is None
    assert events == []


def test_trainer_meets_before_it_builds_the_worker(monkeypatch, tmp_path):
    """The driver calls the meeting before the worker (and its models) exist."""
    from hybrid_rl import trainer as trainer_mod

    from helpers import cpu_dist, make_cfg

    order: list[str] = []
    real_meet, real_worker = trainer_mod.meet_at_engines, trainer_mod.ActorRolloutRefWorker
    monkeypatch.setattr(trainer_mod, "meet_at_engines", lambda *a: order.append("meet") or real_meet(*a))
    monkeypatch.setattr(trainer_mod, "ActorRolloutRefWorker", lambda *a, **k: order.append("worker") or real_worker(*a, **k))
    cfg = make_cfg("model.path=builtin:tiny-qwen2", "data.train_path=synthetic:successor", "data.task=successor",
                   "data.max_prompt_length=32", "trainer.total_steps=1", f"trainer.output_dir={tmp_path}")
    t = trainer_mod.Trainer(cfg, cpu_dist())
    t.close()
    assert order == ["meet", "worker"]


def test_stop_check_runs_on_the_cpu_group_under_split_and_on_the_device_colocated():
    """The per-step stop check (an all-reduce over every rank) under split placement is gloo on the CPU: a rollout
    rank waits in it for the trainer ranks' update while its next round generates, and on NCCL that wait held its
    CUDA stream (tests/gpu/test_stop_check_gpu.py shows the engine's kind of work running beside it)."""
    import torch

    gpu = torch.device("cuda", 1)
    split = placement.Placement(SimpleNamespace(obj_group="world-gloo"), "rollout", 0, 1, None, None, False)
    assert split.stop_check(gpu) == (torch.device("cpu"), "world-gloo")
    colocated = placement.Placement(None, "actor_rollout_ref", 0, 1, None, None, True)
    assert colocated.stop_check(gpu) == (gpu, None)
