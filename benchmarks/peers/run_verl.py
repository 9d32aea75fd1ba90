"""verl (verl==0.9.1, its V1 trainer, vLLM 0.24.0 colocated in hybrid-engine mode) on the peer workload
(benchmarks/peers/workload.py).

Writes GSM8K as verl's parquet (prompt as chat messages, reward_model.ground_truth, data_source='openai/gsm8k', so
verl's own gsm8k scorer is the reward), runs ``python -m verl.trainer.main_ppo`` with Hydra overrides and the
``file`` logger (VERL_FILE_LOGGER_PATH), and parses verl's per-step metrics (timing_s/*, perf/*, response_length/*)
into the peers' JSON shape.

    python benchmarks/peers/run_verl.py --gpus 2 --model-dir /tmp/peers_model --out /tmp/peers_res
    python benchmarks/peers/run_verl.py --print-overrides       # the Hydra overrides, one a line
    python benchmarks/peers/run_verl.py --check-config           # compose the config (verl + hydra importable, no GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import (DATA, VERSIONS, WORKLOAD as W, commit, device_name, gsm8k_rows, prepare_model,  # noqa: E402
                      run_watched, summarize, tail, write_result)

VERL_VERSION = VERSIONS["verl"]
PHASES = ["gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "update_weights"]


def write_parquet(src: Path, out: Path) -> Path:
    """GSM8K jsonl → verl's RL parquet (the fields of verl's examples/data_preprocess/gsm8k.py)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if out.exists():
        return out
    rows = gsm8k_rows(src)
    table = pa.Table.from_pylist([{
        "data_source": "openai/gsm8k",
        "prompt": r["messages"],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": r["ground_truth"]},
        "extra_info": {"split": "train", "index": r["index"]},
    } for r in rows])
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out)
    return out


def overrides(model_dir: str, parquet: Path, gpus: int, steps: int) -> list[str]:
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    return [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False", "algorithm.norm_adv_by_std_in_grpo=True",
        f"data.train_files={parquet}", f"data.val_files={parquet}",
        f"data.train_batch_size={W['prompts_per_step']}", f"data.max_prompt_length={W['max_prompt_length']}",
        f"data.max_response_length={W['response_length']}", "data.filter_overlong_prompts=True",
        "data.truncation=error", "data.shuffle=True", f"data.seed={W['seed']}",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        # no flash-attn wheel on the GPU machines (torch 2.11+cu130, no network): verl's padding removal needs
        # flash_attention_2, so verl runs padded with SDPA (hybrid_rl's packing uses torch's own varlen kernel)
        "actor_rollout_ref.model.use_remove_padding=False", "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"{a}.optim.lr={W['lr']}", f"{a}.optim.weight_decay=0.0", f"{a}.optim.lr_scheduler_type=constant",
        f"{a}.optim.clip_grad={W['grad_clip']}", f"{a}.grad_clip={W['grad_clip']}",
        f"{a}.ppo_mini_batch_size={W['mini_batch_prompts']}",
        f"{a}.ppo_micro_batch_size_per_gpu={W['micro_batch_per_gpu']}", f"{a}.use_dynamic_bsz=False",
        f"{a}.ppo_epochs=1", f"{a}.clip_ratio_low={W['clip_low']}", f"{a}.clip_ratio_high={W['clip_high']}",
        f"{a}.loss_agg_mode=token-mean", f"{a}.entropy_coeff=0", f"{a}.use_kl_loss=False",
        f"{a}.fsdp_config.param_offload=False", f"{a}.fsdp_config.optimizer_offload=False",
        f"{r}.name=vllm", f"{r}.tensor_model_parallel_size=1", f"{r}.n={W['n']}",
        f"{r}.temperature={W['temperature']}", f"{r}.top_p=1.0", f"{r}.top_k=-1", f"{r}.ignore_eos=True",
        f"{r}.gpu_memory_utilization={W['gpu_memory_utilization']}", f"{r}.max_num_seqs={W['max_num_seqs']}",
        f"{r}.max_num_batched_tokens=8192", f"{r}.enforce_eager=False", f"{r}.free_cache_engine=True",
        f"{r}.enable_prefix_caching=True", f"{r}.dtype=bfloat16",
        f"{r}.log_prob_micro_batch_size_per_gpu={W['log_prob_micro_batch_per_gpu']}",
        f"trainer.n_gpus_per_node={gpus}", "trainer.nnodes=1", f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=1", "trainer.logger=[console,file]", "trainer.val_before_train=False",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.project_name=peers", "trainer.experiment_name=verl",
        "trainer.resume_mode=disable",
        "+ray_kwargs.ray_init.include_dashboard=False",
    ]


def parse(metrics: Path) -> list[dict]:
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
            "response_tokens": resp * W["prompts_per_step"] * W["n"] if resp is not None else None,
            "response_length_mean": resp,
            "prompt_length_mean": d.get("prompt_length/mean"),
            # verl 0.9.1 logs the training worker's torch peak as actor/perf/* (the vLLM server is another process)
            "max_memory_allocated_gb": d.get("perf/max_memory_allocated_gb",
                                             d.get("actor/perf/max_memory_allocated_gb")),
            "max_memory_reserved_gb": d.get("perf/max_memory_reserved_gb", d.get("actor/perf/max_memory_reserved_gb")),
            "verl_throughput_per_gpu": d.get("perf/throughput"),
        })
    return rows


