"""Combine the per-framework results of one workload (``<framework>_<workload>.json`` from the run_*.py scripts) into
``peers_<device>_<workload>.json`` and a bar plot beside it, in a run directory (``runs/peers/<UTC time>/`` unless
``--out-dir``; ``benchmarks/publish.py`` copies them to ``benchmarks/results/``) (``..._<profile>`` when every framework
ran another profile than ``tuned``, ``..._mixed`` when they ran different ones). Refuses (exit 2) results that read
different prompt files (``settings.prompts_sha256``). Each peer is compared with the hybrid_rl run on its own machine
(boot id): beside ``hybrid_rl_<workload>.json``, a run of hybrid_rl on another machine of the same kind is read from
``hybrid_rl_<workload>@<label>.json``; ``pairs`` in the report names the machines of every ratio. A peer run again on
another machine (``verl_<workload>@<label>.json``, ``trl_...``) is paired the same way: ``per_machine`` lists every
pair, ``ratios`` and ``pairs`` stay those of the main files, and the target counts as met for a peer only where it is
met on every machine the peer ran on. A variant of hybrid_rl (``hybrid_rl+NAME_<workload>.json``, ``run_hybrid_rl.py
--variant``) is a bar of its own with its ratios to the peers and to the plain run on its machine
(``variant_ratios``); the target stays on the plain run. Runs on the GPU
machine at the end of every ``run_all.sh`` part (into ``$OUT``), or on any machine from the JSON files the runs wrote:

    python benchmarks/peers/plot.py --res /path/with/the/jsons --workload grpo_long
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from bench_common import git_commit, run_dir  # noqa: E402
from workload import DEFAULT_WORKLOAD, VERSIONS, WORKLOADS  # noqa: E402

ORDER = ["hybrid_rl", "verl", "trl"]
COLORS = {"hybrid_rl": "tab:green", "verl": "tab:blue", "trl": "tab:orange"}


def combine(res: Path, workload: str) -> dict:
    runs = {}
    for name in ORDER:
        p = res / f"{name}_{workload}.json"
        if p.exists():
            runs[name] = json.loads(p.read_text())
    # hybrid_rl on other machines of the same kind, one per machine a peer ran on
    extra = [json.loads(p.read_text()) for p in sorted(res.glob(f"hybrid_rl_{workload}@*.json"))]
    extra = [r for r in extra if "step_s" in r]
    variants = [json.loads(p.read_text()) for p in sorted(res.glob(f"hybrid_rl+*_{workload}.json"))]
    variants = [r for r in variants if "step_s" in r]
    # a peer run again on other machines of the same kind, each paired with hybrid_rl on its own machine
    repeats = [json.loads(p.read_text()) for peer in ("verl", "trl")
               for p in sorted(res.glob(f"{peer}_{workload}@*.json"))]
    repeats = [r for r in repeats if "step_s" in r]
    ok = {k: v for k, v in runs.items() if "step_s" in v}
    devices = {v.get("device") for v in runs.values() if v.get("device")}
    device = sorted(devices)[0] if devices else "unknown"
    workloads = {json.dumps(v["workload"], sort_keys=True) for v in [*ok.values(), *extra, *repeats, *variants]
                 if v.get("workload")}
    if len(workloads) > 1:
        raise SystemExit(f"the results in {res} ran different workloads (PEERS_PROMPTS? --steps?): "
                         + "; ".join(f"{k}: {v.get('workload', {}).get('prompts_per_step')} prompts, "
                                     f"{v.get('workload', {}).get('steps')} steps" for k, v in ok.items())
                         + ". Rerun them with the same settings")
    hashes = {k: (v.get("settings") or {}).get("prompts_sha256") for k, v in runs.items() if "skipped" not in v}
    hashes.update({f"hybrid_rl@{r.get('machine')}": (r.get("settings") or {}).get("prompts_sha256") for r in extra})
    hashes.update({r["framework"]: (r.get("settings") or {}).get("prompts_sha256") for r in variants})
    hashes.update({f"{r['framework']}@{r.get('machine')}": (r.get("settings") or {}).get("prompts_sha256")
                   for r in repeats})
    if len({h for h in hashes.values() if h}) > 1:  # one line, exit 2: results that read different prompt files
        print(f"error: the results in {res} read different prompt files (settings.prompts_sha256: "
              + ", ".join(f"{k} {h[:12] if h else None}" for k, h in hashes.items())
              + "); rerun them with the same --data / PEERS_DATA", file=sys.stderr)
        raise SystemExit(2)
    w = json.loads(workloads.pop()) if workloads else {"name": workload, **WORKLOADS.get(workload, {})}
    bases = [ok["hybrid_rl"]] + extra if "hybrid_rl" in ok else extra

    def base_for(run: dict) -> dict:
        """The hybrid_rl run on ``run``'s machine where there is one, else the main one."""
        where = run.get("machine")
        return next((b for b in bases if where and b.get("machine") == where), bases[0])

    ratios, pairs, per_machine = {}, {}, []
    if bases:
        for run in [ok[p] for p in ("verl", "trl") if p in ok] + repeats:
            base, where = base_for(run), run.get("machine")
            per_machine.append({"peer": run["framework"], "peer_machine": where,
                                "hybrid_rl_machine": base.get("machine"),
                                "same_machine": bool(where) and base.get("machine") == where,
                                "peer_step_s_median": run["step_s_median"],
                                "hybrid_rl_step_s_median": base["step_s_median"],
                                "ratio_median": run["step_s_median"] / base["step_s_median"],
                                "ratio_mean": run["step_s"] / base["step_s"]})
            if run is not ok.get(run["framework"]):
                continue  # a repeat: in per_machine only
            peer, pm = run["framework"], per_machine[-1]
            pairs[peer] = {k: pm[k] for k in ("hybrid_rl_machine", "peer_machine", "same_machine",
                                              "hybrid_rl_step_s_median")}
            # the same prompts and the same response lengths, sample by sample: the step-time ratio is the
            # throughput ratio; the token-based ratio is kept beside it as a check, the medians as a third
            ratios[f"hybrid_rl_vs_{peer}_step_time"] = pm["ratio_mean"]
            ratios[f"hybrid_rl_vs_{peer}_step_time_median"] = pm["ratio_median"]
            if base.get("trained_tokens_per_s") and run.get("trained_tokens_per_s"):
                ratios[f"hybrid_rl_vs_{peer}_trained_tokens_per_s"] = (base["trained_tokens_per_s"]
                                                                      / run["trained_tokens_per_s"])
    variant_ratios = {}  # each variant against each peer run and the plain run on its machine
    for var in variants:
        here = var.get("machine")
        if not here:
            continue
        for run in [ok[p] for p in ("verl", "trl") if p in ok] + repeats:
            if run.get("machine") == here:
                variant_ratios[f"{var['framework']}_vs_{run['framework']}_step_time_median"] = (run["step_s_median"]
                                                                                             / var["step_s_median"])
                variant_ratios[f"{var['framework']}_vs_{run['framework']}_step_time"] = run["step_s"] / var["step_s"]
        plain = next((b for b in bases if b.get("machine") == here), None)
        if plain is not None:  # below 1: the variant's step is the longer one
            variant_ratios[f"{var['framework']}_vs_hybrid_rl_step_time_median"] = (plain["step_s_median"]
                                                                                 / var["step_s_median"])
    machines = {k: v.get("machine") for k, v in ok.items()}
    machines.update({r["framework"]: r.get("machine") for r in variants})
    machines.update({f"hybrid_rl@{r.get('machine')}": r.get("machine") for r in extra})
    machines.update({f"{r['framework']}@{r.get('machine')}": r.get("machine") for r in repeats})
    same = (all(p["same_machine"] for p in per_machine) if per_machine
            else len(set(machines.values())) <= 1 and None not in machines.values())
    met = {}  # a peer's target: met on every machine it ran on
    for pm in per_machine:
        met[pm["peer"]] = met.get(pm["peer"], True) and pm["ratio_median"] >= 1.3
    profiles = {k: v.get("profile") or (v.get("settings") or {}).get("profile") for k, v in runs.items()
                if "skipped" not in v}
    return {"device": device, "workload_name": w.get("name", workload), "model": w.get("model"), "workload": w,
            "pinned_versions": VERSIONS, "hybrid_rl_commit": (runs.get("hybrid_rl") or {}).get("commit"),
            "profiles": profiles, "prompts_sha256": next((h for h in hashes.values() if h), None),
            "ratios": ratios, "variant_ratios": variant_ratios, "pairs": pairs, "per_machine": per_machine,
            "machines": machines,
            "same_machine": same,
            "machine_note": None if same else "the ratios compare runs on different machines of the same device "
                                              "kind: compare with that in mind",
            "skipped": {k: v["skipped"] for k, v in runs.items() if "skipped" in v},
            "target": "hybrid_rl's median step at least 1.3x shorter than each peer's that ran, on every machine "
                      "the peer ran on",
            "target_met": met or None,
            # per framework, the options it was asked for that did not take effect (benchmarks/peers/probe.py)
            "took_effect_mismatches": {k: v["took_effect"].get("mismatches") for k, v in runs.items()
                                       if isinstance(v.get("took_effect"), dict) and "mismatches" in v["took_effect"]},
            "frameworks": [runs[k] for k in ORDER if k in runs and "skipped" not in runs[k]] + extra + repeats
                          + variants}


