"""Model FLOPs of the training passes and the device's peak, for ``perf/mfu_update`` and ``perf/mfu_log_prob``.

MFU here is the FLOPs the math needs divided by what the GPUs could have done in the pass's wall time: a dense
decoder's matmuls (2 FLOPs per parameter per token forward, 6 forward + backward), causal self-attention
(scores and values: 4 · heads · head_dim per pair of positions forward, counted over each sequence's own
length) and the LM head for the response tokens only (the prompt's logits are never computed). Activation
checkpointing's recompute and padding are not counted: they are what MFU exposes. The formulas follow the
PaLM appendix and verl's flops counter; peaks are dense bf16 tensor-core figures from the vendors' data sheets.

Left out: MoE routing, multimodal towers, and devices missing from the table (set ``trainer.peak_tflops``).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class ModelFlops:
    body_params: int
    """Parameters of the matmuls every token goes through (all but the input embedding and the LM head)."""
    head_params: int
    """vocabulary × hidden: the LM head, applied to response tokens only."""
    attn_width: int
    """layers × heads × head_dim: attention's cost per pair of positions is 4 × this, forward."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelFlops":
        cfg = model.config
        cfg = getattr(cfg, "text_config", None) or cfg
        seen, total = set(), 0
        for p in model.parameters():  # tied weights counted once; DTensor numel is the global size
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        embed = model.get_input_embeddings().weight.numel()
        head = model.get_output_embeddings()
        head_separate = head is not None and head.weight is not model.get_input_embeddings().weight
        head_params = cfg.vocab_size * cfg.hidden_size
        body = total - embed - (head.weight.numel() if head_separate else 0)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(body, head_params, cfg.num_hidden_layers * cfg.num_attention_heads * head_dim)

    def forward(self, seq_lengths: torch.Tensor, response_tokens: float) -> float:
        """Forward FLOPs of a pass over sequences of ``seq_lengths`` (prompt + response) with ``response_tokens``."""
        lengths = seq_lengths.double()
        causal_pairs = float((lengths * (lengths + 1) / 2).sum())
        return 2.0 * self.body_params * float(lengths.sum()) + 2.0 * self.head_params * response_tokens \
            + 4.0 * self.attn_width * causal_pairs


PASSES = (("perf/mfu_update", "timing/update", 3.0), ("perf/mfu_log_prob", "timing/old_log_prob", 1.0),
          ("perf/mfu_ref", "timing/ref", 1.0))
"""(metric, the pass's timer, its FLOPs in forward passes: backward costs two)."""


def pass_mfu(times: dict[str, float], forward_flops: float, peak: float | None, gpus: int,
             ppo_epochs: int = 1, log_prob_share: float = 1.0) -> dict[str, float]:
    """MFU of each timed training pass of a step, from the batch's forward FLOPs summed over ``gpus`` ranks.

    ``log_prob_share``: the share of the batch the old-log-prob pass ran on (``actor.old_log_prob=auto`` leaves the
    update's first mini-batch out of it: 1 - ``actor/old_log_prob_skipped``)."""
    if not peak:
        return {}
    out = {}
    for metric, timer, passes in PASSES:
        seconds = times.get(timer, 0.0)
        if seconds > 0:
            epochs = ppo_epochs if metric == "perf/mfu_update" else 1
            share = log_prob_share if metric == "perf/mfu_log_prob" else 1.0
            out[metric] = passes * epochs * share * forward_flops / (seconds * gpus * peak)
    return out


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
