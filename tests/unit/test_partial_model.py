"""``benchmarks/partial_model.py`` drives the real partial-rollout scheduling with a simulated engine: it keeps
running against ``hybrid_rl.partial``, and pausing generation through the update (the NCCL stop check's effect)
makes the modelled steps slower and uneven, as measured on 4xH200."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import partial_model as pm  # noqa: E402


def _args(**kw):
    base = dict(per_step=4, n=4, mean=512, sigma=0.8, cap_factor=2.0, prompt_len=50, decode_ms=3.0,
                decode_per_seq_ms=0.04, prefill_tok_s=150e3, update_s=2.0, exchange_s=0.2, steps=10)
    return SimpleNamespace(**{**base, **kw})


def test_the_paused_engine_is_slower_and_every_bound_holds():
    args = _args()
    free = np.concatenate([pm.simulate(args, 1.0, 2, seed, paused=False)[2:] for seed in range(3)])
    paused = np.concatenate([pm.simulate(args, 1.0, 2, seed, paused=True)[2:] for seed in range(3)])
    assert paused.mean() > 1.2 * free.mean()
    assert free.min() >= args.update_s + args.exchange_s - 1e-9  # a step is never shorter than the trainer's side
    # more groups in flight: the scheduling (CarryOver.due) keeps every take within max_staleness 3 (take raises)
    assert len(pm.simulate(args, 2.0, 3, 0, paused=False)) == args.steps - 1
