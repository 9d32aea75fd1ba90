"""A reward model (``reward.model.path``): a sequence classifier that scores each response in its conversation.

The conversation is the prompt's messages (the dataset's, before the policy's chat template) with the response as
the assistant's turn, written with the reward model's own chat template and tokenizer: a reward model and the policy
rarely share a tokenizer, so the response goes over as text (TRL's and OpenRLHF's way; verl's with a different
tokenizer). Of a multi-turn trajectory the response is its last model turn, the text the reward function reads too. The score is the classifier's one output (``AutoModelForSequenceClassification``, ``num_labels=1``), read
where transformers reads it: at the last token that is not padding. Conversations are scored in micro-batches of
``reward.model.micro_batch_size``, sorted by length and padded on the right; a conversation longer than
``reward.model.max_length`` keeps its last tokens (the response's end).

On a GPU the weights (bf16 by default) stay in page-locked host memory between reward phases
(``reward.model.offload``, ``workers/offload.HostMirror``) and are copied in only while they score, so the engine and
the training passes never share the GPU with them. Every rank that scores holds its own copy (no sharding): a reward
model is as large as a GPU holds whole. Left out: generative reward models (an LLM judge answering in text; a
``reward.function`` can call one) and reward models of more than one output.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch

from hybrid_rl.config import RewardModelConfig
from hybrid_rl.models import TINY_RM, ModelLoadError, check_local_path, check_model_dir, resolve_dtype, resolve_model_path
from hybrid_rl.rollout.base import pad_rows
from hybrid_rl.workers.offload import HostMirror

KEY = "reward.model.path"


def _from_pretrained(load, path: str, key: str, want: str):
    """``load(local path)`` of ``path`` (a built-in is built first) after the checks that name ``key``; ``want`` is
    ``"model"`` or ``"tokenizer"``."""
    path = resolve_model_path(path)
    check_local_path(path, key)
    check_model_dir(path, key, want, TINY_RM)
    try:
        return load(path)
    except OSError as e:
        raise ModelLoadError(f"{key}: cannot load a {want} from {path!r} ({str(e).splitlines()[0]})") from e


def load_reward_model(cfg: RewardModelConfig, dtype: torch.dtype):
    """(model in eval mode on the CPU, tokenizer) for ``cfg``; ``ModelLoadError`` naming the key otherwise."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    remote = cfg.trust_remote_code
    config = _from_pretrained(lambda p: AutoConfig.from_pretrained(p, trust_remote_code=remote), cfg.path, KEY, "model")
    kinds = [a for a in getattr(config, "architectures", None) or [] if not a.endswith("ForSequenceClassification")]
    if kinds:
        raise ModelLoadError(f"{KEY}={cfg.path!r} is a {kinds[0]}, not a reward model; point it at a "
                             f"sequence-classification checkpoint of one output (e.g. a *ForSequenceClassification "
                             f"reward model, or builtin:{TINY_RM} to try it)")
    if getattr(config, "num_labels", None) != 1:
        raise ModelLoadError(f"{KEY}={cfg.path!r} has {getattr(config, 'num_labels', None)} outputs "
                             f"(config.num_labels); a reward model gives one score: use a sequence-classification "
                             f"checkpoint with num_labels=1")
    try:
        model = AutoModelForSequenceClassification.from_pretrained(resolve_model_path(cfg.path), dtype=dtype,
                                                                   trust_remote_code=remote)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{KEY}={cfg.path!r}: cannot load it as a sequence classifier "
                             f"({str(e).splitlines()[0]}); use an AutoModelForSequenceClassification checkpoint") from e
    tok_key = "reward.model.tokenizer_path" if cfg.tokenizer_path else KEY
    tokenizer = _from_pretrained(lambda p: AutoTokenizer.from_pretrained(p, trust_remote_code=remote),
                                 cfg.tokenizer_path or cfg.path, tok_key, "tokenizer")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:  # where transformers finds each row's last token
        model.config.pad_token_id = tokenizer.pad_token_id
    return model.eval().requires_grad_(False), tokenizer


def conversation_text(tokenizer, messages: list[dict[str, str]], response: str) -> str:
    """The text the reward model reads: its chat template over the messages and the response as the assistant's
    turn, or without a template the messages' contents and the response, one per line."""
    turns = [*messages, {"role": "assistant", "content": response}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, tokenize=False)
    return "\n".join(m["content"] for m in turns)


class RewardModel:
    """Scores (conversation, response) pairs with a sequence classifier on ``device`` (see the module docstring)."""

    def __init__(self, cfg: RewardModelConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.dtype = resolve_dtype(cfg.dtype, device)
        self.model, self.tokenizer = load_reward_model(cfg, self.dtype)
        self.model.to(device)
        self.mirror = HostMirror(device) if cfg.offload and device.type == "cuda" else None
        self._park()
        if self.mirror is not None:  # built before the engine: what it held goes back to the driver, not to torch's cache
            torch.cuda.empty_cache()

    def _park(self) -> None:
        if self.mirror is not None:
            self.mirror.offload(list(self.model.parameters()), unchanged=True)  # frozen: no copy back after the first

    def encode(self, messages: Sequence[list[dict[str, str]]], responses: Sequence[str]) -> tuple[list[list[int]], int]:
        """Each conversation's token ids (cut to the last ``max_length``), and how many were cut."""
        out, cut = [], 0
        for msgs, response in zip(messages, responses):
            text = conversation_text(self.tokenizer, msgs, response)
            ids = self.tokenizer(text, add_special_tokens=not getattr(self.tokenizer, "chat_template", None))["input_ids"]
            if len(ids) > self.cfg.max_length:
                ids, cut = ids[-self.cfg.max_length:], cut + 1
            out.append(ids)
        return out, cut

    @torch.no_grad()
    def score(self, messages: Sequence[list[dict[str, str]]], responses: Sequence[str]) -> tuple[torch.Tensor, int]:
        """Scores [n] (float32, CPU) of the responses, each after its conversation's messages; and how many
        conversations were cut to ``max_length``."""
        ids, cut = self.encode(messages, responses)
        scores = torch.zeros(len(ids), dtype=torch.float32)
        if not ids:
            return scores, cut
        if self.mirror is not None:
            self.mirror.onload()
        try:
            pad = self.model.config.pad_token_id
            order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
            mb = self.cfg.micro_batch_size
            for s in range(0, len(order), mb):
                rows = order[s:s + mb]
                x, _ = pad_rows([ids[i] for i in rows], None, pad)  # [b, W], right-padded
                lengths = torch.tensor([len(ids[i]) for i in rows])
                mask = (torch.arange(x.shape[1])[None, :] < lengths[:, None]).long()
                logits = self.model(input_ids=x.to(self.device), attention_mask=mask.to(self.device)).logits
                scores[rows] = logits[:, 0].float().cpu()
        finally:
            self._park()
        return scores, cut


def batch_messages(non_tensors: dict[str, Any], prompts: Sequence[str]) -> list[list[dict[str, str]]]:
    """Each row's conversation before the response: the dataset's messages (``messages``, JSON text) where the batch
    kept them, else the decoded prompt as one user message."""
    if "messages" in non_tensors:
        return [json.loads(m) if isinstance(m, str) else list(m) for m in non_tensors["messages"]]
    return [[{"role": "user", "content": p}] for p in prompts]
