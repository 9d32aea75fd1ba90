"""Throughput, MFU and memory of a step (``step_perf_means`` and ``step_perf_metrics``, called by the trainer), and
where its time goes (``profiled``: a step under ``torch.profiler``, ``trainer.profile_steps``).

``perf/mfu_update``, ``perf/mfu_log_prob``, ``perf/mfu_ref``: the hardware figure, model FLOPs the pass ran ÷ (its wall
time × GPUs × the device's dense bf16 peak). The engine counts what each forward computed as it lays the micro-batch
out (``Work``): the tokens through the body (with ``actor.share_prompts`` a group's prompt once per micro-batch that
holds it, not once per sample), the (query, key) pairs causal attention computes (a shared prompt with itself, each
response with its prompt's copy and with itself) and the rows the LM head runs on (the positions predicting response
tokens). FLOPs: 2 per parameter of the body's matmuls per token forward, 2 × vocabulary × hidden per LM-head row,
4 × heads × head_dim per attention pair and layer (scores and values). Backward (the update): every matmul's input
gradient (as much as its forward), the weight gradient of the trainable ones only (LoRA: the adapters, not the frozen
base or head), attention twice its forward. Not counted, by the definition of MFU: recomputation (activation
checkpointing, the fused LM head's logits rebuilt in backward, flash attention's scores rebuilt in backward), padding
(the unpacked path's pad positions, and the masked pairs a kernel's tiles compute along the diagonal), elementwise work
(norms, softmax, entropy) and the optimizer.

``perf/mfu_*_equiv``: the throughput-equivalent figure, the FLOPs of every sample's sequence run on its own (each
prompt counted ``rollout.n`` times, the update as 3 forward passes per epoch) over the same time, for comparing runs
by the work the batch stands for whatever sharing or adapters saved. Without sharing or LoRA the two agree (up to
``actor.old_log_prob=auto`` leaving a mini-batch out of the log-prob pass, which the equivalent figure estimates as a
share of rows). The formulas follow the PaLM appendix and verl's flops counter; peaks are dense bf16 tensor-core
figures from the vendors' data sheets.

Left out: MoE routing, multimodal towers, and devices missing from the table (set ``trainer.peak_tflops``).
"""

from __future__ import annotations

import gc
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

import torch

