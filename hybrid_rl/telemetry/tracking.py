"""Metric sinks: a tqdm progress bar, tensorboard scalars, ``metrics.jsonl`` and Weights & Biases; phase timers.

Only rank 0 writes; other ranks get a tracker whose methods do nothing, so the
driver never branches on rank. Metric names are grouped as ``rollout/*``,
``actor/*``, ``reward/*``, ``timing/*``, ``perf/*``, ``val/*``. The W&B run
(``trainer.logger`` with ``wandb``) gets the resolved config and every step's
finite metrics at the step's number; its id is kept in ``output_dir/wandb_run_id``
so that a resumed run goes on logging into the same W&B run. Left out: mlflow
(its tensorboard import reads ``tensorboard/``). ``run_summary`` is the block
printed when ``fit`` ends: what ran, how it ended, where the results are.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import threading
import time
import uuid
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

import torch

from hybrid_rl.telemetry.gc_pauses import gc_clock


_running = threading.local()
"""``_running.timer``: the Timer whose phases are open on this thread (``note_micro_batch_tokens`` credits them)."""
phase_hooks: dict[str, object] = {}
"""Phase name → a context-manager factory every timer runs that phase under, on any thread (``perf.watched_step``
sets it for a step whose phases are profiled)."""


def note_micro_batch_tokens(tokens: int) -> None:
    """Credit a pass's largest micro-batch (the tokens it computes: a packed row's, or rows × padded width) to every
    phase open now on this thread's timer (``Timer.micro_tokens``); nothing when no phase is open."""
    timer = getattr(_running, "timer", None)
    if timer is not None:
        for name, _ in timer._open:
            timer.micro_tokens[name] = max(timer.micro_tokens.get(name, 0), int(tokens))


