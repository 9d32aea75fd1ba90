"""Export a training checkpoint as a Hugging Face model directory (:func:`export_hf`, and its command line).

``python -m hybrid_rl.export CHECKPOINT OUT_DIR [--adapters-only]``

``CHECKPOINT`` is a ``step_*`` directory written by :mod:`hybrid_rl.checkpoint`
(or a run directory / its ``checkpoints`` directory, meaning the newest complete
checkpoint there). The model path and LoRA settings come from the run's
resolved ``config.yaml``, two directories above ``step_*``
(``<output_dir>/checkpoints/step_N`` → ``<output_dir>/config.yaml``). It runs
in one process on CPU whatever world size wrote the checkpoint. By default
LoRA adapters are merged into the base weights, so
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads the trained policy;
``--adapters-only`` writes peft's ``adapter_model.safetensors`` instead. User
errors print one line and return 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch

from hybrid_rl.checkpoint import CHECKPOINT_SUBDIR, CheckpointError, find_latest, is_complete, verify_checkpoint
from hybrid_rl.checkpoint.layout import error_summary, quiet_single_process
from hybrid_rl.config import ConfigError, load_config
from hybrid_rl.models import ModelLoadError, apply_lora, load_causal_lm, load_tokenizer


def export_hf(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, model_path: str,
              lora: tuple[int, int, list[str], float] | None = None, merge_lora: bool = True,
              trust_remote_code: bool = False, dtype: torch.dtype | None = None, tokenizer_path: str | None = None,
              chat_template: str | None = None) -> Path:
    """Write a Hugging Face model directory (safetensors + tokenizer) from a checkpoint, in this process alone.

    The model is rebuilt from ``model_path`` (plus LoRA ``(rank, alpha,
    target_modules, dropout)`` when given, exactly as the trainer built it),
    the checkpoint's model weights are loaded with DCP (``no_dist``: any saving
    world size reshards into the plain module), and then either the adapters
    are merged (default; ``from_pretrained(out_dir)`` loads a plain model) or,
    with ``merge_lora=False``, only the adapters are saved (peft's
    ``adapter_model.safetensors`` + ``adapter_config.json``). ``dtype`` None
    keeps the base model's dtype (its ``config.json``); training masters are fp32. The tokenizer is the run's
    (``tokenizer_path``, else ``model_path``) with its ``chat_template`` (``model.chat_template``) when given.
    ``out_dir`` must not exist or be empty.
    """
    from torch.distributed.checkpoint import CheckpointException, FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    ckpt = Path(checkpoint)
    verify_checkpoint(ckpt)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"export directory {str(out)!r} exists and is not empty; remove it or pick another output directory")
    if lora is None and not merge_lora:
        raise CheckpointError(f"adapters-only export of {str(ckpt)!r} needs LoRA settings, but the run trained the full model (model.lora.rank=0); "
                              f"export the merged model instead")

    model = load_causal_lm(model_path, torch.float32, trust_remote_code)
    target_dtype = dtype if dtype is not None else _config_dtype(model)
    if lora is not None:
        rank, alpha, target_modules, dropout = lora
        model = apply_lora(model, rank, alpha, list(target_modules), dropout)
    state = {k: v for k, v in model.state_dict().items()}
    try:
        with quiet_single_process():
            dcp_load({"model": state}, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {str(ckpt)!r} does not match the model rebuilt from {model_path!r} "
                              f"(lora rank {0 if lora is None else lora[0]}): {error_summary(e)}; use the run's model.path and model.lora settings") from e
    # DCP loads plain tensors in place (they share storage with the parameters);
    # load_state_dict makes that explicit and checks every key was covered.
    model.load_state_dict(state, strict=True)
    model.eval()

    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    if lora is not None and merge_lora:
        model = model.merge_and_unload()
    model.to(target_dtype)
    # A merged/plain model writes config.json + model.safetensors; a PeftModel
    # (merge_lora=False) writes adapter_model.safetensors + adapter_config.json only.
    model.save_pretrained(tmp, safe_serialization=True)
    load_tokenizer(tokenizer_path or model_path, trust_remote_code, chat_template=chat_template).save_pretrained(tmp)
    if out.exists():
        out.rmdir()  # empty, checked above
    out.parent.mkdir(parents=True, exist_ok=True)
    os.rename(tmp, out)
    return out


def _config_dtype(model: torch.nn.Module) -> torch.dtype:
    d = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else torch.float32


def _resolve_checkpoint(path: Path) -> Path:
    if is_complete(path):
        return path
    if path.is_dir():
        for root in (path, path / CHECKPOINT_SUBDIR):
            found = find_latest(root)
            if found is not None:
                return found
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; pass a <run>/{CHECKPOINT_SUBDIR}/step_* directory")
    raise CheckpointError(f"{str(path)!r} is not a complete checkpoint and holds none; pass a <run>/{CHECKPOINT_SUBDIR}/step_* "
                          f"directory that has a COMPLETE marker")


def main(checkpoint: str, out_dir: str, adapters_only: bool = False, dtype: str | None = None) -> int:
    """Export ``checkpoint`` to ``out_dir``; returns a process exit code (0 ok, 2 user error)."""
    try:
        ckpt = _resolve_checkpoint(Path(checkpoint))
        config_path = ckpt.parent.parent / "config.yaml"
        if not config_path.is_file():
            raise CheckpointError(f"no run config at {str(config_path)!r} (expected two directories above {ckpt.name}); "
                                  f"export from the run directory layout <run>/{CHECKPOINT_SUBDIR}/step_* or call export_hf() directly")
        cfg = load_config(config_path)
        lcfg = cfg.model.lora
        lora = (lcfg.rank, lcfg.alpha, list(lcfg.target_modules), lcfg.dropout) if lcfg.rank > 0 else None
        if adapters_only and lora is None:
            raise CheckpointError(f"--adapters-only: the run in {str(config_path)!r} trained the full model (model.lora.rank=0); "
                                  f"drop --adapters-only to export the full model")
        torch_dtype = None
        if dtype is not None:
            if dtype not in ("float32", "bfloat16", "float16"):
                raise CheckpointError(f"dtype {dtype!r} must be float32, bfloat16 or float16 (or omitted for the base model's dtype)")
            torch_dtype = getattr(torch, dtype)
        out = export_hf(ckpt, Path(out_dir), cfg.model.path, lora=lora, merge_lora=not adapters_only,
                        trust_remote_code=cfg.model.trust_remote_code, dtype=torch_dtype,
                        tokenizer_path=cfg.model.tokenizer_path, chat_template=cfg.model.chat_template)
    except (CheckpointError, ConfigError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_rl.export", description="export a hybrid_rl checkpoint as a Hugging Face model")
    parser.add_argument("checkpoint", help="a <run>/checkpoints/step_* directory (or a run directory: its newest checkpoint)")
    parser.add_argument("out_dir", help="output directory (must not exist or be empty)")
    parser.add_argument("--adapters-only", action="store_true", help="LoRA runs: save the adapters instead of merging them")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="weights dtype (default: the base model's)")
    args = parser.parse_args(argv)
    return main(args.checkpoint, args.out_dir, args.adapters_only, args.dtype)


if __name__ == "__main__":
    sys.exit(cli())
