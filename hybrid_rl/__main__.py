"""Command line: ``hybrid-rl train [--nproc N] [--import MODULE ...] RECIPE.yaml [key.sub=value ...]`` (or ``python -m hybrid_rl``).

``plan RECIPE.yaml [key=value ...] [--gpus N] [--gpu-memory-gb G | --gpu NAME]`` prints the predicted peak memory
per GPU of each phase and whether the config fits (exit 0) or not (exit 1, naming the one setting to change).

``train --nproc N`` is the launcher: it loads and validates the config and runs the
preflight checks (``preflight.py``) in this one process, before any rank starts,
then starts N ranks through torchrun's own ``torch.distributed.run``. Without
``--nproc`` this process is the trainer: a world of one, or one rank when torchrun
started it. Every rank runs the same command, ``--import`` flags included: each
process imports the plug-in modules they name (and those of ``trainer.imports``)
before it reads the config, so their registered names are valid on every rank.

Every rank dies with the process that started it (``lifeline.py``): SIGKILL of the launcher, or of
``make train``'s process group, ends the ranks within a second, and with them their reward
workers and the run's lock.

User errors (a bad recipe, a missing file, a reward function that raises) end the
run with one line on stderr and exit code 2, also through the launcher: ranks hand
their line to the launcher, which prints one and keeps the elastic agent's failure
report to itself. Anything else is a bug and keeps its traceback and torchrun's report.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from pathlib import Path

ENV_PREFLIGHT_DONE = "HYBRID_RL_PREFLIGHT_DONE"
"""Set by the launcher for its ranks: the config was validated and preflighted once, before they started."""
ENV_ERROR_DIR = "HYBRID_RL_ERROR_DIR"
"""Set by the launcher: a rank writes its user-error line to ``<dir>/rank<R>`` instead of printing it."""
ENV_LAUNCHER_PID = "HYBRID_RL_LAUNCHER_PID"
"""Set by the launcher: its pid, the parent every rank dies with (``lifeline.py``), however the launcher dies."""
USER_ERROR = 2


# (module, class) of every user error; classes of modules never imported cannot have been raised, so the
# check imports nothing (an error caught before the trainer is imported must not pay for importing it)
_USER_ERRORS = (("hybrid_rl.config", "ConfigError"), ("hybrid_rl.data.tasks", "DataError"),
                ("hybrid_rl.models", "ModelLoadError"), ("hybrid_rl.rewards.registry", "RewardError"),
                ("hybrid_rl.checkpoint", "CheckpointError"), ("hybrid_rl.modes.overlap", "StalenessError"),
                ("hybrid_rl.checkpoint.checkpointer", "TrainingDiverged"), ("hybrid_rl.preflight", "PreflightError"),
                ("hybrid_rl.runlock", "RunLockError"), ("hybrid_rl.planner.shape", "ShapeError"))


def _is_user_error(e: BaseException) -> bool:
    return any(isinstance(e, getattr(sys.modules[mod], name)) for mod, name in _USER_ERRORS if mod in sys.modules)


def cmd_train(args: argparse.Namespace) -> int:
    from hybrid_rl.config import import_plugins, load_config

    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank: torchrun started it in a session of its own, so a kill of the
        from hybrid_rl.lifeline import die_with_parent  # launcher's process group would miss it

        launcher = os.environ.get(ENV_LAUNCHER_PID)
        die_with_parent(int(launcher) if launcher and launcher.isdigit() else None)
    import_plugins(args.imports, "--import")
    if args.nproc is not None:
        return launch(args.recipe, args.overrides, args.nproc, args.imports)
    cfg = load_config(args.recipe, args.overrides)
    cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))
    if not os.environ.get(ENV_PREFLIGHT_DONE):
        from hybrid_rl.preflight import preflight

        preflight(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    from hybrid_rl.distributed import destroy, init_distributed
    from hybrid_rl.trainer import Trainer
    from hybrid_rl.watchdog import dump_stacks_on_signal

    dump_stacks_on_signal()  # `kill -USR1 <pid>`: every thread's stack, even one stuck in C (a hung rank)

    dist = init_distributed(cfg.trainer.device, cfg.trainer.collective_timeout_s, cfg.trainer.expandable_segments)
    finished = False
    try:
        Trainer(cfg, dist).fit()
        finished = True
    except RuntimeError as e:
        if not _is_collective_timeout(e):
            raise
        # one line instead of a gloo/NCCL traceback; exit 1 (a fault, not bad input), torchrun's report follows
        print(f"error: rank {dist.rank}: a collective waited trainer.collective_timeout_s={cfg.trainer.collective_timeout_s} s "
              f"for the other ranks and gave up: one of them is hung or dead (its own log, or torchrun's report below, says "
              f"which); restart the run (it resumes from the last checkpoint), or raise trainer.collective_timeout_s if a "
              f"phase is legitimately that uneven across ranks", file=sys.stderr, flush=True)
        return 1
    finally:
        destroy(finished)
    return 0


def _is_collective_timeout(e: BaseException) -> bool:
    """gloo: "Timed out waiting ...ms for send/recv operation"; NCCL's watchdog: "... timed out" / "Watchdog caught"."""
    msg = str(e)
    return ("Timed out waiting" in msg or "Watchdog caught collective operation timeout" in msg
            or ("NCCL" in msg and "timed out" in msg))


