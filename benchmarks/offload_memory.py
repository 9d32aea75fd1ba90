"""Offload memory benchmark: the GPU memory training holds while the engine generates, offload off vs on.

    torchrun --standalone --nproc_per_node=1 benchmarks/offload_memory.py     # 0.5B random-init, HF engine
    torchrun --standalone --nproc_per_node=2 benchmarks/offload_memory.py     # FSDP2 over 2 GPUs
    python benchmarks/offload_memory.py --cpu-smoke                            # tiny model on CPU: plumbing only

For each mode, ``on`` (``actor.param_offload=true``, ``actor.optimizer_offload=true``) then ``off``
(both false), every rank builds the real ``ActorRolloutRefWorker`` from ``benchmarks/bench_modes.yaml`` (plus
overrides: ``builtin:qwen2.5-0.5b-random``, the HF engine, short fixed-length responses, one mini-batch per
update), generates once and runs one PPO update so that AdamW state exists (its step frees the gradients), then enters
``worker.rollout_mode()`` (the sharding manager: it pushes the weights, then offloads when asked) and
measures there, before generating again beside what training left on the device:

* ``training_side_bytes``, the issue's number: ``torch.cuda.memory_allocated()`` inside rollout mode,
  minus the engine's own bytes, minus what was allocated before the worker was built. The engine's bytes
  are summed directly over the unique storages of the HF engine's parameters and buffers (its KV cache
  lives only inside ``generate``, and nothing is generating at that moment). The remainder is everything
  the trainer's side keeps on the GPU: parameter shards, gradients, AdamW state, and anything FSDP2 or
  autograd left behind, counted whether we expect it there or not.
* ``actor_state_bytes``: the unique storages of the actor's parameters, gradients and optimizer-state
  tensors that sit on the training device, summed directly: what the first number is made of.

Both are per rank: the figures report the largest rank and list every rank. ``ratio`` = on / off of
``training_side_bytes``, ``meets_target`` = ratio <= 0.10. Between the modes the worker is deleted (checked:
``worker_freed``) and the CUDA cache emptied; each mode's ``allocated_before_build`` shows where it started
from. ``on`` runs first, so what the process allocates once and keeps (cuBLAS workspaces) counts against the
offloaded mode: the ratio errs high, not low.

Printed as one JSON line and written to ``offload_memory_<device>_<model>.json`` (device as ``benchmarks/modes.py``
names it, e.g. ``H200x2``; ``CPU`` for the smoke run) in its run directory (``runs/offload_memory/<UTC time>/`` unless
``--out``; ``benchmarks/publish.py`` copies it to ``benchmarks/results/``).

On CPU (``--cpu-smoke``: tiny model, a gloo world of one, or more ranks under torchrun) there is no GPU
memory to read and the offload target is the training device itself, so offload copies the state but
moves nothing off the device: the smoke run checks the plumbing (worker, update, rollout mode, the offload
flags, a generation inside it, the JSON) and reports ``actor_state_bytes`` for both modes, with
``ratio`` and ``meets_target`` left null.

Left out: the reference policy (built only with a KL term; ``ref.offload`` is its own switch), the vLLM
engine (its memory is its own, released by sleep), and host memory taken by the offloaded state.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as tdist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import git_commit, run_dir  # noqa: E402

from modes import device_name  # noqa: E402

from hybrid_rl.phases.advantage import compute_advantage  # noqa: E402
from hybrid_rl.phases.reward import sparse_scores  # noqa: E402
from hybrid_rl.batch import Batch  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.workers.offload import local  # noqa: E402

TARGET = 0.10  # with offload on, training holds <= 10% of what it holds without
# "on" runs first: buffers the process creates on first use and keeps (cuBLAS workspaces, ~66 MiB on an
# H200) are then charged to the offloaded mode instead of being subtracted from it as its starting point.
MODES = {"on": ["actor.param_offload=true", "actor.optimizer_offload=true"],
         "off": ["actor.param_offload=false", "actor.optimizer_offload=false"]}
GiB = 2**30


# --------------------------------------------------------------------------- measuring
def storage_bytes(tensors: Iterable[torch.Tensor | None], device: torch.device) -> int:
    """Bytes of the unique storages behind ``tensors`` that live on ``device`` (views and ties counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = local(t)  # FSDP2 parameters, gradients and AdamW state are DTensors
        if t.device != device or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def actor_tensors(actor) -> Iterable[torch.Tensor | None]:
    """The actor's parameters, their gradients and every optimizer-state tensor."""
    for p in actor.model.parameters():
        yield p
        yield p.grad
    if actor.optimizer is not None:
        for state in actor.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def engine_tensors(engine) -> Iterable[torch.Tensor]:
    """The HF engine's own weights and buffers (the only engine this benchmark builds)."""
    from hybrid_rl.rollout.hf import HFRolloutEngine

    if not isinstance(engine, HFRolloutEngine):
        raise TypeError(f"offload_memory measures the hf engine's tensors; got {type(engine).__name__} "
                        "(use rollout.name=hf)")
    yield from engine.model.parameters()
    yield from engine.model.buffers()


def cuda_allocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- one mode
def make_overrides(args, world: int, mode: str) -> list[str]:
    """The recipe's overrides for ``mode``: the HF engine, fixed-length responses, one mini-batch per update."""
    b = args.prompts
    return [f"model.path={args.model}", "rollout.name=hf", f"trainer.device={args.device}", "rollout.n=2",
            f"data.train_batch_size={b * world}", f"actor.ppo_mini_batch_size={b * world}",
            f"actor.ppo_micro_batch_size_per_device={2 * b}", f"actor.log_prob_micro_batch_size_per_device={2 * b}",
            f"data.max_prompt_length={args.prompt_length}", f"data.max_response_length={args.response_length}",
            f"rollout.forced_lengths=fixed:{args.response_length}", "trainer.logger=[jsonl]",
            *args.overrides, *MODES[mode]]


def random_prompts(worker, num: int, length: int, seed: int) -> Batch:
    """Token-id prompts drawn from the tokenizer's vocabulary (past its 3 special tokens), no padding."""
    g = torch.Generator().manual_seed(seed)
    vocab = min(len(worker.tokenizer), worker.actor.model.config.vocab_size)
    ids = torch.randint(3, vocab, (num, length), generator=g)
    return Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def one_update(worker, prompts: Batch, seed: int) -> None:
    """Rollout → scores → old log-probs → GRPO advantages → one PPO update: gradients and AdamW state now exist."""
    with worker.rollout_mode():
        batch = worker.generate(prompts)
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 2, (len(batch),), generator=g).float().to(batch["response_mask"].device)
    batch = batch.union(tensors=dict(token_level_scores=sparse_scores(scores, batch["response_mask"]), scores=scores))
    batch = worker.compute_log_prob(batch)
    batch, _ = compute_advantage(batch, worker.cfg.algorithm)
    worker.update_actor(batch)


