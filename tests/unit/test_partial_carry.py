"""Partial rollouts' bookkeeping (``hybrid_rl/modes/partial.py``) without a model: stitching segments gives the trainer's
layout, the pool hands over the oldest complete groups, the staleness bound forces completion, and every prompt
drawn is trained exactly once. A scripted engine decodes in lock-step (one token per unfinished request per step,
EOS at random) and the pipeline's background future runs lazily when the trainer takes it, so interrupts land
at a deterministic point."""

from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybrid_rl.batch import Batch
from hybrid_rl.modes.partial import CarryOver, Group, PartialRolloutPipeline, Sample, assemble_groups, groups_from_batch
from hybrid_rl.rollout.base import SamplingParams, Segment, assemble_rollout
from helpers import LazyFuture

EOS, PAD = 2, 0


def prompts_batch(rows: list[list[int]], start_index: int = 0) -> Batch:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    index = np.arange(start_index, start_index + len(rows))
    uid = np.array([f"0-{i}" for i in index], dtype=object)
    return Batch({"input_ids": ids, "attention_mask": mask}, {"index": index, "uid": uid,
                                                            "ground_truth": np.array(["x"] * len(rows), dtype=object)})


# --------------------------------------------------------------------------- stitching
def test_stitched_segments_match_an_uninterrupted_rollout():
    """Two segments per sample, concatenated, give the tensors ``assemble_rollout`` builds from whole responses."""
    prompts = prompts_batch([[5, 6, 7], [8, 9]])
    whole = [[11, 12, 13, EOS], [14, EOS], [15, 16, 17, 18, 19], [20, 21, EOS]]  # n=2, the third hit the budget
    lps = [[-0.1 * (i + 1) - j for j in range(len(t))] for i, t in enumerate(whole)]
    cuts = [1, 0, 3, 2]  # tokens sampled before the interrupt
    carry = CarryOver(per_step=2, n=2, max_staleness=2, max_response_length=5)
    carry.add_prompts(prompts)
    samples = [s for g in carry.groups for s in g.samples]
    for s, toks, lp, cut in zip(samples, whole, lps, cuts):
        s.extend(Segment(toks[:cut], lp[:cut], False), version=3)
        s.extend(Segment(toks[cut:], lp[cut:], True), version=4)
    got = assemble_groups(carry.groups, 2, [EOS], PAD, torch.device("cpu"), temperature=1.0)

    width = max(map(len, whole))
    responses = torch.tensor([t + [PAD] * (width - len(t)) for t in whole])
    logprobs = torch.tensor([lp + [0.0] * (width - len(lp)) for lp in lps])
    want = assemble_rollout(prompts, responses, logprobs, 2, [EOS], PAD)
    for key in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(got[key], want[key]), key
    assert torch.allclose(got["rollout_log_probs"], want["rollout_log_probs"])
    assert list(got["uid"]) == list(want["uid"]) == ["0-0", "0-0", "0-1", "0-1"]
    tv = got["token_weight_version"]
    for row, cut in enumerate(cuts):  # versions per token, the oldest as the sample's version
        n = len(whole[row])
        assert tv[row, :n].tolist() == [3] * cut + [4] * (n - cut)
    assert got["weight_version"].tolist() == [3, 4, 3, 3]  # the second sample was all sampled in round 4
    assert got.meta["partial_resumed_tokens"] == sum(len(t) - c for t, c in zip(whole, cuts) if c)
    # a checkpointed pool comes back token for token
    back = groups_from_batch(got, 2)
    assert [[(s.tokens, s.versions) for s in g.samples] for g in back] == \
        [[(s.tokens, s.versions) for s in g.samples] for g in carry.groups]


def test_take_is_oldest_first_and_respects_the_bound():
    carry = CarryOver(per_step=2, n=1, max_staleness=2, max_response_length=4)
    carry.add_prompts(prompts_batch([[5], [6], [7], [8]]))
    g = carry.groups
    for grp, version, done in ((g[0], 5, True), (g[1], 4, False), (g[2], 5, True), (g[3], 5, True)):
        grp.samples[0].extend(Segment([9], [-1.0], done), version)
    # trainer at version 6: group 1 (oldest token 4) would be at staleness 3 next step, so it must be taken now
    assert carry.due(6) == [({1}, 1), ({0, 1, 2, 3}, 2)]
    assert not carry.ready(6)  # two complete groups, but the one at the bound is not complete
    g[1].samples[0].extend(Segment([EOS], [-1.0], True), 6)
    assert carry.ready(6)
    taken = carry.take(6)
    assert [x.prompt for x in taken] == [[6], [5]]  # oldest token first, then draw order
    assert [x.prompt for x in carry.groups] == [[7], [8]]