def stem(doc: dict) -> str:
    """``peers_<device>_<workload>``, plus ``_<profile>`` / ``_mixed`` unless every framework ran ``tuned``."""
    profiles = set(doc["profiles"].values())
    suffix = "" if profiles <= {"tuned"} else f"_{profiles.pop()}" if len(profiles) == 1 else "_mixed"
    return f"peers_{doc['device']}_{doc['workload_name']}{suffix}"


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in doc["frameworks"] if "step_s" in r]
    if not ok:
        return
    several = len({r.get("machine") for r in ok}) > 1
    if several:  # each machine's runs side by side, hybrid_rl first
        first = {}
        for r in ok:
            first.setdefault(r.get("machine"), len(first))
        ok.sort(key=lambda r: (first[r.get("machine")], r["framework"] != "hybrid_rl"))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(6 + 2 * len(ok), 4.8))
    names = [f"{r['framework']}\n({r.get('profile')})" + (f"\n{r.get('machine', '')[-8:]}" if several else "")
             for r in ok]
    bottom = [0.0] * len(ok)
    phases = list(dict.fromkeys(p for r in ok for p in r.get("phases_s", {})))
    cmap = plt.get_cmap("tab20")
    for i, ph in enumerate(phases):
        vals = [r.get("phases_s", {}).get(ph, 0.0) for r in ok]
        ax1.bar(names, vals, bottom=bottom, label=ph, color=cmap(i % 20), width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.plot(names, [r["step_s"] for r in ok], "k_", markersize=40, label="step (wall, mean)")
    ax1.plot(names, [r["step_s_median"] for r in ok], "kx", label="step (median)")
    ax1.set_ylabel(f"seconds per step (mean of measured steps; first {ok[0].get('warmup_dropped')} dropped)")
    ax1.set_title("step time and the phases each framework reports")
    ax1.set_ylim(0, max(max(bottom), max(r["step_s"] for r in ok)) * 1.05)
    ax1.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    tput = [r.get("trained_tokens_per_s") or 0.0 for r in ok]
    ax2.bar(names, tput, color=[COLORS.get(r["framework"], "tab:olive") for r in ok], width=0.6)  # olive: variants
    for i, r in enumerate(ok):
        label = f'{r["step_s"]:.1f} s/step\n(median {r["step_s_median"]:.1f})'
        pair = next((pm for pm in doc.get("per_machine", []) if pm["peer"] == r["framework"]
                     and pm["peer_machine"] == r.get("machine")), None)
        if pair:
            label += (f'\nhybrid_rl {pair["ratio_median"]:.2f}x\n(median'
                      f'{", same machine" if pair["same_machine"] else ""})')
        for peer in ("verl", "trl"):  # a variant: its own ratios, on its machine
            v_ratio = doc.get("variant_ratios", {}).get(f'{r["framework"]}_vs_{peer}_step_time_median')
            if v_ratio:
                label += f"\n{v_ratio:.2f}x {peer} (median)"
        ax2.text(i, tput[i], label, ha="center", va="bottom", fontsize=7)
    ax2.set_ylim(0, max(tput) * 1.35 if max(tput) > 0 else 1)
    ax2.set_ylabel("trained tokens / s (prompt + response)")
    ax2.set_title("throughput at equal work")
    w = doc["workload"]
    algo = "PPO (GAE, critic)" if w.get("algorithm") == "gae" else "GRPO"
    skipped = "; ".join(f"{k}: {v}" for k, v in doc.get("skipped", {}).items())
    fig.suptitle(f"{doc['workload_name']}: {doc['model']} on {doc['device']}, {algo}, {w.get('prompts_per_step')} prompts "
                 f"x {w.get('n')}, lengths {w.get('lengths')} (cap {w.get('response_length')}), mini-batch "
                 f"{w.get('mini_batch_prompts')} prompts" + (f"\nnot run: {skipped}" if skipped else "")
                 + ("\neach peer beside the hybrid_rl run on its own machine (boot id under each bar)" if several and doc.get("same_machine") else "")
                 + ("" if doc.get("same_machine", True) else "\nruns on different machines: "
                    + ", ".join(f"{k} {v}" for k, v in doc["machines"].items())), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--res", default="/tmp/peers_res")
    ap.add_argument("--workload", default=os.environ.get("PEERS_WORKLOAD") or DEFAULT_WORKLOAD,
                    choices=list(WORKLOADS))
    ap.add_argument("--out-dir", default=None, help="run directory (default runs/peers/<UTC time>/; "
                    "benchmarks/publish.py copies a result to benchmarks/results/)")
    args = ap.parse_args()
    doc = {**combine(Path(args.res), args.workload), "commit": git_commit()}  # the commit that combined them
    path = run_dir("peers", args.out_dir) / stem(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{path}.json").write_text(json.dumps(doc, indent=2))
    try:
        plot(doc, Path(f"{path}.png"))
    except ImportError as e:
        print(f"no plot ({e}); run this script where matplotlib is installed", file=sys.stderr)
    print(json.dumps({"device": doc["device"], "workload": doc["workload_name"], "profiles": doc["profiles"],
                      "ratios": doc["ratios"], "target_met": doc["target_met"], "same_machine": doc["same_machine"],
                      "steps": {r["framework"] + (f"@{r.get('machine')}" if i >= len(doc["profiles"]) else ""):
                                r.get("step_s", r.get("error")) for i, r in enumerate(doc["frameworks"])}}))
    print(f"wrote {path}.json (+ .png)", file=sys.stderr)


if __name__ == "__main__":
    main()
