"""The non-finite policy's table: every rank's per-layer counts of NaN/Inf gradient
elements (compressors count them and never absorb them), one small collective per step,
so every rank sees the same table and applies ``raise`` / ``skip`` / ``propagate``
(:mod:`hvdsparse.settings`) identically.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

__all__ = ["NonFinite", "raise_nonfinite"]


def raise_nonfinite(table, names: Sequence[str], step: int, hint: str = "") -> None:
    """``table``: host [P][nlayers] counts of non-finite gradient elements; raises
    ``FloatingPointError`` naming the layers and ranks when any is non-zero."""
    hits = [(names[j], r, int(row[j])) for r, row in enumerate(table)
            for j in range(len(names)) if row[j]]
    if hits:
        desc = "; ".join(f"layer {n!r} on rank {r}: {c} element(s)" for n, r, c in hits[:8])
        raise FloatingPointError(
            f"hvdsparse: non-finite gradient (NaN/Inf) at step {step}: {desc}"
            f"{' ...' if len(hits) > 8 else ''}. Nothing of it entered a residual.{hint}")


class NonFinite:
    """The step's non-finite counters and the row this rank contributes to the policy's
    table (every rank's per-layer counts of non-finite gradient elements, gathered in one
    small collective, so every rank sees the same [P, nlayers] table and acts alike).

    ``names``: every layer that may count, in slot order. At a step's first
    :meth:`counter` call one zeroed int32[len(names)] tensor is made; layer ``name``
    counts into its slice (one allocation per step instead of one per layer). When
    every payload of the row counted into its own slice, :meth:`row` is a view or one
    gather of that tensor, else a stack of the payloads' counters."""

    def __init__(self, names: Sequence[str]):
        self.slot = {n: j for j, n in enumerate(names)}
        self._buf: Optional[torch.Tensor] = None
        self._given: Dict[str, torch.Tensor] = {}
        self._index: Dict[tuple, torch.Tensor] = {}     # row order -> slots (device)

    def counter(self, name: str, device) -> Optional[torch.Tensor]:
        """Layer ``name``'s zeroed int32[1] counter for this step, or None (a layer
        without a slot, one already handed out, another device: the callee makes its
        own)."""
        j = self.slot.get(name)
        if j is None or name in self._given:
            return None
        if self._buf is None:
            self._buf = torch.zeros(len(self.slot), dtype=torch.int32, device=device)
        if self._buf.device != torch.device(device):
            return None
        view = self._given[name] = self._buf[j:j + 1]
        return view

    def given(self, name: str, payload) -> bool:
        """Whether ``payload`` counted into ``name``'s slice (or, without a counter, left
        it untouched: no slice was handed out)."""
        return payload.nonfinite is self._given.get(name)

    def row(self, names: Sequence[str], payloads, device) -> torch.Tensor:
        """This rank's [1, len(names)] int32 counts, in ``names`` order (a layer without
        a counter counts 0)."""
        if self._buf is not None and all(self.given(n, p) for n, p in zip(names, payloads)):
            if len(names) == len(self.slot) and \
                    all(self.slot[n] == j for j, n in enumerate(names)):
                return self._buf.view(1, -1)
            key = tuple(names)
            idx = self._index.get(key)
            if idx is None or idx.device != self._buf.device:
                idx = self._index[key] = torch.tensor([self.slot[n] for n in names],
                                                      device=self._buf.device)
            return self._buf.index_select(0, idx).view(1, -1)
        zero = torch.zeros((), dtype=torch.int32, device=device)
        return torch.stack([(p.nonfinite if p.nonfinite is not None else zero)
                            .reshape(()).to(torch.int32) for p in payloads]).view(1, -1)

    def reset(self) -> None:
        """The next step counts into a new tensor."""
        self._buf = None
        self._given.clear()
