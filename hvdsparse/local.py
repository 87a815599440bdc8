"""Combining the sparse global gradient with the local gradient
(local-gradients-with-sparse-global.txt, Algorithm 2 and section 3).

Notation on rank n at step t: ``L`` the local gradient (``p.grad`` as backward left it,
summed over ``backward_passes_per_step``), ``S`` what this rank sent (its payload decoded,
dequantised), ``E`` the compressor's residual after compression (error feedback memory),
``G`` the exchanged gradient. The paper writes ``G = AllReduce(S)`` (a sum); with
``op=Average`` hvdsparse's ``G = (1/P) sum_m S_m``, so with ``s = 1/P`` (Average) or
``s = 1`` (Sum) the update uses

* ``"sum"``:      ``C = (G + L) / 2``
* ``"partial"``:  ``C = G + s (L - S)``  (paper: ``G - S + L``: the other ranks' sparse
  gradients plus this rank's dense local gradient, ``(sum_{m != n} S_m + L) / P`` when
  averaging)
* ``"error"``:    ``C = G + s E``, then ``E := 0`` (paper: ``G + E``; clearing the
  residual every step makes ``E = L - S``, i.e. PARTIAL without error feedback)

instead of ``G``. The compressor still receives ``G`` in ``after_exchange``.

Parameters drift apart because every rank applies its own ``C``; every ``sync_period``
optimizer steps (paper: 500) they are averaged with one dense allreduce
(:func:`sync_parameters`), after which they are identical on every rank.

Drop-ratio warm-up (paper section 5.1, ``R_t = 0.99^max(1, T/t)``): pass a warm-up
schedule to the compressor, e.g. ``TopK(0.01, warmup=RtWarmup(1000))``
(:class:`hvdsparse.compressors.warmup.RtWarmup`); :func:`drop_ratio` is the formula.
"""
from __future__ import annotations

from typing import Iterable

import torch

MODES = ("sum", "partial", "error")


def drop_ratio(step: int, warmup_steps: int, final_drop: float = 0.99) -> float:
    """``R_t = final_drop ** max(1, T / t)`` (``R_0 = 0``: nothing dropped at step 0)."""
    if step <= 0:
        return 0.0
    return float(final_drop) ** max(1.0, warmup_steps / step)


def check_mode(mode):
    if mode is None:
        return None
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"local_gradient must be None or one of "
                         f"{', '.join(map(repr, MODES))}, got {mode!r}")
    return mode


class LocalGradient:
    """Computes ``C`` per layer (see the module docstring)."""

    def __init__(self, mode: str, sync_period: int = 500):
        self.mode = check_mode(mode)
        if not isinstance(sync_period, int) or isinstance(sync_period, bool) or sync_period < 1:
            raise ValueError(f"sync_period must be an int >= 1, got {sync_period!r}")
        self.sync_period = sync_period

    def combine(self, name: str, G: torch.Tensor, L: torch.Tensor, payload, compressor,
                s: float) -> torch.Tensor:
        L32 = L.detach().float()
        if self.mode == "sum":
            return (G + L32) * 0.5
        if self.mode == "partial":
            from . import codec
            S = codec.payload_to_dense(payload).view(G.shape)
            return G + s * (L32 - S)
        # error
        E = compressor.residual(name) if hasattr(compressor, "residual") else None
        if E is None:       # policy-dense layer or no error feedback: nothing withheld
            return G.clone()
        C = G + s * E.view(G.shape)
        E.zero_()
        return C

    def should_sync(self, steps_done: int) -> bool:
        return steps_done > 0 and steps_done % self.sync_period == 0


def sync_parameters(params: Iterable[torch.Tensor], transport,
                    name: str = "hvdsparse.sync"):
    """Average parameters across ranks in place (one grouped dense allreduce through
    ``transport``)."""
    ps = [p for p in params]
    if not ps:
        return
    with torch.no_grad():
        transport.grouped_allreduce_([p.data for p in ps], name=name, average=True)
