"""The planner's table: one row per phase, its predicted peak and its biggest terms, then the verdict line."""

from __future__ import annotations

from hybrid_rl.planner.estimate import GIB, Phase
from hybrid_rl.planner.verdict import Verdict


def table(all_phases: list[Phase], verdict: Verdict, header: str) -> str:
    rows = [header, f"{'phase':28s} {'peak GiB':>8s}  biggest terms (GiB)"]
    for p in all_phases:
        terms = ", ".join(f"{name} {b / GIB:.1f}" for name, b in p.biggest(3))
        mark = " <" if p is verdict.peak else ""
        rows.append(f"{p.name + mark:28s} {p.total / GIB:8.1f}  {terms}")
    rows.append(verdict.line)
    return "\n".join(rows)
