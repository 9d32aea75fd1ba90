"""``VLLMOptions``: the vLLM engine's own keys, the ``rollout.vllm`` section, the checks the engine owns, the GPU memory
they make it take (``memory``, for the planner), and the former names of its keys (``MOVED_KEYS``, ``REMOVED_KEYS``).

Importable without vLLM (and without torch): the config tree holds this section whichever engine ``rollout.name``
picks, and validation calls ``validate``. Errors are ``ValueError``s naming the dotted key; the config turns them
into ``ConfigError``s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from hybrid_rl.rollout import EngineMemory

if TYPE_CHECKING:
    from hybrid_rl.config import Config
    from hybrid_rl.planner.shape import ModelShape

HARMLESS = {"resume": "harmless"}
"""A field a resume may change, as ``hybrid_rl.config.fields.harmless`` marks it (spelt out: the config package
imports this module, so this module cannot import it)."""


@dataclass
class VLLMOptions:
    gpu_memory_utilization: float = field(default=0.5, metadata=HARMLESS)
    """Fraction of GPU memory the engine may take (weights + KV cache)."""
    tensor_parallel_size: int = 1
    """GPUs per engine; ranks form data-parallel groups of this size."""
    max_num_batched_tokens: int = field(default=8192, metadata=HARMLESS)
    """Tokens per scheduler step."""
    max_model_len: Optional[int] = field(default=None, metadata=HARMLESS)
    """Context length (default: max_prompt_length + max_response_length)."""
    enforce_eager: bool = field(default=False, metadata=HARMLESS)
    """Skip CUDA graphs (faster start, slower decode)."""
    enable_prefix_caching: bool = field(default=True, metadata=HARMLESS)
    """Reuse KV for shared prompt prefixes (the n samples of a prompt)."""
    engine_process: bool = field(default=False, metadata=HARMLESS)
    """Run the engine core (scheduler and model runner) in a process of its own on this rank's GPU, instead of
    in the trainer's process (vLLM's multiprocessing front end, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``). In overlap
    mode the trainer then no longer shares one Python interpreter with the engine: on SmolLM2-135M the trainer's
    passes run 2.3-5x slower beside an in-process engine thread. Weights are pushed as CUDA IPC handles (no copy
    through the host); the engine's own memory is not in this process's ``perf/`` figures. Needs
    ``tensor_parallel_size=1`` and ``rollout.cuda_stream=shared``; costs a second CUDA context (~0.5 GB) per GPU."""
    fit_kv_cache: bool = field(default=True, metadata=HARMLESS)
    """Size the KV cache to the most the engine can hold at once, ``max_num_seqs`` sequences of ``max_model_len``
    tokens (vLLM's ``kv_cache_memory_bytes``), when that is under half of what ``gpu_memory_utilization``'s share
    leaves beside the weights; otherwise vLLM fills the share. A small model in a large share would otherwise get
    millions of KV blocks, which vLLM builds at start-up and walks one by one in Python at every prefix-cache reset
    (after each weight push), and the rest of the share would sit idle instead of serving the trainer. The estimate
    counts full attention in every layer (a Qwen2/Llama-style decoder); set false for a model with other state per
    sequence (e.g. Mamba layers), where vLLM refuses a cache too small to hold one sequence."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """More keyword arguments for ``vllm.LLM(...)`` (e.g. ``swap_space``, ``quantization``), given over the ones built
    from this tree (as verl's ``engine_kwargs.vllm``); unchecked, passed as they are. An fp8 KV cache
    (``rollout.vllm.engine_kwargs.kv_cache_dtype=fp8``: half the KV memory and reads, scales of 1.0 since the weights
    arrive after start-up) widens the gap between the engine's log-probs and the trainer's that the decoupled loss
    corrects: 0.040 on average against ~0.014 with a bf16 cache (1xH200,
    ``benchmarks/results/gpu_tests_H200x1_fp8kv_partial.json``); ``rollout/logprob_diff`` shows it per step."""

    def memory(self) -> EngineMemory:
        """The planner's view: vLLM reserves ``gpu_memory_utilization`` of each GPU, its weights split over
        ``tensor_parallel_size`` of them, unless ``fitted_kv_cache_bytes`` sizes its KV cache instead."""
        return EngineMemory(gpu_share=self.gpu_memory_utilization, gpu_share_key="rollout.vllm.gpu_memory_utilization",
                            tensor_parallel=self.tensor_parallel_size, fitted_kv_bytes=self.fitted_kv_cache_bytes)

    def fitted_kv_cache_bytes(self, cfg: "Config", shape: "ModelShape", gpu_bytes: float) -> Optional[int]:
        """The KV cache ``fit_kv_cache`` gives one GPU of an engine of ``shape`` (bytes), or None where vLLM sizes
        it to its share: ``max_num_seqs`` sequences of ``max_model_len`` tokens, each rounded up by 256 tokens (vLLM
        allocates whole blocks), over every layer's keys and values in 16-bit (an fp8 cache passed through
        ``engine_kwargs`` needs half), with the key/value heads split over ``tensor_parallel_size``."""
        if not self.fit_kv_cache:
            return None
        tp = self.tensor_parallel_size
        full = self.max_model_len or (cfg.data.max_prompt_length + cfg.data.max_response_length)
        per_token = shape.layers * 2 * max(1, shape.kv_heads // tp) * shape.head_size * 2
        need = cfg.rollout.max_num_seqs * (full + 256) * per_token
        room = self.gpu_memory_utilization * gpu_bytes - shape.params * 2 / tp
        return need if need <= room / 2 else None

    def validate(self, cfg: "Config", world_size: int, in_use: bool) -> None:
        """These keys, and the rest of ``cfg`` as vLLM needs it when ``in_use`` (``rollout.name`` picks vLLM); otherwise
        only that the keys which change nothing but vLLM's behaviour are off. ``world_size``: all ranks."""
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError(f"rollout.vllm.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1); "
                             "0.3-0.6 leaves room for training")
        tp, r, t = self.tensor_parallel_size, cfg.rollout, cfg.trainer
        if tp < 1 or world_size % tp:
            raise ValueError(f"rollout.vllm.tensor_parallel_size={tp} must divide the {world_size} ranks")
        if not in_use:
            self._validate_unused(r.name)
            return
        if r.dtype == "float32":
            raise ValueError("rollout.dtype=float32 with rollout.name=vllm: vLLM 0.26's float32 generate crashes after "
                             "its first sleep/wake (CUDA illegal memory access, on H200); use rollout.dtype=auto (a "
                             "bfloat16 engine, the actor keeps model.dtype) or rollout.name=hf")
        d = cfg.data
        full = d.max_prompt_length + d.max_response_length
        if self.max_model_len is not None and self.max_model_len < full:
            raise ValueError(f"rollout.vllm.max_model_len={self.max_model_len} is shorter than data.max_prompt_length + "
                             f"data.max_response_length = {d.max_prompt_length} + {d.max_response_length} = {full}: "
                             f"the engine could not hold one prompt with its response; raise rollout.vllm.max_model_len "
                             f"to at least {full} (or leave it unset: the sum), or lower data.max_response_length")
        if t.placement == "split" and cfg.split_layout(world_size)[0] % tp:
            raise ValueError(f"rollout.vllm.tensor_parallel_size={tp} must divide the {cfg.split_layout(world_size)[0]} "
                             f"rollout ranks")
        if self.engine_process and tp != 1:
            raise ValueError(f"rollout.vllm.engine_process=true needs rollout.vllm.tensor_parallel_size=1 (got {tp}): one "
                             f"engine process per GPU; set rollout.vllm.engine_process=false")
        if self.engine_process and r.cuda_stream != "shared":
            raise ValueError(f"rollout.cuda_stream={r.cuda_stream} with rollout.vllm.engine_process=true: the engine "
                             f"runs on its own streams in its own process; set rollout.cuda_stream=shared")
        if t.partial_rollouts and tp > 1:
            raise ValueError(f"trainer.partial_rollouts=true with rollout.name=vllm needs rollout.vllm.tensor_parallel_"
                             f"size=1 (got {tp}): the ranks of one engine cannot agree on an interrupt yet; set "
                             "trainer.partial_rollouts=false")

    def _validate_unused(self, engine: str) -> None:
        """Another engine generates: a key that would only change what vLLM does is an error where it is set."""
        if self.engine_process:
            raise ValueError(f"rollout.vllm.engine_process=true is for rollout.name=vllm (got {engine!r}); set "
                             f"rollout.vllm.engine_process=false")


MOVED_KEYS = {**{f"rollout.{f.name}": f"rollout.vllm.{f.name}" for f in dataclasses.fields(VLLMOptions)
                 if f.name != "engine_kwargs"},
              **{k: "rollout.vllm.engine_kwargs.kv_cache_dtype" for k in ("rollout.kv_cache_dtype",
                                                                          "rollout.vllm.kv_cache_dtype")}}
"""Keys that once sat directly under ``rollout`` and are now vLLM's own, or vLLM options now passed through
``rollout.vllm.engine_kwargs`` (a recipe naming the old key is told the new one; a checkpoint's saved config is read
under the new one; ``hybrid_rl.config.moved`` gathers them)."""

REMOVED_KEYS = {k: "removed: a round after a weight push prefills its carried samples' context again under the new "
                   "weights; delete the key" for k in ("rollout.reuse_stale_kv", "rollout.vllm.reuse_stale_kv")}
"""vLLM keys that no longer exist, with what to do instead."""
