"""Weight-sync benchmark: how fast the sharding manager pushes an FSDP2 actor into a colocated engine.

    torchrun --standalone --nproc_per_node=N benchmarks/weight_sync.py --model qwen2.5-1.5b
    torchrun --standalone --nproc_per_node=2 benchmarks/weight_sync.py --model tiny --switches 5   # CPU smoke test
    torchrun --standalone --nproc_per_node=2 benchmarks/weight_sync.py --model tiny-deep --device cpu  # 290 tiny tensors: per-tensor overhead

A randomly initialised model of the named architecture (no download) is
FSDP2-sharded over the N ranks exactly as the actor is (fp32 masters, bf16
compute on GPU), and ``ShardingManager`` pushes it ``--switches`` times into an
engine: ``--sink copy`` is a stand-in for vLLM's load (a device-to-device copy
into preallocated engine tensors: the bound a real push can approach, vLLM left
out), ``--sink hf`` is the real ``HFRolloutEngine`` (with its sleep/wake moves,
which are outside the timed push), and ``--sink vllm`` is the real colocated
vLLM engine (``VLLMRolloutEngine``, in process, built as the trainer builds it,
dummy weights, kept awake as ``rollout.free_cache_engine=false`` keeps it): the
push the trainer makes, through vLLM's own ``load_weights`` (GPU and vLLM
needed). With ``--sink vllm`` the same run also times the copy sink on the
same shapes, so the record holds both. Every switch
bumps the weight version, so every switch is a full push. The first push records
the sink's loads and later ones replay them (``hybrid_rl.weights.replay``) unless
``--no-replay``; consecutive decoder blocks share one all-gather up to
``--gather-mb``.

Printed as one JSON line (and written to ``weight_sync_<device>x<N>_<model>.json``, e.g. ``H100x2``, in its run
directory, ``runs/weight_sync/<UTC time>/`` unless ``--out-dir``; ``benchmarks/publish.py`` copies it to
``benchmarks/results/``): the median push
time ``sync_s`` (per switch, the slowest rank), its physical bound ``bound_s`` =
the model's bytes in the engine dtype through one all-gather of those same
bytes (measured here, NCCL-tests bus bandwidth reported) plus one device copy
of them, and memory before/after the switches (GPU ``memory_allocated`` /
``max_memory_reserved``, host RSS) to catch leaks. The breakdown: ``gather_s``
is the same stream of buckets with nothing loaded (median, slowest rank), so
``sync_s - gather_s`` estimates what loading adds on top of the gather (the two
overlap, so it is not the load's own duration); ``replayed_tensors`` says how
many tensors of the last push skipped the sink's loader. The copy sink leaves
out vLLM's ``load_weights`` (name mapping, QKV and gate/up fusion on top of the
copy); only ``--sink vllm`` includes it. Left out: multi-node runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import git_commit, gpu_short_name, run_dir  # noqa: E402

from hybrid_rl.models import RANDOM_ARCHS, TINY_CONFIG  # noqa: E402
from hybrid_rl.rollout.base import RolloutEngine  # noqa: E402
from hybrid_rl.weights.sharding_manager import ShardingManager  # noqa: E402
from hybrid_rl.workers.fsdp_engine import TrainingEngine  # noqa: E402

# Qwen2.5 architectures (tied embeddings, as the released checkpoints); tiny = the built-in test model
ARCHS = {
    "qwen2.5-0.5b": RANDOM_ARCHS["qwen2.5-0.5b-random"],
    "qwen2.5-1.5b": RANDOM_ARCHS["qwen2.5-1.5b-random"],
    "tiny": dict(TINY_CONFIG, vocab_size=103),
    # the 0.5B model's 290 tensors at the tiny model's width: what the push costs per tensor, on any device
    "tiny-deep": dict(TINY_CONFIG, vocab_size=103, num_hidden_layers=24),
}


class CopySink(RolloutEngine):
    """What vLLM's load costs at least: engine-owned tensors, preallocated, filled by a device copy."""

    def __init__(self, shapes: dict[str, torch.Size], dtype: torch.dtype, device: torch.device):
        self.tensors = {n: torch.empty(s, dtype=dtype, device=device) for n, s in shapes.items()}

    def load_weights(self, weights):
        for name, t in weights:
            self.tensors[name].copy_(t, non_blocking=True)

    def named_weights(self):
        return self.tensors.items()

    def generate(self, prompts, params):
        raise NotImplementedError("CopySink only receives weights")

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self, tags=None) -> None:
        pass


