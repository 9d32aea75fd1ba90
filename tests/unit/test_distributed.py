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


@pytest.mark.parametrize("code,rank,left", [(0, "1", "_exit 0"), (1, "1", "exit 1"), (0, None, "exit 0")])
def test_a_finished_rank_skips_interpreter_finalization(monkeypatch, code, rank, left):
    """A torchrun rank that finished leaves through os._exit (a gloo rank aborted once in finalization after a
    finished run); a failed rank, and a process outside torchrun, exit normally with their code."""
    import hybrid_rl.__main__ as entry

    class Left(Exception):
        pass

    def fake(kind):
        def leave(c):
            raise Left(f"{kind} {c}")
        return leave

    monkeypatch.setattr(entry.os, "_exit", fake("_exit"))
    monkeypatch.setattr(entry.logging, "shutdown", lambda: None)  # pytest's own handlers stay open
    monkeypatch.setattr(entry.sys, "exit", fake("exit"))
    if rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", rank)
    with pytest.raises(Left, match=f"^{left}$"):
        entry._leave(code)