def measure_mode(args, dist, mode: str) -> dict[str, Any]:
    """Build the worker with ``mode``'s offload switches, update once, measure inside ``rollout_mode()``."""
    from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker

    device = dist.device
    cfg = load_config(args.recipe, make_overrides(args, dist.world_size, mode)).validate(dist.world_size)
    release(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before_build = cuda_allocated(device)
    worker = ActorRolloutRefWorker(cfg, dist, total_training_steps=1)
    prompts = random_prompts(worker, args.prompts, args.prompt_length, seed=dist.rank)
    one_update(worker, prompts, seed=dist.rank)
    release(device)
    with worker.rollout_mode() as engine:
        allocated = cuda_allocated(device)
        engine_bytes = storage_bytes(engine_tensors(engine), device)
        actor_bytes = storage_bytes(actor_tensors(worker.actor), device)
        offloaded = dict(params=worker.actor.params_offloaded, optimizer=worker.actor.optimizer_offloaded)
        out = worker.generate(prompts)  # the engine still generates beside what training left on the device
        generated = int(out["response_mask"].sum())
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None  # build to here
        del out
    training = None if allocated is None else allocated - engine_bytes - before_build
    fig = dict(training_side_bytes=training, actor_state_bytes=actor_bytes, engine_bytes=engine_bytes,
               allocated_in_rollout_mode=allocated, allocated_before_build=before_build, peak_allocated=peak,
               offloaded=offloaded, generated_tokens=generated,
               params=sum(p.numel() for p in worker.actor.model.parameters()))
    actor_model = weakref.ref(worker.actor.model)
    del worker, engine
    release(device)
    fig["worker_freed"] = actor_model() is None  # the next mode starts from a clean device
    return fig


# --------------------------------------------------------------------------- report
def _gather(obj: Any) -> list[Any]:
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        out: list[Any] = [None] * tdist.get_world_size()
        tdist.all_gather_object(out, obj)
        return out
    return [obj]


def _largest(per_rank: list[dict], key: str) -> int | None:
    values = [r[key] for r in per_rank]
    return None if any(v is None for v in values) else max(values)


def summarize(per_mode: dict[str, list[dict]], on_gpu: bool) -> dict[str, Any]:
    """Both numbers per mode (largest rank), the on/off ratios and the verdict (GPU only)."""
    out: dict[str, Any] = {}
    for key in ("training_side_bytes", "actor_state_bytes"):
        off, on = _largest(per_mode["off"], key), _largest(per_mode["on"], key)
        out[key] = dict(off=off, on=on)
        if off is not None and on is not None:
            out[key.replace("_bytes", "_gib")] = dict(off=round(off / GiB, 4), on=round(on / GiB, 4))
        out[key.replace("_bytes", "_ratio")] = round(on / off, 4) if on_gpu and off else None
    out["ratio"] = out["training_side_ratio"]
    out["target"] = TARGET
    out["meets_target"] = out["ratio"] <= TARGET if out["ratio"] is not None else None
    out["offloaded"] = {m: [r["offloaded"] for r in per_mode[m]] for m in per_mode}
    return out


# --------------------------------------------------------------------------- main
def _init_dist(device_pref: str):
    """torchrun's process group, or (plain ``python``) a world of one that still takes the FSDP2 path."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from hybrid_rl.distributed import init_distributed

    return init_distributed(device_pref)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:qwen2.5-0.5b-random")
    ap.add_argument("--recipe", default=str(ROOT / "benchmarks" / "bench_modes.yaml"))
    ap.add_argument("--prompts", type=int, default=4, help="prompts per rank (2 samples each)")
    ap.add_argument("--prompt-length", type=int, default=64)
    ap.add_argument("--response-length", type=int, default=64)
    ap.add_argument("--out", default=None, help="run directory (default runs/offload_memory/<UTC time>/; "
                    "benchmarks/publish.py copies a result to benchmarks/results/)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: checks the plumbing only")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for both modes")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.prompt_length < 1 or args.response_length < 1:
        ap.error("--prompts, --prompt-length and --response-length must be >= 1")
    args.device = "cuda"
    if args.cpu_smoke:
        args.model, args.device = "builtin:tiny-qwen2", "cpu"
        args.prompt_length, args.response_length = min(args.prompt_length, 8), min(args.response_length, 6)
    elif not torch.cuda.is_available():
        ap.error("no CUDA device visible: run on GPUs, or pass --cpu-smoke")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    dist = _init_dist(args.device)
    from hybrid_rl.models import resolve_model_path

    if dist.is_main:  # materialise a built-in model once, not once per rank
        resolve_model_path(args.model)
    if tdist.is_initialized():
        tdist.barrier()
    start = time.perf_counter()
    per_mode = {mode: _gather(measure_mode(args, dist, mode)) for mode in MODES}
    on_gpu = dist.device.type == "cuda"
    device = device_name(dist.world_size) if on_gpu else "CPU"
    model_tag = args.model.split(":")[-1].split("/")[-1]
    record = dict(
        bench="offload_memory", device=device, world_size=dist.world_size, model=args.model, engine="hf",
        device_name=torch.cuda.get_device_name(dist.device) if on_gpu else "cpu",
        **summarize(per_mode, on_gpu), modes=per_mode,
        method=("training_side_bytes = memory_allocated inside rollout_mode() - the engine's parameter/buffer "
                "storages - memory_allocated before the worker was built; actor_state_bytes = storages of the "
                "actor's params + grads + optimizer state on the training device; per rank, largest rank "
                "reported; mode 'on' measured first"),
        prompts_per_rank=args.prompts, prompt_length=args.prompt_length, response_length=args.response_length,
        overrides=make_overrides(args, dist.world_size, "off")[:-len(MODES["off"])],
        seconds=round(time.perf_counter() - start, 1), torch=torch.__version__, commit=git_commit(),
        time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if dist.is_main:
        print(json.dumps(record), flush=True)
        out = run_dir("offload_memory", args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"offload_memory_{device}_{model_tag}.json").write_text(json.dumps(record, indent=1) + "\n")
    if tdist.is_initialized():
        tdist.barrier()
        tdist.destroy_process_group()
    return record


if __name__ == "__main__":
    main()
