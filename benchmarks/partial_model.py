"""A model of split placement with partial rollouts: step times from the real scheduling code, a modelled engine.

    python benchmarks/partial_model.py --aheads 1,2                 # one rollout GPU of split 2:2 at mean 4k
    python benchmarks/partial_model.py --aheads 1 --paused          # generation paused through each update
    python benchmarks/partial_model.py --aheads 1,2,3 --warmup 2 --measure 6 --drained   # a run that drains its pool

Not a measurement. It drives ``hybrid_rl.modes.partial``'s own ``CarryOver`` and ``Round`` (the pool, the window, the
interrupt rule, what a step must train, staleness) with a simulated clock and a simple engine: every running sample
gains one token per decode step, a decode step takes ``--decode-ms + --decode-per-seq-ms × running samples``, and a
round first prefills each continuation's context at ``--prefill-tok-s``. The trainer side is a fixed update time
after each hand-over (``--update-s``, plus ``--exchange-s`` for the batch and the weights). Lengths are the sweep's
(lognormal mean and sigma, capped at ``--cap-factor`` × the mean, EOS ignored). ``--paused`` stops generation from
the round's start until the trainer is ready, which is what an NCCL stop check did on 4xH200 (fixed: it runs on gloo).
A sync step is modelled from the same engine (``--sync-groups-per-gpu`` groups decoded to the end) plus
``--sync-update-s``; ``--sync-step-s`` compares with a measured one instead.

The defaults are the 4k point on 4xH200: 24 prompts x 8 over 2 rollout GPUs (12 groups each), a 3 ms
decode step + 0.04 ms per running sample (which puts sync's generation of 6 groups a GPU at ~31 s, as measured:
30.4 s), the trainer ranks' update 13.5 s. A run is ``--warmup`` + ``--measure`` steps and the pool's steps after
them (``modes_sweep.py``'s partial runs), and the default window (6 + 48) is the steady state. Runs that end one
step after their measured steps 3-8 (``--drained``): that window follows the pool's fill (step 2
generates several steps ahead) and ends in the drain, and the model puts it 13-20% faster than the steady state at
ahead 2 and 3. Writes ``results/partial_model_<tag>[_paused][_drained].json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from bench_common import run_dir  # noqa: E402
from hybrid_rl.config import partial_pool_steps  # noqa: E402
from hybrid_rl.modes.partial import CarryOver, Group, Round, Sample  # noqa: E402
from hybrid_rl.rollout.base import Segment  # noqa: E402


class Engine:
    """Decode-step timing for a set of running samples."""

    def __init__(self, args):
        self.base, self.per_seq = args.decode_ms / 1e3, args.decode_per_seq_ms / 1e3
        self.prefill = args.prefill_tok_s

    def step_s(self, running: int) -> float:
        return self.base + self.per_seq * running


def draw_lengths(rng, count: int, args) -> list[int]:
    mu = math.log(args.mean) - args.sigma ** 2 / 2
    cap = int(args.cap_factor * args.mean)
    return [int(x) for x in np.clip(np.round(rng.lognormal(mu, args.sigma, count)), 1, cap)]


def run_round(rnd: Round, engine: Engine, t: float, armed_at: float | None, trainer_version: int, paused: bool,
              prompt_len: int) -> tuple[float, list[Segment]]:
    """Generate ``rnd``'s continuations from time ``t``; the trainer (at ``trainer_version``) arms it at ``armed_at``
    (None: never, the round runs to the end). Returns the time it stops and its segments. Every continuation's context
    (prompt + carried tokens) is prefilled first: a weight push resets the engine's prefix cache."""
    left = np.array([c.max_tokens for c in rnd.requests], dtype=np.int64)
    made = np.zeros_like(left)
    t += sum(prompt_len + len(c.tokens) for c in rnd.requests) / engine.prefill
    if paused and armed_at is not None:
        t = max(t, armed_at)
    armed = False
    while True:
        if not armed and armed_at is not None and t >= armed_at:
            rnd.arm(trainer_version)
            armed = True
        if rnd.interrupt.is_set():
            break
        running = left > 0
        if not running.any():
            if armed_at is None or armed:
                break
            t = armed_at  # nothing left to generate: wait for the trainer
            continue
        k = int(left[running].min())  # decode steps until the next sample finishes
        dt = engine.step_s(int(running.sum()))
        if not armed and armed_at is not None:
            k = max(1, min(k, math.ceil((armed_at - t) / dt)))
        left[running] -= k
        made[running] += k
        t += k * dt
        finished = np.flatnonzero(running & (left == 0)).tolist()
        if finished:
            rnd.on_finish(finished)
    segs = [Segment([7] * int(m), [-0.5] * int(m), bool(r == 0)) for m, r in zip(made, left)]
    return t, segs


def run_steps(args, ahead: float) -> int:
    """The modelled run's length: ``modes_sweep.py``'s for a partial run (the pool's steps beyond the measured ones,
    so that none of them drains), or with ``--drained`` one step beyond, as 8-step runs that end after their measured steps."""
    return args.warmup + args.measure + (1 if args.drained else partial_pool_steps(ahead))


