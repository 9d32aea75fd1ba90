"""Does a real model learn? SmolLM2-135M-Instruct on GSM8K (recipes/gsm8k_grpo_smollm2.yaml), from run directories.

Reads the ``metrics.jsonl`` of one or more finished runs (e.g. sync and overlap mode), and writes
``learning_smollm2_<device>[_<tag>].json`` and a ``.png`` into its run directory (``runs/learning_smollm2/<UTC
time>/`` unless ``--out-dir``; ``benchmarks/publish.py`` copies them to ``benchmarks/results/``): greedy test
accuracy before and after training with its standard error sqrt(p(1-p)/n) (n = validation questions), and the
accuracy of answers that also
finished before the length cap where the run logged ``val/clipped_reward_mean``; the validation curve; and per step
the training reward, response length, clip ratio (responses at the length cap), engine-vs-trainer log-prob gap and
time. Wall-clock
time is the sum of ``timing/step`` (training only), plus the whole run's time where the run directory holds a
``wall_s.txt`` (seconds of each call of the run, one per line, appended by the command that ran it). Where the run
saved its validation samples (the recipe's ``trainer.validation_data_dir``), the gain is also paired per question: the
questions gained and lost between the first and the last validation, and the standard error of the per-question
differences; where the records carry ``response_length``, the same again counting only answers that finished.
Prints one JSON line per run. It trains nothing itself: run the recipe first, e.g. on one GPU

    s=$(date +%s); hybrid-rl train recipes/gsm8k_grpo_smollm2.yaml trainer.output_dir=runs/smol_sync ...; \
        echo $(( $(date +%s) - s )) >> runs/smol_sync/wall_s.txt
    python benchmarks/learning_smollm2.py --run sync=runs/smol_sync --run overlap=runs/smol_overlap --device H100x1
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_common import git_commit, run_dir, torch_device_tag  # noqa: E402

CURVES = ["reward/mean", "rollout/response_length_mean", "rollout/response_clip_ratio", "rollout/logprob_diff",
          "rollout/logprob_diff_max", "timing/step", "timing/gen", "timing/update", "reward/format_strict",
          "reward/answer_found", "reward/clipped_mean", "reward/overlong_penalty"]
# (absent from older runs) val/clipped_reward_mean: the accuracy earned by answers cut at the length cap
VAL_EXTRA = ["val/response_clip_ratio", "val/format_strict", "val/answer_found", "val/clipped_reward_mean"]


def read_rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{run}: no metrics.jsonl; pass a run directory of a finished run (trainer.output_dir) "
                         f"that logged with trainer.logger including jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_step: dict[int, dict] = {}
    for r in rows:  # a resumed run appends after the checkpoint's step; a later row of a step wins
        by_step.setdefault(int(r["step"]), {}).update(r)
    return [by_step[s] for s in sorted(by_step)]


def val_count(run: Path, override: int | None) -> int:
    """Validation questions: ``--val-n``, else the resolved config's val file (capped by max_val_samples), else 1319."""
    if override:
        return override
    for name in ("config.yaml", "resolved_config.yaml", "config.json"):
        cfg_path = run / name
        if not cfg_path.is_file():
            continue
        try:
            import yaml

            cfg = yaml.safe_load(cfg_path.read_text())
            data = cfg.get("data", {})
            path = Path(data.get("val_path") or "")
            n = sum(1 for line in path.open() if line.strip()) if path.is_file() else 1319
            cap = int(data.get("max_val_samples") or 0)
            return min(n, cap) if cap else n
        except Exception:  # an unreadable config: the GSM8K test set's size
            break
    return 1319


def accuracy(p: float, n: int) -> dict:
    return {"accuracy": p, "stderr": math.sqrt(max(p * (1 - p), 0.0) / n), "n": n}


def max_response_length(run: Path) -> int | None:
    """``data.max_response_length`` from the run's resolved config, or None."""
    try:
        import yaml

        return int(yaml.safe_load((run / "config.yaml").read_text())["data"]["max_response_length"])
    except Exception:  # no config, or an unreadable one
        return None


