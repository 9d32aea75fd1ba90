"""The crossover sweep: sync vs one-step overlap across response lengths, at one prompt batch.

``modes.py`` compares the modes at one setting; whether overlap pays depends on how much of a sync step is
generation, which grows with the response length. This script runs ``modes.py``'s runs (its ``run_mode``,
``summarize`` and ``build_modes``; nothing is copied) at several mean response lengths, each a long-tailed
lognormal draw capped at ``--cap-factor`` × the mean (``rollout.forced_lengths``, ``data.max_response_length``
= the cap), in sync, overlap colocated, overlap split with one or more rollout:trainer ratios, and
``overlap_partial`` (overlap colocated with partial rollouts: the long tail is interrupted at the step boundary
and carried into the next round, ``trainer.max_staleness=2``), ``overlap_stream`` (overlap colocated with generation
on its own high-priority CUDA stream, ``rollout.cuda_stream=high``), ``overlap_proc`` (overlap colocated with
vLLM's engine core in a process of its own, ``rollout.vllm.engine_process=true``), ``split_partial`` (split placement
with partial rollouts on the rollout ranks: they generate until the trainer ranks are ready, the tail is carried;
at the same ratios as ``overlap_split``, run last), and keeps the fastest split ratio per length. Per length it
reports the sync step, the generation share of the sync step, each overlap mode's step time and speed-up over sync,
and a GPU busy fraction; the plot is speed-up against generation share, one line per overlap mode.

    python benchmarks/modes_sweep.py --gpus 4 --model builtin:qwen2.5-1.5b-random --prompts 24 \\
        --lengths 256,1024,4096,8192 --split-ratios auto --budget 540 data.train_path=... rollout.name=vllm
    python benchmarks/modes_sweep.py --dry-run --gpus 4 ...   # the trainer's config checks on every run, nothing run
    python benchmarks/modes_sweep.py --cpu-smoke        # tiny model on CPU, 2 gloo ranks: the plumbing only

Each run takes ``--warmup`` + ``--measure`` + 1 steps and is stopped once the measured steps are logged: the
first step of an overlap run generates in the foreground and the last one generates nothing ahead, so neither is
a steady-state step. With partial rollouts the run is started with the pool's steps (``pool_steps`` =
max(2, ⌈1 + ahead⌉)) beyond the measured ones instead of 1: over a run's last that many steps the pool shrinks
(no prompts beyond the end are started), the rollout ranks only finish what they carry, and steps run faster than
the steady state (on 4xH200 at mean 4k and ahead 3, by ~13% over a run's last two steps). Their warm-up wants more steps too:
the pool's first full round generates several steps ahead, and the steps after it live on that stock
(``partial_model.py``: 4 warm-up and 8 measured steps come within ~3% of the steady state at mean 4k, 2 and 6
flatter it by 13-20%). ``--budget`` bounds the whole invocation: a run whose estimate
(start-up + steps, scaled from the runs already measured) does not fit what is left, or that runs past
``--run-timeout`` or the budget, is recorded as skipped with the reason. The JSON is rewritten after every run
and merged with the one already there (same settings), so a sweep can be cut into parts (``--lengths 8192
--modes overlap_split`` in another call) that land in one file; ``--resume`` runs only what the file lacks, so
a part cut short can be called again. ``overlap_stream``, ``overlap_proc`` and ``overlap_partial`` run after the
split runs, and ``split_partial`` last (the budget skips the last first). A run that logs no step for twice a
start-up plus twice the point's sync step is stopped as hung.
Left out: staleness beyond one step outside partial rollouts (which take 2, or 1 + ahead rounded up with
``--partial-aheads`` above 1), and a search over anything but the split ratio (micro-batch sizes, engine memory) per
point.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import socket
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT))

import modes  # noqa: E402  (benchmarks/modes.py: the runs themselves)
from bench_common import run_dir  # noqa: E402

TRAIN_PHASES = ("old_log_prob", "ref", "values", "update_critic", "update", "sync_weights")
"""Timed phases that keep a training GPU busy (reward and advantage run on the host, ``wait_gen`` idles)."""
NOTES = {
    "step_s": "mean timing/iteration (the loop's wall time per step; timing/step in rows measured before it "
              "existed) over the measured steps (after --warmup, before the last step, which generates nothing "
              "ahead in overlap mode)",
    "trainer_step_s": "mean timing/step: the step as the trainer times it (before 2026-11-28 split placement's "
                      "trainer ranks waited for generation outside it, so that split rows without "
                      "timing/iteration understate the step where generation was the slower side)",
    "gen_share": "timing/gen / step_s of the same point's sync run (timing/gen: the engine's generate call)",
    "speedup_vs_sync": "sync step_s / this mode's step_s at the same point",
    "gpu_busy_fraction": "nvidia-smi utilization.gpu averaged over the GPUs, sampled every 0.25 s during the "
                         "measured steps; null without nvidia-smi (CPU)",
    "gpu_busy_timed": "from the timings: per GPU, the time of the step it spends in a timed GPU phase, averaged "
                      "over the GPUs. Colocated: min(1, (gen + training phases) / step); for overlap colocated this "
                      "is an upper bound, since generation and training share the GPU at the same time. Split R:T: "
                      "(R * min(gen, step) + T * min(training phases, step)) / ((R + T) * step). Training phases: "
                      + ", ".join(TRAIN_PHASES) + " (timings are the max over ranks)",
    "best_split": "the split ratio with the lowest step_s at that point",
    "best_split_partial": "likewise for split_partial (split placement with partial rollouts)",
}


PARTIAL_MODE = ("overlap_partial", ["trainer.mode=overlap", "trainer.max_staleness=2", "trainer.partial_rollouts=true"])
"""Overlap colocated with partial rollouts (``hybrid_rl/modes/partial.py``): carried samples reach staleness 2."""
EXTRA_MODES = (*modes.EXTRA_MODES, PARTIAL_MODE)
"""Colocated variants run after the split runs at each point (the budget skips them first)."""
MODES = ("sync", "overlap_colocated", "overlap_split", "overlap_stream", "overlap_proc", "overlap_partial", "split_partial")
SPLIT_FAMILIES = ("overlap_split", "split_partial")
"""Modes run at every split ratio asked for (``--split-ratios``); each keeps its fastest ratio per point."""


def parse_ratios(text: str, gpus: int) -> tuple[bool, list[int]]:
    """``auto,1:3`` → (auto?, rollout rank counts); every R:T must add up to ``gpus``."""
    auto, ranks = False, []
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        if part == "auto":
            auto = True
            continue
        try:
            r, t = (int(x) for x in part.split(":"))
        except ValueError:
            raise SystemExit(f"--split-ratios={text!r}: give ROLLOUT:TRAINER pairs or 'auto', e.g. 1:3,2:2") from None
        if r < 1 or t < 1 or r + t != gpus:
            raise SystemExit(f"--split-ratios: {part} must be two counts >= 1 that add up to the {gpus} GPUs (--gpus)")
        ranks.append(r)
    return auto, sorted(set(ranks))


def auto_rollout_ranks(gen_share: float, gpus: int) -> int:
    """The ratio that balances the two sides: R GPUs generate for ~gen×W/R, T train for ~train×W/T; equal when
    R/W = the generation share of the sync step."""
    return min(gpus - 1, max(1, round(gen_share * gpus)))


def split_mode(gpus: int, r: int, family: str = "overlap_split") -> tuple[str, list[str]]:
    """``modes.build_modes``' name and overrides for R rollout ranks on ``gpus``; ``split_partial``: the same layout
    with partial rollouts on the rollout ranks (staleness bound 2)."""
    named = dict(modes.build_modes(gpus, str(r)))
    if r == gpus // 2:  # build_modes' plain overlap_split (half the ranks); the count is spelt out for the record
        name, ovr = "overlap_split", [*named["overlap_split"], f"trainer.rollout_ranks={r}"]
    else:
        name, ovr = f"overlap_split_r{r}", named[f"overlap_split_r{r}"]
    if family == "split_partial":
        name = name.replace("overlap_split", "split_partial")
        ovr = [("trainer.max_staleness=2" if o == "trainer.max_staleness=1" else o) for o in ovr]
        ovr.append("trainer.partial_rollouts=true")
    return name, ovr


def split_runs(gpus: int, ranks: list[int], extra: list[str], family: str = "overlap_split",
               aheads: list[float] | None = None) -> list[tuple[str, list[str]]]:
    """(name, overrides) of each split run; ``extra`` (``--split-override``) applies to split runs only.
    ``aheads`` (``split_partial``, ``--partial-aheads``): one run per ``trainer.partial_rollout_ahead`` value at each
    ratio, named ``..._a<value>`` (none: the recipe's value, no suffix); above 1 with the staleness bound that
    many steps in flight need (``trainer.max_staleness`` = 1 + ahead, rounded up)."""
    runs = [(name, [*ovr, *extra]) for name, ovr in (split_mode(gpus, r, family) for r in sorted(set(ranks)))]
    if family != "split_partial" or not aheads:
        return runs
    from hybrid_rl.config import partial_pool_steps

    return [(f"{name}_a{a:g}", [*ovr, f"trainer.partial_rollout_ahead={a:g}",
                                *([f"trainer.max_staleness={partial_pool_steps(a)}"] if a > 1 else [])])
            for name, ovr in runs for a in aheads]


def parse_aheads(text: str) -> list[float]:
    try:
        aheads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--partial-aheads={text!r}: give comma-separated fractions, e.g. 0.25,1.0") from None
    if any(a < 0 for a in aheads):
        raise SystemExit(f"--partial-aheads={text!r}: each must be >= 0 (trainer.partial_rollout_ahead)")
    return aheads


def point_overrides(mean: int, cap: int, args) -> list[str]:
    out = [f"rollout.forced_lengths=lognormal:{mean}:{args.sigma}", f"data.max_response_length={cap}"]
    if args.token_budget:  # one budget for every length: raised to hold the longest sequence
        out += ["actor.use_dynamic_bsz=true",
                f"actor.max_token_len_per_device={max(args.token_budget, args.max_prompt_length + cap)}"]
    return out


def busy_from_timings(row: dict, mode_overrides: list[str], gpus: int) -> float | None:
    ph = row["phases_s"]
    step = row["step_s"]
    if step <= 0:
        return None
    gen, train = ph.get("gen", 0.0), sum(ph.get(p, 0.0) for p in TRAIN_PHASES)
    if "trainer.placement=split" not in mode_overrides:
        return min(1.0, (gen + train) / step)
    r = row.get("rollout_ranks") or gpus // 2
    return (r * min(gen, step) + (gpus - r) * min(train, step)) / (gpus * step)


def measure_metrics(run_dir: Path) -> list[dict]:
    try:
        return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "timing/step" in r]
    except OSError:
        return []


# --------------------------------------------------------------------------- results
def settings_of(args) -> dict:
    """What must match for rows of two invocations to share one JSON (steps may differ: each row has its own)."""
    return {"model": args.model, "gpus": args.gpus, "prompts_per_step": args.prompts, "n": args.n,
            "sigma": args.sigma, "cap_factor": args.cap_factor, "token_budget": args.token_budget,
            "split_overrides": args.split_overrides, "recipe": Path(args.recipe).name, "overrides": args.overrides}


DIAGNOSTIC_KEYS = ("trainer.stall_dump_s=", "trainer.profile_steps=")
"""Overrides that change what a run prints, not what it measures: rows may differ in them."""


def comparable(settings: dict) -> dict:
    """``settings`` without the diagnostic overrides."""
    return {**settings, "overrides": [o for o in settings.get("overrides") or [] if not o.startswith(DIAGNOSTIC_KEYS)]}


def row_key(row: dict) -> tuple:
    return row["length_mean"], row["mode"]


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """New rows replace old ones of the same (length, mode), except that a skip never replaces a measurement."""
    rows = {row_key(r): r for r in old}
    for r in filter(None, new):
        prev = rows.get(row_key(r))
        if prev is not None and "step_s" in prev and "step_s" not in r:
            continue
        rows[row_key(r)] = r
    return sorted(rows.values(), key=lambda r: (r["length_mean"], _mode_order(r["mode"])))


def _mode_order(name: str) -> tuple:
    base = list(MODES)
    return (base.index(name) if name in base else len(base), name)


def summarize_points(rows: list[dict]) -> list[dict]:
    """Per length: the sync step and generation share, speed-ups, the best split; fills each row's derived fields."""
    points = []
    for mean in sorted({r["length_mean"] for r in rows}):
        at = [r for r in rows if r["length_mean"] == mean]
        sync = next((r for r in at if r["mode"] == "sync" and "step_s" in r), None)
        ok = [r for r in at if "step_s" in r]
        for r in ok:
            r["speedup_vs_sync"] = sync["step_s"] / r["step_s"] if sync else None
            r["gen_share"] = sync["gen_share_own"] if sync else None
        bests = {f: min((r for r in ok if r["mode"].startswith(f)), key=lambda r: r["step_s"], default=None)
                 for f in SPLIT_FAMILIES}
        best, best_partial = bests["overlap_split"], bests["split_partial"]
        colo = next((r for r in ok if r["mode"] == "overlap_colocated"), None)
        extra = {m: next((r["speedup_vs_sync"] for r in ok if r["mode"] == m), None) for m, _ in EXTRA_MODES}
        points.append({
            "length_mean": mean, "cap": at[0]["cap"], "forced_lengths": at[0]["forced_lengths"],
            "sync_step_s": sync["step_s"] if sync else None,
            "gen_share": sync["gen_share_own"] if sync else None,
            "response_length_mean": sync["response_length_mean"] if sync else None,
            "step_s": {r["mode"]: r["step_s"] for r in ok},
            "speedup": {"overlap_colocated": colo["speedup_vs_sync"] if colo else None,
                        "overlap_split": best["speedup_vs_sync"] if best else None,
                        # only where measured: sweeps from before these modes keep their layout
                        **{m: v for m, v in extra.items() if v is not None},
                        **({"split_partial": best_partial["speedup_vs_sync"]} if best_partial else {})},
            "best_split": ({"mode": best["mode"], "ratio": best["ratio"]} if best else None),
            **({"best_split_partial": {"mode": best_partial["mode"], "ratio": best_partial["ratio"]}}
               if best_partial else {}),
            "gpu_busy_fraction": {r["mode"]: r.get("gpu_busy_fraction") for r in ok},
            "gpu_busy_timed": {r["mode"]: r.get("gpu_busy_timed") for r in ok},
            "skipped": {r["mode"]: r["skipped"] for r in at if "skipped" in r},
            # parts run on different machines: the speed-ups then compare hosts as well as modes
            "mixed_hosts": len({r.get("host") for r in ok}) > 1,
        })
    return points


def write(rows: list[dict], args, device: str, stem: Path) -> None:
    points = summarize_points(rows)
    doc = {"device": device, "commit": modes.commit(), **settings_of(args), "notes": NOTES, "points": points,
           "rows": rows}
    Path(f"{stem}.json.tmp").write_text(json.dumps(doc, indent=2))
    Path(f"{stem}.json.tmp").replace(f"{stem}.json")  # a reader (or a cut call) never sees half a file
    if any(p["gen_share"] is not None for p in points):
        try:
            plot(points, f"{args.model} on {device}, {args.prompts} prompts x {args.n}", Path(f"{stem}.png"))
        except ImportError:
            print("matplotlib missing: no plot", file=sys.stderr)


def plot(points: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, style in (("overlap_colocated", "o-"), ("overlap_split", "s-"), ("overlap_stream", "v-"),
                        ("overlap_proc", "P-"), ("overlap_partial", "d-"), ("split_partial", "X-")):
        pts = [(p["gen_share"], p["speedup"].get(mode), p) for p in points
               if p["gen_share"] is not None and p["speedup"].get(mode) is not None]
        if not pts:
            continue
        pts.sort(key=lambda x: x[0])
        ratio_key = {"overlap_split": "best_split", "split_partial": "best_split_partial"}.get(mode)
        label = mode + (" (best R:T per point)" if ratio_key else "")
        ax1.plot([x for x, _, _ in pts], [y for _, y, _ in pts], style, label=label)
        for x, y, p in pts:
            tag = f'{p["length_mean"]}' + (f' {p[ratio_key]["ratio"]}' if ratio_key and p.get(ratio_key) else "")
            ax1.annotate(tag, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.axhline(1.5, color="tab:green", lw=0.8, ls="--", label="1.5× target")
    ax1.axhline(0.97, color="tab:red", lw=0.8, ls=":", label="0.97× floor")
    ax1.set_xlabel("generation share of the sync step")
    ax1.set_ylabel("speed-up over sync (sync step / mode step)")
    ax1.set_xlim(0, 1)
    ax1.set_title("crossover (labels: mean response length)")
    ax1.legend(fontsize=7)
    for mode, style in (("sync", "k^-"), ("overlap_colocated", "o-"), ("overlap_split", "s-"), ("overlap_stream", "v-"),
                        ("overlap_proc", "P-"), ("overlap_partial", "d-"), ("split_partial", "X-")):
        pts = [(p["length_mean"], min((s for m, s in p["step_s"].items() if m.startswith(mode)), default=None))
               for p in points]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax2.plot(*zip(*pts), style, label=mode)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks([p["length_mean"] for p in points], [str(p["length_mean"]) for p in points])
    ax2.minorticks_off()
    ax2.set_xlabel("mean response length (tokens; lognormal, capped)")
    ax2.set_ylabel("seconds per step")
    ax2.set_title("step time")
    ax2.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- the sweep
class Budget:
    """Wall-clock left to this invocation, and estimates of a run's time from the runs measured so far."""

    def __init__(self, total: float, run_timeout: float, init_s: float):
        self.start = time.perf_counter()
        self.total, self.run_timeout, self.init_s = total, run_timeout, init_s
        self.measured_init: list[float] = []

    def left(self) -> float:
        return self.total - (time.perf_counter() - self.start) if self.total else math.inf

    def timeout(self) -> float | None:
        t = min(self.run_timeout or math.inf, self.left())
        return None if t == math.inf else max(1.0, t)

    def note_run(self, wall: float | None, all_steps: list[dict]) -> None:
        if wall is not None and all_steps:
            self.measured_init.append(max(0.0, wall - sum(map(modes.step_time, all_steps))))

    def estimate(self, step_s: float | None, steps: float) -> float | None:
        if step_s is None:
            return None
        init = max(self.measured_init) if self.measured_init else self.init_s
        return init + steps * step_s * 1.1

    def stall_limit(self, step_s: float | None) -> float | None:
        """Seconds a run may go without logging a step before it counts as hung: twice a start-up plus twice a
        step (a slow run is still far inside it; an engine that never comes up is stopped long before the
        budget). None before any sync step is known."""
        if step_s is None:
            return None
        init = max(self.measured_init) if self.measured_init else self.init_s
        return 2 * init + 2.2 * step_s

    def why_not(self, step_s: float | None, steps: float) -> str | None:
        """A reason to skip a run that cannot finish in time, or None (``steps``: in sync-step equivalents)."""
        est, left = self.estimate(step_s, steps), self.left()
        limit = min(left, self.run_timeout or math.inf)
        if est is not None and est > limit:
            which = "--run-timeout" if limit < left else "--budget"
            return (f"not started: estimated {est:.0f} s (start-up + {steps:.1f} sync steps of ~{step_s:.1f} s) "
                    f"> {limit:.0f} s left ({which})")
        if left < (max(self.measured_init) if self.measured_init else self.init_s):
            return f"not started: {left:.0f} s left of --budget, less than a run's start-up"
        return None


def expected_step(mean: int, rows: list[dict]) -> float | None:
    """This point's sync step if measured, else the nearest measured shorter point's scaled up by length, or with
    only longer points measured the shortest one's scaled down by length, to a quarter at least (start-up and the
    update's fixed costs; with no floor at all the 4k step, 33 s on 2xH200, would size a 256 run as 33 s a step and skip
    it, where it takes 2.2 s)."""
    syncs = {r["length_mean"]: r["step_s"] for r in rows if r["mode"] == "sync" and "step_s" in r}
    if mean in syncs:
        return syncs[mean]
    if not syncs:
        return None
    below = [m for m in syncs if m < mean]
    if below:
        ref = max(below)
        return syncs[ref] * mean / ref
    ref = min(syncs)
    return syncs[ref] * max(0.25, mean / ref)


def steps_in_sync_steps(name: str, mean: int, rows: list[dict], args) -> float:
    """A run's steps counted in sync steps of its point: an overlap run's warm-up steps generate in the foreground
    (a sync step each); its measured steps take about the longer side, max(gen, rest), plus 30% for the two sides
    slowing each other, and never count more than 1.1 sync steps."""
    if name == "sync":
        return float(args.stop_after)
    if name.startswith("split_partial"):
        # the pool fills over the first two steps (49-60 s against sync's 38 s at 4k on 4xH200); after them the
        # rollout ranks' throughput sets the cadence (0.52-0.68 of a sync step there): 1.5 and 0.8 leave room
        return 1.5 * min(args.warmup, 2) + 0.8 * (max(0, args.warmup - 2) + args.measure)
    share = next((r.get("gen_share_own") for r in rows if r["length_mean"] == mean and r["mode"] == "sync"
                  and "step_s" in r), None)
    factor = 1.1 if share is None else min(1.1, 1.3 * max(share, 1 - share))
    return args.warmup + args.measure * factor


def run_one(name: str, mode_ovr: list[str], mean: int, cap: int, args, budget: Budget, rows: list[dict],
            runs_dir: Path) -> dict | None:
    """One run's row (measured or skipped with the reason); None with --resume when it is measured already."""
    if args.resume and any(r["length_mean"] == mean and r["mode"] == name and "step_s" in r for r in rows):
        return None
    base = {"length_mean": mean, "cap": cap, "forced_lengths": f"lognormal:{mean}:{args.sigma}", "mode": name,
            "overrides": mode_ovr}
    if "trainer.placement=split" in mode_ovr:
        r = next((int(o.split("=")[1]) for o in mode_ovr if o.startswith("trainer.rollout_ranks=")), args.gpus // 2)
        base.update(rollout_ranks=r, ratio=f"{r}:{args.gpus - r}")
    run_ovr = point_overrides(mean, cap, args) + mode_ovr
    steps = run_steps(args, run_ovr)
    if steps != args.steps:
        mode_ovr = [*mode_ovr, f"trainer.total_steps={steps}"]  # after modes.run_mode's own, so it wins
        run_ovr = point_overrides(mean, cap, args) + mode_ovr
    err = check_config(args, run_ovr)
    if err:
        return {**base, "skipped": f"invalid setting: {err}"}
    why = budget.why_not(expected_step(mean, rows), steps_in_sync_steps(name, mean, rows, args))
    if why:
        return {**base, "skipped": why}
    run_args = copy.copy(args)
    run_args.overrides = [*args.overrides, *point_overrides(mean, cap, args)]
    run_args.mode_timeout = budget.timeout()
    run_args.stall_timeout = budget.stall_limit(expected_step(mean, rows))
    out_dir = runs_dir / f"L{mean}"
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res = modes.run_mode(name, mode_ovr, run_args, out_dir)
    all_steps = measure_metrics(out_dir / f"run_{name}")
    if "error" in res:
        logged = len(all_steps)
        if res["error"].startswith("stalled"):
            return {**base, "skipped": f"{res['error']} after {time.perf_counter() - t0:.0f} s: hung, stopped",
                    "stderr_tail": res.get("stderr_tail", "")[-1500:]}
        if "timed out" in res["error"]:
            reason = (f"did not finish: {logged} of {args.stop_after} steps logged after "
                      f"{time.perf_counter() - t0:.0f} s (limit {run_args.mode_timeout:.0f} s: --run-timeout or "
                      "what was left of --budget)")
            return {**base, "skipped": reason, "stderr_tail": res.get("stderr_tail", "")[-1500:]}
        return {**base, "skipped": f"run failed ({res['error']})", "stderr_tail": res.get("stderr_tail", "")[-1500:]}
    budget.note_run(res.get("wall_s"), all_steps[:args.stop_after])
    res.pop("overrides", None)
    row = {**base, **res}
    if name == "sync":  # the point's generation share; an overlap step's gen runs beside it, so no share there
        row["gen_share_own"] = row["phases_s"].get("gen", 0.0) / row["step_s"] if row["step_s"] > 0 else None
    row["gpu_busy_timed"] = busy_from_timings(row, mode_ovr, args.gpus)
    row["step_s_each"] = [modes.step_time(r) for r in all_steps[args.warmup:args.stop_after]]
    row.update(warmup=args.warmup, steps_per_run=steps, commit=modes.commit(), host=socket.gethostname())
    return row


def run_steps(args, overrides: list[str]) -> int:
    """The steps a run is started with (``trainer.total_steps``; it is stopped after ``--warmup`` + ``--measure``):
    one more than it measures, or with partial rollouts the pool's steps more, so that no measured step is one of
    the run's last ``pool_steps``, where the pool drains (see the module docstring)."""
    try:
        from hybrid_rl.config import load_config
        trainer = load_config(args.recipe, [f"model.path={args.model}", *args.overrides, *overrides]).trainer
    except Exception:  # noqa: BLE001  (check_config reports a bad setting; here the default stands)
        return args.steps
    return args.stop_after + trainer.partial_pool_steps if trainer.partial_rollouts else args.steps


def check_config(args, overrides: list[str]) -> str | None:
    """The trainer's own validation of one run's settings (e.g. a batch that the ranks cannot share)."""
    try:
        from hybrid_rl.config import ConfigError, load_config
    except ImportError:
        return None
    ovr = [f"model.path={args.model}", f"trainer.total_steps={args.steps}", *args.overrides, *overrides]
    try:
        load_config(args.recipe, ovr).validate(args.gpus)
    except ConfigError as e:
        return str(e)
    except Exception:  # noqa: BLE001  (anything else is the run's to report, with its traceback)
        return None
    return None


def wanted_modes(args) -> set[str]:
    names = {m.strip() for m in args.modes.split(",") if m.strip()}
    bad = names - set(MODES)
    if bad:
        raise SystemExit(f"--modes: unknown {sorted(bad)}; choose from {','.join(MODES)}")
    return names


def sweep(args, device: str, stem: Path) -> list[dict]:
    rows: list[dict] = []
    if Path(f"{stem}.json").exists() and not args.fresh:
        doc = json.loads(Path(f"{stem}.json").read_text())
        mine = comparable(settings_of(args))
        theirs = comparable({k: doc.get(k) for k in mine})
        if theirs != mine:
            diff = {k: (theirs[k], mine[k]) for k in mine if theirs[k] != mine[k]}
            raise SystemExit(f"{stem}.json holds a sweep with other settings {diff} (theirs, these); pass --fresh to "
                             "replace it or --tag to write beside it")
        rows = doc["rows"]
    want = wanted_modes(args)
    families = [f for f in SPLIT_FAMILIES if f in want] if args.gpus >= 2 else []
    auto, fixed = parse_ratios(args.split_ratios, args.gpus) if families else (False, [])
    budget = Budget(args.budget, args.run_timeout, args.init_s)
    for mean, cap in zip(*lengths_and_caps(args)):
        for name, ovr in modes.build_modes(args.gpus):
            if name in want - {"overlap_split"}:  # sync first: the split ratio and the estimates come from it
                rows = _run_and_record(name, ovr, mean, cap, args, budget, rows, device, stem)
        ranks = set(fixed)
        if auto and families:
            sync = next((r for r in rows if r["length_mean"] == mean and r["mode"] == "sync" and "step_s" in r), None)
            ranks.add(auto_rollout_ranks(sync["gen_share_own"], args.gpus) if sync else args.gpus // 2)
        if "overlap_split" in families:
            for name, ovr in split_runs(args.gpus, sorted(ranks), args.split_overrides):
                rows = _run_and_record(name, ovr, mean, cap, args, budget, rows, device, stem)
        for extra in EXTRA_MODES:
            if extra[0] in want:
                rows = _run_and_record(*extra, mean, cap, args, budget, rows, device, stem)
        if "split_partial" in families:  # last: the newest mode, skipped first when the budget runs short
            for name, ovr in split_runs(args.gpus, sorted(ranks), args.split_overrides, "split_partial",
                                        parse_aheads(args.partial_aheads)):
                rows = _run_and_record(name, ovr, mean, cap, args, budget, rows, device, stem)
    return rows


def _run_and_record(name: str, ovr: list[str], mean: int, cap: int, args, budget: Budget, rows: list[dict],
                    device: str, stem: Path) -> list[dict]:
    """Run (or skip) one (length, mode), rewrite the JSON and plot, print its line; the merged rows."""
    row = run_one(name, ovr, mean, cap, args, budget, rows, Path(f"{stem}_runs"))
    if row is None:
        return rows  # --resume: measured already
    rows = merge(rows, [row])
    write(rows, args, device, stem)
    print(json.dumps({"device": device, "commit": modes.commit(), **_brief(rows, mean, name)}), flush=True)
    return rows


def dry_run(args) -> int:
    """Print each run's overrides and whether the trainer's config accepts them; the number refused."""
    want = wanted_modes(args)
    families = [f for f in SPLIT_FAMILIES if f in want] if args.gpus >= 2 else []
    auto, fixed = parse_ratios(args.split_ratios, args.gpus) if families else (False, [])
    ranks = list(range(1, args.gpus)) if auto else fixed
    bad = 0
    for mean, cap in zip(*lengths_and_caps(args)):
        plan = [m for m in modes.build_modes(args.gpus) if m[0] in want - {"overlap_split"}]
        if "overlap_split" in families:
            plan += split_runs(args.gpus, ranks, args.split_overrides)
        plan += [extra for extra in EXTRA_MODES if extra[0] in want]
        if "split_partial" in families:
            plan += split_runs(args.gpus, ranks, args.split_overrides, "split_partial", parse_aheads(args.partial_aheads))
        for name, ovr in plan:
            err = check_config(args, point_overrides(mean, cap, args) + ovr)
            bad += err is not None
            steps = run_steps(args, point_overrides(mean, cap, args) + ovr)
            print(json.dumps({"length_mean": mean, "cap": cap, "mode": name, "steps": steps,
                              "overrides": point_overrides(mean, cap, args) + ovr, "config": err or "ok"}))
    return bad


def lengths_and_caps(args) -> tuple[list[int], list[int]]:
    lengths = [int(x) for x in args.lengths.split(",")]
    caps = [int(c) for c in args.caps.split(",")] if args.caps else []
    if caps and len(caps) != len(lengths):
        raise SystemExit(f"--caps gives {len(caps)} caps for {len(lengths)} --lengths; give one per length")
    return lengths, caps or [int(math.ceil(m * args.cap_factor)) for m in lengths]


def _brief(rows: list[dict], mean: int, name: str) -> dict:
    r = next(r for r in rows if r["length_mean"] == mean and r["mode"] == name)
    keys = ("length_mean", "cap", "mode", "ratio", "step_s", "gen_share", "speedup_vs_sync", "gpu_busy_fraction",
            "gpu_busy_timed", "prefix_cache_hit", "logprob_diff", "skipped")
    return {k: r[k] for k in keys if k in r}


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:qwen2.5-0.5b-random")
    ap.add_argument("--recipe", default=str(ROOT / "benchmarks" / "bench_modes.yaml"))
    ap.add_argument("--gpus", type=int, default=1, help="ranks per run (torchrun --nproc_per_node)")
    ap.add_argument("--prompts", type=int, default=24, help="data.train_batch_size (all ranks), the same at every length")
    ap.add_argument("--n", type=int, default=8, help="rollout.n")
    ap.add_argument("--lengths", default="256,1024,4096,8192", help="mean response lengths (lognormal means)")
    ap.add_argument("--sigma", type=float, default=0.8, help="lognormal sigma of the response lengths (the tail)")
    ap.add_argument("--cap-factor", type=float, default=2.0,
                    help="cap = data.max_response_length = ceil(factor x mean); draws above it are cut to it")
    ap.add_argument("--caps", default="", help="explicit caps, one per --lengths entry (instead of --cap-factor)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--split-ratios", default="auto",
                    help="ROLLOUT:TRAINER GPU counts for overlap_split, e.g. 1:3,2:2; 'auto' picks R = round(GPUs x the "
                         "point's sync generation share) (half the GPUs if sync did not run); both may be given")
    ap.add_argument("--split-override", dest="split_overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="an override for the split runs only (repeatable), e.g. rollout.vllm.gpu_memory_utilization=0.6: "
                         "their rollout GPUs hold nothing but the engine")
    ap.add_argument("--partial-aheads", default="",
                    help="split_partial: one run per trainer.partial_rollout_ahead value at each ratio, e.g. 0.25,1.0 "
                         "(named split_partial..._a<value>; the family's best is kept per point); empty: the recipe's")
    ap.add_argument("--warmup", type=int, default=1, help="steps dropped at the start of each run")
    ap.add_argument("--measure", type=int, default=2, help="steps measured per run (one more runs but is not waited for)")
    ap.add_argument("--token-budget", type=int, default=0,
                    help="actor.use_dynamic_bsz with this many tokens per micro-batch, raised per point to hold one "
                         "prompt + cap (0: the recipe's micro-batch sizes)")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds for this whole invocation (0: no limit)")
    ap.add_argument("--run-timeout", type=float, default=0.0, help="seconds for one run (0: no limit but --budget)")
    ap.add_argument("--init-s", type=float, default=60.0,
                    help="start-up estimate of a run (model load, engine init) until one has been measured")
    ap.add_argument("--out", default=None, help="run directory (default runs/modes_sweep/<UTC time>/; "
                    "benchmarks/publish.py copies a result to benchmarks/results/)")
    ap.add_argument("--tag", default="", help="suffix for the result files")
    ap.add_argument("--fresh", action="store_true", help="replace the JSON already there instead of merging into it")
    ap.add_argument("--resume", action="store_true",
                    help="run only what the JSON already there has not measured (a part cut short, called again)")
    ap.add_argument("--dry-run", action="store_true",
                    help="run nothing: validate every (length, mode) setting with the trainer's config checks and print "
                         "the plan (with 'auto', every ratio it could pick)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny model on CPU, 2 gloo ranks, short lengths: checks the plumbing only")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_intermixed_args(argv)  # key=value overrides may follow options
    if args.cpu_smoke:
        args.model, args.prompts, args.n = "builtin:tiny-qwen2", 8, 4
        args.gpus = args.gpus if args.gpus > 1 else 2
        if args.lengths == ap.get_default("lengths"):
            args.lengths = "8,24"
        if args.split_ratios == "auto":
            args.split_ratios = "1:1"
        args.measure = min(args.measure, 1)
        # the synthetic task's prompts, short: the smoke checks the plumbing, on 2 CPU ranks
        args.overrides = ["trainer.device=cpu", "rollout.name=hf", "actor.ppo_mini_batch_size=8",
                          "actor.ppo_micro_batch_size_per_device=8",
                          "data.train_path=synthetic:successor", "data.task=successor", "data.max_prompt_length=32",
                          *args.overrides]
    args.overrides = [*args.overrides, f"data.train_batch_size={args.prompts}", f"rollout.n={args.n}"]
    args.steps = args.warmup + args.measure + 1  # the last step is not waited for (see the docstring)
    args.stop_after = args.warmup + args.measure
    args.mode_timeout = None
    args.max_prompt_length = _max_prompt_length(args)
    return args


def _max_prompt_length(args) -> int:
    try:
        from hybrid_rl.config import load_config

        return load_config(args.recipe, [f"model.path={args.model}", *args.overrides]).data.max_prompt_length
    except Exception:  # noqa: BLE001  (only sizes the token budget; the runs report a bad config themselves)
        return 1024


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        sys.exit(1 if dry_run(args) else 0)
    out = run_dir("modes_sweep", args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = f"cpux{args.gpus}" if args.cpu_smoke else modes.device_name(args.gpus)
    if device == "CPU":
        device = f"cpux{args.gpus}"
    model_tag = args.model.split(":")[-1].split("/")[-1]
    stem = out / f"modes_sweep_{device}_{model_tag}{args.tag}"
    sweep(args, device, stem)
    print(f"wrote {stem}.json" + (" and .png" if Path(f"{stem}.png").exists() else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
