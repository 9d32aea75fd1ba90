"""LoRA's adapted linear as one autograd function, with the adapter's scaling at the rank's width.

peft computes an adapted linear as ``base(x) + lora_B(lora_A(x)) * s``: the scaling multiplies the full output
(tokens × out_features) and the sum is one more kernel over it, and in backward the scaling's gradient is another
full-width product and autograd sums the input's two gradients in one more: four memory-bound passes over
(tokens × out_features or in_features) per adapted linear, seven of them per block. Here

    forward:   h = s·(x Aᵀ)          y = x Wᵀ + b,  y += h Bᵀ          (the sum accumulated by the product: addmm)
    backward:  g_h = s·(g B)         dx = g W,  dx += g_h A         dA = g_hᵀ x       dB = gᵀ h

so the scaling multiplies (tokens × rank) and both sums are the products' own accumulation. The same math with the
products in another order; the base stays frozen (no gradient for W or b is ever formed).

``fuse_lora_linears(model)`` gives every plain peft ``lora.Linear`` of ``model`` this forward. A call falls back to
peft's own whenever peft does more than the plain case: adapters disabled (the reference through the adapter
switch) or merged, several adapters active or a variant (DoRA), dropout on in training, extra call arguments, or
tensors of different dtypes.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F


class LoraLinearFn(torch.autograd.Function):
    """``x Wᵀ + b + s·(x Aᵀ) Bᵀ`` over the last dimension of ``x``; gradients for ``x``, ``A`` and ``B`` only."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        h = (x2 @ lora_a.t()).mul_(scaling)
        y = F.linear(x2, weight, bias)
        y.addmm_(h, lora_b.t())
        ctx.save_for_backward(x2, h, weight, lora_a, lora_b)
        ctx.scaling, ctx.shape = scaling, shape
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x2, h, weight, lora_a, lora_b = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        g_h = (g @ lora_b).mul_(ctx.scaling)
        dx = (g @ weight).addmm_(g_h, lora_a).view(ctx.shape) if ctx.needs_input_grad[0] else None
        d_a = g_h.t() @ x2 if ctx.needs_input_grad[3] else None
        d_b = g.t() @ h if ctx.needs_input_grad[4] else None
        return dx, None, None, d_a, d_b, None


def _plain(layer, x: torch.Tensor) -> bool:
    """Whether this call of peft's ``lora.Linear`` is the plain case the fused function computes."""
    if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return False
    name = layer.active_adapters[0]
    variant = name in getattr(layer, "lora_variant", {}) or getattr(layer, "use_dora", {}).get(name, False)
    if name not in layer.lora_A or variant:
        return False
    drop = layer.lora_dropout[name]
    if layer.training and not isinstance(drop, torch.nn.Identity) and drop.p > 0:
        return False
    base = layer.get_base_layer()
    if type(base) is not torch.nn.Linear or base.weight.requires_grad or \
            (base.bias is not None and base.bias.requires_grad):
        return False
    a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
    return x.dtype == base.weight.dtype == a.dtype == b.dtype


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if args or kwargs or not _plain(self, x):
        return type(self).forward(self, x, *args, **kwargs)
    name = self.active_adapters[0]
    base = self.get_base_layer()
    return LoraLinearFn.apply(x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight,
                              float(self.scaling[name]))


def fuse_lora_linears(model: torch.nn.Module) -> int:
    """Give every plain peft ``lora.Linear`` in ``model`` the fused forward; returns how many."""
    from peft.tuners.lora.layer import Linear

    n = 0
    for module in model.modules():
        if type(module) is Linear:
            module.forward = types.MethodType(_fused_forward, module)
            n += 1
    return n
