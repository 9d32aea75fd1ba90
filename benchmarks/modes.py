"""Sync vs one-step-overlap: the same recipe, seed and step count in each mode, measured end to end.

Runs the real trainer (``python -m hybrid_rl train`` under torchrun) once per
mode, samples GPU utilisation with ``nvidia-smi`` while it runs, drops warm-up
steps, and reports per mode: step time and its phase breakdown, generated and
trained tokens/s, GPU busy fraction, peak memory, and ``speedup_vs_sync``.
Modes: ``sync`` (colocated), ``overlap_colocated`` and, on 2+ GPUs,
``overlap_split`` (half the ranks generate, half train; ``trainer.placement=split``), and with
``--rollout-ranks R`` also ``overlap_split_r<R>`` (R ranks generate, the rest train).
Writes ``benchmarks/results/modes_<device>_<model>.json`` (rewritten after every
mode, so a run cut short keeps what finished) and a PNG beside it, and prints
one JSON line per mode.

    python benchmarks/modes.py --model builtin:qwen2.5-0.5b-random --gpus 1 --steps 8
    python benchmarks/modes.py --cpu-smoke            # tiny model on CPU, checks the plumbing

Random-init models never stop on their own, so response lengths are imposed
from a long-tailed distribution (``rollout.forced_lengths``). Random-init
models earn no reward on GSM8K, so "matched reward curves" cannot be shown
here; the CPU tests show that each mode learns and that split 1+1 equals
colocated exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["gen", "wait_gen", "sync_weights", "reward", "old_log_prob", "ref", "adv", "update"]


def device_name(gpus: int) -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    if not out:
        return "CPU"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import gpu_short_name

    return f"{gpu_short_name(out[0])}x{gpus}"


def commit() -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import git_commit

    return git_commit(ROOT)


class GpuSampler(threading.Thread):
    """Mean GPU utilisation (nvidia-smi, every 0.25 s) while a run is going."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[float] = []
        self.stop = threading.Event()
        self.active = False
        """Samples count only while set: from the end of the warm-up steps to the last step (no init, no teardown)."""

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                ids = os.environ.get("CUDA_VISIBLE_DEVICES")
                cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
                out = subprocess.run(cmd + ([f"--id={ids}"] if ids else []), capture_output=True, text=True,
                                     timeout=5).stdout.split()
                if out and self.active:
                    self.samples.append(sum(float(x) for x in out) / len(out) / 100.0)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                return
            self.stop.wait(0.25)


def _steps_logged(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if '"timing/step"' in line)
    except OSError:
        return 0


