"""Plot the weight-sync results (push time vs its all-gather bound) per device.

    python benchmarks/plot_weight_sync.py                       # the curated results -> runs/plot_weight_sync/<time>/
    python benchmarks/plot_weight_sync.py --results runs/weight_sync/<time> --out /tmp/plots

Reads every ``weight_sync_*.json`` result of ``--results`` (default: ``benchmarks/results/``) and writes, per device,
``weight_sync_<device>.png`` and the JSON it plots (``weight_sync_<device>.json``: the rows, their files and
commits) into its run directory, from where ``benchmarks/publish.py`` copies both.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import RESULTS, run_dir  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the weight_sync_*.json files are")
    ap.add_argument("--out", default=None, help="run directory (default runs/plot_weight_sync/<UTC time>/)")
    args = ap.parse_args(argv)
    out_dir = run_dir("plot_weight_sync", args.out)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_device: dict[str, list[dict]] = defaultdict(list)
    files: dict[str, list[str]] = defaultdict(list)
    for f in sorted(args.results.glob("weight_sync_*.json")):
        d = json.loads(f.read_text())
        if d.get("impl") == "grouped" and not d["device"].startswith("cpu"):  # a push result (not a plot's JSON)
            by_device[d["device"]].append(d)
            files[d["device"]].append(f.name)
    for device, rows in by_device.items():
        rows.sort(key=lambda r: r["bytes"])
        names = [f'{r["model"]}\n{r["bytes"] / 1e9:.2f} GB' for r in rows]
        x = range(len(rows))
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([i - 0.2 for i in x], [r["sync_s"] * 1e3 for r in rows], 0.4, label="push (median of 50)")
        ax.bar([i + 0.2 for i in x], [r["bound_s"] * 1e3 for r in rows], 0.4, label="bound: all-gather + copy")
        for i, r in zip(x, rows):
            ax.text(i - 0.2, r["sync_s"] * 1e3, f'{r["bound_ratio"]:.1f}x', ha="center", va="bottom")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("ms per push")
        ax.set_title(f"FSDP2 actor → engine weight push, {device}")
        ax.set_ylim(0, max(r["sync_s"] for r in rows) * 1e3 * 1.35)
        ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        out_dir.mkdir(parents=True, exist_ok=True)
        out = out_dir / f"weight_sync_{device}.png"
        fig.savefig(out, dpi=110)
        doc = {"bench": "plot_weight_sync", "device": device, "commit": ",".join(sorted({r["commit"] for r in rows})),
               "settings": {"results": files[device]}, "rows": rows}
        out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
        print(out)


if __name__ == "__main__":
    main()
