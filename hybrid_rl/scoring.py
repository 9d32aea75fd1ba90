"""The driver's reward phase: decode responses, score them, place each score on the last response token.

Reward functions see text (response, ground truth) and return a float; this
module turns a rollout batch into ``token_level_scores`` [B, R] (sparse: the
score sits on the last real response token, as in verl; of a multi-turn
trajectory the reward function reads the last model turn, the score sits on
its last sampled token and the environment's own rewards are added), counts failures
when ``reward.on_error=zero`` and shapes the training reward of overlong responses
(``reward.overlong_buffer_len``). The scoring itself (in this process, or in worker
processes with ``reward.timeout_s`` for user functions) is ``RewardScorer``'s.
``fill_informative`` is DAPO's dynamic sampling on scored batches (``algorithm.filter_groups``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from hybrid_rl.algorithms.core import response_extent
from hybrid_rl.phases.advantage import sparse_scores
from hybrid_rl.batch import Batch
from hybrid_rl.distributed import all_reduce_max, all_reduce_sum
from hybrid_rl.micro_batching import pad_widths
from hybrid_rl.data.tasks import Task
from hybrid_rl.rewards import RewardScorer, score_responses
from hybrid_rl.rewards.overlong import overlong_penalty


def decode_responses(batch: Batch, tokenizer) -> list[str]:
    """The text each reward function scores: the response, or of a multi-turn trajectory its last model turn (the
    answer after the last tool result; ``turn_ids``)."""
    responses = batch.tensors["responses"].cpu()
    mask = answer_mask(batch).cpu()
    return tokenizer.batch_decode([r[m].tolist() for r, m in zip(responses, mask)], skip_special_tokens=True)


def answer_mask(batch: Batch) -> torch.Tensor:
    """[B, R] bool: the tokens of each response the reward reads (``decode_responses``)."""
    t = batch.tensors
    if "turn_ids" not in t:
        return t["response_mask"].bool()
    turns = t["turn_ids"]
    return (turns == turns.amax(dim=1, keepdim=True)) & (turns > 0)


def trajectory_texts(batch: Batch, tokenizer) -> list[str]:
    """Each response whole, observations and special tokens included (a multi-turn trajectory as the model saw it)."""
    t = batch.tensors
    width = t["responses"].shape[1]
    inside = t["attention_mask"][:, -width:].cpu().bool()
    return tokenizer.batch_decode([r[m].tolist() for r, m in zip(t["responses"].cpu(), inside)],
                                  skip_special_tokens=False)


def sample_records(batch: Batch, tokenizer) -> list[dict]:
    """One JSON-ready record per scored sample: its dataset index, prompt and response text, the response's length in
    tokens (at ``data.max_response_length``: cut, not finished), ground truth and score (multi-turn: the
    response is the last turn, ``trajectory`` the whole conversation after the prompt)."""
    texts = decode_responses(batch, tokenizer)
    ids, mask = batch.tensors["input_ids"].cpu(), batch.tensors["attention_mask"].cpu().bool()
    width = batch.tensors["responses"].shape[1]
    prompts = tokenizer.batch_decode([r[:-width][m[:-width]].tolist() for r, m in zip(ids, mask)],
                                     skip_special_tokens=True)
    nt = batch.non_tensors
    lengths = response_extent(batch.tensors["response_mask"]).tolist()
    records = [{"index": int(i), "prompt": p, "response": t, "response_length": int(n), "ground_truth": str(g),
                "score": float(s)}
               for i, p, t, n, g, s in zip(nt["index"], prompts, texts, lengths, nt["ground_truth"],
                                           batch.tensors["scores"].tolist())]
    if "turn_ids" in batch.tensors:  # multi-turn: the response is the last turn; the whole conversation beside it
        for record, whole in zip(records, trajectory_texts(batch, tokenizer)):
            record["trajectory"] = whole
    return records


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
    if "env_reward" in batch.tensors:  # a multi-turn environment's own rewards add to the reward function's
        score_t = score_t + batch.tensors["env_reward"].float().cpu()
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
    penalty = overlong_penalty(response_extent(mask), max_response_length, buffer_len, penalty_factor)
    shaped = batch.tensors["token_level_scores"] + sparse_scores(penalty, mask)
    return batch.union(tensors=dict(token_level_scores=shaped)), {"reward/overlong_penalty": (float(penalty.sum()),
                                                                                              float(len(batch)))}


# --------------------------------------------------------------------------- dynamic sampling (DAPO)
def informative_groups(batch: Batch, metric: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The rows of each group (samples sharing a ``uid``), split into (groups whose values differ, groups whose values
    are all equal), each in order of first appearance. ``metric``: ``seq_reward`` (the sum of
    ``token_level_scores``, the reward the advantage sees) or ``score`` (the reward function's value)."""
    t = batch.tensors
    values = t["token_level_scores"].sum(-1) if metric == "seq_reward" else t["scores"]
    values = values.detach().double().cpu().numpy()
    uids = np.asarray(batch.non_tensors["uid"])
    _, first, inverse = np.unique(uids, return_index=True, return_inverse=True)
    informative, equal = [], []
    for g in np.argsort(first):  # groups in batch order
        rows = np.flatnonzero(inverse == g)
        (informative if values[rows].max() > values[rows].min() else equal).append(rows)
    return informative, equal


