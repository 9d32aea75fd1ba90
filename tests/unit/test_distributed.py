"""``trainer.expandable_segments``: how the allocator setting reaches PyTorch and vLLM (which reads the variable)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybrid_rl import distributed
from hybrid_rl.distributed import ALLOC_CONF, use_expandable_segments


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", seen.append)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    return seen


def test_sets_the_variable_and_tells_an_initialised_allocator(monkeypatch, calls):
    monkeypatch.setenv(ALLOC_CONF, "max_split_size_mb:512")
    assert use_expandable_segments()
    assert distributed.os.environ[ALLOC_CONF] == "max_split_size_mb:512,expandable_segments:True"
    assert calls == ["expandable_segments:True"]


def test_an_explicit_user_setting_wins(monkeypatch, calls):
    monkeypatch.setenv(ALLOC_CONF, "expandable_segments:False")
    assert not use_expandable_segments()
    assert distributed.os.environ[ALLOC_CONF] == "expandable_segments:False" and calls == []


def test_off_by_default_and_never_on_cpu(monkeypatch, calls):
    monkeypatch.delenv(ALLOC_CONF, raising=False)
    from hybrid_rl.config import load_config

    assert load_config(str(Path(__file__).parents[2] / "recipes/gsm8k_grpo.yaml"), []).trainer.expandable_segments is False
    distributed.init_distributed("cpu", expandable_segments=True)
    assert ALLOC_CONF not in distributed.os.environ and calls == []
