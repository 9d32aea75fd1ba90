"""The driver: every rank runs this loop on its own shard of the prompts (SPMD).

``fit`` reads top to bottom: one call per phase, each under a named timer.
Set-up (data, reward function, worker, trackers) happens in ``__init__``;
validation is greedy pass@1 on the validation prompts. Every mode and
placement runs the same ``step``: a ``RolloutSource`` (``rollout_source.py``: sync,
one-step overlap, split placement) hands over the batch, and ``train_on`` runs
reward → log-probs → (values) → advantage → (critic update) → actor update on it,
one call per phase (``phases/``: the reward phase, where π_old comes from, the
advantage); the old-log-prob pass is skipped where ``actor.old_log_prob`` allows,
the critic phases run when the estimator needs a critic (gae, ``workers/critic.py``),
and the first ``critic.warmup_steps`` steps update the critic only. With
``algorithm.filter_groups`` (sync mode) the reward phase drops the groups of
equal rewards and generates more (DAPO's dynamic sampling). Metrics are gathered
per rank, reduced across ranks (weighted means, maxima; ``metrics.py``, ``perf.py``)
and logged by one rank (under split placement the first trainer rank). Partial
rollouts (``trainer.partial_rollouts``, ``partial.py``) add per-token staleness
metrics, always recompute π_old, and checkpoint nothing partial: saving waits for
the round in flight to finish uninterrupted. Left out on purpose: a single
controller (there is none: torch.distributed is the engine).
"""

from __future__ import annotations

import json
import random
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

from hybrid_rl import algorithms as alg
from hybrid_rl.batch import Batch
from hybrid_rl.checkpoint import (CHECKPOINT_SUBDIR, CheckpointError, CorruptCheckpointError, capture_rng, find_latest,
                                  find_resumable, is_complete, load_checkpoint, read_checkpoint_config, restore_rng,
                                  save_checkpoint, verify_checkpoint)
from hybrid_rl.config import Config, ConfigError, mini_batch_seqs, resume_config_diff, save_config
from hybrid_rl.data import TASKS, PromptDataset, PromptSampler, collate_prompts, load_rows
from hybrid_rl.distributed import DistInfo, all_reduce_sum, reduce_max, reduce_weighted_means
from hybrid_rl.envs.metrics import add_pairs, env_metrics, zero_pairs
from hybrid_rl.envs.multiturn import check_template, env_prompt
from hybrid_rl.interrupt import GracefulStop, RunInterrupted
from hybrid_rl.metrics import finish_step_metrics, outcome_sums, step_metrics, step_times
from hybrid_rl.models import load_tokenizer
from hybrid_rl.perf import ModelFlops, host_wait_summary, peak_flops, step_perf_means, step_perf_metrics
from hybrid_rl.phases.advantage import compute_advantage, kl_in_reward_stats
from hybrid_rl.phases.group_rows import gather_group_rows, own_rows, per_member
from hybrid_rl.phases.old_log_prob import old_log_prob_source, old_log_probs
from hybrid_rl.phases.reward import RewardPhase
from hybrid_rl.placement import make_placement, meet_at_engines
from hybrid_rl.rewards import RewardScorer
from hybrid_rl.rollout_source import make_source
from hybrid_rl.runlock import take_run_lock
from hybrid_rl.scoring import compute_scores, sample_records
from hybrid_rl.tracking import Timer, Tracker, run_summary
from hybrid_rl.watchdog import StallWatchdog
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybrid_rl.workers.critic import CriticWorker


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite updates; the message names the knob and the way out."""


def _trim_metrics(path: Path, last_step: int) -> None:
    """Keep only the lines of steps <= ``last_step`` (a fresh run: none), so a resumed log has no duplicates."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in keep) if last_step > 0 else "")
    tmp.replace(path)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# val/<name>: the outcome_sums key it averages (clipped_reward_mean: the part of the accuracy that responses cut at