# --------------------------------------------------------------------------- helpers
def _init_dist(device_pref: str) -> tuple[int, int, torch.device]:
    if "RANK" not in os.environ:  # plain `python`: a world of one, still through FSDP2 like torchrun would
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from hybrid_rl.distributed import init_distributed

    d = init_distributed(device_pref)
    return d.rank, d.world_size, d.device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return _max_over_ranks(statistics.median(times), device)


def _max_over_ranks(x: float, device: torch.device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _memory(device: torch.device) -> dict[str, int]:
    mem = {"host_rss": _rss_bytes()}
    if device.type == "cuda":
        _sync(device)
        mem.update(allocated=torch.cuda.memory_allocated(device), reserved=torch.cuda.memory_reserved(device),
                   max_allocated=torch.cuda.max_memory_allocated(device),
                   max_reserved=torch.cuda.max_memory_reserved(device))
    return mem


def _device_tag(device: torch.device, world: int) -> tuple[str, str]:
    """(``H100x2``-style tag, as benchmarks/vllm_bench.py writes it; full device name)."""
    if device.type != "cuda":
        return f"cpux{world}", "cpu"
    name = torch.cuda.get_device_name(device)
    return f"{gpu_short_name(name)}x{world}", name


def measure_bound(nbytes: int, dtype: torch.dtype, device: torch.device, world: int, repeats: int) -> dict:
    """All-gather of ``nbytes`` (in ``dtype``) over the world + one device copy of them."""
    esize = torch.tensor([], dtype=dtype).element_size()
    per_rank = -(-nbytes // (esize * world))
    shard = torch.randn(per_rank, device=device).to(dtype)
    gathered = torch.empty(per_rank * world, dtype=dtype, device=device)
    dst = torch.empty_like(gathered)
    out: dict = {}
    if world > 1:
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        t_ag = _timed(lambda: all_gather(gathered, shard), device, repeats)
        out.update(allgather_s=t_ag, allgather_busbw_GBps=nbytes * (world - 1) / world / t_ag / 1e9,
                   allgather_algbw_GBps=nbytes / t_ag / 1e9)
    else:
        t_ag = 0.0  # one rank holds every shard already: no communication is needed
        out.update(allgather_s=0.0, allgather_busbw_GBps=None, allgather_algbw_GBps=None)
    t_copy = _timed(lambda: dst.copy_(gathered), device, repeats)
    out.update(copy_s=t_copy, copy_GBps=nbytes / t_copy / 1e9, bound_s=t_ag + t_copy)
    del shard, gathered, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _drain(actor: TrainingEngine, dtype: torch.dtype, bucket_bytes: int) -> None:
    """The push's gather and bucketing with nothing loaded (the breakdown's ``gather_s``)."""
    from hybrid_rl.weights.buckets import bucketize

    for bucket in bucketize(actor.iter_full_params(dtype), bucket_bytes):
        del bucket


def _profile_switches(switch, n: int, device: torch.device, path: Path) -> None:
    """``n`` switches under torch.profiler; the op tables (by device time and by host time) go to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(n):
            dist.barrier()
            switch()
    table = prof.key_averages()
    parts = [f"{n} pushes under torch.profiler on {device}"]
    if device.type == "cuda":
        parts.append(table.table(sort_by="cuda_time_total", row_limit=25))
    parts.append(table.table(sort_by="cpu_time_total", row_limit=40))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(parts) + "\n")


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(ARCHS), default="qwen2.5-0.5b")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="engine dtype (auto: bf16 on GPU, fp32 on CPU)")
    ap.add_argument("--sink", choices=["copy", "hf", "vllm"], default="copy")
    ap.add_argument("--gpu-util", type=float, default=0.3, help="--sink vllm: rollout.vllm.gpu_memory_utilization")
    ap.add_argument("--switches", type=int, default=50, help="timed switches (each a full push); memory is compared across them")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--no-prefetch", action="store_true", help="gather a chunk only after the previous one was loaded")
    ap.add_argument("--gather-mb", type=int, default=256,
                    help="consecutive decoder blocks share one all-gather up to this many MB (0: one block each)")
    ap.add_argument("--no-replay", action="store_true", help="call the sink's load_weights on every push (no record-and-replay)")
    ap.add_argument("--naive", action="store_true",
                    help="baseline: one full_tensor() of the fp32 master per parameter, then the cast "
                         "(with --no-replay: the push before grouped gathers)")
    ap.add_argument("--param-offload", action="store_true")
    ap.add_argument("--optimizer-offload", action="store_true")
    ap.add_argument("--no-verify", action="store_true", help="skip the bit-for-bit check of the engine after the last push")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timed switches, run N more under torch.profiler and write its tables per rank "
                         "(weight_sync_<device>_<model>_profile_rank<r>.txt): where a push's time goes")
    ap.add_argument("--out-dir", default=None, help="run directory (default runs/weight_sync/<UTC time>/; "
                    "benchmarks/publish.py copies a result to benchmarks/results/)")
    args = ap.parse_args(argv)

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hybrid_rl.models import resolve_dtype
    from hybrid_rl.weights.plan import engine_param_name

    rank, world, device = _init_dist(args.device)
    dtype = resolve_dtype(args.dtype, device)
    config = Qwen2Config(**{**ARCHS[args.model], "rms_norm_eps": 1e-6, "max_position_embeddings": 4096})
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    actor = TrainingEngine(model, device, dtype, trainable=True)
    if args.param_offload or args.optimizer_offload:  # give AdamW its state so there is something to offload
        actor.configure_optimizer(1e-6, (0.9, 0.999), 0.0, 0, "constant", 1, 0.0)
        for p in actor.model.parameters():
            p.grad = torch.zeros_like(p)
        actor.optimizer.step()
        actor.zero_grad()
    names = actor.push_names()
    numel = sum(n for _, n, _ in names)
    nbytes = numel * torch.tensor([], dtype=dtype).element_size()

    with torch.device("meta"):
        shapes = {engine_param_name(n): p.shape for n, p in Qwen2ForCausalLM(config).named_parameters()}
    copy_bound = None
    if args.sink == "vllm":
        sink = _vllm_sink(config, args, device)
        copy_bound = _copy_sink_figure(actor, CopySink(shapes, dtype, device), dtype, args, device)
    elif args.sink == "copy":
        sink = CopySink(shapes, dtype, device)
    else:
        from hybrid_rl.rollout.hf import HFRolloutEngine

        with torch.device(device):
            engine_model = Qwen2ForCausalLM(config).to(dtype)
        sink = HFRolloutEngine(engine_model, [0], 0, device)
    version = [0]
    sm = ShardingManager(actor, sink, lambda: version[0], dtype=dtype, bucket_mb=args.bucket_mb,
                         free_cache_engine=args.sink != "vllm", sleep_level=1, param_offload=args.param_offload,
                         optimizer_offload=args.optimizer_offload, replay=not args.no_replay)
    actor.push_prefetch = not args.no_prefetch
    actor.push_gather_bytes = args.gather_mb * 2**20
    if args.naive:
        def naive_params(dt=None, skip_static=False):
            for name, p in actor.model.named_parameters():
                yield engine_param_name(name), (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).to(dt)

        actor.iter_full_params = naive_params

    def switch() -> tuple[float, float]:
        version[0] += 1
        start = time.perf_counter()
        with sm:
            pass
        _sync(device)
        return sm.last_sync_s, time.perf_counter() - start

    dist.barrier()
    first = switch()[0]
    for _ in range(max(args.warmup - 1, 0)):
        switch()
    bound = measure_bound(nbytes, dtype, device, world, repeats=5)

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    mem_before = _memory(device)
    sync_times, switch_times = [], []
    for _ in range(args.switches):
        dist.barrier()
        s, w = switch()
        sync_times.append(_max_over_ranks(s, device))
        switch_times.append(_max_over_ranks(w, device))
    mem_after = _memory(device)
    assert sm.last_sync_bytes == nbytes, (sm.last_sync_bytes, nbytes)
    gather = _timed(lambda: _drain(actor, dtype, sm.bucket_bytes), device, repeats=max(3, min(args.switches, 10)), warmup=1)

    verified = None
    if args.sink == "vllm" and not args.no_verify:  # vLLM fuses q/k/v and gate/up: compare the tensors it keeps whole
        engine = dict(sink.named_weights())
        checked = bad = 0
        for name, p in actor.model.named_parameters():
            ename = engine_param_name(name)
            if ename in engine:
                full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to(dtype).cpu()
                checked += 1
                bad += int(not torch.equal(engine[ename], full))
        verified = dict(tensors_compared=checked, mismatched=int(_max_over_ranks(float(bad), device)))
    elif not args.no_verify:
        if args.sink == "hf":
            sink.wake_up(["weights"])
        engine = dict(sink.named_weights())
        bad = 0
        for name, p in actor.model.named_parameters():  # one parameter at a time: never the whole state dict
            full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to(dtype)
            bad += int(not torch.equal(engine[engine_param_name(name)], full))
        verified = _max_over_ranks(float(bad), device) == 0

    tag, device_name = _device_tag(device, world)
    out = run_dir("weight_sync", args.out_dir)  # on every rank: a path inside benchmarks/results/ stops each of them
    if args.out_dir is None:  # the default names the time: rank 0's, for every rank
        shared = [str(out)]
        dist.broadcast_object_list(shared, src=0)
        out = Path(shared[0])
    if args.profile:
        _profile_switches(switch, args.profile, device, out / f"weight_sync_{tag}_{args.model}_profile_rank{rank}.txt")
    sync_s = statistics.median(sync_times)
    record = {
        "bench": "weight_sync", "model": args.model, "params": numel, "bytes": nbytes, "dtype": str(dtype).replace("torch.", ""),
        "world_size": world, "device": tag, "device_name": device_name, "sink": args.sink, "bucket_mb": args.bucket_mb,
        "impl": "naive" if args.naive else "grouped", "prefetch": not args.no_prefetch, "param_offload": args.param_offload, "optimizer_offload": args.optimizer_offload,
        "gather_mb": args.gather_mb, "replay": sm.replayer is not None, "replayed_tensors": sm.last_sync_replayed,
        "replay_stats": vars(sm.replayer.stats) if sm.replayer is not None else None,
        "sync_s": sync_s, "sync_s_min": min(sync_times), "sync_s_max": max(sync_times), "first_sync_s": first,
        "gather_s": gather, "load_over_gather_s": sync_s - gather,
        "switch_s": statistics.median(switch_times), "sync_GBps": nbytes / sync_s / 1e9,
        **bound, "bound_ratio": sync_s / bound["bound_s"], "tensors": sm.last_sync_tensors, "switches": args.switches,
        "memory_before": mem_before, "memory_after": mem_after, "verified": verified,
        "copy_sink_same_run": copy_bound, "over_copy_sink": (sync_s / copy_bound["sync_s"]) if copy_bound else None,
        "vllm": _vllm_version() if args.sink == "vllm" else None,
        "torch": torch.__version__, "commit": git_commit(),
        "settings": {k: v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
                     for k, v in vars(args).items()},
    }
    if rank == 0:
        print(json.dumps(record), flush=True)
        out.mkdir(parents=True, exist_ok=True)
        suffix = ("_naive" if args.naive else "") + ("_noreplay" if args.no_replay else "") + ("" if args.sink == "copy" else f"_{args.sink}")
        (out / f"weight_sync_{tag}_{args.model}{suffix}.json").write_text(json.dumps(record, indent=1) + "\n")
    dist.barrier()
    if args.sink == "vllm":
        sink.shutdown()
    dist.destroy_process_group()
    return record


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def _vllm_sink(config, args, device: torch.device):
    """The colocated vLLM engine as the trainer builds it (``VLLMRolloutEngine.from_config``), over a directory holding
    only the architecture's config.json (``load_format=dummy``: the pushes supply every weight)."""
    import tempfile

    from hybrid_rl.config import load_config
    from hybrid_rl.distributed import init_distributed
    from hybrid_rl.rollout.vllm import VLLMRolloutEngine

    model_dir = Path(tempfile.mkdtemp(prefix="weight_sync_arch_"))
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(model_dir)
    cfg = load_config(None, [f"model.path={model_dir}", "model.dtype=bfloat16", "trainer.device=cuda", "rollout.name=vllm",
                             f"rollout.vllm.gpu_memory_utilization={args.gpu_util}", "rollout.vllm.enforce_eager=true",
                             f"rollout.weight_sync_bucket_mb={args.bucket_mb}", "rollout.free_cache_engine=false",
                             "data.max_prompt_length=256", "data.max_response_length=256"])

    class _Tok:  # the engine reads only these two ids (skip_tokenizer_init)
        eos_token_id = 0
        pad_token_id = 0

    return VLLMRolloutEngine.from_config(cfg, init_distributed("cuda"), _Tok())


def _copy_sink_figure(actor, sink: "CopySink", dtype: torch.dtype, args, device: torch.device) -> dict:
    """Median push into the copy sink on the same shapes, in the same process, before the vLLM pushes."""
    version = [0]
    sm = ShardingManager(actor, sink, lambda: version[0], dtype=dtype, bucket_mb=args.bucket_mb,
                         free_cache_engine=True, sleep_level=1, replay=not args.no_replay)
    times = []
    for i in range(args.warmup + args.switches):
        version[0] += 1
        dist.barrier()
        with sm:
            pass
        _sync(device)
        if i >= args.warmup:
            times.append(_max_over_ranks(sm.last_sync_s, device))
    del sink.tensors
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(sync_s=statistics.median(times), sync_s_min=min(times), sync_s_max=max(times), switches=len(times))


if __name__ == "__main__":
    main()
