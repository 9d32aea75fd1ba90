"""A random-init Qwen2 checkpoint written shard by shard, for shapes too large to build whole in host memory.

``Qwen2ForCausalLM(config).to(bfloat16)`` holds the whole model in fp32 and then its bf16 copy: 45 GB of host memory
for a 7.6B model. Here the model is built on the meta device (shapes and names, no storage), each tensor is drawn
straight in the checkpoint's dtype with transformers' own initialisation of a Qwen2 model (linear and embedding
weights normal(0, ``initializer_range``), the embedding's padding row and every bias zero, RMSNorm weights one), and
the tensors are written in safetensors shards of at most ``SHARD_BYTES`` with the usual
``model.safetensors.index.json``: host memory peaks at two shards (one written while the next is drawn). The
result loads with ``from_pretrained`` and vLLM like any sharded hub checkpoint. Draws are seeded (a ``torch.Generator`` on the CPU), so a seed gives the same
weights on every host.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SHARD_BYTES = 4 * 2**30
"""Largest shard: the writer holds two in host memory at once (one on its way to disk, the next being drawn)."""


def init_tensor(kind: str, shape: torch.Size, dtype: torch.dtype, std: float, gen: torch.Generator,
                padding_idx: int | None = None) -> torch.Tensor:
    """One parameter as transformers initialises it: ``normal`` (linear and embedding weights), ``zeros`` (biases),
    ``ones`` (RMSNorm weights)."""
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if kind == "ones":
        return torch.ones(shape, dtype=dtype)
    t = torch.empty(shape, dtype=dtype).normal_(0.0, std, generator=gen)
    if padding_idx is not None:
        t[padding_idx].zero_()
    return t


def param_plan(model: torch.nn.Module) -> list[tuple[str, str, torch.Size, int | None]]:
    """(name, kind, shape, padding row) of every parameter to write, in the model's order; a tied LM head (the same
    tensor as the embedding) is written once, under the embedding's name, as ``save_pretrained`` does."""
    plan, seen = [], set()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(module, torch.nn.Linear):
                kind = "zeros" if p_name == "bias" else "normal"
            elif isinstance(module, torch.nn.Embedding):
                kind = "normal"
            elif type(module).__name__.endswith("RMSNorm") and p_name == "weight":
                kind = "ones"
            else:
                raise ValueError(f"no initialisation known for {name} ({type(module).__name__}); extend param_plan")
            pad = getattr(module, "padding_idx", None) if isinstance(module, torch.nn.Embedding) else None
            plan.append((name, kind, p.shape, pad))
    return plan


def shards(plan: list[tuple[str, str, torch.Size, int | None]], itemsize: int,
           limit: int = SHARD_BYTES) -> list[list[tuple[str, str, torch.Size, int | None]]]:
    """Consecutive parameters grouped into shards of at most ``limit`` bytes (a larger tensor gets one alone)."""
    out: list[list] = [[]]
    size = 0
    for entry in plan:
        nbytes = entry[2].numel() * itemsize
        if out[-1] and size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += nbytes
    return out


def write_random_qwen2(out: Path, config, seed: int, dtype: torch.dtype = torch.bfloat16,
                       shard_bytes: int = SHARD_BYTES) -> int:
    """Write ``config`` (a ``Qwen2Config``) with random weights in ``dtype`` to the directory ``out``: config.json,
    generation_config.json, the shards and their index. Returns the bytes of the weights."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    plan = param_plan(model)
    std = config.initializer_range
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    groups = shards(plan, itemsize, shard_bytes)
    weight_map, total = {}, 0
    # one writer thread: shard i goes to disk while shard i+1 is drawn (both release the GIL), in the draws' order
    with ThreadPoolExecutor(max_workers=1) as writer:
        pending = None
        for i, group in enumerate(groups, 1):
            fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            tensors = {name: init_tensor(kind, shape, dtype, std, gen, pad) for name, kind, shape, pad in group}
            if pending is not None:
                pending.result()  # at most two shards in memory: the one written and the one just drawn
            pending = writer.submit(save_file, tensors, str(out / fname), metadata={"format": "pt"})
            total += sum(t.numel() * itemsize for t in tensors.values())
            weight_map.update({name: fname for name in tensors})
            del tensors
        if pending is not None:
            pending.result()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    config.save_pretrained(out)
    generation = GenerationConfig.from_model_config(config)
    generation.eos_token_id, generation.pad_token_id = config.eos_token_id, config.pad_token_id
    generation.save_pretrained(out)
    return total
