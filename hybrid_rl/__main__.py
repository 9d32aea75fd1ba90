"""Command line: ``python -m hybrid_rl train RECIPE.yaml [key.sub=value ...]``.

Under torchrun every rank runs this same command. User errors (a bad recipe,
a missing file, a reward function that raises) end the run with one line on
stderr and exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys


def _user_errors() -> tuple[type[BaseException], ...]:
    from hybrid_rl.config import ConfigError
    from hybrid_rl.data import DataError
    from hybrid_rl.models import ModelLoadError
    from hybrid_rl.checkpoint import CheckpointError
    from hybrid_rl.pipeline import StalenessError
    from hybrid_rl.rewards import RewardError
    from hybrid_rl.trainer import TrainingDiverged

    return (ConfigError, DataError, ModelLoadError, RewardError, CheckpointError, StalenessError, TrainingDiverged)


def cmd_train(args: argparse.Namespace) -> int:
    from hybrid_rl.config import load_config
    from hybrid_rl.distributed import destroy, init_distributed
    from hybrid_rl.trainer import Trainer

    cfg = load_config(args.recipe, args.overrides)
    dist = init_distributed(cfg.trainer.device)
    try:
        cfg.validate(dist.world_size)
        Trainer(cfg, dist).fit()
    finally:
        destroy()
    return 0


def cmd_build_tiny_model(args: argparse.Namespace) -> int:
    from hybrid_rl.models import build_tiny_model

    print(build_tiny_model(args.out_dir, seed=args.seed))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from hybrid_rl.export import main as export_main

    return export_main(args.checkpoint, args.out_dir, args.adapters_only, args.dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_rl", description="hybrid_rl: colocated RL trainer for LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train from a YAML recipe")
    p.add_argument("recipe", help="path to a recipe YAML (see recipes/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=10")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory (LoRA merged by default)")
    p.add_argument("checkpoint", help="<output_dir>/checkpoints/step_N, or a run directory (its newest checkpoint)")
    p.add_argument("out_dir")
    p.add_argument("--adapters-only", action="store_true", help="LoRA runs: save the adapters instead of merging")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("build-tiny-model", help="write the built-in tiny Qwen2 model + tokenizer to a directory")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_build_tiny_model)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except _user_errors() as e:
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
