"""Benchmark the colocated vLLM rollout engine: parity, sleep memory, cycle growth, push time, throughput.

Run on GPUs under torchrun (vLLM 0.26 installed), one process per GPU:

    torchrun --standalone --nproc_per_node=1 benchmarks/vllm_bench.py --standalone   # baseline: vLLM alone
    torchrun --standalone --nproc_per_node=1 benchmarks/vllm_bench.py                # the hybrid set-up

The hybrid run builds what the worker builds — a ``TrainingEngine`` (FSDP2, fp32 masters, bf16
compute), a ``VLLMRolloutEngine`` from the config tree and a ``ShardingManager`` — for the
Qwen2.5-0.5B architecture with random weights (made from a config, no download), and measures:

* ``parity``: mean/p99/max |engine sampled-token log-prob − trainer log-prob| at T=1.0 and T=0.7;
* ``push``: time and bytes of a full weight push (gather + cast + ``load_weights``), and the
  wake/sleep times around it;
* ``sleep``: free GPU memory awake vs asleep, for sleep levels 1 and 2;
* ``cycles``: free memory and allocated memory over 50 sleep → wake → push → generate cycles;
* ``throughput``: 64 prompts × 8 samples × 512 tokens (prompt 256, ``ignore_eos``: random weights,
  fixed lengths) through ``VLLMRolloutEngine.generate`` after a sleep/wake/push, through the same
  ``LLM`` object directly, and (when ``--standalone`` ran first) through a vLLM engine alone in its
  process with the same settings.

Each result is printed as one JSON line and written to ``<out>/vllm_<device>_<what>.json``
(device like ``H100x1``), naming the device, commit, config and figures. With several ranks each
rank has its own engine (tensor_parallel_size=1, data parallel) or ``--tp`` ranks share one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

for _k, _v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
               "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybrid_rl.batch import Batch  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.distributed import init_distributed  # noqa: E402
from hybrid_rl.models import RANDOM_ARCHS, write_random_model  # noqa: E402
from hybrid_rl.rollout.base import SamplingParams  # noqa: E402
from hybrid_rl.rollout.vllm import VLLMRolloutEngine, engine_kwargs, import_vllm, sampling_kwargs  # noqa: E402

QWEN25_05B = RANDOM_ARCHS["qwen2.5-0.5b-random"]  # the published Qwen2.5-0.5B shape
EOS, PAD = 151645, 151643
GiB, MiB = 2**30, 2**20


# --------------------------------------------------------------------------- bookkeeping
def device_tag(world: int) -> str:
    name = torch.cuda.get_device_name(0)
    m = re.search(r"(H100|H200|H20|A100|A10G|L40S|L4|B200|GH200|MI300X)", name)
    short = m.group(1) if m else re.sub(r"[^A-Za-z0-9]", "", name)[:16]
    return f"{short}x{world}"


def commit() -> str:
    if os.environ.get("HYBRID_RL_COMMIT"):
        return os.environ["HYBRID_RL_COMMIT"]
    head = ROOT / ".git" / "HEAD"
    try:  # read the ref without running git
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            return (ROOT / ".git" / ref[5:]).read_text().strip()
        return ref
    except OSError:
        return "unknown"


def free_mem() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def gather(obj):
    if tdist.is_initialized() and tdist.get_world_size() > 1:
        out = [None] * tdist.get_world_size()
        tdist.all_gather_object(out, obj)
        return out
    return [obj]


class Reporter:
    def __init__(self, args, dist, config: dict):
        self.args, self.dist, self.config = args, dist, config
        self.tag = device_tag(dist.world_size)
        self.base = dict(device=self.tag, gpu=torch.cuda.get_device_name(0), world_size=dist.world_size,
                         commit=commit(), tree=os.environ.get("HYBRID_RL_TREE", "working tree as carried"),
                         torch=torch.__version__, vllm=import_vllm().__version__)

    def write(self, what: str, figures: dict, per_rank: list | None = None) -> None:
        if not self.dist.is_main:
            return
        rec = dict(what=what, **self.base, config=self.config, figures=figures,
                   time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        if per_rank is not None:
            rec["per_rank"] = per_rank
        for out in self.args.out:
            Path(out).mkdir(parents=True, exist_ok=True)
            suffix = f"_tp{self.args.tp}" if self.args.tp > 1 else ""
            (Path(out) / f"vllm_{self.tag}_{what}{suffix}.json").write_text(json.dumps(rec, indent=1) + "\n")
        print("RESULT " + json.dumps(rec), flush=True)


# --------------------------------------------------------------------------- set-up
def build_model_dir(path: Path, dist) -> None:
    if dist.is_main and not (path / "config.json").exists():
        write_random_model(path, QWEN25_05B, dist.device, eos_token_id=EOS, pad_token_id=PAD)
    if tdist.is_initialized():
        tdist.barrier()


def make_cfg(args, path: Path):
    return load_config(None, [
        f"model.path={path}", "model.dtype=bfloat16", "trainer.device=cuda", "rollout.name=vllm",
        f"rollout.gpu_memory_utilization={args.gpu_util}", f"rollout.enforce_eager={str(args.enforce_eager).lower()}",
        f"rollout.max_num_seqs={args.max_num_seqs}", f"rollout.max_num_batched_tokens={args.max_num_batched_tokens}",
        f"rollout.tensor_parallel_size={args.tp}", f"rollout.sleep_level={args.sleep_level}",
        f"rollout.weight_sync_bucket_mb={args.bucket_mb}",
        f"data.max_prompt_length={args.prompt_length}", f"data.max_response_length={args.response_length}"])


def random_prompts(num: int, length: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 150000, (num, length), generator=g)
    return Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def masked_stats(diff: torch.Tensor, mask: torch.Tensor) -> dict:
    vals = diff[mask.bool()].float()
    return dict(mean=float(vals.mean()), p99=float(torch.quantile(vals.cpu(), 0.99)), max=float(vals.max()),
                tokens=int(vals.numel()))


def throughput_prompts(args, dist) -> Batch:
    """This rank's share: under TP the ranks of one engine bring args.prompts / tp prompts each."""
    return random_prompts(args.prompts // args.tp, args.prompt_length, seed=1000 + dist.rank)


def engine_prompts(prompts: Batch, tp_group) -> Batch:
    """What one engine replica generates: the union of its TP ranks' prompts (the raw runs submit it all)."""
    if tp_group is None:
        return prompts
    parts = [None] * tdist.get_world_size(tp_group)
    tdist.all_gather_object(parts, prompts.tensors["input_ids"], group=tp_group)
    ids = torch.cat(parts)
    return Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def time_raw_generate(llm, vllm, prompts: Batch, args) -> dict:
    """The same prompts straight through ``LLM.generate`` (no conversion, no assembly)."""
    ids = [row.tolist() for row in prompts.tensors["input_ids"]]
    sp = vllm.SamplingParams(**sampling_kwargs(SamplingParams(n=args.n, temperature=1.0, max_tokens=args.response_length),
                                               [EOS], ignore_eos=True))
    warm = vllm.SamplingParams(**sampling_kwargs(SamplingParams(n=2, temperature=1.0, max_tokens=16), [EOS], ignore_eos=True))
    llm.generate([{"prompt_token_ids": p} for p in ids[:8]], warm, use_tqdm=False)
    if tdist.is_initialized():
        tdist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], sp, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for r in outs for o in r.outputs)
    return dict(tokens=tokens, seconds=dt, tok_per_s=tokens / dt)


