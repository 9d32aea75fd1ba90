"""The 7B recipe on one box with long responses: step time, phases, update MFU, and each phase's peak memory beside
the memory planner's prediction for the same config.

    python benchmarks/scale_7b.py --gpus 8                        # every run below, into runs/scale_7b/<UTC time>/
    python benchmarks/scale_7b.py --gpus 4 --runs mean8k_sp1      # one run
    python benchmarks/scale_7b.py --gpus 1 --runs mean8k_sp1 --out D actor.optimizer_offload=true ref.offload=true
                                                                  # one GPU, full fine-tuning, with the offloads that
                                                                  # `make plan` names for it
    python benchmarks/scale_7b.py --gpus 1 --runs mean2k_sp1 --mean 2048 --tag lora64 --out D model.lora.rank=64
                                                                  # one GPU, LoRA: added to D's JSON as mean2k_sp1_lora64
    python benchmarks/scale_7b.py --cpu-smoke                     # plumbing only: tiny model, 2 CPU ranks, ~2 minutes
    python benchmarks/scale_7b.py --summarize D/scale_7b_H200x1.json   # no run: its runs' figures read again from D
    python benchmarks/scale_7b.py --summarize D/scale_7b_H200x1.json --merge E/scale_7b_H200x1.json
                                                                  # and E's runs that D's JSON lacks added to it

Runs ``recipes/gsm8k_grpo_7b.yaml`` (``python -m hybrid_rl train`` under torchrun, through ``modes.run_mode``) with
``builtin:qwen2.5-7b-random`` (Qwen2.5-7B's shape with random weights: no download; built once per host before the
first run, 15.2 GB in ``$HYBRID_RL_CACHE``) on the GSM8K prompts shipped in ``benchmarks/data/``, ``--prompts`` × 8
samples per step (default 4 prompts per GPU: 32 on 8, 4 on one) in 4 mini-batches, no validation or checkpoints. A
random model does not end its responses, so the response lengths are forced (``rollout.forced_lengths``), capped at
16,384 tokens with the token budget raised to one prompt + cap (16,896):

  mean8k_sp1               lognormal:8192:0.8 (mean 8k, long tail cut at the cap; ``--mean`` sets another mean, which
                           names the run: mean2k_sp1), no sequence parallelism
  fixed16k_sp1/sp2/sp4     every response 16,384 tokens, actor.ulysses_sequence_parallel_size 1 / 2 / 4 (the sizes
                           that divide the GPUs)

On fewer GPUs than the recipe's ``rollout.vllm.tensor_parallel_size`` (2), the engine spans the largest size that
divides them (one GPU: 1). ``--tag`` appends a name to each run (settings of one kind, e.g. ``model.lora.rank=64``;
``--runs`` takes either name); runs are added to the JSON already in ``--out`` (a run of the same name replaced), each
with its own settings and commit, so that the runs of several commands make one result.

Per run, over the measured steps (after ``--warmup``): step time and its phases, generated tokens/s, the update's
MFU (``perf/mfu_update``: the FLOPs it ran ÷ time ÷ the GPUs' dense bf16 peak; ``_equiv`` counts every sample's
prompt whole) and the log-prob pass's, the switch (``timing/switch``: engine wake, push, sleep, onload), every measured
step's metrics (``per_step``), and per phase the measured peak (``perf/phase_memory_allocated_gb/<phase>``, the largest over steps
and ranks; the engine's pool, ``perf/engine_pool_gb``, taken off the training phases, which run with it asleep) beside
the planner's figure for that phase on this GPU (``hybrid_rl.planner``: generation, old log-prob, reference, update;
the push is not a timed phase of its own), and its figure at the largest micro-batch the phase computed
(``perf/phase_micro_batch_tokens/<phase>``: the memory model apart from the worst-case lengths it plans for). Writes ``scale_7b_<device>.json`` and ``.png`` (another ``--model``:
``scale_7b_<device>_<model name>.json``, e.g. ``scale_7b_H200x1_qwen2.5-1.5b-random.json``) and each run's directory
(``run_<name>/``: metrics.jsonl, stderr.log) into ``--out`` (default ``runs/scale_7b/<UTC time>/``); into
``benchmarks/results/`` only through ``benchmarks/publish.py``. A run that fails is one line naming it and its log; exit status 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT))

import modes  # noqa: E402  (benchmarks/modes.py: run_mode, summarize, device_name)
from bench_common import run_dir  # noqa: E402

from phase_memory import PLANNED, TRAINING, from_rows  # noqa: E402  (timed phase → the planner's; its peaks)

RECIPE = ROOT / "recipes" / "gsm8k_grpo_7b.yaml"
DATA = ROOT / "benchmarks" / "data" / "gsm8k_train_1k.jsonl"
GPU = dict(model="builtin:qwen2.5-7b-random", prompts=None, prompts_per_gpu=4, warmup=1, measure=2, run_timeout=2400.0,
           cap=16384, mean=8192, sp_sizes=(1, 2, 4), overrides=[])
CPU_SMOKE = dict(model="builtin:tiny-qwen2", prompts=8, warmup=1, measure=1, run_timeout=240.0, cap=32, mean=16,
                 sp_sizes=(2,), overrides=["trainer.device=cpu", "rollout.name=hf", "model.dtype=float32",
                                           "data.max_prompt_length=384", "actor.use_remove_padding=true"])
"""``--cpu-smoke``: the same runs on the tiny model (2 gloo ranks, the transformers engine); its figures mean nothing."""


def runs(args) -> list[tuple[str, list[str]]]:
    """(name, overrides) of every run: the long-tailed one, then the fixed-length ones per sequence-parallel size."""
    tag = f"_{args.tag}" if args.tag else ""
    out = [(f"mean{args.mean // 1024 or args.mean}{'k' if args.mean >= 1024 else ''}_sp1{tag}",
            [f"rollout.forced_lengths=lognormal:{args.mean}:0.8"])]
    cap = f"{args.cap // 1024}k" if args.cap >= 1024 else str(args.cap)
    out += [(f"fixed{cap}_sp{sp}{tag}",
             [f"rollout.forced_lengths=fixed:{args.cap}", f"actor.ulysses_sequence_parallel_size={sp}"])
            for sp in args.sp_sizes if args.gpus % sp == 0]
    return out


def selected(every: list[tuple[str, list[str]]], names: list[str], tag: str
             ) -> tuple[list[tuple[str, list[str]]], set[str]]:
    """The runs ``--runs`` names (all when it names none), by their full name or the name ``--tag`` extends
    (``mean8k_sp1`` or ``mean8k_sp1_lora64``), and the names that match none."""
    def base(name: str) -> str:
        return name.removesuffix(f"_{tag}") if tag else name

    known = {n for n, _ in every} | {base(n) for n, _ in every}
    return [r for r in every if not names or r[0] in names or base(r[0]) in names], set(names) - known


def engine_tp(recipe_tp: int, gpus: int) -> int:
    """The recipe's engine tensor-parallel size, or the largest size below it that divides ``gpus``."""
    return max(d for d in range(1, min(recipe_tp, gpus) + 1) if gpus % d == 0)


