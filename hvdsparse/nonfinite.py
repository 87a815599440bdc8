"""The non-finite policy's table: every rank's per-layer counts of NaN/Inf gradient
elements (compressors count them and never absorb them), one small collective per step,
so every rank sees the same table and applies ``raise`` / ``skip`` / ``propagate``
(:mod:`hvdsparse.settings`) identically.
"""
from __future__ import annotations

import logging
from typing import Dict, Iterable, Optional, Sequence

import torch

log = logging.getLogger("hvdsparse")

__all__ = ["NonFinite", "NonFinitePolicy", "raise_nonfinite"]


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


class NonFinitePolicy:
    """The policy in force applied to the step's [P, nlayers] table, the same on every
    rank, for both doors.

    ``policy``: ``"raise"`` / ``"skip"`` / ``"propagate"``; ``transport``: the door's
    transport (the table's allgather); ``prefix``: the collectives' name prefix;
    ``reads``: the engine's deferred reads (on CUDA ``raise`` reads the table at the next
    step, without a stall), whose ``hint`` (the door's advice) ends the error message.

    ``raise``: ``FloatingPointError`` naming layers and ranks on every rank (CPU: now;
    CUDA: one step late, with the flagged layers marked meanwhile as under
    ``propagate``). ``propagate``: element 0 of every layer that held a non-finite value
    on some rank becomes NaN in the exchanged gradient on every rank (device ops), as a
    dense allreduce of a NaN would. ``skip``: the step is skipped on every rank (a host
    read of the table in the same step, as ``torch.amp.GradScaler`` reads its flag)."""

    def __init__(self, policy: str, transport, prefix: str, reads):
        self.policy = policy
        self.transport = transport
        self.prefix = prefix
        self.reads = reads

    def gather(self, row: torch.Tensor, *, wait: bool = True):
        """Every rank's [1, nlayers] row -> the [P, nlayers] table (rank order); with
        ``wait=False`` the handle (:meth:`finish`)."""
        h = self.transport.allgather_async(row, name=f"{self.prefix}.nonfinite")
        return self.transport.synchronize(h) if wait else h

    def finish(self, handle):
        return None if handle is None else self.transport.synchronize(handle)

    def flags(self, table: torch.Tensor, names: Sequence[str], step: int,
              ) -> Optional[torch.Tensor]:
        """Apply ``raise`` / ``propagate`` to ``table``. CPU: ``raise`` raises now; CUDA:
        the table is read at the next step without a stall, and meanwhile (as under
        ``propagate``) the flagged layers are marked. Returns the per-layer "non-finite
        on some rank" vector to mark NaN into the buckets, or None when nothing is to be
        marked."""
        if self.policy == "raise":
            if table.device.type == "cpu":
                raise_nonfinite(table.numpy().tolist(), names, step, self.reads.hint)
            else:
                self.reads.defer_read("nonfinite", step, table, list(names))
        if self.policy == "propagate" or table.device.type != "cpu":
            return table.sum(0) > 0
        return None

    def propagate(self, table: torch.Tensor, names: Sequence[str], step: int,
                  buckets: Iterable[tuple]) -> None:
        """:meth:`flags`, then NaN into element 0 of every flagged layer: ``buckets``
        yields ``(spec, total, first)`` per bucket, in ``names`` order (``spec``: its
        :class:`~hvdsparse.exchange.BucketSpec`, ``total``: its flat exchanged gradient,
        ``first``: ``spec.first_elements`` on ``total``'s device); drawn only when some
        layer is to be marked."""
        flagged = self.flags(table, names, step)
        if flagged is None:
            return
        j = 0
        for spec, total, first in buckets:
            spec.mark_nan(total, flagged[j:j + len(spec.names)], first)
            j += len(spec.names)

    def skip(self, table: torch.Tensor, names: Sequence[str], step: int) -> bool:
        """``skip``: whether this step is skipped on every rank (a host read of the table
        in the same step)."""
        host = table.cpu().numpy()
        if not host.any():
            return False
        log.warning("hvdsparse: step %d skipped: non-finite gradient in %s", step,
                    sorted({names[j] for j in range(host.shape[1]) if host[:, j].any()}))
        return True