def _process_tree(root: int) -> list[int]:
    """``root`` and every process below it, by the parent links in /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _dump_rank_stacks(proc: subprocess.Popen, wait_s: float = 3.0) -> int:
    """SIGUSR1 to the training processes below torchrun (``hybrid_rl`` in their command line; not torchrun itself,
    which the signal would end, nor the engine or reward processes they spawned): each prints every thread's stack
    into the run's log (``watchdog.dump_stacks_on_signal``), even a rank stuck in C with the GIL held. Returns how
    many were signalled."""
    ranks = []
    for pid in _process_tree(proc.pid)[1:]:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hybrid_rl" in cmdline and b"train" in cmdline:
            ranks.append(pid)
    for pid in ranks:
        _signal(pid, signal.SIGUSR1)
    if ranks:
        time.sleep(wait_s)
    return len(ranks)


def _kill(proc: subprocess.Popen) -> None:
    """torchrun and every process it started, and nothing else (other runs on the machine are left alone).

    Workers sit in their own process groups, so killpg alone misses them: the tree is found by parent links
    and stopped first, so that nothing forks a child while it is being collected, then killed.
    """
    stopped: set[int] = set()
    for _ in range(5):
        new = [pid for pid in _process_tree(proc.pid) if pid not in stopped]
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped.update(new)
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    time.sleep(3)  # let the driver release the GPU memory


def run_mode(name: str, overrides: list[str], args, out_dir: Path) -> dict:
    run_dir = out_dir / f"run_{name}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}", "-m", "hybrid_rl",
           "train", str(args.recipe), f"model.path={args.model}", f"trainer.output_dir={run_dir}",
           f"trainer.total_steps={args.steps}", "trainer.logger=[jsonl]", *args.overrides, *overrides]
    sampler = GpuSampler()
    sampler.start()
    start = time.perf_counter()
    shutil.rmtree(run_dir, ignore_errors=True)  # a stale metrics.jsonl would end the wait at once
    run_dir.mkdir(parents=True, exist_ok=True)
    # own session, so a timeout kills torchrun *and* its workers (a survivor would hold the GPU for the next mode)
    log = (run_dir / "stderr.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    # the sweep (modes_sweep.py) stops a run once its measured steps are logged, before the last step, which
    # generates nothing ahead in overlap mode and so is no steady-state step
    target = getattr(args, "stop_after", None) or args.steps
    grace = 15 if target >= args.steps else 0
    done_at = None
    # a run that logs no step for stall_timeout s (since its start, or its last step) is hung, not slow: stop it
    # rather than let it use up the rest of the budget (modes_sweep.py sets it from its estimates)
    stall = getattr(args, "stall_timeout", None)
    progress_at, seen, stalled = 0.0, 0, False
    while proc.poll() is None:
        time.sleep(1.0 if grace else 0.25)
        elapsed = time.perf_counter() - start
        logged = _steps_logged(metrics) if metrics.exists() else 0
        if logged > seen:
            progress_at, seen = elapsed, logged
        sampler.active = args.warmup <= logged < target
        if done_at is None and logged >= target:
            done_at = elapsed  # every step is logged: the rest is teardown, which gets a short grace period
        stalled = bool(stall) and done_at is None and elapsed - progress_at > stall
        if (done_at is not None and elapsed - done_at >= grace) or (args.mode_timeout and elapsed > args.mode_timeout) \
                or stalled:
            if done_at is None:  # hung or out of time: where each rank is, before it goes
                _dump_rank_stacks(proc)
            _kill(proc)
            break
    wall = (done_at if done_at is not None else time.perf_counter() - start)
    sampler.stop.set()
    log.close()
    stderr = (run_dir / "stderr.log").read_text(errors="replace")
    if done_at is None and stalled:
        return {"mode": name, "overrides": overrides, "stderr_tail": stderr[-3000:],
                "error": f"stalled: no step logged for {stall:.0f} s (step {seen + 1} of {target} did not come)"}
    if done_at is None and proc.returncode != 0:
        if args.mode_timeout and time.perf_counter() - start > args.mode_timeout:
            return {"mode": name, "overrides": overrides, "error": f"timed out after {args.mode_timeout} s",
                    "stderr_tail": stderr[-3000:]}
        print(f"{name} failed:\n{stderr[-4000:]}", file=sys.stderr)
        return {"mode": name, "overrides": overrides, "error": f"exit {proc.returncode}", "stderr_tail": stderr[-3000:]}
    busy = statistics.fmean(sampler.samples) if sampler.samples else None
    return summarize(name, overrides, run_dir, args, wall, busy)


def step_time(row: dict) -> float:
    """A logged step's wall time: ``timing/iteration``, the loop's cadence, which also holds any wait after the
    step (before it existed, split placement's trainer ranks waited for the rollout ranks' generation in the stop
    check after ``timing/step``, which then read ~half the real step); ``timing/step`` for older runs."""
    return row.get("timing/iteration", row["timing/step"])


def summarize(name: str, overrides: list[str], run_dir: Path, args, wall: float | None, busy: float | None) -> dict:
    """One mode's figures from its ``metrics.jsonl`` (warm-up steps dropped)."""
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step" in r][args.warmup:getattr(args, "stop_after", None) or None]
    mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in rows)
    step_s = statistics.fmean(map(step_time, rows))
    # every rank's response/total tokens per step, recovered from the logged throughputs
    gen_tokens = mean("rollout/response_length_mean") * args.prompts * args.n
    total_tokens = statistics.fmean(r["perf/tokens_per_s"] * r["timing/step"] for r in rows)
    extra = {}
    if any("rollout/logprob_diff" in r for r in rows):  # engine vs trainer log-probs (an fp8 KV cache, stale keys)
        extra["logprob_diff"] = mean("rollout/logprob_diff")
    context = sum(r.get("rollout/partial_context_tokens", 0.0) for r in rows)
    if context:  # partial rollouts: the rounds' context read from vLLM's prefix cache (rollout.reuse_stale_kv)
        extra["prefix_cache_hit"] = sum(r.get("rollout/partial_cached_tokens", 0.0) for r in rows) / context
    return {
        "mode": name,
        "overrides": overrides,
        "steps_measured": len(rows),
        "step_s": step_s,
        "trainer_step_s": mean("timing/step"),
        "phases_s": {p: mean(f"timing/{p}") for p in PHASES if any(f"timing/{p}" in r for r in rows)},
        "gen_tokens_per_s": gen_tokens / step_s,
        "trained_tokens_per_s": total_tokens / step_s,
        "engine_gen_tokens_per_s": mean("perf/gen_tokens_per_s"),
        "gpu_busy_fraction": busy,
        "peak_memory_allocated_gb": max((r.get("perf/max_memory_allocated_gb", 0.0) for r in rows), default=0.0),
        "peak_memory_reserved_gb": max((r.get("perf/max_memory_reserved_gb", 0.0) for r in rows), default=0.0),
        "reward_mean": mean("reward/mean"),
        "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in rows),
        "response_length_mean": mean("rollout/response_length_mean"),
        "wall_s": wall,
        **extra,
    }


def plot(results: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["mode"] for r in results]
    bottom = [0.0] * len(results)
    for phase in PHASES:
        vals = [r["phases_s"].get(phase, 0.0) for r in results]
        if any(vals):
            ax1.bar(names, vals, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.plot(names, [r["step_s"] for r in results], "k_", markersize=40, label="step (wall)")
    ax1.set_ylabel("seconds per step")
    ax1.set_title("phase time (overlap: gen runs beside the update)")
    ax1.legend(fontsize=7)
    ax2.bar(names, [r["trained_tokens_per_s"] for r in results], color="tab:green")
    for i, r in enumerate(results):
        if r.get("speedup_vs_sync") is not None:
            ax2.text(i, r["trained_tokens_per_s"], f'{r["speedup_vs_sync"]:.2f}x', ha="center", va="bottom")
    ax2.set_ylabel("trained tokens / s")
    ax2.set_title("throughput")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


STREAM_MODE = ("overlap_stream", ["trainer.mode=overlap", "trainer.max_staleness=1", "rollout.cuda_stream=high"])
"""Overlap colocated with generation on a CUDA stream of its own at high priority (``rollout.cuda_stream``): with the
default ``shared`` the engine's kernels queue on the trainer's stream and the two sides never run at once. Run only
when named in ``--modes``."""
PROC_MODE = ("overlap_proc", ["trainer.mode=overlap", "trainer.max_staleness=1", "rollout.engine_process=true"])
"""Overlap colocated with vLLM's engine core in a process of its own (``rollout.engine_process``): generation no longer
runs in a thread of the trainer's interpreter. Run only when named in ``--modes``."""
EXTRA_MODES = (STREAM_MODE, PROC_MODE)


def build_modes(world: int, rollout_ranks: str = "") -> list[tuple[str, list[str]]]:
    """(name, overrides) of each mode on ``world`` ranks; ``rollout_ranks`` ("1,3") adds split ratios."""
    overlap = ["trainer.mode=overlap", "trainer.max_staleness=1"]
    modes = [("sync", ["trainer.mode=sync"]), ("overlap_colocated", overlap)]
    if world >= 2:
        modes.append(("overlap_split", [*overlap, "trainer.placement=split"]))  # half the ranks generate
    try:
        extra = {int(x) for x in rollout_ranks.split(",") if x.strip()}
    except ValueError:
        raise SystemExit(f"--rollout-ranks={rollout_ranks!r}: give comma-separated integers, e.g. 1,3") from None
    for r in sorted(extra - {world // 2}):
        if not 1 <= r < world:
            raise SystemExit(f"--rollout-ranks: {r} rollout ranks must be in 1..{world - 1} on {world} GPUs")
        modes.append((f"overlap_split_r{r}", [*overlap, "trainer.placement=split", f"trainer.rollout_ranks={r}"]))
    return modes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:qwen2.5-0.5b-random")
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "bench_modes.yaml"))
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64, help="data.train_batch_size (all ranks)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: checks the plumbing only")
    ap.add_argument("--modes", default="", help="comma-separated subset of sync,overlap_colocated,overlap_split "
                    "(default: those), overlap_stream, overlap_proc (only when named)")
    ap.add_argument("--mode-timeout", type=float, default=None, help="seconds before one mode's run is abandoned")
    ap.add_argument("--device", default="", help="with --from-runs: the device name the runs were made on (e.g. H200x1)")
    ap.add_argument("--from-runs", action="store_true",
                    help="do not run: rebuild the JSON/PNG from the run directories already under --out (e.g. a run whose "
                         "teardown was cut off after every step was logged); GPU busy fraction is kept from the old JSON")
    ap.add_argument("--rollout-ranks", default="", help="comma-separated rollout rank counts for more split modes "
                    "(overlap_split_r<R>), e.g. 1 on 4 GPUs for 1 rollout + 3 trainer ranks")
    ap.add_argument("--tag", default="", help="suffix for the result files, e.g. _tuned for a run with other overrides")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every mode")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.model, args.gpus, args.steps, args.warmup, args.prompts, args.n = "builtin:tiny-qwen2", 2, 4, 1, 8, 4
        args.overrides += ["trainer.device=cpu", "data.max_response_length=32", "rollout.forced_lengths=lognormal:12:0.8",
                           "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_device=8"]
    args.overrides += [f"data.train_batch_size={args.prompts}", f"rollout.n={args.n}"]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = device_name(args.gpus) if not args.cpu_smoke else "CPU"
    model_tag = args.model.split(":")[-1].split("/")[-1]
    modes = build_modes(2 if args.cpu_smoke else args.gpus, args.rollout_ranks)
    if args.modes:
        wanted = args.modes.split(",")
        modes = [m for m in [*modes, *EXTRA_MODES] if m[0] in wanted]
    if args.from_runs:
        device = args.device or device
    stem = out_dir / f"modes_{device}_{model_tag}{args.tag}"
    if args.from_runs:
        rebuild(modes, args, device, stem, out_dir / f"modes_{device}_{model_tag}{args.tag}_runs")
        return
    # a subset run (--modes) keeps the other modes' figures already in the JSON, so modes can run in separate calls
    kept = []
    if args.modes and Path(f"{stem}.json").exists():
        kept = [m for m in json.loads(Path(f"{stem}.json").read_text())["modes"] if m["mode"] not in args.modes.split(",")]
    results = []
    for name, overrides in modes:
        results.append(run_mode(name, overrides, args, out_dir / f"modes_{device}_{model_tag}{args.tag}_runs"))
        write_results(_in_order(kept + results), args, device, stem)
        print(json.dumps({"device": device, "commit": commit(), "model": args.model, **results[-1]}), flush=True)
    print(f"wrote {stem}.json and .png", file=sys.stderr)


