"""The memory planner's verdicts for the 1.5B flagship and the 7B recipe on one box, and the longest response that fits.

    PYTHONPATH=. python benchmarks/plan_verdicts.py          # table, and runs/plan_verdicts/<time>/plan_verdicts.json
    PYTHONPATH=. python benchmarks/plan_verdicts.py --out /tmp/v     # /tmp/v/plan_verdicts.json (or --out /tmp/v.json)
    python benchmarks/publish.py --no-device runs/plan_verdicts/<time>/plan_verdicts.json   # the curated copy

Predictions of ``hybrid_rl.planner`` (its public functions, in this process; CPU, seconds), not measurements: per
config and box, each phase's predicted peak per GPU and whether it fits (peak + the CUDA context within the card).
Boxes: 8 × H100 (80 GB) and 4 × H200. Configs: ``recipes/gsm8k_grpo.yaml`` and ``recipes/gsm8k_grpo_7b.yaml`` as
shipped, then the 7B at responses of 2k and 16k tokens with Ulysses sequence parallelism of size 1, 2 and 4, with
the recipe's recomputation and without it. The overrides per point: ``data.max_response_length``, the token budget
raised to hold one prompt + response (``actor.max_token_len_per_device``, as ``modes_sweep.py`` does), and
``actor.ulysses_sequence_parallel_size``. Last, for each box, sequence-parallel size and recomputation setting, the
largest ``data.max_response_length`` the planner says fits with one sequence per micro-batch (the token budget at
prompt + response: the least memory a length can take), by bisection in steps of ``STEP`` tokens up to ``LIMIT``;
lengths past the model's 32,768 positions would also need a longer context (RoPE scaling), which the planner does
not judge.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "benchmarks"))

from bench_common import git_commit, run_dir  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.planner.estimate import CONTEXT_GIB, GIB  # noqa: E402
from hybrid_rl.planner.gpus import card_memory_gib  # noqa: E402
from hybrid_rl.planner.shape import read_shape  # noqa: E402
from hybrid_rl.planner.verdict import judge  # noqa: E402

FLAGSHIP, SEVEN_B = "recipes/gsm8k_grpo.yaml", "recipes/gsm8k_grpo_7b.yaml"
BOXES = (("8xH100", 8, "H100"), ("4xH200", 4, "H200"))
SP_SIZES = (1, 2, 4)
RESPONSES = (2048, 16384)
STEP, LIMIT = 256, 1 << 20
"""The search's granularity and its ceiling (tokens of response)."""
CONTEXT_LIMIT = 32768
"""Qwen2.5-7B-Instruct's ``max_position_embeddings``."""


def long_response(recipe: str, response: int, sp: int, recompute: bool, one_sequence: bool = False) -> list[str]:
    """Overrides for a response cap of ``response`` tokens at sequence-parallel size ``sp``: the recipe's token budget
    raised to hold one prompt + response, or (``one_sequence``) exactly that, one sequence per micro-batch."""
    cfg = load_config(str(ROOT / recipe))
    full = cfg.data.max_prompt_length + response
    budget = full if one_sequence else max(cfg.actor.max_token_len_per_device, full)
    return [f"data.max_response_length={response}", f"actor.max_token_len_per_device={budget}",
            f"actor.ulysses_sequence_parallel_size={sp}", f"model.enable_gradient_checkpointing={str(recompute).lower()}"]


def plan(recipe: str, overrides: list[str], gpus: int, card: str) -> dict:
    """One config on one box: each phase's predicted peak (GiB) and the verdict."""
    cfg = load_config(str(ROOT / recipe), overrides).validate(gpus)
    gib = card_memory_gib(card)
    all_phases, verdict = judge(cfg, read_shape(cfg.model.path), gpus, gib * GIB)
    return {"phases_gib": {p.name: round(p.total / GIB, 2) for p in all_phases},
            "peak_phase": verdict.peak.name, "peak_gib": round(verdict.peak.total / GIB, 2),
            "peak_terms_gib": {k: round(v / GIB, 2) for k, v in verdict.peak.biggest(3)},
            "fits": verdict.fits, "verdict": verdict.line}


