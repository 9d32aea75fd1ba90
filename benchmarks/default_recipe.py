"""The default recipe (``recipes/cpu_successor.yaml``) on this machine's GPU with vLLM: step time and its phases.

``make train ARGS="trainer.device=auto rollout.name=vllm"`` is the first thing a user with a GPU runs. This script
runs exactly that (one rank, the recipe's 64 prompts x 16 samples of a 2-layer model), once per variant, and reports
the median of every ``timing/*`` phase over the steps after the warm-up:

  current              the recipe as shipped (the engine stays awake between rollouts, ``rollout.free_cache_engine:
                       false``; its KV cache sized to what 256 sequences of 36 tokens take, ``rollout.vllm.
                       fit_kv_cache``; the actor packs micro-batches only where flash-attention's varlen kernel runs,
                       so a float32 model on CUDA runs padded)
  share_pool           as current, with the KV cache filling the engine's share (``rollout.vllm.fit_kv_cache=false``,
                       half of the GPU): millions of blocks for a 2-layer model, which vLLM walks one by one when the
                       prefix cache is reset after each push
  small_share_pool     as share_pool with a tenth of that share (``rollout.vllm.gpu_memory_utilization=0.05``): whether
                       generation's cost follows the number of blocks
  sleep_and_pack       the engine woken and put to sleep every step (``rollout.free_cache_engine=true``) and the
                       float32 actor packed (``actor.use_remove_padding=true``): the settings the two defaults replace

    python benchmarks/default_recipe.py --steps 40 --out runs/bench/default_recipe
    python benchmarks/default_recipe.py --variants current --steps 250       # the recipe's full length

Writes ``default_recipe_<device>.json`` (commit, device, each variant's command, per-step metrics, phase medians) and
a PNG of the phases into ``--out`` (default ``runs/bench/default_recipe_<UTC time>/``). Needs a CUDA GPU and vLLM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import git_commit, torch_device_tag  # noqa: E402

VARIANTS = {
    "current": [],
    "share_pool": ["rollout.vllm.fit_kv_cache=false"],
    "small_share_pool": ["rollout.vllm.fit_kv_cache=false", "rollout.vllm.gpu_memory_utilization=0.05"],
    "sleep_and_pack": ["rollout.free_cache_engine=true", "actor.use_remove_padding=true"],
}
BASE = ["trainer.device=auto", "rollout.name=vllm"]
PHASES = ("gen", "switch", "sync_weights", "reward", "old_log_prob", "ref", "adv", "update", "other")


def run_variant(name: str, args, out: Path) -> dict:
    run_dir = out / f"run_{name}"
    cmd = [sys.executable, "-m", "hybrid_rl", "train", "--nproc", "1", str(ROOT / "recipes" / "cpu_successor.yaml"),
           *BASE, *VARIANTS[name], f"trainer.total_steps={args.steps}", f"trainer.output_dir={run_dir}",
           "trainer.resume=never", *args.overrides]
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] if rc == 0 else []
    steps = [r for r in rows if "timing/step" in r]
    measured = steps[args.warmup:]
    if rc != 0 or not measured:
        return dict(variant=name, overrides=VARIANTS[name], returncode=rc, error=f"see {out / (name + '.log')}")
    med = lambda key: statistics.median(r.get(key, 0.0) for r in measured)
    return dict(
        variant=name, overrides=VARIANTS[name], command=" ".join(cmd[1:]), returncode=rc, wall_s=wall,
        steps=len(steps), steps_measured=len(measured), step_s_median=med("timing/step"),
        iteration_s_median=med("timing/iteration"), step_s_mean=statistics.fmean(r["timing/step"] for r in measured),
        phases_s_median={p: med(f"timing/{p}") for p in PHASES if any(f"timing/{p}" in r for r in measured)},
        reward_first=steps[0].get("reward/mean"), reward_last=steps[-1].get("reward/mean"),
        val=[{k: r[k] for k in ("step", "val/reward_mean") if k in r} for r in rows if "val/reward_mean" in r],
        per_step=steps)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "phases_s_median" in r]
    if not ok:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, r in enumerate(ok):
        left = 0.0
        for p in ("gen", "switch", "reward", "old_log_prob", "adv", "update", "other"):
            v = r["phases_s_median"].get(p, 0.0)
            ax.barh(i, v, left=left, color=f"C{PHASES.index(p) % 10}", label=p if i == 0 else None)
            left += v
    ax.set_yticks(range(len(ok)), [r["variant"] for r in ok])
    ax.set_xlabel("seconds per step (median phases)")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before one variant's run is stopped")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every variant")
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        print(f"error: --variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    out = Path(args.out or ROOT / "runs" / "bench" / time.strftime("default_recipe_%Y%m%dT%H%M%SZ", time.gmtime()))
    out.mkdir(parents=True, exist_ok=True)
    device = torch_device_tag(cpu="CPU")
    results = []
    for name in names:
        res = run_variant(name, args, out)
        results.append(res)
        line = {k: res.get(k) for k in ("variant", "step_s_median", "phases_s_median", "reward_last", "error")}
        print(json.dumps(line), flush=True)
        doc = dict(bench="default_recipe", device=device, commit=git_commit(ROOT), recipe="recipes/cpu_successor.yaml",
                   base_overrides=BASE, steps=args.steps, warmup=args.warmup, overrides=args.overrides,
                   variants=results)
        (out / f"default_recipe_{device}.json").write_text(json.dumps(doc, indent=1) + "\n")
        plot(results, out / f"default_recipe_{device}.png")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
