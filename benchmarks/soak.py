"""Soak: run the real trainer for N steps and record host RSS and GPU memory after every step.

"Memory is flat over a long run" becomes a figure: the JSON holds one row per step and a summary (mean RSS
over the first and the last window of steps, the least-squares slope in MB per 100 steps, the same for GPU
memory on CUDA), and the plot shows both curves. Growth that a short test cannot see (a cache that never
shrinks, a list that keeps every batch) shows up as a slope.

    python benchmarks/soak.py --steps 250                                  # CPU default recipe
    torchrun --standalone --nproc_per_node=1 benchmarks/soak.py --recipe benchmarks/bench_modes.yaml --steps 200 \\
        rollout.name=vllm                                             # GPU: rank 0 writes the results

Writes ``soak_<device>_<model>.json`` and ``.png`` into its run directory (``runs/soak/<UTC time>/`` unless ``--out``;
``benchmarks/publish.py`` copies them to ``benchmarks/results/``). Left out: per-rank files (rank 0
measures its own process, which holds the same parts as every other rank).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import git_commit, gpu_short_name, run_dir  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.distributed import destroy, init_distributed  # noqa: E402
from hybrid_rl.trainer import Trainer  # noqa: E402


class SoakTrainer(Trainer):
    """The trainer, sampling this process's memory after every step."""

    samples: list[dict]

    def step(self, last: bool = False) -> dict[str, float]:
        out = super().step(last)
        row = {"step": len(self.samples) + 1, "rss_mb": psutil.Process().memory_info().rss / 2**20,
               "time_s": time.perf_counter()}
        if self.dist.device.type == "cuda":
            torch.cuda.synchronize(self.dist.device)
            row["gpu_allocated_mb"] = torch.cuda.memory_allocated(self.dist.device) / 2**20
            row["gpu_reserved_mb"] = torch.cuda.memory_reserved(self.dist.device) / 2**20
        self.samples.append(row)
        return out


def summarise(rows: list[dict], key: str, window: int) -> dict:
    steps = np.array([r["step"] for r in rows], dtype=float)
    values = np.array([r[key] for r in rows], dtype=float)
    w = max(1, min(window, len(rows) // 2))
    slope = float(np.polyfit(steps, values, 1)[0] * 100) if len(rows) > 1 else 0.0
    return {"first_mean_mb": float(values[:w].mean()), "last_mean_mb": float(values[-w:].mean()),
            "growth_mb": float(values[-w:].mean() - values[:w].mean()), "slope_mb_per_100_steps": slope,
            "max_mb": float(values.max()), "window_steps": w}


def plot(rows: list[dict], keys: list[str], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows])
        ax.set_xlabel("step")
        ax.set_ylabel(key.replace("_mb", " (MiB)"))
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "cpu_successor.yaml"))
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--window", type=int, default=50, help="steps averaged at the start and at the end")
    p.add_argument("--out", default=None, help="run directory (default runs/soak/<UTC time>/; benchmarks/publish.py "
                   "copies a result to benchmarks/results/)")
    p.add_argument("--run-dir", default="/tmp/hybrid_rl_soak")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. trainer.mode=overlap")
    args = p.parse_args(argv)
    overrides = [f"trainer.total_steps={args.steps}", f"trainer.output_dir={args.run_dir}", "trainer.resume=never",
                 "trainer.logger=[jsonl]", *args.overrides]
    cfg = load_config(args.recipe, overrides)
    dist = init_distributed(cfg.trainer.device)
    try:
        trainer = SoakTrainer(cfg.validate(dist.world_size), dist)
        trainer.samples = []
        trainer.fit()
    finally:
        destroy()
    if dist.rank != 0:
        return 0
    rows = trainer.samples
    device = (f"{gpu_short_name(torch.cuda.get_device_name(dist.device))}x{dist.world_size}"
              if dist.device.type == "cuda" else f"cpux{dist.world_size}")
    model = cfg.model.path.replace("builtin:", "").replace("/", "_")
    keys = ["rss_mb"] + (["gpu_allocated_mb", "gpu_reserved_mb"] if "gpu_allocated_mb" in rows[0] else [])
    result = {"benchmark": "soak", "device": device, "commit": git_commit(), "recipe": Path(args.recipe).name,
              "overrides": args.overrides, "mode": cfg.trainer.mode, "steps": len(rows),
              "summary": {k: summarise(rows, k, args.window) for k in keys}, "rows": rows}
    out = run_dir("soak", args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"soak_{device}_{model}{'_' + cfg.trainer.mode if cfg.trainer.mode != 'sync' else ''}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(rows, keys, f"soak: {model}, {cfg.trainer.mode}, {device}, {len(rows)} steps", stem.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