def configs() -> list[tuple[str, str, list[str]]]:
    """(name, recipe, overrides) of every config judged."""
    out = [("gsm8k_grpo (1.5B)", FLAGSHIP, []), ("gsm8k_grpo_7b", SEVEN_B, [])]
    for recompute in (True, False):
        for response in RESPONSES:
            for sp in SP_SIZES:
                name = f"7b resp {response // 1024}k sp{sp}{'' if recompute else ' no-recompute'}"
                out.append((name, SEVEN_B, long_response(SEVEN_B, response, sp, recompute)))
    return out


def largest_response(gpus: int, card: str, sp: int, recompute: bool) -> dict:
    """The largest response cap (a multiple of ``STEP``) the planner says fits; fits shrink as the cap grows."""
    def fits(response: int) -> bool:
        return plan(SEVEN_B, long_response(SEVEN_B, response, sp, recompute, True), gpus, card)["fits"]

    if not fits(STEP):
        return {"max_response_length": 0}
    lo, hi = 1, LIMIT // STEP  # fits(lo * STEP) holds
    if fits(hi * STEP):
        return {"max_response_length": LIMIT, "at_limit": True}
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * STEP) else (lo, mid)
    over = plan(SEVEN_B, long_response(SEVEN_B, hi * STEP, sp, recompute, True), gpus, card)
    return {"max_response_length": lo * STEP, "first_too_long": hi * STEP, "peak_phase_beyond": over["peak_phase"],
            "beyond_model_context": lo * STEP + load_config(str(ROOT / SEVEN_B)).data.max_prompt_length > CONTEXT_LIMIT}


def table(rows: list[dict], searches: list[dict]) -> str:
    phases = ["weight push", "generation", "old log-prob", "ref log-prob", "actor update"]
    short = ["push", "gen", "old lp", "ref lp", "update"]
    lines = [f"{'config':28s} {'box':7s} " + " ".join(f"{s:>7s}" for s in short) + "  verdict (GiB per GPU)"]
    for r in rows:
        cells = " ".join(f"{r['phases_gib'].get(p, float('nan')):7.1f}" for p in phases)
        lines.append(f"{r['name']:28s} {r['box']:7s} {cells}  {'fits' if r['fits'] else 'DOES NOT FIT'}: "
                     f"{r['peak_phase']} {r['peak_gib']:.1f}")
    lines += ["", "largest response that fits (7B recipe, one sequence per micro-batch; tokens, prompt 512 on top)",
              f"{'box':7s} {'sp':>3s} {'recompute':>10s} {'max response':>13s}  beyond it"]
    for s in searches:
        beyond = s.get("peak_phase_beyond", "the search's limit" if s.get("at_limit") else "-")
        note = "  (past the model's 32k positions)" if s.get("beyond_model_context") else ""
        lines.append(f"{s['box']:7s} {s['sp']:3d} {str(s['recompute']).lower():>10s} {s['max_response_length']:13,d}  "
                     f"{beyond}{note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="run directory (default runs/plan_verdicts/<UTC time>/; "
                    "benchmarks/publish.py copies a result to benchmarks/results/)")
    args = ap.parse_args(argv)
    rows = [{"name": name, "recipe": recipe, "overrides": ovr, "box": box, "gpus": gpus, "gpu": card,
             **plan(recipe, ovr, gpus, card)}
            for name, recipe, ovr in configs() for box, gpus, card in BOXES]
    searches = [{"box": box, "gpus": gpus, "gpu": card, "sp": sp, "recompute": recompute,
                 **largest_response(gpus, card, sp, recompute)}
                for box, gpus, card in BOXES for recompute in (True, False) for sp in SP_SIZES]
    doc = {"bench": "plan_verdicts", "commit": git_commit(ROOT),
           "kind": "prediction (hybrid_rl.planner), not a measurement",
           "gpu_gib": {card: card_memory_gib(card) for _, _, card in BOXES}, "context_gib": CONTEXT_GIB,
           "search": {"step": STEP, "limit": LIMIT, "model_context": CONTEXT_LIMIT}, "configs": rows,
           "largest_response": searches}
    print(table(rows, searches))
    if args.out and args.out.endswith(".json"):  # a file named outright, in a run directory all the same
        out = run_dir("plan_verdicts", Path(args.out).parent) / Path(args.out).name
    else:
        out = run_dir("plan_verdicts", args.out) / "plan_verdicts.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return doc


if __name__ == "__main__":
    main()
