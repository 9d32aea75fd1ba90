"""Does a real model learn, and as well in every mode? SmolLM2-135M-Instruct on held-out arithmetic.

Runs ``recipes/arith_grpo_smollm2.yaml`` once per mode, one after the other on the same GPUs, with the same seed,
data and number of steps, and writes one JSON and one PNG: greedy accuracy on the 1,000 held-out problems before
and after training with its standard error sqrt(p(1-p)/n), each family's accuracy (200 problems each), the
validation curve against steps and against wall-clock, the step and wall-clock at which accuracy first gained
``--gain`` points, and per step the training reward, response length, the share of answers given as the number
alone (``format_exact``), the engine-vs-trainer log-prob gap (``rollout/logprob_diff``), the samples' staleness and
the share of tokens the off-policy correction truncated or masked. Wall-clock is the loop's own time (the sum of
``timing/iteration``: steps, validations, checkpoints), start-up excluded; each run's whole time is recorded beside
it. The JSON records the test split's name (``data.arith.split`` from each run's resolved ``config.yaml``;
``ordered`` for runs whose config predates the key: problems identified by family and operands in order, so a
test problem's commuted or reworded twin could be a training row, and their figures are not comparable). Where
validation samples are saved (the recipe's ``trainer.validation_data_dir``), each mode's final accuracy is also
compared per question with sync's, and with the mean of the sync seeds when ``sync_seed1`` ran too: the paired
difference, its standard error, and whether it lies within two of them; a run cut short is compared with the others
at the step it reached. Each mode's folder keeps its ``run.json`` (command, exit, wall time, host, steps planned), so
modes run by separate invocations, or on separate machines, collect into one JSON. Each mode's entry also stores its
per-question scores at every validation (``scores``), so that a later collection can take modes from an earlier JSON
(``--include``) and pair its new runs with them per question, without the earlier runs' folders.

Modes (``--modes``, comma-separated; by default the two sync seeds and the modes the README's chooser recommends:
``sync,sync_seed1,overlap,overlap_partial``, and ``split_partial`` with ``--gpus`` 2 or more):

- ``sync``: generate, then train, every step; ``sync_seed1``: the same with ``trainer.seed=1``;
- ``overlap``: one-step overlap, colocated (``trainer.max_staleness=1``; token-level truncated IS, cap 2);
- ``overlap_partial``: overlap colocated with partial rollouts, ``trainer.partial_rollout_ahead=3``,
  ``trainer.max_staleness=4``;
- ``overlap_sequence_mask``, ``overlap_geo_mask``, ``overlap_token_mask``: ``overlap`` with that
  ``algorithm.rollout_correction.method`` at its default knobs; ``overlap_partial_sequence_mask``,
  ``overlap_partial_geo_mask``, ``overlap_partial_token_mask``: the same on ``overlap_partial``, whose samples are
  up to four versions old; ``overlap_partial_ahead1``: partial rollouts at ``make bench``'s setting,
  ``trainer.partial_rollout_ahead=1``, ``trainer.max_staleness=2``;
- ``overlap_proc``: ``overlap`` with vLLM's engine core in a process of its own (``rollout.vllm.engine_process``), so
  the generation running beside the update shares no Python interpreter with it;
- ``split_partial``: split placement (half the GPUs generate, half train) with partial rollouts,
  ``trainer.partial_rollout_ahead=3``, ``trainer.max_staleness=4``.

    python benchmarks/learning_arith.py --gpus 1 --modes sync,sync_seed1,overlap,overlap_partial --out runs/la
    python benchmarks/learning_arith.py --collect runs/learning_arith --json out.json   # from finished runs only
    python benchmarks/learning_arith.py --collect runs/la2 --modes sync,sync_seed1,overlap_geo_mask \
        --include benchmarks/results/learning_arith_smollm2_H200x1.json --json out.json   # sync seeds from before

``--concurrent`` runs the modes at the same time on the same GPUs (a 135M model leaves an H200 mostly idle): their
accuracy is what it would be alone, up to the timing-dependent parts of the asynchronous modes (how far a partial
rollout got before a weight push), but their times are not their own; each such mode's record says so
(``ran_beside``, ``timing_note``) and the table marks it.

On one H200 each mode's 200 steps take ~6-7 minutes (vLLM start-up ~1.5 minutes). Any further ``key=value``
arguments override the recipe in every mode. A run cut by ``--mode-timeout`` keeps what it logged; the JSON says so.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_common import ROOT, git_commit, kill_tree, read_rows, run_dir, torch_device_tag  # noqa: E402

RECIPE = "recipes/arith_grpo_smollm2.yaml"
OVERLAP = ["trainer.mode=overlap", "trainer.max_staleness=1"]
PARTIAL = ["trainer.mode=overlap", "trainer.partial_rollouts=true", "trainer.partial_rollout_ahead=3",
           "trainer.max_staleness=4"]
CORRECTIONS = ("sequence_mask", "geo_mask", "token_mask")
MODES = {
    "sync": ["trainer.mode=sync"],
    "sync_seed1": ["trainer.mode=sync", "trainer.seed=1"],
    "overlap": OVERLAP,
    "overlap_partial": PARTIAL,
    **{f"overlap_{m}": [*OVERLAP, f"algorithm.rollout_correction.method={m}"] for m in CORRECTIONS},
    **{f"overlap_partial_{m}": [*PARTIAL, f"algorithm.rollout_correction.method={m}"] for m in CORRECTIONS},
    "overlap_partial_ahead1": ["trainer.mode=overlap", "trainer.partial_rollouts=true",
                               "trainer.partial_rollout_ahead=1", "trainer.max_staleness=2"],
    "overlap_proc": [*OVERLAP, "rollout.vllm.engine_process=true"],
    "split_partial": ["trainer.placement=split", "trainer.mode=overlap", "trainer.partial_rollouts=true",
                      "trainer.partial_rollout_ahead=3", "trainer.max_staleness=4"],
}
SYNC_SEEDS = ("sync", "sync_seed1")
STEP_CURVES = ["reward/mean", "rollout/response_length_mean", "reward/format_exact", "reward/answer_found",
               "rollout/logprob_diff", "rollout/staleness_mean", "rollout/staleness_max",
               "rollout/token_staleness_mean", "rollout/token_staleness_max", "rollout/is_ratio_mean",
               "rollout/is_ratio_max", "rollout/is_truncated_frac", "rollout/is_masked_frac", "timing/step",
               "timing/iteration",
               "timing/gen", "timing/update", "actor/ppo_kl", "actor/pg_clipfrac"]


def run_mode(mode: str, gpus: int, steps: int, out: Path, overrides: list[str], timeout: float,
             beside: list[str] | None = None) -> dict:
    """Train one mode into ``out/mode``; returns how the run ended and its whole wall time. ``beside`` names the modes
    running on the same GPUs at the same time (``--concurrent``), recorded so that no one reads its time as its own."""
    run_dir = out / mode
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "hybrid_rl", "train", "--nproc", str(gpus), RECIPE,
           f"trainer.output_dir={run_dir}", f"trainer.total_steps={steps}", *MODES[mode], *overrides]
    start = time.time()
    with open(run_dir / "train.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM to the launcher: torchrun passes it to the ranks, which finish their step and exit; the whole
            # process tree is killed only if they have not within a minute (each rank sits in a group of its own)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill_tree(proc)
            rc = "timeout"
    wall = time.time() - start
    print(json.dumps({"mode": mode, "rc": rc, "wall_s": round(wall, 1), "log": str(run_dir / "train.log")}), flush=True)
    meta = {"rc": rc, "wall_s": wall, "command": " ".join(cmd[1:]), "steps_planned": steps,
            "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
            **({"ran_beside": beside} if beside else {})}
    (run_dir / "run.json").write_text(json.dumps(meta, indent=1))  # travels with the mode's folder
    return meta


def arith_split(run: Path) -> str | None:
    """The run's ``data.arith.split`` from its resolved config; ``ordered`` where the config predates the key."""
    import yaml

    path = run / "config.yaml"
    if not path.is_file():
        return None
    arith = (yaml.safe_load(path.read_text()) or {}).get("data", {}).get("arith", {})
    return arith.get("split", "ordered")