class Timer:
    """Named wall-clock timers: ``with timer("gen"): ...`` → ``timing/gen`` in seconds.

    Given a CUDA ``device``, also each phase's peak of allocated memory (``peaks``): torch's peak counters are read
    and reset as each phase starts and ends, and every open phase (``step`` holds the others) takes the maximum of
    the stretches it spans. ``step_peaks`` keeps the maxima of all of them (allocated, reserved), so that the step's
    own peak survives the resets (``perf.step_perf_metrics`` folds in the stretch after the last phase)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.times: dict[str, float] = {}
        self.device = device if device is not None and device.type == "cuda" else None
        self.peaks: dict[str, int] = {}
        """Phase name → bytes allocated at most while it ran (the engine's memory included)."""
        self.step_peaks = (0, 0)
        """(allocated, reserved) bytes at most since the timer was made, up to the last phase boundary."""
        self._open: list[list] = []  # [name, peak bytes so far] of the phases running now, outermost first
        self.micro_tokens: dict[str, int] = {}
        """Phase name → tokens of the largest micro-batch its passes computed (``note_micro_batch_tokens``)."""
        self.gc_clock = gc_clock()
        self.gc_seconds: dict[str, float] = {}
        """Phase name → seconds the garbage collector ran while the phase was open (any thread's collection)."""

    def _fold(self) -> None:
        if self.device is None:
            return
        allocated = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        for frame in self._open:
            frame[1] = max(frame[1], allocated)
        self.step_peaks = (max(self.step_peaks[0], allocated), max(self.step_peaks[1], reserved))
        torch.cuda.reset_peak_memory_stats(self.device)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        gc_start = self.gc_clock.seconds
        self._fold()
        self._open.append([name, 0])
        outer = getattr(_running, "timer", None)
        _running.timer = self
        end = gc_end = None
        try:
            hook = phase_hooks.get(name)
            with hook() if hook is not None else nullcontext():
                try:
                    with torch.profiler.record_function(f"phase/{name}"):  # phases show up in trainer.profile_steps
                        yield                                                # tables
                finally:  # the phase ends here: a hook's own exit (a profile's table written) is not its time
                    end, gc_end = time.perf_counter(), self.gc_clock.seconds
        finally:
            end = time.perf_counter() if end is None else end
            gc_end = self.gc_clock.seconds if gc_end is None else gc_end
            self.times[f"timing/{name}"] = self.times.get(f"timing/{name}", 0.0) + end - start
            self.gc_seconds[name] = self.gc_seconds.get(name, 0.0) + gc_end - gc_start
            self._fold()
            _, peak = self._open.pop()
            self.peaks[name] = max(self.peaks.get(name, 0), peak)
            _running.timer = outer

    def pop(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out

    def memory_metrics(self) -> dict[str, float]:
        """``perf/phase_memory_allocated_gb/<phase>``: each timed phase's peak, GiB (empty without a CUDA device)."""
        if self.device is None:
            return {}
        return {f"perf/phase_memory_allocated_gb/{name}": b / 2**30 for name, b in self.peaks.items() if name != "step"}

    def gc_metrics(self) -> dict[str, float]:
        """``perf/gc_pause_s``: seconds the garbage collector stopped the process for during the step, and
        ``perf/gc_pause_s/<phase>`` for each timed phase, 0 where none ran (every rank names the same phases: the
        maxima are all-reduced key by key; ``telemetry/gc_pauses.py``)."""
        out = {"perf/gc_pause_s": self.gc_seconds.get("step", 0.0)}
        out.update({f"perf/gc_pause_s/{name}": s for name, s in self.gc_seconds.items() if name != "step"})
        return out

    def micro_batch_metrics(self) -> dict[str, float]:
        """``perf/phase_micro_batch_tokens/<phase>``: the largest micro-batch each phase computed, in tokens (what
        the memory planner's activation terms scale with; ``hybrid_rl.planner``)."""
        return {f"perf/phase_micro_batch_tokens/{name}": float(t) for name, t in self.micro_tokens.items()
                if name != "step"}


WANDB_ID_FILE = "wandb_run_id"
"""In ``output_dir``: the id of the W&B run this output directory logs to."""


def start_wandb(out: Path, project: str, name: str | None, config: dict | None):
    """The W&B run of ``out``: a new one (its id written to ``out/wandb_run_id``), or the one that file names,
    resumed; files under ``out/wandb/``."""
    import wandb

    from hybrid_rl.config import ConfigError

    id_file = out / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.exists() else None
    if not run_id:
        run_id = uuid.uuid4().hex[:8]  # W&B's own ids are 8 characters of [a-z0-9]
        id_file.write_text(run_id + "\n")
    try:
        return wandb.init(project=project, name=name or out.resolve().name, id=run_id, resume="allow", dir=str(out),
                          config=config)
    except Exception as e:  # noqa: BLE001  (wandb raises its own errors: no API key, no network, a bad project)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"trainer.logger=wandb: starting the W&B run failed ({first}); log in (wandb login or "
                          f"WANDB_API_KEY), log offline with WANDB_MODE=offline, or drop wandb from trainer.logger") from e


class Tracker:
    def __init__(self, output_dir: str, loggers: list[str], total_steps: int, enabled: bool, initial_step: int = 0,
                 project: str = "hybrid_rl", name: str | None = None, config: dict | None = None):
        """``project``, ``name``, ``config``: the W&B run's, where ``loggers`` holds ``wandb``."""
        self.enabled = enabled
        self.out = Path(output_dir)
        self.bar = None
        self.tb = None
        self.jsonl = None
        self.wandb = None
        if not enabled:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        if "console" in loggers:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True, file=sys.stderr)
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.out / "tensorboard"))
        if "jsonl" in loggers:
            self.jsonl = open(self.out / "metrics.jsonl", "a", buffering=1)  # the trainer trims it on (re)start
        if "wandb" in loggers:
            self.wandb = start_wandb(self.out, project, name, config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)},
                           step=step)
        if self.bar is not None and "reward/mean" in metrics:
            post = {"reward": f"{metrics['reward/mean']:.3f}"}
            if "perf/tokens_per_s" in metrics:
                post["tok/s"] = f"{metrics['perf/tokens_per_s']:.0f}"
            if "val/reward_mean" in metrics:
                post["val"] = f"{metrics['val/reward_mean']:.3f}"
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(1)

    def write(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the bar on a line of its own (later writes, the run summary or an error, go below it) and close the
        files; idempotent."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def export_command() -> str:
    """How to call the CLI from here: ``hybrid-rl`` when on PATH, else the console script beside this Python, else
    ``python -m hybrid_rl``."""
    if shutil.which("hybrid-rl"):
        return "hybrid-rl"
    script = Path(sys.executable).parent / "hybrid-rl"
    if script.exists():
        rel = os.path.relpath(script)
        return rel if not rel.startswith("..") else str(script)
    return "python -m hybrid_rl"


def _duration(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"


def run_summary(output_dir: str, loggers: list[str], steps_run: int, final_step: int, wall_s: float,
                rewards: list[float], last_val: tuple[int, float] | None, checkpoint: Path | None, save_freq: int,
                window: int = 5) -> str:
    """The end-of-run block: steps and wall time, final reward (mean of the last ``window`` steps) and validation
    score, the newest checkpoint, the metric files, and the export command."""
    out = Path(output_dir)
    lines = [f"hybrid_rl: done: {steps_run} step(s) run in {_duration(wall_s)}; the run is at step {final_step}"]
    scores = []
    if rewards:
        last = rewards[-window:]
        scores.append(f"reward/mean {sum(last) / len(last):.3f} (mean of the last {len(last)} step(s))")
    if last_val is not None:
        scores.append(f"val/reward_mean {last_val[1]:.3f} (step {last_val[0]})")
    if scores:
        lines.append("  final:      " + ", ".join(scores))
    if checkpoint is not None:
        lines.append(f"  checkpoint: {checkpoint}")
    else:
        why = " (trainer.save_freq=-1)" if save_freq < 0 else ""
        lines.append(f"  checkpoint: none{why}")
    if "jsonl" in loggers:
        lines.append(f"  metrics:    {out / 'metrics.jsonl'}")
    if "tensorboard" in loggers:
        lines.append(f"  tensorboard: tensorboard --logdir {out / 'tensorboard'}")
    if "wandb" in loggers:
        lines.append(f"  wandb:      {out / 'wandb'} (offline runs: wandb sync {out / 'wandb'}/offline-run-*)")
    if checkpoint is not None:
        lines.append(f"  export:     {export_command()} export {out} {out / 'hf'}   (a Hugging Face model directory)")
    return "\n".join(lines)


def trim_metrics(path: Path, last_step: int) -> None:
    """Keep only the lines of ``metrics.jsonl`` at ``path`` of steps <= ``last_step`` (a fresh run: none), so that a
    resumed run's log has no duplicates."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep) if last_step > 0 else "")
    tmp.replace(path)
