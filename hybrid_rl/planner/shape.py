"""A decoder's shape, read without building a model: a built-in's table, or a local ``config.json``.

Only what the memory model needs: hidden size, MLP width, layers, key/value width, vocabulary, tied embeddings; and
the positions the model was built for (``max_position_embeddings``), which the preflight holds the sequence length to.
A hub id is read only from a local directory or the local Hugging Face cache (never downloaded): planning is
offline and instant. The Qwen2.5 models the recipes name (``HUB_SHAPES``) are planned from their published shapes when
they are not here yet; any other model that is not here gets one line saying so.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path


class ShapeError(ValueError):
    """``model.path`` names nothing whose shape can be read here; the message says what to do."""


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    positions: int | None = None
    """``max_position_embeddings``: the longest sequence the model was built for (None: its config does not say)."""
    head_dim: int | None = None
    """The config's ``head_dim`` where it gives one (Qwen3's differs from ``hidden / heads``); None: that ratio."""

    @property
    def head_size(self) -> int:
        """Width of one attention head: ``head_dim``, or ``hidden / heads``."""
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of the query projection (and the output projection's input): ``heads × head_size``."""
        return self.heads * self.head_size

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: ``kv_heads × head_size``."""
        return self.kv_heads * self.head_size

    @property
    def layer_params(self) -> int:
        """One Qwen2/Llama block: q and o (h × q), k and v (h × kv), their biases (Qwen2's q/k/v), the gated MLP
        (3·h·I), two RMSNorm weights."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        return 2 * h * q + 2 * h * kv + (q + 2 * kv) + 3 * h * self.intermediate + 2 * h

    @property
    def embedding_params(self) -> int:
        """Token embedding, plus the LM head when it is not tied to it."""
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.hidden  # + the final norm

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Adapter parameters: ``rank × (in + out)`` for each targeted projection of each block."""
        h, kv, i = self.hidden, self.kv_dim, self.intermediate
        dims = {"q_proj": (h, self.q_dim), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (self.q_dim, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return self.layers * sum(rank * sum(dims[t]) for t in targets if t in dims)


def _tiny_vocab() -> int:
    """The tiny model's character-level vocabulary (``models.build_tiny_tokenizer``): 3 special tokens + the
    distinct byte-level characters of ``string.printable``."""
    from hybrid_rl.models import _byte_level_char

    return 3 + len({_byte_level_char(ord(c)) for c in string.printable})


# SmolLM2-135M's published architecture (the GGUF built-in is converted from it at first use)
_SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192)


HUB_SHAPES: dict[str, str] = {
    f"Qwen/Qwen2.5-{size}{suffix}": f"qwen2.5-{size.lower()}-random"
    for size in ("0.5B", "1.5B", "7B") for suffix in ("", "-Instruct")
}
"""Hub ids whose published shape a random-weight built-in copies exactly (``models.RANDOM_ARCHS``): what the
planner reads for them when no config.json is here."""


def from_hf_config(cfg: dict) -> ModelShape:
    """The fields of a Hugging Face ``config.json`` (``text_config`` for multimodal wrappers)."""
    cfg = cfg.get("text_config", cfg)
    try:
        return ModelShape(hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"],
                          layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"],
                          kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                          vocab=cfg["vocab_size"], tied=bool(cfg.get("tie_word_embeddings", False)),
                          positions=cfg.get("max_position_embeddings"), head_dim=cfg.get("head_dim"))
    except KeyError as e:
        raise ShapeError(f"config.json has no {e.args[0]}: not a decoder-only transformer the planner knows") from None


def builtin_shape(name: str) -> ModelShape:
    from hybrid_rl.models import BUILTIN_NAMES, BUILTIN_PREFIX, RANDOM_ARCHS, TINY_CONFIG, TINY_MODEL, TINY_RM

    if name in (TINY_MODEL, TINY_RM):  # the reward model: the same network, a score head for the LM head
        return from_hf_config(dict(TINY_CONFIG, vocab_size=_tiny_vocab()))
    if name in RANDOM_ARCHS:
        return from_hf_config(RANDOM_ARCHS[name])
    if name == "smollm2-135m-instruct":
        return from_hf_config(_SMOLLM2_135M)
    raise ShapeError(f"model.path: unknown built-in model {name!r}; choose one of "
                     f"{[BUILTIN_PREFIX + k for k in BUILTIN_NAMES]}")


def _local_config(path: str) -> Path | None:
    """``config.json`` of a local directory, or of a hub id's newest snapshot in the local Hugging Face cache."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p / "config.json" if (p / "config.json").is_file() else None
    if path.count("/") != 1 or p.exists():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(path, "config.json")
    return Path(found) if isinstance(found, str) else None


def read_shape(path: str) -> ModelShape:
    """The shape of ``model.path``: a ``builtin:NAME``, a local directory, or a hub id cached here."""
    from hybrid_rl.models import BUILTIN_PREFIX

    if path.startswith(BUILTIN_PREFIX):
        return builtin_shape(path[len(BUILTIN_PREFIX):])
    config = _local_config(path)
    if config is None and path in HUB_SHAPES:
        return builtin_shape(HUB_SHAPES[path])
    if config is None:
        raise ShapeError(f"model.path={path!r}: no config.json here (not a local directory, not in the local Hugging "
                         f"Face cache); download the model first or point model.path at a local copy")
    try:
        return from_hf_config(json.loads(config.read_text()))
    except (OSError, ValueError) as e:
        if isinstance(e, ShapeError):
            raise
        raise ShapeError(f"model.path={path!r}: cannot read {config}: {e}") from None