def val_scores(run: Path, step: int, finished_below: int | None = None) -> dict[int, float] | None:
    """The per-question greedy scores of one validation (``trainer.validation_data_dir: validation``), or None.
    With ``finished_below``, an answer cut at that length (its record's ``response_length``) scores 0; None when the
    records carry no lengths (older runs)."""
    files = sorted((run / "validation").glob(f"step_{step:08d}_rank*.jsonl"))
    if not files:
        return None
    records = [r for f in files for r in map(json.loads, f.read_text().splitlines())]
    if finished_below is None:
        return {int(r["index"]): float(r["score"]) for r in records}
    if not all("response_length" in r for r in records):
        return None
    return {int(r["index"]): float(r["score"]) * (r["response_length"] < finished_below) for r in records}


def paired(before: dict[int, float], after: dict[int, float]) -> dict:
    """Before vs after on the same questions: the questions gained and lost, and the standard error of the gain from
    the per-question differences (tighter than the two accuracies' unpaired errors when most answers stay put)."""
    common = sorted(set(before) & set(after))
    n = len(common)
    gained = sum(1 for i in common if after[i] > before[i])
    lost = sum(1 for i in common if after[i] < before[i])
    var = (gained + lost - (gained - lost) ** 2 / n) / n if n else 0.0
    return {"n": n, "gained": gained, "lost": lost, "gain": (gained - lost) / n if n else 0.0,
            "stderr": math.sqrt(max(var, 0.0) / n) if n else 0.0}


