"""verl (verl==0.9.1, its V1 trainer, vLLM 0.24.0 colocated in hybrid-engine mode) on a peer workload
(benchmarks/peers/workload.py).

Writes the prepared GSM8K prompts as verl's parquet (prompt as chat messages, reward_model.ground_truth,
data_source='openai/gsm8k', so verl's own gsm8k scorer is the reward; ``extra_info.forced_lengths`` holds each row's
response lengths), runs ``python -m verl.trainer.main_ppo`` with Hydra overrides and the ``file`` logger
(VERL_FILE_LOGGER_PATH), and parses verl's per-step metrics (timing_s/*, perf/*, response_length/*) into the peers'
JSON shape. Workloads with per-sample lengths run a one-method agent loop (``verl_agent_loop.py``) that gives each
request its ``max_tokens``, registered through verl's ``rollout.agent.agent_loop_config_path``.

    python benchmarks/peers/run_verl.py --gpus 2 --workload grpo --model-dir /tmp/peers_model --out /tmp/peers_res
    python benchmarks/peers/run_verl.py --workload ppo --print-overrides     # the Hydra overrides, one a line
    python benchmarks/peers/run_verl.py --check-config    # compose + validate the config (verl importable, no GPU)
    python benchmarks/peers/run_verl.py --profile baseline --set dynamic_bsz=on ...

Options (``PROFILES``; ``--set NAME=VALUE`` changes one): see benchmarks/peers/README.md for what each maps to.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe  # noqa: E402
import verl_critic_attn  # noqa: E402
from workload import (VERSIONS, chat_token_counter, commit, common_args, device_name, file_sha256, forced,  # noqa: E402
                      gsm8k_rows, prepare_model, prepare_prompts, resolve_options, result_path, row_lengths,
                      run_watched, settings_record, skipped, summarize, tail, workload_spec, write_result)

VERL_VERSION = VERSIONS["verl"]
PHASES = ["gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights"]
AGENT_LOOP = "peers_forced_lengths"


def baseline(w: dict) -> dict:
    """The settings of the first comparison: verl padded with SDPA, micro-batches by sequence count, recomputation,
    FSDP1, none of verl's kernels (its V1 critic always cuts micro-batches by its token budget, default 32768)."""
    opts = {
        "strategy": "fsdp",
        "remove_padding": False,
        "attn_implementation": "sdpa",
        "pad_to_length": False,
        "pad_to_length_bucket": 1024,
        "dynamic_bsz": False,
        "micro_batch_per_gpu": 8,
        "log_prob_micro_batch_per_gpu": 16,
        "max_token_len_per_gpu": 16384,
        "log_prob_max_token_len_per_gpu": 32768,
        "fused_kernels": False,
        "fused_kernel_backend": "torch",
        "liger": False,
        "gradient_checkpointing": True,
        "reshard_after_forward": True,
        "no_sync_accumulation": False,
        "chunked_prefill": True,
    }
    if w["algorithm"] == "gae":  # the critic's option exists where there is a critic
        opts["critic_max_token_len_per_gpu"] = 32768
    return opts


def tuned(w: dict) -> dict:
    """verl's performance-tuning guide (docs/perf/perf_tuning.rst, best_practices.rst) within what runs without the
    flash-attn package: FSDP2; padding removal with transformers' flex attention (verl's packed rows carry per-sequence
    position ids and no mask; transformers' mask builder turns them into a block-diagonal BlockMask), packed rows
    rounded up to 1,024-token buckets (verl's pad_to_length, so flex attention compiles for few shapes); micro-batches
    by a 16k-token budget (old log-prob 32k: forward-only passes can take 2x, as the guide says); verl's fused LM-head
    kernel (torch backend) and Liger's layer kernels; no recomputation; parameters kept gathered between forward and
    backward and gradients reduced once per mini-batch (hybrid_rl's accumulate_unsharded); chunked prefill (vLLM)."""
    opts = {**baseline(w), "strategy": "fsdp2", "remove_padding": True, "attn_implementation": "flex_attention",
            "pad_to_length": True, "dynamic_bsz": True, "fused_kernels": True, "liger": True,
            "gradient_checkpointing": False, "reshard_after_forward": False, "no_sync_accumulation": True}
    if "critic_max_token_len_per_gpu" in opts:
        opts["critic_max_token_len_per_gpu"] = 16384
    return opts


