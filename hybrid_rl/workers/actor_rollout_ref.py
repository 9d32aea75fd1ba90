"""``ActorRolloutRefWorker``: one per GPU, holding the actor, the reference policy and the rollout engine.

The role string (``actor``, ``rollout``, ``ref``, ``actor_rollout``,
``actor_rollout_ref``) decides which parts are built, as in verl. The actor is
a ``TrainingEngine`` with an optimizer; the reference (only built when a KL
term needs it) is a frozen copy loaded from the same checkpoint, optionally
parked on CPU between uses, or with LoRA the actor itself with its adapters
disabled; the rollout
engine holds its own weights, refreshed by the sharding manager returned from
``rollout_mode()``. ``update_policy`` is the PPO update: epochs × mini-batches ×
micro-batches with gradient accumulation, each micro-batch loss normalised by
the *mini-batch's global* token/sequence counts so that any micro-batch split
(and any number of ranks) gives the same gradient up to rounding. Where π_old
comes from is the step's ``OldLogProbPlan`` (``phases/old_log_prob.py``):
``compute_old_log_probs(batch, plan)`` runs the pass the plan asks for, and
``update_policy(batch, plan)`` fills the rest from the update's own first
forward where the plan says so.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

from hybrid_rl import algorithms as alg
from hybrid_rl.batch import Batch, row_index
from hybrid_rl.config import Config, lr_schedule_steps, mini_batch_seqs, parse_forced_lengths
from hybrid_rl.micro_batching import micro_batches
from hybrid_rl.distributed import DistInfo, all_reduce_sum
from hybrid_rl.liger import apply_liger
from hybrid_rl.telemetry.metrics import cut_at_cap
from hybrid_rl.models import apply_lora, load_causal_lm, model_tokenizer, resolve_dtype
from hybrid_rl.telemetry.perf import Work
from hybrid_rl.rollout import rollout_engine_class
from hybrid_rl.rollout.base import RolloutEngine, SamplingParams
from hybrid_rl.weights.sharding_manager import ShardingManager
from hybrid_rl.workers.fsdp_engine import AdapterDisabledReference, FrozenReference, TrainingEngine
from hybrid_rl.workers.materialize import reads_weights
from hybrid_rl.workers.packed import packs_by_default
from hybrid_rl.workers.ulysses import SP_KEY, check_heads, data_parallel, make_groups

if TYPE_CHECKING:
    from hybrid_rl.phases.old_log_prob import OldLogProbPlan

ROLES = ("actor", "rollout", "ref", "actor_ref", "actor_rollout", "actor_rollout_ref")


@dataclass
class UpdateStats:
    """Per-update metric accumulators: (sum, count) pairs reduced across ranks by the driver.

    Values and weights may be device tensors: they are summed on the device and read back once in
    ``pairs()``, so the update loop never stalls the GPU queue to log a metric.
    """

    sums: dict[str, float | torch.Tensor] = field(default_factory=dict)
    counts: dict[str, float | torch.Tensor] = field(default_factory=dict)

    def add(self, key: str, value: float | torch.Tensor, weight: float | torch.Tensor = 1.0) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().double()
        self.sums[key] = self.sums.get(key, 0.0) + value * weight
        self.counts[key] = self.counts.get(key, 0.0) + weight

    def pairs(self) -> dict[str, tuple[float, float]]:
        keys = list(self.sums)
        flat = [v for k in keys for v in (self.sums[k], self.counts[k])]
        tensors = [v for v in flat if isinstance(v, torch.Tensor)]
        if tensors:  # one device-to-host copy for all of them (a CPU tensor, e.g. from offloaded state, joins them)
            device = next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)
            values = iter(torch.stack([t.double().reshape(()).to(device) for t in tensors]).tolist())
            flat = [next(values) if isinstance(v, torch.Tensor) else float(v) for v in flat]
        return {k: (float(flat[2 * i]), float(flat[2 * i + 1])) for i, k in enumerate(keys)}


class ActorRolloutRefWorker:
    def __init__(self, cfg: Config, dist: DistInfo, role: str = "actor_rollout_ref", total_training_steps: int = 1,
                 tokenizer=None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.cfg = cfg
        self.dist = dist
        self.is_actor = role.startswith("actor")
        self.is_rollout = "rollout" in role
        self.is_ref = role.endswith("ref") and cfg.need_ref
        self.weight_version = 0
        self.device = dist.device
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        self.rollout_dtype = resolve_dtype(cfg.rollout_dtype, self.device)
        """The engine's weight dtype: what the push casts to (``rollout.dtype``)."""
        mcfg = cfg.model
        on_gpu = self.device.type == "cuda"  # null = the device's default (see ActorConfig)
        packs = packs_by_default(self.device, self.dtype)
        self.remove_padding = packs if cfg.actor.use_remove_padding is None else cfg.actor.use_remove_padding
        self.fused_logprob = on_gpu if cfg.actor.fused_logprob is None else cfg.actor.fused_logprob
        share = cfg.actor.share_prompts
        self.share_prompts = (on_gpu and self.remove_padding) if share is None else share
        if self.share_prompts and not self.remove_padding:
            raise ValueError("actor.share_prompts=true shares prompts inside a packed row, but this run does not pack "
                             f"(actor.use_remove_padding={cfg.actor.use_remove_padding} on {self.device.type}): set "
                             "actor.use_remove_padding=true, or actor.share_prompts=false")
        sp = cfg.actor.ulysses_sequence_parallel_size
        if sp > 1 and not self.remove_padding:
            raise ValueError(f"{SP_KEY}={sp} cuts packed rows, but this run does not pack (actor.use_remove_"
                             f"padding={cfg.actor.use_remove_padding} on {self.device.type}): set "
                             "actor.use_remove_padding=true")
        self.sp = make_groups(sp, dist.group) if sp > 1 else data_parallel(dist.rank, dist.world_size)
        """This rank's sequence-parallel group and data-parallel share (``workers/ulysses.py``)."""
        # the driver loads the tokenizer once (for its datasets) and passes it in
        self.tokenizer = tokenizer if tokenizer is not None else model_tokenizer(mcfg)

        self.actor: TrainingEngine | None = None
        if self.is_actor:
            # only the data-parallel group's first rank reads the weights: the engine loads the others' shards
            # from it (workers/materialize.py)
            model = load_causal_lm(mcfg.path, torch.float32, mcfg.trust_remote_code,
                                   on_meta=not reads_weights(dist.group))
            check_heads(model.config, sp, SP_KEY)
            if mcfg.use_liger:  # before LoRA wraps the linears and FSDP2 shards the blocks
                apply_liger(model, self.device)
            if mcfg.lora.rank > 0:
                model = apply_lora(model, mcfg.lora.rank, mcfg.lora.alpha, mcfg.lora.target_modules, mcfg.lora.dropout)
            self.actor = TrainingEngine(model, self.device, self.dtype, trainable=True,
                                        gradient_checkpointing=mcfg.enable_gradient_checkpointing,
                                        accumulate_unsharded=cfg.actor.accumulate_unsharded,
                                        compile_blocks=cfg.actor.use_torch_compile, group=dist.group,
                                        remove_padding=self.remove_padding, fused_logprob=self.fused_logprob,
                                        share_prompts=self.share_prompts, sp=self.sp,
                                        frozen_dtype=self.dtype if mcfg.lora.rank > 0 and
                                        mcfg.lora.base_dtype == "compute" else None)
            a = cfg.actor
            self.actor.configure_optimizer(a.lr, (a.betas[0], a.betas[1]), a.weight_decay, a.lr_warmup_steps, a.lr_scheduler,
                                           lr_schedule_steps(a, cfg.data.train_batch_size, total_training_steps),
                                           a.min_lr_ratio, a.optimizer_impl)
        self.ref: FrozenReference | AdapterDisabledReference | None = None
        if self.is_ref:
            if mcfg.lora.rank > 0 and self.actor is not None:
                # LoRA: the reference is the base model, i.e. the actor with its adapters off (no second copy)
                self.ref = AdapterDisabledReference(self.actor)
            else:
                ref_model = load_causal_lm(mcfg.path, self.dtype, mcfg.trust_remote_code,
                                           on_meta=not reads_weights(dist.group))
                if mcfg.use_liger:
                    apply_liger(ref_model, self.device)
                # accumulate_unsharded: the reference's pass gathers each block once, not once per micro-batch
                ref_engine = TrainingEngine(ref_model, self.device, self.dtype, trainable=False, group=dist.group,
                                            accumulate_unsharded=cfg.actor.accumulate_unsharded,
                                            remove_padding=self.remove_padding, fused_logprob=self.fused_logprob,
                                            share_prompts=self.share_prompts, sp=self.sp)
                self.ref = FrozenReference(ref_engine, offload=cfg.ref.offload)
        self.rollout: RolloutEngine | None = None
        self.sharding_manager: ShardingManager | None = None
        self.multi_turn = None
        """``env.name`` set: the multi-turn rollout loop ``generate`` runs on the engine (``envs/multiturn.py``)."""
        if self.is_rollout:
            self.rollout = self._build_rollout()
            if cfg.env.name is not None:
                from hybrid_rl.envs.multiturn import MultiTurnRollout

                self.multi_turn = MultiTurnRollout(cfg, self.tokenizer, self.rollout.eos_token_ids)
            if self.actor is not None:
                r = cfg.rollout
                self.sharding_manager = ShardingManager(
                    self.actor, self.rollout, lambda: self.weight_version, dtype=self.rollout_dtype,
                    bucket_mb=r.weight_sync_bucket_mb, free_cache_engine=cfg.engine_sleeps, sleep_level=r.sleep_level,
                    param_offload=cfg.actor.param_offload, optimizer_offload=cfg.actor.optimizer_offload,
                    replay=r.weight_load_replay and self.rollout.in_process)
        # dynamic batch size: micro-batches cut by padded tokens instead of a sequence count
        self._token_budget = cfg.actor.max_token_len_per_device if cfg.actor.use_dynamic_bsz else None
        # one stream per data-parallel share: a sequence-parallel group cuts its rows into the same mini-batches
        self._shuffle_rng = np.random.default_rng(cfg.trainer.seed + 7919 * self.sp.dp_rank)
        self._length_rng = np.random.default_rng(cfg.trainer.seed + 104729 * (dist.rank + 1))
        self.pass_work: dict[str, Work] = {}
        """What each training pass ("update", "old_log_prob", "ref") computed since ``take_pass_work`` (``perf``)."""

    def rng_generators(self) -> dict[str, np.random.Generator]:
        """The worker's own random streams (mini-batch shuffling, forced lengths), for checkpoints."""
        return {"shuffle": self._shuffle_rng, "lengths": self._length_rng}

    # -- rollout ------------------------------------------------------------------------
    def _build_rollout(self) -> RolloutEngine:
        """Whichever engine class ``rollout.name`` names in ``hybrid_rl.rollout.ROLLOUT_ENGINES``."""
        return rollout_engine_class(self.cfg.rollout.name).from_config(self.cfg, self.dist, self.tokenizer)

    def rollout_mode(self) -> ShardingManager:
        if self.sharding_manager is None:
            raise RuntimeError("rollout_mode() needs a worker with both the actor and rollout roles")
        return self.sharding_manager

    def sampling_params(self, validate: bool = False) -> SamplingParams:
        r = self.cfg.rollout
        turns = self.cfg.env.name is not None  # a conversation's segments carry their log-probs
        if validate:
            return SamplingParams(n=r.val_n, temperature=r.val_temperature, top_p=1.0 if r.val_temperature == 0 else r.top_p,
                                  top_k=0, max_tokens=self.cfg.data.max_response_length, logprobs=turns)
        return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              max_tokens=self.cfg.data.max_response_length, logprobs=self.cfg.engine_logprobs)

    def generate(self, prompts: Batch, validate: bool = False) -> Batch:
        """Responses for ``prompts`` (n each) with the sampled tokens' log-probs; call inside ``rollout_mode()``."""
        assert self.rollout is not None
        params = self.sampling_params(validate)
        if self.cfg.rollout.forced_lengths and not validate:
            params = dataclasses.replace(params, response_lengths=self.forced_lengths(len(prompts) * params.n))
        version = self.rollout.weights_version
        if self.multi_turn is not None:  # conversations with the environment, turn by turn
            out = self.multi_turn.generate(self.rollout, prompts, params, version)
        else:
            out = self.rollout.generate(prompts, params)
        # every sample records the weight version that produced it (staleness accounting)
        versions = torch.full((len(out),), -1 if version is None else version, dtype=torch.long)
        return out.union(tensors=dict(weight_version=versions.to(out.tensors["responses"].device)),
                         weight_version=version, temperature=params.logprob_temperature)

    def forced_lengths(self, count: int) -> tuple[int, ...]:
        """Benchmark response lengths: a long-tailed draw (lognormal with the given mean), capped."""
        kind, nums = parse_forced_lengths(self.cfg.rollout.forced_lengths)
        cap = self.cfg.data.max_response_length
        if kind == "fixed":
            return tuple([min(int(nums[0]), cap)] * count)
        mean, sigma = nums
        mu = np.log(mean) - sigma**2 / 2  # so that E[length] = mean before capping
        draws = self._length_rng.lognormal(mu, sigma, size=count)
        return tuple(int(x) for x in np.clip(np.round(draws), 1, cap))

    # -- work counted per pass ------------------------------------------------------------
    @contextmanager
    def _counted(self, name: str, engine: TrainingEngine):
        """Adds what ``engine``'s forwards compute inside to ``pass_work[name]``."""
        engine.work = Work()
        try:
            yield
        finally:
            self.pass_work.setdefault(name, Work()).add(engine.work)
            engine.work = Work()

    def take_pass_work(self) -> dict[str, Work]:
        """The passes' work since the last call (the step's), and start counting afresh."""
        work, self.pass_work = self.pass_work, {}
        return work

    # -- log-probs ----------------------------------------------------------------------
    def compute_old_log_probs(self, batch: Batch, plan: OldLogProbPlan) -> Batch:
        """π_old as far as ``plan`` has the separate pass compute it, for ``update_policy(batch, plan)``: the engine's
        log-probs, the pass over the whole batch, over every row but the update's first mini-batch (those hold 0
        until the update fills them), or nothing where that mini-batch is the whole batch."""
        if plan.from_engine:
            return self.engine_log_probs_as_old(batch)
        if plan.first_order is None:
            return self.compute_log_prob(batch)
        rest = np.sort(plan.first_order[self._seqs_per_mini():])
        if not len(rest):
            return batch
        # every rank runs this (FSDP collectives): each skips one mini-batch of the same size
        a = self.cfg.actor
        lp = torch.zeros(batch.tensors["responses"].shape, device=self.device)
        ent = torch.zeros_like(lp)
        with self._counted("old_log_prob", self.actor):
            part_lp, part_ent = self.actor.compute_log_prob(
                batch.index(rest), a.log_prob_micro_batch_size_per_device, batch.meta["temperature"],
                with_entropy=True, max_tokens=self._token_budget)
        where = row_index(rest, self.device)
        lp[where, :part_lp.shape[1]] = part_lp
        ent[where, :part_ent.shape[1]] = part_ent
        return batch.union(tensors=dict(old_log_probs=lp, old_entropy=ent))

    def compute_log_prob(self, batch: Batch) -> Batch:
        """``old_log_probs`` under the current actor weights (the PPO proximal policy)."""
        assert self.actor is not None
        with self._counted("old_log_prob", self.actor):
            lp, ent = self.actor.compute_log_prob(batch, self.cfg.actor.log_prob_micro_batch_size_per_device,
                                                  batch.meta["temperature"], with_entropy=True,
                                                  max_tokens=self._token_budget)
        return batch.union(tensors=dict(old_log_probs=lp, old_entropy=ent))

    def engine_log_probs_as_old(self, batch: Batch) -> Batch:
        """``actor.old_log_prob=engine``: the rollout engine's log-probs of the sampled tokens stand in for π_old."""
        if "rollout_log_probs" not in batch.tensors:
            raise ValueError(f"actor.old_log_prob=engine uses the rollout engine's log-probs as π_old, but rollout.name="
                             f"{self.cfg.rollout.name} returned none (no 'rollout_log_probs' in the batch); use "
                             f"actor.old_log_prob=auto or recompute")
        return batch.union(tensors=dict(old_log_probs=batch.tensors["rollout_log_probs"].clone()))

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        assert self.ref is not None
        with self._counted("ref", self.ref.engine):
            lp, _ = self.ref.compute_log_prob(batch, self.cfg.ref.log_prob_micro_batch_size_per_device,
                                              batch.meta["temperature"], max_tokens=self._token_budget)
        return batch.union(tensors=dict(ref_log_prob=lp))

    # -- update -------------------------------------------------------------------------
    def num_mini_batches(self, batch: Batch) -> int:
        """Optimizer steps per epoch that ``update_actor`` takes on this rank's share ``batch``."""
        return len(range(0, len(batch), self._seqs_per_mini()))

    def _seqs_per_mini(self) -> int:
        return mini_batch_seqs(self.cfg.actor, self.sp.dp_size, self.cfg.rollout.n)

    def draw_update_order(self, rows: int) -> np.ndarray:
        """The next epoch's row order over ``rows`` rows (shuffled under ``actor.shuffle_mini_batches``), drawn from the
        stream the update draws from: an ``OldLogProbPlan`` draws the first epoch's ahead of the update."""
        return self._shuffle_rng.permutation(rows) if self.cfg.actor.shuffle_mini_batches else np.arange(rows)

    def update_policy(self, batch: Batch, plan: OldLogProbPlan | None = None
                      ) -> tuple[dict[str, tuple[float, float]], Batch]:
        """The PPO update on this rank's share ``batch`` after ``compute_old_log_probs(batch, plan)`` (``plan`` None:
        π_old is already in the batch). Where the plan says so, the first epoch's first mini-batch takes π_old from
        its own forward, detached: exact, since that forward runs under the weights a separate pass would have seen,
        so the ratio is 1 in value and the gradient is the recomputed one's; later mini-batches and epochs read what
        it wrote. Returns (sum, count) metric pairs and the batch with ``old_log_probs`` / ``old_entropy`` complete
        (for the step's metrics)."""
        assert self.actor is not None
        a = self.cfg.actor
        seqs_per_mini = self._seqs_per_mini()
        stats = UpdateStats()
        first_order = plan.first_order if plan is not None else None
        if first_order is not None and len(batch) > seqs_per_mini and "old_log_probs" not in batch.tensors:
            raise ValueError(f"π_old from the update's own forward covers its first mini-batch only, and this update has "
                             f"{self.num_mini_batches(batch)}: call compute_old_log_probs(batch, plan) first")
        lps = ents = None
        if first_order is not None:
            # [B, R] π_old in the batch's row order, the first mini-batch's rows filled by its forward below; the
            # batch holds these very tensors, so later mini-batches and epochs read what that forward wrote
            shape = batch.tensors["responses"].shape
            lps = batch.tensors["old_log_probs"].clone() if "old_log_probs" in batch.tensors else \
                torch.zeros(shape, device=self.device)
            ents = batch.tensors["old_entropy"].clone() if "old_entropy" in batch.tensors else torch.zeros_like(lps)
            batch = batch.union(tensors=dict(old_log_probs=lps, old_entropy=ents))
        self.actor.packed_tokens = [0, 0]
        self.actor.model.train()
        self.actor.onload(params=False, optimizer=True)  # offloaded state (actor.optimizer_offload): see optimizer_trip
        with self._counted("update", self.actor):
            for epoch in range(a.ppo_epochs):
                order = first_order if epoch == 0 and first_order is not None else self.draw_update_order(len(batch))
                for start in range(0, len(batch), seqs_per_mini):
                    rows = order[start:start + seqs_per_mini]
                    capture = first_order is not None and epoch == 0 and start == 0
                    self._update_mini_batch(batch.index(rows), stats, (rows, lps, ents) if capture else None)
        self.weight_version += 1
        stats.add("actor/lr", self.actor.lr)
        ran, of = self.actor.packed_tokens
        if self.actor.share_prompts and of:  # the tokens the update computed per token of the batch (token-weighted
            stats.add("perf/update_token_share", ran / of, of)  # over ranks); perf/mfu_update counts the FLOPs run
        return stats.pairs(), batch

    @contextmanager
    def optimizer_trip(self, timer) -> Iterator[None]:
        """``actor.optimizer_offload``: the optimizer state comes to the GPU for the block (the update) and goes back
        after it, each leg a timed phase of its own (``optimizer_onload``, ``optimizer_offload``), so that the
        update's time, and its MFU, is its compute; the other phases run without the state. Otherwise nothing."""
        if self.actor is None or not self.cfg.actor.optimizer_offload:
            yield
            return
        with timer("optimizer_onload"):
            self.actor.onload(params=False, optimizer=True)
        try:
            yield
        finally:
            with timer("optimizer_offload"):
                self.actor.offload(params=False, optimizer=True)

    def update_actor(self, batch: Batch) -> dict[str, tuple[float, float]]:
        """``update_policy`` on a batch that already holds π_old; returns the (sum, count) metric pairs."""
        return self.update_policy(batch)[0]

    def _loss_mask(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """The tokens the actor's loss counts, [b, R] float: the response tokens, less every token of the responses
        cut at the length cap (or, multi-turn, ended by it) when ``actor.mask_truncated_completions``."""
        mask = t["response_mask"].float()
        if self.cfg.actor.mask_truncated_completions:
            mask = mask * ~cut_at_cap(mask, self.cfg.data.max_response_length, t.get("env_stop"))[:, None]
        return mask

    def _update_mini_batch(self, mini: Batch, stats: UpdateStats,
                           capture: tuple[np.ndarray, torch.Tensor, torch.Tensor] | None = None) -> None:
        """``capture`` = (the mini-batch's rows in the batch, [B, R] log-prob and entropy buffers): π_old is the
        forward's own detached log-probs, written into the buffers."""
        a = self.cfg.actor
        mask = self._loss_mask(mini.tensors)
        # Global denominators across ranks: every micro-batch on every rank divides
        # by the same counts, so the summed gradient equals one big batch's.
        seqs = float(mask.amax(-1).sum()) if a.mask_truncated_completions else float(len(mini))
        denom = torch.tensor([mask.sum().item(), seqs], dtype=torch.float64, device=self.device)
        all_reduce_sum(denom, self.dist.group)
        denom /= self.sp.size  # a sequence-parallel group's ranks hold the same rows: count them once
        # at least 1: with every response masked out (all cut at the cap) the loss is 0, not 0/0
        num_tokens, num_seqs = max(denom[0].item(), 1.0), max(denom[1].item(), 1.0)
        # FSDP averages gradients over ranks; undo that so the loss is a global sum. (With sequence parallelism
        # each rank's gradient is its slices' share of its group's loss: the sum over ranks is still the total.)
        scale = float(self.dist.world_size) if self.actor.fsdp else 1.0
        self.actor.zero_grad()
        micros = micro_batches(mini, a.ppo_micro_batch_size_per_device, self._token_budget, self.dist.group,
                               self.actor.remove_padding, self.actor.share_prompts)
        for i, (idx, micro) in enumerate(micros):
            loss, m, (lp, ent) = self._micro_batch_loss(micro, num_tokens, num_seqs, own_old=capture is not None)
            if capture is not None:
                rows, lps, ents = capture
                where = row_index(rows[idx], self.device)
                lps[where, :lp.shape[1]] = lp
                ents[where, :ent.shape[1]] = ent
            self.actor.micro_batch_step(last=i == len(micros) - 1)
            (loss * scale).backward()
            ntok = self._loss_mask(micro.tensors).sum().double()
            for k, v in m.items():
                stats.add(k, v, ntok)
        grad_norm, stepped = self.actor.optimizer_step(a.grad_clip)
        stats.add("actor/grad_norm", grad_norm if stepped else 0.0)
        stats.add("actor/skipped_updates", 0.0 if stepped else 1.0)

    def _micro_batch_loss(self, micro: Batch, num_tokens: float, num_seqs: float, own_old: bool = False
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """This micro-batch's share of the mini-batch loss, its metrics as detached device tensors, and the
        forward's detached (log-probs, entropy). ``own_old``: those log-probs are π_old (see ``update_policy``)."""
        a = self.cfg.actor
        t = micro.to(self.device).tensors
        mask = self._loss_mask(t)  # [b, R]
        log_prob, entropy = self.actor.forward(micro, micro.meta["temperature"], with_entropy=True,
                                               entropy_grad=bool(a.entropy_coeff))
        if own_old:
            t = {**t, "old_log_probs": log_prob.detach()}
        # A fixed norm_length: each micro-batch is trimmed to its own longest response, so the tensor's
        # width (agg_loss's default for seq-mean-token-sum-norm) would change with the split.
        denoms = dict(num_tokens=num_tokens, num_seqs=num_seqs, norm_length=self.cfg.data.max_response_length)
        clip = dict(clip_ratio_low=a.clip_ratio_low, clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
                    loss_agg_mode=a.loss_agg_mode, **denoms)
        # The loss by name (ppo, or decoupled_ppo under rollout correction): the shared arguments here, its own
        # (old / proximal / behaviour log-probs, importance-weight knobs) from its registration's ``inputs``.
        policy_loss = alg.POLICY_LOSSES[self.cfg.policy_loss]
        own = alg.POLICY_LOSSES.info(self.cfg.policy_loss).inputs(t, self.cfg)
        pg_loss, pg_m = policy_loss(log_prob=log_prob, advantages=t["advantages"], response_mask=mask, **own, **clip)
        loss = pg_loss
        names = {"pg_clipfrac": "actor/pg_clipfrac", "ppo_kl": "actor/ppo_kl", "pg_clipfrac_lower": "actor/pg_clipfrac_lower",
                 "is_truncated_frac": "rollout/is_truncated_frac", "is_masked_frac": "rollout/is_masked_frac"}
        metrics = {names[k]: torch.as_tensor(v).detach() for k, v in pg_m.items() if k in names}
        if entropy is not None:
            ent_loss = alg.agg_loss(entropy, mask, a.loss_agg_mode, **denoms)
            if a.entropy_coeff:
                loss = loss - a.entropy_coeff * ent_loss
            metrics["actor/entropy"] = alg.masked_mean(entropy.detach(), mask)
        if a.use_kl_loss:
            kl = alg.kl_loss(log_prob, t["ref_log_prob"], mask, kind=a.kl_loss_type, loss_agg_mode=a.loss_agg_mode,
                             **denoms)
            loss = loss + a.kl_loss_coef * kl
            metrics["actor/kl_loss"] = alg.masked_mean(alg.kl_penalty(log_prob.detach(), t["ref_log_prob"], a.kl_loss_type), mask)
        # pg_loss is this micro-batch's share of the mini-batch loss. Scaled by
        # num_tokens/ntok, its token-weighted mean over all micro-batches and ranks
        # (how the driver reduces metrics) is exactly the mini-batch loss.
        ntok = mask.sum().clamp(min=1.0)
        metrics["actor/pg_loss"] = pg_loss.detach() * num_tokens / ntok
        return loss, metrics, (log_prob.detach(), entropy.detach() if entropy is not None else torch.zeros_like(log_prob))