# --------------------------------------------------------------------------- the pipeline, scripted
class ScriptedEngine:
    """Lock-step decoding: each step every unfinished request gets one token; EOS with probability p."""

    def __init__(self, seed: int, p_eos: float):
        self.rng, self.p = random.Random(seed), p_eos
        self.weights_version = 0
        self.eos_token_ids = [EOS]
        self.calls: list[int] = []
        self.last_generate_stats: dict[str, float] = {}

    def generate_interruptible(self, requests, params, interrupt=None, on_finish=None):
        self.calls.append(len(requests))
        segs = [Segment() for _ in requests]
        live = list(range(len(requests)))
        while live:
            ended = []
            for i in live:
                tok = EOS if (self.rng.random() < self.p and not requests[i].ignore_eos) else self.rng.randint(3, 50)
                segs[i].tokens.append(tok)
                segs[i].logprobs.append(-1.0)
                if tok == EOS or len(segs[i].tokens) >= requests[i].max_tokens:
                    segs[i].finished = True
                    ended.append(i)
            live = [i for i in live if i not in ended]
            if ended and on_finish:
                on_finish(ended)
            if interrupt is not None and interrupt.is_set():
                break
        return segs


def scripted_pipeline(per_step: int, n: int, max_len: int, seed: int, p_eos: float, forced: str | None = None,
                      ahead: float = 1.0, max_staleness: int = 2):  # the bookkeeping tests below start every group at once
    engine = ScriptedEngine(seed, p_eos)
    cfg = SimpleNamespace(rollout=SimpleNamespace(n=n, forced_lengths=forced),
                          data=SimpleNamespace(max_response_length=max_len))
    worker = SimpleNamespace(cfg=cfg, rollout=engine, device=torch.device("cpu"), weight_version=0,
                             tokenizer=SimpleNamespace(pad_token_id=PAD),
                             sampling_params=lambda validate=False: SamplingParams(n=n, max_tokens=max_len))
    lengths = random.Random(seed + 1)
    worker.forced_lengths = lambda count: tuple(lengths.randint(1, max_len) for _ in range(count))

    def push():
        engine.weights_version = worker.weight_version

    worker.sharding_manager = SimpleNamespace(sync_weights=push)
    worker.rollout_mode = lambda: contextlib.nullcontext(push())
    pipe = PartialRolloutPipeline(worker, max_staleness=max_staleness, stale_policy="error", per_step=per_step,
                                  ahead=ahead)
    pipe.executor = SimpleNamespace(submit=LazyFuture, shutdown=lambda wait=True: None)
    drawn: list[int] = []
    counter = iter(range(10**6))

    def next_prompts() -> Batch:
        idx = [next(counter) for _ in range(per_step)]
        drawn.extend(idx)
        return prompts_batch([[3 + i % 40, 4, 5 + i % 7] for i in idx], start_index=idx[0])

    return pipe, worker, next_prompts, drawn


def run_steps(pipe, worker, next_prompts, steps: int) -> list[Batch]:
    """The source's order of calls: take (interrupt), start the next round, train (version + 1). Records the pool's
    size after each start in ``pipe.pool_sizes``."""
    batches, pipe.pool_sizes = [], []
    for step in range(1, steps + 1):
        last = step == steps
        batch = pipe.take(next_prompts, worker.weight_version, final=last)
        batch = pipe.check_staleness(batch, worker.weight_version)
        batches.append(batch)
        if not last:
            pipe.start(next_prompts, steps_left=steps - step)
            pipe.pool_sizes.append(len(pipe.carry.groups))
        worker.weight_version += 1
    return batches