PROFILES = {"tuned": tuned, "baseline": baseline}


def write_parquet(prompts: Path, out: Path, w: dict, gpus: int) -> Path:
    """The prepared prompt rows → verl's RL parquet (the fields of verl's examples/data_preprocess/gsm8k.py), each
    row's n response lengths in ``extra_info.forced_lengths``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = gsm8k_rows(prompts)
    lengths = row_lengths(w, gpus, len(rows))
    table = pa.Table.from_pylist([{
        "data_source": "openai/gsm8k",
        "prompt": r["messages"],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": r["ground_truth"]},
        "extra_info": {"split": "train", "index": r["index"], "forced_lengths": lengths[k]},
    } for k, r in enumerate(rows)])
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out)
    return out


def agent_loop_config(site: Path) -> Path:
    """verl's agent-loop registry file naming the forced-length loop (its module sits in ``site``, on PYTHONPATH)."""
    path = site / "peers_agent_loops.yaml"
    path.write_text(f"- name: {AGENT_LOOP}\n  _target_: peers_verl_agent_loop.ForcedLengthAgentLoop\n")
    return path


def overrides(model_dir: str, parquet: Path, gpus: int, w: dict, opts: dict, agent_config: Path | None = None) -> list[str]:
    a, r, m, c = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.model", "critic"
    gae = w["algorithm"] == "gae"
    ov = [
        f"algorithm.adv_estimator={'gae' if gae else 'grpo'}", "algorithm.use_kl_in_reward=False",
        f"data.train_files={parquet}", f"data.val_files={parquet}",
        f"data.train_batch_size={w['prompts_per_step']}", f"data.max_prompt_length={w['max_prompt_length']}",
        f"data.max_response_length={w['response_length']}", "data.filter_overlong_prompts=True",
        "data.truncation=error", "data.shuffle=False", f"data.seed={w['seed']}",
        f"{m}.path={model_dir}", f"{m}.enable_gradient_checkpointing={opts['gradient_checkpointing']}",
        f"{m}.use_remove_padding={opts['remove_padding']}",
        f"+{m}.override_config.attn_implementation={opts['attn_implementation']}",
        f"{m}.use_fused_kernels={opts['fused_kernels']}",
        f"{m}.fused_kernel_options.impl_backend={opts['fused_kernel_backend']}", f"{m}.use_liger={opts['liger']}",
        f"{a}.strategy={opts['strategy']}",
        f"{a}.optim.lr={w['lr']}", f"{a}.optim.weight_decay=0.0", f"{a}.optim.lr_scheduler_type=constant",
        f"{a}.optim.clip_grad={w['grad_clip']}", f"{a}.grad_clip={w['grad_clip']}",
        f"{a}.ppo_mini_batch_size={w['mini_batch_prompts']}", f"{a}.ppo_epochs=1",
        f"{a}.clip_ratio_low={w['clip_low']}", f"{a}.clip_ratio_high={w['clip_high']}",
        f"{a}.loss_agg_mode=token-mean", f"{a}.entropy_coeff=0", f"{a}.use_kl_loss=False",
        f"{a}.fsdp_config.param_offload=False", f"{a}.fsdp_config.optimizer_offload=False",
        f"{a}.fsdp_config.reshard_after_forward={opts['reshard_after_forward']}",
        f"{a}.fsdp_config.use_no_sync_for_gradient_accumulation={opts['no_sync_accumulation']}",
        f"{a}.use_dynamic_bsz={opts['dynamic_bsz']}", f"{r}.log_prob_use_dynamic_bsz={opts['dynamic_bsz']}",
    ]
    if opts["dynamic_bsz"]:
        ov += [f"{a}.ppo_max_token_len_per_gpu={opts['max_token_len_per_gpu']}",
               f"{r}.log_prob_max_token_len_per_gpu={opts['log_prob_max_token_len_per_gpu']}"]
    else:
        ov += [f"{a}.ppo_micro_batch_size_per_gpu={opts['micro_batch_per_gpu']}",
               f"{r}.log_prob_micro_batch_size_per_gpu={opts['log_prob_micro_batch_per_gpu']}"]
    if opts["remove_padding"]:
        ov += [f"{a}.pad_to_length={opts['pad_to_length']}",
               f"{a}.fsdp_config.pad_to_length_bucket={opts['pad_to_length_bucket']}"]
    ov += [
        f"{r}.name=vllm", f"{r}.tensor_model_parallel_size=1", f"{r}.n={w['n']}",
        f"{r}.temperature={w['temperature']}", f"{r}.top_p=1.0", f"{r}.top_k=-1", f"{r}.ignore_eos=True",
        f"{r}.gpu_memory_utilization={w['gpu_memory_utilization']}", f"{r}.max_num_seqs={w['max_num_seqs']}",
        f"{r}.max_num_batched_tokens={w['max_num_batched_tokens']}", f"{r}.enforce_eager=False",
        f"{r}.free_cache_engine=True", f"{r}.enable_prefix_caching=True",
        f"{r}.enable_chunked_prefill={opts['chunked_prefill']}", f"{r}.dtype=bfloat16",
    ]
    if forced(w):
        if agent_config is None:
            raise ValueError(f"workload {w['name']} forces per-sample lengths: pass the agent-loop config")
        ov += [f"{r}.agent.agent_loop_config_path={agent_config}", f"{r}.agent.default_agent_loop={AGENT_LOOP}"]
    if gae:
        ov += [
            f"algorithm.gamma={w['gamma']}", f"algorithm.lam={w['lam']}", "trainer.critic_warmup=0",
            f"{c}.strategy={opts['strategy']}", f"{c}.model.path={model_dir}",
            f"{c}.model.enable_gradient_checkpointing={opts['gradient_checkpointing']}",
            f"{c}.model.use_remove_padding={opts['remove_padding']}",
            f"+{c}.model.override_config.attn_implementation={opts['attn_implementation']}",
            f"{c}.model.use_liger={opts['liger']}",
            f"{c}.optim.lr={w['critic_lr']}", f"{c}.optim.weight_decay=0.0", f"{c}.optim.lr_scheduler_type=constant",
            f"{c}.optim.clip_grad={w['grad_clip']}", f"{c}.grad_clip={w['grad_clip']}",
            f"{c}.ppo_mini_batch_size={w['mini_batch_prompts']}", f"{c}.ppo_epochs=1",
            f"{c}.cliprange_value={w['cliprange_value']}", f"{c}.loss_agg_mode=token-mean",
            f"{c}.fsdp.param_offload=False", f"{c}.fsdp.optimizer_offload=False",
            f"{c}.fsdp.reshard_after_forward={opts['reshard_after_forward']}",
            f"{c}.fsdp.use_no_sync_for_gradient_accumulation={opts['no_sync_accumulation']}",
            f"{c}.use_dynamic_bsz={opts['dynamic_bsz']}",
            # the V1 trainer cuts the critic's micro-batches, in its update and its value pass, by this one budget
            f"+{c}.ppo_infer_max_token_len_per_gpu={opts['critic_max_token_len_per_gpu']}",
        ]
        if opts["dynamic_bsz"]:
            ov += [f"{c}.ppo_max_token_len_per_gpu={opts['critic_max_token_len_per_gpu']}",
                   f"{c}.forward_max_token_len_per_gpu={opts['critic_max_token_len_per_gpu']}"]
        else:
            ov += [f"{c}.ppo_micro_batch_size_per_gpu={opts['micro_batch_per_gpu']}",
                   f"{c}.forward_micro_batch_size_per_gpu={opts['log_prob_micro_batch_per_gpu']}"]
        if opts["remove_padding"]:
            ov += [f"{c}.fsdp.pad_to_length={opts['pad_to_length']}",
                   f"{c}.fsdp.pad_to_length_bucket={opts['pad_to_length_bucket']}"]
    else:
        ov += ["algorithm.norm_adv_by_std_in_grpo=True"]
    ov += [
        f"trainer.n_gpus_per_node={gpus}", "trainer.nnodes=1", f"trainer.total_training_steps={w['steps']}",
        "trainer.total_epochs=1", "trainer.balance_batch=True", "trainer.logger=[console,file]",
        "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.project_name=peers",
        f"trainer.experiment_name=verl_{w['name']}", "trainer.resume_mode=disable",
        "+ray_kwargs.ray_init.include_dashboard=False",
    ]
    return ov


