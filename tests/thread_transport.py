"""P ranks in one process, one thread each, over an in-process transport: the real
exchange strategies' collectives (allgather, alltoall with splits, allreduce with
Horovod's pre/post scaling) matched by issue order, as an ordered transport is. For
unit tests of the exchanges; the multi-process tests run real Horovod / torchrun."""
from __future__ import annotations

import threading

import torch


class Hub:
    """Where the P threads meet: collective ``seq``'s per-rank contributions."""

    def __init__(self, P):
        self.P, self.cv, self.slots = P, threading.Condition(), {}

    def put(self, seq, rank, item):
        with self.cv:
            self.slots.setdefault(seq, {})[rank] = item
            self.cv.notify_all()

    def all(self, seq):
        with self.cv:
            self.cv.wait_for(lambda: len(self.slots.get(seq, {})) == self.P, timeout=60)
            got = self.slots.get(seq, {})
            assert len(got) == self.P, f"collective {seq}: only ranks {sorted(got)} came"
            return [got[r] for r in range(self.P)]


class ThreadTransport:
    """The in-process stand-in for Horovod's collectives. ``tamper(kind, rank, tensor)``
    (optional) may alter what a rank contributes, as a corrupted link would."""
    ordered, kind = True, "threads"

    def __init__(self, hub, rank, tamper=None):
        self.hub, self.r, self.seq, self.tamper = hub, rank, 0, tamper

    def rank(self):
        return self.r

    def size(self):
        return self.hub.P

    def _put(self, kind, item):
        self.seq += 1
        self.hub.put(self.seq, self.r, item)
        return (kind, self.seq, None)

    def _mine(self, kind, tensor):
        t = tensor.contiguous().clone()
        if self.tamper is not None:
            self.tamper(kind, self.r, t)
        return t

    def allgather_async(self, tensor, name=None):
        return self._put("gather", self._mine("gather", tensor))

    def alltoall_async(self, tensor, splits, name=None):
        return self._put("a2a", (self._mine("a2a", tensor),
                                 [int(s) for s in splits.tolist()]))

    def allreduce_async_(self, tensor, name=None, *, prescale_factor=1.0,
                         postscale_factor=1.0):
        """In place, as Horovod's: ``post * sum_r(pre * t_r)``, summed in rank order in
        the tensor's dtype."""
        self.seq += 1
        self.hub.put(self.seq, self.r, self._mine("reduce", tensor) * prescale_factor)
        return ("reduce", self.seq, (tensor, postscale_factor))

    def poll(self, handle):
        return True

    def synchronize(self, handle):
        kind, seq, extra = handle
        items = self.hub.all(seq)
        if kind == "gather":
            return torch.cat(items)
        if kind == "reduce":
            out, post = extra
            acc = items[0].clone()
            for t in items[1:]:
                acc += t
            return out.copy_(acc * post if post != 1.0 else acc)
        parts, recv = [], []
        for rows, splits in items:                 # sender by sender, rank order
            a = sum(splits[:self.r])
            parts.append(rows[a:a + splits[self.r]])
            recv.append(splits[self.r])
        return torch.cat(parts), torch.tensor(recv, dtype=torch.int32)


def on_threads(P, body, *, validate=True, tamper=None, **ctx_kw):
    """``body(r, ctx)`` for every rank r on its own thread, each with an exchange
    context over the in-process transport; returns the P results (rank order), or
    raises the first rank's error as ``(rank, exception)`` list in an AssertionError."""
    from hvdsparse.exchange.base import BufferPool, ExchangeContext
    hub, out, errors = Hub(P), [None] * P, []

    def rank(r):
        try:
            ctx = ExchangeContext(rank=r, world_size=P, prefix="t", validate=validate,
                                  transport=ThreadTransport(hub, r, tamper),
                                  buffers=BufferPool(), **ctx_kw)
            if not validate:
                ctx.error_flag = torch.zeros(1, dtype=torch.int32)
            out[r] = body(r, ctx)
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append((r, e))
    th = [threading.Thread(target=rank, args=(r,)) for r in range(P)]
    for t in th:
        t.start()
    for t in th:
        t.join(120)
    assert not errors, errors
    return out