@pytest.mark.parametrize("seed,ahead", [(0, 1.0), (1, 1.0), (2, 1.0), (0, 2.0), (3, 2.0)])
def test_every_prompt_is_trained_exactly_once_within_the_bound(seed, ahead):
    """Every prompt drawn is trained once, in whole groups, within staleness 2; ``ahead`` 2.0 keeps three steps'
    groups in flight, and the pool still shrinks to what the last steps train."""
    per_step, n, steps = 3, 4, 10
    bound = 2 if ahead == 1.0 else 3  # config: max_staleness >= pool_steps
    pipe, worker, next_prompts, drawn = scripted_pipeline(per_step, n, max_len=12, seed=seed, p_eos=0.12, ahead=ahead,
                                                          max_staleness=bound)
    assert (pipe.window, pipe.pool_steps) == ((6, 2) if ahead == 1.0 else (9, 3))
    batches = run_steps(pipe, worker, next_prompts, steps)
    trained = [int(i) for b in batches for i in b["index"][::n]]
    assert sorted(trained) == sorted(drawn) and len(trained) == len(set(trained)) == per_step * steps
    for step, b in enumerate(batches):
        trainer_version = step  # the version the batch was trained at
        assert len(b) == per_step * n and b.meta["trainer_version"] == trainer_version
        mask = b["response_mask"].bool()
        staleness = trainer_version - b["token_weight_version"]
        assert int(staleness[mask].max()) <= bound and int(staleness[mask].min()) >= 0
        assert torch.equal(b["weight_version"], b["token_weight_version"].min(dim=1).values)
        for start in range(0, len(b), n):  # GRPO groups stay whole and in one batch
            assert len(set(b["uid"][start:start + n])) == 1
    assert any(b.meta["partial_carried"] for b in batches[1:-1])
    assert sum(b.meta["partial_resumed_tokens"] for b in batches) > 0  # some samples did continue
    assert batches[-1].meta["partial_carried"] == 0 and not pipe.carry.groups  # nothing left over
    assert max(int((s - b["token_weight_version"])[b["response_mask"].bool()].max())
               for s, b in enumerate(batches)) == bound  # carried tokens do reach the bound
    # the pool: pool_steps steps' groups while the run has that many left, then only what the last steps train
    # (a pool holds at least what it trains next, and groups are taken per_step a step)
    left = [steps - step for step in range(1, steps)]
    assert pipe.pool_sizes == [per_step * min(pipe.pool_steps, k) for k in left]


def test_a_smaller_window_carries_only_the_tail():
    """``trainer.partial_rollout_ahead=0.25``: a round generates the pool's oldest 1.25 steps of groups, the rest wait
    unstarted; far fewer samples are carried (staleness 2) than with every group started at once, and still every
    prompt drawn is trained exactly once within the bound."""
    per_step, n, steps = 8, 4, 12
    stale2 = {}
    for ahead in (1.0, 0.25):
        pipe, worker, next_prompts, drawn = scripted_pipeline(per_step, n, max_len=12, seed=5, p_eos=0.12, ahead=ahead)
        assert pipe.window == per_step + (8 if ahead == 1.0 else 2)
        batches = run_steps(pipe, worker, next_prompts, steps)
        trained = [int(i) for b in batches for i in b["index"][::n]]
        assert sorted(trained) == sorted(drawn) and len(trained) == len(set(trained)) == per_step * steps
        staleness = [(s - b["weight_version"]) for s, b in enumerate(batches)]
        assert max(int(x.max()) for x in staleness) <= 2
        stale2[ahead] = sum(int((x == 2).sum()) for x in staleness[2:-1]) / sum(len(x) for x in staleness[2:-1])
        if ahead < 1.0:  # at most the window's extra groups were ever started and left behind
            assert max(engine_calls for engine_calls in worker.rollout.calls) <= pipe.window * n
    print("share of samples at staleness 2:", stale2)
    assert stale2[1.0] > 0.8 and stale2[0.25] < 0.5, stale2


def test_the_interrupt_waits_for_a_steps_groups_not_for_groups_outside_the_window():
    """Regression: a round counted the groups waiting outside its window as finished (none of their samples was
    among its requests), so it was interrupted with too few complete groups and every step generated the rest in
    the foreground, to the end: nothing of the tail was carried. Now each step makes exactly one engine call, the
    interrupted round's, and the interrupt lands with a step's groups complete."""
    per_step, n, steps = 8, 4, 12
    pipe, worker, next_prompts, _ = scripted_pipeline(per_step, n, max_len=12, seed=5, p_eos=0.12, ahead=0.25)
    assert 2 * per_step > pipe.window  # some groups wait outside the window
    batches = run_steps(pipe, worker, next_prompts, steps)
    assert len(worker.rollout.calls) == steps  # the first step's foreground call, then one round per step
    assert all(b.meta["partial_carried"] > 0 for b in batches[1:-1])