PEAK_TFLOPS_BF16 = {  # dense, no sparsity; matched as substrings of torch.cuda.get_device_name(), first match wins
    "GB200": 2500.0, "B200": 2250.0, "H200": 989.0, "H100": 989.0, "H800": 989.0, "H20": 148.0, "GH200": 989.0,
    "A100": 312.0, "A800": 312.0, "L40S": 362.0, "L40": 181.0, "A10G": 70.0, "L4": 121.0, "MI300X": 1307.0,
    "MI325X": 1307.0,
}


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """The device's dense bf16 peak in FLOP/s (``override_tflops`` wins; None: unknown, MFU is not logged)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS_BF16, key=len, reverse=True):  # longest first: "GH200" before "H200"
        if key in name:
            return PEAK_TFLOPS_BF16[key] * 1e12
    return None


@dataclass
class Work:
    """What forwards computed, summed: fields may be host numbers or device tensors (read once, at the step's end)."""

    tokens: float = 0
    """Positions through the body: each real token of a packed row once (a shared prompt once per micro-batch)."""
    attn_pairs: float = 0
    """(query, key) pairs causal attention computes, per layer and head."""
    head_rows: float = 0
    """Rows the LM head runs on (real positions only)."""

    def add(self, other: "Work") -> "Work":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


@dataclass(frozen=True)
class ModelFlops:
    body_params: int
    """Parameters of the matmuls every token goes through (all but the input embedding and the LM head)."""
    head_params: int
    """vocabulary × hidden: the LM head."""
    attn_width: int
    """layers × heads × head_dim: attention's cost per pair of positions is 4 × this, forward."""
    trainable_body_params: int | None = None
    """The body parameters that take gradients (None: all): backward computes weight gradients for these only."""
    head_trainable: bool = True
    """Whether the LM head's weight takes a gradient (not under LoRA, unless the adapters wrap it)."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelFlops":
        cfg = model.config
        cfg = getattr(cfg, "text_config", None) or cfg
        embed_w = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        head_w = head.weight if head is not None else None
        seen, total, trainable = set(), 0, 0
        for p in model.parameters():  # tied weights counted once; DTensor numel is the global size
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
                if p.requires_grad and p is not embed_w and p is not head_w:
                    trainable += p.numel()
        head_separate = head_w is not None and head_w is not embed_w
        body = total - embed_w.numel() - (head_w.numel() if head_separate else 0)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        head_trainable = bool((head_w if head_w is not None else embed_w).requires_grad)
        return cls(body, cfg.vocab_size * cfg.hidden_size, cfg.num_hidden_layers * cfg.num_attention_heads * head_dim,
                   trainable, head_trainable)

    def forward(self, seq_lengths: torch.Tensor, response_tokens: float) -> float:
        """Forward FLOPs of sequences of ``seq_lengths`` (prompt + response) each run on its own, with the LM head
        over ``response_tokens``: the throughput-equivalent count (``perf/mfu_*_equiv``)."""
        lengths = seq_lengths.double()
        causal_pairs = float((lengths * (lengths + 1) / 2).sum())
        return 2.0 * self.body_params * float(lengths.sum()) + 2.0 * self.head_params * response_tokens \
            + 4.0 * self.attn_width * causal_pairs

    def pass_flops(self, work: Work, backward: bool = False) -> float:
        """FLOPs of a pass that computed ``work``: forward, and with ``backward`` its gradients (see the module's
        docstring for what is counted)."""
        tokens, pairs, rows = float(work.tokens), float(work.attn_pairs), float(work.head_rows)
        fwd = 2.0 * self.body_params * tokens + 2.0 * self.head_params * rows + 4.0 * self.attn_width * pairs
        if not backward:
            return fwd
        trainable = self.body_params if self.trainable_body_params is None else self.trainable_body_params
        bwd = 2.0 * (self.body_params + trainable) * tokens + 8.0 * self.attn_width * pairs \
            + 2.0 * self.head_params * rows * (1 + self.head_trainable)
        return fwd + bwd


UPDATE_FORWARDS = 3.0
"""An update's FLOPs in forward passes, per epoch, in the equivalent count: its forward and a backward of two."""

PASSES = (("perf/mfu_update", "timing/update", "update", UPDATE_FORWARDS),
          ("perf/mfu_log_prob", "timing/old_log_prob", "old_log_prob", 1.0),
          ("perf/mfu_ref", "timing/ref", "ref", 1.0))
"""(metric, the pass's timer, its ``Work`` key, its FLOPs in forward passes in the equivalent count)."""


def pass_mfu(times: dict[str, float], forward_flops: float, peak: float | None, gpus: int,
             ppo_epochs: int = 1, log_prob_share: float = 1.0) -> dict[str, float]:
    """``perf/mfu_*_equiv`` of each timed training pass of a step, from the batch's forward FLOPs (every sequence on
    its own) summed over ``gpus`` ranks.

    ``log_prob_share``: the share of the batch the old-log-prob pass ran on (``actor.old_log_prob=auto`` leaves the
    update's first mini-batch out of it: 1 - ``actor/old_log_prob_skipped``)."""
    if not peak:
        return {}
    out = {}
    for metric, timer, _, passes in PASSES:
        seconds = times.get(timer, 0.0)
        if seconds > 0:
            epochs = ppo_epochs if metric == "perf/mfu_update" else 1
            share = log_prob_share if metric == "perf/mfu_log_prob" else 1.0
            out[metric + "_equiv"] = passes * epochs * share * forward_flops / (seconds * gpus * peak)
    return out


def hardware_mfu(times: dict[str, float], work: dict[str, Work], flops: ModelFlops, peak: float | None,
                 gpus: int) -> dict[str, float]:
    """``perf/mfu_*`` of each timed pass: the FLOPs its forwards (and the update's backward) ran, ``work`` summed over
    ``gpus`` ranks, ÷ (time × gpus × peak)."""
    if not peak:
        return {}
    out = {}
    for metric, timer, key, _ in PASSES:
        seconds = times.get(timer, 0.0)
        if seconds > 0 and key in work:
            out[metric] = flops.pass_flops(work[key], backward=key == "update") / (seconds * gpus * peak)
    return out


def step_perf_means(batch, flops: ModelFlops | None, work: dict[str, Work]) -> dict[str, tuple[float, float]]:
    """This rank's FLOP counts of the step as ``(value, 1)`` pairs (the trainer's mean over ranks, × ranks, is their
    sum): the batch's equivalent forward FLOPs and the ``Work`` of each pass (zeros for a pass that did not run, so
    every rank reduces the same keys)."""
    if flops is None:
        return {}
    t = batch.tensors
    out = {"perf/forward_flops": (flops.forward(t["attention_mask"].sum(1), float(t["response_mask"].sum())), 1.0)}
    for _, _, key, _ in PASSES:
        w = work.get(key, Work())
        out.update({f"perf/work/{key}/{f.name}": (float(getattr(w, f.name)), 1.0) for f in fields(Work)})
    return out


def step_perf_metrics(out: dict[str, float], world: int, gpus_all: int, flops: ModelFlops | None,
                      peak: float | None, ppo_epochs: int, device: torch.device, rollout=None,
                      memory_peaks: tuple[int, int] = (0, 0)) -> None:
    """Turn the reduced step metrics ``out`` (means over the ``world`` training ranks) into throughput, MFU and
    memory, in place. ``gpus_all``: every rank of the run (``perf/throughput_per_gpu``); ``rollout``: this rank's
    engine (its pool is left out of ``perf/max_memory_allocated_outside_engine_gb``); ``memory_peaks``: the step's
    (allocated, reserved) peaks up to its last phase boundary (``tracking.Timer``, which resets torch's counters).

    ``perf/gen_tokens_per_s``: the tokens the engines generated ÷ ``timing/gen`` (the slowest rank's generate time).
    Whole-batch generation generates exactly the batch's responses; under partial rollouts the batch holds tokens of
    earlier rounds, so the count is ``rollout/partial_gen_tokens``, the tokens sampled in the rounds finished since the
    previous batch was taken, and ``timing/gen`` those rounds' generate time."""
    total_tokens = out.pop("perf/total_tokens") * world
    response_tokens = out.pop("perf/response_tokens") * world
    out["perf/tokens_per_s"] = total_tokens / max(out["timing/step"], 1e-9)
    generated = out.get("rollout/partial_gen_tokens", response_tokens)
    out["perf/gen_tokens_per_s"] = generated / max(out["timing/gen"], 1e-9)
    out["perf/throughput_per_gpu"] = out["perf/tokens_per_s"] / gpus_all
    if "perf/forward_flops" in out:
        forward = out.pop("perf/forward_flops") * world
        work = {key: Work(*(out.pop(f"perf/work/{key}/{f.name}") * world for f in fields(Work)))
                for _, _, key, _ in PASSES}
        out.update(hardware_mfu(out, work, flops, peak, world))
        out.update(pass_mfu(out, forward, peak, world, ppo_epochs, 1.0 - out.get("actor/old_log_prob_skipped", 0.0)))
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = max(memory_peaks[0], torch.cuda.max_memory_allocated(device)) / 2**30
        out["perf/max_memory_reserved_gb"] = max(memory_peaks[1], torch.cuda.max_memory_reserved(device)) / 2**30
        # both count the engine's pool (allocated once, constant) even while it sleeps: the rest's own peak
        pool = (rollout.pool_bytes() if rollout is not None else 0) / 2**30
        out["perf/engine_pool_gb"] = pool
        out["perf/max_memory_allocated_outside_engine_gb"] = out["perf/max_memory_allocated_gb"] - pool
        torch.cuda.reset_peak_memory_stats(device)


HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::nonzero",
              "aten::_local_scalar_dense")
