"""hybrid_rl on a peer workload (benchmarks/peers/workload.py): recipes/gsm8k_grpo.yaml (the GRPO workloads) or
recipes/gsm8k_ppo.yaml (ppo) with overrides, run under torchrun, its runs/<dir>/metrics.jsonl parsed into the peers'
JSON shape.

    python benchmarks/peers/run_hybrid_rl.py --gpus 2 --workload grpo --model-dir /tmp/peers_model --out /tmp/peers_res
    python benchmarks/peers/run_hybrid_rl.py --workload ppo --print-overrides
    python benchmarks/peers/run_hybrid_rl.py --cpu-smoke      # tiny model on CPU (HF engine): checks the plumbing
    python benchmarks/peers/run_hybrid_rl.py --workload ppo --out /tmp/peers_res --add-memory
                                          # runs nothing: adds the per-phase peaks of the run in --out to its result
    python benchmarks/peers/run_hybrid_rl.py --workload grpo_long --variant overlap_partial ...

``--variant NAME`` runs the same workload with hybrid_rl's settings changed as ``VARIANTS`` names them, written as
framework ``hybrid_rl+NAME`` (``hybrid_rl+NAME_<workload>.json``) beside the plain run; ``plot.py`` shows it as a bar of
its own and keeps the target's ratios to the plain run. A variant in overlap mode is not the synchronous algorithm the
peers run: its step is the loop's cadence (``timing/iteration``), and its samples are up to ``max_staleness`` weight
versions old.

The result records each timed phase's peak memory over the measured steps as the planner names it (``memory``,
``engine_pool``: ``benchmarks/phase_memory.py``), which ``benchmarks/plan_calibration.py`` sets beside the planner.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import probe  # noqa: E402
from phase_memory import memory_record  # noqa: E402
from workload import (ROOT, chat_token_counter, commit, common_args, device_name, file_sha256, prepare_model,  # noqa: E402
                      prepare_prompts, resolve_options, result_path, run_watched, settings_record, summarize, tail,
                      workload_spec, write_result)

PHASES = ["gen", "switch", "sync_weights", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update",
          "other"]


def baseline(w: dict) -> dict:
    """The settings of the first comparison (GRPO: the flagship recipe's token budgets with recomputation) and of
    recipes/gsm8k_ppo.yaml before it took the flagship's levers (PPO: 8-sequence micro-batches, recomputation)."""
    grpo = w["algorithm"] == "grpo"
    opts = {"gradient_checkpointing": True, "liger": False, "remove_padding": True, "share_prompts": True,
            "fused_logprob": True, "dynamic_bsz": grpo, "max_token_len_per_device": 16384,
            "accumulate_unsharded": grpo, "micro_batch_per_device": 8, "log_prob_micro_batch_per_device": 16}
    if not grpo:  # the critic's options exist where there is a critic
        opts.update(critic_dynamic_bsz=False, critic_max_token_len_per_device=16384,
                    critic_gradient_checkpointing=True, critic_micro_batch_per_device=8,
                    critic_forward_micro_batch_per_device=32)
    return opts


def tuned(w: dict) -> dict:
    """recipes/gsm8k_grpo.yaml's levers for every pass (packed rows, shared prompts, the fused LM head, 16k-token
    micro-batches, one all-gather/reduce-scatter per mini-batch), the critic's passes by the same budget, no
    recomputation, Liger's layer kernels."""
    opts = {**baseline(w), "gradient_checkpointing": False, "liger": True, "dynamic_bsz": True,
            "accumulate_unsharded": True}
    if "critic_dynamic_bsz" in opts:
        opts.update(critic_dynamic_bsz=True, critic_gradient_checkpointing=False)
    return opts


PROFILES = {"tuned": tuned, "baseline": baseline}

VARIANTS = {
    "gc": (["trainer.gc_steps=1"],
           "the garbage collector off while steps run, one collection after each step (trainer.gc_steps=1)"),
    "engine_process": (["rollout.vllm.engine_process=true"],
                       "vLLM's engine core in a process of its own (as verl's server runs it), weights pushed as CUDA "
                       "IPC handles; the same synchronous algorithm"),
    "logprobs_auto": (["rollout.logprobs=auto"],
                      "the engine computes and returns no log-probs (nothing in a synchronous step reads them), as "
                      "verl with rollout.calculate_log_probs=false; the same algorithm"),
    "overlap": (["trainer.mode=overlap", "trainer.max_staleness=1"],
                "one-step overlap colocated: batch k+1 generates while batch k trains (staleness 1, decoupled PPO)"),
    "overlap_partial": (["trainer.mode=overlap", "trainer.partial_rollouts=true", "trainer.partial_rollout_ahead=1",
                         "trainer.max_staleness=2"],
                        "overlap colocated with partial rollouts: the engine stops once a step's groups are complete "
                        "and carries the unfinished ones into the next round (staleness up to 2, decoupled PPO)"),
}
"""``--variant NAME``: (overrides, what it changes). Overlap variants are compared by the loop's cadence."""
SMOKE_PROMPT = 504  # --cpu-smoke: the tiny model's 512 positions less its 8-token responses


def recipe(w: dict) -> Path:
    return ROOT / "recipes" / ("gsm8k_ppo.yaml" if w["algorithm"] == "gae" else "gsm8k_grpo.yaml")


def overrides(model_dir: str, run_dir: Path, data: str, w: dict, opts: dict, cpu: bool) -> list[str]:
    b = lambda v: "true" if v else "false"
    o = [
        f"model.path={model_dir}", "model.dtype=bfloat16",
        f"model.enable_gradient_checkpointing={b(opts['gradient_checkpointing'])}", f"model.use_liger={b(opts['liger'])}",
        f"data.train_path={data}", "data.val_path=null", "data.shuffle=false",
        f"data.train_batch_size={w['prompts_per_step']}", f"data.max_prompt_length={w['max_prompt_length']}",
        f"data.max_response_length={w['response_length']}", "data.truncation=filter",
        f"rollout.n={w['n']}", f"rollout.temperature={w['temperature']}", f"rollout.forced_lengths={w['lengths']}",
        f"rollout.vllm.gpu_memory_utilization={w['gpu_memory_utilization']}", f"rollout.max_num_seqs={w['max_num_seqs']}",
        f"rollout.vllm.max_num_batched_tokens={w['max_num_batched_tokens']}",
        "rollout.free_cache_engine=true", "rollout.sleep_level=2", "rollout.vllm.enforce_eager=false",
        "rollout.vllm.enable_prefix_caching=true", "rollout.vllm.tensor_parallel_size=1",
        f"actor.lr={w['lr']}", "actor.weight_decay=0.0", "actor.lr_scheduler=constant", "actor.lr_warmup_steps=0",
        "actor.ppo_epochs=1", f"actor.ppo_mini_batch_size={w['mini_batch_prompts']}",
        f"actor.use_dynamic_bsz={b(opts['dynamic_bsz'])}", f"actor.max_token_len_per_device={opts['max_token_len_per_device']}",
        f"actor.accumulate_unsharded={b(opts['accumulate_unsharded'])}",
        f"actor.ppo_micro_batch_size_per_device={opts['micro_batch_per_device']}",
        f"actor.log_prob_micro_batch_size_per_device={opts['log_prob_micro_batch_per_device']}",
        f"actor.use_remove_padding={b(opts['remove_padding'])}", f"actor.share_prompts={b(opts['share_prompts'])}",
        f"actor.fused_logprob={b(opts['fused_logprob'])}",
        f"actor.clip_ratio_low={w['clip_low']}", f"actor.clip_ratio_high={w['clip_high']}",
        "actor.loss_agg_mode=token-mean", "actor.entropy_coeff=0.0", "actor.use_kl_loss=false",
        f"actor.grad_clip={w['grad_clip']}", "algorithm.use_kl_in_reward=false",
        f"trainer.seed={w['seed']}", f"trainer.total_steps={w['steps']}", "trainer.test_freq=0",
        "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
        f"trainer.output_dir={run_dir}",
    ]
    if w["algorithm"] == "gae":
        o += ["algorithm.adv_estimator=gae", f"algorithm.gamma={w['gamma']}", f"algorithm.lam={w['lam']}",
              f"critic.lr={w['critic_lr']}", "critic.weight_decay=0.0", "critic.lr_scheduler=constant",
              "critic.lr_warmup_steps=0", "critic.freeze_actor_steps=0", "critic.ppo_epochs=1",
              f"critic.ppo_mini_batch_size={w['mini_batch_prompts']}", f"critic.cliprange_value={w['cliprange_value']}",
              "critic.loss_agg_mode=token-mean", f"critic.grad_clip={w['grad_clip']}",
              f"critic.enable_gradient_checkpointing={b(opts['critic_gradient_checkpointing'])}",
              f"critic.use_dynamic_bsz={b(opts['critic_dynamic_bsz'])}",
              f"critic.max_token_len_per_device={opts['critic_max_token_len_per_device']}",
              f"critic.ppo_micro_batch_size_per_device={opts['critic_micro_batch_per_device']}",
              f"critic.forward_micro_batch_size_per_device={opts['critic_forward_micro_batch_per_device']}",
              "critic.param_offload=false", "critic.optimizer_offload=false"]
    else:
        o += ["algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=true"]
    if cpu:  # the HF engine on CPU: no vLLM knobs matter, no Liger, CUDA-only levers back to their defaults
        o += ["trainer.device=cpu", "rollout.name=hf", "model.dtype=float32", "model.use_liger=false",
              "actor.use_remove_padding=null", "actor.share_prompts=null", "actor.fused_logprob=null"]
    else:
        o += ["rollout.name=vllm"]
    return o


def parse(metrics: Path, step_key: str = "timing/step") -> list[dict]:
    """Per-step rows of a run's ``metrics.jsonl``; ``step_key`` is the step's time (``timing/iteration`` for a mode
    whose generation runs beside the step)."""
    rows = []
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if "timing/step" not in r:
            continue
        resp_mean = r.get("rollout/response_length_mean")
        rows.append({
            "step_s": r.get(step_key, r["timing/step"]),
            "phases": {p: r[f"timing/{p}"] for p in PHASES if f"timing/{p}" in r},
            "total_tokens": r["perf/tokens_per_s"] * r["timing/step"] if "perf/tokens_per_s" in r else None,
            "response_tokens": r["perf/gen_tokens_per_s"] * r["timing/gen"] if "perf/gen_tokens_per_s" in r else None,
            "response_length_mean": resp_mean,
            "prompt_length_mean": r.get("rollout/prompt_length_mean"),
            "max_memory_allocated_gb": r.get("perf/max_memory_allocated_gb"),
            "max_memory_reserved_gb": r.get("perf/max_memory_reserved_gb"),
        })
    return rows


def measured_gc(metrics: Path, warmup: int) -> dict:
    """``gc_pause_s``: the garbage collector's mean seconds per measured step, in the step and in each phase it ran in
    (``perf/gc_pause_s``), and the collection between steps (``timing/gc``, with ``trainer.gc_steps``)."""
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "timing/step" in r][warmup:]
    keys = dict.fromkeys(k for r in rows for k in r if k.startswith("perf/gc_pause_s") or k == "timing/gc")
    if not rows or not keys:
        return {}
    name = lambda k: "between_steps" if k == "timing/gc" else "step" if k == "perf/gc_pause_s" else k.rsplit("/", 1)[1]
    return {"gc_pause_s": {name(k): sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys}}