def test_checkpoint_completes_groups_waiting_outside_the_window():
    per_step, n = 4, 2
    pipe, worker, next_prompts, _ = scripted_pipeline(per_step, n, max_len=9, seed=7, p_eos=0.2, ahead=0.25)
    run_steps(pipe, worker, next_prompts, 1)  # the foreground first step
    pipe.start(next_prompts)  # two steps' prompts drawn, a window of 5 groups started
    assert len(pipe.carry.groups) > pipe.window == 5  # so some groups wait outside it, unstarted
    pipe._finish_round()
    assert sum(not g.complete for g in pipe.carry.groups) >= len(pipe.carry.groups) - pipe.window > 0
    pool = pipe.peek()
    assert len(pool) == len(pipe.carry.groups) * n and all(g.complete for g in pipe.carry.groups)


def test_forced_lengths_continue_to_their_length():
    per_step, n = 2, 2
    pipe, worker, next_prompts, _ = scripted_pipeline(per_step, n, max_len=9, seed=3, p_eos=0.0, forced="fixed:1")
    batches = run_steps(pipe, worker, next_prompts, 6)
    for b in batches:
        lengths = b["response_mask"].sum(1)
        assert int(lengths.min()) >= 1 and int(lengths.max()) <= 9
    assert sum(b.meta["partial_resumed_tokens"] for b in batches) > 0


@pytest.mark.parametrize("ahead,bound", [(1.0, 2), (2.0, 3)])
def test_waiting_for_the_round_leaves_a_complete_pool_that_restores(ahead, bound):
    """Checkpoint rule: ``wait`` lets the round finish with no interrupt; the saved pool restores as it was (with
    ``ahead`` 2.0 a pool of three steps' groups)."""
    per_step, n = 2, 3
    pipe, worker, next_prompts, _ = scripted_pipeline(per_step, n, max_len=10, seed=5, p_eos=0.1, ahead=ahead,
                                                      max_staleness=bound)
    run_steps(pipe, worker, next_prompts, 3)  # ends with a final take: start one more round by hand
    pipe.start(next_prompts, steps_left=5)
    pipe.wait()
    assert len(pipe.carry.groups) == per_step * pipe.pool_steps and all(g.complete for g in pipe.carry.groups)
    saved = Batch.from_state_dict(pipe.peek().state_dict())
    again, *_ = scripted_pipeline(per_step, n, max_len=10, seed=5, p_eos=0.1, ahead=ahead, max_staleness=bound)
    again.restore(saved)
    mine = [(g.prompt, [(s.tokens, s.logprobs, s.versions) for s in g.samples]) for g in pipe.carry.groups]
    theirs = [(g.prompt, [(s.tokens, s.logprobs, s.versions) for s in g.samples]) for g in again.carry.groups]
    assert mine == theirs
    assert [g.fields["uid"] for g in pipe.carry.groups] == [g.fields["uid"] for g in again.carry.groups]


def test_more_groups_due_than_a_step_takes_are_taken_early():
    """Earliest deadline first: three steps' groups started at version 0 under max_staleness 3 are due by version 3,
    and three steps (versions 1-3) take them, a step's worth each: version 1 must take a step of them, any of them
    (the rule for two steps in flight, "would exceed the bound next step", named none before version 3 and then all
    six, more than a step takes)."""
    carry = CarryOver(per_step=2, n=1, max_staleness=3, max_response_length=8)
    for version, done in ((0, True), (0, False), (0, False), (0, True), (0, False), (0, False), (1, True), (1, True)):
        carry.groups.append(Group([1], {}, [Sample([5], [-0.1], [version], finished=done)], carry._next_seq()))
    old_six, all_eight = frozenset(range(6)), frozenset(range(8))
    assert carry.due(0) == []
    # 6 due by version 3 over versions 1-3, 8 by version 4 over versions 1-4: two a step
    assert carry.due(1) == [(old_six, 2), (all_eight, 2)]
    assert carry.due(2) == [(old_six, 4), (all_eight, 4)]  # had version 1 taken none of them
    assert carry.ready(1) and [g.seq for g in carry.take(1)] == [1, 4]  # two complete old ones: any two will do
    assert carry.due(2) == [(frozenset(range(4)), 2), (frozenset(range(6)), 2)]
    assert not carry.ready(2)  # the two complete groups are version 1's; two old ones must come first
    # groups a round in flight starts (no tokens yet) count at the round's version when it is armed
    fresh = CarryOver(per_step=1, n=1, max_staleness=2, max_response_length=8)
    fresh.groups = [Group([1], {}, [Sample()], fresh._next_seq()) for _ in range(3)]
    assert fresh.due(1) == [] and fresh.due(1, {0: 0, 1: 0, 2: 0}) == [(frozenset({0, 1, 2}), 2)]