"""Profiler rows where the host waits for the GPU: explicit syncs, and the ops that read a device value back
(boolean indexing's ``nonzero``, ``.item()`` / ``int()``). Each one drains the queue and leaves the GPU idle while the
host prepares the next kernels."""


def host_wait_summary(averages) -> str:
    """One line for a profile table (``prof.key_averages()``): count and host time of every ``HOST_WAITS`` row."""
    rows = {e.key: e for e in averages if e.key in HOST_WAITS}
    parts = [f"{k} {rows[k].count} calls {rows[k].cpu_time_total / 1e3:.0f} ms" for k in HOST_WAITS if k in rows]
    return "host waits for the device: " + ("; ".join(parts) if parts else "none recorded")


@contextmanager
def profiled(out: Path, label: str, cuda: bool) -> Iterator[None]:
    """The block under ``torch.profiler`` (``trainer.profile_steps``): ``out`` gets ``label``, the host's waits for
    the device, and the top ops by CUDA time (``cuda``) and by CPU time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        yield
    out.parent.mkdir(parents=True, exist_ok=True)
    table = prof.key_averages()
    parts = [label, host_wait_summary(table)]
    if cuda:
        parts.append(table.table(sort_by="cuda_time_total", row_limit=30))
    parts.append(table.table(sort_by="cpu_time_total", row_limit=30))
    out.write_text("\n\n".join(parts))
    # The profiler's events are cyclic garbage (millions of objects for a 7B update): collected here, in the profiled
    # step after the table is written, rather than by whichever later phase next runs a full collection (vLLM's
    # sleep calls gc.collect(), which then took seconds of the next switch)
    del table, prof
    gc.collect()


@contextmanager
def watched_step(cfg, step: int, rank: int, device) -> Iterator[None]:
    """One training step as ``trainer.profile_steps`` and ``trainer.stall_dump_s`` ask: under torch.profiler,
    summarised per rank into ``<output_dir>/profile/`` (where the time goes), and with every thread's stack printed
    if it takes longer than the stall limit."""
    from hybrid_rl.watchdog import StallWatchdog

    t = cfg.trainer
    stall = t.stall_dump_s
    out = Path(t.output_dir) / "profile" / f"step_{step}_rank{rank}.txt"
    whole = step in t.profile_steps and not t.profile_phases
    with StallWatchdog(stall, label=f"step {step}") if stall > 0 else nullcontext():
        with profiled(out, f"step {step}, rank {rank}", device.type == "cuda") if whole else nullcontext():
            with profiled_phases(t.profile_phases if step in t.profile_steps else [], out, step, rank, device):
                yield


@contextmanager
def profiled_phases(names: list[str], out: Path, step: int, rank: int, device) -> Iterator[None]:
    """Each timed phase in ``names`` under ``profiled`` wherever it runs in the block, into ``<out's stem>_<phase>``
    (a phase that runs more than once: its last run); a phase that did not run is one warning line."""
    from hybrid_rl.telemetry import tracking

    ran: set[str] = set()

    def hook(name: str):
        def enter():
            ran.add(name)
            return profiled(out.with_name(f"{out.stem}_{name}.txt"), f"step {step}, rank {rank}, phase {name}",
                            device.type == "cuda")
        return enter

    tracking.phase_hooks.update({name: hook(name) for name in names})
    try:
        yield
    finally:
        for name in names:
            tracking.phase_hooks.pop(name, None)
        missing = [n for n in names if n not in ran]
        if missing and rank == 0:
            print(f"hybrid_rl: warning: trainer.profile_phases: {', '.join(missing)} did not run in step {step}",
                  file=sys.stderr, flush=True)