def aggregate(per_rank: list[dict], tp: int, replicated: bool = True) -> dict:
    # replicated: each rank of a TP group reports its engine's tokens (count each replica once);
    # otherwise each rank reports its own share (the hybrid engine's slice)
    replicas = per_rank[::tp] if replicated else per_rank
    tokens = sum(r["tokens"] for r in replicas)
    seconds = max(r["seconds"] for r in per_rank)
    return dict(tokens=tokens, seconds=round(seconds, 3), tok_per_s=round(tokens / seconds),
                tok_per_s_per_gpu=round(tokens / seconds / len(per_rank)))


# --------------------------------------------------------------------------- modes
def run_standalone(args, dist) -> None:
    """vLLM alone in the process (same engine arguments, dummy weights), the throughput baseline."""
    vllm = import_vllm()
    path = Path(args.model_dir)
    build_model_dir(path, dist)
    cfg = make_cfg(args, path)
    kwargs = engine_kwargs(cfg, dist)
    t0 = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    init_s = time.perf_counter() - t0
    prompts = throughput_prompts(args, dist)
    runs = []
    for _ in range(args.repeats):
        llm.reset_prefix_cache()
        runs.append(time_raw_generate(llm, vllm, prompts, args))
    best = max(runs, key=lambda r: r["tok_per_s"])
    per_rank = gather(dict(best, init_s=init_s, runs=runs))
    if dist.is_main:
        rec = dict(standalone=aggregate(per_rank, args.tp), per_rank=per_rank, engine_kwargs=kwargs)
        Path(args.standalone_json).write_text(json.dumps(rec, default=str))
        print("STANDALONE " + json.dumps(rec, default=str), flush=True)


