"""The shared workload of the peer comparison and the helpers the three run_*.py scripts share.

One GRPO workload, expressed in each framework's own config:
  model   builtin:qwen2.5-1.5b-random, written once to a HF directory in bfloat16 (``prepare_model``), so that every
          engine (hybrid_rl's, TRL's and verl's vLLM) loads bf16 weights and every trainer keeps fp32 masters with
          bf16 compute; its generation_config names one EOS id, so vLLM's ``ignore_eos`` leaves no stop id active
  data    GSM8K train prompts from ``benchmarks/data/gsm8k_train_1k.jsonl`` (``DATA``: the split's first 1,024 rows,
          shipped with the benchmarks; 12 steps of 64 prompts use 768 of them; ``--data`` takes another), the prompt
          ``question + "\\n" + "Let's think step by step and output the final answer after \\"####\\"."`` as one user turn
          (hybrid_rl's and verl's gsm8k format), prompts capped at 512 tokens (none is longer)
  batch   64 prompts x 8 samples per step on 4 GPUs (16 prompts per GPU: ``PEERS_PROMPTS``, set by run_all.sh to
          16 x GPUs, so a 2-GPU machine runs 32 prompts with the same work per GPU); PPO mini-batch half the step
          (2 optimizer steps per step), 1 PPO epoch, micro-batch 8 sequences per GPU, log-prob micro-batch 16
  lengths every response exactly 256 tokens: a random model never stops, and each framework is told to ignore EOS
          (hybrid_rl ``rollout.forced_lengths=fixed:256``, verl ``rollout.ignore_eos=True``, TRL
          ``generation_kwargs={"ignore_eos": True, "min_tokens": 256}``) with max response length 256
  loss    GRPO advantages (group mean/std), PPO clip 0.2 / 0.28, token-mean, no KL (no reference model), entropy 0,
          AdamW lr 1e-6 constant, weight decay 0, grad clip 1.0, gradient checkpointing on
  engine  vLLM colocated on the training GPUs, bf16, CUDA graphs on, prefix caching on, 0.3 of GPU memory, released
          (sleep level 2) while training
  steps   12, the first 2 are warm-up and dropped from the means

Result JSON shape (one per framework, the same keys as ``benchmarks/modes.py``'s modes where they exist):
  framework, version, device, gpus, steps_measured, step_s, step_s_all, phases_s, gen_tokens_per_s,
  trained_tokens_per_s, response_length_mean, prompt_length_mean, peak_memory_allocated_gb,
  peak_memory_reserved_gb, startup_s, wall_s, settings, notes  (or: framework, error, log_tail)
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
DATA = BENCH / "data" / "gsm8k_train_1k.jsonl"  # the GSM8K prompts the benchmarks ship (benchmarks/data/README.md)

WORKLOAD = {
    "model": "builtin:qwen2.5-1.5b-random",
    "prompts_per_step": 64,
    "n": 8,
    "mini_batch_prompts": 32,
    "micro_batch_per_gpu": 8,
    "log_prob_micro_batch_per_gpu": 16,
    "max_prompt_length": 512,
    "response_length": 256,
    "steps": 12,
    "warmup": 2,
    "lr": 1e-6,
    "clip_low": 0.2,
    "clip_high": 0.28,
    "grad_clip": 1.0,
    "temperature": 1.0,
    "gpu_memory_utilization": 0.3,
    "max_num_seqs": 256,
    "seed": 0,
}


def scale_batch(workload: dict, prompts: str | None) -> dict:
    """The step's prompts from ``PEERS_PROMPTS`` (run_all.sh: 16 per GPU), the PPO mini-batch half of it (2 optimizer
    steps per step). One clear error for a value the three frameworks cannot all split."""
    if not prompts:
        return workload
    try:
        n = int(prompts)
    except ValueError:
        raise SystemExit(f"PEERS_PROMPTS={prompts!r} is not an integer: set it to prompts per step, e.g. 32") from None
    if n < 2 or n % 2:
        raise SystemExit(f"PEERS_PROMPTS={n}: needs an even number >= 2 (the mini-batch is half the step)")
    return {**workload, "prompts_per_step": n, "mini_batch_prompts": n // 2}


WORKLOAD = scale_batch(WORKLOAD, os.environ.get("PEERS_PROMPTS"))
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."

# Pinned peer versions: the staged wheels in benchmarks/peers/*.sha256 are these.
VERSIONS = {"trl": "1.16.0", "verl": "0.9.1", "vllm_trl": "0.26.0", "vllm_verl": "0.24.0",
            "transformers_verl": "5.9.0", "ray": "2.60.0"}


def device_name(gpus: int) -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    if not out:
        return "CPU"
    sys.path.insert(0, str(BENCH))
    from bench_common import gpu_short_name

    return f"{gpu_short_name(out[0])}x{gpus}"


def commit() -> str:
    sys.path.insert(0, str(BENCH))
    from bench_common import git_commit

    return git_commit(ROOT)


# -- shared inputs -----------------------------------------------------------------------------------------------------
def prepare_model(builtin: str, out: Path) -> Path:
    """``builtin:NAME`` → a bf16 HF directory at ``out`` (once; reused when its marker is there)."""
    marker = out / ".peers_model"
    if marker.exists() and marker.read_text().strip() == builtin:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    sys.path.insert(0, str(ROOT))
    from hybrid_rl.models import resolve_model_path

    src = resolve_model_path(builtin)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.config.dtype = torch.bfloat16
    eos = tok.eos_token_id if tok.eos_token_id is not None else model.config.eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = eos[0]
    model.config.eos_token_id = eos
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id if tok.pad_token_id
                                               is not None else eos)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    marker.write_text(builtin)
    return out


def gsm8k_rows(path: Path, limit: int | None = None) -> list[dict]:
    """(prompt messages, ground truth) for each GSM8K row, in the file's order."""
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        r = json.loads(line)
        answer = r["answer"].split("####")[-1].strip().replace(",", "")
        rows.append({"messages": [{"role": "user", "content": r["question"] + "\n" + GSM8K_INSTRUCTION}],
                     "ground_truth": answer, "index": i})
        if limit and len(rows) >= limit:
            break
    return rows


