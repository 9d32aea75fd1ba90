"""The critic role: a value model V(s_t) for PPO with GAE, trained beside the actor in the same per-GPU process.

``ValueModel`` is a causal LM's backbone (its decoder stack, the LM head dropped)
plus a fresh ``Linear(hidden, 1)`` value head, as TRL and verl build it. It is
initialised from ``critic.model_path`` (default: the actor's ``model.path``).
``CriticWorker`` wraps it in the actor's ``TrainingEngine`` (FSDP2 per decoder
block, its own AdamW + LR schedule, explicit offload/onload; with
``critic.accumulate_unsharded``, by default the actor's setting, its parameters
gathered once per pass) and does the two critic phases of the step:

- ``compute_values``: no-grad values [B, R] of the response tokens, in micro-batches.
  V_t is read at the position *before* response token t (the state in which
  token t is chosen), the same positions whose logits give the actor's log-probs.
- ``update_critic``: epochs × mini-batches × micro-batches of the clipped value loss
  (``algorithms.value_loss``) against the GAE returns, each micro-batch normalised
  by the mini-batch's global token/sequence counts (so any split, and any number of
  ranks, gives the same gradient up to rounding, as in the actor's update).

With ``critic.use_remove_padding`` (default: as the actor) each micro-batch runs packed into one row of real tokens,
through the same packing, prompt sharing and sequence-parallel slicing as the actor's passes
(``TrainingEngine.packed_inputs``); the value head reads only the positions that predict a response token.

With ``critic.param_offload`` / ``critic.optimizer_offload`` the critic lives on
CPU between steps: it comes back for ``compute_values``, stays through the
advantage phase, and leaves after ``update_critic`` (one round trip a step), so
its memory is free while the engine generates.

Left out: LoRA on the critic (it is always fully fine-tuned), a critic sharing
the actor's backbone (two heads on one model), and reward models.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
from torch import nn

from hybrid_rl import algorithms as alg
from hybrid_rl.batch import Batch, row_index
from hybrid_rl.config import Config, data_parallel_size, lr_schedule_steps, mini_batch_seqs
from hybrid_rl.distributed import DistInfo, all_reduce_sum
from hybrid_rl.liger import apply_liger
from hybrid_rl.micro_batching import HOST_META, micro_batches
from hybrid_rl.models import load_causal_lm, resolve_dtype
from hybrid_rl.workers.actor_rollout_ref import UpdateStats
from hybrid_rl.workers.fsdp_engine import TrainingEngine
from hybrid_rl.workers.materialize import reads_weights
from hybrid_rl.workers.packed import unpack
from hybrid_rl.workers.ulysses import SequenceParallel


class ValueModel(nn.Module):
    """Backbone + scalar head: ``forward`` gives the values of the last ``num_values + 1`` positions but one."""

    def __init__(self, backbone: nn.Module, hidden_size: int, no_split_modules: list[str] | None):
        super().__init__()
        self.backbone = backbone
        # Zero-initialised: the untrained critic says V ≡ 0 instead of a random projection of the hidden states. After
        # whitening, a random head's state-dependent noise (however small) weighs as much as the reward signal while
        # rewards are rare; V ≡ 0 makes the first advantages the (whitened) returns themselves.
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        # what TrainingEngine reads to find the decoder blocks it shards (HF's attribute on the causal LM)
        self._no_split_modules = list(no_split_modules or [])

    # gradient checkpointing is the backbone's (a PreTrainedModel); TrainingEngine switches it on through these
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        fn = getattr(self.backbone, "activation_checkpointing_enable", None)
        if fn is not None:  # transformers >= 5.2x: the old name is deprecated
            fn(activation_checkpointing_kwargs=gradient_checkpointing_kwargs)
        else:
            self.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    def enable_input_require_grads(self) -> None:
        if hasattr(self.backbone, "enable_input_require_grads"):
            self.backbone.enable_input_require_grads()

    def set_attn_implementation(self, name: str) -> None:
        """The backbone's attention function (``workers.packed.use_varlen_attention`` sets the packed one)."""
        self.backbone.set_attn_implementation(name)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                num_values: int = 0, keep: torch.Tensor | None = None, **attn_kwargs) -> torch.Tensor:
        """Values (float32) of a padded batch, [b, num_values]: V at the positions that predict the last ``num_values``
        tokens; or of a packed row ([1, T] ids, ``attn_kwargs`` from ``TrainingEngine.packed_inputs``), [n]: V at its
        positions ``keep``."""
        attn_kwargs["use_cache"] = False
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **attn_kwargs)
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state  # [b, T, H]
        if keep is not None:
            hidden = hidden[0].index_select(0, keep)  # [n, H]
        else:
            hidden = hidden[:, -num_values - 1:-1, :]  # [b, R, H]: only the response's states go through the head
        return self.value_head(hidden).squeeze(-1).float()