def simulate(args, ahead: float, staleness: int, seed: int, paused: bool) -> list[float]:
    """Hand-over times' differences (the step cadence) of one modelled run, its measured steps."""
    rng = np.random.default_rng(seed)
    engine, B, n = Engine(args), args.per_step, args.n
    carry = CarryOver(B, n, staleness, int(args.cap_factor * args.mean))
    window = B + math.ceil(ahead * B)
    pool_steps = partial_pool_steps(ahead)

    def add(count: int) -> None:
        for _ in range(count):
            lengths = draw_lengths(rng, n, args)
            carry.groups.append(Group([1] * args.prompt_len, {}, [Sample(forced_length=x) for x in lengths],
                                      carry._next_seq()))

    # step 1: the foreground round, to the end
    add(B)
    rnd = Round(carry, 0)
    t, segs = run_round(rnd, engine, 0.0, None, 0, False, args.prompt_len)
    carry.apply(rnd.pending, segs, 0)
    carry.take(0)
    handovers, version = [t], 0
    total = run_steps(args, ahead)
    for step in range(2, total + 1):
        steps_left = total - step + 1
        add(max(0, B * min(pool_steps, steps_left) - len(carry.groups)))
        t_start = handovers[-1] + args.exchange_s
        rnd = Round(carry, version, window)
        ready_at = t_start + args.update_s
        t, segs = run_round(rnd, engine, t_start, ready_at, version + 1, paused, args.prompt_len)
        carry.apply(rnd.pending, segs, version)
        version += 1
        if not carry.ready(version):  # what the pipeline does after a restore: finish in the foreground
            rnd = Round(carry, version)
            t, segs = run_round(rnd, engine, t, None, version, False, args.prompt_len)
            carry.apply(rnd.pending, segs, version)
        carry.take(version)
        handovers.append(max(t, ready_at))
    # step s's time is hand-over s minus hand-over s-1 (step 1's is its own round)
    return list(np.diff([0.0, *handovers]))[args.warmup:args.warmup + args.measure]


def sync_step(args, seed: int) -> float:
    """Each GPU decodes its groups to the end (prefill, then the tail), then the update."""
    rng = np.random.default_rng(10_000 + seed)
    engine, worst = Engine(args), 0.0
    for _ in range(args.sync_gpus):
        lengths = sorted(draw_lengths(rng, args.sync_groups_per_gpu * args.n, args))
        t, prev = len(lengths) * args.prompt_len / engine.prefill, 0
        for i, x in enumerate(lengths):
            t += (x - prev) * engine.step_s(len(lengths) - i)
            prev = x
        worst = max(worst, t)
    return worst + args.sync_update_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aheads", default="1,2", help="trainer.partial_rollout_ahead values, comma-separated")
    ap.add_argument("--staleness", type=int, default=0, help="trainer.max_staleness (0: the least each ahead allows)")
    ap.add_argument("--paused", action="store_true", help="no generation from a round's start until the trainer is "
                                                          "ready (the NCCL stop check before the fix)")
    ap.add_argument("--per-step", type=int, default=12, help="groups per step on this rollout GPU")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--mean", type=float, default=4096)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--cap-factor", type=float, default=2.0)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--decode-ms", type=float, default=3.0)
    ap.add_argument("--decode-per-seq-ms", type=float, default=0.04)
    ap.add_argument("--prefill-tok-s", type=float, default=150e3)
    ap.add_argument("--update-s", type=float, default=13.5)
    ap.add_argument("--exchange-s", type=float, default=1.0)
    ap.add_argument("--sync-gpus", type=int, default=4)
    ap.add_argument("--sync-groups-per-gpu", type=int, default=6)
    ap.add_argument("--sync-update-s", type=float, default=12.1)
    ap.add_argument("--sync-step-s", type=float, default=0.0, help="a measured sync step to compare with (0: model)")
    ap.add_argument("--warmup", type=int, default=6, help="steps left out at the start")
    ap.add_argument("--measure", type=int, default=48, help="steps measured after the warm-up")
    ap.add_argument("--drained", action="store_true",
                    help="the run ends one step after the measured ones, so its last measured steps drain the pool "
                         "(a window that drains); default: the pool's steps after, as modes_sweep.py now runs")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--tag", default="4k_split2")
    ap.add_argument("--out", default=None, help="run directory (default runs/partial_model/<UTC time>/; "
                    "benchmarks/publish.py copies a result to benchmarks/results/)")
    args = ap.parse_args()
    try:
        aheads = [float(a) for a in args.aheads.split(",") if a.strip()]
    except ValueError:
        raise SystemExit(f"--aheads={args.aheads!r}: give comma-separated numbers, e.g. 1,2") from None
    sync = args.sync_step_s or float(np.mean([sync_step(args, s) for s in range(args.seeds)]))
    rows = []
    for ahead in aheads:
        bound = args.staleness or partial_pool_steps(ahead)
        steps = [d for s in range(args.seeds) for d in simulate(args, ahead, bound, s, args.paused)]
        mean = float(np.mean(steps))
        rows.append({"ahead": ahead, "max_staleness": bound, "paused": args.paused, "drained": args.drained,
                     "step_s": mean, "speedup_vs_sync": sync / mean,
                     "steps_s_first_seed": [round(x, 1) for x in steps[:min(args.measure, 16)]]})
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}), flush=True)
    out = run_dir("partial_model", args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "".join(f"_{k}" for k in ("paused", "drained") if getattr(args, k))
    path = out / f"partial_model_{args.tag}{suffix}.json"
    path.write_text(json.dumps({"model": "benchmarks/partial_model.py (a model, not a measurement)",
                                "sync_step_s": sync, "sync_basis": "measured" if args.sync_step_s else "model",
                                "args": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}, indent=1))
    print(f"sync step {sync:.1f} s ({'measured' if args.sync_step_s else 'model'}); wrote {path}")


if __name__ == "__main__":
    main()
