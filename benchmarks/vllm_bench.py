"""Benchmark the colocated vLLM rollout engine: parity, sleep memory, cycle growth, push time, throughput.

Run on GPUs under torchrun (vLLM 0.26 installed), one process per GPU:

    torchrun --standalone --nproc_per_node=1 benchmarks/vllm_bench.py --standalone   # baseline: vLLM alone
    torchrun --standalone --nproc_per_node=1 benchmarks/vllm_bench.py                # the hybrid set-up
    torchrun --standalone --nproc_per_node=1 benchmarks/vllm_bench.py --only throughput   # throughput alone (~1.5 min)

The hybrid run builds what the worker builds — a ``TrainingEngine`` (FSDP2, fp32 masters, bf16
compute), a ``VLLMRolloutEngine`` from the config tree and a ``ShardingManager`` — for the
Qwen2.5-0.5B architecture with random weights (made from a config, no download), and measures
(``--only`` picks a comma-separated subset):

* ``parity``: mean/p99/max |engine sampled-token log-prob − trainer log-prob| at T=1.0 and T=0.7;
* ``push``: time and bytes of a full weight push (gather + cast + ``load_weights``), and the
  wake/sleep times around it;
* ``sleep``: free GPU memory awake vs asleep, for sleep levels 1 and 2;
* ``cycles``: free memory and allocated memory over 50 sleep → wake → push → generate cycles;
* ``throughput``: 64 prompts × 8 samples × 512 tokens (prompt 256, ``ignore_eos``: random weights,
  fixed lengths) through ``VLLMRolloutEngine.generate`` after a sleep/wake/push ("in-engine"),
  through the same ``LLM`` object directly ("same LLM, raw"), and (when ``--standalone`` ran
  first) through a vLLM engine alone in its process ("standalone").

How throughput compares like with like: every mode sends the same prompts with the same
``vllm.SamplingParams`` (built by ``sampling_kwargs``: ``logprobs=0``, ``flat_logprobs`` where
vLLM has it, EOS ignored; the engine's own arguments are captured and must equal the raw
ones) to an engine built from the same ``engine_kwargs``; the hybrid run checks the
standalone record against its own (device, world size, engine and sampling arguments, workload)
and lists any difference under ``like_for_like``. Each mode first runs one untimed warm-up of
the full batch shape (same prompts and n, ``--warmup-tokens`` tokens: CUDA graphs, Triton JITs
and allocator pools of the full batch), then ``--repeats`` timed runs (the in-engine and raw runs
alternate, the prefix cache is reset before each). The in-engine time is the wall time of
``VLLMRolloutEngine.generate`` — un-padding, request construction, ``LLM.generate``,
``collect_outputs`` and ``assemble_rollout`` on the GPU — so it includes all our post-processing;
``postprocess_s`` is its part outside ``LLM.generate``. Each run records the time the Python
garbage collector took inside it. ``--after-wake-runs`` more in-engine runs each follow a full
sleep → wake → push with no warm-up (what every RL step sees). Reported: the median and the best
run per mode (per run, the slowest rank's time), and ``in_engine_over_standalone`` (median over
median; the target is ≥ 0.95) and ``in_engine_over_same_llm``.

Each result is printed as one JSON line and written to ``<out>/vllm_<device>_<what>.json``
(device like ``H100x1``), naming the device, commit, config and figures. With several ranks each
rank has its own engine (rollout.vllm.tensor_parallel_size=1, data parallel) or ``--tp`` ranks share one.
Left out: workloads other than fixed-length sampling at T=1 (no top-p/top-k, no EOS stops).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_common import git_commit, gpu_short_name, run_dir  # noqa: E402

from hybrid_rl.batch import Batch  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.distributed import init_distributed  # noqa: E402
from hybrid_rl.models import RANDOM_ARCHS, write_random_model  # noqa: E402
from hybrid_rl.rollout.base import SamplingParams  # noqa: E402
from hybrid_rl.rollout.vllm import (VLLMRolloutEngine, engine_kwargs, import_vllm, sampling_kwargs,  # noqa: E402
                                    supports_flat_logprobs)

QWEN25_05B = RANDOM_ARCHS["qwen2.5-0.5b-random"]  # the published Qwen2.5-0.5B shape
EOS, PAD = 151645, 151643
PROMPT_ID_HIGH = 150000  # random prompt ids are drawn below this
GiB, MiB = 2**30, 2**20
SECTIONS = ("parity", "push", "sleep", "cycles", "throughput")
TARGET = 0.95  # in-engine throughput >= 95% of standalone


# --------------------------------------------------------------------------- bookkeeping
def device_tag(world: int) -> str:
    return f"{gpu_short_name(torch.cuda.get_device_name(0))}x{world}"


def commit() -> str:
    return os.environ.get("HYBRID_RL_COMMIT") or git_commit(ROOT)


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
        f"rollout.vllm.gpu_memory_utilization={args.gpu_util}", f"rollout.vllm.enforce_eager={str(args.enforce_eager).lower()}",
        f"rollout.max_num_seqs={args.max_num_seqs}", f"rollout.vllm.max_num_batched_tokens={args.max_num_batched_tokens}",
        f"rollout.vllm.tensor_parallel_size={args.tp}", f"rollout.sleep_level={args.sleep_level}",
        f"rollout.weight_sync_bucket_mb={args.bucket_mb}",
        f"data.max_prompt_length={args.prompt_length}", f"data.max_response_length={args.response_length}"])


def random_prompts(num: int, length: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, PROMPT_ID_HIGH, (num, length), generator=g)
    return Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def masked_stats(diff: torch.Tensor, mask: torch.Tensor) -> dict:
    vals = diff[mask.bool()].float()
    return dict(mean=float(vals.mean()), p99=float(torch.quantile(vals.cpu(), 0.99)), max=float(vals.max()),
                tokens=int(vals.numel()))


def throughput_prompts(args, rank: int) -> Batch:
    """Rank ``rank``'s share: under TP the ranks of one engine bring args.prompts / tp prompts each."""
    return random_prompts(args.prompts // args.tp, args.prompt_length, seed=1000 + rank)


def engine_prompt_ids(args, rank: int) -> list[list[int]]:
    """What rank ``rank``'s engine generates: the prompts of every rank of its TP group, in rank order
    (under TP every rank of an engine must submit the same requests; the raw and standalone runs send it all)."""
    first = rank - rank % args.tp
    return [row.tolist() for r in range(first, first + args.tp)
            for row in throughput_prompts(args, r).tensors["input_ids"]]


# --------------------------------------------------------------------------- throughput helpers
def cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def barrier() -> None:
    if tdist.is_initialized():
        tdist.barrier()


def bench_params(args) -> SamplingParams:
    """The throughput workload's sampling: T=1, ``args.n`` samples of ``args.response_length`` tokens."""
    return SamplingParams(n=args.n, temperature=1.0, max_tokens=args.response_length)


def raw_sampling_kwargs(args, sampling_params_cls) -> dict:
    """What the raw and standalone runs pass to ``vllm.SamplingParams``: exactly what the engine builds."""
    return sampling_kwargs(bench_params(args), [EOS], ignore_eos=True,
                           flat_logprobs=supports_flat_logprobs(sampling_params_cls))


class GcTimer:
    """Time spent in Python's garbage collector (and collections per generation) while active."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.collections[info.get("generation", 2)] += 1

    def __enter__(self) -> "GcTimer":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


def timed(fn, sync=cuda_sync) -> tuple[object, dict]:
    """Run ``fn`` between two device syncs; returns (its result, seconds and GC figures)."""
    sync()
    with GcTimer() as g:
        t0 = time.perf_counter()
        result = fn()
        sync()
        seconds = time.perf_counter() - t0
    return result, dict(seconds=seconds, gc_s=round(g.seconds, 4), gc_collections=list(g.collections))


def raw_run(llm, make_sp, ids: list[list[int]], kwargs: dict, sync=cuda_sync) -> dict:
    """One timed ``LLM.generate`` of ``ids`` (request construction included, no conversion, no assembly)."""
    sp = make_sp(**kwargs)
    outs, t = timed(lambda: llm.generate([{"prompt_token_ids": p} for p in ids], sp, use_tqdm=False), sync)
    tokens = sum(len(o.token_ids) for r in outs for o in r.outputs)
    return dict(tokens=tokens, tok_per_s=tokens / t["seconds"], **t)


def engine_run(eng, prompts: Batch, params: SamplingParams, sync=cuda_sync) -> dict:
    """One timed ``VLLMRolloutEngine.generate``: our whole path, post-processing included."""
    batch, t = timed(lambda: eng.generate(prompts, params), sync)
    stats = dict(eng.last_generate_stats)
    tokens = int(stats["num_tokens"])
    return dict(tokens=tokens, tok_per_s=tokens / t["seconds"], vllm_seconds=stats["seconds"],
                postprocess_s=t["seconds"] - stats["seconds"], masked_tokens=int(batch.tensors["response_mask"].sum()), **t)


def throughput_runs(eng, prompts: Batch, raw_ids: list[list[int]], params: SamplingParams, raw_kwargs: dict,
                    make_sp, repeats: int, warmup_tokens: int, sync=cuda_sync) -> dict:
    """Inside an awake engine: one untimed full-shape warm-up, then ``repeats`` in-engine/raw pairs.

    ``raw_ids`` is what this rank's engine generates (under TP the group's union). The engine's
    ``vllm.SamplingParams`` arguments are captured and returned for the like-for-like check.
    """
    captured: list[dict] = []
    make = eng.make_sampling_params
    eng.make_sampling_params = lambda **kw: captured.append(kw) or make(**kw)
    eng.ignore_eos = True
    try:
        warm = time.perf_counter()
        eng.generate(prompts, dataclasses.replace(params, max_tokens=warmup_tokens))
        sync()
        warmup_s = time.perf_counter() - warm
        barrier()
        in_engine, raw = [], []
        for _ in range(repeats):
            eng.llm.reset_prefix_cache()  # no run may reuse the prompts another run cached
            barrier()
            in_engine.append(engine_run(eng, prompts, params, sync))
            eng.llm.reset_prefix_cache()
            barrier()
            raw.append(raw_run(eng.llm, make_sp, raw_ids, raw_kwargs, sync))
    finally:
        eng.ignore_eos = False
        eng.make_sampling_params = make
    return dict(in_engine=in_engine, raw=raw, warmup_s=warmup_s, engine_sampling_kwargs=captured[-1])


def standalone_runs(llm, make_sp, ids: list[list[int]], raw_kwargs: dict, repeats: int, warmup_tokens: int,
                    sync=cuda_sync) -> dict:
    """vLLM alone: one untimed full-shape warm-up, then ``repeats`` timed runs."""
    warm = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in ids], make_sp(**dict(raw_kwargs, max_tokens=warmup_tokens)),
                 use_tqdm=False)
    sync()
    warmup_s = time.perf_counter() - warm
    barrier()
    runs = []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        barrier()
        runs.append(raw_run(llm, make_sp, ids, raw_kwargs, sync))
    return dict(runs=runs, warmup_s=warmup_s)


def summarize(per_rank: list[list[dict]], tp: int, replicated: bool, expected_tokens: int) -> dict:
    """Runs of every rank → one figure per run index (tokens of all engines / the slowest rank's time).

    ``replicated``: each rank of a TP group reports its whole engine's tokens (count each engine
    once); otherwise each rank reports its own share. Median and best over the runs.
    """
    if not per_rank or not per_rank[0]:
        raise ValueError("no timed runs to summarize")
    owners = per_rank[::tp] if replicated else per_rank
    runs = []
    for i in range(len(per_rank[0])):
        tokens = sum(r[i]["tokens"] for r in owners)
        seconds = max(r[i]["seconds"] for r in per_rank)
        runs.append(dict(tokens=tokens, seconds=round(seconds, 3), tok_per_s=round(tokens / seconds),
                         gc_s=round(max(r[i].get("gc_s", 0.0) for r in per_rank), 4)))
    rates = [r["tok_per_s"] for r in runs]
    out = dict(tok_per_s_median=round(statistics.median(rates)), tok_per_s_best=max(rates),
               tok_per_s_per_gpu_median=round(statistics.median(rates) / len(per_rank)),
               seconds_median=round(statistics.median(r["seconds"] for r in runs), 3),
               tokens_as_expected=all(r["tokens"] == expected_tokens for r in runs), expected_tokens=expected_tokens,
               runs=runs)
    if "postprocess_s" in per_rank[0][0]:
        out["postprocess_s_median"] = round(statistics.median(max(r[i]["postprocess_s"] for r in per_rank)
                                                              for i in range(len(runs))), 4)
    return out


def like_for_like(mine: dict, theirs: dict) -> list[str]:
    """Differences between two runs' workload descriptions (empty = comparable)."""
    keys = sorted(set(mine) | set(theirs))
    return [f"{k}: {theirs.get(k)!r} (standalone) vs {mine.get(k)!r} (hybrid)" for k in keys if mine.get(k) != theirs.get(k)]


