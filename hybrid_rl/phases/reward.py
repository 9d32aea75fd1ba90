"""The driver's reward phase: decode the responses, score them, place each score on the last response token,
shape the training reward of overlong responses, and with ``algorithm.filter_groups`` DAPO's dynamic sampling (drop
the groups of equal rewards, refill with fresh ones).

Reward functions see text (response, ground truth) and return a float; this module turns a rollout batch into
``token_level_scores`` [B, R] (sparse: the score sits on the last real response token, as in verl; of a multi-turn
trajectory the reward function reads the last model turn, the score sits on its last sampled token and the
environment's own rewards are added), counts failures
when ``reward.on_error=zero``, and reports (sum, count) ``reward/*`` stats under the ``timing/reward`` timer. Running
the functions (in this process, or in worker processes with ``reward.timeout_s`` for user functions) is
``RewardScorer``'s (``hybrid_rl.rewards``); a reward model's score (``reward.model``, ``rewards/model.py``) and a
reward server's (``reward.remote``, ``rewards/remote.py``) add to the function's. Validation scores through ``compute_scores`` too.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from hybrid_rl.algorithms.core import response_extent
from hybrid_rl.batch import Batch
from hybrid_rl.config import Config
from hybrid_rl.data.tasks import Task
from hybrid_rl.distributed import DistInfo, all_reduce_max, all_reduce_sum
from hybrid_rl.micro_batching import pad_widths
from hybrid_rl.rewards import RewardScorer, score_responses
from hybrid_rl.rewards.model import RewardModel, batch_messages
from hybrid_rl.rewards.overlong import overlong_penalty
from hybrid_rl.rewards.remote import RemoteReward
from hybrid_rl.rewards.weighted import WeightedRewards
from hybrid_rl.telemetry.tracking import Timer


def sparse_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar score on its last response token (the last sampled one of a multi-turn
    trajectory, whose mask has holes): [B] → [B, R]."""
    out = torch.zeros_like(response_mask, dtype=torch.float32)
    last = (response_extent(response_mask) - 1).clamp(min=0).long()
    out[torch.arange(len(scores)), last] = scores.float().to(out.device)
    return out


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
    prompts = prompt_texts(batch, tokenizer)
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


def prompt_texts(batch: Batch, tokenizer, special: bool = False) -> list[str]:
    """Each row's prompt as text, special tokens left out (``special``: kept, as the chat template wrote them)."""
    ids, mask = batch.tensors["input_ids"].cpu(), batch.tensors["attention_mask"].cpu().bool()
    width = batch.tensors["responses"].shape[1]
    return tokenizer.batch_decode([r[:-width][m[:-width]].tolist() for r, m in zip(ids, mask)],
                                  skip_special_tokens=not special)


def model_scores(batch: Batch, tokenizer, texts: list[str], reward_model: RewardModel,
                 prefix: str) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """The reward model's scores [B] of ``texts`` (the responses), each in its prompt's conversation, and their
    stats: ``<prefix>/model_mean`` (before ``reward.model.weight``), ``<prefix>/model_truncated``."""
    nt = batch.non_tensors
    messages = batch_messages(nt, [] if "messages" in nt else prompt_texts(batch, tokenizer))
    scores, cut = reward_model.score(messages, texts)
    n = float(len(texts))
    return scores, {f"{prefix}/model_mean": (float(scores.sum()), n), f"{prefix}/model_truncated": (float(cut), n)}


def sample_infos(batch: Batch) -> list[tuple[str, str]]:
    """Each sample's ``(data_source, extra_info JSON)``, what a reward function that names them is passed."""
    nt = batch.non_tensors
    n = len(nt["ground_truth"])
    sources = nt["data_source"] if "data_source" in nt else [""] * n
    extras = nt["extra_info"] if "extra_info" in nt else ["{}"] * n
    return [(str(s), str(e)) for s, e in zip(sources, extras)]


def remote_scores(batch: Batch, tokenizer, texts: list[str], remote: RemoteReward, on_error: str,
                  prefix: str) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """The reward server's scores [B] of ``texts`` after their prompts (as the chat template wrote them), and their
    stats: ``<prefix>/remote_mean`` (before ``reward.remote.weight``) and the samples a failed request scored 0."""
    prompts = prompt_texts(batch, tokenizer, special=True)
    scores, failed = remote.score(prompts, texts, [str(g) for g in batch.non_tensors["ground_truth"]], on_error)
    n = float(len(texts))
    return torch.tensor(scores, dtype=torch.float32), {f"{prefix}/remote_mean": (float(sum(scores)), n),
                                                       f"{prefix}/errors": (float(failed), 1.0)}


