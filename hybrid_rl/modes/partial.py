"""Partial rollouts for overlap mode (``trainer.partial_rollouts``): interrupt the long tail, carry it over.

In one-step overlap the trainer waits at every step for the whole next batch, including the few very long responses
that decode at low engine occupancy. Here (AReaL-style) a generation *round* holds the GRPO groups carried over from
the previous round plus this step's new prompts; at the step boundary the trainer waits only until this rank has
``B_rank`` complete groups (its prompts per step), then interrupts the engine. It trains on the ``B_rank`` oldest
complete groups; every other group (finished, or unfinished with its tokens and their engine log-probs so far) goes
into the next round, where unfinished samples continue from prompt + partial response under the weights pushed at
that boundary. Groups are never split.

Bookkeeping, in ``CarryOver`` (pure, no threads): the pool of groups, oldest first. A background round generates
the pool's oldest ``(1 + trainer.partial_rollout_ahead) × B_rank`` groups (the window): the others wait unstarted,
so only the slowest of a round's groups are carried, not a whole step. The pool is topped up to two steps' prompts,
or to as many whole steps as the window spans when ``ahead`` > 1, and never to more than the steps left in the run
(so every prompt drawn is trained exactly once). Each token records the engine's weight version when it was
sampled (``token_weight_version`` [B, T]); a sample's ``weight_version`` is its oldest token's, so the staleness
check keeps its meaning. A carried group is used one step later than its round, so its oldest tokens reach
staleness 2 (hence ``trainer.max_staleness >= 2``, and one more per extra step of groups in flight). What a step
must train is earliest deadline first (``CarryOver.due``): a group that would exceed the bound at its next use is
waited for and trained now, never carried, and when more groups fall due together than the steps left before
their deadline take, enough of them are trained early. The loss needs nothing new: behaviour = the engine's
per-token log-probs (stitched from every segment), proximal = θ_k's ``old_log_probs`` (the pass, or the update's own
first forward under ``actor.old_log_prob=auto``).

Under split placement (``rollout_source.SplitSource``) the same pipeline runs on each rollout rank, which has no actor: the
weights arrive by broadcast before a round starts, and the step boundary is the moment every trainer rank is ready
for the next batch, so a rollout GPU keeps generating the whole time the trainer GPUs update (AReaL's layout).

Checkpoints hold nothing partial: saving (and validation) waits for the round in flight to finish with no interrupt,
groups waiting outside the window are generated to the end, and the pending batch saved is the whole pool, every
group complete; a resumed run puts it back and goes on as an uninterrupted one would. Left out: tensor parallelism
with vLLM (the ranks of an engine would have to agree on the interrupt), and KV reuse across an interrupt (a
continuation prefills its context again)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from hybrid_rl.batch import Batch
from hybrid_rl.config import partial_pool_steps
from hybrid_rl.modes.overlap import RolloutPipeline
from hybrid_rl.rollout.base import Continuation, SamplingParams, Segment, assemble_rollout, pad_rows


# --------------------------------------------------------------------------- the pool
@dataclass
class Sample:
    """One response, across however many rounds it took."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The engine's weight version when each token was sampled."""
    finished: bool = False
    forced_length: int | None = None
    """Benchmarks (``rollout.forced_lengths``): the response is exactly this long, EOS ignored."""
    resumed_tokens: int = 0
    """Tokens sampled in a round after the one that started this response."""

    def extend(self, seg: Segment, version: int) -> None:
        if self.tokens:
            self.resumed_tokens += len(seg.tokens)
        self.tokens += seg.tokens
        self.logprobs += seg.logprobs
        self.versions += [version] * len(seg.tokens)
        self.finished = seg.finished

    def request(self, prompt: list[int], max_response_length: int) -> Continuation:
        budget = (self.forced_length if self.forced_length is not None else max_response_length) - len(self.tokens)
        return Continuation(prompt, tuple(self.tokens), budget, ignore_eos=self.forced_length is not None)


