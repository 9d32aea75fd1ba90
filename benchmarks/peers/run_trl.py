"""TRL's GRPOTrainer (trl==1.16.0, vLLM colocated) on the peer workload (benchmarks/peers/workload.py).

The launcher writes an accelerate config (FSDP2, bf16 mixed precision, like TRL's own accelerate_configs/fsdp2.yaml),
starts ``accelerate launch`` on this file with ``--worker``, and parses what the worker wrote into the peers' JSON
shape. The worker is plain TRL: a GRPOConfig, a GSM8K reward function and one TrainerCallback that times every
optimizer step (CUDA-synchronised) and reads the peak memory; generation and weight-sync times come from timing
TRL's own ``vllm_generation.generate`` / ``sync_weights`` calls (wrapped on the instance, behaviour unchanged).

One hybrid_rl/verl step (P prompts x 8, two mini-batches of P/2 prompts; P = 64 on 4 GPUs, 16 per GPU) is two TRL
optimizer steps over one generation batch: generation_batch_size=8P completions, per_device_train_batch_size=8,
gradient_accumulation_steps=4P/(8 x GPUs); so 12 steps = max_steps 24.

    python benchmarks/peers/run_trl.py --gpus 2 --model-dir /tmp/peers_model --out /tmp/peers_res
    python benchmarks/peers/run_trl.py --cpu-smoke     # tiny model on CPU, transformers generate, 1 process
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import (DATA, ROOT, VERSIONS, WORKLOAD as W, commit, device_name, gsm8k_reward,  # noqa: E402
                      gsm8k_rows, prepare_model, run_watched, summarize, tail, write_result)

TRL_VERSION = VERSIONS["trl"]
ACCELERATE_FSDP2 = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: {dist}
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: {gpus}
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def grpo_kwargs(gpus: int, steps: int, cpu: bool) -> dict:
    per_device = W["micro_batch_per_gpu"]
    mini = W["mini_batch_prompts"] * W["n"]  # sequences per optimizer step
    gen = W["prompts_per_step"] * W["n"]  # completions per generation (one hybrid_rl/verl step)
    if mini % (per_device * gpus) or gen % mini:
        raise SystemExit(f"batch sizes do not divide: {mini} per optimizer step, {per_device} x {gpus} GPUs, {gen}")
    kw = dict(
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=mini // (per_device * gpus),
        generation_batch_size=gen,
        num_generations=W["n"],
        max_completion_length=W["response_length"],
        temperature=W["temperature"], top_p=1.0, top_k=0,
        beta=0.0, num_iterations=1, epsilon=W["clip_low"], epsilon_high=W["clip_high"], loss_type="dapo",
        scale_rewards="group", mask_truncated_completions=False,
        learning_rate=W["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=W["grad_clip"], adam_beta1=0.9, adam_beta2=0.999,
        gradient_checkpointing=True,
        max_steps=steps * (gen // mini),
        logging_steps=1, save_strategy="no", report_to="none", seed=W["seed"], shuffle_dataset=True,
        remove_unused_columns=False, dataloader_num_workers=0, log_completions=False,
        model_init_kwargs={"dtype": "float32"},  # fp32 masters, bf16 compute (mixed_precision: bf16)
    )
    if cpu:
        kw.update(use_vllm=False, use_cpu=True, bf16=False,
                  generation_kwargs={"min_new_tokens": kw["max_completion_length"]})
    else:
        kw.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=W["gpu_memory_utilization"],
                  vllm_enable_sleep_mode=True, vllm_tensor_parallel_size=1,
                  vllm_max_model_length=W["max_prompt_length"] + W["response_length"],
                  generation_kwargs={"ignore_eos": True, "min_tokens": W["response_length"]}, bf16=True)
    return kw


# -- worker (inside accelerate launch) -----------------------------------------------------------------------------------
def worker(args) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = gsm8k_rows(Path(args.data))
    # TRL 1.x has no prompt cap: drop what hybrid_rl (data.truncation=filter) and verl (filter_overlong_prompts) drop,
    # prompts over max_prompt_length tokens (the built-in tokenizer is near character level: ~1 in 20 GSM8K prompts)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    rows = [r for r in rows if len(tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)) <= W["max_prompt_length"]]
    ds = Dataset.from_list([{"prompt": r["messages"], "ground_truth": r["ground_truth"]} for r in rows])

    def gsm8k(completions, ground_truth, **kwargs):
        out = []
        for c, gt in zip(completions, ground_truth):
            text = c[-1]["content"] if isinstance(c, list) else c
            out.append(gsm8k_reward(text, gt))
        return out

    kw = grpo_kwargs(args.gpus, args.steps, args.cpu_smoke)
    if args.cpu_smoke:
        kw.update(per_device_train_batch_size=4, gradient_accumulation_steps=1, generation_batch_size=8,
                  num_generations=2, max_completion_length=8, generation_kwargs={"min_new_tokens": 8},
                  max_steps=args.steps * 2)
    config = GRPOConfig(output_dir=str(Path(args.out) / "run_trl"), **kw)
    trainer = GRPOTrainer(model=args.model, reward_funcs=[gsm8k], args=config, train_dataset=ds)
    rank0 = trainer.accelerator.is_main_process
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    timers = {"gen": 0.0, "sync_weights": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                timers[name] += time.perf_counter() - t
        return wrapper

    vg = getattr(trainer, "vllm_generation", None)
    if vg is not None:  # instrumentation only: the same calls, timed
        vg.generate = timed("gen", vg.generate)
        vg.sync_weights = timed("sync_weights", vg.sync_weights)
    steps_file = Path(args.out) / "trl_steps.jsonl"
    opt_per_step = kw["generation_batch_size"] // (kw["per_device_train_batch_size"] * trainer.accelerator.num_processes
                                                   * kw["gradient_accumulation_steps"])

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t0 = None
            self.acc = {"step_s": 0.0}
            self.logs: dict = {}
            self.last_tokens = 0.0
            self.n = 0
            self.recorded = 0  # optimizer steps already in a row (the end-of-training log repeats the last count)

        def on_step_begin(self, a, state, control, **k):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **k):
            if cuda:
                torch.cuda.synchronize()
            self.acc["step_s"] += time.perf_counter() - self.t0
            self.n += 1

        def on_log(self, a, state, control, logs=None, **k):
            logs = logs or {}
            for key in ("completions/mean_length", "num_tokens", "step_time", "reward"):
                if key in logs:
                    self.logs.setdefault(key, []).append(logs[key])
            if self.n % opt_per_step or self.n == self.recorded:
                return
            self.recorded = self.n
            tokens = self.logs.get("num_tokens", [self.last_tokens])[-1]
            resp_len = (self.logs.get("completions/mean_length") or [None])[0]
            row = {"step_s": self.acc["step_s"], "optimizer_steps": self.n,
                   "phases": {"gen": timers["gen"], "sync_weights": timers["sync_weights"],
                              "train": self.acc["step_s"] - timers["gen"] - timers["sync_weights"]},
                   "trl_step_time_s": sum(self.logs.get("step_time", [])),
                   "response_length_mean": resp_len,
                   "response_tokens": resp_len * kw["generation_batch_size"] if resp_len is not None else None,
                   "total_tokens": tokens - self.last_tokens,
                   "reward": (self.logs.get("reward") or [None])[0]}
            if resp_len is not None:
                row["prompt_length_mean"] = row["total_tokens"] / kw["generation_batch_size"] - resp_len
            if cuda:
                row["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
                row["max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
            self.last_tokens = tokens
            self.acc = {"step_s": 0.0}
            self.logs = {}
            timers.update(gen=0.0, sync_weights=0.0)
            if rank0:
                with steps_file.open("a") as f:
                    f.write(json.dumps(row) + "\n")

    trainer.add_callback(StepTimer())
    if rank0:
        steps_file.unlink(missing_ok=True)
        (Path(args.out) / "trl_config.json").write_text(json.dumps(config.to_dict(), indent=1, default=str))
    trainer.train()


# -- launcher ------------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--model-dir", default="/tmp/peers_model")
    ap.add_argument("--model", default=None, help="(worker) the model directory")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--steps", type=int, default=W["steps"])
    ap.add_argument("--warmup", type=int, default=W["warmup"])
    ap.add_argument("--out", default="/tmp/peers_res")
    ap.add_argument("--strategy", choices=["fsdp2", "ddp"], default="fsdp2")
    ap.add_argument("--timeout", type=float, default=480)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
        return
    t0 = time.perf_counter()
    if args.cpu_smoke:
        sys.path.insert(0, str(ROOT))
        from hybrid_rl.models import resolve_model_path

        model, args.gpus, args.steps, args.warmup = resolve_model_path("builtin:tiny-qwen2"), 1, 3, 1
        cmd = [sys.executable, __file__, "--worker", "--cpu-smoke"]
    else:
        model = str(prepare_model(W["model"], Path(args.model_dir)))
        cfg = out / "accelerate_trl.yaml"
        cfg.write_text(ACCELERATE_FSDP2.format(gpus=args.gpus, dist="FSDP" if args.strategy == "fsdp2" else "MULTI_GPU"))
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), __file__, "--worker"]
    cmd += ["--model", model, "--data", args.data, "--steps", str(args.steps), "--out", str(out), "--gpus",
            str(args.gpus)]
    log_path = out / "trl_stdout.log"
    steps_file = out / "trl_steps.jsonl"
    steps_file.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    w = run_watched(cmd, ROOT, env, log_path,
                    lambda: len(steps_file.read_text().splitlines()) if steps_file.exists() else 0, args.steps,
                    args.timeout, t0)
    rows = [json.loads(l) for l in steps_file.read_text().splitlines()] if steps_file.exists() else []
    try:
        import trl

        version = trl.__version__
    except ImportError:
        version = TRL_VERSION
    if version != TRL_VERSION:
        print(f"WARNING: trl {version} imported, {TRL_VERSION} pinned", file=sys.stderr)
    if len(rows) <= args.warmup:
        doc = {"framework": "trl", "version": version, "error": f"exit {w.returncode}, {len(rows)} steps logged",
               "log_tail": tail(log_path)}
    else:
        cfg_doc = json.loads((out / "trl_config.json").read_text()) if (out / "trl_config.json").exists() else {}
        keep = ["per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
                "steps_per_generation", "num_generations", "max_completion_length", "beta", "epsilon", "epsilon_high",
                "loss_type", "learning_rate", "bf16", "gradient_checkpointing", "use_vllm", "vllm_mode",
                "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "generation_kwargs", "max_steps",
                "vllm_importance_sampling_correction", "scale_rewards", "model_init_kwargs"]
        doc = summarize("trl", version, rows, args.gpus, args.warmup,
                        startup_s=(w.first_step_at - rows[0]["step_s"]) if w.first_step_at else None,
                        wall_s=w.done_at or time.perf_counter() - t0,
                        settings={"strategy": args.strategy, **{k: cfg_doc.get(k) for k in keep}},
                        notes=[f"one step = 2 TRL optimizer steps over one generation batch of "
                               f"{W['prompts_per_step'] * W['n']} completions",
                               "lengths forced with generation_kwargs ignore_eos=True, min_tokens=256",
                               "TRL computes old log-probs (vLLM importance-sampling correction, its default)",
                               "TRL fixes vLLM max_num_batched_tokens=4096 (hybrid_rl and verl: 8192)",
                               "phases: gen and sync_weights timed around TRL's own calls; train = the rest"])
    doc.update(device=device_name(args.gpus) if not args.cpu_smoke else "CPU", commit=commit())
    write_result(doc, out / "trl.json")


if __name__ == "__main__":
    main()
