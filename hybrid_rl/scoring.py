"""The driver's reward phase: decode responses, score them, place each score on the last response token.

Reward functions see text (response, ground truth) and return a float; this
module turns a rollout batch into ``token_level_scores`` [B, R] (sparse: the
score sits on the last real response token, as in verl) and counts failures
when ``reward.on_error=zero``. Left out: a process pool for slow reward
functions (GSM8K scoring is microseconds per sample).
"""

from __future__ import annotations

from typing import Callable

import torch

from hybrid_rl.phases.advantage import sparse_scores
from hybrid_rl.batch import Batch
from hybrid_rl.rewards import score_responses


def decode_responses(batch: Batch, tokenizer) -> list[str]:
    responses = batch.tensors["responses"].cpu()
    mask = batch.tensors["response_mask"].cpu().bool()
    return tokenizer.batch_decode([r[m].tolist() for r, m in zip(responses, mask)], skip_special_tokens=True)


def compute_scores(batch: Batch, tokenizer, fn: Callable[[str, str], float], on_error: str) -> tuple[Batch, dict[str, tuple[float, float]]]:
    texts = decode_responses(batch, tokenizer)
    scores, num_errors = score_responses(fn, texts, list(batch.non_tensors["ground_truth"]), on_error)
    score_t = torch.tensor(scores, dtype=torch.float32)
    token_scores = sparse_scores(score_t, batch.tensors["response_mask"])
    stats = {"reward/errors": (float(num_errors), 1.0)}
    return batch.union(tensors=dict(token_level_scores=token_scores, scores=score_t.to(token_scores.device))), stats