# the length cap earned, a lucky last number rather than an answer)
VAL_OUTCOMES = {"reward_mean": "score", "clipped_reward_mean": "clipped_score", "response_length_mean": "length",
                "response_clip_ratio": "clipped"}


class Trainer:
    def __init__(self, cfg: Config, dist: DistInfo):
        # first, before anything is written: one run per output_dir (rank 0 holds it, the others wait for its verdict)
        self.run_lock = take_run_lock(cfg.trainer.output_dir, dist.rank, dist.world_size)
        try:
            stall = cfg.trainer.stall_dump_s  # a set-up that hangs (a collective, vLLM's groups) shows its stacks too
            with StallWatchdog(stall, label="set-up") if stall > 0 else nullcontext():
                self._build(cfg, dist)
        except BaseException:
            self.run_lock.release()
            raise

    def _build(self, cfg: Config, dist: DistInfo) -> None:
        self.cfg = cfg
        self.global_dist = dist
        seed_everything(cfg.trainer.seed + dist.rank)
        self.placement = make_placement(cfg, dist)  # this rank's role and data-parallel world
        self.dist = self.placement.dist
        self.is_logger = self.placement.is_logger
        self.ckpt_root = Path(cfg.trainer.output_dir) / CHECKPOINT_SUBDIR
        self.tracker_notes: list[str] = []
        resume_from = self._resume_target()  # before anything costly is built: a mismatched resume fails at once
        d = cfg.data
        self.tokenizer = tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, cfg.model.trust_remote_code,
                                                    "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path")
        options = getattr(d, d.task, None)  # a synthetic task's own section (data.arith)
        rows = load_rows(d.train_path, d.train_split, d.hub_config, d.task, d.num_synthetic, cfg.trainer.seed,
                         options=options)
        system, chat_kwargs = env_prompt(cfg)  # an environment's tools reach the prompt (env.describe_tools)
        multi_turn = cfg.env.name is not None
        self.train_set = PromptDataset(rows, d.task, tokenizer, d.max_prompt_length, d.truncation, system,
                                       chat_kwargs, keep_messages=multi_turn)
        if multi_turn:  # a template that cannot append observations fails here, in one line
            check_template(cfg, tokenizer, self.train_set[0]["messages"])
        pl = self.placement
        self.sampler = PromptSampler(len(self.train_set), d.train_batch_size, pl.sampler_rank, pl.sampler_world,
                                     cfg.trainer.seed, d.shuffle)
        self.val_set = None
        if d.val_path and (cfg.trainer.test_freq > 0 or cfg.trainer.val_before_train):  # read only when used
            val_rows = load_rows(d.val_path, d.val_split, d.hub_config, d.task, max(d.num_synthetic // 4, 1),
                                 cfg.trainer.seed + 1, key="data.val_path", options=options, held_out=True)
            if d.max_val_samples:
                val_rows = val_rows[: d.max_val_samples]
            self.val_set = PromptDataset(val_rows, d.task, tokenizer, d.max_prompt_length, d.truncation, system,
                                         chat_kwargs, keep_messages=multi_turn)
        self.reward_fn = RewardScorer.from_config(cfg.reward, d.task)  # user functions score in worker processes
        self.task = TASKS.get(d.task)  # its answer-shape counts are logged beside the reward (None: an unknown task)
        self.reward = RewardPhase(cfg, tokenizer, self.reward_fn, self.task, self.dist)
        t = cfg.trainer
        self.total_steps = t.total_steps or t.total_epochs * self.sampler.steps_per_epoch
        self.engine_twin = meet_at_engines(cfg, pl, dist, tokenizer)  # split + vLLM: before any model is built
        self.worker = ActorRolloutRefWorker(cfg, pl.worker_dist, role=pl.role, total_training_steps=self.total_steps,
                                            tokenizer=tokenizer)
        self.critic = None  # the critic role, beside actor/rollout/ref in this process (trainer ranks only)
        if cfg.need_critic and pl.role != "rollout":
            w = self.worker
            self.critic = CriticWorker(cfg, pl.worker_dist, total_training_steps=self.total_steps,
                                       actor_packs=w.remove_padding, share_prompts=w.share_prompts, sp=w.sp)
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = alg.make_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon)  # β of KL-in-reward
        self.source = make_source(cfg, pl, self.worker, self.next_prompts, self.global_dist, tokenizer.pad_token_id,
                                  steps_left=lambda: self.total_steps - self.current_step)
        self.model_flops = ModelFlops.of(self.worker.actor.model) if self.worker.actor is not None else None
        self.peak_flops = peak_flops(self.dist.device, cfg.trainer.peak_tflops)
        self.skipped_in_a_row = 0
        self.val_owed = False  # this checkpoint step's validation was put off by a stop signal
        self.last_val: tuple[int, float] | None = None
        self.start_step = self._restore(resume_from) if resume_from is not None else 0  # nothing written before this
        self.current_step = self.start_step  # the step being run (``step`` counts); critic warm-up reads it
        if self.is_logger:
            _trim_metrics(Path(t.output_dir) / "metrics.jsonl", self.start_step)
        self.tracker = Tracker(t.output_dir, t.logger, self.total_steps, enabled=self.is_logger, initial_step=self.start_step)
        if self.is_logger and self.start_step < self.total_steps:  # "nothing to do" leaves the run's config as it was
            save_config(cfg, Path(t.output_dir) / "config.yaml")
        self.data_stats = {"data/train_prompts": len(self.train_set), "data/filtered_prompts": self.train_set.num_filtered,
                           "data/truncated_prompts": self.train_set.num_truncated}

    # -- the loop -----------------------------------------------------------------------
    def fit(self) -> list[dict[str, float]]:
        """Train to ``total_steps``; however it ends, the reward workers stop and the output_dir is free again."""
        try:
            return self._fit()
        finally:
            self.reward_fn.close()
            rollout = getattr(self.worker, "rollout", None)
            if rollout is not None and not rollout.in_process:  # an engine process (rollout.vllm.engine_process): a
                rollout.shutdown()  # finished rank leaves through os._exit, which skips the finalizers that end it
            self.run_lock.release()

    def _fit(self) -> list[dict[str, float]]:
        history, started = [], time.perf_counter()
        for note in self.tracker_notes:
            self.tracker.write(note)
        self.tracker.write(f"hybrid_rl: {self.total_steps} steps, mode {self.cfg.trainer.mode}, "
                           f"placement {self.placement.describe()}, "
                           f"{self.global_dist.world_size} rank(s), device {self.dist.device}; {self.data_stats}")
        if self.start_step >= self.total_steps:
            self.tracker.write(f"nothing to do: the checkpoint is at step {self.start_step} of {self.total_steps}; "
                               "raise trainer.total_steps (or total_epochs) to train further")
        elif self.val_set is not None and (self.val_owed or (self.start_step == 0 and self.cfg.trainer.val_before_train)):
            self._log(self.validate(), step=self.start_step)  # before training, or the one a stop put off (below)
            self.val_owed = False
        with GracefulStop() as stop:  # SIGTERM / SIGINT: finish the step, checkpoint, exit non-zero
            stop_at = self.placement.stop_check(self.global_dist.device)  # (device, group) of the per-step check
            prev_end = time.perf_counter()
            for step in range(self.start_step + 1, self.total_steps + 1):
                with self._profiled(step):
                    metrics = self.step(last=step == self.total_steps)
                now = time.perf_counter()
                if metrics:  # (split placement's rollout ranks log nothing)
                    # the loop's cadence: this step plus what ran after the last one (its validation, logging,
                    # checkpoint and the stop check, a collective over every rank, where a rank ahead of the others
                    # waits); the figure to compare modes and placements by
                    metrics["timing/iteration"] = now - prev_end
                prev_end = now
                test_freq = self.cfg.trainer.test_freq  # and at the last step, as verl does: a run ends measured
                last_val = test_freq > 0 and step == self.total_steps
                if self.val_set is not None and (self._due(step, test_freq) or last_val):
                    # a stop signal puts the validation off to the resumed run: the checkpoint comes first (a
                    # validation of a large set can outlast the grace a scheduler gives between SIGTERM and SIGKILL)
                    if step < self.total_steps and stop.agreed(*stop_at):
                        self.val_owed = True
                    else:
                        metrics.update(self.validate())
                self._log(metrics, step)
                self._guard_skipped_updates(metrics)
                history.append({"step": step, **metrics})
                save_freq = self.cfg.trainer.save_freq
                saved = save_freq >= 0 and (self._due(step, save_freq) or step == self.total_steps)
                if saved:
                    self.save(step)
                signum = stop.agreed(*stop_at) if step < self.total_steps else 0
                if signum:
                    self._stop_on_signal(step, signum, saved)
        self.source.close()
        self.tracker.close()
        self.tracker.write(self._summary(history, time.perf_counter() - started))
        return history

    def _stop_on_signal(self, step: int, signum: int, saved: bool) -> None:
        """After the step a signal arrived in: checkpoint (unless checkpoints are off), close, raise RunInterrupted."""
        import signal

        if not saved and self.cfg.trainer.save_freq >= 0:
            self.save(step)
        self.source.close()
        self.tracker.close()
        latest = find_latest(self.ckpt_root)
        where = (f"checkpoint {latest}; run the same command again to resume from it (trainer.resume=auto)"
                 if latest is not None else "no checkpoint (trainer.save_freq=-1)")
        raise RunInterrupted(signum, f"stopped by {signal.Signals(signum).name} after step {step} of {self.total_steps}: "
                                     f"{where}")

    def _log(self, metrics: dict[str, float], step: int) -> None:
        self.tracker.log(metrics, step)
        if "val/reward_mean" in metrics:
            self.last_val = (step, metrics["val/reward_mean"])

    def _summary(self, history: list[dict[str, float]], wall_s: float) -> str:
        """The end-of-run lines (logging rank): what ran, how it ended, where the results are."""
        if not self.is_logger:
            return ""
        t = self.cfg.trainer
        return run_summary(t.output_dir, t.logger, len(history), max(self.start_step, self.total_steps), wall_s,
                           [r["reward/mean"] for r in history if "reward/mean" in r], self.last_val,
                           find_latest(self.ckpt_root), t.save_freq)

    def step(self, last: bool = False) -> dict[str, float]:
        """One step: the source hands over a batch (``last``: none is generated ahead), the trainer learns from it."""
        timer = Timer(self.dist.device)  # on CUDA also each phase's peak memory
        self.current_step += 1
        with timer("step"):
            batch = self.source.next_batch(timer, last)
            if batch is None:  # split placement's rollout ranks only generate
                return {}
            metrics = self.train_on(batch, timer)
        return self._finish_metrics(metrics, timer)

    def train_on(self, batch: Batch, timer: Timer) -> dict:
        """reward → (filter groups) → old log-prob → ref log-prob → values → advantage → critic update → actor update,
        on one batch."""
        w, cfg, critic = self.worker, self.cfg, self.critic
        batch = self.source.check_staleness(batch, w.weight_version)
        batch, reward_stats = self.reward(batch, timer, self.source.next_batch)
        # a sequence-parallel group trains on all its members' rows (actor.ulysses_sequence_parallel_size)
        batch, members = gather_group_rows(batch, w.sp, self.tokenizer.pad_token_id,
                                           mini_batch_seqs(cfg.actor, w.dist.world_size, cfg.rollout.n))
        old_source = old_log_prob_source(cfg, w.num_mini_batches(batch), self._actor_updates())
        batch, skipped = old_log_probs(w, batch, old_source, timer)
        if cfg.need_ref:
            with timer("ref"):
                batch = w.compute_ref_log_prob(batch)
        if critic is not None:
            with timer("values"):
                batch = critic.compute_values(batch)
        with timer("adv"):
            batch, adv_metrics = self._advantage(batch, members)
        update_stats: dict = {"actor/old_log_prob_skipped": (skipped, 1.0)}  # the share of the pass not run
        if critic is not None:
            with timer("update_critic"):
                update_stats.update(critic.update_critic(batch))
        if self._actor_updates():
            with timer("update"):
                stats, batch = w.update_policy(batch, old_source)
                update_stats.update(stats)
        return dict(batch=own_rows(batch, members[w.sp.rank]), reward_stats=reward_stats, update_stats=update_stats,
                    adv_metrics=adv_metrics)

    def _actor_updates(self) -> bool:
        """Whether the actor updates this step (during the critic's warm-up it waits)."""
        return self.critic is None or self.current_step > self.cfg.critic.warmup_steps

    def _advantage(self, batch: Batch, members: list[np.ndarray]) -> tuple[Batch, dict[str, float]]:
        """The advantage phase under the KL controller's β, then (KL-in-reward) the controller fed this step's
        per-sequence mean KL over every rank (so β stays the same on all). ``members``: where each rank's own rows
        are in ``batch`` (``gather_group_rows``): each rank's are normalised on their own, as without sequence
        parallelism."""
        acfg = self.cfg.algorithm
        own = self.worker.sp.rank
        batch, metrics = per_member(batch, members, own,
                                    lambda rows: compute_advantage(rows, acfg, kl_coef=self.kl_ctrl.value))
        if acfg.use_kl_in_reward:
            stats = kl_in_reward_stats(own_rows(batch, members[own]), acfg)
            kl = torch.tensor(stats, dtype=torch.float64, device=self.dist.device)
            all_reduce_sum(kl, self.dist.group)
            self.kl_ctrl.update(float(kl[0] / kl[1].clamp(min=1)), int(kl[1]))
        return batch, metrics

    # -- checkpoints ---------------------------------------------------------------------
    def _rng_generators(self) -> dict:
        return self.worker.rng_generators()

    def _capture_rng(self) -> dict:
        """Global RNGs, the worker's generators and the engine's sampling RNG (saved as generator "rollout")."""
        rng = capture_rng(self._rng_generators())
        engine_rng = self.worker.rollout.rng_state() if self.worker.rollout is not None else None
        if engine_rng is not None:  # None: not capturable (vLLM samples with its own per-request RNG)
            rng["generators"]["rollout"] = engine_rng
        return rng

    def _restore_rng(self, rng: dict) -> None:
        restore_rng(rng, self._rng_generators())
        engine = self.worker.rollout
        if engine is not None and engine.rng_state() is not None:
            saved = rng.get("generators", {})
            if "rollout" not in saved:
                raise CheckpointError(f"RNG state has no generator 'rollout' (it has {sorted(saved)}): the checkpoint "
                                      f"was saved by a run whose rollout engine had no capturable sampling RNG")
            engine.set_rng_state(saved["rollout"])

    def _checkpoint_parts(self) -> tuple:
        """(model, optimizer, scheduler, DCP process group) of this rank: none on split placement's rollout ranks."""
        a = self.worker.actor
        if a is None:
            return None, None, None, None
        return a.model, a.optimizer, a.scheduler, self.placement.dcp_group

    def save(self, step: int) -> None:
        w = self.worker
        pending = self.source.pending_batch()  # waits for the in-flight batch (it must not race the RNG capture)
        extra = {"step": step, "val_owed": self.val_owed, "weight_version": w.weight_version,
                 "sampler": self.sampler.state_dict(),
                 "rng": self._capture_rng(), "skipped_in_a_row": self.skipped_in_a_row,
                 "pending_batch": pending.state_dict() if pending is not None else None,
                 "kl_ctrl": self.kl_ctrl.state_dict()}
        model, optimizer, scheduler, group = self._checkpoint_parts()
        with self._critic_resident():
            save_checkpoint(self.ckpt_root, step, model, optimizer, scheduler, extra, self.cfg.trainer.keep_last, group,
                            config=self.cfg.to_dict(), parts=self._extra_parts())

    def _extra_parts(self) -> dict:
        """Trained modules checkpointed beside the actor: the critic (model, optimizer, scheduler), when there is one."""
        return {"critic": self.critic.checkpoint_part()} if self.critic is not None else {}

    def _critic_resident(self):
        """The critic on its device while a checkpoint reads or writes it (it may be offloaded between phases)."""
        return self.critic.resident() if self.critic is not None else nullcontext()

    def _resume_target(self) -> Path | None:
        """The checkpoint ``trainer.resume`` names (None = a fresh run), its run config checked against this one."""
        resume = self.cfg.trainer.resume
        if resume == "never":
            return None
        if resume == "auto":  # `latest` is a hint: the newest complete checkpoint whose files check out, warned if not it
            path, notes = find_resumable(self.ckpt_root)
            self.tracker_notes.extend(notes)
            if path is None:
                return None
        else:
            path = Path(resume)
            if not is_complete(path):
                raise CheckpointError(f"trainer.resume={resume!r} is not a complete checkpoint (no COMPLETE marker: missing, "
                                      f"crashed or partial); point it at a <output_dir>/checkpoints/step_* directory, or use "
                                      f"trainer.resume=auto to pick the newest complete one")
            verify_checkpoint(path)  # damaged files: one line naming the file and the previous checkpoint
        self._check_resumed_config(path)
        return path

    def _restore(self, path: Path) -> int:
        """Load checkpoint ``path``; returns the step to continue after."""
        w = self.worker
        try:
            with self._critic_resident():
                extra = load_checkpoint(path, *self._checkpoint_parts(), parts=self._extra_parts())
        except CorruptCheckpointError as e:  # damage the size checks missed; under resume=auto, the previous one
            older = None
            if self.cfg.trainer.resume == "auto":
                older, notes = find_resumable(self.ckpt_root, below=int(path.name.rsplit("_", 1)[1]))
                self.tracker_notes.extend(notes)
            if older is None:
                raise
            self.tracker_notes.append(f"warning: checkpoint {path} is corrupt ({e.file} {e.problem}); "
                                      f"resuming from the previous complete checkpoint, {older}")
            self._check_resumed_config(older)
            return self._restore(older)  # it loads every tensor, over whatever the failed load had written
        w.weight_version = extra["weight_version"]
        self.sampler.load_state_dict(extra["sampler"])
        self.skipped_in_a_row = extra.get("skipped_in_a_row", 0)
        self.val_owed = bool(extra.get("val_owed", False))  # a stop put this step's validation off: run it first
        if "kl_ctrl" in extra:  # the adaptive controller's β where the run left it
            self.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        if extra.get("pending_batch") is not None:
            self.source.restore_pending(Batch.from_state_dict(extra["pending_batch"]).to(self.global_dist.device))
        self._restore_rng(extra["rng"])  # last: building models consumed the global RNG
        self.tracker_notes.append(f"resumed from {path} (step {extra['step']})")
        return int(extra["step"])

    def _check_resumed_config(self, path: Path) -> None:
        """Resuming continues the checkpoint's run: a setting that changes what is trained must not differ
        silently (ConfigError unless trainer.allow_config_change); harmless differences become a warning."""
        saved = read_checkpoint_config(path)
        if saved is None:
            self.tracker_notes.append(f"warning: {path} records no run config; resuming without comparing settings")
            return
        strict, harmless = resume_config_diff(saved, self.cfg)
        if strict and not self.cfg.trainer.allow_config_change:
            raise ConfigError(f"checkpoint {path} was trained with different settings: {', '.join(strict)}; to train with "
                              f"the new settings use a new trainer.output_dir, set trainer.resume=never to start over, or "
                              f"trainer.allow_config_change=true to continue this checkpoint with them")
        if strict:
            self.tracker_notes.append(f"warning: continuing {path} with changed training settings "
                                      f"(trainer.allow_config_change=true): {', '.join(strict)}")
        if harmless:
            note = ""
            if self.cfg.actor.lr_scheduler == "cosine" and any(k.startswith(("trainer.total_steps", "trainer.total_epochs"))
                                                               for k in harmless):
                note = " (the cosine LR schedule stretches to the new length)"
            self.tracker_notes.append(f"warning: resuming {path} with changed settings: {', '.join(harmless)}{note}")

    def _guard_skipped_updates(self, metrics: dict[str, float]) -> None:
        """A non-finite loss/grad norm skips the update; too many in a row stops the run."""
        skipped = metrics.get("actor/skipped_updates", 0) > 0 or metrics.get("critic/skipped_updates", 0) > 0
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        limit = self.cfg.trainer.max_skipped_updates
        if self.skipped_in_a_row >= limit:
            raise TrainingDiverged(f"{self.skipped_in_a_row} steps in a row had a non-finite loss or gradient norm and were "
                                   f"skipped (trainer.max_skipped_updates={limit}); lower actor.lr, check the reward "
                                   f"function, or resume from the last checkpoint in {self.ckpt_root}")

    # -- helpers ------------------------------------------------------------------------
    @contextmanager
    def _profiled(self, step: int):
        """``trainer.profile_steps``: this step under torch.profiler, summarised per rank (where the time goes);
        ``trainer.stall_dump_s``: stacks of every thread if the step takes longer."""
        stall = self.cfg.trainer.stall_dump_s
        with StallWatchdog(stall, label=f"step {step}") if stall > 0 else nullcontext():
            if step not in self.cfg.trainer.profile_steps:
                yield
                return
            yield from self._profile(step)

    def _profile(self, step: int):
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.dist.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            yield
        out = Path(self.cfg.trainer.output_dir) / "profile" / f"step_{step}_rank{self.global_dist.rank}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        table = prof.key_averages()
        parts = [f"step {step}, rank {self.global_dist.rank}", host_wait_summary(table)]
        if self.dist.device.type == "cuda":
            parts.append(table.table(sort_by="cuda_time_total", row_limit=30))
        parts.append(table.table(sort_by="cpu_time_total", row_limit=30))
        out.write_text("\n\n".join(parts))


    def next_prompts(self) -> Batch:
        items = [self.train_set[i] for i in self.sampler.next_indices()]
        # group ids unique across ranks and steps, so grouping can never mix prompts
        batch = collate_prompts(items, self.tokenizer.pad_token_id)
        uid = np.array([f"{self.sampler.epoch}-{it['index']}" for it in items], dtype=object)
        return batch.union(non_tensors=dict(uid=uid))

    def _write_validation_records(self, records: list[dict], rank: int) -> None:
        """``trainer.validation_data_dir``: this rank's validation samples of the current step, one JSON per line."""
        path = Path(self.cfg.trainer.output_dir) / self.cfg.trainer.validation_data_dir
        path /= f"step_{self.current_step:08d}_rank{rank}.jsonl"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
            tmp.replace(path)
        except OSError as e:
            raise OSError(f"trainer.validation_data_dir: cannot write {path} ({e.strerror or e}); point it at a "
                          f"writable directory, or set it to '' to stop writing validation samples") from e

    @staticmethod
    def _due(step: int, freq: int) -> bool:
        return freq > 0 and step % freq == 0

    def _finish_metrics(self, parts: dict, timer: Timer) -> dict[str, float]:
        """The step's metrics: gathered on this rank, reduced over the training ranks, completed (``metrics.py``,
        ``perf.py``)."""
        batch, dist = parts["batch"], self.dist
        means, maxima = step_metrics(batch, self.cfg.data.max_response_length,
                                     {**parts["reward_stats"], **parts["update_stats"]}, parts["adv_metrics"])
        means.update(step_perf_means(batch, self.model_flops, self.worker.take_pass_work()))
        times = timer.pop()
        sync_s, sync_bytes = self.source.sync_stats()
        out = reduce_weighted_means(means, dist.device, dist.group)
        out.update(reduce_max({**maxima, **step_times(times, sync_s), **timer.memory_metrics()}, dist.device,
                              dist.group))
        finish_step_metrics(out, batch.meta, sync_bytes, dist.world_size)
        step_perf_metrics(out, dist.world_size, self.global_dist.world_size, self.model_flops, self.peak_flops,
                          self.cfg.actor.ppo_epochs, dist.device, self.worker.rollout, timer.step_peaks)
        return out

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Greedy pass@1 on the validation prompts with the current weights (every rank takes its share)."""
        start = time.perf_counter()
        out = dict(self.source.validate(self._validate_on_engine, self.dist))
        out["timing/validate"] = time.perf_counter() - start  # outside timing/step, inside the next timing/iteration
        return out

    def _validate_on_engine(self, rank: int, world: int) -> dict[str, float]:
        assert self.val_set is not None
        idx = list(range(rank, len(self.val_set), world))
        chunk = self.cfg.data.val_batch_size or self.cfg.data.train_batch_size
        # the same keys on every rank (one all-reduce), also on a rank with no validation prompts
        names = list(VAL_OUTCOMES)
        names += list(self.task.answer_stats([])) if self.task is not None else []
        sums = {f"val/{k}": 0.0 for k in names}
        count = 0.0
        # a validation set of several sources (arith's families) also reports each one's accuracy
        sources = self.val_set.sources if len(self.val_set.sources) > 1 else []
        by_source = {f"val/reward_mean/{src}": [0.0, 0.0] for src in sources}
        records: list[dict] | None = [] if self.cfg.trainer.validation_data_dir else None
        tool_use = zero_pairs("val/env") if self.cfg.env.name is not None else {}  # multi-turn: val/env/*
        for s in range(0, len(idx), chunk):
            prompts = collate_prompts([self.val_set[i] for i in idx[s:s + chunk]], self.tokenizer.pad_token_id)
            out = self.worker.generate(prompts, validate=True)
            out, stats = compute_scores(out, self.tokenizer, self.reward_fn, self.cfg.reward.on_error, self.task,
                                        prefix="val")
            stats.pop("val/errors")
            outcome = outcome_sums(out.tensors["scores"], out.tensors["response_mask"], self.cfg.data.max_response_length)
            stats.update({f"val/{name}": (outcome[key], len(out)) for name, key in VAL_OUTCOMES.items()})
            for k, (v, _) in stats.items():
                sums[k] += v
            count += len(out)
            if by_source:
                for src, score in zip(out.non_tensors["data_source"], out.tensors["scores"].tolist()):
                    by_source[f"val/reward_mean/{src}"][0] += score
                    by_source[f"val/reward_mean/{src}"][1] += 1
            if records is not None:
                records += sample_records(out, self.tokenizer)
            if tool_use:
                add_pairs(tool_use, env_metrics(out, "val/env")[0])
        if records is not None:
            self._write_validation_records(records, rank)
        stats = {k: (v, count) for k, v in sums.items()}
        stats.update({k: (v, n) for k, (v, n) in by_source.items()})
        stats.update(tool_use)
        return reduce_weighted_means(stats, self.dist.device, self.dist.group)
