"""The ``trainer`` section: the driver loop, its mode and placement, checkpoints, logging."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Literal, Optional

from hybrid_rl.config.errors import ConfigError
from hybrid_rl.config.fields import harmless, not_compared


@dataclass
class TrainerConfig:
    output_dir: str = not_compared("runs/default")
    """Run directory: resolved config, metrics.jsonl, tensorboard events."""
    seed: int = 0
    """Seeds data order, sampling and init; CPU runs repeat step for step."""
    total_steps: int = harmless(0)
    """Training steps; 0 = ``total_epochs`` passes over the data."""
    total_epochs: int = harmless(1)
    """Epochs when ``total_steps`` is 0."""
    test_freq: int = harmless(0)
    """Validate every N steps and after the last (0 = never, except ``val_before_train``)."""
    val_before_train: bool = harmless(False)
    """Validate once before the first step."""
    balance_batch: bool = harmless(True)
    """Before the updates, exchange whole groups between the data-parallel ranks so that every mini-batch holds a
    similar number of tokens on each (``phases/balance.py``); the update is the same up to the order of float sums.
    ``perf/dp_token_imbalance`` says how even it is."""
    val_only: bool = harmless(False)
    """Validate the current weights once and stop, training nothing and writing no checkpoint: the model's, or the
    checkpoint a resume finds (``trainer.resume=auto``), logged at its step (``metrics.jsonl``, the loggers)."""
    logger: list[Literal["console", "tensorboard", "jsonl", "wandb"]] = harmless(default_factory=lambda: ["console", "tensorboard", "jsonl"])
    """Metric sinks: the progress bar, ``tensorboard/``, ``metrics.jsonl``, and Weights & Biases (``wandb``: the
    ``wandb`` package, ``pip install 'hybrid_rl[wandb]'``; ``WANDB_MODE=offline`` keeps it on disk)."""
    project_name: str = not_compared("hybrid_rl")
    """The Weights & Biases project of a run logging to ``wandb``."""
    experiment_name: Optional[str] = not_compared(None)
    """The Weights & Biases run name (null: the name of ``output_dir``). A resumed run continues the same W&B run
    (its id is kept in ``output_dir/wandb_run_id``)."""
    device: Literal["auto", "cpu", "cuda"] = harmless("auto")
    """``auto`` uses CUDA when present."""
    mode: Literal["sync", "overlap"] = "sync"
    """``sync``: generate then train. ``overlap``: generate batch k+1 while batch k trains."""
    max_staleness: int = 1
    """Overlap mode: the most weight versions a trained-on sample may lag (0 = sync semantics); 0 or 1, or >= 2
    with ``partial_rollouts`` (a carried sample's oldest tokens are used two versions later)."""
    partial_rollouts: bool = False
    """Overlap mode, colocated: interrupt the round in flight once this rank has a step's complete GRPO groups
    and carry the rest (unfinished samples with their partial responses) into the next round, where they continue
    under the newer weights (AReaL-style). Needs ``max_staleness >= 2``; tokens record their own weight version
    (``token_weight_version``). Checkpoints let the round finish first, so nothing partial is saved."""
    partial_rollout_ahead: float = 0.25
    """Partial rollouts: how much is generated beyond the step's own groups, as a fraction of a step. A round
    holds the pool's oldest ``(1 + ahead) × per-step`` groups (the newer ones wait unstarted), and the trainer takes
    the first per-step groups to complete: the default leaves the slowest fifth of a round's groups, the long tail, to
    the next round (about a quarter of the trained samples then have oldest-token staleness 2, the rest 1). 1.0 starts
    every group of a two-step pool at once: more slack for the tail, but nearly every sample is carried once
    (staleness 2). Above 1 the pool grows to the window (up to 4: five steps' groups in flight), so more complete
    groups are at hand at each boundary; a group that reaches ``max_staleness`` is still waited for."""
    save_freq: int = harmless(0)
    """Checkpoint every N steps (0 = only at the end, -1 = never, e.g. for benchmarks)."""
    keep_last: int = harmless(2)
    """Complete checkpoints kept (older ones pruned after a new one is complete; 0 = all)."""
    resume: str = not_compared("auto")
    """``auto`` (newest complete checkpoint in output_dir, else fresh), ``never``, or a checkpoint path."""
    max_skipped_updates: int = harmless(3)
    """Stop after this many consecutive steps whose update was skipped for a non-finite loss/grad norm."""
    stale_policy: Literal["drop", "error"] = harmless("drop")
    """A batch beyond ``max_staleness`` is regenerated under the current weights (drop) or stops the run (error)."""
    validation_data_dir: str = harmless("")
    """Write every validation's samples (dataset index, prompt, response, its length in tokens, ground truth, score)
    as JSON lines to ``<dir>/step_<N>_rank<R>.jsonl`` ("" = off, as verl's key of the same name; a relative path is
    inside ``output_dir``). For reading what the model writes, and for a paired before/after comparison per question."""
    profile_steps: list[int] = harmless(default_factory=list)
    """Steps to run under ``torch.profiler``; each rank writes its top ops by CUDA and CPU time to
    ``<output_dir>/profile/step_<N>_rank<R>.txt`` (e.g. ``trainer.profile_steps=[5]``)."""
    profile_phases: list[str] = harmless(default_factory=list)
    """Within ``profile_steps``, only these timed phases (``timing/<phase>``: ``gen``, ``old_log_prob``, ``ref``,
    ``update``, ...), each to ``step_<N>_rank<R>_<phase>.txt``; empty: the whole step. A long step's profile is mostly
    generation; ``[update]`` says what bounds the update."""
    peak_tflops: Optional[float] = harmless(None)
    """The device's dense bf16 peak in TFLOP/s for ``perf/mfu_*`` (default: looked up by GPU name in
    ``hybrid_rl.telemetry.perf``; MFU is not logged for devices it does not know)."""
    stall_dump_s: float = harmless(0.0)
    """A step (or the run's set-up) running longer than this many seconds dumps every thread's Python stack to
    stderr, and again every as many seconds (0 = off): the first thing to look at when a multi-rank run hangs."""
    gc_steps: int = harmless(0)
    """Python's cyclic garbage collector: 0 leaves it automatic (it runs whenever allocations cross its threshold, in
    any phase, while the in-process engine and the trainer wait); N > 0 turns it off while steps run and collects
    after every N-th step, with what set-up built frozen out of its scans (``gc.freeze``), as torchtitan's
    ``gc_freq`` does. Reference counting still frees at once every object outside a cycle. ``perf/gc_pause_s`` (and
    ``/<phase>``) logs the pauses either way; the collection between steps is ``timing/gc``."""
    expandable_segments: bool = harmless(False)
    """CUDA: PyTorch's expandable segments for the trainer's allocations (``PYTORCH_CUDA_ALLOC_CONF``; vLLM turns
    them off around its own pools). Packed micro-batches change size every call, and the caching allocator fragments:
    on 4xH200 the flagship with 16k-token micro-batches reserves ~135 GB per GPU for ~68 GB allocated
    (``perf/max_memory_*`` less vLLM's sleeping 70 GB pool, which they count) and makes 718 ``cudaFree`` calls in a
    step. Off by default all the same: with it the flagship recipe's step on 4xH200 takes 19.3 s, against 17.3 s
    without (``benchmarks/results/flagship_H200x4.json``)."""
    check_memory: bool = harmless(True)
    """On CUDA, before any rank starts: refuse a config whose predicted peak memory per GPU (``hybrid-rl plan``,
    ``hybrid_rl/planner/``) exceeds the GPU's by more than 5%, naming the one setting to change; false skips it."""
    collective_timeout_s: int = harmless(1800)
    """How long a rank waits in a collective for the others before it fails the run (a hung or dead rank then ends the
    run with an error instead of waiting forever); raise it if a phase is legitimately that uneven across ranks."""
    placement: Literal["colocated", "split"] = "colocated"
    """``colocated``: every rank trains and generates. ``split``: ranks ``0..R-1`` only generate, the rest only train
    (weights broadcast over NCCL after each update)."""
    rollout_ranks: int = 0
    """Split placement: R, the number of generate-only ranks (0 = half the world, rounded down)."""
    allow_config_change: bool = not_compared(False)
    """Resume a checkpoint even though settings that change what is trained differ from the run that wrote it
    (model, data, algorithm, optimiser, sampling, mode, placement, seed); off, such a resume stops and lists them."""
    imports: list[str] = harmless(default_factory=list)
    """Plug-in modules every process imports before the rest of the config is read: module names (on
    ``sys.path``/``PYTHONPATH``) or ``path/to/file.py``. Their registrations (``register_estimator``,
    ``register_policy_loss``, ``register_rollout_engine``, ``register_reward``) make their names valid in
    ``algorithm.adv_estimator``, ``actor.policy_loss``, ``rollout.name`` and ``reward.function``, on every rank that
    ``train --nproc`` starts (the command line's ``--import MODULE`` does the same)."""

    @property
    def partial_pool_steps(self) -> int:
        """``partial_pool_steps(partial_rollout_ahead)``."""
        return partial_pool_steps(self.partial_rollout_ahead)

    def validate(self) -> None:
        if "wandb" in self.logger and importlib.util.find_spec("wandb") is None:
            raise ConfigError("trainer.logger includes wandb, but the wandb package is not installed: pip install "
                              "'hybrid_rl[wandb]' (or wandb), or drop wandb from trainer.logger")
        if self.save_freq < -1 or self.keep_last < 0 or self.max_skipped_updates < 1:
            raise ConfigError("trainer.save_freq must be >= -1 (-1 = never), trainer.keep_last >= 0, "
                              "trainer.max_skipped_updates >= 1")
        if self.partial_rollouts:
            self._validate_partial()
        elif self.max_staleness not in (0, 1):
            raise ConfigError(f"trainer.max_staleness={self.max_staleness}: one-step overlap supports 0 or 1 "
                              "(deeper pipelines are not built yet; >= 2 only with trainer.partial_rollouts=true)")
        if self.rollout_ranks < 0:
            raise ConfigError(f"trainer.rollout_ranks={self.rollout_ranks} must be >= 0 (0 = half the ranks under "
                              f"placement=split)")
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"trainer.collective_timeout_s={self.collective_timeout_s} must be > 0 seconds")
        if self.gc_steps < 0:
            raise ConfigError(f"trainer.gc_steps={self.gc_steps} must be >= 0 (0 = Python's automatic collection, N = "
                              f"collect after every N-th step)")
        if self.stall_dump_s < 0:
            raise ConfigError(f"trainer.stall_dump_s={self.stall_dump_s} must be >= 0 seconds (0 = off)")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"trainer.peak_tflops={self.peak_tflops} must be > 0 (the GPU's dense bf16 TFLOP/s), or "
                              f"null to look it up by GPU name")
        if any(step < 1 for step in self.profile_steps):
            raise ConfigError(f"trainer.profile_steps={self.profile_steps} must list step numbers >= 1, e.g. [5]")
        if self.profile_phases and not self.profile_steps:
            raise ConfigError(f"trainer.profile_phases={self.profile_phases} needs trainer.profile_steps, the steps to "
                              f"profile them in, e.g. trainer.profile_steps=[2]")
        if self.total_steps < 0 or self.total_epochs < 1:
            raise ConfigError("trainer.total_steps must be >= 0 and trainer.total_epochs >= 1")

    def _validate_partial(self) -> None:
        """``partial_rollouts``: overlap mode (either placement), a staleness bound that a carried sample fits."""
        if not 0.0 < self.partial_rollout_ahead <= 4.0:
            raise ConfigError(f"trainer.partial_rollout_ahead={self.partial_rollout_ahead} must be in (0, 4] (steps' "
                              "groups generated beyond this step's, e.g. 0.25 or 1.0); not a percentage")
        if self.mode != "overlap":
            raise ConfigError(f"trainer.partial_rollouts=true needs trainer.mode=overlap (got {self.mode}): set "
                              "trainer.mode=overlap trainer.max_staleness=2, or trainer.partial_rollouts=false")
        if self.max_staleness < 2:
            raise ConfigError(f"trainer.partial_rollouts=true needs trainer.max_staleness >= 2 (got {self.max_staleness}): "
                              "a carried sample's oldest tokens are used two weight versions later; set "
                              "trainer.max_staleness=2")
        pool_steps = self.partial_pool_steps
        if self.max_staleness < pool_steps:
            raise ConfigError(f"trainer.partial_rollout_ahead={self.partial_rollout_ahead:g} keeps {pool_steps} steps' "
                              f"groups in flight, started together, so the last is trained {pool_steps} versions later: "
                              f"set trainer.max_staleness={pool_steps} (got {self.max_staleness}) or a smaller ahead")


def partial_pool_steps(ahead: float) -> int:
    """Partial rollouts: how many steps' groups the pool keeps in flight at ``trainer.partial_rollout_ahead`` =
    ``ahead``, max(2, ⌈1 + ahead⌉), and so the least ``trainer.max_staleness`` it allows (the last of them is
    trained that many versions after it started). The pool shrinks only over a run's last that many steps (there
    are no prompts beyond the end to start)."""
    return max(2, math.ceil(1 + ahead))