def base_overrides(args) -> list[str]:
    """What every run sets on top of the recipe: local prompts, the batch, the cap and its budget, no validation, and
    an engine no wider than the GPUs (the command's own overrides come last and win)."""
    from hybrid_rl.config import load_config

    cfg = load_config(str(args.recipe), [f"model.path={args.model}", *args.overrides])
    prompt, tp = cfg.data.max_prompt_length, cfg.rollout.vllm.tensor_parallel_size
    fit = engine_tp(tp, args.gpus)
    return [f"data.train_path={DATA}", "data.val_path=null", "trainer.val_before_train=false", "trainer.test_freq=0",
            "trainer.save_freq=-1", f"data.train_batch_size={args.prompts}",
            f"actor.ppo_mini_batch_size={max(args.prompts // 4, 1)}", f"data.max_response_length={args.cap}",
            "actor.use_dynamic_bsz=true", f"actor.max_token_len_per_device={max(16384, prompt + args.cap)}",
            *([f"rollout.vllm.tensor_parallel_size={fit}"] if fit != tp else []), *args.overrides]


def predicted(args, overrides: list[str], gpu_gib: float, micro_tokens: dict[str, int] | None = None) -> dict:
    """The planner on this run's config: each phase's peak (GiB per GPU) and the verdict line; with ``micro_tokens``
    (timed phase → the largest micro-batch the run logged) also each phase at those micro-batches."""
    from hybrid_rl.config import load_config
    from hybrid_rl.planner.estimate import GIB, phases
    from hybrid_rl.planner.shape import read_shape
    from hybrid_rl.planner.verdict import judge

    cfg = load_config(str(args.recipe), [f"model.path={args.model}", *overrides]).validate(args.gpus)
    shape = read_shape(cfg.model.path)
    all_phases, verdict = judge(cfg, shape, args.gpus, gpu_gib * GIB)
    out = {"phases_gib": {p.name: p.total / GIB for p in all_phases}, "verdict": verdict.line,
           "engine_share_gib": cfg.rollout.vllm.gpu_memory_utilization * gpu_gib if cfg.rollout.name == "vllm" else None}
    if micro_tokens:
        at = {PLANNED[k]: t for k, t in micro_tokens.items() if k in PLANNED}
        out["phases_at_run_micro_batches_gib"] = {p.name: p.total / GIB
                                                   for p in phases(cfg, shape, args.gpus, gpu_gib * GIB, at)}
    return out


