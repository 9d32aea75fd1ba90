"""TRL's GRPOTrainer (trl==1.16.0, vLLM colocated) on a peer workload (benchmarks/peers/workload.py).

The launcher writes an accelerate config (FSDP2 with bf16 mixed precision, like TRL's own accelerate_configs/fsdp2.yaml,
or DDP), starts ``accelerate launch`` on this file with ``--worker``, and parses what the worker wrote into the peers'
JSON shape. The worker is plain TRL: a GRPOConfig, a GSM8K reward function and one TrainerCallback that times every
optimizer step (CUDA-synchronised) and reads the peak memory; generation and weight-sync times come from timing
TRL's own ``vllm_generation.generate`` / ``sync_weights`` calls (wrapped on the instance, behaviour unchanged). For
workloads with per-sample response lengths the colocated engine's ``generate`` is wrapped too: TRL sends one request
per sample with one SamplingParams for all; the wrapper gives each request its own copy with
``max_tokens = min_tokens = `` the sample's length (``workload.length_table``, the lengths hybrid_rl draws for the same
step and rank). TRL has no option for it.

One hybrid_rl/verl step (P prompts x n, two mini-batches of P/2 prompts) is two TRL optimizer steps over one
generation batch: generation_batch_size = P x n completions, per_device_train_batch_size x GPUs x
gradient_accumulation_steps = P/2 x n; so 12 steps = max_steps 24. The PPO workload is not run: GRPOTrainer has no
critic.

    python benchmarks/peers/run_trl.py --gpus 2 --workload grpo --model-dir /tmp/peers_model --out /tmp/peers_res
    python benchmarks/peers/run_trl.py --workload grpo_long --print-config   # the GRPOConfig kwargs and accelerate config
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
import probe  # noqa: E402
from workload import (ROOT, VERSIONS, chat_token_counter, commit, common_args, device_name, forced,  # noqa: E402
                      file_sha256, gsm8k_reward, gsm8k_rows, length_table, prepare_model, prepare_prompts, resolve_options,
                      result_path, run_watched, settings_record, skipped, summarize, tail, workload_spec,
                      write_result)

TRL_VERSION = VERSIONS["trl"]
ACCELERATE = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: {dist}
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: {reshard}
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


def baseline(w: dict) -> dict:
    """The settings of the first comparison: FSDP2 resharding after forward, 8 sequences per micro-batch,
    recomputation, no Liger."""
    return {"strategy": "fsdp2", "reshard_after_forward": True, "per_device_train_batch_size": 8,
            "gradient_checkpointing": True, "liger": False, "sleep_mode": True}


def tuned(w: dict) -> dict:
    """TRL's best settings for the workload within what GRPOConfig exposes: parameters kept gathered between forward
    and backward (FSDP2 without resharding), larger micro-batches where the sequences are short (TRL pads the whole
    generation batch to its longest completion, so a micro-batch of k sequences costs k x the longest: 16 x ~770
    tokens for grpo, 2 x ~6,650 for grpo_long, about the 16k-token budget of the others), no recomputation, Liger's
    layer kernels (TRL's use_liger_kernel; its own fused LM head is always on). Sleep mode stays on: the engine's
    memory is released while training, as in the others."""
    return {**baseline(w), "reshard_after_forward": False,
            "per_device_train_batch_size": 2 if w["response_length"] > 1024 else 16,
            "gradient_checkpointing": False, "liger": True}


PROFILES = {"tuned": tuned, "baseline": baseline}


def grpo_kwargs(w: dict, opts: dict, gpus: int, cpu: bool) -> dict:
    per_device = opts["per_device_train_batch_size"]
    mini = w["mini_batch_prompts"] * w["n"]  # sequences per optimizer step
    gen = w["prompts_per_step"] * w["n"]  # completions per generation (one hybrid_rl/verl step)
    if mini % (per_device * gpus) or gen % mini:
        raise SystemExit(f"batch sizes do not divide: {mini} per optimizer step, {per_device} x {gpus} GPUs, {gen}")
    kw = dict(
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=mini // (per_device * gpus),
        generation_batch_size=gen,
        num_generations=w["n"],
        max_completion_length=w["response_length"],
        temperature=w["temperature"], top_p=1.0, top_k=0,
        beta=0.0, num_iterations=1, epsilon=w["clip_low"], epsilon_high=w["clip_high"], loss_type="dapo",
        scale_rewards="group", mask_truncated_completions=False,
        learning_rate=w["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=w["grad_clip"], adam_beta1=0.9, adam_beta2=0.999,
        gradient_checkpointing=opts["gradient_checkpointing"], use_liger_kernel=opts["liger"],
        max_steps=w["steps"] * (gen // mini),
        logging_steps=1, save_strategy="no", report_to="none", seed=w["seed"], shuffle_dataset=False,
        remove_unused_columns=False, dataloader_num_workers=0, log_completions=False,
        model_init_kwargs={"dtype": "float32"},  # fp32 masters, bf16 compute (mixed_precision: bf16)
    )
    if cpu:
        kw.update(use_vllm=False, use_cpu=True, bf16=False, use_liger_kernel=False,
                  generation_kwargs={"min_new_tokens": kw["max_completion_length"]})
    else:
        kw.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=w["gpu_memory_utilization"],
                  vllm_enable_sleep_mode=opts["sleep_mode"], vllm_tensor_parallel_size=1,
                  vllm_max_model_length=w["max_prompt_length"] + w["response_length"],
                  generation_kwargs={"ignore_eos": True, "min_tokens": w["response_length"]}, bf16=True)
        if forced(w):  # each request's max_tokens/min_tokens come from the length wrapper
            kw["generation_kwargs"] = {"ignore_eos": True}
    return kw


def accelerate_config(opts: dict, gpus: int) -> str:
    return ACCELERATE.format(gpus=gpus, dist="FSDP" if opts["strategy"] == "fsdp2" else "MULTI_GPU",
                             reshard="true" if opts["reshard_after_forward"] else "false")


def forced_length_generate(generate, lengths_per_call):
    """``generate(prompts, sampling_params=one SamplingParams)`` → the same call with one copy of the params per
    request, ``max_tokens = min_tokens =`` its length: the k-th call takes ``lengths_per_call(k)``."""
    calls = [0]

    def wrapped(prompts, sampling_params=None, *args, **kwargs):
        lengths = lengths_per_call(calls[0])
        calls[0] += 1
        if len(lengths) != len(prompts):
            raise RuntimeError(f"forced lengths: {len(prompts)} requests in generate call {calls[0] - 1}, "
                               f"{len(lengths)} lengths for it")
        per_request = []
        for length in lengths:
            sp = sampling_params.clone()
            sp.max_tokens = length
            sp.min_tokens = length
            per_request.append(sp)
        return generate(prompts, per_request, *args, **kwargs)

    return wrapped


# -- worker (inside accelerate launch) -----------------------------------------------------------------------------------
def worker(args) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(args.spec).read_text())
    w, opts = spec["workload"], spec["options"]
    rows = gsm8k_rows(Path(args.data))  # prepared: prompts that fit, in order, as many as the run reads
    ds = Dataset.from_list([{"prompt": r["messages"], "ground_truth": r["ground_truth"]} for r in rows])

    def gsm8k(completions, ground_truth, **kwargs):
        out = []
        for c, gt in zip(completions, ground_truth):
            text = c[-1]["content"] if isinstance(c, list) else c
            out.append(gsm8k_reward(text, gt))
        return out

    kw = grpo_kwargs(w, opts, args.gpus, args.cpu_smoke)
    if args.cpu_smoke:
        kw.update(per_device_train_batch_size=4, gradient_accumulation_steps=1, generation_batch_size=8,
                  num_generations=2, max_completion_length=8, generation_kwargs={"min_new_tokens": 8},
                  max_steps=w["steps"] * 2)
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
        if forced(w):
            rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
            table = length_table(w, world, w["steps"] + 2)
            share = len(table[0]) // world
            vg.llm.generate = forced_length_generate(vg.llm.generate,
                                                     lambda k: table[k][rank * share:(rank + 1) * share])
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
    common_args(ap, default_timeout=480)
    ap.add_argument("--model", default=None, help="(worker) the model directory")
    ap.add_argument("--spec", default=None, help="(worker) the workload and options the launcher wrote")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--print-config", action="store_true")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
        return
    if args.cpu_smoke:
        args.gpus, args.steps, args.warmup = 1, 3, 1
    w = workload_spec(args.workload, args.gpus)
    w.update(steps=args.steps or w["steps"], warmup=w["warmup"] if args.warmup is None else args.warmup)
    opts = resolve_options(PROFILES, args.profile, w, args.set)
    if args.print_config:
        print(json.dumps({"grpo_config": grpo_kwargs(w, opts, args.gpus, False) if "trl" in w["frameworks"] else None,
                          "accelerate": accelerate_config(opts, args.gpus)}, indent=1))
        return
    if "trl" not in w["frameworks"]:
        write_result(skipped("trl", w, "TRL's GRPOTrainer has no critic (no GAE/PPO path)"),
                     result_path(out, "trl", w), w)
        return
    t0 = time.perf_counter()
    if args.cpu_smoke:
        sys.path.insert(0, str(ROOT))
        from hybrid_rl.models import resolve_model_path

        model = resolve_model_path("builtin:tiny-qwen2")
        cmd = [sys.executable, __file__, "--worker", "--cpu-smoke"]
    else:
        model = str(prepare_model(w["model"], Path(args.model_dir)))
        cfg = out / "accelerate_trl.yaml"
        cfg.write_text(accelerate_config(opts, args.gpus))
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), __file__, "--worker"]
    prompts = prepare_prompts(Path(args.data), out / f"prompts_{w['name']}.jsonl", w, chat_token_counter(model))
    spec = out / f"trl_{w['name']}_spec.json"
    spec.write_text(json.dumps({"workload": w, "options": opts}))
    cmd += ["--model", model, "--data", str(prompts), "--spec", str(spec), "--out", str(out), "--gpus", str(args.gpus)]
    log_path = out / f"trl_{w['name']}_stdout.log"
    steps_file = out / "trl_steps.jsonl"
    steps_file.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    probe_dir = out / f"probe_trl_{w['name']}"
    env = probe.env_for(env, probe.site(out / "probe_site"), probe_dir)
    wt = run_watched(cmd, ROOT, env, log_path,
                     lambda: len(steps_file.read_text().splitlines()) if steps_file.exists() else 0, w["steps"],
                     args.timeout, t0)
    rows = [json.loads(l) for l in steps_file.read_text().splitlines()] if steps_file.exists() else []
    try:
        import trl

        version = trl.__version__
    except ImportError:
        version = TRL_VERSION
    if version != TRL_VERSION:
        print(f"WARNING: trl {version} imported, {TRL_VERSION} pinned", file=sys.stderr)
    kw = grpo_kwargs(w, opts, args.gpus, args.cpu_smoke)
    settings = settings_record(args.profile, opts, prompts_sha256=file_sha256(prompts),
                               grpo_config={k: v for k, v in kw.items()},
                               accelerate=None if args.cpu_smoke else accelerate_config(opts, args.gpus))
    if len(rows) <= w["warmup"]:
        doc = {"framework": "trl", "version": version, "error": f"exit {wt.returncode}, {len(rows)} steps logged",
               "profile": args.profile, "settings": settings, "log_tail": tail(log_path)}
    else:
        doc = summarize("trl", version, rows, args.gpus, w["warmup"],
                        startup_s=(wt.first_step_at - rows[0]["step_s"]) if wt.first_step_at else None,
                        wall_s=wt.done_at or time.perf_counter() - t0, settings=settings,
                        notes=[f"one step = {kw['generation_batch_size'] // (kw['per_device_train_batch_size'] * args.gpus * kw['gradient_accumulation_steps'])}"
                               f" TRL optimizer steps over one generation batch of {kw['generation_batch_size']} completions",
                               f"lengths {w['lengths']} (cap {w['response_length']}), EOS ignored"
                               + ("; per-request max_tokens/min_tokens by the harness's wrapper of the engine's generate"
                                  if forced(w) else f"; min_tokens={w['response_length']}"),
                               "TRL computes old log-probs (vLLM importance-sampling correction, its default)",
                               "TRL fixes vLLM max_num_batched_tokens=4096 (hybrid_rl and verl: 8192) and derives "
                               "max_num_seqs = per-device batch x steps per generation",
                               "phases: gen and sync_weights timed around TRL's own calls; train = the rest"])
    doc.update(device=device_name(args.gpus) if not args.cpu_smoke else "CPU", commit=commit(),
               took_effect=probe.collect(probe_dir, w["max_prompt_length"] + w["response_length"],
                                         {"liger": opts["liger"]}))
    write_result(doc, result_path(out, "trl", w), w)


if __name__ == "__main__":
    main()
