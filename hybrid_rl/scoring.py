"""The driver's reward phase: decode responses, score them, place each score on the last response token.

Reward functions see text (response, ground truth) and return a float; this
module turns a rollout batch into ``token_level_scores`` [B, R] (sparse: the
score sits on the last real response token, as in verl), counts failures
when ``reward.on_error=zero`` and shapes the training reward of overlong responses
(``reward.overlong_buffer_len``). The scoring itself (in this process, or in worker
processes with ``reward.timeout_s`` for user functions) is ``RewardScorer``'s.
"""

from __future__ import annotations

from typing import Callable

import torch

from hybrid_rl.phases.advantage import sparse_scores
from hybrid_rl.batch import Batch
from hybrid_rl.data.tasks import Task
from hybrid_rl.rewards import RewardScorer, score_responses
from hybrid_rl.rewards.overlong import overlong_penalty


def decode_responses(batch: Batch, tokenizer) -> list[str]:
    responses = batch.tensors["responses"].cpu()
    mask = batch.tensors["response_mask"].cpu().bool()
    return tokenizer.batch_decode([r[m].tolist() for r, m in zip(responses, mask)], skip_special_tokens=True)


def sample_records(batch: Batch, tokenizer) -> list[dict]:
    """One JSON-ready record per scored sample: its dataset index, prompt and response text, the response's length in
    tokens (at ``data.max_response_length``: cut, not finished), ground truth and score."""
    texts = decode_responses(batch, tokenizer)
    ids, mask = batch.tensors["input_ids"].cpu(), batch.tensors["attention_mask"].cpu().bool()
    width = batch.tensors["responses"].shape[1]
    prompts = tokenizer.batch_decode([r[:-width][m[:-width]].tolist() for r, m in zip(ids, mask)],
                                     skip_special_tokens=True)
    nt = batch.non_tensors
    lengths = batch.tensors["response_mask"].sum(-1).tolist()
    return [{"index": int(i), "prompt": p, "response": t, "response_length": int(n), "ground_truth": str(g),
             "score": float(s)}
            for i, p, t, n, g, s in zip(nt["index"], prompts, texts, lengths, nt["ground_truth"],
                                        batch.tensors["scores"].tolist())]


def compute_scores(batch: Batch, tokenizer, fn: RewardScorer | Callable[[str, str], float],
                   on_error: str, task: Task | None = None,
                   prefix: str = "reward") -> tuple[Batch, dict[str, tuple[float, float]]]:
    """``fn``: the run's ``RewardScorer``, or a bare reward function (scored in this process). The stats are
    ``(sum, count)`` pairs: the failed samples, and the ``task``'s answer shape counts as ``<prefix>/<name>``."""
    texts = decode_responses(batch, tokenizer)
    truths = list(batch.non_tensors["ground_truth"])
    if isinstance(fn, RewardScorer):
        scores, num_errors = fn.score(texts, truths, on_error)
    else:
        scores, num_errors = score_responses(fn, texts, truths, on_error)
    score_t = torch.tensor(scores, dtype=torch.float32)
    token_scores = sparse_scores(score_t, batch.tensors["response_mask"])
    stats = {f"{prefix}/errors": (float(num_errors), 1.0)}
    if task is not None:
        stats.update({f"{prefix}/{k}": (v, float(len(texts))) for k, v in task.answer_stats(texts).items()})
    return batch.union(tensors=dict(token_level_scores=token_scores, scores=score_t.to(token_scores.device))), stats


def shape_overlong(batch: Batch, max_response_length: int, buffer_len: int,
                   penalty_factor: float) -> tuple[Batch, dict[str, tuple[float, float]]]:
    """Add DAPO's overlong penalty to ``token_level_scores`` (on the last response token, with the score); ``scores``
    keeps the reward function's own, so ``reward/mean`` stays comparable across runs. Stat: the mean penalty."""
    mask = batch.tensors["response_mask"]
    penalty = overlong_penalty(mask.sum(-1), max_response_length, buffer_len, penalty_factor)
    shaped = batch.tensors["token_level_scores"] + sparse_scores(penalty, mask)
    return batch.union(tensors=dict(token_level_scores=shaped)), {"reward/overlong_penalty": (float(penalty.sum()),
                                                                                              float(len(batch)))}