def check_config(ov: list[str]) -> None:
    """Compose verl's ppo_trainer config with the overrides (Hydra), as main_ppo would, and validate what can be
    validated without GPUs."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    import verl.trainer.main_ppo as mp

    cfg_dir = str(Path(mp.__file__).parent / "config")
    with initialize_config_dir(config_dir=cfg_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=ov)
    OmegaConf.resolve(cfg)
    keys = ["actor_rollout_ref.rollout.ignore_eos", "actor_rollout_ref.actor.ppo_mini_batch_size",
            "actor_rollout_ref.rollout.n", "trainer.use_v1", "actor_rollout_ref.rollout.mode",
            "actor_rollout_ref.actor.fsdp_config.model_dtype", "actor_rollout_ref.actor.strategy"]
    for k in keys:
        print(k, "=", OmegaConf.select(cfg, k))
    try:
        from verl.trainer.ppo.utils import need_critic, need_reference_policy
        from verl.utils.config import validate_config

        validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
        print("validate_config: ok; reference policy:", need_reference_policy(cfg))
    except Exception as e:  # noqa: BLE001 - report whatever verl's own check says
        print("validate_config:", type(e).__name__, e)


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
    """A folder holding the sitecustomize.py above (Python's own start-up hook; verl's code is not touched)."""
    site = out / "verl_port_site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(PORT_SITE)
    return site


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--model-dir", default="/tmp/peers_model")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--steps", type=int, default=W["steps"])
    ap.add_argument("--warmup", type=int, default=W["warmup"])
    ap.add_argument("--out", default="/tmp/peers_res")
    ap.add_argument("--timeout", type=float, default=480)
    ap.add_argument("--print-overrides", action="store_true")
    ap.add_argument("--check-config", action="store_true")
    ap.add_argument("--start-retries", type=int, default=2,
                    help="start again this many times when vLLM's servers collide on a port before step 1")
    ap.add_argument("extra", nargs="*", help="more Hydra overrides")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parquet = out / "gsm8k_verl" / "train.parquet"
    if args.print_overrides or args.check_config:
        ov = overrides(args.model_dir, parquet, args.gpus, args.steps) + args.extra
        if args.check_config:
            check_config(ov)
        else:
            print("\n".join(ov))
        return
    t0 = time.perf_counter()
    model = str(prepare_model(W["model"], Path(args.model_dir)))
    write_parquet(Path(args.data), parquet)
    ov = overrides(model, parquet, args.gpus, args.steps) + args.extra
    metrics = out / "verl_metrics.jsonl"
    metrics.unlink(missing_ok=True)
    log_path = out / "verl_stdout.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", VERL_FILE_LOGGER_PATH=str(metrics), TOKENIZERS_PARALLELISM="false",
               RAY_DEDUP_LOGS="0", HYDRA_FULL_ERROR="1", RAY_USAGE_STATS_ENABLED="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(port_site(out)), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *ov]
    for attempt in range(1, args.start_retries + 2):
        w = run_watched(cmd, out, env, log_path,
                        lambda: sum(1 for l in metrics.read_text().splitlines() if "timing_s/step" in l)
                        if metrics.exists() else 0, args.steps, args.timeout, t0)
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True, timeout=60,
                       env=env, check=False)  # the ray cluster this run started
        # verl starts one vLLM server per GPU at once, and their distributed-init ports can collide (vLLM picks each
        # with its own open-port probe: verl-project/verl#6677; seen here on 4xH200, 2026-11-26). port_site() spreads
        # the ports apart; should it still happen, start again.
        if metrics.exists() or not port_race(log_path) or attempt > args.start_retries:
            break
        kept = log_path.with_name(f"verl_stdout_try{attempt}.log")
        log_path.replace(kept)
        print(f"verl: vLLM servers collided on a port (EADDRINUSE) before step 1; log kept in {kept}; starting again")
    rows = parse(metrics) if metrics.exists() else []
    try:
        import verl

        version = getattr(verl, "__version__", VERL_VERSION)
    except ImportError:
        version = VERL_VERSION
    if len(rows) <= args.warmup:
        doc = {"framework": "verl", "version": version, "error": f"exit {w.returncode}, {len(rows)} steps logged",
               "log_tail": tail(log_path, 6000)}
    else:
        doc = summarize("verl", version, rows, args.gpus, args.warmup,
                        startup_s=(w.first_step_at - rows[0]["step_s"]) if w.first_step_at else None,
                        wall_s=w.done_at or time.perf_counter() - t0, settings={"overrides": ov},
                        notes=["verl V1 trainer (trainer.use_v1=True, its default), rollout mode async (vLLM AsyncLLM "
                               "server per GPU, colocated hybrid engine)",
                               "lengths forced with actor_rollout_ref.rollout.ignore_eos=True, response_length 256",
                               "verl's own gsm8k scorer (data_source openai/gsm8k) is the reward",
                               "verl defaults kept: torch.compile of its log-prob helpers, balance_batch; "
                               "overridden: use_remove_padding=False with SDPA attention (its padding removal needs "
                               "flash-attn, which has no wheel for the GPU machines' torch)"])
    doc.update(device=device_name(args.gpus), commit=commit())
    write_result(doc, out / "verl.json")


if __name__ == "__main__":
    main()
