"""Prompt datasets: rows → chat-templated token ids, and a collate into left-padded batches.

Every row is formatted by its task and tokenized once, up front, so prompt
length problems (``data.truncation``) surface at start-up rather than halfway
through a run, and the counts of filtered/truncated prompts can be logged.
Batches are LEFT-padded because generation appends to the right end of every
prompt at once. Left out: packing, multi-modal inputs, and lazy tokenization of
huge datasets (GSM8K-sized data tokenizes in seconds).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np
import torch

from ..batch import Batch
from .tasks import DataError, get_task

TRUNCATION_MODES = ("error", "filter", "left", "right")


class PromptDataset:
    """Tokenized prompts of one split; ``__getitem__`` gives ``input_ids``, ``ground_truth``, ``data_source``, ``index``,
    ``extra_info`` (the row's, as JSON text, for reward functions that take it) (with ``keep_messages``, for multi-turn rollouts, also ``messages`` and the task's ``env_info`` as JSON text).
    ``template_kwargs`` go to the chat template (an environment's ``tools=``).

    ``index`` is the row's position in ``rows`` (stable across filtering), so
    samples can be traced back to the data file. Truncation ``left`` keeps the
    end of the prompt (the generation prompt survives), ``right`` keeps the
    start (as in verl, the assistant header may be cut off).
    """

    def __init__(self, rows: list[dict[str, Any]], task: str, tokenizer: Any, max_prompt_length: int,
                 truncation: str = "error", system_prompt: Optional[str] = None, source: str = "the dataset",
                 template_kwargs: Optional[Mapping[str, Any]] = None, keep_messages: bool = False) -> None:
        """``source`` names the rows' key and file in messages (``data.train_path='train.jsonl'``); a message names
        a row by its number, counted from 1 in the order of the file. ``template_kwargs`` go to the chat template
        (an environment's tools); ``keep_messages`` keeps each conversation for a multi-turn environment."""
        if truncation not in TRUNCATION_MODES:
            raise DataError(f"data.truncation={truncation!r} is not one of {list(TRUNCATION_MODES)}")
        if max_prompt_length <= 0:
            raise DataError(f"data.max_prompt_length={max_prompt_length} must be a positive number of tokens")
        if not rows:
            raise DataError(f"{source}: no rows; point it at a non-empty dataset")
        spec = get_task(task)
        self.task = task
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.num_filtered = 0
        self.num_truncated = 0
        self.num_rows = len(rows)
        self._items: list[dict[str, Any]] = []
        for i, row in enumerate(rows):
            try:
                formatted = spec.format(row, i + 1)
            except DataError as e:
                raise DataError(f"{source}: {e}") from None
            messages = list(formatted["messages"])
            if system_prompt is not None:
                messages = [{"role": "system", "content": system_prompt}] + messages
            ids = _encode_chat(tokenizer, messages, template_kwargs or {})
            if len(ids) > max_prompt_length:
                if truncation == "error":
                    raise DataError(f"data.max_prompt_length={max_prompt_length}: the prompt of row {i + 1} of {source} has "
                                    f"{len(ids)} tokens after the chat template; raise data.max_prompt_length or set "
                                    f"data.truncation to filter/left/right")
                if truncation == "filter":
                    self.num_filtered += 1
                    continue
                ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
                self.num_truncated += 1
            item = {"input_ids": ids, "ground_truth": str(formatted["ground_truth"]),
                    "data_source": str(formatted["data_source"]), "index": i,
                    "extra_info": json.dumps(formatted.get("extra_info", {}), default=str)}
            if keep_messages:  # for environments: the conversation as text, and what the task keeps for them
                item["messages"] = json.dumps(messages)
                item["env_info"] = json.dumps(formatted.get("env_info", {}))
            self._items.append(item)
        if not self._items:
            raise DataError(f"data.max_prompt_length={max_prompt_length}: all {len(rows)} prompts of {source} are longer "
                            f"and were filtered; raise data.max_prompt_length or set data.truncation=left")

    @classmethod
    def concat(cls, parts: list["PromptDataset"]) -> "PromptDataset":
        """The prompts of ``parts`` in order, one dataset; ``index`` counts on from one part's rows to the next."""
        out = cls.__new__(cls)
        out.task, out.max_prompt_length, out.truncation = parts[0].task, parts[0].max_prompt_length, parts[0].truncation
        out.num_filtered = sum(p.num_filtered for p in parts)
        out.num_truncated = sum(p.num_truncated for p in parts)
        out._items, offset = [], 0
        for p in parts:
            out._items += [{**item, "index": item["index"] + offset} for item in p._items]
            offset += p.num_rows
        out.num_rows = offset
        return out

    @property
    def sources(self) -> list[str]:
        """The distinct ``data_source`` values of the rows, sorted (the same on every rank: all ranks hold all rows)."""
        return sorted({item["data_source"] for item in self._items})

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = self._items[i]
        # A copy, so a caller editing input_ids cannot corrupt the dataset.
        return {**item, "input_ids": list(item["input_ids"])}


def _encode_chat(tokenizer: Any, messages: list[dict[str, str]], template_kwargs: Mapping[str, Any]) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                        **template_kwargs)
    # transformers 5 may still hand back a BatchEncoding (a Mapping) from some
    # tokenizers or versions; accept either shape.
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):
        out = out[0]
    return [int(t) for t in out]


def collate_prompts(items: list[dict[str, Any]], pad_token_id: int) -> Batch:
    """Left-pad ``items`` to the longest prompt: ``input_ids``/``attention_mask`` [B, P] long + per-sample non-tensors."""
    if not items:
        raise ValueError("collate_prompts needs at least one item")
    width = max(len(it["input_ids"]) for it in items)
    input_ids = torch.full((len(items), width), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, it in enumerate(items):
        ids = it["input_ids"]
        if len(ids):
            input_ids[row, width - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1
    non_tensors = {
        "ground_truth": _object_array([it["ground_truth"] for it in items]),
        "data_source": _object_array([it["data_source"] for it in items]),
        "extra_info": _object_array([it.get("extra_info", "{}") for it in items]),
        "index": np.asarray([it["index"] for it in items], dtype=np.int64),
    }
    if "messages" in items[0]:  # multi-turn rollouts (PromptDataset(keep_messages=True)): JSON text per row
        non_tensors["messages"] = _object_array([it["messages"] for it in items])
        non_tensors["env_info"] = _object_array([it["env_info"] for it in items])
    return Batch({"input_ids": input_ids, "attention_mask": attention_mask}, non_tensors)


def _object_array(values: list[Any]) -> np.ndarray:
    # dtype=object keeps strings as Python str (no fixed-width '<U…' arrays
    # that would silently truncate when a longer string is assigned later).
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr
