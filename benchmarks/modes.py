"""``make bench``: the training modes on the GPUs of this machine, the same workload in each, measured end to end.

Runs the real trainer (``python -m hybrid_rl train`` under torchrun, vLLM as the engine) once per mode on every
visible GPU, samples GPU utilisation with ``nvidia-smi`` while it runs, drops the warm-up steps and reports per
mode: step time and its phase breakdown, generated and trained tokens/s, GPU busy fraction, peak memory and
``speedup_vs_sync``. The modes by default, the ones the README recommends:

  sync               trainer.mode=sync (colocated: every GPU generates, then trains)
  overlap_colocated  trainer.mode=overlap trainer.max_staleness=1 (step N+1 generates beside step N's update)
  split_partial      trainer.placement=split trainer.mode=overlap trainer.partial_rollouts=true
                     trainer.partial_rollout_ahead=3 trainer.max_staleness=4 (half the GPUs generate, half train;
                     2+ GPUs)
  overlap_partial    trainer.mode=overlap trainer.partial_rollouts=true trainer.partial_rollout_ahead=1
                     trainer.max_staleness=2 (colocated: on one GPU it takes split_partial's place)

``--modes`` picks others too: overlap_split (split without partial rollouts), overlap_split_r<R> (with
``--rollout-ranks R``), overlap_stream, overlap_proc.

The workload: ``benchmarks/bench_modes.yaml`` with a random-weight Qwen2.5-1.5B shape (built locally, no
download), the GSM8K prompts shipped in ``benchmarks/data/``, 24 prompts x 8 samples per step, response lengths
forced from a long-tailed draw (``rollout.forced_lengths=lognormal:256:0.8``, capped at 512: a random model never
stops on its own), 3 warm-up + 8 measured steps. Each mode costs ~40-60 s of start-up (vLLM engine, CUDA graphs;
the first run on a machine also builds the model, ~40 s) plus its steps, and is stopped after --mode-timeout s
(180; 300 on one GPU, whose update micro-batches then take 8,192 tokens): on one H200 7 minutes in all
(``benchmarks/results/modes_H200x1_qwen2.5-1.5b-random.json``).
Trailing ``key=value`` arguments override the recipe for every mode (e.g. ``rollout.forced_lengths=lognormal:1024:0.8
data.max_response_length=2048``); ``--mode-override MODE:key=value`` for one mode.

Output: a table on the terminal, and ``modes_<device>_<model>.json`` + ``.png`` in the run directory (default
``runs/bench/<UTC time>/``, ``--out`` to change; never ``benchmarks/results/``, which ``benchmarks/publish.py`` writes),
with each mode's run (``run_<mode>/``: metrics.jsonl, stderr.log). A mode that fails is one line naming it and
its error, with the path of its full log; the exit status is then 1.

Needs NVIDIA GPUs and vLLM (``.venv/bin/pip install -e '.[vllm]'``). On a machine without them it says so in one
line and exits 2; ``--cpu-smoke`` runs the same plumbing on CPU instead (the built-in tiny model, the
transformers engine, 2 gloo ranks, 2 steps per mode: it checks that every mode runs and reports, and its figures
mean nothing).

    make bench                                  # .venv/bin/python benchmarks/modes.py --gpus <visible GPUs>
    make bench ARGS="--modes sync,split_partial --out /tmp/bench"
    make bench ARGS=--cpu-smoke
"""

from __future__ import annotations

import argparse
import json
import copy
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import git_commit, gpu_short_name, kill_tree, process_tree, run_dir, signal_pid  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["gen", "wait_gen", "sync_weights", "reward", "old_log_prob", "ref", "adv", "optimizer_onload", "update",
          "optimizer_offload"]


def device_name(gpus: int) -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    if not out:
        return "CPU"
    return f"{gpu_short_name(out[0])}x{gpus}"


def commit() -> str:
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


def _dump_rank_stacks(proc: subprocess.Popen, wait_s: float = 3.0) -> int:
    """SIGUSR1 to the training processes below torchrun (``hybrid_rl`` in their command line; not torchrun itself,
    which the signal would end, nor the engine or reward processes they spawned): each prints every thread's stack
    into the run's log (``watchdog.dump_stacks_on_signal``), even a rank stuck in C with the GIL held. Returns how
    many were signalled."""
    ranks = []
    for pid in process_tree(proc.pid)[1:]:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hybrid_rl" in cmdline and b"train" in cmdline:
            ranks.append(pid)
    for pid in ranks:
        signal_pid(pid, signal.SIGUSR1)
    if ranks:
        time.sleep(wait_s)
    return len(ranks)


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
            kill_tree(proc)
            break
    wall = (done_at if done_at is not None else time.perf_counter() - start)
    sampler.stop.set()
    log.close()
    log_path = run_dir / "stderr.log"
    stderr = log_path.read_text(errors="replace")
    failed = {"mode": name, "overrides": overrides, "stderr_tail": stderr[-3000:], "log": str(log_path)}
    if done_at is None and stalled:
        return {**failed, "error": f"stalled: no step logged for {stall:.0f} s (step {seen + 1} of {target} did not come)"}
    if done_at is None and proc.returncode != 0:
        if args.mode_timeout and time.perf_counter() - start > args.mode_timeout:
            return {**failed, "error": f"timed out after {args.mode_timeout:g} s ({seen} of {target} steps logged)"}
        return {**failed, "error": f"exit {proc.returncode}: {error_line(stderr)}"}
    busy = statistics.fmean(sampler.samples) if sampler.samples else None
    return summarize(name, overrides, run_dir, args, wall, busy)


_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure|Failed)\b(?::.*)?$")
_TORCHRUN_NOISE = ("ChildFailedError", "torch.distributed.elastic")


def error_line(log: str) -> str:
    """The line of a failed run's output that says what went wrong: the trainer's own ``error: ...`` line (a user
    error), else the last exception a rank raised (``RuntimeError: ...``, not torchrun's ``ChildFailedError``
    report that follows it), else the last line that mentions an error, else the last line."""
    lines = []
    for raw in log.splitlines():
        line = re.sub(r"^\[(?:rank|default)\d+\]:\s?", "", raw.strip())  # torchrun's per-rank prefix
        if line and set(line) - set("=-*~^ "):
            lines.append(line)
    for line in reversed(lines):
        if line.startswith("error: "):
            return line[len("error: "):]
    for line in reversed(lines):
        if _EXCEPTION_LINE.match(line) and not any(n in line for n in _TORCHRUN_NOISE):
            return line[:400]
    for line in reversed(lines):
        if re.search(r"\berror\b", line, re.IGNORECASE) and not any(n in line for n in _TORCHRUN_NOISE) \
                and "error_file" not in line:
            return line[:400]
    return lines[-1][:400] if lines else "no output"


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
    if any("rollout/logprob_diff" in r for r in rows):  # engine vs trainer log-probs (e.g. an fp8 KV cache)
        extra["logprob_diff"] = mean("rollout/logprob_diff")
    for key in ("perf/mfu_update", "perf/mfu_log_prob", "perf/mfu_update_equiv"):  # FLOPs run ÷ time ÷ peak
        if any(key in r for r in rows):
            extra[key.split("/")[1]] = mean(key)
    context = sum(r.get("rollout/partial_context_tokens", 0.0) for r in rows)
    if context:  # partial rollouts: the rounds' context read from vLLM's prefix cache (prompts shared by a group's samples)
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
        "per_step": rows,
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
PROC_MODE = ("overlap_proc", ["trainer.mode=overlap", "trainer.max_staleness=1", "rollout.vllm.engine_process=true"])
"""Overlap colocated with vLLM's engine core in a process of its own (``rollout.vllm.engine_process``): generation no longer
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


SPLIT_PARTIAL = ("split_partial", ["trainer.placement=split", "trainer.mode=overlap", "trainer.partial_rollouts=true",
                                   "trainer.partial_rollout_ahead=3", "trainer.max_staleness=4"])
"""Split placement with partial rollouts, as the README recommends it: half the GPUs generate, half train; the
rollout side keeps generating for up to 3 steps ahead and carries the long tail (staleness bound 4)."""
OVERLAP_PARTIAL = ("overlap_partial", ["trainer.mode=overlap", "trainer.partial_rollouts=true",
                                       "trainer.partial_rollout_ahead=1", "trainer.max_staleness=2"])
"""Overlap colocated with partial rollouts: the engine beside the trainer on the same GPUs keeps one step's groups in
flight and carries the unfinished ones into the next round (staleness bound 2). What one GPU allows of the partial
modes."""
DEFAULT_MODES = ("sync", "overlap_colocated", "split_partial")
DEFAULT_MODES_ONE_GPU = ("sync", "overlap_colocated", "overlap_partial")
SPLIT_OVERRIDES = ["rollout.vllm.gpu_memory_utilization=0.6"]
"""For the split modes: their rollout GPUs hold nothing but the engine, so it gets more of the card."""

DATA = ROOT / "benchmarks" / "data" / "gsm8k_train_1k.jsonl"
RECIPE = ROOT / "benchmarks" / "bench_modes.yaml"
GPU_RUN = dict(model="builtin:qwen2.5-1.5b-random", prompts=24, n=8, steps=11, warmup=3, mode_timeout=180.0,
               overrides=["rollout.name=vllm", "rollout.forced_lengths=lognormal:256:0.8", "data.max_response_length=512",
                          "data.max_prompt_length=512", "model.enable_gradient_checkpointing=false",
                          "actor.ppo_mini_batch_size=24", "actor.ppo_micro_batch_size_per_device=8",
                          "actor.use_dynamic_bsz=true", "actor.max_token_len_per_device=16384"])
"""``make bench`` on GPUs: the workload of the README's mean-256 point (24 x 8 per step, lognormal lengths of mean
256 capped at 512), 3 warm-up and 8 measured steps."""
ONE_GPU_MODE_TIMEOUT = 300.0
"""``--mode-timeout`` default on one GPU, which generates and trains the whole batch alone."""
ONE_GPU_OVERRIDES = ["actor.max_token_len_per_device=8192"]
"""On one GPU the actor's unsharded AdamW state (~24 GB at 1.5B) sits beside the engine's pool, so the update's
micro-batches take half the tokens (at 16,384 the 1.5B shape's activations without recomputation overflow 141 GB)."""
CPU_SMOKE = dict(model="builtin:tiny-qwen2", gpus=2, prompts=8, n=4, steps=2, warmup=1, mode_timeout=300.0,
                 overrides=["trainer.device=cpu", "rollout.name=hf", "data.max_prompt_length=384",
                            "data.max_response_length=32", "rollout.forced_lengths=lognormal:12:0.8",
                            "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_device=8"])
"""``--cpu-smoke``: the tiny model on 2 gloo ranks, the transformers engine, 1 warm-up + 1 measured step."""


def pip_install_vllm() -> str:
    from hybrid_rl.preflight import pip_command  # .venv/bin/pip, or this interpreter's pip

    here = Path.cwd().resolve() == ROOT
    return f"{pip_command()} install -e '{'.' if here else ROOT}[vllm]'"


def available_modes(world: int, rollout_ranks: str = "") -> list[tuple[str, list[str]]]:
    """Every mode this script can run on ``world`` ranks, in table order."""
    modes = build_modes(world, rollout_ranks)
    if world >= 2:
        modes.insert(2, SPLIT_PARTIAL)
    return [*modes, OVERLAP_PARTIAL, *EXTRA_MODES]


def select_modes(wanted: str, world: int, rollout_ranks: str) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(modes to run, notes on those left out): ``wanted`` (comma-separated) or the defaults."""
    modes = available_modes(world, rollout_ranks)
    names = [m.strip() for m in wanted.split(",") if m.strip()]
    if not names:
        extra = [m[0] for m in modes if m[0].startswith("overlap_split_r")]
        names = [*(DEFAULT_MODES if world >= 2 else DEFAULT_MODES_ONE_GPU), *extra]
    known = {name for name, _ in available_modes(max(world, 2), rollout_ranks)}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"error: --modes: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
    have = dict(modes)
    missing = [n for n in names if n not in have]
    if wanted.strip() and missing:
        raise SystemExit(f"error: --modes: {', '.join(missing)} need(s) 2+ GPUs (some generate, the others train) "
                         f"and {world} is visible; drop it from --modes")
    notes = [f"{n} needs 2+ GPUs (half generate, half train): left out on {world}" for n in missing]
    split = lambda ovr: SPLIT_OVERRIDES if "trainer.placement=split" in ovr else []
    return [(n, [*have[n], *split(have[n])]) for n in names if n in have], notes


def parse_mode_overrides(items: list[str], names: list[str]) -> dict[str, list[str]]:
    """``--mode-override MODE:key=value`` (repeatable) → {mode: [key=value, ...]}."""
    out: dict[str, list[str]] = {}
    for item in items:
        mode, sep, kv = item.partition(":")
        if not sep or "=" not in kv:
            raise SystemExit(f"error: --mode-override {item!r}: write MODE:key=value, e.g. "
                             f"split_partial:rollout.vllm.gpu_memory_utilization=0.7")
        if mode not in names:
            raise SystemExit(f"error: --mode-override {item!r}: {mode!r} is not one of the modes run ({', '.join(names)})")
        out.setdefault(mode, []).append(kv)
    return out


def check_machine(args) -> str | None:
    """Why this machine cannot run the GPU benchmark (one line), or None."""
    import importlib.util

    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        return (f"make bench needs NVIDIA GPUs and vLLM ({pip_install_vllm()}), and this machine has no CUDA GPU; "
                f"`make bench ARGS=--cpu-smoke` runs its plumbing on CPU instead (tiny model, figures mean nothing)")
    if args.gpus and args.gpus > gpus:
        return f"--gpus {args.gpus}: only {gpus} GPU(s) are visible; pass --gpus {gpus} (make bench GPUS={gpus})"
    engine_hf = any(o.replace(" ", "") == "rollout.name=hf" for o in args.overrides)
    if not engine_hf and importlib.util.find_spec("vllm") is None:
        return (f"make bench runs vLLM, which is not installed: {pip_install_vllm()} (tested: vllm 0.26); "
                f"or add rollout.name=hf to time the transformers engine")
    return None


def check_mode(args, overrides: list[str]) -> tuple[int | None, str | None]:
    """(trainer steps to start the mode's run with, or None; the config's one-line error, or None)."""
    from hybrid_rl.config import load_config

    try:
        cfg = load_config(args.recipe, [f"model.path={args.model}", *args.overrides, *overrides])
        cfg.validate(args.gpus)
    except Exception as e:  # noqa: BLE001  (ConfigError and any other reason the setting cannot run)
        return None, str(e).splitlines()[0] if str(e) else type(e).__name__
    # one step beyond the measured ones (the last step generates nothing ahead in overlap mode), or with partial
    # rollouts the pool's steps (the pool drains over the last ones, faster than the steady state)
    t = cfg.trainer
    return args.steps + (t.partial_pool_steps if t.partial_rollouts else 1), None


def _show(path: Path | str) -> str:
    """``path`` relative to the current directory when it is below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def table(results: list[dict]) -> str:
    cols = [("mode", 19), ("step s", 8), ("vs sync", 8), ("gen tok/s", 10), ("train tok/s", 12), ("GPU busy", 9),
            ("peak GB", 8), ("staleness", 10)]
    lines = ["".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(cols))]
    for r in results:
        if "step_s" not in r:
            lines.append(f"{r['mode']:<19}{'FAILED':>8}  (below)")
            continue
        busy = f"{r['gpu_busy_fraction']:.0%}" if r.get("gpu_busy_fraction") is not None else "-"
        speed = f"{r['speedup_vs_sync']:.2f}x" if r.get("speedup_vs_sync") else "-"
        vals = [r["mode"], f"{r['step_s']:.2f}", speed, f"{r['gen_tokens_per_s']:.0f}", f"{r['trained_tokens_per_s']:.0f}",
                busy, f"{r['peak_memory_reserved_gb']:.1f}", f"{r['staleness_max']:.0f}"]
        lines.append("".join(f"{v:<{w}}" if i == 0 else f"{v:>{w}}" for i, (v, (_, w)) in enumerate(zip(vals, cols))))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=None, help="ranks (one per GPU); default: every visible GPU")
    ap.add_argument("--modes", default="", help=f"comma-separated modes (default: {','.join(DEFAULT_MODES)}); also "
                    "overlap_split, overlap_split_r<R> (with --rollout-ranks), overlap_stream, overlap_proc")
    ap.add_argument("--out", default=None, help="run directory for the JSON, PNG and each mode's run and log "
                    "(default: runs/bench/<UTC time>/ in the repository); not under benchmarks/results/")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="no GPU needed: the tiny model on 2 CPU ranks with the transformers engine, 2 steps per mode; "
                         "checks that every mode runs and reports (its figures mean nothing)")
    ap.add_argument("--model", default=None, help=f"default {GPU_RUN['model']} (random weights, built locally)")
    ap.add_argument("--recipe", default=str(RECIPE), help="the recipe under every mode's overrides")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"steps measured from the start, warm-up included (default {GPU_RUN['steps']}); the run goes "
                         "on for one more (with partial rollouts: the pool's) and is stopped there")
    ap.add_argument("--warmup", type=int, default=None, help=f"steps dropped (default {GPU_RUN['warmup']})")
    ap.add_argument("--prompts", type=int, default=None, help=f"data.train_batch_size (default {GPU_RUN['prompts']})")
    ap.add_argument("--n", type=int, default=None, help=f"rollout.n (default {GPU_RUN['n']})")
    ap.add_argument("--mode-timeout", type=float, default=None,
                    help=f"seconds before one mode's run is stopped and counted as failed (default {GPU_RUN['mode_timeout']:g})")
    ap.add_argument("--mode-override", action="append", default=[], metavar="MODE:KEY=VALUE",
                    help="an override for one mode only (repeatable), e.g. split_partial:trainer.rollout_ranks=1")
    ap.add_argument("--rollout-ranks", default="", help="comma-separated rollout rank counts for more split modes "
                    "(overlap_split_r<R>), e.g. 1 on 4 GPUs for 1 rollout + 3 trainer ranks")
    ap.add_argument("--tag", default="", help="suffix for the result files, e.g. _tuned for a run with other overrides")
    ap.add_argument("--from-runs", action="store_true",
                    help="do not run: rebuild the JSON/PNG from the run directories already under --out (e.g. a run whose "
                         "teardown was cut off after every step was logged); GPU busy fraction is kept from the old JSON")
    ap.add_argument("--device", default="", help="with --from-runs: the device name the runs were made on (e.g. H200x1)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every mode, after the benchmark's own")
    args = ap.parse_intermixed_args(argv)
    base = CPU_SMOKE if args.cpu_smoke else GPU_RUN
    args.mode_timeout_given = args.mode_timeout is not None
    for key in ("model", "steps", "warmup", "prompts", "n", "mode_timeout"):
        if getattr(args, key) is None:
            setattr(args, key, base[key])
    if args.cpu_smoke:
        args.gpus = args.gpus if args.gpus and args.gpus > 1 else CPU_SMOKE["gpus"]
    if args.warmup >= args.steps:
        raise SystemExit(f"error: --warmup {args.warmup} leaves no measured step of --steps {args.steps}; raise --steps")
    # the shipped prompts, by absolute path (the runs start in the repository root; this may be called from anywhere)
    args.overrides = [f"data.train_path={DATA}", *base["overrides"], *args.overrides,
                      f"data.train_batch_size={args.prompts}", f"rollout.n={args.n}"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(1, str(ROOT))
    # --from-runs rebuilds the JSON/PNG in the run directory it reads, wherever that is
    out_dir = Path(args.out) if args.from_runs and args.out else run_dir("bench", args.out)
    if not args.cpu_smoke and not args.from_runs:
        why = check_machine(args) if args.gpus is None or args.gpus > 0 else "--gpus must be at least 1"
        if why:
            print(f"error: {why}", file=sys.stderr)
            return 2
    if args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count()
    if args.gpus == 1 and not args.cpu_smoke and not args.mode_timeout_given:
        args.mode_timeout = ONE_GPU_MODE_TIMEOUT  # one GPU generates and trains the whole batch
    if args.gpus == 1 and not args.cpu_smoke:
        at = 1 + len(GPU_RUN["overrides"])  # after the benchmark's own, before the user's
        args.overrides = [*args.overrides[:at], *ONE_GPU_OVERRIDES, *args.overrides[at:]]
    device = "CPU" if args.cpu_smoke else device_name(args.gpus)
    model_tag = args.model.split(":")[-1].split("/")[-1]
    modes, notes = select_modes(args.modes, args.gpus, args.rollout_ranks)
    per_mode = parse_mode_overrides(args.mode_override, [n for n, _ in modes])
    modes = [(n, [*ovr, *per_mode.get(n, [])]) for n, ovr in modes]
    stem = out_dir / f"modes_{device}_{model_tag}{args.tag}"
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.from_runs:
        args.device = args.device or device
        rebuild(modes, args, args.device, stem, out_dir)
        return 0
    # a subset run (--modes) into an existing --out keeps the other modes' figures already in the JSON
    kept = []
    if args.modes and Path(f"{stem}.json").exists():
        kept = [m for m in json.loads(Path(f"{stem}.json").read_text())["modes"] if m["mode"] not in dict(modes)]
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"bench: {', '.join(n for n, _ in modes)} on {args.gpus} {'CPU rank' if args.cpu_smoke else 'GPU'}(s), "
          f"{args.model}, {args.prompts} prompts x {args.n} per step, {args.steps} steps ({args.warmup} warm-up), "
          f"at most {args.mode_timeout:g} s a mode; run directory {_show(out_dir)}", file=sys.stderr, flush=True)
    results = []
    for i, (name, overrides) in enumerate(modes, 1):
        steps, err = check_mode(args, overrides)
        if err:
            res = {"mode": name, "overrides": overrides, "error": f"invalid setting: {err}"}
        else:
            run_args = copy.copy(args)  # run to `steps`, stopped once the measured ones are logged
            run_args.steps, run_args.stop_after = steps, args.steps
            print(f"[{i}/{len(modes)}] {name}: {' '.join(overrides)}", file=sys.stderr, flush=True)
            res = run_mode(name, overrides, run_args, out_dir)
            res.pop("stderr_tail", None)
        if "error" in res:
            print(f"[{i}/{len(modes)}] {name} FAILED: {res['error']}", file=sys.stderr, flush=True)
        else:
            print(f"[{i}/{len(modes)}] {name}: {res['step_s']:.2f} s/step over {res['steps_measured']} steps",
                  file=sys.stderr, flush=True)
        results.append(res)
        write_results(_in_order(kept + results), args, device, stem, out_dir)
    everything = _in_order(kept + results)
    print(table(everything))
    print(f"wrote {_show(stem)}.json" + (" and .png" if Path(f"{stem}.png").exists() else ""))
    failed = [r for r in results if "error" in r]
    for r in failed:
        log = f" (log: {_show(r['log'])})" if r.get("log") else ""
        print(f"FAILED {r['mode']}: {r['error']}{log}", file=sys.stderr)
    if failed:
        print(f"error: {len(failed)} of {len(results)} modes failed: {', '.join(r['mode'] for r in failed)}",
              file=sys.stderr)
        return 1
    return 0


def _in_order(results: list[dict]) -> list[dict]:
    order = {name: i for i, name in enumerate(["sync", "overlap_colocated", "split_partial", "overlap_partial",
                                               "overlap_split"])}
    return sorted(results, key=lambda r: (order.get(r["mode"], len(order)), r["mode"]))


def rebuild(modes, args, device: str, stem: Path, runs: Path) -> None:
    if not any((runs / f"run_{name}").is_dir() for name, _ in modes):
        runs = Path(f"{stem}_runs")  # the layout of the older result folders
    old = {}
    if Path(f"{stem}.json").exists():
        old = {m["mode"]: m for m in json.loads(Path(f"{stem}.json").read_text())["modes"]}
    results = []
    for name, overrides in modes:
        metrics = runs / f"run_{name}" / "metrics.jsonl"
        args.stop_after = args.steps
        if not metrics.exists() or _steps_logged(metrics) < args.steps:
            results.append(old.get(name, {"mode": name, "overrides": overrides, "error": "no complete run"}))
            continue
        prev = old.get(name, {})
        r = summarize(name, overrides, metrics.parent, args, prev.get("wall_s"), prev.get("gpu_busy_fraction"))
        r["rebuilt_from_runs"] = True
        results.append(r)
    write_results(results, args, device, stem, runs)
    print(f"rebuilt {stem}.json and .png", file=sys.stderr)


def write_results(results: list[dict], args, device: str, stem: Path, run_dir: Path) -> None:
    ok = [r for r in results if "step_s" in r]
    base = next((r["step_s"] for r in ok if r["mode"] == "sync"), None)
    for r in ok:
        r["speedup_vs_sync"] = base / r["step_s"] if base else None
    doc = {"device": device, "commit": commit(), "model": args.model, "gpus": args.gpus, "steps": args.steps,
           "warmup": args.warmup, "prompts_per_step": args.prompts, "n": args.n, "recipe": str(Path(args.recipe).name),
           "overrides": args.overrides, "run_dir": str(run_dir), "modes": results}
    Path(f"{stem}.json").write_text(json.dumps(doc, indent=2))
    if ok:
        plot(ok, f"{args.model} on {device}", Path(f"{stem}.png"))


if __name__ == "__main__":
    sys.exit(main())
