"""Plot the committed weight-sync results (push time vs its all-gather bound) per device.

    python benchmarks/plot_weight_sync.py            # writes benchmarks/results/weight_sync_<device>.png
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_device: dict[str, list[dict]] = defaultdict(list)
    for f in sorted(RESULTS.glob("weight_sync_*.json")):
        d = json.loads(f.read_text())
        if d.get("impl") == "grouped" and not d["device"].startswith("cpu"):
            by_device[d["device"]].append(d)
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
        out = RESULTS / f"weight_sync_{device}.png"
        fig.savefig(out, dpi=110)
        print(out)


if __name__ == "__main__":
    main()