def _nproc(value: str, cfg) -> int:
    """``--nproc``: a count, or ``auto`` = the visible GPUs (one process on CPU)."""
    from hybrid_rl.preflight import PreflightError

    if value == "auto":
        import torch

        return max(torch.cuda.device_count(), 1) if cfg.trainer.device != "cpu" else 1
    if not value.isdigit() or int(value) < 1:
        raise PreflightError(f"--nproc {value!r} must be a positive number of processes or 'auto' (one per visible GPU)")
    return int(value)


def launch(recipe: str, overrides: list[str], nproc_arg: str, imports: list[str] = ()) -> int:
    """Validate + preflight here, then run ``torchrun --standalone --nproc_per_node=N -m hybrid_rl train ...``
    (``imports``: the ``--import`` modules, imported here already and passed on to every rank)."""
    import tempfile

    from hybrid_rl.config import load_config
    from hybrid_rl.preflight import PreflightError, preflight

    if "LOCAL_RANK" in os.environ:
        raise PreflightError("train --nproc starts the ranks itself; drop --nproc when torchrun launches this command")
    cfg = load_config(recipe, overrides)
    nproc = _nproc(nproc_arg, cfg)
    cfg.validate(nproc)
    preflight(cfg, nproc)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    with tempfile.TemporaryDirectory(prefix="hybrid_rl_errors_") as error_dir:
        os.environ[ENV_PREFLIGHT_DONE] = "1"
        os.environ[ENV_ERROR_DIR] = error_dir
        os.environ[ENV_LAUNCHER_PID] = str(os.getpid())
        torchrun_args = parse_args(["--standalone", f"--nproc_per_node={nproc}", "--module", "hybrid_rl",
                                    "train", *(f"--import={m}" for m in imports), recipe, *overrides])
        _quiet_elastic_agent()
        try:
            run(torchrun_args)
        except ChildFailedError as e:
            first_rank, first = e.get_first_failure()
            if first.exitcode == USER_ERROR:  # the ranks' one line, printed once; the agent's report stays quiet
                print(f"error: {_rank_error(Path(error_dir), first_rank)}", file=sys.stderr)
                return USER_ERROR
            print(e.format_msg(), file=sys.stderr)  # a crash: the ranks printed their tracebacks; add torchrun's report
            return first.exitcode if first.exitcode > 0 else 1
        except SignalException as e:  # Ctrl-C or a kill: the ranks were stopped, nothing to report
            return 128 + int(e.sigval)
        finally:
            os.environ.pop(ENV_PREFLIGHT_DONE, None)
            os.environ.pop(ENV_ERROR_DIR, None)
            os.environ.pop(ENV_LAUNCHER_PID, None)
    return 0


_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")


class _DropAgentRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith(_AGENT_LOGGERS)


def _quiet_elastic_agent() -> None:
    """Silence the elastic agent's own logging (a failed rank, the OMP_NUM_THREADS banner) in this process.

    A crash is still reported: the ranks print their tracebacks and ``launch`` prints torchrun's failure summary.
    The agent's loggers set their own levels (so a parent's level would not reach them) and some are created
    only when the rendezvous starts, so the records are dropped at the handlers they reach as well.
    """
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(_AGENT_LOGGERS):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    for name in ("", "torch", "torch.distributed"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _DropAgentRecords) for f in handler.filters):
                handler.addFilter(_DropAgentRecords())


def _rank_error(error_dir: Path, first_rank: int) -> str:
    """The line the first failing rank wrote (else rank 0's, else any)."""
    files = sorted(error_dir.glob("rank*"), key=lambda p: (p.name != f"rank{first_rank}", p.name != "rank0", p.name))
    for f in files:
        text = f.read_text().strip()
        if text:
            return text
    return f"rank {first_rank} stopped with a user error (exit code {USER_ERROR}) but left no message; see the output above"


def _report_user_error(e: BaseException) -> None:
    error_dir = os.environ.get(ENV_ERROR_DIR)
    rank = os.environ.get("RANK", "0")
    if error_dir and Path(error_dir).is_dir():  # the launcher prints it, once
        (Path(error_dir) / f"rank{rank}").write_text(str(e))
    elif rank == "0":
        print(f"error: {e}", file=sys.stderr)


