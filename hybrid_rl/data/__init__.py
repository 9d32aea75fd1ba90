"""Data: raw rows (``sources``), tasks that turn rows into prompts (``tasks``),
tokenized prompt datasets and their collate (``prompts``), the resumable
per-rank sampler (``sampler``), and the trainer's feed of prompt batches
(``feed``). Reward functions live in ``hybrid_rl.rewards``.

The names below are imported on first use, so that the config loader's import of ``hybrid_rl.data.arith``
imports no torch.
"""

import importlib
from typing import Any

_EXPORTS = {"PromptDataset": "prompts", "collate_prompts": "prompts", "PromptSampler": "sampler",
            "PromptFeed": "feed", "load_rows": "sources", "TASKS": "tasks", "DataError": "tasks", "Task": "tasks", "get_task": "tasks"}

__all__ = ["DataError", "TASKS", "Task", "get_task", "load_rows", "PromptDataset", "collate_prompts", "PromptSampler",
           "PromptFeed"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
