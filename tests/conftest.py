"""Shared test set-up: an isolated cache for the built-in tiny model, built once per session."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# Before any test imports hybrid_rl.models: every test (and every subprocess
# they launch) shares one tiny-model directory instead of ~/.cache.
os.environ.setdefault("HYBRID_RL_CACHE", os.path.join(tempfile.gettempdir(), f"hybrid_rl_test_cache_{os.getuid()}"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from hybrid_rl.models import resolve_model_path

    return resolve_model_path("builtin:tiny-qwen2")


def make_cfg(*overrides: str):
    """A small CPU config for in-process tests."""
    from hybrid_rl.config import load_config

    base = ["trainer.device=cpu", "model.dtype=float32", "data.max_response_length=6", "rollout.n=4",
            "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_device=16",
            "actor.lr=1e-3", "trainer.logger=[jsonl]"]
    return load_config(None, base + list(overrides)).validate()


def cpu_dist():
    from hybrid_rl.distributed import DistInfo

    return DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
