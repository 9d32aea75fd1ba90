"""Validation: greedy pass@1 on the validation prompts with the current weights (or ``rollout.val_n`` samples per
prompt at ``rollout.val_temperature``: mean@n, best@n and, for tasks whose answers can be read, maj@n).

``load_val_set`` reads ``data.val_path`` (only where a validation will run); calling a ``Validator`` with the
step's rollout source hands the engine the current weights and has every rank that generates score its share of the
prompts, reduced over them: ``val/reward_mean`` and its clipped part, the response lengths and clip ratio, the task's
answer-shape counts, each source's accuracy where the set has several (arith's families), and ``timing/validate``.
``trainer.validation_data_dir`` also writes each sample per rank and step. Left out: validation on a schedule of its
own (the loop decides when, ``trainer.test_freq``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from hybrid_rl.config import Config
from hybrid_rl.data import PromptDataset, collate_prompts
from hybrid_rl.data.feed import read_prompts
from hybrid_rl.data.tasks import Task
from hybrid_rl.distributed import DistInfo, reduce_weighted_means
from hybrid_rl.envs.metrics import add_pairs, env_metrics, zero_pairs
from hybrid_rl.telemetry.metrics import outcome_sums
from hybrid_rl.phases.reward import compute_scores, decode_responses, sample_records
from hybrid_rl.rewards import RewardScorer
from hybrid_rl.rewards.weighted import WeightedRewards, function_labels
from hybrid_rl.rewards.model import RewardModel
from hybrid_rl.rewards.remote import RemoteReward

if TYPE_CHECKING:
    from hybrid_rl.modes.sources import RolloutSource
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

VAL_OUTCOMES = {"reward_mean": "score", "clipped_reward_mean": "clipped_score", "response_length_mean": "length",
                "response_clip_ratio": "clipped"}
"""val/<name>: the ``outcome_sums`` key it averages (clipped_reward_mean: the part of the accuracy that responses cut
at the length cap earned, a lucky last number rather than an answer)."""


def load_val_set(cfg: Config, tokenizer) -> PromptDataset | None:
    """The validation prompts, or None where no validation runs (no ``data.val_path``, or neither
    ``trainer.test_freq``, ``trainer.val_before_train`` nor ``trainer.val_only``): the set is read only when used."""
    d, t = cfg.data, cfg.trainer
    if not d.val_path or not (t.test_freq > 0 or t.val_before_train or t.val_only):
        return None
    return read_prompts(cfg, tokenizer, "val_path", d.val_split, max(d.num_synthetic // 4, 1), t.seed + 1,
                        held_out=True, cap=d.max_val_samples)


def majority_scores(keys: list[str | None], scores: list[float], n: int) -> list[float]:
    """Per prompt (``n`` consecutive samples): the score of the answer most of its samples give (``keys``: each
    sample's final answer, None for none; a tie goes to the answer given first), 0 when no sample answered."""
    out = []
    for p in range(0, len(keys), n):
        counts: dict[str, int] = {}
        for k in keys[p:p + n]:
            if k is not None:
                counts[k] = counts.get(k, 0) + 1
        if not counts:
            out.append(0.0)
            continue
        top = max(counts.values())
        winner = next(k for k in keys[p:p + n] if k is not None and counts[k] == top)
        out.append(scores[p + keys[p:p + n].index(winner)])
    return out


class Validator:
    """One run's validation set and how it is scored; ``step()`` names the step a validation belongs to."""

    def __init__(self, cfg: Config, val_set: PromptDataset, tokenizer, worker: ActorRolloutRefWorker,
                 reward_fn: WeightedRewards | RewardScorer, task: Task | None, dist: DistInfo, step: Callable[[], int],
                 reward_model: RewardModel | None = None, remote: RemoteReward | None = None):
        self.cfg, self.val_set, self.tokenizer, self.worker = cfg, val_set, tokenizer, worker
        self.reward_fn, self.task, self.dist, self.step = reward_fn, task, dist, step
        self.reward_model = reward_model
        self.remote = remote

    @torch.no_grad()
    def __call__(self, source: RolloutSource) -> dict[str, float]:
        """Greedy pass@1 (or mean@n and best@n) with the current weights, through ``source`` (every rank takes its
        share)."""
        start = time.perf_counter()
        out = dict(source.validate(self.on_engine, self.dist))
        out["timing/validate"] = time.perf_counter() - start  # outside timing/step, inside the next timing/iteration
        return out

    def on_engine(self, rank: int, world: int) -> dict[str, float]:
        """Share ``rank`` of ``world`` of the prompts, generated and scored on this rank's engine, reduced over the
        training ranks' group."""
        idx = list(range(rank, len(self.val_set), world))
        chunk = self.cfg.data.val_batch_size or self.cfg.data.train_batch_size
        # the same keys on every rank (one all-reduce), also on a rank with no validation prompts
        names = list(VAL_OUTCOMES)
        names += list(self.task.answer_stats([])) if self.task is not None else []
        names += ["model_mean", "model_truncated"] if self.reward_model is not None else []
        names += ["remote_mean"] if self.remote is not None else []
        names += [f"function/{label}" for label in function_labels(self.reward_fn)]
        sums = {f"val/{k}": 0.0 for k in names}
        count = 0.0
        # a validation set of several sources (arith's families) also reports each one's accuracy
        sources = self.val_set.sources if len(self.val_set.sources) > 1 else []
        by_source = {f"val/reward_mean/{src}": [0.0, 0.0] for src in sources}
        records: list[dict] | None = [] if self.cfg.trainer.validation_data_dir else None
        tool_use = zero_pairs("val/env") if self.cfg.env.name is not None else {}  # multi-turn: val/env/*
        n = self.cfg.rollout.val_n  # samples per prompt, consecutive rows
        best = [0.0, 0.0]  # (sum of each prompt's best score, prompts): val/reward_best_of_n
        votes = n > 1 and self.task is not None and self.task.votes
        majority = [0.0, 0.0]  # (sum of each prompt's majority answer's score, prompts): val/reward_maj_of_n
        for s in range(0, len(idx), chunk):
            prompts = collate_prompts([self.val_set[i] for i in idx[s:s + chunk]], self.tokenizer.pad_token_id)
            out = self.worker.generate(prompts, validate=True)
            out, stats = compute_scores(out, self.tokenizer, self.reward_fn, self.cfg.reward.on_error, self.task,
                                        prefix="val", reward_model=self.reward_model, remote=self.remote)
            stats.pop("val/errors")
            outcome = outcome_sums(out.tensors["scores"], out.tensors["response_mask"], self.cfg.data.max_response_length,
                                   out.tensors.get("env_stop"))
            stats.update({f"val/{name}": (outcome[key], len(out)) for name, key in VAL_OUTCOMES.items()})
            for k, (v, _) in stats.items():
                sums[k] += v
            count += len(out)
            per_prompt = out.tensors["scores"].float().cpu().view(-1, n)  # [prompts, n]
            best[0] += float(per_prompt.max(dim=1).values.sum())
            best[1] += per_prompt.shape[0]
            if votes:
                keys = [self.task.vote_key(t) for t in decode_responses(out, self.tokenizer)]
                majority[0] += sum(majority_scores(keys, per_prompt.flatten().tolist(), n))
                majority[1] += per_prompt.shape[0]
            if by_source:
                for src, score in zip(out.non_tensors["data_source"], out.tensors["scores"].tolist()):
                    by_source[f"val/reward_mean/{src}"][0] += score
                    by_source[f"val/reward_mean/{src}"][1] += 1
            if records is not None:
                records += sample_records(out, self.tokenizer)
            if tool_use:
                add_pairs(tool_use, env_metrics(out, "val/env")[0])
        if records is not None:
            self._write_records(records, rank)
        stats = {k: (v, count) for k, v in sums.items()}
        stats.update({k: (v, c) for k, (v, c) in by_source.items()})
        if n > 1:
            stats["val/reward_best_of_n"] = (best[0], best[1])
        if votes:
            stats["val/reward_maj_of_n"] = (majority[0], majority[1])
        stats.update(tool_use)
        return reduce_weighted_means(stats, self.dist.device, self.dist.group)

    def _write_records(self, records: list[dict], rank: int) -> None:
        """``trainer.validation_data_dir``: this rank's validation samples of the current step, one JSON per line."""
        path = Path(self.cfg.trainer.output_dir) / self.cfg.trainer.validation_data_dir
        path /= f"step_{self.step():08d}_rank{rank}.jsonl"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
            tmp.replace(path)
        except OSError as e:
            raise OSError(f"trainer.validation_data_dir: cannot write {path} ({e.strerror or e}); point it at a "
                          f"writable directory, or set it to '' to stop writing validation samples") from e
