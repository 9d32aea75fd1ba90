"""The ``model`` and ``data`` sections: what is trained and on which prompts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from hybrid_rl.config.errors import ConfigError, require_positive
from hybrid_rl.config.fields import harmless
from hybrid_rl.data.arith import ArithConfig
from hybrid_rl.data.arith import check_config as check_arith


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank; 0 trains the full model."""
    alpha: int = 16
    """LoRA scaling numerator (scale = alpha / rank)."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Module names that get adapters."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    base_dtype: Literal["float32", "compute"] = harmless("float32")
    """The frozen base's storage in the actor: ``float32`` (as the trained parameters, verl's way) or ``compute``
    (``model.dtype``, bf16 on GPUs: half the bytes). The same update either way: every pass casts the base to the
    compute dtype, and the push sends it in the engine's."""


@dataclass
class ModelConfig:
    path: str = "builtin:tiny-qwen2"
    """Hub id, local directory, or ``builtin:tiny-qwen2`` (built locally, no download)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer location when it differs from ``path``."""
    chat_template: Optional[str] = None
    """A chat template replacing the tokenizer's: Jinja text, or the path of a file holding it (``.jinja``,
    ``.j2``, ``.txt``). For a base model without one, or a prompt format of your own, e.g. R1-Zero's
    ``"A conversation between User and Assistant. User: {{ messages[-1]['content'] }} Assistant: <think>"``.
    Prompts, multi-turn observations and the exported tokenizer use it."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Training/inference dtype; ``auto`` is bf16 on GPU and fp32 on CPU."""
    enable_gradient_checkpointing: bool = harmless(False)
    """Recompute activations in the backward pass (≈ half the activation memory)."""
    use_liger: bool = harmless(False)
    """Liger-Kernel's fused Triton kernels (RMSNorm, SwiGLU, rotary embeddings) in the actor, the reference and the
    critic (``hybrid_rl/liger.py``); CUDA only, needs ``pip install 'hybrid_rl[liger]'``. Same math, fewer kernels."""
    trust_remote_code: bool = harmless(False)
    """Passed to ``from_pretrained``."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters via peft."""

    def validate(self) -> None:
        if self.lora.rank < 0:
            raise ConfigError("model.lora.rank must be >= 0 (0 = full fine-tuning)")


@dataclass
class DataConfig:
    train_path: str | list[str] = "synthetic:successor"
    """A local .jsonl/.parquet file, a ``datasets`` hub name (e.g. ``openai/gsm8k``), or ``synthetic:<task>``; or a
    list of files and hub names, whose rows are read in order (a row without a ``data_source`` field takes its
    file's name, so validation reports each file)."""
    val_path: Optional[str | list[str]] = harmless(None)
    """Validation prompts, same forms as ``train_path`` (a list: several test sets, each reported as
    ``val/reward_mean/<name>``); none skips validation."""
    task: Literal["gsm8k", "successor", "arith", "lookup", "mul3", "math", "code", "chat"] = "successor"
    """How rows become chat prompts and ground truths (``arith``: arithmetic with a held-out test set; ``lookup``:
    a digit only a tool reveals; ``mul3``: three-digit products with a held-out test set; ``math``: ``problem`` and
    ``answer`` (or a ``solution`` with a ``\\boxed{}`` answer), LaTeX answers; ``code``: a problem and its tests,
    assertions or input/output cases, run in a sandbox; ``chat``: prompts alone, ``messages`` or ``prompt`` per row,
    for a reward model). ``gsm8k``, ``math``, ``code`` and ``chat`` also read verl's parquet rows (``prompt``,
    ``reward_model.ground_truth``, ``data_source``, ``extra_info``) as they are."""
    hub_config: Optional[str] = None
    """``datasets`` config name for hub datasets (``main`` for openai/gsm8k)."""
    train_split: str = "train"
    """Split name for hub datasets."""
    val_split: str = harmless("test")
    """Split name for hub datasets."""
    max_val_samples: int = harmless(256)
    """Cap on validation prompts (0 = all), the first ones of each ``val_path`` entry."""
    val_batch_size: Optional[int] = harmless(None)
    """Validation prompts per generate call on each rank (default: ``data.train_batch_size``). A large value lets
    vLLM schedule the whole validation set at once (the engine still caps concurrency at ``rollout.max_num_seqs``)."""
    train_batch_size: int = 32
    """Prompts per step, across all ranks."""
    max_prompt_length: int = 512
    """Prompt tokens after the chat template."""
    max_response_length: int = 256
    """Maximum new tokens per response."""
    truncation: Literal["error", "filter", "left", "right"] = "filter"
    """What to do with prompts longer than ``max_prompt_length``."""
    shuffle: bool = True
    """Reshuffle the prompts each epoch (seeded)."""
    system_prompt: Optional[str] = None
    """Optional system message prepended to every prompt."""
    num_synthetic: int = 2048
    """Rows generated for ``synthetic:<task>`` training data (validation: the task's held-out test set where it has
    one, otherwise a quarter as many rows with another seed)."""
    arith: ArithConfig = field(default_factory=ArithConfig)
    """The ``arith`` task's problems: families, digits, list length, test set size."""


    def validate(self) -> None:
        require_positive(self, "data", ["train_batch_size", "max_prompt_length", "max_response_length"])
        if self.val_batch_size is not None and self.val_batch_size < 1:
            raise ConfigError(f"data.val_batch_size={self.val_batch_size} must be a positive number of prompts (or null "
                              "for data.train_batch_size)")
        for key in ("train_path", "val_path"):
            value = getattr(self, key)
            if isinstance(value, list) and (not value or any(p.startswith("synthetic:") for p in value)):
                raise ConfigError(f"data.{key}={value}: a list takes one or more files or hub datasets "
                                  f"(synthetic:<task> stands alone); give files, or one path")
        if (isinstance(self.train_path, str) and self.train_path.startswith("synthetic:")
                and self.train_path.split(":", 1)[1] != self.task):
            raise ConfigError(f"data.train_path={self.train_path} is a synthetic task but data.task={self.task}; set "
                              f"data.task to the synthetic task's name")
        try:
            check_arith(self.arith)
        except ValueError as e:
            raise ConfigError(str(e)) from None