def cmd_plan(args: argparse.Namespace) -> int:
    from hybrid_rl.config import ConfigError, import_plugins, load_config
    from hybrid_rl.planner.estimate import GIB
    from hybrid_rl.planner.gpus import card_memory_gib, visible_gpu, visible_gpu_count
    from hybrid_rl.planner.report import table
    from hybrid_rl.planner.shape import read_shape
    from hybrid_rl.planner.verdict import judge

    import_plugins(args.imports, "--import")
    cfg = load_config(args.recipe, args.overrides)
    gpus = args.gpus if args.gpus is not None else max(visible_gpu_count(), 1)
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus} must be a positive number of GPUs")
    cfg.validate(gpus)
    if args.gpu_memory_gb is not None:
        name, gib = f"{args.gpu_memory_gb:g} GiB", args.gpu_memory_gb
    elif args.gpu is not None:
        try:
            name, gib = args.gpu, card_memory_gib(args.gpu)
        except ValueError as e:
            raise ConfigError(f"--gpu: {e}") from None
    elif (seen := visible_gpu()) is not None:
        name, gib = seen
    else:
        raise ConfigError("no GPU is visible: give the card with --gpu H200|H100|A100-80GB|A100-40GB or its memory "
                          "with --gpu-memory-gb G")
    all_phases, verdict = judge(cfg, read_shape(cfg.model.path), gpus, gib * GIB)
    print(table(all_phases, verdict, f"{args.recipe}: {cfg.model.path} on {gpus} x {name} ({gib:.1f} GiB)"))
    if cfg.reward.model.path and not any(p.name == "reward model" for p in all_phases):
        print(f"not counted: the reward model {cfg.reward.model.path!r}, whose config.json is not here (download it "
              f"first to plan with it)")
    return 0 if verdict.fits else 1


def cmd_build_tiny_model(args: argparse.Namespace) -> int:
    from hybrid_rl.models import build_tiny_model

    print(build_tiny_model(args.out_dir, seed=args.seed))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from hybrid_rl.export import main as export_main

    return export_main(args.checkpoint, args.out_dir, args.adapters_only, args.dtype)


def _wrong_interpreter(argv: list[str]) -> str | None:
    """A Python without the project's packages (``python -m hybrid_rl`` outside .venv) gets the command to use."""
    if importlib.util.find_spec("torch") is not None:
        return None
    venv = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "hybrid-rl"
    script = os.path.relpath(venv) if venv.exists() else None
    fix = (f"run {script} {' '.join(argv)}" if script else
           "create it with `make install` and run .venv/bin/hybrid-rl " + " ".join(argv))
    return f"{sys.executable} has no torch, so it is not the project's environment; {fix} (or use make train)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="hybrid-rl", description="hybrid_rl: colocated RL trainer for LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train from a YAML recipe")
    p.add_argument("recipe", help="path to a recipe YAML (see recipes/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=10")
    p.add_argument("--nproc", metavar="N", default=None,
                   help="check the config, then launch N ranks through torchrun ('auto': one per visible GPU, "
                        "one on CPU); without it this process trains alone, or is one rank under torchrun")
    p.add_argument("--import", dest="imports", metavar="MODULE", action="append", default=[],
                   help="import a plug-in module (a module name or path/to/file.py) before the config is read, on "
                        "every rank, so that what it registers can be named in the config (repeatable; the config's "
                        "own list is trainer.imports)")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("plan", help="predict the peak GPU memory of each phase and whether the config fits")
    p.add_argument("recipe", help="path to a recipe YAML (see recipes/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.ppo_micro_batch_size_per_device=4")
    p.add_argument("--gpus", type=int, default=None, help="GPUs of the run (default: the visible ones, else 1)")
    p.add_argument("--gpu-memory-gb", type=float, default=None, metavar="G",
                   help="memory of one GPU in GiB (default: the visible GPU's, or --gpu's)")
    p.add_argument("--gpu", default=None, metavar="NAME", help="a known card: H200, H100, A100-80GB, A100-40GB")
    p.add_argument("--import", dest="imports", metavar="MODULE", action="append", default=[],
                   help="import a plug-in module before the config is read (as train's)")
    p.set_defaults(func=cmd_plan)
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
    wrong = _wrong_interpreter(argv)
    if wrong:
        print(f"error: {wrong}", file=sys.stderr)
        return USER_ERROR
    try:
        return args.func(args)
    except Exception as e:
        if type(e).__name__ == "RunInterrupted":  # stopped by SIGTERM/SIGINT after writing a checkpoint
            if os.environ.get("RANK", "0") == "0":
                print(f"hybrid_rl: {e}", file=sys.stderr, flush=True)
            return 128 + e.signum
        if not _is_user_error(e):
            raise
        _report_user_error(e)
        return USER_ERROR


def _leave(code: int) -> None:
    """Exit with ``code``. A torchrun rank that finished (its checkpoint and metrics written, its process groups
    destroyed by ``cmd_train``) skips interpreter finalization: a gloo rank aborted there once after a finished run
    ("terminate called without an active exception", CI, 2 ranks), turning a good run into a failed one. The trainer
    has closed the reward workers and the tracker by then; the engine and the CUDA context go with the process."""
    if code == 0 and "LOCAL_RANK" in os.environ:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(code)


if __name__ == "__main__":
    _leave(main())
