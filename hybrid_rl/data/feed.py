"""``PromptFeed``: this rank's training prompts, one batch per call, each prompt with its group id.

It reads ``data.train_path`` into a ``PromptDataset`` and draws this rank's share of every batch from a resumable
``PromptSampler`` (which the checkpoint saves). A prompt's ``uid`` (epoch and dataset index) is unique across ranks
and steps, so that grouping the n samples of a prompt can never mix two prompts. Left out: the validation prompts
(``hybrid_rl.validation``) and any ordering but the sampler's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybrid_rl.batch import Batch
from hybrid_rl.data.prompts import PromptDataset, collate_prompts
from hybrid_rl.data.sampler import PromptSampler
from hybrid_rl.data.sources import load_rows
from hybrid_rl.envs.multiturn import env_prompt


def keeps_messages(cfg: Any) -> bool:
    """Whether each prompt keeps its conversation (``messages``) beside its tokens: for an environment's multi-turn
    rollout, and for a reward model, which writes the conversation with its own chat template."""
    return cfg.env.name is not None or cfg.reward.model.path is not None


class PromptFeed:
    """The training set and this rank's sampler: ``rank`` of ``world`` shares of ``data.train_batch_size``."""

    def __init__(self, cfg: Any, tokenizer, rank: int, world: int):
        d = cfg.data
        options = getattr(d, d.task, None)  # a synthetic task's own section (data.arith)
        rows = load_rows(d.train_path, d.train_split, d.hub_config, d.task, d.num_synthetic, cfg.trainer.seed,
                         key="data.train_path", options=options)
        system, chat_kwargs = env_prompt(cfg)  # an environment's tools reach the prompt (env.describe_tools)
        self.dataset = PromptDataset(rows, d.task, tokenizer, d.max_prompt_length, d.truncation, system,
                                     source=f"data.train_path={d.train_path!r}", template_kwargs=chat_kwargs,
                                     keep_messages=keeps_messages(cfg))
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