def compute_scores(batch: Batch, tokenizer, fn: WeightedRewards | RewardScorer | Callable[[str, str], float],
                   on_error: str, task: Task | None = None, prefix: str = "reward",
                   reward_model: RewardModel | None = None,
                   remote: RemoteReward | None = None) -> tuple[Batch, dict[str, tuple[float, float]]]:
    """``fn``: the run's reward functions (``WeightedRewards``: with several, each one's mean is a stat), one
    ``RewardScorer``, or a bare reward function (scored in this process); ``reward_model``: its
    score times ``reward.model.weight`` added. The stats are ``(sum, count)`` pairs: the failed samples, the reward
    model's (``model_scores``) and the ``task``'s answer shape counts as ``<prefix>/<name>``."""
    texts = decode_responses(batch, tokenizer)
    truths = list(batch.non_tensors["ground_truth"])
    infos = sample_infos(batch)
    each: dict[str, list[float]] = {}
    if isinstance(fn, WeightedRewards):
        scores, num_errors, each = fn.score(texts, truths, on_error, infos)
    elif isinstance(fn, RewardScorer):
        scores, num_errors = fn.score(texts, truths, on_error, infos)
    else:
        scores, num_errors = score_responses(fn, texts, truths, on_error, infos=infos)
    score_t = torch.tensor(scores, dtype=torch.float32)
    stats = {f"{prefix}/errors": (float(num_errors), 1.0)}
    if len(each) > 1:  # several reward functions: each one's mean before its weight
        stats.update({f"{prefix}/function/{name}": (float(sum(v)), float(len(v))) for name, v in each.items()})
    if reward_model is not None:
        rm, rm_stats = model_scores(batch, tokenizer, texts, reward_model, prefix)
        score_t = score_t + reward_model.cfg.weight * rm
        stats.update(rm_stats)
    if remote is not None:
        server, server_stats = remote_scores(batch, tokenizer, texts, remote, on_error, prefix)
        score_t = score_t + remote.cfg.weight * server
        stats[f"{prefix}/errors"] = (stats[f"{prefix}/errors"][0] + server_stats.pop(f"{prefix}/errors")[0], 1.0)
        stats.update(server_stats)
    if "env_reward" in batch.tensors:  # a multi-turn environment's own rewards add to the reward function's
        score_t = score_t + batch.tensors["env_reward"].float().cpu()
    token_scores = sparse_scores(score_t, batch.tensors["response_mask"])
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


# --------------------------------------------------------------------------- the phase
NextBatch = Callable[..., Batch]
"""The rollout source's ``next_batch(timer, last)``: a refill round's freshly generated batch."""


class RewardPhase:
    """Scores a step's batch; ``tokenizer`` decodes the responses, ``reward_fn`` scores them, ``task`` (None: an
    unknown one) counts their answer shapes, ``dist`` is the training ranks' world (group filtering meets there)."""

    def __init__(self, cfg: Config, tokenizer, reward_fn: WeightedRewards | RewardScorer, task: Task | None, dist: DistInfo,
                 reward_model: RewardModel | None = None, remote: RemoteReward | None = None):
        self.cfg, self.tokenizer, self.reward_fn, self.task, self.dist = cfg, tokenizer, reward_fn, task, dist
        self.reward_model = reward_model
        """``reward.model.path``'s model (None: no reward model)."""
        self.remote = remote
        """``reward.remote.url``'s client (None: no reward server)."""

    def __call__(self, batch: Batch, timer: Timer, next_batch: NextBatch) -> tuple[Batch, dict]:
        """The scored batch (only informative groups under ``algorithm.filter_groups``, refilled through
        ``next_batch``) and its (sum, count) stats."""
        with timer("reward"):
            batch, reward_stats = self.score(batch)
        if self.cfg.algorithm.filter_groups.enable:
            batch, reward_stats = self.filter_groups(batch, reward_stats, timer, next_batch)
        return batch, reward_stats

    def score(self, batch: Batch) -> tuple[Batch, dict]:
        """Scores on the last response tokens, the overlong penalty; (sum, count) stats."""
        cfg = self.cfg
        batch, reward_stats = compute_scores(batch, self.tokenizer, self.reward_fn, cfg.reward.on_error, self.task,
                                             reward_model=self.reward_model, remote=self.remote)
        if cfg.reward.overlong_buffer_len > 0:
            batch, penalty_stats = shape_overlong(batch, cfg.data.max_response_length, cfg.reward.overlong_buffer_len,
                                                  cfg.reward.overlong_penalty_factor)
            reward_stats.update(penalty_stats)
        return batch, reward_stats

    def filter_groups(self, batch: Batch, reward_stats: dict, timer: Timer, next_batch: NextBatch
                      ) -> tuple[Batch, dict]:
        """``algorithm.filter_groups`` (DAPO's dynamic sampling, ``trainer.mode=sync`` only): drop the groups of equal
        rewards and refill with groups of fresh prompts (generated under the same θ_k, scored) until this rank holds
        its share of ``data.train_batch_size`` informative groups, every rank taking the same number of refill rounds
        (``fill_informative``). The reward stats count every scored sample; ``reward/mean`` and the other
        batch metrics describe the batch trained on."""
        cfg = self.cfg
        fg = cfg.algorithm.filter_groups
        switch = timer.times.get("timing/switch", 0.0)

        def more() -> Batch:
            nonlocal switch
            fresh = next_batch(timer, last=False)  # sync: push θ_k (already there), generate
            switch += timer.times.get("timing/switch", 0.0)
            with timer("reward"):
                fresh, stats = self.score(fresh)
            for k, (v, c) in stats.items():  # errors: a count per step; the rest: (sum, samples)
                v0, c0 = reward_stats.get(k, (0.0, 0.0))
                reward_stats[k] = (v0 + v, c0 if k == "reward/errors" else c0 + c)
            return fresh

        # the refills' generation and scoring count in timing/gen and timing/reward
        batch, counts = fill_informative(batch, more, cfg.data.train_batch_size // self.dist.world_size, fg.max_rounds,
                                         fg.metric, self.tokenizer.pad_token_id, self.dist.device, self.dist.group)
        if "timing/switch" in timer.times:
            timer.times["timing/switch"] = switch
        reward_stats.update({k: (v, 1.0) for k, v in counts.items()})
        return batch, reward_stats