def summarise(label: str, run: Path, n_val: int | None) -> dict:
    rows = read_rows(run)
    n = val_count(run, n_val)
    val = [(r["step"], r["val/reward_mean"], r.get("val/response_length_mean"), {k: r[k] for k in VAL_EXTRA if k in r})
           for r in rows if "val/reward_mean" in r]
    train = [r for r in rows if "timing/step" in r]
    out: dict = {"label": label, "run_dir": str(run), "steps": train[-1]["step"] if train else 0, "val_n": n}
    if val:
        before, after = accuracy(val[0][1], n), accuracy(val[-1][1], n)
        before["step"], after["step"] = val[0][0], val[-1][0]
        for point, (_, acc, _, extra) in ((before, val[0]), (after, val[-1])):
            if "val/clipped_reward_mean" in extra:  # right answers that also finished (ended before the cap)
                point["finished_accuracy"] = acc - extra["val/clipped_reward_mean"]
        diff = after["accuracy"] - before["accuracy"]
        out.update(before=before, after=after, gain=diff,
                   gain_stderr=math.sqrt(before["stderr"] ** 2 + after["stderr"] ** 2))
        first, last = val_scores(run, val[0][0]), val_scores(run, val[-1][0])
        if first is not None and last is not None:
            out["paired"] = paired(first, last)
        cap = max_response_length(run)
        if cap is not None:  # the same, counting only answers that finished before the cap
            first, last = val_scores(run, val[0][0], cap), val_scores(run, val[-1][0], cap)
            if first is not None and last is not None:
                out["paired_finished"] = paired(first, last)
    out["val_curve"] = [{"step": s, "accuracy": a, "stderr": accuracy(a, n)["stderr"], "response_length_mean": L,
                         **{k.split("/", 1)[1]: v for k, v in extra.items()}} for s, a, L, extra in val]
    out["train_curve"] = {k: [[r["step"], r[k]] for r in train if k in r] for k in CURVES}
    step_s = [r["timing/step"] for r in train]
    out["train_time_s"] = sum(step_s)
    out["step_time_s_median"] = sorted(step_s)[len(step_s) // 2] if step_s else None
    wall = run / "wall_s.txt"
    if wall.is_file():
        out["wall_s"] = sum(float(x) for x in wall.read_text().split())
    if train:
        k = max(1, len(train) // 10)  # first and last tenth of the run
        for key in ("reward/mean", "rollout/response_length_mean", "rollout/response_clip_ratio"):
            first = [r[key] for r in train[:k] if key in r]
            last = [r[key] for r in train[-k:] if key in r]
            if first and last:
                out.setdefault("first_vs_last_tenth", {})[key] = [sum(first) / len(first), sum(last) / len(last)]
    return out


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("val", "greedy test accuracy (± s.e.; dashed: finished before the cap)"), ("reward/mean", "train reward"),
              ("rollout/response_length_mean", "response length (tokens)"),
              ("rollout/response_clip_ratio", "clip ratio (at length cap)"),
              ("rollout/logprob_diff", "|engine - trainer| log-prob (mean)"), ("time", "wall-clock (s, training)"),
              ("shape", "answer shape (train): '####' line (solid), any answer (dashed)"),
              ("val_clip", "greedy test responses at the length cap")]
    fig, axes = plt.subplots(2, 4, figsize=(20, 8))
    for ax, (key, name) in zip(axes.flat, panels):
        for res in results:
            if key == "val":
                c = res["val_curve"]
                line = ax.errorbar([p["step"] for p in c], [p["accuracy"] for p in c], yerr=[p["stderr"] for p in c],
                                   marker="o", capsize=3, label=res["label"])
                fin = [p for p in c if "clipped_reward_mean" in p]
                if fin:
                    ax.plot([p["step"] for p in fin], [p["accuracy"] - p["clipped_reward_mean"] for p in fin], "--",
                            color=line[0].get_color(), label=f"{res['label']} finished")
            elif key == "shape":
                for k, style in (("reward/format_strict", "-"), ("reward/answer_found", "--")):
                    pts = res["train_curve"].get(k, [])
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{res['label']} {k[7:]}", alpha=0.8)
            elif key == "val_clip":
                c = [p for p in res["val_curve"] if "response_clip_ratio" in p]
                ax.plot([p["step"] for p in c], [p["response_clip_ratio"] for p in c], marker="o", label=res["label"])
            elif key == "time":
                pts = res["train_curve"]["timing/step"]
                total, xs, ys = 0.0, [], []
                for s, v in pts:
                    total += v
                    xs.append(s)
                    ys.append(total)
                ax.plot(xs, ys, label=res["label"])
            else:
                pts = res["train_curve"].get(key, [])
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=res["label"], alpha=0.8)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def default_device() -> str:
    try:
        import torch

        gpus = torch.cuda.device_count()
    except ImportError:
        gpus = 1
    return torch_device_tag(gpus, cpu="cpux1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", required=True, metavar="LABEL=DIR",
                    help="a run directory with its label (e.g. sync=runs/smol_sync); give it once per run")
    ap.add_argument("--device", default=None, help="device tag of the result files, e.g. H100x1 (default: detected)")
    ap.add_argument("--host", default=None, help="how the runs shared the machine, recorded in the JSON "
                    "(e.g. '4 runs at once, one per GPU of a H100x4 host')")
    ap.add_argument("--val-n", type=int, default=None, help="validation questions (default: from the run's config)")
    ap.add_argument("--tag", default="", help="appended to the result files' name, so that another setting's runs on "
                    "the same device do not overwrite them (e.g. overlong)")
    ap.add_argument("--out-dir", default=None, help="run directory (default runs/learning_smollm2/<UTC time>/; "
                    "benchmarks/publish.py copies a result to benchmarks/results/)")
    args = ap.parse_args(argv)
    runs = []
    for spec in args.run:
        label, sep, d = spec.partition("=")
        if not sep or not d:
            ap.error(f"--run {spec!r}: use LABEL=DIR, e.g. sync=runs/smol_sync")
        runs.append((label, Path(d)))
    device = args.device or default_device()
    results = [summarise(label, d, args.val_n) for label, d in runs]
    out_dir = run_dir("learning_smollm2", args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"learning_smollm2_{device}{'_' + args.tag if args.tag else ''}"
    doc = {"benchmark": "learning_smollm2", "device": device, "commit": git_commit(),
           "recipe": "recipes/gsm8k_grpo_smollm2.yaml", "model": "builtin:smollm2-135m-instruct", "host": args.host, "runs": results}
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(results, stem.with_suffix(".png"), f"SmolLM2-135M-Instruct GRPO on GSM8K, {device}, {git_commit()}")
    for res in results:
        line = {k: res.get(k) for k in ("label", "steps", "before", "after", "gain", "gain_stderr", "paired",
                                         "paired_finished", "train_time_s", "wall_s", "step_time_s_median")}
        print(json.dumps({"device": device, "commit": doc["commit"], **line}))
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
