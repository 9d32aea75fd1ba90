"""Does a real model learn to use a tool? SmolLM2-135M-Instruct with a calculator on held-out 3-digit multiplication.

Three runs of ``recipes/calc_grpo_smollm2.yaml``, one after the other on the same GPU, same seed and data:

- ``tool``: the recipe (multi-turn: the model may call ``<calculator>...</calculator>`` and read the result);
- ``no_tool``: the same model and problems, single-turn, without the tool or its mention (``env.name=null
  data.system_prompt=null``): the baseline, and the single-turn reference for ``rollout/logprob_diff``;
- ``single_forced``: single-turn generation at the tool run's mean trajectory length (``rollout.forced_lengths``,
  a few steps, no validation), so that sampled tokens/s are compared at the same tokens per sequence.

It writes one JSON and one PNG: held-out greedy accuracy before → after with its standard error sqrt(p(1-p)/n) for
``tool`` and ``no_tool``, the validation curves, per step the tool-call share (``env/called_frac``), faults per call
(``env/error_rate``) and turns, ``rollout/logprob_diff`` multi- against single-turn (mean over the steps, and over
the first ``EARLY`` steps, where both runs still sample at the base model's entropy: the gap grows with entropy, and
a run that has learned its task samples far more surely than one that has not), and
sampled tokens/s of the rollout (``perf/gen_tokens_per_s``: tokens the model sampled ÷ the generate phase, tool calls
included) multi-turn beside single-turn. The target: +50 points on the held-out problems within 200 steps.

    python benchmarks/multiturn.py --out runs/bench_multiturn                 # one GPU, vLLM (~15 minutes)
    python benchmarks/multiturn.py --runs tool --out runs/bench_multiturn    # one run at a time (then the others)
    python benchmarks/multiturn.py --collect runs/bench_multiturn            # summarise finished runs only
    python benchmarks/multiturn.py --cpu-smoke --out runs/bench_multiturn_cpu # the plumbing on CPU (tiny model)

``--cpu-smoke`` runs ``recipes/cpu_lookup_tool.yaml`` the same three ways for a few steps with the transformers
engine: it checks the runs and the summary, not the result. Any further ``key=value`` arguments override the recipe
in every run. A run cut by ``--run-timeout`` keeps what it logged and a checkpoint; the JSON says so, and
``--resume`` with the same ``--out`` goes on with it from there (where one command's time is bounded).
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_common import ROOT, git_commit, kill_tree, parse_runs, read_rows, torch_device_tag  # noqa: E402

GPU_RECIPE = "recipes/calc_grpo_smollm2.yaml"
CPU_RECIPE = "recipes/cpu_lookup_tool.yaml"
RUNS = {
    "tool": [],
    "no_tool": ["env.name=null", "data.system_prompt=null"],
    "single_forced": ["env.name=null", "data.system_prompt=null", "trainer.test_freq=0",
                      "trainer.val_before_train=false"],  # + rollout.forced_lengths=fixed:<tool's mean length>
}
STEP_CURVES = ["reward/mean", "env/called_frac", "env/tool_calls_mean", "env/error_rate", "env/turns_mean",
               "env/observation_tokens_mean", "env/sampled_tokens_mean", "env/stop/answer", "env/stop/max_turns",
               "env/stop/budget", "rollout/response_length_mean", "rollout/logprob_diff", "perf/gen_tokens_per_s",
               "timing/gen", "timing/step"]


def train(name: str, recipe: str, steps: int, out: Path, overrides: list[str], timeout: float, cpu: bool,
          before: dict | None = None) -> dict:
    """One run into ``out/name``; returns how it ended and its wall time. With ``before`` (the record of an earlier
    command's part of this run) the run resumes from the checkpoint that command's stop wrote, and the wall times
    add up."""
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    launch = [] if cpu else ["--nproc", "1"]
    # a checkpoint only at the end or when --run-timeout stops the run, so that a later command can go on from it
    resume = ["trainer.resume=auto"] if before else ["trainer.resume=never"]
    cmd = [sys.executable, "-m", "hybrid_rl", "train", *launch, recipe, f"trainer.output_dir={run_dir}",
           f"trainer.total_steps={steps}", *resume, "trainer.save_freq=0", "trainer.keep_last=1", *RUNS[name],
           *overrides]
    start = time.time()
    with open(run_dir / "train.log", "a" if before else "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the trainer finishes its step and exits
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill_tree(proc)
            rc = "timeout"
    wall = time.time() - start + (before or {}).get("wall_s", 0.0)
    print(json.dumps({"run": name, "rc": rc, "wall_s": round(wall, 1), "log": str(run_dir / "train.log")}), flush=True)
    parts = (before or {}).get("commands", []) + [" ".join(cmd[1:])]
    return {"rc": rc, "wall_s": wall, "command": parts[0], "commands": parts}


EARLY = 4
"""Steps at the start of a run compared for the engine-vs-trainer log-prob gap (before learning moves the entropy)."""


def wilson(p: float | None, n: int, z: float = 1.96) -> list[float] | None:
    """The 95% Wilson score interval of a proportion ``p`` of ``n``: unlike ``se``, not empty at 0 or 1."""
    if p is None or not n:
        return None
    scale = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / scale
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / scale
    return [max(0.0, centre - half), min(1.0, centre + half)]


def planned_steps(command: str) -> int | None:
    """``trainer.total_steps`` of a recorded command (the runs of one JSON may have been asked for different counts)."""
    found = [w.split("=", 1)[1] for w in command.split() if w.startswith("trainer.total_steps=")]
    return int(found[-1]) if found else None


def se(p: float | None, n: int) -> float | None:
    return None if p is None or not n else math.sqrt(max(p * (1 - p), 0.0) / n)


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(run: Path, n_test: int, meta: dict | None) -> dict | None:
    rows = read_rows(run)
    if not rows:
        return None
    steps = [r for r in rows if "reward/mean" in r]
    curve = [{"step": r["step"], "acc": r["val/reward_mean"], "called": r.get("val/env/called_frac"),
              "error_rate": r.get("val/env/error_rate"), "turns": r.get("val/env/turns_mean")}
             for r in rows if "val/reward_mean" in r]
    first, last = (curve[0], curve[-1]) if curve else ({}, {})
    out = {
        "steps_run": max((r["step"] for r in steps), default=0),
        "acc_before": first.get("acc"), "se_before": se(first.get("acc"), n_test),
        "acc_after": last.get("acc"), "se_after": se(last.get("acc"), n_test), "step_after": last.get("step"),
        "ci95_before": wilson(first.get("acc"), n_test), "ci95_after": wilson(last.get("acc"), n_test),
        "logprob_diff_mean": mean([r["rollout/logprob_diff"] for r in steps if "rollout/logprob_diff" in r]),
        "logprob_diff_early": mean([r["rollout/logprob_diff"] for r in steps[:EARLY] if "rollout/logprob_diff" in r]),
        "entropy_early": mean([r["actor/entropy"] for r in steps[:EARLY] if "actor/entropy" in r]),
        "gen_tokens_per_s_median": _median([r["perf/gen_tokens_per_s"] for r in steps[1:]
                                            if "perf/gen_tokens_per_s" in r]),
        "trajectory_tokens_mean": mean([r["rollout/response_length_mean"] for r in steps
                                        if "rollout/response_length_mean" in r]),
        "curve": curve,
        "per_step": [{"step": r["step"], **{k: r[k] for k in STEP_CURVES if k in r}} for r in steps],
    }
    if meta:
        out.update({"run_wall_s": round(meta["wall_s"], 1), "rc": meta["rc"], "command": meta["command"],
                    "steps_planned": planned_steps(meta["command"])})
    return out


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def compare(result: dict) -> dict:
    """The headline figures: the gain in points (with its standard error, the runs' errors combined), the
    log-prob gap ratio multi- ÷ single-turn, and the throughputs side by side."""
    tool, base, forced = (result["runs"].get(k) or {} for k in ("tool", "no_tool", "single_forced"))
    out: dict = {}
    if tool.get("acc_after") is not None and tool.get("acc_before") is not None:
        out["tool_gain_points"] = 100 * (tool["acc_after"] - tool["acc_before"])
        out["tool_gain_se_points"] = 100 * math.sqrt(tool["se_after"] ** 2 + tool["se_before"] ** 2)
    if base.get("acc_after") is not None and tool.get("acc_after") is not None:
        out["tool_vs_no_tool_points"] = 100 * (tool["acc_after"] - base["acc_after"])
        out["tool_vs_no_tool_se_points"] = 100 * math.sqrt(tool["se_after"] ** 2 + base["se_after"] ** 2)
    if tool.get("logprob_diff_mean") and base.get("logprob_diff_mean"):
        out["logprob_diff_multi"] = tool["logprob_diff_mean"]
        out["logprob_diff_single"] = base["logprob_diff_mean"]
        out["logprob_diff_ratio"] = tool["logprob_diff_mean"] / base["logprob_diff_mean"]
    if tool.get("logprob_diff_early") and base.get("logprob_diff_early"):
        out["logprob_diff_early_multi"] = tool["logprob_diff_early"]
        out["logprob_diff_early_single"] = base["logprob_diff_early"]
        out["logprob_diff_early_ratio"] = tool["logprob_diff_early"] / base["logprob_diff_early"]
        out["entropy_early_multi"], out["entropy_early_single"] = tool.get("entropy_early"), base.get("entropy_early")
    out["gen_tokens_per_s_multi"] = tool.get("gen_tokens_per_s_median")
    out["gen_tokens_per_s_single_same_length"] = forced.get("gen_tokens_per_s_median")
    out["gen_tokens_per_s_single_own_length"] = base.get("gen_tokens_per_s_median")
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for name in ("tool", "no_tool"):
        m = result["runs"].get(name)
        if m and m["curve"]:
            axes[0].plot([c["step"] for c in m["curve"]], [100 * c["acc"] for c in m["curve"]], marker="o", label=name)
    tool = result["runs"].get("tool") or {"per_step": []}
    xs = [r["step"] for r in tool["per_step"]]
    for key, label in (("env/called_frac", "trajectories with a call"), ("env/error_rate", "faults per call")):
        axes[1].plot(xs, [r.get(key, float("nan")) for r in tool["per_step"]], label=label)
    axes[1].plot(xs, [r.get("reward/mean", float("nan")) for r in tool["per_step"]], label="training reward")
    c = result["comparison"]
    bars = {"multi-turn": c.get("gen_tokens_per_s_multi"), "single, same length": c.get("gen_tokens_per_s_single_same_length"),
            "single, own length": c.get("gen_tokens_per_s_single_own_length")}
    bars = {k: v for k, v in bars.items() if v}
    axes[2].bar(list(bars), list(bars.values()))
    axes[0].set(xlabel="step", ylabel="held-out greedy accuracy (%)", title="accuracy: with and without the tool")
    axes[1].set(xlabel="step", ylabel="share", title="tool use (training rollouts)")
    axes[2].set(ylabel="sampled tokens/s (median step)", title="rollout throughput")
    for ax in axes[:2]:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['model']} with a calculator, held-out {result['task']} ({result['n_test']} problems), "
                 f"{result['device']}, commit {result['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="training steps of the tool and no-tool runs")
    ap.add_argument("--forced-steps", type=int, default=10, help="steps of the single-turn throughput run")
    ap.add_argument("--out", default="runs/bench_multiturn", help="run directory (one folder per run)")
    ap.add_argument("--collect", metavar="DIR", help="only summarise the finished runs in DIR")
    ap.add_argument("--runs", default=",".join(RUNS),
                    help=f"which runs to train into --out (comma-separated, of {', '.join(RUNS)}; the others are "
                         "summarised if already there): one at a time where a command's time is bounded")
    ap.add_argument("--run-timeout", type=float, default=1200.0, help="seconds per run (per command with --resume)")
    ap.add_argument("--resume", action="store_true",
                    help="go on with runs an earlier command in --out stopped at --run-timeout (from their checkpoint)")
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny model on CPU, a few steps: the plumbing only")
    ap.add_argument("--device", help="device tag for the JSON (default: read from torch)")
    ap.add_argument("--json", help="where to write the JSON (default: OUT/multiturn_<device>.json)")
    ap.add_argument("--commit", help="with --collect: the commit the runs ran at (default: the one checked out here)")
    args, overrides, chosen = parse_runs(ap, RUNS)
    cpu = args.cpu_smoke
    recipe = CPU_RECIPE if cpu else GPU_RECIPE
    steps, forced_steps = (4, 2) if cpu else (args.steps, args.forced_steps)
    if cpu:
        overrides = ["data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
                     "actor.ppo_micro_batch_size_per_device=32", "data.max_val_samples=8", "trainer.test_freq=2",
                     "trainer.logger=[jsonl]", *overrides]
    out = Path(args.collect or args.out)
    meta_path = out / "runs.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if not args.collect:
        out.mkdir(parents=True, exist_ok=True)
        for name in (n for n in ("tool", "no_tool") if n in chosen):
            before = meta.get(name) if args.resume and meta.get(name, {}).get("rc") == "timeout" else None
            meta[name] = train(name, recipe, steps, out, overrides, args.run_timeout, cpu, before)
            meta_path.write_text(json.dumps(meta, indent=1))
        if "single_forced" in chosen:  # at the tool run's mean trajectory length: after it
            tool = summarize(out / "tool", 1, None)
            if tool is None:
                ap.error(f"--runs=single_forced needs the tool run's metrics in {out / 'tool'} first")
            length = max(1, round(tool.get("trajectory_tokens_mean") or 1))
            meta["single_forced"] = train("single_forced", recipe, forced_steps, out,
                                          [*overrides, f"rollout.forced_lengths=fixed:{length}"], args.run_timeout,
                                          cpu)
            meta["_forced_length"] = length
        meta["_device"] = args.device or torch_device_tag()
        meta_path.write_text(json.dumps(meta, indent=1))
    device = args.device or meta.get("_device") or torch_device_tag()
    n_test = 1000 if not cpu else 8
    result = {"benchmark": "multiturn", "model": "builtin:tiny-qwen2-lookup" if cpu else "builtin:smollm2-135m-instruct",
              "recipe": recipe, "task": "lookup" if cpu else "mul3", "device": device,
              "commit": args.commit or git_commit(), "summarised_at": git_commit(),
              "n_test": n_test, "cpu_smoke": cpu,
              "held_out": "data.val_path=synthetic:mul3: 1,000 distinct factor pairs, a tenth of all pairs held out "
                          "of training in either order" if not cpu else "the lookup task's validation rows",
              "settings": {"steps": None if args.collect else steps, "forced_steps": forced_steps,
                           "overrides": "each run's command" if args.collect else overrides,
                           "runs": RUNS, "forced_length": meta.get("_forced_length")},
              "runs": {}}
    for name in RUNS:
        s = summarize(out / name, n_test, meta.get(name))
        if s is not None:
            result["runs"][name] = s
    result["comparison"] = compare(result)
    json_path = Path(args.json) if args.json else out / f"multiturn_{device}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    if result["runs"]:
        plot(result, json_path.with_suffix(".png"))
    print(json.dumps({"benchmark": "multiturn", "device": device, "commit": result["commit"],
                      **result["comparison"]}), flush=True)
    print(f"wrote {json_path}")
    failed = [n for n in chosen if not args.collect and meta.get(n, {}).get("rc") not in (0,)]
    if failed:
        print(f"runs that did not finish: {', '.join(failed)} (see each run's train.log)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
