"""The driver: every rank runs this loop on its own shard of the prompts (SPMD).

``fit`` reads top to bottom: a validation before training where asked, then one ``step`` per training step, each
followed by its validation, logging, checkpoint and the stop-signal check. Every mode and placement runs the same
``step``: a ``RolloutSource`` (``modes/sources.py``: sync, one-step overlap, split placement, partial rollouts)
hands over the batch, and ``train_on`` runs reward → old log-prob → ref → values → advantage → critic update → actor
update on it, one call per phase under a named timer (``phases/``); the critic's phases run when the estimator needs
one, and the first ``critic.freeze_actor_steps`` steps update the critic only. Metrics are gathered per rank,
reduced over the training ranks (``telemetry/metrics.py``, ``telemetry/perf.py``) and logged by one rank (under
split placement the first trainer rank).
``__init__`` is the set-up (data, reward function, worker, critic, source); checkpoints and resuming are the
``Checkpointer``'s (``checkpoint/checkpointer.py``), validation the ``Validator``'s (``validation.py``). Left out on
purpose: a single controller (there is none: torch.distributed is the engine).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

from hybrid_rl import algorithms as alg
from hybrid_rl.batch import Batch
from hybrid_rl.checkpoint.checkpointer import TrainingDiverged  # noqa: F401 (importable from here too)
from hybrid_rl.checkpoint.checkpointer import Checkpointer, LoopState, resume_target
from hybrid_rl.checkpoint.rng import seed_everything
from hybrid_rl.config import Config, mini_batch_seqs, save_config
from hybrid_rl.data import TASKS, PromptFeed
from hybrid_rl.distributed import DistInfo, reduce_max, reduce_weighted_means
from hybrid_rl.envs.multiturn import check_template
from hybrid_rl.interrupt import GracefulStop, RunInterrupted
from hybrid_rl.models import model_tokenizer
from hybrid_rl.modes.placement import make_placement, meet_at_engines
from hybrid_rl.modes.sources import make_source
from hybrid_rl.phases.advantage import AdvantagePhase
from hybrid_rl.phases.balance import balance_rows
from hybrid_rl.phases.group_rows import gather_group_rows, own_rows
from hybrid_rl.phases.old_log_prob import old_log_probs, plan_old_log_prob
from hybrid_rl.phases.reward import RewardPhase
from hybrid_rl.rewards.weighted import WeightedRewards
from hybrid_rl.rewards.model import RewardModel
from hybrid_rl.rewards.remote import RemoteReward
from hybrid_rl.runlock import take_run_lock
from hybrid_rl.telemetry.gc_pauses import StepCollection
from hybrid_rl.telemetry.metrics import finish_step_metrics, step_metrics, step_times
from hybrid_rl.telemetry.perf import ModelFlops, peak_flops, step_perf_means, step_perf_metrics, watched_step
from hybrid_rl.telemetry.tracking import Timer, Tracker, run_summary, trim_metrics
from hybrid_rl.validation import Validator, load_val_set
from hybrid_rl.watchdog import StallWatchdog
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybrid_rl.workers.critic import CriticWorker


class Trainer:
    def __init__(self, cfg: Config, dist: DistInfo):
        # first, before anything is written: one run per output_dir (rank 0 holds it, the others wait for its verdict)
        self.run_lock = take_run_lock(cfg.trainer.output_dir, dist.rank, dist.world_size)
        try:
            stall = cfg.trainer.stall_dump_s  # a set-up that hangs (a collective, vLLM's groups) shows its stacks too
            with StallWatchdog(stall, label="set-up") if stall > 0 else nullcontext():
                self._build(cfg, dist)
        except BaseException:
            self._close_tracker()
            self.run_lock.release(discard=True)  # a refused run leaves no directory it created
            raise

    def _build(self, cfg: Config, dist: DistInfo) -> None:
        self.cfg = cfg
        self.global_dist = dist
        seed_everything(cfg.trainer.seed + dist.rank)
        self.placement = make_placement(cfg, dist)  # this rank's role and data-parallel world
        self.dist = self.placement.dist
        self.is_logger = self.placement.is_logger
        self.tracker_notes: list[str] = []
        resume_from = resume_target(cfg, self.tracker_notes)  # before anything costly: a mismatched resume fails now
        self.tokenizer = tokenizer = model_tokenizer(cfg.model)
        pl = self.placement
        self.prompts = PromptFeed(cfg, tokenizer, pl.sampler_rank, pl.sampler_world)  # this rank's training prompts
        if cfg.env.name is not None:  # a template that cannot append observations fails here, in one line
            check_template(cfg, tokenizer, self.prompts.dataset[0]["messages"])
        val_set = load_val_set(cfg, tokenizer)  # None where no validation runs
        self.reward_fn = WeightedRewards.from_config(cfg.reward, cfg.data.task)  # user functions score in worker processes
        self.task = TASKS.get(cfg.data.task)  # its answer-shape counts are logged beside the reward (None: unknown)
        # a reward model (reward.model.path), a copy per rank: loaded now, so that a bad path fails before any training
        self.reward_model = RewardModel(cfg.reward.model, dist.device) if cfg.reward.model.path else None
        self.remote_reward = RemoteReward(cfg.reward.remote) if cfg.reward.remote.url else None
        self.reward = RewardPhase(cfg, tokenizer, self.reward_fn, self.task, self.dist, self.reward_model,
                                  self.remote_reward)
        t = cfg.trainer
        self.total_steps = t.total_steps or t.total_epochs * self.prompts.sampler.steps_per_epoch
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
        self.advantage = AdvantagePhase(cfg.algorithm, self.kl_ctrl, self.dist)
        self.source = make_source(cfg, pl, self.worker, self.prompts, self.global_dist, tokenizer.pad_token_id,
                                  steps_left=lambda: self.total_steps - self.current_step)
        self.validator = None if val_set is None else Validator(cfg, val_set, tokenizer, self.worker, self.reward_fn,
                                                                  self.task, self.dist, lambda: self.current_step,
                                                                  self.reward_model, self.remote_reward)
        self.model_flops = ModelFlops.of(self.worker.actor.model) if self.worker.actor is not None else None
        self.peak_flops = peak_flops(self.dist.device, cfg.trainer.peak_tflops)
        self.checkpointer = Checkpointer(cfg, pl, self.worker, self.critic, self.source, self.prompts.sampler,
                                         self.kl_ctrl, self.tracker_notes)
        self.loop = LoopState()  # what checkpoints carry of the loop: skipped updates, a validation a stop put off
        self.last_val: tuple[int, float] | None = None
        self.start_step = 0  # nothing written before this
        if resume_from is not None:
            self.start_step, self.loop = self.checkpointer.restore(resume_from)
        self.current_step = self.start_step  # the step being run (``step`` counts); critic.freeze_actor_steps reads it
        if self.is_logger:
            trim_metrics(Path(t.output_dir) / "metrics.jsonl", self.start_step)
        self.tracker = Tracker(t.output_dir, t.logger, self.total_steps, enabled=self.is_logger, initial_step=self.start_step,
                               project=t.project_name, name=t.experiment_name, config=cfg.to_dict())
        if self.is_logger and self.start_step < self.total_steps:  # "nothing to do" leaves the run's config as it was
            save_config(cfg, Path(t.output_dir) / "config.yaml")

    # -- the loop -----------------------------------------------------------------------
    def fit(self) -> list[dict[str, float]]:
        """Train to ``total_steps``; however it ends, the trainer is closed (``close``)."""
        try:
            return self._fit()
        finally:
            self.close()

    def close(self) -> None:
        """End what the trainer holds, on every exit path: the progress bar (so that an error printed next is a line
        of its own, not the bar's tail), the metric files, the reward workers, an engine process, and the output_dir's
        lock. Idempotent; ``fit`` calls it, a trainer that is built but never fitted needs it too."""
        self._close_tracker()
        self.reward_fn.close()
        rollout = getattr(self.worker, "rollout", None)
        if rollout is not None and not rollout.in_process:  # an engine process (rollout.vllm.engine_process): a
            rollout.shutdown()  # finished rank leaves through os._exit, which skips the finalizers that end it
        self.run_lock.release()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _close_tracker(self) -> None:
        tracker = getattr(self, "tracker", None)  # absent when set-up failed before it
        if tracker is not None:
            tracker.close()

    def _fit(self) -> list[dict[str, float]]:
        history, started = [], time.perf_counter()
        for note in self.tracker_notes:
            self.tracker.write(note)
        self.tracker.write(f"hybrid_rl: {self.total_steps} steps, mode {self.cfg.trainer.mode}, "
                           f"placement {self.placement.describe()}, "
                           f"{self.global_dist.world_size} rank(s), device {self.dist.device}; {self.prompts.stats()}")
        if self.cfg.trainer.val_only:  # validate the weights as they are, then stop
            return self._validate_only(started)
        if self.start_step >= self.total_steps:
            self.tracker.write(f"nothing to do: the checkpoint is at step {self.start_step} of {self.total_steps}; "
                               "raise trainer.total_steps (or total_epochs) to train further")
        elif self.validator is not None and (self.loop.val_owed or (self.start_step == 0 and
                                                                     self.cfg.trainer.val_before_train)):
            self._log(self.validate(), step=self.start_step)  # before training, or the one a stop put off (below)
            self.loop.val_owed = False
        collector = StepCollection(self.cfg.trainer.gc_steps)  # trainer.gc_steps: collect between steps only
        collector.start()
        try:
            self._steps(history, collector)
        finally:
            collector.stop()
        self.source.close()
        self.tracker.close()
        self.tracker.write(self._summary(history, time.perf_counter() - started))
        return history

    def _validate_only(self, started: float) -> list[dict[str, float]]:
        """``trainer.val_only``: one validation of the current weights, logged at the current step; no step runs."""
        metrics = self.validate()
        self._log(metrics, step=self.start_step)
        self.source.close()
        self.tracker.close()
        if self.is_logger:
            self.tracker.write(f"validated step {self.start_step} in {time.perf_counter() - started:.0f} s "
                               f"(trainer.val_only): val/reward_mean {metrics.get('val/reward_mean', float('nan')):.4f}; "
                               f"metrics in {self.cfg.trainer.output_dir}; nothing trained")
        return [{"step": self.start_step, **metrics}]

    def _steps(self, history: list[dict[str, float]], collector: StepCollection) -> None:
        """Steps ``start_step + 1 .. total_steps``, each logged into ``history``, validated and saved when due."""
        with GracefulStop() as stop:  # SIGTERM / SIGINT: finish the step, checkpoint, exit non-zero
            stop_at = self.placement.stop_check(self.global_dist.device)  # (device, group) of the per-step check
            prev_end = time.perf_counter()
            for step in range(self.start_step + 1, self.total_steps + 1):
                with watched_step(self.cfg, step, self.global_dist.rank, self.dist.device):
                    metrics = self.step(last=step == self.total_steps)
                gc_s = collector.after_step(step)
                if metrics and gc_s is not None:
                    metrics["timing/gc"] = gc_s
                now = time.perf_counter()
                if metrics:  # (split placement's rollout ranks log nothing)
                    # the loop's cadence: this step plus what ran after the last one (its validation, logging,
                    # checkpoint and the stop check, a collective over every rank, where a rank ahead of the others
                    # waits); the figure to compare modes and placements by
                    metrics["timing/iteration"] = now - prev_end
                prev_end = now
                test_freq = self.cfg.trainer.test_freq  # and at the last step, as verl does: a run ends measured
                last_val = test_freq > 0 and step == self.total_steps
                if self.validator is not None and (self._due(step, test_freq) or last_val):
                    # a stop signal puts the validation off to the resumed run: the checkpoint comes first (a
                    # validation of a large set can outlast the grace a scheduler gives between SIGTERM and SIGKILL)
                    if step < self.total_steps and stop.agreed(*stop_at):
                        self.loop.val_owed = True
                    else:
                        metrics.update(self.validate())
                self._log(metrics, step)
                self.loop.count_skipped(metrics, self.cfg.trainer.max_skipped_updates, self.checkpointer.root)
                history.append({"step": step, **metrics})
                save_freq = self.cfg.trainer.save_freq
                saved = save_freq >= 0 and (self._due(step, save_freq) or step == self.total_steps)
                if saved:
                    self.checkpointer.save(step, self.loop)
                signum = stop.agreed(*stop_at) if step < self.total_steps else 0
                if signum:
                    self._stop_on_signal(step, signum, saved)

    def _stop_on_signal(self, step: int, signum: int, saved: bool) -> None:
        """After the step a signal arrived in: checkpoint (unless checkpoints are off), close, raise RunInterrupted."""
        import signal

        if not saved and self.cfg.trainer.save_freq >= 0:
            self.checkpointer.save(step, self.loop)
        self.source.close()
        self.tracker.close()
        latest = self.checkpointer.latest()
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
                           self.checkpointer.latest(), t.save_freq)

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
        old_plan = plan_old_log_prob(cfg, w, batch, self._actor_updates())
        batch = old_log_probs(w, batch, old_plan, timer)
        if cfg.need_ref:
            with timer("ref"):
                batch = w.compute_ref_log_prob(batch)
        if critic is not None:
            with timer("values"):
                batch = critic.compute_values(batch)
        with timer("adv"):
            batch, adv_metrics = self.advantage(batch, members, w.sp.rank)
        update_stats: dict = {"actor/old_log_prob_skipped": (old_plan.skipped, 1.0)}  # the share of the pass not run
        if cfg.trainer.balance_batch and w.sp.size == 1 and w.dist.world_size > 1:  # even tokens per rank per mini-batch
            with timer("balance"):
                batch, balance_stats = balance_rows(batch, w.dist, self.tokenizer.pad_token_id,
                                                    mini_batch_seqs(cfg.actor, w.dist.world_size, cfg.rollout.n))
            update_stats.update({k: (v, 1.0) for k, v in balance_stats.items()})
        if critic is not None:
            with timer("update_critic"):
                update_stats.update(critic.update_critic(batch))
        if self._actor_updates():
            with w.optimizer_trip(timer), timer("update"):
                stats, batch = w.update_policy(batch, old_plan)
                update_stats.update(stats)
        return dict(batch=own_rows(batch, members[w.sp.rank]), reward_stats=reward_stats, update_stats=update_stats,
                    adv_metrics=adv_metrics)

    def _actor_updates(self) -> bool:
        """Whether the actor updates this step (it stays frozen for the first ``critic.freeze_actor_steps``)."""
        return self.critic is None or self.current_step > self.cfg.critic.freeze_actor_steps

    # -- helpers ------------------------------------------------------------------------
    @staticmethod
    def _due(step: int, freq: int) -> bool:
        return freq > 0 and step % freq == 0

    def _finish_metrics(self, parts: dict, timer: Timer) -> dict[str, float]:
        """The step's metrics: gathered on this rank, reduced over the training ranks, completed
        (``telemetry/metrics.py``, ``telemetry/perf.py``)."""
        batch, dist = parts["batch"], self.dist
        means, maxima = step_metrics(batch, self.cfg.data.max_response_length,
                                     {**parts["reward_stats"], **parts["update_stats"]}, parts["adv_metrics"])
        means.update(step_perf_means(batch, self.model_flops, self.worker.take_pass_work()))
        times = timer.pop()
        sync_s, sync_bytes = self.source.sync_stats()
        out = reduce_weighted_means(means, dist.device, dist.group)
        maxima = {**maxima, **step_times(times, sync_s), **timer.memory_metrics(), **timer.micro_batch_metrics(),
                  **timer.gc_metrics()}
        out.update(reduce_max(maxima, dist.device, dist.group))
        finish_step_metrics(out, batch.meta, sync_bytes, dist.world_size)
        step_perf_metrics(out, dist.world_size, self.global_dist.world_size, self.model_flops, self.peak_flops,
                          self.cfg.actor.ppo_epochs, dist.device, self.worker.rollout, timer.step_peaks)
        return out

    def validate(self) -> dict[str, float]:
        """Greedy pass@1 on the validation prompts with the current weights (``validation.py``)."""
        return self.validator(self.source)
