"""What each rank's engines hold right after construction, when only the first rank reads the weights.

    torchrun --standalone --nproc_per_node=2 tests/engine/multirank/materialize_checks.py OUT_DIR

Builds, on 2 gloo ranks with the tiny model, the actor with its frozen reference, a LoRA actor and a critic, through
the workers as the trainer builds them, and writes ``OUT_DIR/rank{r}.pt``: every parameter's full tensor and every
buffer of each model, which parameters are tied, each module's train/eval mode, how often this rank read a checkpoint
(``from_pretrained``) and where the parameters it handed each engine lived. ``tests/engine/test_materialize.py``
compares them with the models loaded the plain way.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout, without installing

from hybrid_rl.config import load_config  # noqa: E402
from hybrid_rl.distributed import destroy, init_distributed  # noqa: E402
from hybrid_rl.workers import fsdp_engine  # noqa: E402
from hybrid_rl.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402
from hybrid_rl.workers.critic import CriticWorker  # noqa: E402

BASE = ["trainer.device=cpu", "model.dtype=float32", "data.train_batch_size=4", "rollout.n=2",
        "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_device=2", "actor.use_kl_loss=true"]
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,v_proj]"]
LORA_SEED = 1234
"""The torch seed set before the LoRA worker is built: the test draws the same initial adapters from it."""


def counting_loader() -> list[str]:
    """Record every checkpoint read (``from_pretrained`` of a causal LM) in the returned list."""
    from transformers import AutoModelForCausalLM

    calls: list[str] = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def from_pretrained(cls, path, *args, **kwargs):
        calls.append(str(path))
        return original(cls, path, *args, **kwargs)

    AutoModelForCausalLM.from_pretrained = classmethod(from_pretrained)
    return calls


def recording_engine_inputs() -> list[set[str]]:
    """Record the devices of the parameters of every model handed to a ``TrainingEngine``."""
    devices: list[set[str]] = []
    original = fsdp_engine.TrainingEngine.__init__

    def init(self, model, *args, **kwargs):
        devices.append({p.device.type for p in model.parameters()})
        original(self, model, *args, **kwargs)

    fsdp_engine.TrainingEngine.__init__ = init
    return devices


def snapshot(model: torch.nn.Module) -> dict:
    """The model as every rank sees it: full parameters and buffers, ties, modes (collective: every rank calls)."""
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in model.named_parameters()}
    return dict(params=params,
                buffers={n: b.detach().clone() for n, b in model.named_buffers()},
                trainable=sorted(n for n, p in model.named_parameters() if p.requires_grad),
                tied=[n for n, _ in model.named_parameters(remove_duplicate=False) if n not in params],
                training={n: m.training for n, m in model.named_modules()},
                devices=sorted({p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()}))


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    d = init_distributed("cpu")
    assert torch.distributed.is_initialized() and d.world_size > 1, "run me under torchrun with 2+ ranks"
    reads = counting_loader()
    handed = recording_engine_inputs()
    res: dict = {}
    w = ActorRolloutRefWorker(load_config(None, BASE).validate(d.world_size), d, role="actor_ref")
    res["actor"], res["ref"] = snapshot(w.actor.model), snapshot(w.ref.model)
    del w
    torch.manual_seed(LORA_SEED)
    w = ActorRolloutRefWorker(load_config(None, BASE + LORA).validate(d.world_size), d, role="actor")
    res["lora"] = snapshot(w.actor.model)
    del w
    cfg = load_config(None, BASE + ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=4",
                               "critic.ppo_micro_batch_size_per_device=2"]).validate(d.world_size)
    res["critic"] = snapshot(CriticWorker(cfg, d).model)
    res["reads"], res["handed"] = reads, handed
    torch.save(res, out / f"rank{d.rank}.pt")
    destroy(finished=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as checks.py: a finished gloo rank skips interpreter finalization