@dataclass
class Group:
    """The n samples of one prompt (never split), with the prompt row's non-tensor fields."""

    prompt: list[int]
    fields: dict[str, Any]
    samples: list[Sample]
    seq: int
    """Draw order: ties in age are broken oldest drawn first."""

    @property
    def complete(self) -> bool:
        return all(s.finished for s in self.samples)

    @property
    def oldest_version(self) -> int | None:
        """The version of the oldest token sampled so far (None before any)."""
        return min((s.versions[0] for s in self.samples if s.versions), default=None)


class CarryOver:
    """The groups being generated on this rank, oldest first; which to train on and which to carry."""

    def __init__(self, per_step: int, n: int, max_staleness: int, max_response_length: int):
        self.per_step, self.n = per_step, n
        self.max_staleness = max_staleness
        self.max_response_length = max_response_length
        self.groups: list[Group] = []
        self._seq = 0

    def add_prompts(self, prompts: Batch, forced_lengths: tuple[int, ...] | None = None) -> None:
        """New groups from a left-padded prompt batch (n empty samples each)."""
        ids, mask = prompts.tensors["input_ids"].cpu(), prompts.tensors["attention_mask"].cpu().bool()
        for row in range(len(prompts)):
            forced = forced_lengths[row * self.n:(row + 1) * self.n] if forced_lengths is not None else [None] * self.n
            self.groups.append(Group(ids[row][mask[row]].tolist(), {k: v[row] for k, v in prompts.non_tensors.items()},
                                     [Sample(forced_length=f) for f in forced], self._next_seq()))

    def add_groups(self, groups: list[Group]) -> None:
        for g in groups:
            self.groups.append(dataclasses.replace(g, seq=self._next_seq()))

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def pending(self, window: int | None = None) -> list[tuple[int, int]]:
        """(group, sample) index of every unfinished sample of the pool's first ``window`` groups (all: None), in
        pool order (oldest first)."""
        return [(gi, si) for gi, g in enumerate(self.groups[:window]) for si, s in enumerate(g.samples)
                if not s.finished]

    def requests(self, pending: list[tuple[int, int]]) -> list[Continuation]:
        return [self.groups[gi].samples[si].request(self.groups[gi].prompt, self.max_response_length)
                for gi, si in pending]

    def apply(self, pending: list[tuple[int, int]], segments: list[Segment], version: int) -> None:
        if len(segments) != len(pending):
            raise RuntimeError(f"the engine returned {len(segments)} segments for {len(pending)} continuations")
        for (gi, si), seg in zip(pending, segments):
            self.groups[gi].samples[si].extend(seg, version)

    def _version(self, gi: int, fresh: dict[int, int] | None) -> int | None:
        """A group's oldest version; ``fresh``: groups a round in flight started, at that round's version."""
        v = self.groups[gi].oldest_version
        return v if v is not None or fresh is None else fresh.get(gi)

    def due(self, trainer_version: int, fresh: dict[int, int] | None = None) -> list[tuple[frozenset[int], int]]:
        """What this step must train so that every started group can still be trained within ``max_staleness``
        (earliest deadline first): ``(groups, k)`` pairs, at least ``k`` of ``groups`` in this step's batch.

        A group is due by version ``oldest_version + max_staleness``; the groups due by any version ``d`` must fit
        in the steps from this one to ``d``, ``per_step`` a step, so this step takes at least the excess. With two
        steps' groups in flight that is the groups that would exceed the bound next step, every one of them; a
        larger pool (``ahead`` > 1) starts more groups at once than a step takes, and some must go early (any of
        them: a count, not a choice of groups)."""
        by_deadline: dict[int, set[int]] = {}
        for gi in range(len(self.groups)):
            v = self._version(gi, fresh)
            if v is not None:
                by_deadline.setdefault(v + self.max_staleness, set()).add(gi)
        needs, upto = [], set()
        for d in sorted(by_deadline):
            upto |= by_deadline[d]
            k = len(upto) - max(0, d - trainer_version) * self.per_step
            if k > 0:
                needs.append((frozenset(upto), k))
        return needs

    @staticmethod
    def meets(chosen: set[int], needs: list[tuple[frozenset[int], int]]) -> bool:
        return all(len(groups & chosen) >= k for groups, k in needs)

    def ready(self, trainer_version: int) -> bool:
        """Enough complete groups to train on, and among them what ``due`` asks of this step."""
        done = {gi for gi, g in enumerate(self.groups) if g.complete}
        return len(done) >= self.per_step and self.meets(set(self.oldest(done)), self.due(trainer_version))

    def oldest(self, complete: set[int], fresh: dict[int, int] | None = None) -> list[int]:
        """The ``per_step`` oldest of ``complete``, oldest first (by oldest token, then draw order): what ``take``
        trains."""
        return sorted(complete, key=lambda gi: (self._version(gi, fresh), self.groups[gi].seq))[:self.per_step]

    def take(self, trainer_version: int) -> list[Group]:
        """The ``per_step`` oldest complete groups (by oldest token, then draw order), removed from the pool."""
        complete = {gi for gi, g in enumerate(self.groups) if g.complete}
        ordered = self.oldest(complete)
        chosen = set(ordered)
        if len(chosen) < self.per_step or not self.meets(chosen, self.due(trainer_version)):
            raise RuntimeError(f"partial rollouts: {len(complete)} complete groups for {self.per_step} per step, "
                               f"or groups due at this step left out (a bookkeeping bug)")
        taken = [self.groups[gi] for gi in ordered]
        self.groups = [g for gi, g in enumerate(self.groups) if gi not in chosen]
        return taken


