"""The memory planner's predictions beside the peaks committed in ``results/``, one row per reconstructable run.

    PYTHONPATH=. python benchmarks/plan_calibration.py

Each row names the result file, the config it ran (the recipe of its commit, as its overrides), and the phase whose
peak that measurement is: ``perf/max_memory_allocated_outside_engine_gb`` and ``update_step``'s peak are the trainer's
largest phase (``update_step`` runs the log-prob pass and the update only: no engine, no reference), ``engine_pool_gb``
is the engine's share. Measured and predicted are torch's allocated bytes, GiB.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.planner.estimate import GIB, phases  # noqa: E402
from hybrid_rl.planner.shape import read_shape  # noqa: E402

M15 = "model.path=builtin:qwen2.5-1.5b-random"
# the flagship recipe before its memory levers (46cdd3a, cba16b7): recomputation, micro-batches of 16 / 32 sequences
OLD = ["model.enable_gradient_checkpointing=true", "actor.use_dynamic_bsz=false", "actor.accumulate_unsharded=false",
       "actor.share_prompts=false"]
UPDATE_STEP = ["actor.use_kl_loss=false", "data.train_batch_size={p}", "actor.ppo_mini_batch_size={m}"]
ROWS = [
    # (result file, what, overrides, GPUs, GiB per GPU, measured GiB, phases the measurement spans)
    ("flagship_H200x4", "trainer peak, levers on", [M15], 4, 139.8, 67.4, "trainer"),
    ("flagship_H200x4", "engine pool", [M15], 4, 139.8, 69.68, "engine"),
    ("flagship_H100x1 (cba16b7)", "trainer peak, padded, unfused", [M15, "data.train_batch_size=64",
     "actor.ppo_mini_batch_size=16", *OLD, "actor.use_remove_padding=false", "actor.fused_logprob=false"],
     1, 79.2, 86.4 - 39.5, "trainer"),
    ("update_step_H200x4", "padded, unfused", [M15, *OLD, *UPDATE_STEP, "actor.use_remove_padding=false",
     "actor.fused_logprob=false"], 4, 139.8, 27.35, "trainer"),
    ("update_step_H200x4", "packed+fused", [M15, *OLD, *UPDATE_STEP], 4, 139.8, 11.98, "trainer"),
    ("update_step_H200x4", "no ckpt, Liger", [M15, *OLD, *UPDATE_STEP, "model.enable_gradient_checkpointing=false",
     "model.use_liger=true"], 4, 139.8, 43.90, "trainer"),
    ("update_step_H200x4", "no ckpt, 16k budget, unsharded, Liger", [M15, *OLD, *UPDATE_STEP,
     "model.enable_gradient_checkpointing=false", "actor.use_dynamic_bsz=true", "actor.max_token_len_per_device=16384",
     "actor.accumulate_unsharded=true", "model.use_liger=true"], 4, 139.8, 50.95, "trainer"),
    ("update_step_H100x1", "padded, unfused", [M15, *OLD, *UPDATE_STEP, "actor.use_remove_padding=false",
     "actor.fused_logprob=false"], 1, 79.2, 44.61, "trainer"),
    ("update_step_H100x1", "packed+fused", [M15, *OLD, *UPDATE_STEP], 1, 79.2, 29.15, "trainer"),
    ("update_step_H100x1", "packed+fused, no ckpt", [M15, *OLD, *UPDATE_STEP,
     "model.enable_gradient_checkpointing=false"], 1, 79.2, 70.14, "trainer"),
]
SIZES = {"update_step_H200x4": (256, 64), "update_step_H100x1": (64, 16)}


def predicted(overrides: list[str], gpus: int, gib: float, which: str) -> float:
    cfg = load_config(str(ROOT / "recipes" / "gsm8k_grpo.yaml"), overrides)
    all_phases = phases(cfg, read_shape(cfg.model.path), gpus, gib * GIB)
    if which == "engine":
        return cfg.rollout.vllm.gpu_memory_utilization * gib
    return max(p.total for p in all_phases if p.name not in ("weight push", "generation")) / GIB


def main() -> None:
    print(f"{'result':28s} {'run':40s} {'measured':>9s} {'predicted':>9s} {'error':>7s}")
    for name, what, overrides, gpus, gib, measured, which in ROWS:
        p, m = SIZES.get(name, (None, None))
        ov = [o.format(p=p, m=m) for o in overrides]
        pred = predicted(ov, gpus, gib, which)
        print(f"{name:28s} {what:40s} {measured:9.1f} {pred:9.1f} {100 * (pred - measured) / measured:+6.0f}%")


if __name__ == "__main__":
    main()