def measured_memory(metrics: Path, warmup: int) -> dict:
    """``memory`` and ``engine_pool`` (``phase_memory.memory_record``) over the steps after ``warmup`` of a run's
    ``metrics.jsonl``."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return memory_record([r for r in rows if "timing/step" in r][warmup:])


def add_memory(out: Path, w: dict) -> int:
    """Add ``memory`` and ``engine_pool`` to the result in ``out`` from its run's ``metrics.jsonl`` (a result written
    before they were recorded); 2 with one line when either file is missing."""
    path, metrics = result_path(out, "hybrid_rl", w), out / f"run_hybrid_rl_{w['name']}" / "metrics.jsonl"
    for need in (path, metrics):
        if not need.is_file():
            print(f"error: {need} not found: --add-memory reads a finished run's result and its metrics.jsonl in --out",
                  file=sys.stderr)
            return 2
    doc = json.loads(path.read_text())
    doc.update(measured_memory(metrics, doc.get("warmup_dropped", w["warmup"])))
    doc["memory_added"] = f"from {metrics.parent.name}/metrics.jsonl by run_hybrid_rl.py --add-memory at {commit()}"
    path.write_text(json.dumps(doc, indent=2))
    print(json.dumps({k: doc[k] for k in ("memory", "engine_pool", "memory_added")}))
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, default_timeout=420)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--print-overrides", action="store_true")
    ap.add_argument("--add-memory", action="store_true",
                    help="run nothing: add the per-phase peaks of the finished run in --out to its result")
    ap.add_argument("--variant", choices=sorted(VARIANTS),
                    help="hybrid_rl's settings changed as VARIANTS names them; written as framework hybrid_rl+NAME")
    ap.add_argument("extra", nargs="*", help="more key=value overrides")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.gpus, args.steps, args.warmup = 1, 3, 1
    w = workload_spec(args.workload, args.gpus)
    w.update(steps=args.steps or w["steps"], warmup=w["warmup"] if args.warmup is None else args.warmup)
    opts = resolve_options(PROFILES, args.profile, w, args.set)
    out = Path(args.out)
    if args.add_memory:
        sys.exit(add_memory(out, w))
    framework = f"hybrid_rl+{args.variant}" if args.variant else "hybrid_rl"
    variant_ov, variant_note = VARIANTS[args.variant] if args.variant else ([], None)
    overlap = "trainer.mode=overlap" in variant_ov
    run_dir = out / f"run_{framework}_{w['name']}"
    if args.print_overrides:
        print("\n".join(overrides(args.model_dir, run_dir, "PROMPTS.jsonl", w, opts, False) + variant_ov + args.extra))
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.cpu_smoke:
        sys.path.insert(0, str(ROOT))
        from hybrid_rl.models import resolve_model_path

        model_dir = "builtin:tiny-qwen2"
        counter = chat_token_counter(resolve_model_path(model_dir))
    else:
        model_dir = str(prepare_model(w["model"], Path(args.model_dir)))
        counter = chat_token_counter(model_dir)
    if args.cpu_smoke:  # only prompts that fit the tiny model's positions
        w["max_prompt_length"] = SMOKE_PROMPT
    prompts = prepare_prompts(Path(args.data), out / f"prompts_{w['name']}.jsonl", w, counter)
    ov = overrides(model_dir, run_dir, str(prompts), w, opts, args.cpu_smoke)
    if args.cpu_smoke:
        ov += ["data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
               # the tiny model has 512 positions: prompt + response must fit them
               f"data.max_prompt_length={SMOKE_PROMPT}", "data.max_response_length=8", f"rollout.forced_lengths={'fixed:8' if w['n'] > 1 else 'lognormal:4:0.8'}",
               "actor.ppo_micro_batch_size_per_device=2", "actor.log_prob_micro_batch_size_per_device=2",
               "critic.ppo_micro_batch_size_per_device=2", "critic.forward_micro_batch_size_per_device=2",
               "actor.max_token_len_per_device=1024", "critic.max_token_len_per_device=1024"]
        if w["n"] > 1:
            ov += ["rollout.n=2"]
    ov += variant_ov + args.extra
    if overlap:  # one step more, left out below: the last step has nothing to generate beside it
        ov += [f"trainer.total_steps={w['steps'] + 1}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.gpus}",
           "-m", "hybrid_rl", "train", str(recipe(w)), *ov]
    log_path = run_dir / "stdout.log"
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [env.get("PYTHONPATH", ""), str(ROOT)] if p)
    probe_dir = out / f"probe_{framework}_{w['name']}"
    env = probe.env_for(env, probe.site(out / "probe_site"), probe_dir)
    wt = run_watched(cmd, ROOT, env, log_path,
                     lambda: sum(1 for l in metrics.read_text().splitlines() if '"timing/step"' in l) if metrics.exists() else 0,
                     w["steps"] + overlap, args.timeout, t0)
    rows = parse(metrics, "timing/iteration" if overlap else "timing/step") if metrics.exists() else []
    rows = rows[:w["steps"]]
    import torch

    version = f"{commit()} (torch {torch.__version__})"
    settings = settings_record(args.profile, opts, prompts_sha256=file_sha256(prompts),
                               recipe=str(recipe(w).relative_to(ROOT)), overrides=ov, variant=args.variant)
    if len(rows) <= w["warmup"]:
        doc = {"framework": framework, "version": version, "error": f"exit {wt.returncode}, {len(rows)} steps logged",
               "profile": args.profile, "settings": settings, "log_tail": tail(log_path)}
    else:
        first = rows[0]["step_s"]
        notes = [f"response lengths forced: rollout.forced_lengths={w['lengths']} (cap {w['response_length']}; "
                 f"EOS ignored, no stop ids)"]
        if variant_note:
            notes.append(f"variant {args.variant}: {variant_note}" + (
                "; step = the loop's cadence (timing/iteration), generation runs beside it" if overlap else ""))
        doc = summarize(framework, version, rows, args.gpus, w["warmup"],
                        startup_s=(wt.first_step_at - first) if wt.first_step_at else None,
                        wall_s=wt.done_at or time.perf_counter() - t0, settings=settings, notes=notes)
        doc.update(measured_memory(metrics, w["warmup"]))
        doc.update(measured_gc(metrics, w["warmup"]))
    doc.update(device=device_name(args.gpus) if not args.cpu_smoke else "CPU", commit=commit(),
               took_effect=probe.collect(probe_dir, w["max_prompt_length"] + w["response_length"],
                                         {"liger": opts["liger"]}))
    write_result(doc, result_path(out, framework, w), w)


if __name__ == "__main__":
    main()