def _in_order(results: list[dict]) -> list[dict]:
    order = {name: i for i, name in enumerate(["sync", "overlap_colocated", "overlap_split"])}
    return sorted(results, key=lambda r: (order.get(r["mode"], len(order)), r["mode"]))


def rebuild(modes, args, device: str, stem: Path, runs: Path) -> None:
    old = {}
    if Path(f"{stem}.json").exists():
        old = {m["mode"]: m for m in json.loads(Path(f"{stem}.json").read_text())["modes"]}
    results = []
    for name, overrides in modes:
        metrics = runs / f"run_{name}" / "metrics.jsonl"
        if not metrics.exists() or _steps_logged(metrics) < args.steps:
            results.append(old.get(name, {"mode": name, "overrides": overrides, "error": "no complete run"}))
            continue
        prev = old.get(name, {})
        r = summarize(name, overrides, metrics.parent, args, prev.get("wall_s"), prev.get("gpu_busy_fraction"))
        r["rebuilt_from_runs"] = True
        results.append(r)
    write_results(results, args, device, stem)
    print(f"rebuilt {stem}.json and .png", file=sys.stderr)


def write_results(results: list[dict], args, device: str, stem: Path) -> None:
    ok = [r for r in results if "step_s" in r]
    base = next((r["step_s"] for r in ok if r["mode"] == "sync"), None)
    for r in ok:
        r["speedup_vs_sync"] = base / r["step_s"] if base else None
    doc = {"device": device, "commit": commit(), "model": args.model, "gpus": args.gpus, "steps": args.steps,
           "warmup": args.warmup, "prompts_per_step": args.prompts, "n": args.n, "recipe": str(Path(args.recipe).name),
           "overrides": args.overrides, "modes": results}
    Path(f"{stem}.json").write_text(json.dumps(doc, indent=2))
    if ok:
        plot(ok, f"{args.model} on {device}", Path(f"{stem}.png"))


if __name__ == "__main__":
    main()