def fill_informative(batch: Batch, more: Callable[[], Batch], target: int, max_rounds: int, metric: str,
                     pad_token_id: int, device: torch.device, group=None) -> tuple[Batch, dict[str, float]]:
    """Keep ``target`` informative groups of ``batch`` (scored), calling ``more()`` (a new scored batch of fresh
    prompts) while this rank is short, at most ``max_rounds`` times.

    A collective: every rank of ``group`` calls ``more()`` equally often (the rounds go on while any rank is short,
    all-reduce max), so the generate calls and the prompt samplers stay in step; a rank already full discards what it
    generates. Groups never straddle ranks, so each rank fills its own share. Past ``max_rounds`` the remaining slots
    keep all-equal groups (zero advantage under a group estimator): the batch always holds ``target`` groups, and the
    mini-batches and collectives of the update are those of any step. A refill round's ``uid``s get ``/r<round>``
    appended, so that a prompt drawn again (a new epoch) is never merged with an earlier group. The returned batch
    has the first batch's ``meta``, its parts padded to their widest prompt and response (``pad_token_id``).

    Stats (every rank the same): ``rollout/filtered_groups`` (all-equal groups seen, summed over ranks),
    ``rollout/filter_rounds`` (calls of ``more``), ``rollout/filter_short_groups`` (slots left to all-equal groups,
    summed over ranks).
    """
    meta = dict(batch.meta)
    kept: list[Batch] = []
    fillers: list[Batch] = []  # all-equal groups, one batch each, as many as could still be needed
    have = dropped = rounds = 0
    while True:
        informative, equal = informative_groups(batch, metric)
        take = informative[:target - have]
        if take:
            kept.append(batch.index(np.concatenate(take)))
            have += len(take)
        dropped += len(equal)
        fillers += [batch.index(rows) for rows in equal[:max(target - have - len(fillers), 0)]]
        short = torch.tensor([float(have < target)], device=device)
        if not all_reduce_max(short, group).item() or rounds == max_rounds:
            break
        rounds += 1
        batch = more()
        tag = f"/r{rounds}"
        batch = batch.union(non_tensors=dict(uid=np.array([f"{u}{tag}" for u in batch.non_tensors["uid"]],
                                                          dtype=object)))
    missing = target - have
    parts = kept + fillers[:missing]  # the first all-equal groups fill the slots still open
    widths = (max(p.tensors["prompts"].shape[1] for p in parts), max(p.tensors["responses"].shape[1] for p in parts))
    out = Batch.concat([pad_widths(p, *widths, pad_token_id) for p in parts])
    out.meta = meta
    counts = torch.tensor([float(dropped), float(missing)], dtype=torch.float64, device=device)
    all_reduce_sum(counts, group)
    return out, {"rollout/filtered_groups": float(counts[0]), "rollout/filter_rounds": float(rounds),
                 "rollout/filter_short_groups": float(counts[1])}