def measured(run_dir: Path, args) -> dict:
    """MFU and per-phase peaks from the measured steps of ``metrics.jsonl``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/step" in r][args.warmup:args.stop_after]
    mean = lambda k: statistics.fmean(r[k] for r in rows) if all(k in r for r in rows) else None  # noqa: E731
    return {**from_rows(rows), "mfu_update": mean("perf/mfu_update"), "mfu_update_equiv": mean("perf/mfu_update_equiv")}


def one_run(name: str, overrides: list[str], args, out_dir: Path, gpu_gib: float) -> dict:
    try:  # the trainer's own checks first: a setting it refuses is not started
        plan = predicted(args, [*args.base, *overrides], gpu_gib)
    except Exception as e:  # noqa: BLE001  (ConfigError, or anything else that rejects the config)
        return {"mode": name, "overrides": overrides, **settings(args),
                "error": f"invalid setting: {str(e).splitlines()[0]}"}
    res = modes.run_mode(name, overrides, args, out_dir)
    if "error" in res:
        return {**res, **settings(args), "planner": plan}
    got = measured(out_dir / f"run_{name}", args)
    at_run = predicted(args, [*args.base, *overrides], gpu_gib, got["micro_batch_tokens"]).get(
        "phases_at_run_micro_batches_gib", {})
    memory = {phase: {"measured_gib": got["phase_peak_gib"].get(phase), "predicted_gib": plan["phases_gib"].get(planned),
                      "micro_batch_tokens": got["micro_batch_tokens"].get(phase),
                      "predicted_at_run_micro_batches_gib": at_run.get(planned)}
              for phase, planned in PLANNED.items() if planned in plan["phases_gib"]}
    keep = ("step_s", "trainer_step_s", "phases_s", "gen_tokens_per_s", "trained_tokens_per_s", "engine_gen_tokens_per_s",
            "response_length_mean", "steps_measured", "wall_s", "gpu_busy_fraction")
    return {"mode": name, "overrides": overrides, **settings(args), **{k: res[k] for k in keep if k in res},
            "mfu_update": got["mfu_update"], "mfu_update_equiv": got["mfu_update_equiv"], **step_figures(res),
            "memory": memory,
            "engine_pool": {"measured_gib": got["engine_pool_gb"], "predicted_gib": plan["engine_share_gib"]},
            "peak_outside_engine": {"measured_gib": got["peak_outside_engine_gib"],
                                    "predicted_gib": max((plan["phases_gib"].get(PLANNED[p], 0.0) for p in TRAINING))},
            "planner": plan}


def step_figures(res: dict) -> dict:
    """From ``modes.summarize``'s figures: the log-prob pass's MFU, the switch (engine wake, push, sleep, onload: the
    step's ``timing/switch``) and every measured step's logged metrics."""
    rows = res.get("per_step", [])
    switch = [r["timing/switch"] for r in rows if "timing/switch" in r]
    return {"mfu_log_prob": res.get("mfu_log_prob"), "switch_s": statistics.fmean(switch) if switch else None,
            "per_step": rows}


def summarize_again(path: Path) -> list[dict]:
    """``--summarize``: each run that ``path`` holds, its figures read again from its directory beside ``path``
    (``run_<name>/metrics.jsonl``: the same measured steps, by the warm-up and count it recorded), its settings,
    commit and the planner's figures as recorded. A run whose directory is missing is kept as it is."""
    doc = json.loads(path.read_text())
    for run in doc["runs"]:
        run_dir = path.parent / f"run_{run['mode']}"
        if "error" in run or not (run_dir / "metrics.jsonl").exists():
            continue
        ns = argparse.Namespace(prompts=run["prompts"], n=doc["n"], warmup=run["warmup"],
                                stop_after=run["warmup"] + run["measured_steps"])
        res = modes.summarize(run["mode"], run["overrides"], run_dir, ns, run.get("wall_s"), run.get("gpu_busy_fraction"))
        if abs(res["step_s"] - run["step_s"]) > 1e-6 * run["step_s"]:
            raise SystemExit(f"error: {run_dir}: its measured steps give {res['step_s']:.3f} s a step, the JSON says "
                             f"{run['step_s']:.3f}: not the directory of that run")
        run.update(step_figures(res))
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return doc["runs"]


def merge_into(path: Path, other: Path) -> None:
    """``--merge``: the runs of ``other`` that ``path`` does not hold by name, added to ``path`` (each run keeps its
    own settings and commit; ``path``'s own runs, and its commit, stay). ValueError when the two are not results of
    this script for the same model and device."""
    doc, add = json.loads(path.read_text()), json.loads(other.read_text())
    for key in ("bench", "model", "device"):
        if doc.get(key) != add.get(key):
            raise ValueError(f"{other} has {key} {add.get(key)!r}, {path} {doc.get(key)!r}: only runs of the same "
                             f"model on the same device make one result")
    have = {r["mode"] for r in doc["runs"]}
    doc["runs"] += [r for r in add["runs"] if r["mode"] not in have]
    path.write_text(json.dumps(doc, indent=2) + "\n")


def result_stem(device: str, model: str, default_model: str) -> str:
    """``scale_7b_<device>``; another model's runs go to a file of their own, ``scale_7b_<device>_<model name>``."""
    return f"scale_7b_{device}" if model == default_model else f"scale_7b_{device}_{model.split(':')[-1].split('/')[-1]}"


def settings(args) -> dict:
    """What one run ran with beyond its own overrides (runs of several commands share a JSON)."""
    return {"commit": modes.commit(), "base_overrides": args.base, "prompts": args.prompts, "warmup": args.warmup,
            "measured_steps": args.measure}


def merged(path: Path, results: list[dict], model: str) -> list[dict]:
    """The runs already in ``path`` (same model), with ``results`` added and those of the same name replaced."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return list(results)
    if doc.get("model") != model:
        return list(results)
    new = {r["mode"] for r in results}
    return [r for r in doc.get("runs", []) if r.get("mode") not in new] + list(results)


def table(results: list[dict]) -> str:
    lines = [f"{'run':16s} {'step s':>8s} {'gen s':>7s} {'update s':>9s} {'MFU upd':>8s}  peak GiB measured / planned"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['mode']:16s} FAILED: {r['error']}")
            continue
        mfu = f"{r['mfu_update']:.0%}" if r.get("mfu_update") is not None else "-"
        mem = ", ".join(f"{p} {m['measured_gib']:.1f}/{m['predicted_gib']:.1f}" if m["measured_gib"] is not None
                        else f"{p} -/{m['predicted_gib']:.1f}" for p, m in r["memory"].items())
        lines.append(f"{r['mode']:16s} {r['step_s']:8.1f} {r['phases_s'].get('gen', 0.0):7.1f} "
                     f"{r['phases_s'].get('update', 0.0):9.1f} {mfu:>8s}  {mem}")
    return "\n".join(lines)


def plot(results: list[dict], title: str, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    ok = [r for r in results if "step_s" in r]
    if not ok:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    names, bottom = [r["mode"] for r in ok], [0.0] * len(ok)
    for phase in modes.PHASES:
        vals = [r["phases_s"].get(phase, 0.0) for r in ok]
        if any(vals):
            ax1.bar(names, vals, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(ok):
        mfu = f"\nMFU {r['mfu_update']:.0%}" if r.get("mfu_update") is not None else ""
        ax1.text(i, max(bottom[i], r["step_s"]), f"{r['step_s']:.3g} s{mfu}", ha="center", va="bottom", fontsize=7)
    ax1.set_ylabel("seconds per step (phases: maxima over ranks)")
    ax1.legend(fontsize=7)
    phases = [p for p in PLANNED if any(p in r["memory"] for r in ok)]
    width = 0.8 / max(len(ok), 1)
    for i, r in enumerate(ok):
        xs = [j + i * width for j in range(len(phases))]
        ax2.bar(xs, [r["memory"].get(p, {}).get("measured_gib") or 0.0 for p in phases], width * 0.9, label=r["mode"])
        ax2.scatter(xs, [r["memory"].get(p, {}).get("predicted_gib") or 0.0 for p in phases], color="k", marker="_",
                    s=120, zorder=3, label="planner" if i == 0 else None)
    ax2.set_xticks([j + 0.4 - width / 2 for j in range(len(phases))], phases)
    ax2.set_ylabel("peak GiB per GPU (bars: measured; marks: planner)")
    ax2.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def default_prompts(args: argparse.Namespace) -> None:
    """GPU runs without ``--prompts``: ``prompts_per_gpu`` per GPU, a per-GPU load the same on any number of GPUs
    (once the GPUs are known)."""
    if args.prompts is None and args.gpus:
        args.prompts = GPU["prompts_per_gpu"] * args.gpus


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=None, help="ranks, one per GPU (default: every visible GPU)")
    ap.add_argument("--runs", default="", help="comma-separated run names (default: all; see above)")
    ap.add_argument("--prompts", type=int, default=None, help=f"prompts per step, 8 samples each (default "
                                                              f"{GPU['prompts_per_gpu']} per GPU)")
    ap.add_argument("--warmup", type=int, default=None, help=f"steps dropped (default {GPU['warmup']})")
    ap.add_argument("--measure", type=int, default=None, help=f"steps measured (default {GPU['measure']})")
    ap.add_argument("--run-timeout", type=float, default=None, help=f"seconds per run (default {GPU['run_timeout']:g})")
    ap.add_argument("--mean", type=int, default=None, help=f"mean response length of the lognormal run (default "
                                                          f"{GPU['mean']}; at most the cap, {GPU['cap']})")
    ap.add_argument("--tag", default="", help="appended to each run's name: mean8k_sp1_TAG (letters, digits, _ -)")
    ap.add_argument("--model", default=None, help=f"default {GPU['model']}")
    ap.add_argument("--out", default=None, help="run directory (default runs/scale_7b/<UTC time>/)")
    ap.add_argument("--cpu-smoke", action="store_true", help="the plumbing on CPU: tiny model, 2 gloo ranks")
    ap.add_argument("--summarize", metavar="JSON", default=None,
                    help="start no run: read again the figures of the runs JSON holds from their directories beside "
                         "it, and write JSON and its plot")
    ap.add_argument("--merge", metavar="OTHER", action="append", default=[],
                    help="with --summarize: first add the runs of OTHER (a JSON of this script, the same model and "
                         "device) that JSON does not hold by name; JSON's own runs are kept (repeatable)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = ap.parse_intermixed_args(argv)
    if args.merge and not args.summarize:
        ap.error("--merge adds runs to the JSON that --summarize names; give --summarize JSON")
    base = CPU_SMOKE if args.cpu_smoke else GPU
    for key in ("model", "prompts", "warmup", "measure", "run_timeout"):
        if getattr(args, key) is None:
            setattr(args, key, base[key])
    default_prompts(args)
    args.cap, args.sp_sizes = base["cap"], base["sp_sizes"]
    args.mean = args.mean or base["mean"]
    if not 1 <= args.mean <= args.cap:
        ap.error(f"--mean={args.mean}: must be between 1 and the cap, {args.cap}")
    if args.tag and not all(c.isalnum() or c in "_-" for c in args.tag):
        ap.error(f"--tag={args.tag!r}: letters, digits, _ and - only (it names files)")
    args.overrides = [*base["overrides"], *args.overrides]
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    args.recipe, args.n = RECIPE, 8
    args.stop_after = args.warmup + args.measure
    args.steps = args.stop_after + 1  # the run is stopped once the measured steps are logged
    args.mode_timeout = args.run_timeout
    if args.cpu_smoke:
        args.gpus = args.gpus if args.gpus and args.gpus > 1 else 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize:
        path = Path(args.summarize)
        try:
            for other in args.merge:
                merge_into(path, Path(other))
            every_run = summarize_again(path)
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --summarize {path}: {e}", file=sys.stderr)
            return 2
        doc = json.loads(path.read_text())
        plot(every_run, f"{doc['model']} on {doc['device']}, {doc['n']} samples per prompt", path.with_suffix(".png"))
        print(table(every_run))
        print(f"wrote {path} and .png")
        return 0
    out = run_dir("scale_7b", args.out)
    import torch

    if not args.cpu_smoke:
        if not torch.cuda.is_available():
            print("error: scale_7b.py needs NVIDIA GPUs and vLLM; --cpu-smoke runs its plumbing on CPU", file=sys.stderr)
            return 2
        args.gpus = args.gpus or torch.cuda.device_count()
        default_prompts(args)
    from hybrid_rl.models import resolve_model_path
    from hybrid_rl.planner.gpus import visible_gpu

    device = f"cpux{args.gpus}" if args.cpu_smoke else modes.device_name(args.gpus)
    gpu_gib = visible_gpu()[1] if not args.cpu_smoke else 80.0  # the smoke plans for a nominal 80 GiB card
    args.base = base_overrides(args)
    every = runs(args)
    todo, unknown = selected(every, args.runs, args.tag)
    if unknown:
        raise SystemExit(f"error: --runs: {', '.join(sorted(unknown))} not known; choose from "
                         f"{', '.join(n for n, _ in every)}")
    out.mkdir(parents=True, exist_ok=True)
    print(f"scale_7b: {', '.join(n for n, _ in todo)} on {args.gpus} ranks ({device}), {args.model}; run directory "
          f"{out}", file=sys.stderr, flush=True)
    resolve_model_path(args.model)  # built once here, before any rank waits on it
    run_args = argparse.Namespace(**{**vars(args), "overrides": args.base})
    results = []
    stem = result_stem(device, args.model, (CPU_SMOKE if args.cpu_smoke else GPU)["model"])
    path = out / f"{stem}.json"
    every_run = merged(path, [], args.model)
    for name, ovr in todo:
        print(f"[{name}] {' '.join(ovr)}", file=sys.stderr, flush=True)
        results.append(one_run(name, ovr, run_args, out, gpu_gib))
        every_run = merged(path, results, args.model)
        doc = {"bench": "scale_7b", "device": device, "commit": modes.commit(), "model": args.model,
               "recipe": str(RECIPE.relative_to(ROOT)), "gpus": args.gpus, "gpu_gib": gpu_gib, "n": args.n,
               "overrides": args.base, "runs": every_run}  # each run holds its own settings and commit
        path.write_text(json.dumps(doc, indent=2) + "\n")
    plot(every_run, f"{args.model} on {device}, {args.n} samples per prompt", path.with_suffix(".png"))
    print(table(every_run))
    print(f"wrote {path} and .png")
    failed = [r for r in results if "error" in r]
    for r in failed:
        print(f"FAILED {r['mode']}: {r['error']} (log: {r.get('log')})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