# --------------------------------------------------------------------------- stitching
def assemble_groups(groups: list[Group], n: int, eos_token_ids: list[int], pad_token_id: int,
                    device: torch.device, temperature: float) -> Batch:
    """Complete groups → the batch ``worker.generate`` would hand the trainer, plus ``token_weight_version``.

    The prompts are left-padded again and every response (all its segments, concatenated) goes through
    ``assemble_rollout``, so masks and position ids are laid out exactly as for an uninterrupted rollout.
    """
    samples = [s for g in groups for s in g.samples]
    unfinished = sum(not s.finished for s in samples)
    if unfinished:
        raise RuntimeError(f"assemble_groups: {unfinished} samples are unfinished; only complete groups are trained")
    width = max(len(g.prompt) for g in groups)
    ids = torch.full((len(groups), width), int(pad_token_id), dtype=torch.long)
    mask = torch.zeros((len(groups), width), dtype=torch.long)
    for row, g in enumerate(groups):
        ids[row, width - len(g.prompt):] = torch.as_tensor(g.prompt, dtype=torch.long)
        mask[row, width - len(g.prompt):] = 1
    fields = {k: np.array([g.fields[k] for g in groups], dtype=object) for k in groups[0].fields}
    if "index" in fields:
        fields["index"] = fields["index"].astype(np.int64)
    prompts = Batch({"input_ids": ids, "attention_mask": mask}, fields).to(device)
    responses, logprobs = pad_rows([s.tokens for s in samples], [s.logprobs for s in samples], pad_token_id)
    forced = tuple(len(s.tokens) for s in samples) if samples[0].forced_length is not None else None
    out = assemble_rollout(prompts, responses.to(device), logprobs.to(device), n, eos_token_ids, pad_token_id, forced)
    oldest = torch.tensor([min(s.versions) for s in samples], dtype=torch.long)
    versions = oldest[:, None].repeat(1, responses.shape[1])  # past a response: its oldest version
    for row, s in enumerate(samples):
        versions[row, :len(s.versions)] = torch.as_tensor(s.versions, dtype=torch.long)
    resumed = sum(s.resumed_tokens for s in samples)
    return out.union(tensors=dict(weight_version=oldest.to(device), token_weight_version=versions.to(device)),
                     weight_version=int(oldest.min()), temperature=temperature, partial_resumed_tokens=resumed,
                     source_prompts=prompts)  # kept so a stale batch could be regenerated (pipeline.check_staleness)


