"""hybrid_rl on the peer workload (benchmarks/peers/workload.py): recipes/gsm8k_grpo.yaml with overrides, run under
torchrun, its runs/<dir>/metrics.jsonl parsed into the peers' JSON shape.

    python benchmarks/peers/run_hybrid_rl.py --gpus 2 --model-dir /tmp/peers_model --out /tmp/peers_res
    python benchmarks/peers/run_hybrid_rl.py --cpu-smoke      # tiny model on CPU (HF engine): checks the plumbing
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import (DATA, ROOT, WORKLOAD as W, commit, device_name, prepare_model, run_watched,  # noqa: E402
                      summarize, tail, write_result)

PHASES = ["gen", "switch", "sync_weights", "reward", "old_log_prob", "ref", "adv", "update", "other"]


def overrides(model_dir: str, run_dir: Path, data: str, steps: int, cpu: bool) -> list[str]:
    o = [
        f"model.path={model_dir}", "model.dtype=bfloat16", "model.enable_gradient_checkpointing=true",
        f"data.train_path={data}", "data.val_path=null",
        f"data.train_batch_size={W['prompts_per_step']}", f"data.max_prompt_length={W['max_prompt_length']}",
        f"data.max_response_length={W['response_length']}", "data.truncation=filter",
        f"rollout.n={W['n']}", f"rollout.temperature={W['temperature']}",
        f"rollout.forced_lengths=fixed:{W['response_length']}",
        f"rollout.vllm.gpu_memory_utilization={W['gpu_memory_utilization']}", f"rollout.max_num_seqs={W['max_num_seqs']}",
        "rollout.free_cache_engine=true", "rollout.sleep_level=2", "rollout.vllm.enforce_eager=false",
        "rollout.vllm.enable_prefix_caching=true", "rollout.vllm.tensor_parallel_size=1",
        f"actor.lr={W['lr']}", "actor.weight_decay=0.0", "actor.lr_scheduler=constant", "actor.warmup_steps=0",
        "actor.ppo_epochs=1", f"actor.ppo_mini_batch_size={W['mini_batch_prompts']}",
        f"actor.ppo_micro_batch_size_per_device={W['micro_batch_per_gpu']}",
        f"actor.log_prob_micro_batch_size_per_device={W['log_prob_micro_batch_per_gpu']}",
        f"actor.clip_ratio_low={W['clip_low']}", f"actor.clip_ratio_high={W['clip_high']}",
        "actor.loss_agg_mode=token-mean", "actor.entropy_coeff=0.0", "actor.use_kl_loss=false",
        f"actor.grad_clip={W['grad_clip']}",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false", "algorithm.norm_adv_by_std_in_grpo=true",
        f"trainer.seed={W['seed']}", f"trainer.total_steps={steps}", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
        f"trainer.output_dir={run_dir}",
    ]
    if cpu:  # the HF engine on CPU: no vLLM knobs matter, the batch is cut down in main()
        o += ["trainer.device=cpu", "rollout.name=hf", "model.dtype=float32"]
    else:
        o += ["rollout.name=vllm"]
    return o


def parse(metrics: Path) -> list[dict]:
    rows = []
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if "timing/step" not in r:
            continue
        resp_mean = r.get("rollout/response_length_mean")
        rows.append({
            "step_s": r["timing/step"],
            "phases": {p: r[f"timing/{p}"] for p in PHASES if f"timing/{p}" in r},
            "total_tokens": r["perf/tokens_per_s"] * r["timing/step"] if "perf/tokens_per_s" in r else None,
            "response_tokens": r["perf/gen_tokens_per_s"] * r["timing/gen"] if "perf/gen_tokens_per_s" in r else None,
            "response_length_mean": resp_mean,
            "prompt_length_mean": r.get("rollout/prompt_length_mean"),
            "max_memory_allocated_gb": r.get("perf/max_memory_allocated_gb"),
            "max_memory_reserved_gb": r.get("perf/max_memory_reserved_gb"),
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--model-dir", default="/tmp/peers_model", help="the shared bf16 HF directory (made if missing)")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--steps", type=int, default=W["steps"])
    ap.add_argument("--warmup", type=int, default=W["warmup"])
    ap.add_argument("--out", default="/tmp/peers_res")
    ap.add_argument("--timeout", type=float, default=420)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("extra", nargs="*", help="more key=value overrides")
    args = ap.parse_args()
    out = Path(args.out)
    run_dir = out / "run_hybrid_rl"
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.cpu_smoke:
        model_dir = "builtin:tiny-qwen2"
        args.gpus, args.steps, args.warmup = 1, 3, 1
    else:
        model_dir = str(prepare_model(W["model"], Path(args.model_dir)))
    ov = overrides(model_dir, run_dir, args.data, args.steps, args.cpu_smoke)
    if args.cpu_smoke:
        ov += ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "rollout.n=2",
               "data.max_response_length=8", "rollout.forced_lengths=fixed:8",
               "actor.ppo_micro_batch_size_per_device=2", "actor.log_prob_micro_batch_size_per_device=2"]
    ov += args.extra
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
           "-m", "hybrid_rl", "train", str(ROOT / "recipes" / "gsm8k_grpo.yaml"), *ov]
    log_path = run_dir / "stdout.log"
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [env.get("PYTHONPATH", ""), str(ROOT)] if p)
    w = run_watched(cmd, ROOT, env, log_path,
                    lambda: sum(1 for l in metrics.read_text().splitlines() if '"timing/step"' in l) if metrics.exists() else 0,
                    args.steps, args.timeout, t0)
    rows = parse(metrics) if metrics.exists() else []
    import torch

    version = f"{commit()} (torch {torch.__version__})"
    if len(rows) <= args.warmup:
        doc = {"framework": "hybrid_rl", "version": version, "error": f"exit {w.returncode}, {len(rows)} steps logged",
               "log_tail": tail(log_path)}
    else:
        first = rows[0]["step_s"]
        doc = summarize("hybrid_rl", version, rows, args.gpus, args.warmup,
                        startup_s=(w.first_step_at - first) if w.first_step_at else None,
                        wall_s=w.done_at or time.perf_counter() - t0, settings={"overrides": ov},
                        notes=["response lengths forced: rollout.forced_lengths=fixed:256 (EOS ignored, no stop ids)"])
    doc.update(device=device_name(args.gpus) if not args.cpu_smoke else "CPU", commit=commit())
    write_result(doc, out / "hybrid_rl.json")


if __name__ == "__main__":
    main()
