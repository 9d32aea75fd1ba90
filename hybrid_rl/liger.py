"""Fused training kernels from Liger (``model.use_liger``): RMSNorm, SwiGLU and rotary embeddings as Triton kernels.

The training passes of a 1.5B model run at a fraction of the GPU: with a hidden size of 1,536 the matrix
products are small next to the elementwise work around them (norms, the SiLU gate, rotary embeddings, residuals),
which eager PyTorch runs as one memory-bound kernel per operation. Liger-Kernel (linkedin/Liger-Kernel, what
verl's ``use_liger`` and TRL's ``use_liger_kernel`` switch on) replaces those with fused Triton kernels, patched into the
model instance, so parameter names, FSDP2 units and the weight push are untouched.

Only the in-model kernels are used. Liger's fused linear cross-entropy is left off: hybrid_rl's own LM-head path
(``workers/packed.py``'s ``FusedLogProb``) gives per-token log-probs at a temperature and the entropy, which a
cross-entropy loss does not. Patched into the actor, the reference and the critic (its decoder stack, before the
value head goes on); never on any device but CUDA (Triton).
"""

from __future__ import annotations

import torch

LIGER_KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": False}
"""What ``apply_liger`` asks Liger for: the in-model kernels, never its loss (see the module docstring)."""


def apply_liger(model: torch.nn.Module, device: torch.device) -> str:
    """Patch ``model`` (a transformers causal LM, before LoRA and FSDP) with Liger's kernels; returns its model type.

    Raises a one-line ``ValueError`` naming ``model.use_liger`` when the device, the package or the model type rules
    it out, so a run fails before any weight is loaded onto a GPU.
    """
    if device.type != "cuda":
        raise ValueError(f"model.use_liger=true needs a CUDA device (Liger's kernels are Triton), this run is on "
                         f"{device.type}: set model.use_liger=false")
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as e:
        raise ValueError(f"model.use_liger=true needs the liger-kernel package ({e}): pip install 'hybrid_rl[liger]' "
                         "(liger-kernel), or set model.use_liger=false") from e
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply_fn is None:
        raise ValueError(f"model.use_liger=true: liger-kernel has no kernels for model type {model_type!r} "
                         f"({type(model).__name__}); set model.use_liger=false for this model")
    apply_fn(model=model, **LIGER_KERNELS)
    return model_type
