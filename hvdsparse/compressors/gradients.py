"""The gradient's way into a compressor: the loss scale's inverse (``grad_scale``), its
check, and the two passes that apply the non-finite rule -- ``d = fp32(g) *
grad_scale``, non-finite elements of ``d`` taken as 0 and counted -- either into the
residual (:func:`residual_add`) or into a fresh tensor (:func:`clean_grad`). Device ops
only (``ops``), no host sync.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import ops


def inverse_loss_scale(grad_scaler, device) -> Optional[torch.Tensor]:
    """``1 / scale`` of a ``torch.amp.GradScaler`` as the ``grad_scale`` that
    ``compress`` takes (fp32, on ``device``; a power of two, so multiplying by it is
    exact), or None: no scaler, a disabled one, or one whose scale ``scale()`` has not
    created yet. Device ops only (no host read). Both front doors call it once per
    step."""
    if grad_scaler is None or not grad_scaler.is_enabled():
        return None
    scale = getattr(grad_scaler, "_scale", None)
    if scale is None:
        return None
    return torch.reciprocal(scale.float()).to(device)


def check_grad_scale(name, grad_scale, device):
    """``grad_scale``: None or a 1-element fp32 tensor on the gradient's device (checked
    from metadata only: no host sync)."""
    if grad_scale is None:
        return None
    if not isinstance(grad_scale, torch.Tensor) or grad_scale.dtype != torch.float32 \
            or grad_scale.numel() != 1:
        got = (f"{grad_scale.dtype} of shape {tuple(grad_scale.shape)}"
               if isinstance(grad_scale, torch.Tensor) else repr(grad_scale))
        raise TypeError(f"layer {name!r}: grad_scale must be None or a 1-element float32 "
                        f"tensor (1 / GradScaler scale), got {got}")
    if grad_scale.device != device:
        raise ValueError(f"layer {name!r}: grad_scale is on {grad_scale.device} but the "
                         f"gradient is on {device}")
    return grad_scale.reshape(1)


def clean_grad(flat: torch.Tensor, grad_scale, nonfinite: Optional[torch.Tensor],
               count: bool = True) -> torch.Tensor:
    """``d = fp32(g) * grad_scale``, then ``where(isfinite(d), d, 0)`` (a new fp32
    tensor) and, with ``count``, ``nonfinite[0] += #non-finite(d)`` -- the same rule as
    ``ops.residual_add_binmax`` (``ops.clean_grad``: one launch on the Triton path, torch
    ops elsewhere, no host sync), for the paths whose gradient does not go through that
    kernel."""
    return ops.clean_grad(flat.reshape(-1), grad_scale=grad_scale,
                          nonfinite=nonfinite if count else None)


def residual_add(flat: torch.Tensor, residual: torch.Tensor, bin_size: int, grad_scale,
                 nonfinite: Optional[torch.Tensor]) -> torch.Tensor:
    """``residual += d`` with ``d = fp32(g) * grad_scale`` where ``d`` is finite,
    ``nonfinite[0] += #non-finite(d)``; returns the per-bin max of ``|residual|``
    (``ops.residual_add_binmax``: one fused pass, no host sync on the Triton path)."""
    return ops.residual_add_binmax(flat, residual, bin_size, grad_scale=grad_scale,
                                   nonfinite=nonfinite)
