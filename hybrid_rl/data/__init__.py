"""Data: raw rows (``sources``), tasks that turn rows into prompts (``tasks``),
tokenized prompt datasets and their collate (``prompts``), and the resumable
per-rank sampler (``sampler``). Reward functions live in ``hybrid_rl.rewards``.
"""

from .prompts import PromptDataset, collate_prompts
from .sampler import PromptSampler
from .sources import load_rows
from .tasks import TASKS, DataError, Task, get_task

__all__ = ["DataError", "TASKS", "Task", "get_task", "load_rows", "PromptDataset", "collate_prompts", "PromptSampler"]
