"""Ulysses sequence parallelism against the same passes without it, measured under torchrun.

    torchrun --standalone --nproc_per_node=N tests/engine/multirank/ulysses_checks.py OUT_DIR [engine|worker]

``engine``: for every sequence-parallel size dividing N (1 first, the reference), an FSDP2 ``TrainingEngine`` over
all N ranks runs one packed forward of this rank's data-parallel share of one global batch and one backward of a
token-mean loss (log-probs plus an entropy bonus) over the global token count; every rank records the largest
difference from size 1 of the log-probs and entropies of its rows and of the full gradients, per head/packing variant. ``worker``: the actor worker's whole
update on the same batch at size 1 and at size N; every rank records the largest parameter difference.
Each rank writes ``OUT_DIR/rank{r}.pt``; ``tests/engine/test_ulysses.py`` asserts on them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout, without installing

from hybrid_rl.batch import Batch  # noqa: E402
from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.data import collate_prompts  # noqa: E402
from hybrid_rl.distributed import DistInfo, destroy, init_distributed  # noqa: E402
from hybrid_rl.models import load_causal_lm, resolve_model_path  # noqa: E402
from hybrid_rl.rollout.base import assemble_rollout  # noqa: E402
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402
from hybrid_rl.workers.fsdp_engine import TrainingEngine  # noqa: E402
from hybrid_rl.workers.ulysses import make_groups  # noqa: E402

MODEL = "builtin:tiny-qwen2"  # 4 attention heads, 2 key/value heads: size 4 repeats the key/value heads
VARIANTS = {"plain": dict(fused_logprob=False, share_prompts=False),
            "fused_shared_ckpt": dict(fused_logprob=True, share_prompts=True, gradient_checkpointing=True)}
N_SAMPLES = 2
PROMPTS = 4
RESPONSE = 7
PAD = 0


def make_batch(seed: int = 0) -> Batch:
    """A rollout batch of ``PROMPTS`` prompts of different lengths × ``N_SAMPLES``, responses of different lengths,
    advantages and old log-probs: identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    items = [dict(input_ids=torch.randint(3, 100, (n,), generator=g).tolist(), ground_truth="", data_source="x",
                  index=i) for i, n in enumerate((5, 11, 3, 8)[:PROMPTS])]
    prompts = collate_prompts(items, PAD)
    responses = torch.randint(3, 100, (PROMPTS * N_SAMPLES, RESPONSE), generator=g)
    lengths = (7, 2, 5, 7, 1, 6, 4, 3)
    batch = assemble_rollout(prompts, responses, torch.zeros(responses.shape), N_SAMPLES, [1], PAD, lengths)
    mask = batch["response_mask"].float()
    adv = torch.randn(len(batch), 1, generator=g).expand_as(mask) * mask
    old = -2.0 * torch.rand(mask.shape, generator=g) * mask - 3.5
    return batch.union(tensors=dict(advantages=adv.contiguous(), old_log_probs=old,
                                    weight_version=torch.zeros(len(batch), dtype=torch.long)),
                       temperature=1.0, weight_version=0)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def engine_pass(d: DistInfo, batch: Batch, size: int, variant: dict
                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], Batch]:
    """(log-probs and entropies of this rank's rows, full gradients, the rows) at sequence-parallel size ``size``."""
    sp = make_groups(size)
    per = len(batch) // sp.dp_size
    share = batch.index(slice(sp.dp_rank * per, (sp.dp_rank + 1) * per))
    model = load_causal_lm(resolve_model_path(MODEL), torch.float32)
    engine = TrainingEngine(model, d.device, torch.float32, trainable=True, remove_padding=True, sp=sp, **variant)
    engine.model.train()
    lp, ent = engine.forward(share, 1.0, with_entropy=True)
    mask = share["response_mask"].float()
    loss = ((lp + 0.1 * ent) * mask).sum() / batch["response_mask"].sum()  # each row's tokens once over the world
    (loss * d.world_size).backward()  # FSDP2 averages over all ranks
    grads = {n: full(p.grad) for n, p in engine.model.named_parameters()}
    return lp.detach(), ent.detach(), grads, share