def build_value_model(path: str, trust_remote_code: bool = False, on_meta: bool = False,
                      liger_device: torch.device | None = None) -> ValueModel:
    """A ``ValueModel`` from a causal LM checkpoint (fp32 on CPU; the engine moves and shards it). ``on_meta``: built
    on the ``meta`` device without reading the weights (``models.load_causal_lm``); the engine fills it from the first
    rank's, value head included. ``liger_device``: Liger's kernels patched into the decoder stack first
    (``model.use_liger``; the LM head they would leave alone is dropped anyway)."""
    lm = load_causal_lm(path, torch.float32, trust_remote_code, on_meta=on_meta)
    if liger_device is not None:
        apply_liger(lm, liger_device)
    backbone = lm.base_model  # the decoder stack (``model`` for Llama/Qwen), without the LM head
    if backbone is lm:
        raise ValueError(f"critic.model_path: {type(lm).__name__} exposes no backbone (base_model) to put a value head "
                         f"on; point critic.model_path at a causal LM with one (Llama, Qwen, Mistral, ...)")
    cfg = lm.config
    hidden = getattr(cfg, "hidden_size", None) or cfg.get_text_config().hidden_size
    with torch.device("meta") if on_meta else nullcontext():
        return ValueModel(backbone, hidden, getattr(lm, "_no_split_modules", None))


