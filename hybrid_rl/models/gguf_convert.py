"""A built-in's GGUF file converted into an ordinary Hugging Face directory (``builtin:smollm2-135m-instruct``).

transformers' GGUF loader (which needs the ``gguf`` package: ``pip install hybrid_rl[real-model]``) dequantises
the file that ``gguf_fetch`` provides. ``save_pretrained`` refuses a GGUF-loaded model, so the quantizer and
``config.quantization_config`` are dropped first; the result is an ordinary bf16 safetensors Llama directory that
the trainer, vLLM and the hf engine load like any hub checkpoint.

The GGUF metadata gets the chat model's end of turn wrong on some transformers versions (5.17 names ``<|im_start|>``,
id 1, as eos, so vLLM ran every response to the length cap), so the conversion writes the tokens of the original hub
checkpoint explicitly: eos = pad = ``<|im_end|>`` (id 2), bos = ``<|im_start|>`` (id 1), in the tokenizer, the
config and the generation config. The weights stay the Q4_1 ones (dequantised), so this model is slightly weaker
than the bf16 hub release.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from .gguf_fetch import GGUF_BUILTINS, GgufBuiltin, GgufSourceError, fetch_gguf


def write_gguf_model(out: Path, name: str, downloads: Path, save) -> None:
    """Convert built-in ``name`` into the existing directory ``out`` (bf16 safetensors + tokenizer files).

    ``save(model, out)`` is the caller's ``save_pretrained`` (``models.save_on_any_rank``).
    """
    spec = GGUF_BUILTINS[name]
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader imports it; fail here with the install line)
    except ImportError:
        raise GgufSourceError("it is converted from a GGUF file, which needs the 'gguf' package; "
                              "pip install 'hybrid_rl[real-model]' (or pip install gguf)") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # inside the build directory: a killed build leaves the 98 MB GGUF where the cache's sweep removes it
    with tempfile.TemporaryDirectory(dir=out, prefix=".gguf-") as tmp:
        gguf_file = fetch_gguf(spec, downloads, Path(tmp)).name
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf_file, dtype=torch.bfloat16)
    # save_pretrained refuses a quantized (GGUF) model; the weights are already dequantised tensors
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _set_chat_tokens(model, tokenizer, spec)
    model = model.to(torch.bfloat16)
    save(model, out)
    tokenizer.save_pretrained(out)


def _set_chat_tokens(model, tokenizer, spec: GgufBuiltin) -> None:
    """End of turn, bos and pad as the original hub checkpoint has them (the GGUF's may name the wrong eos)."""
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = spec.bos_token, spec.eos_token, spec.pad_token
    tokenizer.padding_side = "left"
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (spec.bos_token, spec.eos_token, spec.pad_token)}
    if any(i is None or i == tokenizer.unk_token_id for i in ids.values()):
        raise RuntimeError(f"the GGUF tokenizer lacks one of the chat tokens {sorted(ids)} ({ids}); this is a bug in "
                           f"the converter or a different GGUF file")
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id = ids[spec.bos_token]
        cfg.eos_token_id = ids[spec.eos_token]
        cfg.pad_token_id = ids[spec.pad_token]