def all_rows(batch: Batch, mine: torch.Tensor, d: DistInfo) -> torch.Tensor:
    """[B, R] from every rank's [B / ranks, R'] share (size 1: each rank its own rows)."""
    out = torch.zeros(batch["responses"].shape)
    parts = [torch.zeros_like(mine) for _ in range(d.world_size)]
    dist.all_gather(parts, mine.contiguous())
    per = len(batch) // d.world_size
    for r, part in enumerate(parts):
        out[r * per:(r + 1) * per, :part.shape[1]] = part
    return out


def run_engine(d: DistInfo, res: dict) -> None:
    batch = make_batch()
    sizes = [s for s in (1, 2, 4, 8) if d.world_size % s == 0]
    for name, variant in VARIANTS.items():
        ref_lp, ref_ent, ref_grads, _ = engine_pass(d, batch, 1, variant)
        ref_lp, ref_ent = all_rows(batch, ref_lp, d), all_rows(batch, ref_ent, d)
        grad_scale = max(g.abs().max().item() for g in ref_grads.values())
        for size in sizes[1:]:
            lp, ent, grads, share = engine_pass(d, batch, size, variant)
            sp_per = len(batch) // (d.world_size // size)
            rows = slice((d.rank // size) * sp_per, (d.rank // size + 1) * sp_per)
            want_lp, want_ent = ref_lp[rows, :lp.shape[1]], ref_ent[rows, :ent.shape[1]]
            res[(name, size)] = dict(
                lp_diff=(lp - want_lp).abs().max().item(), lp_scale=want_lp.abs().max().item(),
                ent_diff=(ent - want_ent).abs().max().item(), ent_scale=want_ent.abs().max().item(),
                grad_diff=max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
                grad_scale=grad_scale, rows=len(share))


WORKER = ["trainer.device=cpu", "model.dtype=float32", f"model.path={MODEL}", f"rollout.n={N_SAMPLES}",
          f"data.train_batch_size={PROMPTS}", f"data.max_response_length={RESPONSE}",
          f"actor.ppo_mini_batch_size={PROMPTS}", "actor.ppo_micro_batch_size_per_device=2",
          "actor.log_prob_micro_batch_size_per_device=2", "actor.lr=1e-3", "actor.entropy_coeff=0.01",
          "actor.use_remove_padding=true", "actor.fused_logprob=true", "actor.share_prompts=false",
          "rollout.name=hf", "algorithm.adv_estimator=grpo", "trainer.logger=[jsonl]"]


def worker_update(d: DistInfo, batch: Batch, size: int) -> tuple[dict[str, torch.Tensor], float]:
    cfg = load_config(None, WORKER + [f"actor.ulysses_sequence_parallel_size={size}"]).validate(d.world_size)
    w = ActorRolloutRefWorker(cfg, d, role="actor")
    per = len(batch) // w.sp.dp_size
    stats = w.update_actor(batch.index(slice(w.sp.dp_rank * per, (w.sp.dp_rank + 1) * per)))
    return {n: full(p) for n, p in w.actor.model.named_parameters()}, stats["actor/grad_norm"][0]


def run_worker(d: DistInfo, res: dict) -> None:
    batch = make_batch(seed=1)
    model = load_causal_lm(resolve_model_path(MODEL), torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref, ref_norm = worker_update(d, batch, 1)
    got, norm = worker_update(d, batch, d.world_size)
    res["worker"] = dict(param_diff=max((got[n] - ref[n]).abs().max().item() for n in ref),
                         moved=min((ref[n] - before[n]).abs().max().item() for n in ref),
                         grad_norm=(norm, ref_norm))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    d = init_distributed("cpu")
    assert dist.is_initialized() and d.world_size > 1, "run me under torchrun with 2+ ranks"
    which = sys.argv[2:] or ["engine", "worker"]
    res: dict = {"world_size": d.world_size}
    if "engine" in which:
        run_engine(d, res)
    if "worker" in which:
        run_worker(d, res)
    torch.save(res, out / f"rank{d.rank}.pt")
    destroy(finished=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