def workload(args, dist, kwargs: dict, sampling: dict) -> dict:
    """What must be equal between the standalone and the hybrid throughput runs."""
    return dict(device=device_tag(dist.world_size), world_size=dist.world_size, tp=args.tp, prompts=args.prompts, n=args.n,
                prompt_length=args.prompt_length, response_length=args.response_length,
                engine_kwargs=dict(kwargs), sampling_kwargs=dict(sampling))


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


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
    ids = engine_prompt_ids(args, dist.rank)
    raw_kwargs = raw_sampling_kwargs(args, vllm.SamplingParams)
    res = standalone_runs(llm, vllm.SamplingParams, ids, raw_kwargs, args.repeats, args.warmup_tokens)
    per_rank = gather(dict(res, init_s=init_s))
    if dist.is_main:
        expected = args.prompts * args.n * args.response_length * dist.world_size // args.tp
        rec = dict(standalone=summarize([r["runs"] for r in per_rank], args.tp, True, expected),
                   workload=workload(args, dist, kwargs, raw_kwargs), per_rank=per_rank, vllm=vllm.__version__,
                   gpu=torch.cuda.get_device_name(0), commit=commit(),
                   time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        Path(args.standalone_json).write_text(json.dumps(rec, default=str))
        print("STANDALONE " + json.dumps(rec, default=str), flush=True)


def run_hybrid(args, dist) -> None:
    from hybrid_rl.models import load_causal_lm
    from hybrid_rl.weights.sharding_manager import ShardingManager
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

    only = set(args.only)
    first = None

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

    if "parity" in only:
        par, first = cycle(parity, bump=False)
        par_ranks = gather(par)
        rep.write("parity", dict(logprob_diff={k: dict(mean=statistics.mean(r[k]["mean"] for r in par_ranks),
                                                       max=max(r[k]["max"] for r in par_ranks),
                                                       p99=max(r[k]["p99"] for r in par_ranks))
                                              for k in par_ranks[0]},
                                 threshold_mean=2e-2, engine_init_s=round(init_s, 1)), per_rank=par_ranks)

    # ---- push timing (weights unchanged, but a new version forces a full push)
    if "push" in only:
        if first is None:
            first = cycle(bump=False)[1]
        pushes = [first] + [cycle()[1] for _ in range(args.pushes)]
        later = pushes[1:]
        push_fig = dict(first_push_s=round(first["push_s"], 4),
                        push_s_median=round(statistics.median(p["push_s"] for p in later), 4),
                        push_s_all=[round(p["push_s"], 4) for p in later], push_bytes=later[0]["push_bytes"],
                        push_gb_per_s=round(later[0]["push_bytes"] / 1e9 / statistics.median(p["push_s"] for p in later), 2),
                        wake_s_median=round(statistics.median(p["wake_s"] for p in later), 4),
                        sleep_s_median=round(statistics.median(p["sleep_s"] for p in later), 4))
        rep.write("push", push_fig, per_rank=gather(push_fig))
    if "sleep" in only:
        sleep_section(args, rep, sm, cycle, free_before_engine, free_after_engine)
    if "cycles" in only:
        cycles_section(args, rep, cycle)
    if "throughput" in only:
        throughput_section(args, dist, rep, engine, cycle, vllm, kwargs, init_s)
    engine.shutdown()


def sleep_section(args, rep, sm, cycle, free_before_engine, free_after_engine) -> None:
    """Free GPU memory awake vs asleep, for both sleep levels."""
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


def cycles_section(args, rep, cycle) -> None:
    """Free and allocated memory over ``args.cycles`` sleep → wake → push → generate cycles."""
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


def throughput_section(args, dist, rep, engine, cycle, vllm, kwargs, init_s) -> None:
    """In-engine vs the same LLM raw (alternating, after a warm-up), then runs right after a wake, vs standalone."""
    prompts = throughput_prompts(args, dist.rank)
    params = bench_params(args)
    raw_ids = engine_prompt_ids(args, dist.rank)
    raw_kwargs = raw_sampling_kwargs(args, vllm.SamplingParams)
    cycle()  # push and sleep once, so the timed runs below follow a sleep → wake → push, as in training
    thr, _ = cycle(lambda eng: throughput_runs(eng, prompts, raw_ids, params, raw_kwargs, vllm.SamplingParams,
                                               args.repeats, args.warmup_tokens))
    after_wake = []
    for _ in range(args.after_wake_runs):  # sleep → wake → push → generate, no warm-up: what each RL step sees
        def first_batch(eng):
            eng.ignore_eos = True
            try:
                barrier()
                return engine_run(eng, prompts, params)
            finally:
                eng.ignore_eos = False

        after_wake.append(cycle(first_batch)[0])
    thr_ranks = gather(dict(thr, after_wake=after_wake))
    expected = args.prompts * args.n * args.response_length * dist.world_size // args.tp
    in_engine = summarize([r["in_engine"] for r in thr_ranks], args.tp, False, expected)
    raw = summarize([r["raw"] for r in thr_ranks], args.tp, True, expected)
    mine = workload(args, dist, kwargs, raw_kwargs)
    figures = dict(in_engine=in_engine, same_llm_raw=raw,
                   in_engine_over_same_llm=ratio(in_engine["tok_per_s_median"], raw["tok_per_s_median"]),
                   engine_sampling_kwargs_equal_raw=all(r["engine_sampling_kwargs"] == raw_kwargs for r in thr_ranks),
                   sampling_kwargs=raw_kwargs, warmup_tokens=args.warmup_tokens,
                   warmup_s=round(max(r["warmup_s"] for r in thr_ranks), 2), hybrid_engine_init_s=round(init_s, 1))
    if after_wake:
        figures["in_engine_after_wake"] = summarize([r["after_wake"] for r in thr_ranks], args.tp, False, expected)
    sa = json.loads(Path(args.standalone_json).read_text()) if Path(args.standalone_json).exists() else {}
    if "tok_per_s_median" in sa.get("standalone", {}):
        figures["standalone"] = sa["standalone"]
        figures["standalone_init_s"] = round(max(r["init_s"] for r in sa["per_rank"]), 1)
        figures["like_for_like"] = like_for_like(json.loads(json.dumps(mine, default=str)), sa.get("workload", {}))
        figures["in_engine_over_standalone"] = ratio(in_engine["tok_per_s_median"], sa["standalone"]["tok_per_s_median"])
        figures["in_engine_over_standalone_best"] = ratio(in_engine["tok_per_s_best"], sa["standalone"]["tok_per_s_best"])
        figures["target"] = TARGET
        figures["meets_target"] = (figures["in_engine_over_standalone"] >= TARGET and not figures["like_for_like"]
                                   and in_engine["tokens_as_expected"] and sa["standalone"]["tokens_as_expected"])
    else:
        figures["standalone"] = (f"not run: no record of this format at {args.standalone_json} "
                                 "(run with --standalone first)")
    rep.write("throughput", figures, per_rank=thr_ranks)


class _Tok:
    eos_token_id = EOS
    pad_token_id = PAD


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--standalone", action="store_true", help="only the vLLM-alone throughput baseline")
    ap.add_argument("--standalone-json", default="/tmp/hybrid_rl_vllm_standalone.json")
    ap.add_argument("--out", action="append", default=None, help="result folder (repeatable); default runs/vllm/<UTC "
                    "time>/ (benchmarks/publish.py copies a result to benchmarks/results/)")
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
    ap.add_argument("--repeats", type=int, default=3, help="timed throughput runs per mode (median and best reported)")
    ap.add_argument("--warmup-tokens", type=int, default=64,
                    help="tokens per sample of the untimed full-shape warm-up before the timed throughput runs")
    ap.add_argument("--after-wake-runs", type=int, default=1,
                    help="in-engine throughput runs that each follow a sleep → wake → push, without warm-up")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated hybrid sections to run, of {','.join(SECTIONS)} (default: all)")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args(argv)
    args.only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = sorted(set(args.only) - set(SECTIONS))
    if unknown:
        ap.error(f"--only: unknown sections {unknown}; choose from {list(SECTIONS)}")
    if args.repeats < 1 or args.warmup_tokens < 1 or args.after_wake_runs < 0:
        ap.error("--repeats and --warmup-tokens must be >= 1, --after-wake-runs >= 0")
    if args.prompts % args.tp:
        ap.error(f"--prompts {args.prompts} must be divisible by --tp {args.tp}")
    args.out = [str(run_dir("vllm", out)) for out in (args.out or [None])]
    dist = init_distributed("cuda")
    try:
        (run_standalone if args.standalone else run_hybrid)(args, dist)
    finally:
        if tdist.is_initialized():
            tdist.barrier()


if __name__ == "__main__":
    main()