def groups_from_batch(batch: Batch, n: int) -> list[Group]:
    """The inverse of ``assemble_groups`` for a checkpointed pool (complete groups, in order)."""
    t = batch.tensors
    width = t["prompts"].shape[1]
    keep = [k for k in batch.non_tensors]
    groups = []
    for start in range(0, len(batch), n):
        rows = range(start, start + n)
        prompt = t["input_ids"][start, :width][t["attention_mask"][start, :width].bool()].tolist()
        samples = []
        for r in rows:
            m = t["response_mask"][r].bool()
            samples.append(Sample(t["responses"][r][m].tolist(), t["rollout_log_probs"][r][m].tolist(),
                                  t["token_weight_version"][r][m].tolist(), finished=True,
                                  forced_length=int(m.sum()) if batch.meta.get("forced") else None))
        groups.append(Group(prompt, {k: batch.non_tensors[k][start] for k in keep}, samples, 0))
    return groups


COUNTS = ("partial_carried", "partial_resumed_tokens", "partial_context_tokens", "partial_cached_tokens",
          "partial_gen_tokens")
"""Batch meta that counts something on its rollout rank, logged as ``rollout/<key>`` summed over the ranks: groups
left in the pool, tokens resumed from earlier rounds, the rounds' context tokens (prompt + partial response)
with those vLLM served from its prefix cache, and the tokens the rounds sampled
(``perf/gen_tokens_per_s`` divides them by the rounds' generate time)."""


def partial_metrics(batch: Batch, trainer_version: int, counts: bool = True
                    ) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """``rollout/token_staleness_*`` over response tokens, and (``counts``) the carry-over counts (per rank, summed
    later)."""
    t = batch.tensors
    mask = t["response_mask"].bool()
    staleness = (trainer_version - t["token_weight_version"])[mask].float()
    means = {"rollout/token_staleness_mean": (float(staleness.sum()), float(mask.sum())),
             **{f"rollout/{key}": (float(batch.meta.get(key, 0)), 1.0) for key in (COUNTS if counts else ())}}
    return means, {"rollout/token_staleness_max": float(staleness.max()) if staleness.numel() else 0.0}


# --------------------------------------------------------------------------- one round in flight
class Round:
    """The continuations of one round and the rule that interrupts it.

    The generating thread reports finished requests (``on_finish``); the trainer ``arm``s the round when it
    starts waiting. The interrupt is set once both hold: ``per_step`` groups complete, and the ``per_step`` oldest of
    them meet what ``CarryOver.due`` asks of this step. Until armed it never fires (the engine keeps going while the
    trainer trains).
    """

    def __init__(self, carry: CarryOver, version: int, window: int | None = None):
        self.pending = carry.pending(window)
        self.requests = carry.requests(self.pending)
        self.version = version
        self.interrupt = threading.Event()
        self.gen_s = 0.0
        self._lock = threading.Lock()
        # unfinished samples per group, over the whole pool: a group waiting outside the window is not complete
        # (counting only this round's requests made those look finished, so the interrupt fired early and the step
        # generated the rest in the foreground)
        self._left = [sum(not s.finished for s in g.samples) for g in carry.groups]
        self._carry = carry
        self._fresh = {gi: version for gi, _ in self.pending if carry.groups[gi].oldest_version is None}
        """Groups this round starts: their tokens will carry its version (the pool learns them after the round)."""
        self._need: list[tuple[frozenset[int], int]] | None = None

    def on_finish(self, indices: list[int]) -> None:
        with self._lock:
            for i in indices:
                self._left[self.pending[i][0]] -= 1
            self._check()

    def arm(self, trainer_version: int) -> None:
        with self._lock:
            self._need = self._carry.due(trainer_version, self._fresh)
            self._check()

    def _check(self) -> None:
        if self._need is None or self.interrupt.is_set():
            return
        carry = self._carry
        done = {gi for gi, left in enumerate(self._left) if left == 0}
        if len(done) >= carry.per_step and carry.meets(set(carry.oldest(done, self._fresh)), self._need):
            self.interrupt.set()