def parse(metrics: Path, w: dict) -> list[dict]:
    rows = []
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        d = rec.get("data", rec)
        if "timing_s/step" not in d:
            continue
        resp = d.get("response_length/mean")
        rows.append({
            "step_s": d["timing_s/step"],
            "phases": {p: d[f"timing_s/{p}"] for p in PHASES if f"timing_s/{p}" in d},
            "total_tokens": d.get("perf/total_num_tokens"),
            "response_tokens": resp * w["prompts_per_step"] * w["n"] if resp is not None else None,
            "response_length_mean": resp,
            "prompt_length_mean": d.get("prompt_length/mean"),
            # verl 0.9.1 logs the training worker's torch peak as actor/perf/* (the vLLM server is another process)
            "max_memory_allocated_gb": d.get("perf/max_memory_allocated_gb",
                                             d.get("actor/perf/max_memory_allocated_gb")),
            "max_memory_reserved_gb": d.get("perf/max_memory_reserved_gb", d.get("actor/perf/max_memory_reserved_gb")),
            "verl_throughput_per_gpu": d.get("perf/throughput"),
        })
    return rows


def check_config(ov: list[str]) -> dict:
    """Compose verl's ppo_trainer config with the overrides (Hydra), as main_ppo would, and run verl's own
    validation (validate_config builds the actor's and the critic's config dataclasses) plus the rollout's dataclass;
    returns the keys a reader checks, resolved."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    import verl.trainer.main_ppo as mp
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    cfg_dir = str(Path(mp.__file__).parent / "config")
    with initialize_config_dir(config_dir=cfg_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=ov)
    OmegaConf.resolve(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    keys = ["trainer.use_v1", "actor_rollout_ref.actor.strategy", "actor_rollout_ref.actor.fsdp_config.strategy",
            "actor_rollout_ref.model.use_remove_padding", "actor_rollout_ref.actor.use_remove_padding",
            "actor_rollout_ref.model.override_config.attn_implementation",
            "actor_rollout_ref.actor.fsdp_config.pad_to_length", "actor_rollout_ref.actor.use_dynamic_bsz",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "actor_rollout_ref.actor.use_fused_kernels",
            "actor_rollout_ref.model.use_liger", "actor_rollout_ref.model.enable_gradient_checkpointing",
            "actor_rollout_ref.actor.fsdp_config.reshard_after_forward",
            "actor_rollout_ref.actor.fsdp_config.use_no_sync_for_gradient_accumulation",
            "actor_rollout_ref.rollout.enable_chunked_prefill", "actor_rollout_ref.rollout.agent.default_agent_loop",
            "critic.strategy", "critic.ppo_infer_max_token_len_per_gpu", "critic.model.use_remove_padding",
            "critic.model.enable_gradient_checkpointing", "critic.model.use_liger", "algorithm.adv_estimator"]
    out = {k: OmegaConf.select(cfg, k) for k in keys}
    out.update(use_critic=need_critic(cfg), use_reference_policy=need_reference_policy(cfg),
               rollout_agent=rollout.agent.default_agent_loop)
    return out


def flash_attn_importable(env: dict) -> bool:
    """Whether ``flash_attn`` imports under the verl run's environment (its PYTHONPATH)."""
    try:
        return subprocess.run([sys.executable, "-c", "import flash_attn"], env=env, capture_output=True,
                              timeout=300, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


# verl 0.9.1 loads the critic with attn_implementation="flash_attention_2" written into the call
# (verl/utils/model.py load_valuehead_model, from workers/engine/fsdp/transformer_impl.py); no override_config reaches
# it. Without the flash-attn package the critic loads with the actor's implementation instead (verl_critic_attn.py);
# only a run that asks for flash attention itself cannot go on.
NO_FLASH_ATTN = ("attn_implementation=flash_attention_2 was asked for and flash_attn is not importable here "
                 "(no wheel for this torch): run with --set attn_implementation=flex_attention or sdpa")
CRITIC_ATTN_NOTE = ("verl 0.9.1 hard-codes attn_implementation='flash_attention_2' for its critic "
                    "(verl/utils/model.py load_valuehead_model) and flash_attn is not importable here: the critic "
                    "loaded with the actor's {attn} instead (benchmarks/peers/verl_critic_attn.py)")


def port_race(log_path: Path) -> bool:
    """Whether a run that logged no step died of the vLLM servers' distributed-init port collision."""
    text = tail(log_path, 400_000)
    return "EADDRINUSE" in text and "Engine core initialization failed" in text


PORT_SITE = """\
# Written by hybrid_rl's peer harness (benchmarks/peers/run_verl.py), first on PYTHONPATH of the verl run only.
# verl starts one vLLM server per GPU at once; each engine core picks its distributed-init port with vLLM's open-port
# probe, which releases the port before binding it, so two can pick the same one (verl-project/verl#6677). vLLM scans
# upward from VLLM_PORT when it is set: give every process its own base, 16 ports apart, chosen by its own pid. A base
# inherited from a parent is replaced (inherited, every engine core would scan from the same port and collide for
# certain: seen on 4xH200, 2026-11-27); a VLLM_PORT the user set is kept.
import os
if os.environ.get("VLLM_PORT", "") in ("", os.environ.get("HYBRID_RL_PEERS_VLLM_PORT")):
    os.environ["VLLM_PORT"] = os.environ["HYBRID_RL_PEERS_VLLM_PORT"] = str(20000 + (os.getpid() % 2000) * 16)
"""


def port_site(out: Path) -> Path:
    """A folder on the verl run's PYTHONPATH: the sitecustomize.py above (Python's own start-up hook; verl's code is
    not touched), the forced-length agent loop module and the critic's attention choice, importable in verl's Ray
    workers."""
    here = Path(__file__).resolve().parent
    site = probe.site(out / "verl_port_site", prelude=PORT_SITE + verl_critic_attn.SITE_HOOK)  # + the probe
    shutil.copyfile(here / "verl_agent_loop.py", site / "peers_verl_agent_loop.py")
    shutil.copyfile(here / "verl_critic_attn.py", site / "peers_verl_critic_attn.py")
    return site


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, default_timeout=480)
    ap.add_argument("--print-overrides", action="store_true")
    ap.add_argument("--check-config", action="store_true")
    ap.add_argument("--start-retries", type=int, default=2,
                    help="start again this many times when vLLM's servers collide on a port before step 1")
    ap.add_argument("extra", nargs="*", help="more Hydra overrides")
    args = ap.parse_args()
    w = workload_spec(args.workload, args.gpus)
    w.update(steps=args.steps or w["steps"], warmup=w["warmup"] if args.warmup is None else args.warmup)
    opts = resolve_options(PROFILES, args.profile, w, args.set)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parquet = out / f"verl_{w['name']}" / "train.parquet"
    site = port_site(out)
    agent = agent_loop_config(site)
    if args.print_overrides or args.check_config:
        ov = overrides(args.model_dir, parquet, args.gpus, w, opts, agent) + args.extra
        print(json.dumps(check_config(ov), indent=1, default=str) if args.check_config else "\n".join(ov))
        return
    if "verl" not in w["frameworks"]:
        write_result(skipped("verl", w, "not part of this workload"), result_path(out, "verl", w), w)
        return
    t0 = time.perf_counter()
    metrics = out / f"verl_{w['name']}_metrics.jsonl"
    env = dict(os.environ, PYTHONUNBUFFERED="1", VERL_FILE_LOGGER_PATH=str(metrics), TOKENIZERS_PARALLELISM="false",
               RAY_DEDUP_LOGS="0", HYDRA_FULL_ERROR="1", RAY_USAGE_STATS_ENABLED="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH", "")]))
    probe_dir = out / f"probe_verl_{w['name']}"
    env = probe.env_for(env, site, probe_dir)  # the site is first on PYTHONPATH already: env_for keeps that
    flash_attn = flash_attn_importable(env)
    critic_attn = None  # verl's own choice (flash_attention_2), or the actor's where flash_attn is missing
    if w["algorithm"] == "gae" and not flash_attn:
        critic_attn = env[verl_critic_attn.ENV] = opts["attn_implementation"]
    if opts["attn_implementation"] == "flash_attention_2" and not flash_attn:
        doc = {**skipped("verl", w, NO_FLASH_ATTN), "version": VERL_VERSION, "profile": args.profile,
               "settings": settings_record(args.profile, opts, flash_attn_importable=flash_attn)}
        doc.update(device=device_name(args.gpus), commit=commit())
        print(f"verl: {w['name']} not run: {NO_FLASH_ATTN}", file=sys.stderr)
        write_result(doc, result_path(out, "verl", w), w)
        return
    model = str(prepare_model(w["model"], Path(args.model_dir)))
    prompts = prepare_prompts(Path(args.data), out / f"prompts_{w['name']}.jsonl", w, chat_token_counter(model))
    write_parquet(prompts, parquet, w, args.gpus)
    ov = overrides(model, parquet, args.gpus, w, opts, agent) + args.extra
    metrics.unlink(missing_ok=True)
    log_path = out / f"verl_{w['name']}_stdout.log"
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *ov]
    for attempt in range(1, args.start_retries + 2):
        wt = run_watched(cmd, out, env, log_path,
                         lambda: sum(1 for l in metrics.read_text().splitlines() if "timing_s/step" in l)
                         if metrics.exists() else 0, w["steps"], args.timeout, t0)
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True, timeout=60,
                       env=env, check=False)  # the ray cluster this run started
        # verl starts one vLLM server per GPU at once, and their distributed-init ports can collide (vLLM picks each
        # with its own open-port probe: verl-project/verl#6677; seen here on 4xH200, 2026-11-26). port_site() spreads
        # the ports apart; should it still happen, start again.
        if metrics.exists() or not port_race(log_path) or attempt > args.start_retries:
            break
        kept = log_path.with_name(f"{log_path.stem}_try{attempt}.log")
        log_path.replace(kept)
        print(f"verl: vLLM servers collided on a port (EADDRINUSE) before step 1; log kept in {kept}; starting again")
    rows = parse(metrics, w) if metrics.exists() else []
    settings = settings_record(args.profile, opts, prompts_sha256=file_sha256(prompts), flash_attn_importable=flash_attn,
                               overrides=ov)
    if w["algorithm"] == "gae":
        settings["critic_attn_implementation"] = critic_attn or "flash_attention_2"
    try:
        import verl

        version = getattr(verl, "__version__", VERL_VERSION)
    except ImportError:
        version = VERL_VERSION
    if len(rows) <= w["warmup"]:
        doc = {"framework": "verl", "version": version, "error": f"exit {wt.returncode}, {len(rows)} steps logged",
               "profile": args.profile, "settings": settings,
               "log_tail": tail(log_path, 6000)}
    else:
        doc = summarize("verl", version, rows, args.gpus, w["warmup"],
                        startup_s=(wt.first_step_at - rows[0]["step_s"]) if wt.first_step_at else None,
                        wall_s=wt.done_at or time.perf_counter() - t0,
                        settings=settings,
                        notes=["verl V1 trainer (trainer.use_v1=True, its default), rollout mode async (vLLM AsyncLLM "
                               "server per GPU, colocated hybrid engine)",
                               f"lengths {w['lengths']} (cap {w['response_length']}), EOS ignored "
                               "(rollout.ignore_eos=True)" + ("; per-sample max_tokens from the peers' agent loop"
                                                              if forced(w) else ""),
                               "verl's own gsm8k scorer (data_source openai/gsm8k) is the reward",
                               "verl defaults kept: torch.compile of its log-prob helpers, balance_batch"]
                        + ([CRITIC_ATTN_NOTE.format(attn=critic_attn)] if critic_attn else []))
    doc.update(device=device_name(args.gpus), commit=commit(),
               took_effect=probe.collect(probe_dir, w["max_prompt_length"] + w["response_length"],
                                         {k: opts.get(k) for k in ("liger", "attn_implementation", "remove_padding")}))
    write_result(doc, result_path(out, "verl", w), w)


if __name__ == "__main__":
    main()
