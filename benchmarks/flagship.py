"""The flagship recipe's step, commit against commit: per-phase times and MFU from each run's metrics.jsonl.

Run the recipe once per commit to compare (each from its own export, the same overrides: GSM8K prompts,
``builtin:qwen2.5-1.5b-random``, forced ``lognormal:250:0.8`` responses), then summarise the run directories:

    python benchmarks/flagship.py --run cba16b7=/tmp/res/old --run new=/tmp/res/new --device H100x1 --out-dir DIR

The first step (CUDA graphs, compilation, allocator warm-up) is dropped. MFU is recomputed from each step's token
counts with ``hybrid_rl.telemetry.perf.ModelFlops`` for every run alike (old commits do not log it): the model's forward
FLOPs over the batch's mean prompt and response lengths, ×3 for the update, ×1 for each log-prob pass, divided by
the phase's time and the device's dense bf16 peak. Writes ``flagship_<device>.json`` and a stacked-bar plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "benchmarks"))

from bench_common import git_commit, run_dir  # noqa: E402
from hybrid_rl.telemetry.perf import PEAK_TFLOPS_BF16, UPDATE_FORWARDS, ModelFlops  # noqa: E402

PHASES = ["gen", "switch", "reward", "old_log_prob", "ref", "adv", "update"]


def model_flops(model: str) -> ModelFlops:
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybrid_rl.models import resolve_model_path

    cfg = AutoConfig.from_pretrained(resolve_model_path(model))
    with torch.device("meta"):
        return ModelFlops.of(AutoModelForCausalLM.from_config(cfg))


def summarise(run_dir: Path, flops: ModelFlops, peak: float, gpus: int, skip: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step" in r][skip:]
    if not rows:
        return {"error": f"no step after the first {skip} in {run_dir}/metrics.jsonl"}
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in rows)  # noqa: E731
    out = {"steps": len(rows), "step_s": mean("timing/step"), "step_s_all": [r["timing/step"] for r in rows],
           "phases_s": {p: mean(f"timing/{p}") for p in PHASES if any(f"timing/{p}" in r for r in rows)}}
    if any("timing/other" in r for r in rows):
        # the trainer's own figure: step minus its named phases on each rank, before the max over ranks (a sum of
        # per-phase maxima over ranks exceeds the step when ranks are slow in different phases)
        out["untimed_s"] = mean("timing/other")
    else:  # older commits log no timing/other
        out["untimed_s"] = out["step_s"] - sum(v for k, v in out["phases_s"].items())
    out["untimed_share"] = out["untimed_s"] / out["step_s"]
    # the batch: every sequence is one prompt + one response (means over the global batch)
    total = mean("perf/tokens_per_s") * out["step_s"]
    resp_mean, prompt_mean = mean("rollout/response_length_mean"), mean("rollout/prompt_length_mean")
    seqs = total / (resp_mean + prompt_mean)
    lengths = torch.full((max(1, round(seqs)),), resp_mean + prompt_mean)
    fwd = flops.forward(lengths, resp_mean * seqs)  # equal lengths: attention slightly under the long-tailed truth
    out.update(tokens_per_step=total, sequences=seqs, response_length_mean=resp_mean, prompt_length_mean=prompt_mean,
               forward_flops=fwd)
    # the old-log-prob pass leaves out the update's first mini-batch under actor.old_log_prob=auto (older commits: 0)
    lp_share = 1.0 - (mean("actor/old_log_prob_skipped") if any("actor/old_log_prob_skipped" in r for r in rows) else 0.0)
    for name, phase, passes in (("mfu_update", "update", UPDATE_FORWARDS), ("mfu_log_prob", "old_log_prob", lp_share),
                                ("mfu_ref", "ref", 1)):
        t = out["phases_s"].get(phase)
        if t:
            out[name] = passes * fwd / (t * gpus * peak)
    if any("perf/mfu_update_equiv" in r for r in rows):
        # the trainer logs both: perf/mfu_* from the FLOPs the passes ran (a shared prompt once per group), and
        # perf/mfu_*_equiv with every sequence counted whole (what the estimate above gives)
        for name in ("mfu_update", "mfu_log_prob", "mfu_ref"):
            if any(f"perf/{name}" in r for r in rows):
                out[f"{name}_equiv"] = mean(f"perf/{name}_equiv")
                out[name] = mean(f"perf/{name}")
    else:  # runs of older commits logged only the batch-equivalent figure
        for name in ("mfu_update", "mfu_log_prob", "mfu_ref"):
            if name in out:
                out[f"{name}_equiv"] = out.pop(name)
    out["peak_memory_allocated_gb"] = max(r.get("perf/max_memory_allocated_gb", 0.0) for r in rows)
    if any("perf/engine_pool_gb" in r for r in rows):  # the figure above counts vLLM's sleeping pool too
        out["peak_memory_outside_engine_gb"] = max(r["perf/max_memory_allocated_outside_engine_gb"] for r in rows)
    return out


def plot(doc: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    runs = [(k, v) for k, v in doc["runs"].items() if "step_s" in v]
    fig, ax = plt.subplots(figsize=(9, 1.8 + 0.6 * len(runs)))
    labelled, right = set(), 0.0
    for i, (name, r) in enumerate(runs):
        left = 0.0  # phases are per-rank maxima: their sum can exceed the step (the label gives the step)
        for p in PHASES + ["untimed"]:
            w = r["untimed_s"] if p == "untimed" else r["phases_s"].get(p, 0.0)
            if w <= 0:
                continue
            ax.barh(i, w, left=left, color=plt.cm.tab10(PHASES.index(p) if p in PHASES else 9),
                    label=None if p in labelled else p)
            labelled.add(p)
            left += w
        mfu = f", update MFU {r['mfu_update']:.0%}" if "mfu_update" in r else ""
        ax.text(left, i, f" {r['step_s']:.1f} s{mfu}", va="center", fontsize=8)
        right = max(right, left)
    ax.set_xlim(0, right * 1.6)
    ax.set_yticks(range(len(runs)), [k for k, _ in runs])
    ax.set_xlabel("seconds per step (mean after the first; bars: per-phase maxima over ranks)")
    ax.set_title(f"flagship recipe on {doc['device']}: {doc['model']}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), fontsize=7, ncol=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, metavar="NAME=DIR", help="a run directory, by name")
    ap.add_argument("--device", required=True, help="e.g. H100x1 (GPU name x count)")
    ap.add_argument("--model", default="builtin:qwen2.5-1.5b-random")
    ap.add_argument("--skip", type=int, default=1, help="steps dropped at the start")
    ap.add_argument("--settings", default="", help="the overrides both runs used (recorded)")
    ap.add_argument("--out-dir", default=None, help="run directory (default runs/flagship/<UTC time>/; "
                    "benchmarks/publish.py copies a result to benchmarks/results/)")
    args = ap.parse_args()
    name, _, count = args.device.partition("x")
    peak = next(v for k, v in sorted(PEAK_TFLOPS_BF16.items(), key=lambda kv: -len(kv[0])) if k in name) * 1e12
    flops = model_flops(args.model)
    runs = {}
    for spec in args.run:
        key, _, d = spec.partition("=")
        runs[key] = summarise(Path(d), flops, peak, int(count or 1), args.skip)
        print(json.dumps({"run": key, **{k: v for k, v in runs[key].items() if k != "step_s_all"}}), flush=True)
    first = next((v for v in runs.values() if "step_s" in v), None)
    for v in runs.values():
        if first and "step_s" in v:
            v["speedup_vs_first"] = first["step_s"] / v["step_s"]
    doc = {"bench": "flagship", "device": args.device, "commit": git_commit(), "model": args.model,
           "settings": args.settings,
           "skip_first_steps": args.skip, "runs": runs}
    out = run_dir("flagship", args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    Path(out / f"flagship_{args.device}.json").write_text(json.dumps(doc, indent=2))
    plot(doc, out / f"flagship_{args.device}.png")
    print(f"wrote {out}/flagship_{args.device}.json and .png", file=sys.stderr)


if __name__ == "__main__":
    main()
