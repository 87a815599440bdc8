"""The non-finite policy's table: every rank's per-layer counts of NaN/Inf gradient
elements (compressors count them and never absorb them), the same on every rank, so
every rank applies ``raise`` / ``skip`` / ``propagate`` (:mod:`hvdsparse.settings`)
identically.

How the counts travel: each bucket's row (this rank's counts for its layers) rides in
the bucket's own message where its exchange can carry it (``allgather``: a tail of the
message; ``dense``: a [P, L] block of the allreduce; see those modules); the rows of the
other buckets (``split``, ``balanced``) go together in one small allgather queued after
the step's last bucket. :meth:`NonFinitePolicy.assemble` puts the [P, nlayers] table
together in bucket order. A count is non-zero exactly when the layer held a non-finite
value on that rank; a malformed (negative) count that slips past an unvalidated decode
is non-zero too, so it flags the layer instead of hiding it.
"""
from __future__ import annotations

import logging
from typing import Dict, Iterable, Optional, Sequence

import torch

log = logging.getLogger("hvdsparse")

__all__ = ["NonFinite", "NonFinitePolicy", "flagged_layers", "raise_nonfinite"]


def raise_nonfinite(table, names: Sequence[str], step: int, hint: str = "") -> None:
    """``table``: host [P][nlayers] counts of non-finite gradient elements; raises
    ``FloatingPointError`` naming the layers and ranks when any is non-zero."""
    hits = [(names[j], r, int(row[j])) for r, row in enumerate(table)
            for j in range(len(names)) if row[j]]
    if hits:
        desc = "; ".join(f"layer {n!r} on rank {r}: " + (
            f"{c} element(s)" if c > 0 else f"a malformed count ({c}) in its message")
            for n, r, c in hits[:8])
        raise FloatingPointError(
            f"hvdsparse: non-finite gradient (NaN/Inf) at step {step}: {desc}"
            f"{' ...' if len(hits) > 8 else ''}. Nothing of it entered a residual.{hint}")


def flagged_layers(table: torch.Tensor) -> torch.Tensor:
    """bool [nlayers]: the layers with a non-zero count on some rank (device op)."""
    return (table != 0).any(0)


class NonFinite:
    """The step's non-finite counters and the rows this rank contributes to the policy's
    table (every rank's per-layer counts of non-finite gradient elements; a bucket's row
    travels with its message, see the module doc, so every rank sees the same
    [P, nlayers] table and acts alike).

    ``names``: every layer that may count, in slot order (a bucket whose layers have
    consecutive slots gets its row as a view; :meth:`follow` re-slots them in the
    buckets' order). At a step's first
    :meth:`counter` call one int32[len(names)] tensor is zeroed (two are kept per
    device and used in turn, step by step); layer ``name`` counts into its slice. A
    step's rows are consumed within that step (its messages' encodes, the rest's
    allgather, waited for in :meth:`NonFinitePolicy.assemble`), so a tensor is free again
    two steps later, and a bucket's row has the same address every other step (what a
    captured encode is keyed by, :mod:`hvdsparse.device_graphs`). When
    every payload of the row counted into its own slice, :meth:`row` is a view or one
    gather of that tensor, else a stack of the payloads' counters."""

    def __init__(self, names: Sequence[str]):
        self.slot = {n: j for j, n in enumerate(names)}
        self._buf: Optional[torch.Tensor] = None
        self._given: Dict[str, torch.Tensor] = {}
        self._index: Dict[tuple, torch.Tensor] = {}     # row order -> slots (device)
        self._kept: Dict[str, list] = {}                 # device -> the two tensors
        self._turn = 0

    def counter(self, name: str, device) -> Optional[torch.Tensor]:
        """Layer ``name``'s zeroed int32[1] counter for this step, or None (a layer
        without a slot, one already handed out, another device: the callee makes its
        own)."""
        j = self.slot.get(name)
        if j is None or name in self._given:
            return None
        if self._buf is None:
            self._buf = self._zeroed(device)
        if self._buf.device != torch.device(device):
            return None
        view = self._given[name] = self._buf[j:j + 1]
        return view

    def _zeroed(self, device) -> torch.Tensor:
        kept = self._kept.setdefault(str(torch.device(device)), [None, None])
        t = kept[self._turn]
        if t is None or t.numel() != len(self.slot):
            t = kept[self._turn] = torch.zeros(len(self.slot), dtype=torch.int32,
                                               device=device)
            return t
        return t.zero_()

    def given(self, name: str, payload) -> bool:
        """Whether ``payload`` counted into ``name``'s slice (or, without a counter, left
        it untouched: no slice was handed out)."""
        return payload.nonfinite is self._given.get(name)

    def row(self, names: Sequence[str], payloads, device) -> torch.Tensor:
        """This rank's [1, len(names)] int32 counts, in ``names`` order (a layer without
        a counter counts 0)."""
        if self._buf is not None and all(self.given(n, p) for n, p in zip(names, payloads)):
            j0 = self.slot[names[0]] if names else 0
            if all(self.slot[n] == j0 + j for j, n in enumerate(names)):
                return self._buf[j0:j0 + len(names)].view(1, -1)    # a view: no launch
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
        """The next step counts into the other kept tensor."""
        self._buf = None
        self._given.clear()
        self._turn ^= 1

    def follow(self, names: Sequence[str]) -> None:
        """Between steps: slot ``names`` first, in this order (the buckets' order of the
        step that ended), the other layers after them, so each bucket's row is a slice
        again at the next step. Nothing changes when the order already holds."""
        if self._buf is not None:
            raise RuntimeError("NonFinite.follow during a step (call reset() first)")
        if all(self.slot.get(n) == j for j, n in enumerate(names)):
            return
        first = set(names)
        order = list(names) + [n for n in self.slot if n not in first]
        self.slot = {n: j for j, n in enumerate(order)}
        self._index.clear()


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

    def gather_rest(self, pends):
        """The rows (``Pending.nonfinite_row``) of the buckets whose message did not
        carry them (``pends``: the step's buckets in order) in one allgather, not waited
        for; None when every bucket carried its own."""
        rest = [p.nonfinite_row for p in pends if not p.carries_nonfinite]
        if not rest:
            return None
        return self.gather(rest[0] if len(rest) == 1 else torch.cat(rest, dim=1),
                           wait=False)

    def assemble(self, pends, handle) -> Optional[torch.Tensor]:
        """The step's [P, nlayers] table in bucket order (``pends`` finished): each
        carrying bucket's own block, the others' from ``handle`` (:meth:`gather_rest`,
        waited for here). None with no buckets."""
        rest = self.finish(handle)
        if not any(p.carries_nonfinite for p in pends):
            return rest
        parts, j = [], 0
        for pend in pends:
            if pend.carries_nonfinite:
                parts.append(pend.nonfinite)
            else:
                w = len(pend.spec.names)
                parts.append(rest[:, j:j + w])
                j += w
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

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
            return flagged_layers(table)
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