class CriticWorker:
    """The critic of one rank: ``compute_values`` and ``update_critic`` on this rank's share of the batch.

    ``actor_packs``, ``share_prompts``, ``sp``: the actor's resolved packing, prompt sharing and sequence-parallel
    layout (``ActorRolloutRefWorker``), which a packing critic follows."""

    def __init__(self, cfg: Config, dist: DistInfo, total_training_steps: int = 1, actor_packs: bool = False,
                 share_prompts: bool = False, sp: SequenceParallel | None = None):
        self.cfg = cfg
        self.dist = dist
        self.device = dist.device
        c = cfg.critic
        packs = actor_packs if c.use_remove_padding is None else c.use_remove_padding
        # only the data-parallel group's first rank reads the weights (workers/materialize.py)
        model = build_value_model(c.model_path or cfg.model.path, cfg.model.trust_remote_code,
                                  on_meta=not reads_weights(dist.group),
                                  liger_device=self.device if cfg.model.use_liger else None)
        self.engine = TrainingEngine(model, self.device, resolve_dtype(cfg.model.dtype, self.device), trainable=True,
                                     gradient_checkpointing=c.enable_gradient_checkpointing,
                                     accumulate_unsharded=c.accumulates_unsharded(cfg.actor), group=dist.group,
                                     remove_padding=packs, share_prompts=packs and share_prompts,
                                     sp=sp if packs else None)  # unpacked: each rank runs its group's rows whole
        self.engine.configure_optimizer(c.lr, (c.betas[0], c.betas[1]), c.weight_decay, c.lr_warmup_steps, c.lr_scheduler,
                                        lr_schedule_steps(c, cfg.data.train_batch_size, total_training_steps),
                                        c.min_lr_ratio, c.optimizer_impl)
        self._token_budget = c.max_token_len_per_device if c.use_dynamic_bsz else None
        self._release()

    # -- what the checkpoint saves -------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        return self.engine.model

    def checkpoint_part(self) -> tuple[nn.Module, torch.optim.Optimizer | None, object]:
        """(model, optimizer, scheduler) for ``save_checkpoint(parts={"critic": ...})``; call inside ``resident()``."""
        return self.engine.model, self.engine.optimizer, self.engine.scheduler

    # -- residency -----------------------------------------------------------------------
    def _release(self) -> None:
        c = self.cfg.critic
        if c.param_offload or c.optimizer_offload:
            self.engine.offload(params=c.param_offload, optimizer=c.optimizer_offload)

    @contextmanager
    def resident(self) -> Iterator[None]:
        """The critic on its device for the block; offloaded again after it (as ``critic.*_offload`` say)."""
        self.engine.onload()
        try:
            yield
        finally:
            self._release()

    # -- values --------------------------------------------------------------------------
    def _micro_batches(self, batch: Batch, max_seqs: int) -> list[tuple]:
        e = self.engine
        return micro_batches(batch, max_seqs, self._token_budget, self.dist.group, e.remove_padding, e.share_prompts)

    def _values(self, micro: Batch) -> torch.Tensor:
        """[b, R'] values of the micro-batch's response tokens (0 past each response when packed)."""
        t = micro.to(self.device).tensors
        if not self.engine.remove_padding:
            with self.engine.autocast():
                return self.engine.model(t["input_ids"], t["position_ids"], t["attention_mask"], t["responses"].shape[1])
        p, row, kwargs = self.engine.packed_inputs(t, micro.meta.get(HOST_META))
        with self.engine.autocast():
            values = self.engine.model(**kwargs, keep=row.keep if row is not None else p.keep)
        if row is not None:  # every rank of the group: the whole row's values
            values = row.gather(values)
        return unpack(values, p)

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        """``values`` [B, R] of the response tokens under the current critic (0 past each response). The critic comes
        to its device here and stays there for the step's ``update_critic``, which offloads it (``critic.*_offload``);
        it is offloaded here only when the pass fails."""
        c = self.cfg.critic
        self.engine.onload()
        try:
            model = self.engine.model
            model.eval()
            values = torch.zeros(batch.tensors["responses"].shape, device=self.device)  # [B, R]
            try:
                for idx, micro in self._micro_batches(batch, c.forward_micro_batch_size_per_device):
                    v = self._values(micro)  # [b, R'] (trimmed to the micro-batch's longest response)
                    rows = row_index(idx, self.device)
                    values[rows, :v.shape[1]] = v
            finally:
                self.engine.reshard()
            model.train()
        except BaseException:
            self._release()
            raise
        mask = batch.tensors["response_mask"].to(self.device).bool()
        return batch.union(tensors=dict(values=torch.where(mask, values, torch.zeros_like(values))))

    # -- update --------------------------------------------------------------------------
    def update_critic(self, batch: Batch) -> dict[str, tuple[float, float]]:
        """Clipped value regression onto ``returns``; (sum, count) metric pairs, reduced across ranks by the driver.
        Offloads the critic afterwards (``critic.*_offload``)."""
        c = self.cfg.critic
        # a sequence-parallel group (the actor's) holds one share of the batch, each of its ranks all of it
        seqs_per_mini = mini_batch_seqs(c, data_parallel_size(self.cfg, self.dist.world_size), self.cfg.rollout.n)
        stats = UpdateStats()
        with self.resident():
            self.engine.model.train()
            for _ in range(c.ppo_epochs):
                for start in range(0, len(batch), seqs_per_mini):
                    self._update_mini_batch(batch.index(slice(start, start + seqs_per_mini)), stats)
        t = batch.tensors
        mask = t["response_mask"].float()
        ntok = mask.sum().double()
        values, returns = t["values"].float(), t["returns"].float()
        stats.add("critic/values_mean", alg.masked_mean(values, mask), ntok)
        stats.add("critic/returns_mean", alg.masked_mean(returns, mask), ntok)
        # 1 − Var(G − V)/Var(G) on this rank's tokens: 1 = the critic explains the returns, ≤ 0 = it explains nothing
        if ntok >= 2:
            var_ret = alg.masked_var(returns, mask)
            stats.add("critic/vf_explained_var", 1.0 - alg.masked_var(returns - values, mask) / var_ret.clamp(min=1e-8))
        stats.add("critic/lr", self.engine.lr)
        return stats.pairs()

    def _update_mini_batch(self, mini: Batch, stats: UpdateStats) -> None:
        c = self.cfg.critic
        mask = mini.tensors["response_mask"].float()
        denom = torch.tensor([mask.sum().item(), float(len(mini))], dtype=torch.float64, device=self.device)
        all_reduce_sum(denom, self.dist.group)  # the mini-batch's global counts: every micro-batch divides by them
        # A sequence-parallel group's ranks hold the same rows. Sliced (a packing critic), each rank's gradient is its
        # slice's share of the loss: count the rows once, so that the group's shares add up to its loss. Unsliced,
        # each rank computes the whole loss of the rows: counted once per rank, each gradient is 1/size of the group's.
        # Either way the sum over ranks is the total, as ``scale`` below expects.
        if self.engine.sp.size > 1:
            denom /= self.engine.sp.size
        num_tokens, num_seqs = denom[0].item(), denom[1].item()
        scale = float(self.dist.world_size) if self.engine.fsdp else 1.0  # FSDP averages gradients over ranks
        self.engine.zero_grad()
        micros = self._micro_batches(mini, c.ppo_micro_batch_size_per_device)
        for i, (_, micro) in enumerate(micros):
            t = micro.to(self.device).tensors
            m = t["response_mask"].float()  # [b, R']
            vpreds = self._values(micro)  # [b, R']
            loss, clipfrac = alg.clipped_value_loss(vpreds, t["returns"], t["values"], m, c.cliprange_value, c.loss_agg_mode,
                                                    num_tokens=num_tokens, num_seqs=num_seqs,
                                                    norm_length=self.cfg.data.max_response_length)
            self.engine.micro_batch_step(last=i == len(micros) - 1)
            (loss * scale).backward()
            ntok = m.sum().double()
            # this micro-batch's share of the mini-batch loss; token-weighted over micro-batches and ranks it is the loss
            stats.add("critic/vf_loss", loss.detach() * num_tokens / ntok.clamp(min=1.0), ntok)
            stats.add("critic/vf_clipfrac", clipfrac, ntok)
            stats.add("critic/vpred_mean", alg.masked_mean(vpreds.detach(), m), ntok)
        grad_norm, stepped = self.engine.optimizer_step(c.grad_clip)
        stats.add("critic/grad_norm", grad_norm if stepped else 0.0)
        stats.add("critic/skipped_updates", 0.0 if stepped else 1.0)
