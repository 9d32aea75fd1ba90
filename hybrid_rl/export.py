"""Export a training checkpoint as a Hugging Face model directory.

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
import sys
from pathlib import Path

from hybrid_rl.checkpoint import CHECKPOINT_SUBDIR, CheckpointError, export_hf, find_latest, is_complete


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
    import torch

    from hybrid_rl.config import ConfigError, load_config
    from hybrid_rl.models import ModelLoadError

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
                        trust_remote_code=cfg.model.trust_remote_code, dtype=torch_dtype)
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
