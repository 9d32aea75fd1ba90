"""Does the asynchronous agent loop pay? ``env.scheduler=turns`` against ``async`` on the tool-use recipe.

``recipes/calc_grpo_smollm2.yaml`` (SmolLM2-135M-Instruct learning to call a calculator, vLLM, one GPU) trained
for ``--steps`` steps four ways, one after the other on the same GPU, same seed and data, validation off:

- ``turns`` / ``async``: the recipe's calculator, which answers at once: what is left to gain is the turns that
  finish early waiting for the longest turn of their round;
- ``turns_latency`` / ``async_latency``: every call also takes a simulated remote latency (``agent_latency.py``:
  lognormal, mean ``--latency`` seconds, σ 1; the same draws slot by slot in both runs), with ``env.workers``
  (``--workers``) threads enough for every trajectory to wait on its own call, as a search or sandbox service's
  client would.

Per run: the median over steps past the first ``SKIP`` of ``timing/gen`` (the rollout: every trajectory's turns
and tool calls), ``timing/step`` and ``timing/iteration``, the mean turns, tool calls and training reward, and every
step's figures. The comparison: turns' median rollout time ÷ async's, with and without latency. The runs train, so
each run's model and trajectories move apart as it learns; the per-step turns and calls are in the JSON beside the
times.

    python benchmarks/agent_loop.py --out runs/bench_agent_loop                    # one GPU, vLLM (~12 minutes)
    python benchmarks/agent_loop.py --runs turns,async --out runs/bench_agent_loop # some of the runs
    python benchmarks/agent_loop.py --collect runs/bench_agent_loop               # summarise the runs in a folder
    python benchmarks/agent_loop.py --cpu-smoke --out runs/bench_agent_loop_cpu    # the plumbing on CPU

``--cpu-smoke`` runs ``recipes/cpu_lookup_tool.yaml`` the four ways for a few steps with the transformers engine
(its stream batches what is queued) and a short latency: it checks the runs and the summary, not the result. Further
``key=value`` arguments override the recipe in every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_common import ROOT, git_commit, kill_tree, parse_runs, read_rows, torch_device_tag  # noqa: E402

GPU_RECIPE = "recipes/calc_grpo_smollm2.yaml"
CPU_RECIPE = "recipes/cpu_lookup_tool.yaml"
LATENCY = ["env.name=tools_latency", "trainer.imports=[benchmarks/agent_latency.py]"]
RUNS = {
    "turns": ["env.scheduler=turns"],
    "async": ["env.scheduler=async"],
    "turns_latency": ["env.scheduler=turns", *LATENCY],
    "async_latency": ["env.scheduler=async", *LATENCY],
}
COMMON = ["trainer.test_freq=0", "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.resume=never",
          "trainer.logger=[jsonl]"]
SKIP = 2
"""Steps at the start of a run left out of the medians (the engine's first batches, compilation)."""
STEP_KEYS = ["timing/gen", "timing/step", "timing/iteration", "env/turns_mean", "env/tool_calls_mean",
             "env/called_frac", "env/error_rate", "env/stop/timeout", "reward/mean", "perf/gen_tokens_per_s",
             "rollout/response_length_mean"]


def train(name: str, recipe: str, steps: int, out: Path, overrides: list[str], latency: float, workers: int,
          timeout: float, cpu: bool) -> dict:
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    # the latency runs: a thread per waiting call (the others keep the recipe's env.workers)
    threads = [f"env.workers={workers}"] if name.endswith("_latency") else []
    cmd = [sys.executable, "-m", "hybrid_rl", "train", *([] if cpu else ["--nproc", "1"]), recipe,
           f"trainer.output_dir={run_dir}", f"trainer.total_steps={steps}", *COMMON, *RUNS[name], *threads,
           *overrides]
    env = dict(os.environ, HYBRID_RL_TOOL_LATENCY_MEAN_S=str(latency))
    start = time.time()
    with open(run_dir / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            rc = "timeout"
    wall = time.time() - start
    print(json.dumps({"run": name, "rc": rc, "wall_s": round(wall, 1), "log": str(run_dir / "train.log")}), flush=True)
    return {"rc": rc, "wall_s": round(wall, 1), "command": " ".join(cmd[1:]), "steps": steps,
            "latency_mean_s": latency if name.endswith("_latency") else None}


def summarize(run: Path, meta: dict | None) -> dict | None:
    rows = [r for r in read_rows(run) if "timing/gen" in r]
    if not rows:
        return None
    later = rows[SKIP:] or rows

    def median(key: str) -> float | None:
        values = [r[key] for r in later if key in r]
        return statistics.median(values) if values else None

    def mean(key: str) -> float | None:
        values = [r[key] for r in later if key in r]
        return statistics.fmean(values) if values else None

    out = {"steps_run": max(r["step"] for r in rows), "steps_in_medians": len(later),
           "gen_s_median": median("timing/gen"), "step_s_median": median("timing/step"),
           "iteration_s_median": median("timing/iteration"), "turns_mean": mean("env/turns_mean"),
           "tool_calls_mean": mean("env/tool_calls_mean"), "reward_mean": mean("reward/mean"),
           "gen_tokens_per_s_median": median("perf/gen_tokens_per_s"),
           "per_step": [{"step": r["step"], **{k: r[k] for k in STEP_KEYS if k in r}} for r in rows]}
    if meta:
        planned = [w.split("=", 1)[1] for w in meta["command"].split() if w.startswith("trainer.total_steps=")]
        out.update({"rc": meta["rc"], "run_wall_s": meta["wall_s"], "command": meta["command"],
                    "steps_planned": int(planned[-1]) if planned else None})
    return out


def compare(runs: dict) -> dict:
    out = {}
    for tag, (a, b) in {"instant": ("turns", "async"), "latency": ("turns_latency", "async_latency")}.items():
        ta, tb = runs.get(a) or {}, runs.get(b) or {}
        if ta.get("gen_s_median") and tb.get("gen_s_median"):
            out[f"gen_speedup_{tag}"] = ta["gen_s_median"] / tb["gen_s_median"]
            out[f"step_speedup_{tag}"] = ta["step_s_median"] / tb["step_s_median"]
            # step by step, over the steps both ran (each ratio at the same step number)
            ga = {r["step"]: r["timing/gen"] for r in ta["per_step"][SKIP:]}
            gb = {r["step"]: r["timing/gen"] for r in tb["per_step"][SKIP:]}
            both = sorted(set(ga) & set(gb))
            if both:
                out[f"gen_speedup_{tag}_stepwise_median"] = statistics.median(ga[s] / gb[s] for s in both)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    for name, m in result["runs"].items():
        xs = [r["step"] for r in m["per_step"]]
        style = "-" if name.startswith("async") else "--"
        axes[0].plot(xs, [r["timing/gen"] for r in m["per_step"]], style, marker="o", ms=3, label=name)
        axes[1].plot(xs, [r.get("env/tool_calls_mean", float("nan")) for r in m["per_step"]], style, label=name)
    axes[0].set(xlabel="step", ylabel="rollout seconds (timing/gen)", title="rollout time per step")
    axes[1].set(xlabel="step", ylabel="tool calls per trajectory", title="tool use")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    s = result["settings"]
    fig.suptitle(f"env.scheduler turns vs async, {result['recipe']}, latency mean {s['latency_mean_s']} s, "
                 f"{result['device']}, commit {result['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="training steps per run")
    ap.add_argument("--latency", type=float, default=0.5, help="mean simulated latency of a tool call (seconds)")
    ap.add_argument("--workers", type=int, default=512,
                    help="env.workers of the latency runs: threads for the environments' steps")
    ap.add_argument("--out", default="runs/bench_agent_loop", help="run directory (one folder per run)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny model on CPU, a few steps: the plumbing only")
    ap.add_argument("--json", help="where to write the JSON (default: OUT/agent_loop_<device>.json)")
    ap.add_argument("--collect", metavar="DIR", help="only summarise the runs in DIR (one command's or several's)")
    ap.add_argument("--device", help="with --collect: the device the runs ran on (default: read from torch)")
    ap.add_argument("--commit", help="with --collect: the commit the runs ran at (default: the one checked out here)")
    args, overrides, chosen = parse_runs(ap, RUNS)
    cpu = args.cpu_smoke
    recipe = CPU_RECIPE if cpu else GPU_RECIPE
    steps, latency = (3, 0.05) if cpu else (args.steps, args.latency)
    if cpu:
        overrides = ["data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
                     "actor.ppo_micro_batch_size_per_device=32", *overrides]
    out = Path(args.collect or args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "runs.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    for name in [] if args.collect else chosen:
        meta[name] = train(name, recipe, steps, out, overrides, latency, args.workers, args.run_timeout, cpu)
        meta_path.write_text(json.dumps(meta, indent=1))
    device = args.device or torch_device_tag()
    result = {"benchmark": "agent_loop", "recipe": recipe, "device": device, "commit": args.commit or git_commit(),
              "summarised_at": git_commit(), "cpu_smoke": cpu,
              "settings": {"steps": "each run's steps_planned" if args.collect else steps, "latency_mean_s": latency,
                           "latency_sigma": 1.0, "skip_steps": SKIP,
                           "latency_runs_env_workers": args.workers,
                           "overrides": overrides, "common": COMMON, "runs": RUNS},
              "runs": {}}
    for name in RUNS:
        s = summarize(out / name, meta.get(name))
        if s is not None:
            result["runs"][name] = s
    result["comparison"] = compare(result["runs"])
    json_path = Path(args.json) if args.json else out / f"agent_loop_{device}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    if result["runs"]:
        plot(result, json_path.with_suffix(".png"))
    print(json.dumps({"benchmark": "agent_loop", "device": device, "commit": result["commit"],
                      **{n: {k: m.get(k) for k in ("gen_s_median", "step_s_median", "turns_mean", "tool_calls_mean")}
                         for n, m in result["runs"].items()}, **result["comparison"]}), flush=True)
    print(f"wrote {json_path}")
    failed = [n for n in ([] if args.collect else chosen) if meta.get(n, {}).get("rc") != 0]
    if failed:
        print(f"runs that did not finish: {', '.join(failed)} (see each run's train.log)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
