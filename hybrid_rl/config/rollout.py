"""The ``rollout`` section: which engine generates, how it samples, and each engine's own options."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from hybrid_rl.config.errors import ConfigError, require_positive
from hybrid_rl.config.fields import harmless
from hybrid_rl.rollout import EngineMemory
from hybrid_rl.rollout.vllm_options import VLLMOptions


@dataclass
class RolloutConfig:
    name: str = "hf"
    """Rollout engine registered in ``hybrid_rl.rollout.ROLLOUT_ENGINES``: ``hf`` (transformers, anywhere) or ``vllm`` (GPU)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """The engine's weight dtype (the push casts the actor's weights to it): ``auto`` = ``model.dtype``, except that
    vLLM runs a float32 model in bfloat16 (vLLM 0.26's float32 generate crashes on H200)."""
    n: int = 8
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are computed at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    val_temperature: float = harmless(0.0)
    """Temperature for validation (0 = greedy pass@1)."""
    val_n: int = harmless(1)
    """Samples per validation prompt: ``val/reward_mean`` is then their mean (mean@n), ``val/reward_best_of_n``
    the mean over prompts of each one's best score (best@n) and, where the task reads final answers (gsm8k, math,
    arith), ``val/reward_maj_of_n`` the score of each prompt's most frequent answer (maj@n); more than 1 needs
    ``val_temperature`` > 0."""
    max_num_seqs: int = harmless(256)
    """Sequences generated at once by the engine (the hf engine chunks by this)."""
    weight_sync_bucket_mb: int = harmless(512)
    """Bucket size for pushing weights into the engine."""
    weight_load_replay: bool = harmless(True)
    """Record where the engine's ``load_weights`` copies each tensor on the first push and replay later pushes
    as one fused copy per bucket (falls back to the real loader whenever the recording is not a plain copy)."""
    free_cache_engine: bool = harmless(True)
    """Put the engine to sleep between rollouts (frees its memory for training)."""
    forced_lengths: Optional[str] = None
    """Benchmarks only: ignore EOS and draw response lengths from ``lognormal:MEAN:SIGMA`` or ``fixed:N`` (capped at max_response_length)."""
    sleep_level: Literal[1, 2] = harmless(1)
    """Engine sleep depth: 1 offloads its weights to CPU, 2 discards them (re-pushed on wake)."""
    cuda_stream: Literal["shared", "own", "high"] = harmless("shared")
    """Which CUDA stream generation runs on (``hybrid_rl.rollout.base.GenerationStream``): ``shared``, the calling
    thread's, which in overlap mode colocated is the trainer's too (vLLM 0.26's runner caches one stream), so the two
    never run kernels at the same time;
    ``own``, a stream of the engine's own; ``high``, that at the highest priority. Matters in overlap mode with
    colocated placement. On SmolLM2-135M (1xH200, overlap) ``high`` is no faster than ``shared``: median step 1.44
    against 1.37 s (``benchmarks/results/learning_smollm2_H200x1_overlong.json``); other models and lengths are not
    measured."""
    logprobs: Literal["always", "auto"] = harmless("always")
    """The engine's log-prob of every sampled token (``rollout_log_probs``): ``always`` (the metrics
    ``rollout/logprob_diff`` and ``is_ratio_*``, the engine's numerics against the trainer's, every step); ``auto``
    only where training reads them (overlap mode, ``algorithm.rollout_correction.apply=always``,
    ``actor.old_log_prob=engine``, a policy loss other than ``ppo``/``gspo``, a multi-turn environment), so that a
    synchronous run's engine neither computes nor returns them, as verl's ``rollout.calculate_log_probs=false``.
    Validation never asks for them."""
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    """The vLLM engine's own options (``hybrid_rl/rollout/vllm_options.py``)."""

    def validate(self) -> None:
        require_positive(self, "rollout", ["n", "val_n", "max_num_seqs", "weight_sync_bucket_mb"])
        if self.val_n > 1 and self.val_temperature == 0:
            raise ConfigError(f"rollout.val_n={self.val_n} samples per validation prompt at rollout.val_temperature=0 "
                              f"would all be the same greedy response; set rollout.val_temperature > 0 (e.g. 0.6) or "
                              f"rollout.val_n=1")
        if self.forced_lengths is not None:
            parse_forced_lengths(self.forced_lengths)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature={self.temperature} must be > 0 for training rollouts; "
                              "use rollout.val_temperature=0 for greedy validation")

    def engine_options(self) -> dict[str, object]:
        """Each engine's options section by its ``rollout.name`` (the sections of this one)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if dataclasses.is_dataclass(getattr(self, f.name))}

    def engine_memory(self) -> EngineMemory:
        """The GPU memory the engine ``name`` picks takes, as its options section says (``EngineMemory()`` for an
        engine without one)."""
        options = self.engine_options().get(self.name)
        return options.memory() if options is not None else EngineMemory()


def parse_forced_lengths(spec: str) -> tuple[str, list[float]]:
    """``lognormal:MEAN:SIGMA`` or ``fixed:N`` → (kind, numbers); ConfigError naming the key otherwise."""
    kind, _, rest = spec.partition(":")
    try:
        nums = [float(x) for x in rest.split(":")] if rest else []
    except ValueError:
        nums = []
    if (kind, len(nums)) not in (("lognormal", 2), ("fixed", 1)) or any(x <= 0 for x in nums):
        raise ConfigError(f"rollout.forced_lengths={spec!r} must be 'lognormal:MEAN:SIGMA' or 'fixed:N' with positive numbers")
    return kind, nums
