"""The LoRA actor with its frozen base stored in fp32 and in the compute dtype, on 2 gloo ranks.

    torchrun --standalone --nproc_per_node=2 tests/engine/multirank/lora_base_checks.py OUT_DIR

Builds the tiny model's LoRA actor twice through the worker, as the trainer does (the first rank reads the weights,
bf16 compute), with ``model.lora.base_dtype`` ``float32`` and ``compute``, the same seed for the adapters; runs one
forward and backward of a fixed batch through each; writes ``OUT_DIR/rank{r}.pt``: per setting, the dtypes and bytes
of this rank's frozen and trainable shards, the full frozen parameters, the logits and the adapters' gradients.
``tests/engine/test_lora_base_dtype.py`` compares them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout, without installing

from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.distributed import destroy, init_distributed  # noqa: E402
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402

BASE = ["trainer.device=cpu", "model.dtype=bfloat16", "data.train_batch_size=4", "rollout.n=2",
        "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_device=2",
        "model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj]"]


def local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def measure(base_dtype: str, world: int, d) -> dict:
    torch.manual_seed(1234)
    cfg = load_config(None, BASE + [f"model.lora.base_dtype={base_dtype}"]).validate(world)
    w = ActorRolloutRefWorker(cfg, d, role="actor")
    model = w.actor.model
    named = list(model.named_parameters())
    frozen = [(n, p) for n, p in named if not p.requires_grad]
    trained = [(n, p) for n, p in named if p.requires_grad]
    ids = torch.arange(3, 3 + 2 * 12).reshape(2, 12) % 100 + 3
    logits = model(input_ids=ids).logits
    logits.float().pow(2).mean().backward()
    out = dict(frozen_dtypes=sorted({str(p.dtype) for _, p in frozen}),
               trained_dtypes=sorted({str(p.dtype) for _, p in trained}),
               frozen_bytes=sum(local(p).numel() * local(p).element_size() for _, p in frozen),
               frozen_full={n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                            for n, p in frozen},
               logits=logits.detach().float().clone(),
               grads={n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                      for n, p in trained})
    del w, model
    return out


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    d = init_distributed("cpu")
    assert torch.distributed.is_initialized() and d.world_size > 1, "run me under torchrun with 2+ ranks"
    res = {b: measure(b, d.world_size, d) for b in ("float32", "compute")}
    torch.save(res, out / f"rank{d.rank}.pt")
    destroy(finished=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a finished gloo rank skips interpreter finalization
