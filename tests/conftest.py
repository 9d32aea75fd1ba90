"""Shared test set-up (fixtures only; helpers shared by several modules live in helpers.py, see README.md):
an isolated cache for the built-in tiny model, built once per session."""

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

