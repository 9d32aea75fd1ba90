"""The trainer's two passes alone: old log-probs and the PPO update, on a synthetic scored batch, per FSDP2 setting.

Isolates what `benchmarks/modes.py` profiled as the largest phases (no engine, no reward): for the same batch,
times `compute_log_prob` and `update_actor` under each configuration and reports trained tokens/s.

    torchrun --standalone --nproc_per_node=1 benchmarks/update_step.py --model builtin:qwen2.5-0.5b-random
    torchrun --standalone --nproc_per_node=2 benchmarks/update_step.py --cpu-smoke      # tiny model, plumbing only

The batch follows the modes benchmark: ``--prompts`` prompts × ``--n`` samples across all ranks, prompt lengths
uniform in [250, 450], response lengths lognormal (mean ``--resp-mean``, capped at ``--resp-cap``), random
token ids, random advantages. Writes ``results/update_step_<device>_<model>.json`` and a bar plot beside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import git_commit, gpu_short_name, run_dir  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.data import collate_prompts  # noqa: E402
from hybrid_rl.distributed import init_distributed  # noqa: E402
from hybrid_rl.telemetry.perf import UPDATE_FORWARDS, ModelFlops, peak_flops  # noqa: E402
from hybrid_rl.rollout.base import assemble_rollout  # noqa: E402
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402

# the training passes' levers, each row explicit about every one of them (the recipe gsm8k_grpo now ships several switched on):
# the passes as they were before the levers, then each lever added
BEFORE = ["model.enable_gradient_checkpointing=true", "actor.use_dynamic_bsz=false", "actor.accumulate_unsharded=false",
          "actor.share_prompts=false", "model.use_liger=false", "actor.use_remove_padding=true", "actor.fused_logprob=true"]
NO_CKPT_BUDGET_UNSHARDED = ["model.enable_gradient_checkpointing=false", "actor.use_dynamic_bsz=true",
                            "actor.max_token_len_per_device=16384", "actor.accumulate_unsharded=true"]


def _levers(*extra: str) -> list[str]:
    return BEFORE + list(extra)


CONFIGS = {
    "default": ["actor.accumulate_unsharded=false"],  # explicit: benchmarks/bench_modes.yaml turns it on
    "accumulate_unsharded": ["actor.accumulate_unsharded=true"],
    "accumulate_unsharded+compile": ["actor.accumulate_unsharded=true", "actor.use_torch_compile=true"],
    "accumulate_unsharded+dynamic_bsz": ["actor.accumulate_unsharded=true", "actor.use_dynamic_bsz=true",
                                         "actor.max_token_len_per_device=24576"],
    "accumulate_unsharded+dynamic_bsz+compile": ["actor.accumulate_unsharded=true", "actor.use_dynamic_bsz=true",
                                                 "actor.max_token_len_per_device=24576", "actor.use_torch_compile=true"],
    "padded": _levers("actor.use_remove_padding=false", "actor.fused_logprob=false"),
    "packed": _levers("actor.fused_logprob=false"),
    "packed+fused": _levers(),
    "packed+fused+no_ckpt": _levers("model.enable_gradient_checkpointing=false"),
    "packed+fused+no_ckpt+budget16k": _levers("model.enable_gradient_checkpointing=false", "actor.use_dynamic_bsz=true",
                                              "actor.max_token_len_per_device=16384"),
    "packed+fused+budget32k": _levers("actor.use_dynamic_bsz=true", "actor.max_token_len_per_device=32768"),
    "packed+fused+no_ckpt+budget16k+unsharded": _levers(*NO_CKPT_BUDGET_UNSHARDED),
    # each prompt once per micro-batch, its n responses attending to it (actor.share_prompts)
    "packed+fused+shared": _levers("actor.share_prompts=true"),
    # the levers gsm8k_grpo ships (share_prompts is on by default on CUDA)
    "packed+fused+no_ckpt+budget16k+unsharded+shared": _levers(*NO_CKPT_BUDGET_UNSHARDED, "actor.share_prompts=true"),
    "packed+fused+no_ckpt+budget32k+unsharded+shared": _levers(*NO_CKPT_BUDGET_UNSHARDED, "actor.share_prompts=true",
                                                               "actor.max_token_len_per_device=32768"),
    # Liger's fused RMSNorm / SwiGLU / rotary kernels (model.use_liger; needs liger-kernel on the GPU machine); they
    # patch transformers for the whole process, so these run last (see main)
    "packed+fused+liger": _levers("model.use_liger=true"),
    "packed+fused+no_ckpt+budget16k+unsharded+liger": _levers(*NO_CKPT_BUDGET_UNSHARDED, "model.use_liger=true"),
    "packed+fused+no_ckpt+budget16k+unsharded+shared+liger": _levers(*NO_CKPT_BUDGET_UNSHARDED,
                                                                     "actor.share_prompts=true", "model.use_liger=true"),
}


def make_batch(worker: ActorRolloutRefWorker, prompts: int, n: int, resp_mean: float, resp_cap: int, seed: int):
    """This rank's share of a scored rollout batch (random ids, the modes benchmark's length distribution)."""
    d = worker.dist
    rng = np.random.default_rng(seed + d.rank)
    vocab = len(worker.tokenizer)
    per_rank = prompts // d.world_size
    items = [dict(input_ids=rng.integers(3, vocab, int(rng.integers(250, 451))).tolist(), ground_truth="0",
                  data_source="bench", index=i) for i in range(per_rank)]
    batch_prompts = collate_prompts(items, worker.tokenizer.pad_token_id)
    sigma = 0.8
    mu = np.log(resp_mean) - sigma ** 2 / 2
    lengths = np.clip(rng.lognormal(mu, sigma, per_rank * n).round().astype(int), 1, resp_cap)
    responses = torch.from_numpy(rng.integers(3, vocab, (per_rank * n, int(lengths.max())))).long()
    batch = assemble_rollout(batch_prompts, responses, torch.zeros(responses.shape), n, [], worker.tokenizer.pad_token_id,
                             response_lengths=tuple(int(x) for x in lengths))
    batch = batch.to(worker.device)
    mask = batch["response_mask"].float()
    adv = torch.from_numpy(rng.standard_normal((len(batch), 1))).float().to(worker.device).expand_as(mask) * mask
    return batch.union(tensors=dict(advantages=adv.contiguous(), weight_version=torch.zeros(len(batch), dtype=torch.long,
                                                                                           device=worker.device)),
                       temperature=1.0, weight_version=0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _liger(name: str) -> bool:
    return "model.use_liger=true" in CONFIGS[name]


def liger_last(names: list[str]) -> list[str]:
    """``names`` with the Liger configurations moved to the end, each group in its given order."""
    return [n for n in names if not _liger(n)] + [n for n in names if _liger(n)]


def recipe_path(recipe: str) -> Path:
    """``--recipe``: a YAML file, or the name of one in recipes/ (the user recipes) or benchmarks/ (bench_modes)."""
    if recipe.endswith((".yaml", ".yml")):
        return Path(recipe)
    for folder in ("recipes", "benchmarks"):
        if (ROOT / folder / f"{recipe}.yaml").is_file():
            return ROOT / folder / f"{recipe}.yaml"
    raise SystemExit(f"--recipe {recipe!r}: no recipes/{recipe}.yaml nor benchmarks/{recipe}.yaml; pass a name or a file")


def run_config(name: str, overrides: list[str], args, d) -> dict:
    cfg = load_config(str(recipe_path(args.recipe)), [
        f"model.path={args.model}", f"trainer.device={args.device}", "actor.use_kl_loss=false", "trainer.logger=[jsonl]",
        f"data.train_batch_size={args.prompts}", f"rollout.n={args.n}", f"actor.ppo_mini_batch_size={args.mini}",
        *args.overrides, *overrides]).validate(d.world_size)
    worker = ActorRolloutRefWorker(cfg, d, role="actor")
    batch = make_batch(worker, args.prompts, args.n, args.resp_mean, args.resp_cap, seed=0)
    if args.host_batch:  # as split placement hands it to the trainer ranks
        batch = batch.to("cpu")
    tokens = int(batch["attention_mask"].sum()) * d.world_size  # ranks hold equal shares of the same distribution
    # model FLOPs of one forward over this rank's share (hybrid_rl.telemetry.perf): MFU = passes × FLOPs / (time × peak)
    fwd_flops = ModelFlops.of(worker.actor.model).forward(batch["attention_mask"].sum(1), float(batch["response_mask"].sum()))
    peak = peak_flops(worker.device)
    runs = []
    if worker.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(worker.device)
    for _ in range(args.repeats + 1):  # the first is warm-up (allocator, kernels)
        _sync(worker.device)
        t0 = time.perf_counter()
        scored = worker.compute_log_prob(batch)
        _sync(worker.device)
        t1 = time.perf_counter()
        worker.update_actor(scored)
        _sync(worker.device)
        t2 = time.perf_counter()
        runs.append({"log_prob_s": t1 - t0, "update_s": t2 - t1})
    measured = runs[1:]
    lp = statistics.median(r["log_prob_s"] for r in measured)
    up = statistics.median(r["update_s"] for r in measured)
    mem = torch.cuda.max_memory_allocated(worker.device) / 2**30 if worker.device.type == "cuda" else 0.0
    mfu = {"mfu_log_prob": fwd_flops / (lp * peak), "mfu_update": UPDATE_FORWARDS * cfg.actor.ppo_epochs * fwd_flops / (up * peak)} \
        if peak else {}
    del worker, batch, scored
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"config": name, "overrides": overrides, "log_prob_s": lp, "update_s": up, "tokens": tokens,
            "trained_tokens_per_s": tokens / (lp + up), "peak_memory_allocated_gb": mem, **mfu, "runs": runs}


def plot(doc: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    rows = [r for r in doc["configs"] if "error" not in r]
    width = max((len(r["config"]) for r in rows), default=10)
    fig, ax = plt.subplots(figsize=(6 + 0.09 * width, 1.2 + 0.4 * len(rows)))
    names = [r["config"] for r in rows]
    ax.barh(names, [r["log_prob_s"] for r in rows], label="old log-prob")
    ax.barh(names, [r["update_s"] for r in rows], left=[r["log_prob_s"] for r in rows], label="update")
    for i, r in enumerate(rows):
        mfu = f", MFU {r['mfu_update']:.0%}" if "mfu_update" in r else ""
        ax.text(r["log_prob_s"] + r["update_s"], i, f" {r['trained_tokens_per_s'] / 1e3:.1f}k tok/s{mfu}", va="center",
                fontsize=8)
    ax.set_xlim(0, 1.45 * max(r["log_prob_s"] + r["update_s"] for r in rows))
    ax.set_xlabel("seconds per batch")
    ax.set_title(f"{doc['model']} on {doc['device']}: {doc['sequences']} sequences, {doc['tokens'] / 1e3:.0f}k tokens")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def best_overrides(path: str) -> list[str]:
    """The overrides of the fastest configuration in an update_step JSON (for a follow-up modes run)."""
    doc = json.loads(Path(path).read_text())
    return max(doc["configs"], key=lambda r: r["trained_tokens_per_s"])["overrides"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:qwen2.5-0.5b-random")
    ap.add_argument("--recipe", default="bench_modes", help="a recipe file, or a name in recipes/ or benchmarks/, "
                    "under the benchmark's overrides "
                    "(gsm8k_grpo: the flagship's micro-batches and activation checkpointing)")
    ap.add_argument("--prompts", type=int, default=32, help="prompts across all ranks")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--mini", type=int, default=16, help="actor.ppo_mini_batch_size (prompts per optimizer step)")
    ap.add_argument("--resp-mean", type=float, default=200.0)
    ap.add_argument("--resp-cap", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--configs", default=",".join(list(CONFIGS)[:5]), help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None, help="run directory (default runs/update_step/<UTC time>/; "
                    "benchmarks/publish.py copies a result to benchmarks/results/)")
    ap.add_argument("--host-batch", action="store_true",
                    help="start the passes from a batch in host memory, as the trainer ranks of split placement do")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: checks the plumbing only")
    ap.add_argument("--best-of", metavar="JSON", help="print the fastest configuration's overrides in JSON and exit")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every configuration")
    args = ap.parse_args()
    if args.best_of:
        print(" ".join(best_overrides(args.best_of)))
        return
    if args.cpu_smoke:
        args.model, args.prompts, args.n, args.mini, args.resp_mean, args.resp_cap, args.device = (
            "builtin:tiny-qwen2", 4, 2, 2, 12.0, 32, "cpu")
        args.overrides += ["rollout.name=hf", "actor.ppo_micro_batch_size_per_device=2",
                           "actor.log_prob_micro_batch_size_per_device=2",
                           "actor.max_token_len_per_device=1024"]
    for name in args.configs.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"--configs: unknown configuration {name!r}; pick from {', '.join(CONFIGS)}")
    d = init_distributed(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    device = (f"{gpu_short_name(torch.cuda.get_device_name(d.device))}x{d.world_size}" if d.device.type == "cuda"
              else f"cpux{d.world_size}")
    # Liger patches transformers' modeling module (rotary function, RMSNorm and MLP classes) for the whole process,
    # so every model built after a Liger configuration has its kernels: those configurations run last, and a plain
    # one after them is refused (at 1e7776c the rows after the first Liger row all ran with Liger)
    names = liger_last(args.configs.split(","))
    rows, patched = [], False
    for name in names:
        if patched and not _liger(name):
            rows.append({"config": name, "overrides": CONFIGS[name],
                         "error": "a Liger configuration ran earlier in this process: run it in its own process"})
            continue
        patched = patched or _liger(name)
        try:
            rows.append(run_config(name, CONFIGS[name], args, d))
        except torch.OutOfMemoryError as e:  # a configuration that does not fit is a result too; the next one runs
            rows.append({"config": name, "overrides": CONFIGS[name], "error": f"out of memory: {str(e)[:160]}"})
            gc.collect()
            torch.cuda.empty_cache()
        if d.rank == 0:
            print(json.dumps({"device": device, **{k: v for k, v in rows[-1].items() if k != "runs"}}), flush=True)
    if d.rank == 0:
        ok = [r for r in rows if "error" not in r]
        for r in ok:
            r["speedup_vs_first"] = r["trained_tokens_per_s"] / ok[0]["trained_tokens_per_s"]
        doc = {"bench": "update_step", "device": device, "world_size": d.world_size, "model": args.model,
               "sequences": args.prompts * args.n, "tokens": ok[0]["tokens"] if ok else 0, "resp_mean": args.resp_mean,
               "resp_cap": args.resp_cap, "mini_batch_prompts": args.mini, "overrides": args.overrides,
               "recipe": args.recipe,
               "host_batch": args.host_batch,
               "torch": torch.__version__, "commit": git_commit(ROOT), "configs": rows}
        out = run_dir("update_step", args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"update_step_{device}_{args.model.split(':')[-1].split('/')[-1]}{'_host' if args.host_batch else ''}"
        Path(f"{stem}.json").write_text(json.dumps(doc, indent=2))
        plot(doc, Path(f"{stem}.png"))
        print(f"wrote {stem}.json and .png", file=sys.stderr)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