# --------------------------------------------------------------------------- the pipeline
class PartialRolloutPipeline(RolloutPipeline):
    """``RolloutPipeline`` with rounds instead of whole batches: start tops the pool up and generates it in the
    background; take interrupts it once ``per_step`` groups are complete and hands over the oldest of them."""

    def __init__(self, worker, max_staleness: int, stale_policy: str, per_step: int, ahead: float = 0.25):
        super().__init__(worker, max_staleness, stale_policy, background=True)
        cfg = worker.cfg
        self.carry = CarryOver(per_step, cfg.rollout.n, max_staleness, cfg.data.max_response_length)
        self.window = per_step + math.ceil(ahead * per_step)
        """Groups a background round generates (``trainer.partial_rollout_ahead``): the pool's oldest; the rest wait."""
        self.pool_steps = partial_pool_steps(ahead)  # = ⌈window / per_step⌉, at least 2
        """Steps of prompts the pool is topped up to (fewer before the run's last steps)."""
        self.round: Round | None = None
        self._gen = [0, 0.0]
        """Tokens the rounds folded into the pool since the last take sampled, and those rounds' generate seconds
        (the batch's ``partial_gen_tokens`` and ``gen_s``, i.e. ``timing/gen``: every round counted once, the one in
        flight at a take, one in the foreground, and those finished for validation or a checkpoint)."""
        self._context = [0, 0]
        """Context tokens the rounds since the last take submitted, and those vLLM served from its prefix cache."""

    # -- generation ----------------------------------------------------------------
    def _params(self) -> SamplingParams:
        return self.worker.sampling_params()

    def _add(self, prompts: Batch) -> None:
        forced = None
        if self.worker.cfg.rollout.forced_lengths:  # the worker's own length stream, as worker.generate draws it
            forced = self.worker.forced_lengths(len(prompts) * self.carry.n)
        self.carry.add_prompts(prompts, forced)

    def _new_round(self, window: int | None = None) -> Round | None:
        version = self.worker.rollout.weights_version
        rnd = Round(self.carry, -1 if version is None else version, window)
        return rnd if rnd.requests else None

    def _engine_awake(self):
        """The engine with this rank's current weights, for a round in the foreground: the sharding manager's
        switch when colocated; a split rollout rank's engine is always awake and holds the broadcast weights."""
        return self.worker.rollout_mode() if self.worker.sharding_manager is not None else contextlib.nullcontext()

    def _run(self, rnd: Round) -> list[Segment]:
        start = time.perf_counter()
        segments = self.worker.rollout.generate_interruptible(rnd.requests, self._params(), rnd.interrupt,
                                                               rnd.on_finish)
        rnd.gen_s = time.perf_counter() - start
        self._context[0] += sum(len(r.prompt) + len(r.tokens) for r in rnd.requests)
        self._context[1] += int(self.worker.rollout.last_generate_stats.get("cached_tokens", 0))
        return segments

    def _fold(self, rnd: Round, segments: list[Segment]) -> None:
        """A finished round's segments into the pool, its sampled tokens and generate time into ``_gen``."""
        self.carry.apply(rnd.pending, segments, rnd.version)
        self._gen[0] += sum(len(seg.tokens) for seg in segments)
        self._gen[1] += rnd.gen_s

    def _finish_round(self) -> None:
        """Wait for the round in flight (interrupted or not) and fold its segments into the pool."""
        if self.pending is None:
            return
        segments, rnd = self.pending.result(), self.round
        self.pending, self.round = None, None
        self._fold(rnd, segments)

    def start(self, next_prompts: Callable[[], Batch], steps_left: int = 2) -> None:  # type: ignore[override]
        """Top the pool up (``pool_steps`` steps' prompts, at most ``steps_left``: the steps from the next one to the
        run's end) and generate its window in the background."""
        if self.pending is not None:
            raise RuntimeError("a rollout is already in flight; take() it first")
        target = self.carry.per_step * max(1, min(self.pool_steps, steps_left))
        while len(self.carry.groups) < target:
            self._add(next_prompts())
        if self.worker.sharding_manager is not None:  # colocated: push θ_k now, while no generation runs (split
            self.worker.sharding_manager.sync_weights()  # placement's rollout ranks received it by broadcast)
        rnd = self._new_round(self.window)
        if rnd is not None:
            self.round, self.pending = rnd, self.executor.submit(self._run, rnd)

    def take(self, next_prompts: Callable[[], Batch], trainer_version: int = 0,  # type: ignore[override]
             final: bool = False) -> Batch:
        """This step's batch: interrupt the round once it holds ``per_step`` complete groups (never on the
        ``final`` step), or generate in the foreground when nothing is in flight and too little is complete."""
        carry = self.carry
        if self.round is not None and not final:
            self.round.arm(trainer_version)
        self._finish_round()
        if not carry.ready(trainer_version):  # the first step (or after a restore): in the foreground, to the end
            while len(carry.groups) < carry.per_step:
                self._add(next_prompts())
            with self._engine_awake():
                rnd = self._new_round()
                if rnd is not None:
                    self._fold(rnd, self._run(rnd))
        taken = carry.take(trainer_version)
        (context, cached), self._context = self._context, [0, 0]
        (generated, gen_s), self._gen = self._gen, [0, 0.0]
        return self._batch(taken, gen_s=gen_s, partial_gen_tokens=generated, partial_carried=len(carry.groups),
                           partial_context_tokens=context, partial_cached_tokens=cached)

    def _batch(self, groups: list[Group], **meta: Any) -> Batch:
        w = self.worker
        batch = assemble_groups(groups, self.carry.n, w.rollout.eos_token_ids, w.tokenizer.pad_token_id, w.device,
                                self._params().logprob_temperature)
        return batch.union(forced=w.cfg.rollout.forced_lengths is not None, **meta)

    # -- checkpoints, validation ------------------------------------------------------
    def wait(self) -> None:
        """Let the round in flight finish with no interrupt (validation, checkpoints): nothing partial remains."""
        self._finish_round()

    def peek(self) -> Batch | None:
        """The whole pool, every group complete, for a checkpoint (None when it is empty): the round in flight
        finishes, and groups still waiting outside the window are generated now, to the end, under the current
        weights."""
        self._finish_round()
        if not self.carry.groups:
            return None
        if any(not g.complete for g in self.carry.groups):
            with self._engine_awake():
                rnd = self._new_round()
                if rnd is not None:
                    self._fold(rnd, self._run(rnd))
        return self._batch(list(self.carry.groups))

    def restore(self, batch: Batch) -> None:
        """Put a checkpointed pool back (complete groups, oldest first)."""
        self.carry.groups = []
        self.carry.add_groups(groups_from_batch(batch, self.carry.n))

    def close(self) -> None:
        self._finish_round()
        left = len(self.carry.groups)
        if left:  # a graceful stop (its checkpoint holds them), or a run ended before the step the pool was sized for
            print(f"warning: partial rollouts: {left} generated group(s) were not trained in this run (a checkpoint "
                  f"saved after the last step holds them)", file=sys.stderr)
        super().close()