def first_gain(curve: list[dict], points: float) -> dict | None:
    """The first validation at least ``points`` percentage points above the first one: its step and wall-clock."""
    if not curve:
        return None
    for c in curve:
        if c["acc"] - curve[0]["acc"] >= points / 100 - 1e-12:
            return {"points": points, "step": c["step"], "wall_s": c["wall_s"]}
    return {"points": points, "step": None, "wall_s": None}


def se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


def val_scores(run: Path, step: int) -> dict[int, float]:
    """Per test problem (dataset index) its greedy score at ``step``, from the saved validation samples."""
    scores = {}
    for path in sorted((run / "validation").glob(f"step_{step:08d}_rank*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                scores[int(r["index"])] = float(r["score"])
    return scores


def encode_scores(scores: dict[int, float]) -> str | list:
    """Per-question scores as stored in the JSON: a string indexed by test problem, ``1``/``0`` for a right/wrong
    answer and ``-`` where the problem was not validated; a list (``None`` where missing) if any score is not 0 or 1."""
    n = max(scores, default=-1) + 1
    if all(v in (0.0, 1.0) for v in scores.values()):
        return "".join("-" if i not in scores else str(int(scores[i])) for i in range(n))
    return [scores.get(i) for i in range(n)]


def decode_scores(stored: str | list) -> dict[int, float]:
    if isinstance(stored, str):
        return {i: float(c) for i, c in enumerate(stored) if c != "-"}
    return {i: float(v) for i, v in enumerate(stored) if v is not None}


def medians(per_step: list[dict]) -> dict:
    """Median step, generation and update time over the run's steps (``timing/step``, ``timing/gen``,
    ``timing/update``), in seconds; a key is left out where no step logged it."""
    out = {}
    for name, key in (("median_step_s", "timing/step"), ("median_gen_s", "timing/gen"),
                      ("median_update_s", "timing/update")):
        xs = sorted(r[key] for r in per_step if key in r)
        if xs:
            mid = len(xs) // 2
            out[name] = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
    return out


def summarize(mode: str, run: Path, n_test: int, meta: dict | None, gain: float,
              steps_planned: int) -> dict | None:
    rows = read_rows(run)
    if not rows:
        return None
    wall, clock = 0.0, {}
    for r in rows:
        wall += r.get("timing/iteration", 0.0)
        clock[r["step"]] = wall
    vals = [r for r in rows if "val/reward_mean" in r]
    curve = [{"step": r["step"], "wall_s": round(clock[r["step"]], 2), "acc": r["val/reward_mean"],
              "families": {k.rsplit("/", 1)[1]: v for k, v in r.items() if k.startswith("val/reward_mean/")},
              "format_exact": r.get("val/format_exact"), "response_length": r.get("val/response_length_mean")}
             for r in vals]
    steps = [r for r in rows if "reward/mean" in r]
    first, last = (curve[0], curve[-1]) if curve else (None, None)
    out = {
        "steps_run": max((r["step"] for r in steps), default=0),
        "acc_before": first["acc"] if first else None, "acc_after": last["acc"] if last else None,
        "se_after": se(last["acc"], n_test) if last else None, "step_after": last["step"] if last else None,
        "families_after": {f: {"acc": a, "se": se(a, n_test // max(len(last["families"]), 1))}
                           for f, a in last["families"].items()} if last else {},
        "split": arith_split(run),
        "gain": first_gain(curve, gain),
        "train_wall_s": round(wall, 1),
        "mean_step_s": sum(r.get("timing/iteration", 0.0) for r in steps) / max(len(steps), 1),
        "curve": curve,
        # each validation's per-question scores, so that runs collected later pair with this one without its folder
        "scores": {str(c["step"]): encode_scores(sc) for c in curve if (sc := val_scores(run, c["step"]))},
        "per_step": [{"step": r["step"], **{k: r[k] for k in STEP_CURVES if k in r}} for r in steps],
    }
    out.update(medians(out["per_step"]))
    if meta:
        out.update({"run_wall_s": round(meta["wall_s"], 1), "rc": meta["rc"], "command": meta["command"],
                    **{k: meta[k] for k in ("host", "started", "ran_beside") if k in meta}})
        if meta.get("ran_beside"):
            out["timing_note"] = (f"shared its GPUs with {', '.join(meta['ran_beside'])} for the whole run: its "
                                  "wall-clock and step times are not comparable with a run that had them alone")
    planned = (meta or {}).get("steps_planned", steps_planned)
    out["steps_planned"] = planned
    if out["steps_run"] < planned:
        out["ended"] = f"cut after step {out['steps_run']} of {planned}; its figures are at step {out['step_after']}"
    return out


def paired(refs: list[dict], b_mode: dict, step_b: int) -> dict | None:
    """Per question, mode b's greedy score at ``step_b`` (its last validation) minus the mean of the reference modes'
    (one run, or the sync seeds) at the same step: the mean difference, its standard error, and whether it lies
    within two of them. A run cut short is so compared with the references at the step it reached, not at their end.
    The modes are summaries (``summarize``) with their stored scores. None without scores at that step in every one."""
    at = lambda m: decode_scores(m.get("scores", {}).get(str(step_b), ""))  # noqa: E731
    ref_scores = [at(m) for m in refs]
    b = at(b_mode)
    common = sorted(set(b).intersection(*ref_scores))
    if not common:
        return None
    d = [b[i] - sum(r[i] for r in ref_scores) / len(ref_scores) for i in common]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / max(len(d) - 1, 1)
    err = math.sqrt(var / len(d))
    return {"step": step_b, "diff": mean, "se": err, "within_2se": abs(mean) <= 2 * err, "n": len(d),
            "gained": sum(x > 0 for x in d), "lost": sum(x < 0 for x in d)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(26, 4.6))
    for i, (mode, m) in enumerate(result["modes"].items()):
        style = {"color": f"C{i}", "label": mode}
        xs = [c["wall_s"] for c in m["curve"]]
        ys = [100 * c["acc"] for c in m["curve"]]
        # a run that shared its GPUs: dashed against time, where its clock is not its own
        axes[0].plot(xs, ys, marker="o", **{**style, **({"linestyle": "--", "label": f"{mode} (GPU shared)"}
                                                        if m.get("ran_beside") else {})})
        axes[1].plot([c["step"] for c in m["curve"]], ys, marker="o", **style)
        axes[2].plot([r["step"] for r in m["per_step"]], [r.get("reward/mean", float("nan")) for r in m["per_step"]],
                     **style)
        if any("rollout/is_truncated_frac" in r or "rollout/is_masked_frac" in r for r in m["per_step"]):
            changed = [100 * (r.get("rollout/is_truncated_frac", 0.0) + r.get("rollout/is_masked_frac", 0.0))
                       for r in m["per_step"]]
            axes[3].plot([r["step"] for r in m["per_step"]], changed, **style)
        gap = [(r["step"], r["rollout/logprob_diff"]) for r in m["per_step"] if "rollout/logprob_diff" in r]
        stale = [r["rollout/staleness_mean"] for r in m["per_step"] if "rollout/staleness_mean" in r]
        if gap:
            axes[4].plot(*zip(*gap), **{**style, "label": f"{mode} (staleness "
                                                           f"{sum(stale) / max(len(stale), 1):.1f})"})
    axes[0].set(xlabel="training wall-clock (s)", ylabel="held-out greedy accuracy (%)", title="accuracy vs time")
    axes[1].set(xlabel="step", ylabel="held-out greedy accuracy (%)", title="accuracy vs steps")
    axes[2].set(xlabel="step", ylabel="training reward (mean)", title="training reward")
    axes[3].set(xlabel="step", ylabel="tokens truncated or masked (%)", title="off-policy correction")
    axes[4].set(xlabel="step", ylabel="mean |log-prob gap| per token", yscale="log",
                title="engine vs trainer log-probs (rollout/logprob_diff)")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a panel no mode logged stays empty, without a legend
            ax.legend()
    fig.suptitle(f"SmolLM2-135M-Instruct, held-out arithmetic ({result['n_test']} problems, split "
                 f"{result['split']}), {result['device']}, commit {result['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_concurrently(modes: list[str], args: argparse.Namespace, out: Path, overrides: list[str]) -> dict:
    """Every mode's run at once on the same GPUs, the starts ``args.stagger`` seconds apart (the engines' start-ups,
    their compile caches included, do not race); each run's record names the others."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int, mode: str) -> dict:
        time.sleep(i * args.stagger)
        return run_mode(mode, args.gpus, args.steps, out, overrides, args.mode_timeout,
                        beside=[m for m in modes if m != mode])

    with ThreadPoolExecutor(len(modes)) as pool:
        futures = {mode: pool.submit(one, i, mode) for i, mode in enumerate(modes)}
        return {mode: f.result() for mode, f in futures.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=1, help="ranks per run (split_partial needs at least 2)")
    ap.add_argument("--modes", help="comma-separated (default: sync,sync_seed1,overlap,overlap_partial, and "
                                    "split_partial with --gpus 2 or more)")
    ap.add_argument("--steps", type=int, default=200, help="steps per run (the recipe's 200)")
    ap.add_argument("--out", default=None, help="run directory, one folder per mode (default runs/learning_arith/<UTC "
                    "time>/; benchmarks/publish.py copies the result to benchmarks/results/)")
    ap.add_argument("--collect", metavar="DIR", help="only summarise the finished runs in DIR")
    ap.add_argument("--mode-timeout", type=float, default=900.0, help="seconds per mode's run")
    ap.add_argument("--gain", type=float, default=30.0, help="points of accuracy whose first step and time are reported")
    ap.add_argument("--device", help="device tag for the JSON (default: read from torch)")
    ap.add_argument("--json", help="where to write the JSON (default: OUT/learning_arith_smollm2_<device>.json)")
    ap.add_argument("--n-test", type=int, default=1000, help="test problems validated (data.arith.test_size)")
    ap.add_argument("--concurrent", action="store_true",
                    help="run the modes at the same time on the same GPUs, each started --stagger seconds after the "
                         "one before (each run's record names the others: its times are not its own)")
    ap.add_argument("--stagger", type=float, default=45.0, help="seconds between concurrent starts")
    ap.add_argument("--note", help="a remark recorded in the JSON as written (\"note\"), e.g. how the runs were "
                                   "spread over machines")
    ap.add_argument("--include", action="append", metavar="JSON",
                    help="an earlier result of this script: the modes asked for that have no run here are taken from "
                         "it as summarised (marked included_from) and paired per question through its stored scores; "
                         "repeatable")
    args, overrides = ap.parse_known_args()
    if args.stagger < 0:
        ap.error(f"--stagger {args.stagger:g}: seconds between concurrent starts must be >= 0")
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        ap.error(f"unknown arguments {bad}: recipe overrides are key=value")
    default = "sync,sync_seed1,overlap,overlap_partial" + (",split_partial" if args.gpus >= 2 else "")
    modes = [m for m in (args.modes or default).split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    if "split_partial" in modes and args.gpus < 2 and not args.collect:
        ap.error("--modes split_partial needs --gpus 2 or more (one rank generates, the others train)")
    out = Path(args.collect) if args.collect else run_dir("learning_arith", args.out)
    meta_path = out / "runs.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if not args.collect:
        out.mkdir(parents=True, exist_ok=True)
        if args.concurrent and len(modes) > 1:
            meta.update(run_concurrently(modes, args, out, overrides))
            meta_path.write_text(json.dumps(meta, indent=1))
        else:
            for mode in modes:
                meta[mode] = run_mode(mode, args.gpus, args.steps, out, overrides, args.mode_timeout)
                meta_path.write_text(json.dumps(meta, indent=1))
    device = args.device or meta.get("_device") or torch_device_tag(args.gpus)
    if not args.collect:
        meta["_device"] = device
        meta_path.write_text(json.dumps(meta, indent=1))
    result = {"benchmark": "learning_arith", "model": "builtin:smollm2-135m-instruct", "recipe": RECIPE,
              "device": device, "gpus_per_run": args.gpus, "commit": git_commit(), "n_test": args.n_test,
              "held_out": "data.val_path=synthetic:arith: 1,000 problems (200 each of add, sub, mul, max, word) of "
                          "distinct canonical identities (operation and operands, unordered for + * max, whatever "
                          "the wording), none of them a training row in any order or wording",
              "settings": {"steps": args.steps, "overrides": overrides,
                           "modes": {m: MODES[m] for m in modes}},
              "modes": {}, **({"note": args.note} if args.note else {})}
    for mode in modes:
        own = out / mode / "run.json"
        s = summarize(mode, out / mode, args.n_test,
                      meta.get(mode) or (json.loads(own.read_text()) if own.is_file() else None), args.gain,
                      args.steps)
        if s is not None:
            result["modes"][mode] = s
    for path in args.include or []:  # modes with no folder here, as an earlier JSON summarised them
        try:
            earlier = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            ap.error(f"--include {path}: not a readable JSON ({e.__class__.__name__}); give a result this script wrote")
        for mode in modes:
            if mode not in result["modes"] and mode in earlier.get("modes", {}):
                m = {k: v for k, v in earlier["modes"][mode].items() if not k.startswith("vs_")}
                m["included_from"] = {"json": Path(path).name, "commit": earlier.get("commit"),
                                      "device": earlier.get("device")}
                m.update({k: v for k, v in medians(m.get("per_step", [])).items() if k not in m})
                if not m.get("scores"):
                    # no per-question scores to pair with the runs here: the earlier JSON's own pairing, against
                    # its sync runs (their final accuracies beside it, to compare with this collection's)
                    m.update({f"{k}_at_source": v for k, v in earlier["modes"][mode].items()
                              if k.startswith("vs_") and v})
                    m["source_sync_acc_after"] = {k: earlier["modes"][k]["acc_after"] for k in SYNC_SEEDS
                                                  if k in earlier["modes"]}
                result["modes"][mode] = m
    result["modes"] = {m: result["modes"][m] for m in modes if m in result["modes"]}
    splits = sorted({str(m["split"]) for m in result["modes"].values()})
    result["split"] = splits[0] if len(splits) == 1 else splits  # runs on different splits are not comparable
    sync = result["modes"].get("sync")
    if sync:
        result.update(acc_before=sync["acc_before"], acc_after=sync["acc_after"], se=sync["se_after"],
                      se_before=se(sync["acc_before"], args.n_test) if sync["acc_before"] is not None else None)
        seeds = [result["modes"][k] for k in SYNC_SEEDS
                 if k in result["modes"] and result["modes"][k]["step_after"] is not None]
        for mode, m in result["modes"].items():
            # per question only on one test set: a problem's index names the same problem only within one split
            if mode != "sync" and m["step_after"] is not None and m["split"] == sync["split"]:
                m["vs_sync"] = paired([sync], m, m["step_after"])
                if len(seeds) > 1 and mode not in SYNC_SEEDS and all(r["split"] == m["split"] for r in seeds):
                    m["vs_sync_seeds_mean"] = paired(seeds, m, m["step_after"])
    json_path = Path(args.json) if args.json else out / f"learning_arith_smollm2_{device}.json"
    run_dir("learning_arith", json_path.parent)  # never among the curated results: publish.py copies it there
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    if result["modes"]:
        plot(result, json_path.with_suffix(".png"))
    print(f"split: {result['split']}")
    print(f"{'mode':<22} {'steps':>5} {'acc before':>10} {'acc after':>10} {'train s':>8} {'step s':>7} "
          f"{f'+{args.gain:g} at s':>10}")
    for mode, m in result["modes"].items():
        fmt = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        at = m["gain"]["wall_s"] if m["gain"] else None
        print(f"{mode:<22} {m['steps_run']:>5} {fmt(m['acc_before']):>10} {fmt(m['acc_after']):>10} "
              f"{m['train_wall_s']:>8.0f} {m['mean_step_s']:>7.2f} {'-' if at is None else f'{at:.0f}':>10}"
              + ("  (GPUs shared: times not its own)" if m.get("ran_beside") else ""))
    print(f"wrote {json_path}")
    failed = [m for m in modes if not args.collect and meta.get(m, {}).get("rc") not in (0,)]
    if failed:
        print(f"modes that did not finish: {', '.join(failed)} (see each mode's train.log)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