def gsm8k_reward(text: str, ground_truth: str) -> float:
    """1 when the number after the last ``####`` equals the ground truth (verl's and hybrid_rl's strict rule)."""
    import re

    m = re.findall(r"#### (\-?[0-9\.\,]+)", text)
    if not m:
        return 0.0
    return 1.0 if m[-1].replace(",", "").replace("$", "") == ground_truth else 0.0


# -- results -------------------------------------------------------------------------------------------------------------
def summarize(framework: str, version: str, rows: list[dict], gpus: int, warmup: int, *, startup_s: float | None,
              wall_s: float | None, settings: dict, notes: list[str]) -> dict:
    """Means over the measured steps of normalised per-step rows. Each row holds ``step_s`` and, where the framework
    reports them: ``phases`` (name → s), ``response_tokens``, ``total_tokens``, ``response_length_mean``,
    ``prompt_length_mean``, ``max_memory_allocated_gb``, ``max_memory_reserved_gb``."""
    measured = rows[warmup:]
    if not measured:
        return {"framework": framework, "version": version, "error": f"only {len(rows)} steps logged (warm-up {warmup})",
                "step_s_all": [r["step_s"] for r in rows]}
    mean = lambda key: (statistics.fmean(r[key] for r in measured) if all(r.get(key) is not None for r in measured)
                        else None)
    step_s = mean("step_s")
    phases: dict[str, float] = {}
    for name in dict.fromkeys(k for r in measured for k in r.get("phases", {})):
        phases[name] = statistics.fmean(r.get("phases", {}).get(name, 0.0) for r in measured)
    resp, total = mean("response_tokens"), mean("total_tokens")
    mem_a = [r["max_memory_allocated_gb"] for r in rows if r.get("max_memory_allocated_gb") is not None]
    mem_r = [r["max_memory_reserved_gb"] for r in rows if r.get("max_memory_reserved_gb") is not None]
    return {
        "framework": framework,
        "version": version,
        "gpus": gpus,
        "steps_logged": len(rows),
        "steps_measured": len(measured),
        "step_s": step_s,
        "step_s_median": statistics.median(r["step_s"] for r in measured),
        "step_s_all": [round(r["step_s"], 3) for r in rows],
        "phases_s": phases,
        "gen_tokens_per_s": resp / step_s if resp and step_s else None,
        "trained_tokens_per_s": total / step_s if total and step_s else None,
        "response_tokens_per_step": resp,
        "total_tokens_per_step": total,
        "response_length_mean": mean("response_length_mean"),
        "prompt_length_mean": mean("prompt_length_mean"),
        "peak_memory_allocated_gb": max(mem_a) if mem_a else None,
        "peak_memory_reserved_gb": max(mem_r) if mem_r else None,
        "startup_s": startup_s,
        "wall_s": wall_s,
        "settings": settings,
        "notes": notes,
    }


def machine_id() -> str:
    """Which machine ran this: the kernel's boot id (the same for every run until a reboot) and the date."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "unknown"
    return f"{time.strftime('%Y-%m-%d', time.gmtime())} boot {boot}"


def write_result(doc: dict, out: Path) -> None:
    doc.setdefault("machine", machine_id())
    doc.setdefault("workload", WORKLOAD)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(json.dumps({k: v for k, v in doc.items() if k not in ("settings", "step_s_all", "log_tail")}), flush=True)
    extra = os.environ.get("OUT")  # a copy under $OUT, where the runner collects results
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        (Path(extra) / out.name).write_text(json.dumps(doc, indent=2))


@dataclass
class Watched:
    returncode: int | None
    first_step_at: float | None
    """Seconds from ``t0`` to the first logged step (None: none was)."""
    done_at: float | None
    """Seconds from ``t0`` to the last wanted step (None: not reached)."""


def run_watched(cmd: list[str], cwd: Path, env: dict, log_path: Path, steps_logged: Callable[[], int], steps: int,
                timeout: float, t0: float) -> Watched:
    """Run a framework's training command with its output in ``log_path``, polling ``steps_logged`` every second;
    its process group is killed 20 s after ``steps`` steps are logged (no teardown timed) or at ``timeout``."""
    first_step_at = done_at = None
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        while proc.poll() is None:
            time.sleep(1.0)
            n = steps_logged()
            el = time.perf_counter() - t0
            if n >= 1 and first_step_at is None:
                first_step_at = el
            if n >= steps and done_at is None:
                done_at = el
            if (done_at is not None and el - done_at > 20) or el > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
    return Watched(proc.returncode, first_step_at, done_at)


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""