def run_hybrid(args, dist) -> None:
    from hybrid_rl.models import load_causal_lm
    from hybrid_rl.sharding_manager import ShardingManager
    from hybrid_rl.workers.fsdp_engine import TrainingEngine

    vllm = import_vllm()
    path = Path(args.model_dir)
    build_model_dir(path, dist)
    cfg = make_cfg(args, path)
    kwargs = engine_kwargs(cfg, dist)
    config = dict(model="Qwen2.5-0.5B architecture, random init", engine_kwargs={k: v for k, v in kwargs.items() if k != "model"},
                  prompts=args.prompts, n=args.n, prompt_length=args.prompt_length, response_length=args.response_length,
                  bucket_mb=args.bucket_mb, sleep_level=args.sleep_level, cycles=args.cycles,
                  trainer="TrainingEngine: FSDP2 (fully_shard per block), fp32 masters, bf16 compute")
    rep = Reporter(args, dist, config)

    actor = TrainingEngine(load_causal_lm(str(path), torch.float32), dist.device, torch.bfloat16, trainable=True)
    actor.configure_optimizer(1e-6, (0.9, 0.999), 0.0, 0, "constant", 100, 0.0)
    free_before_engine = free_mem()
    t0 = time.perf_counter()
    engine = VLLMRolloutEngine.from_config(cfg, dist, _Tok())
    init_s = time.perf_counter() - t0
    free_after_engine = free_mem()
    version = [0]
    sm = ShardingManager(actor, engine, lambda: version[0], dtype=torch.bfloat16, bucket_mb=args.bucket_mb,
                         free_cache_engine=True, sleep_level=args.sleep_level)

    def cycle(fn=None, bump=True):
        if bump:
            version[0] += 1
        t_enter = time.perf_counter()
        eng = sm.__enter__()
        enter_s = time.perf_counter() - t_enter
        try:
            result = fn(eng) if fn else None
        finally:
            t_exit = time.perf_counter()
            sm.__exit__(None, None, None)
            torch.cuda.synchronize()
            exit_s = time.perf_counter() - t_exit
        return result, dict(enter_s=enter_s, push_s=sm.last_sync_s, wake_s=enter_s - sm.last_sync_s, sleep_s=exit_s,
                            push_bytes=sm.last_sync_bytes)

    # ---- parity (the first push happens here)
    def parity(eng):
        out = {}
        prompts = random_prompts(16, 128, seed=7 + dist.rank)
        for temp in (1.0, 0.7):
            batch = eng.generate(prompts, SamplingParams(n=4, temperature=temp, max_tokens=128))
            lp, _ = actor.compute_log_prob(batch, 16, temp)
            out[f"T={temp}"] = masked_stats((batch.tensors["rollout_log_probs"] - lp).abs(), batch.tensors["response_mask"])
            if temp != 1.0:  # what a T=1 (raw log-prob) engine would have scored
                lp1, _ = actor.compute_log_prob(batch, 16, 1.0)
                out[f"T={temp}_vs_T=1_recompute"] = masked_stats((batch.tensors["rollout_log_probs"] - lp1).abs(),
                                                                 batch.tensors["response_mask"])
        return out

    par, first = cycle(parity, bump=False)
    par_ranks = gather(par)
    rep.write("parity", dict(logprob_diff={k: dict(mean=statistics.mean(r[k]["mean"] for r in par_ranks),
                                                   max=max(r[k]["max"] for r in par_ranks),
                                                   p99=max(r[k]["p99"] for r in par_ranks))
                                          for k in par_ranks[0]},
                             threshold_mean=2e-2, engine_init_s=round(init_s, 1)), per_rank=par_ranks)

    # ---- push timing (weights unchanged, but a new version forces a full push)
    pushes = [first] + [cycle()[1] for _ in range(args.pushes)]
    timed = pushes[1:]
    push_fig = dict(first_push_s=round(first["push_s"], 4), push_s_median=round(statistics.median(p["push_s"] for p in timed), 4),
                    push_s_all=[round(p["push_s"], 4) for p in timed], push_bytes=timed[0]["push_bytes"],
                    push_gb_per_s=round(timed[0]["push_bytes"] / 1e9 / statistics.median(p["push_s"] for p in timed), 2),
                    wake_s_median=round(statistics.median(p["wake_s"] for p in timed), 4),
                    sleep_s_median=round(statistics.median(p["sleep_s"] for p in timed), 4))
    rep.write("push", push_fig, per_rank=gather(push_fig))

    # ---- sleep memory, levels 2 and 1
    sleep_fig = dict(free_before_engine_gib=round(free_before_engine / GiB, 2),
                     free_after_engine_init_gib=round(free_after_engine / GiB, 2))
    for level in (args.sleep_level, 3 - args.sleep_level):
        sm.sleep_level = level
        awake = {}

        def probe(eng):
            eng.generate(random_prompts(4, 32, seed=9), SamplingParams(n=2, max_tokens=16))
            awake["free"] = free_mem()

        _, t = cycle(probe)
        asleep = free_mem()
        sleep_fig[f"level{level}"] = dict(free_awake_gib=round(awake["free"] / GiB, 2), free_asleep_gib=round(asleep / GiB, 2),
                                          freed_gib=round((asleep - awake["free"]) / GiB, 2), sleep_s=round(t["sleep_s"], 3),
                                          wake_s=round(t["wake_s"], 3))
    sm.sleep_level = args.sleep_level
    rep.write("sleep", sleep_fig, per_rank=gather(sleep_fig))

    # ---- 50 cycles
    free_trace, alloc_trace, cycle_s = [], [], []
    small = random_prompts(4, 32, seed=11)
    for _ in range(args.cycles):
        t0 = time.perf_counter()
        cycle(lambda eng: eng.generate(small, SamplingParams(n=2, max_tokens=16)))
        cycle_s.append(time.perf_counter() - t0)
        free_trace.append(free_mem())
        alloc_trace.append(torch.cuda.memory_allocated())
    cyc = dict(cycles=args.cycles, free_asleep_first_gib=round(free_trace[0] / GiB, 3), free_asleep_last_gib=round(free_trace[-1] / GiB, 3),
               free_drop_max_mib=round((free_trace[0] - min(free_trace)) / MiB, 1),
               allocated_growth_mib=round((max(alloc_trace) - alloc_trace[0]) / MiB, 1),
               cycle_s_median=round(statistics.median(cycle_s), 3),
               free_asleep_trace_gib=[round(f / GiB, 3) for f in free_trace])
    rep.write("cycles", cyc, per_rank=gather({k: v for k, v in cyc.items() if k != "free_asleep_trace_gib"}))

    # ---- throughput: in-engine (after sleep/wake/push) vs the same LLM raw vs standalone
    prompts = throughput_prompts(args, dist)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.response_length)

    union = engine_prompts(prompts, engine.tp_group)

    def in_engine(eng):
        eng.ignore_eos = True
        try:
            eng.generate(prompts.index(slice(0, 8)), SamplingParams(n=2, max_tokens=16))
            if tdist.is_initialized():
                tdist.barrier()
            hybrid_runs, raw_runs = [], []
            for _ in range(args.repeats):  # alternate, so warm-up effects show up in the first pair only
                eng.llm.reset_prefix_cache()  # no run may reuse the prompts another run cached
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                batch = eng.generate(prompts, params)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                stats = dict(eng.last_generate_stats)
                hybrid_runs.append(dict(tokens=int(stats["num_tokens"]), seconds=wall, tok_per_s=stats["num_tokens"] / wall,
                                        vllm_seconds=stats["seconds"], masked_tokens=int(batch.tensors["response_mask"].sum())))
                eng.llm.reset_prefix_cache()
                raw_runs.append(time_raw_generate(eng.llm, vllm, union, args))
        finally:
            eng.ignore_eos = False
        best = lambda runs: dict(max(runs, key=lambda r: r["tok_per_s"]), runs=runs)  # noqa: E731
        return dict(hybrid=best(hybrid_runs), same_llm_raw=best(raw_runs))

    thr, _ = cycle(in_engine)
    thr_ranks = gather(thr)
    figures = dict(hybrid_generate=aggregate([r["hybrid"] for r in thr_ranks], args.tp, replicated=False),
                   same_llm_raw_generate=aggregate([r["same_llm_raw"] for r in thr_ranks], args.tp),
                   conversion_overhead_s=round(max(r["hybrid"]["seconds"] - r["hybrid"]["vllm_seconds"] for r in thr_ranks), 3))
    if Path(args.standalone_json).exists() and args.tp == 1:
        sa = json.loads(Path(args.standalone_json).read_text())
        figures["standalone_generate"] = sa["standalone"]
        figures["hybrid_over_standalone"] = round(figures["hybrid_generate"]["tok_per_s"] / sa["standalone"]["tok_per_s"], 3)
        figures["standalone_init_s"] = round(max(r["init_s"] for r in sa["per_rank"]), 1)
    else:
        figures["standalone_generate"] = "not run (run with --standalone first)"
    figures["hybrid_engine_init_s"] = round(init_s, 1)
    rep.write("throughput", figures, per_rank=thr_ranks)
    engine.shutdown()


class _Tok:
    eos_token_id = EOS
    pad_token_id = PAD


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--standalone", action="store_true", help="only the vLLM-alone throughput baseline")
    ap.add_argument("--standalone-json", default="/tmp/hybrid_rl_vllm_standalone.json")
    ap.add_argument("--out", action="append", default=None, help="result folder (repeatable); default benchmarks/results")
    ap.add_argument("--model-dir", default="/tmp/hybrid_rl_qwen25_05b_arch")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-length", type=int, default=256)
    ap.add_argument("--response-length", type=int, default=512)
    ap.add_argument("--cycles", type=int, default=50)
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--gpu-util", type=float, default=0.5)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--sleep-level", type=int, default=2, choices=(1, 2))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="timed throughput runs per mode (best is reported)")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    args.out = args.out or [str(ROOT / "benchmarks" / "results")]
    dist = init_distributed("cuda")
    try:
        (run_standalone if args.standalone else run_hybrid)(args, dist)
    finally:
        if tdist.is_initialized():
            tdist.barrier()


if __name__ == "__main__":
    main()
