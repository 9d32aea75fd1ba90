"""``PromptFeed``: this rank's training prompts, one batch per call, each prompt with its group id.

It reads ``data.train_path`` (one path or a list: ``read_prompts``, which validation uses too) into a
``PromptDataset`` and draws this rank's share of every batch from a resumable ``PromptSampler`` (which the
checkpoint saves). A prompt's ``uid`` (epoch and dataset index) is unique across ranks and steps, so that grouping
the n samples of a prompt can never mix two prompts. Left out: any ordering but the sampler's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybrid_rl.batch import Batch
from hybrid_rl.data.prompts import PromptDataset, collate_prompts
from hybrid_rl.data.sampler import PromptSampler
from hybrid_rl.data.sources import load_rows
from hybrid_rl.envs.multiturn import env_prompt


def read_prompts(cfg: Any, tokenizer, key: str, split: str, num_synthetic: int, seed: int, held_out: bool = False,
                 cap: int = 0) -> PromptDataset:
    """The prompts of ``data.<key>`` (``train_path`` or ``val_path``): one path, or a list of files and hub
    datasets read in order, each entry's rows formatted on their own (messages name ``data.<key>[i]``) and, where a
    row has no ``data_source``, named after its entry (``source_name``), so validation reports each. ``cap``: the
    first rows of each entry (0 = all)."""
    d = cfg.data
    value = getattr(d, key)
    paths = value if isinstance(value, list) else [value]
    options = getattr(d, d.task, None)  # a synthetic task's own section (data.arith)
    system, chat_kwargs = env_prompt(cfg)  # an environment's tools reach the prompt (env.describe_tools)
    parts = []
    for i, path in enumerate(paths):
        name = f"data.{key}" if len(paths) == 1 else f"data.{key}[{i}]"
        rows = load_rows(path, split, d.hub_config, d.task, num_synthetic, seed, key=name, options=options,
                         held_out=held_out)
        if cap:
            rows = rows[:cap]
        if len(paths) > 1:
            rows = [{"data_source": source_name(path), **r} if isinstance(r, dict) else r for r in rows]
        parts.append(PromptDataset(rows, d.task, tokenizer, d.max_prompt_length, d.truncation, system,
                                   source=f"{name}={path!r}", template_kwargs=chat_kwargs,
                                   keep_messages=keeps_messages(cfg)))
    return parts[0] if len(parts) == 1 else PromptDataset.concat(parts)


def source_name(path: str) -> str:
    """A data file's or hub dataset's short name: ``test/math500.jsonl`` → ``math500``, ``HuggingFaceH4/MATH-500``
    → ``MATH-500``."""
    from pathlib import PurePath

    p = PurePath(path.rstrip("/"))
    return p.stem if p.suffix.lower() in (".jsonl", ".parquet", ".json") else p.name


def keeps_messages(cfg: Any) -> bool:
    """Whether each prompt keeps its conversation (``messages``) beside its tokens: for an environment's multi-turn
    rollout, and for a reward model, which writes the conversation with its own chat template."""
    return cfg.env.name is not None or cfg.reward.model.path is not None


class PromptFeed:
    """The training set and this rank's sampler: ``rank`` of ``world`` shares of ``data.train_batch_size``."""

    def __init__(self, cfg: Any, tokenizer, rank: int, world: int):
        d = cfg.data
        self.dataset = read_prompts(cfg, tokenizer, "train_path", d.train_split, d.num_synthetic, cfg.trainer.seed)
        self.sampler = PromptSampler(len(self.dataset), d.train_batch_size, rank, world, cfg.trainer.seed, d.shuffle)
        self.pad_token_id = tokenizer.pad_token_id

    def __call__(self) -> Batch:
        """The next batch of this rank's prompts, with their ``uid``s."""
        items = [self.dataset[i] for i in self.sampler.next_indices()]
        batch = collate_prompts(items, self.pad_token_id)
        uid = np.array([f"{self.sampler.epoch}-{it['index']}" for it in items], dtype=object)
        return batch.union(non_tensors=dict(uid=uid))

    def stats(self) -> dict[str, int]:
        """The training set's size and what reading it dropped or cut (``data.truncation``)."""
        ds = self.dataset
        return {"data/train_prompts": len(ds), "data/filtered_prompts": ds.num_filtered,
                "data/truncated_prompts": ds.num_truncated}
