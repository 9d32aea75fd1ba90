"""``benchmarks/partial_model.py`` drives the real partial-rollout scheduling with a simulated engine: it keeps
running against ``hybrid_rl.modes.partial``, and pausing generation through the update (the NCCL stop check's effect)
makes the modelled steps slower and uneven, as measured on 4xH200; and a run that ends right after its measured
steps drains the pool in them and looks faster than the steady state, as 8-step runs on 4xH200 did."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import partial_model as pm  # noqa: E402


def _args(**kw):
    base = dict(per_step=4, n=4, mean=512, sigma=0.8, cap_factor=2.0, prompt_len=50, decode_ms=3.0,
                decode_per_seq_ms=0.04, prefill_tok_s=150e3, update_s=2.0, exchange_s=0.2, warmup=2, measure=8,
                drained=False)
    return SimpleNamespace(**{**base, **kw})


def test_the_paused_engine_is_slower_and_every_bound_holds():
    args = _args()
    free = np.concatenate([pm.simulate(args, 1.0, 2, seed, paused=False) for seed in range(3)])
    paused = np.concatenate([pm.simulate(args, 1.0, 2, seed, paused=True) for seed in range(3)])
    assert paused.mean() > 1.2 * free.mean()
    assert free.min() >= args.update_s + args.exchange_s - 1e-9  # a step is never shorter than the trainer's side
    # more groups in flight: the scheduling (CarryOver.due) keeps every take within max_staleness 3 (take raises)
    assert len(pm.simulate(args, 2.0, 3, 0, paused=False)) == args.measure


def _mean_step(seeds=4, **kw) -> float:
    return float(np.mean([np.mean(pm.simulate(_args(**kw), 3.0, 4, seed, paused=False)) for seed in range(seeds)]))


@pytest.mark.slow
def test_a_draining_window_is_faster_than_the_steady_state():
    """At the 4k point (ahead 3): steps 3-8 of a run that ends after them (a window that drains) follow the pool's
    fill, whose second step generates several steps ahead, and end in the drain; 4 warm-up steps, 8 measured and the
    pool's steps after them (what modes_sweep.py now runs) come within a few per cent of a long run's mean."""
    at_4k = dict(per_step=12, n=8, mean=4096, prompt_len=300, update_s=13.5, exchange_s=1.0)
    assert pm.run_steps(_args(warmup=4, measure=8), 3.0) == 4 + 8 + 4
    assert pm.run_steps(_args(warmup=2, measure=6, drained=True), 3.0) == 2 + 6 + 1
    steady = _mean_step(warmup=6, measure=32, **at_4k)
    sixth = _mean_step(warmup=2, measure=6, drained=True, **at_4k)
    now = _mean_step(warmup=4, measure=8, **at_4k)
    assert sixth < 0.9 * steady, (sixth, steady)
    assert abs(now - steady) < 0.06 * steady, (now, steady)


