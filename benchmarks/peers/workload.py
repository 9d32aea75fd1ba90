"""The workloads of the peer comparison, the option profiles, and the helpers the three run_*.py scripts share.

Three workloads (``WORKLOADS``), each expressed in every framework's own config with the same algorithmic settings:

  grpo        GRPO, 16 prompts per GPU x 8 samples, every response exactly 256 tokens (hybrid_rl, verl, TRL)
  grpo_long   generation-heavy GRPO, 8 prompts per GPU x 8 samples, response lengths drawn from a long-tailed
              lognormal (mean 2,048 before the cap, capped at 6,144 tokens: ~1,950 on average, median ~1,490,
              ~4% at the cap) (hybrid_rl, verl, TRL)
  ppo         PPO with a critic (GAE, gamma = lambda = 1), 128 prompts per GPU x 1 sample, lognormal lengths with
              mean 256 capped at 512 (hybrid_rl, verl; TRL's GRPOTrainer has no critic)

Shared by all three: ``builtin:qwen2.5-1.5b-random`` written once to a bf16 HF directory (``prepare_model``; every
engine loads bf16 weights, every trainer keeps fp32 masters with bf16 compute); GSM8K train prompts from
``benchmarks/data/gsm8k_train_1k.jsonl`` as one user turn (question + "Let's think step by step and output the final
answer after "####"."), those of at most 512 tokens, in the file's order and repeated as often as the run needs
(``prepare_prompts``: every framework reads the same rows in the same order, so step s trains the same prompts
everywhere); the PPO mini-batch half the step (2 optimizer steps per step), 1 epoch; clip 0.2 / 0.28, token-mean
loss, no KL and no reference model, entropy 0; AdamW lr 1e-6 constant (critic 1e-5), weight decay 0, grad clip 1.0;
vLLM colocated, 0.3 of GPU memory, CUDA graphs, prefix caching, released while training; EOS ignored (a random
model's response lengths mean nothing): every response is exactly its forced length.

Response lengths are identical across frameworks, sample by sample: ``length_table`` reproduces hybrid_rl's own draw
(``rollout.forced_lengths``: one stream per rank seeded ``seed + 104729 * (rank + 1)``, ``local prompts x n`` lengths
per step), and ``row_lengths`` gives each prompt row the lengths of its n samples, which verl's runs read through a
custom agent loop and TRL's through a wrapper of its colocated engine's ``generate`` (one request per sample, its own
``max_tokens``).

Result JSON shape (one per framework and workload, the same keys as ``benchmarks/modes.py``'s modes where they exist):
  framework, version, device, gpus, profile, steps_measured, step_s (mean), step_s_median, step_s_all, phases_s
  (means), phases_s_median, gen_tokens_per_s, trained_tokens_per_s, response_length_mean, prompt_length_mean,
  peak_memory_allocated_gb, peak_memory_reserved_gb, startup_s, wall_s, settings (profile, options, on, off,
  overrides or config), notes  (or: framework, error, log_tail)
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
DATA = BENCH / "data" / "gsm8k_train_1k.jsonl"  # the GSM8K prompts the benchmarks ship (benchmarks/data/README.md)
FRAMEWORKS = ("hybrid_rl", "verl", "trl")

_COMMON = {
    "model": "builtin:qwen2.5-1.5b-random",
    "max_prompt_length": 512,
    "lr": 1e-6,
    "clip_low": 0.2,
    "clip_high": 0.28,
    "grad_clip": 1.0,
    "temperature": 1.0,
    "gpu_memory_utilization": 0.3,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "seed": 0,
}

WORKLOADS: dict[str, dict] = {
    "grpo": {**_COMMON, "algorithm": "grpo", "frameworks": list(FRAMEWORKS), "prompts_per_gpu": 16, "n": 8,
             "lengths": "fixed:256", "response_length": 256, "steps": 12, "warmup": 2},
    "grpo_long": {**_COMMON, "algorithm": "grpo", "frameworks": list(FRAMEWORKS), "prompts_per_gpu": 8, "n": 8,
                  "lengths": "lognormal:2048:0.8", "response_length": 6144, "steps": 6, "warmup": 2},
    "ppo": {**_COMMON, "algorithm": "gae", "frameworks": ["hybrid_rl", "verl"], "prompts_per_gpu": 128, "n": 1,
            "lengths": "lognormal:256:0.8", "response_length": 512, "steps": 12, "warmup": 2,
            "gamma": 1.0, "lam": 1.0, "critic_lr": 1e-5, "cliprange_value": 0.5},
}
"""Per workload: everything the frameworks must agree on. ``prompts_per_gpu`` x GPUs is the step's prompts;
``response_length`` is the cap (max response length) and ``lengths`` the forced draw under it."""
DEFAULT_WORKLOAD = "grpo"


def workload_spec(name: str | None = None, gpus: int = 4, prompts: str | None = None) -> dict:
    """The workload ``name`` (default ``$PEERS_WORKLOAD`` or grpo) for ``gpus`` GPUs: ``prompts_per_gpu x gpus``
    prompts per step (``prompts``, default ``$PEERS_PROMPTS``, sets the step's prompts directly), the PPO mini-batch
    half of it. One clear error for a name or a count the frameworks cannot all split."""
    name = name or os.environ.get("PEERS_WORKLOAD") or DEFAULT_WORKLOAD
    if name not in WORKLOADS:
        raise SystemExit(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
    w = {"name": name, **WORKLOADS[name]}
    prompts = prompts if prompts is not None else os.environ.get("PEERS_PROMPTS")
    if prompts:
        try:
            p = int(prompts)
        except ValueError:
            raise SystemExit(f"PEERS_PROMPTS={prompts!r} is not an integer: set it to prompts per step, e.g. 32") from None
    else:
        p = w["prompts_per_gpu"] * gpus
    if p < 2 or p % 2:
        raise SystemExit(f"PEERS_PROMPTS={p}: needs an even number >= 2 (the mini-batch is half the step)")
    if p % gpus:
        raise SystemExit(f"PEERS_PROMPTS={p}: needs a multiple of the {gpus} GPUs (each takes its share of prompts)")
    w.update(prompts_per_step=p, mini_batch_prompts=p // 2)
    return w


GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."

# Pinned peer versions: the staged wheels in benchmarks/peers/*.sha256 are these.
VERSIONS = {"trl": "1.16.0", "verl": "0.9.1", "vllm_trl": "0.26.0", "vllm_verl": "0.24.0",
            "transformers_verl": "5.9.0", "ray": "2.60.0", "liger_kernel": "0.8.5"}


# -- options and profiles ------------------------------------------------------------------------------------------------
def parse_value(text: str):
    """``on``/``true`` → True, ``off``/``false`` → False, an integer, a float, else the text."""
    low = text.strip().lower()
    if low in ("on", "true", "yes"):
        return True
    if low in ("off", "false", "no"):
        return False
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def resolve_options(profiles: dict[str, Callable[[dict], dict]], profile: str, w: dict,
                    sets: Iterable[str] = ()) -> dict:
    """The option set of ``profile`` for workload ``w``, then each ``name=value`` of ``sets`` (``--set``) on top;
    a name the profile does not know is an error naming the known ones."""
    if profile not in profiles:
        raise SystemExit(f"unknown profile {profile!r}: one of {', '.join(profiles)}")
    opts = dict(profiles[profile](w))
    for item in sets:
        name, eq, value = item.partition("=")
        if not eq or name not in opts:
            raise SystemExit(f"--set {item!r}: expected NAME=VALUE with NAME one of {', '.join(sorted(opts))}")
        opts[name] = parse_value(value)
    return opts


def settings_record(profile: str, opts: dict, **extra) -> dict:
    """What a result records of its settings: the profile, every option's value, and which switches were on/off."""
    return {"profile": profile, "options": dict(opts),
            "on": sorted(k for k, v in opts.items() if v is True),
            "off": sorted(k for k, v in opts.items() if v is False), **extra}


# -- response lengths ----------------------------------------------------------------------------------------------------
def parse_lengths(spec: str) -> tuple[str, list[float]]:
    """``fixed:N`` or ``lognormal:MEAN:SIGMA`` (hybrid_rl's ``rollout.forced_lengths`` forms)."""
    kind, _, rest = spec.partition(":")
    nums = [float(x) for x in rest.split(":")] if rest else []
    if (kind, len(nums)) not in (("fixed", 1), ("lognormal", 2)) or any(x <= 0 for x in nums):
        raise ValueError(f"lengths {spec!r}: 'fixed:N' or 'lognormal:MEAN:SIGMA' with positive numbers")
    return kind, nums


def rank_lengths(spec: str, cap: int, seed: int, rank: int, per_step: int, steps: int) -> list[list[int]]:
    """hybrid_rl's draw on one rank: a generator seeded ``seed + 104729 * (rank + 1)``, ``per_step`` lengths per step
    (its local prompts x n), a lognormal with the given mean (mu = ln(mean) - sigma^2 / 2) rounded and clipped to
    [1, cap]; ``fixed:N`` is min(N, cap) for every sample."""
    import numpy as np

    kind, nums = parse_lengths(spec)
    if kind == "fixed":
        return [[min(int(nums[0]), cap)] * per_step for _ in range(steps)]
    mean, sigma = nums
    mu = float(np.log(mean) - sigma ** 2 / 2)
    rng = np.random.default_rng(seed + 104729 * (rank + 1))
    out = []
    for _ in range(steps):
        draws = rng.lognormal(mu, sigma, size=per_step)
        out.append([int(x) for x in np.clip(np.round(draws), 1, cap)])
    return out


def length_table(w: dict, gpus: int, steps: int) -> list[list[int]]:
    """Step → the lengths of its ``prompts_per_step x n`` samples in batch order (prompt-major, sample-minor): rank r's
    draw covers the r-th contiguous share of the step's prompts, as hybrid_rl's sampler hands them out."""
    per_rank = w["prompts_per_step"] // gpus * w["n"]
    ranks = [rank_lengths(w["lengths"], w["response_length"], w["seed"], r, per_rank, steps) for r in range(gpus)]
    return [[x for r in range(gpus) for x in ranks[r][s]] for s in range(steps)]


def row_lengths(w: dict, gpus: int, rows: int) -> list[list[int]]:
    """Prompt row k (of the prepared file, read in order) → the lengths of its n samples: row k is prompt
    ``k % P`` of step ``k // P``."""
    p, n = w["prompts_per_step"], w["n"]
    table = length_table(w, gpus, -(-rows // p))
    return [table[k // p][(k % p) * n:(k % p + 1) * n] for k in range(rows)]


def forced(w: dict) -> bool:
    """Whether the lengths need per-sample limits (anything but every response at the cap)."""
    kind, nums = parse_lengths(w["lengths"])
    return not (kind == "fixed" and int(nums[0]) >= w["response_length"])


# -- shared inputs -------------------------------------------------------------------------------------------------------
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


def gsm8k_messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question + "\n" + GSM8K_INSTRUCTION}]


def gsm8k_rows(path: Path, limit: int | None = None) -> list[dict]:
    """(prompt messages, ground truth) for each GSM8K row, in the file's order."""
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        r = json.loads(line)
        answer = r["answer"].split("####")[-1].strip().replace(",", "")
        rows.append({"messages": gsm8k_messages(r["question"]), "ground_truth": answer, "index": len(rows)})
        if limit and len(rows) >= limit:
            break
    return rows


def rows_needed(w: dict) -> int:
    """Prompt rows a run reads: every step's, plus two steps' spare (no framework reaches the end of its data)."""
    return (w["steps"] + 2) * w["prompts_per_step"]


def prepare_prompts(src: Path, out: Path, w: dict, count_tokens: Callable[[list[dict]], int]) -> Path:
    """The GSM8K rows of ``src`` whose prompt (``count_tokens`` of its chat messages) fits ``max_prompt_length``, in
    the file's order, repeated until ``rows_needed(w)``, written to ``out`` as jsonl (question, answer): the one
    prompt file every framework reads, in order, so none filters or reorders anything of its own."""
    kept = []
    for line in src.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if count_tokens(gsm8k_messages(r["question"])) <= w["max_prompt_length"]:
            kept.append({"question": r["question"], "answer": r["answer"]})
    if not kept:
        raise SystemExit(f"no prompt of {src} fits {w['max_prompt_length']} tokens")
    need = rows_needed(w)
    rows = [kept[k % len(kept)] for k in range(need)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def file_sha256(path: Path) -> str:
    """sha256 of a file (a result's ``settings.prompts_sha256``: the prompt file the framework read)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def chat_token_counter(model_dir: str) -> Callable[[list[dict]], int]:
    """Prompt tokens of chat messages with the model's chat template and the generation prompt (how all three count)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return lambda messages: len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))


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
    """Means and medians over the measured steps (every step after the first ``warmup``, the same rule for every
    framework) of normalised per-step rows. Each row holds ``step_s`` and, where the framework reports them:
    ``phases`` (name → s), ``response_tokens``, ``total_tokens``, ``response_length_mean``, ``prompt_length_mean``,
    ``max_memory_allocated_gb``, ``max_memory_reserved_gb``."""
    measured = rows[warmup:]
    if not measured:
        return {"framework": framework, "version": version, "error": f"only {len(rows)} steps logged (warm-up {warmup})",
                "step_s_all": [r["step_s"] for r in rows]}
    mean = lambda key: (statistics.fmean(r[key] for r in measured) if all(r.get(key) is not None for r in measured)
                        else None)
    step_s = mean("step_s")
    phases: dict[str, float] = {}
    phases_median: dict[str, float] = {}
    for name in dict.fromkeys(k for r in measured for k in r.get("phases", {})):
        vals = [r.get("phases", {}).get(name, 0.0) for r in measured]
        phases[name] = statistics.fmean(vals)
        phases_median[name] = statistics.median(vals)
    resp, total = mean("response_tokens"), mean("total_tokens")
    mem_a = [r["max_memory_allocated_gb"] for r in rows if r.get("max_memory_allocated_gb") is not None]
    mem_r = [r["max_memory_reserved_gb"] for r in rows if r.get("max_memory_reserved_gb") is not None]
    return {
        "framework": framework,
        "version": version,
        "gpus": gpus,
        "profile": settings.get("profile"),
        "steps_logged": len(rows),
        "steps_measured": len(measured),
        "warmup_dropped": warmup,
        "step_s": step_s,
        "step_s_median": statistics.median(r["step_s"] for r in measured),
        "step_s_all": [round(r["step_s"], 3) for r in rows],
        "phases_s": phases,
        "phases_s_median": phases_median,
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


def result_path(out: Path, framework: str, w: dict) -> Path:
    """``<out>/<framework>_<workload>.json``."""
    return out / f"{framework}_{w['name']}.json"


def write_result(doc: dict, out: Path, w: dict) -> None:
    doc.setdefault("machine", machine_id())
    doc.setdefault("workload", w)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    print(json.dumps({k: v for k, v in doc.items() if k not in ("settings", "step_s_all", "log_tail", "workload")}),
          flush=True)
    extra = os.environ.get("OUT")  # a copy under $OUT, where the runner collects results
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        (Path(extra) / out.name).write_text(json.dumps(doc, indent=2))


def skipped(framework: str, w: dict, reason: str) -> dict:
    """The result of a framework that cannot express a workload (TRL and PPO)."""
    return {"framework": framework, "skipped": reason, "workload": w}


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


def common_args(ap, default_timeout: float) -> None:
    """The arguments every run_*.py takes."""
    ap.add_argument("--workload", default=None, help=f"one of {', '.join(WORKLOADS)} (default $PEERS_WORKLOAD or "
                                                      f"{DEFAULT_WORKLOAD})")
    ap.add_argument("--profile", default="tuned", help="tuned (default) or baseline")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="change one option of the profile (repeatable), e.g. --set gradient_checkpointing=on")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--model-dir", default="/tmp/peers_model", help="the shared bf16 HF directory (made if missing)")
    ap.add_argument("--data", default=str(DATA), help="GSM8K jsonl (question/answer) the prompts come from")
    ap.add_argument("--steps", type=int, default=None, help="default: the workload's")
    ap.add_argument("--warmup", type=int, default=None, help="default: the workload's")
    ap.add_argument("--out", default="/tmp/peers_res")
    ap.add_argument("--timeout", type=float, default=default_timeout)
