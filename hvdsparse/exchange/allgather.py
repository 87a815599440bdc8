"""``allgather``: every rank's encoded bucket through one allgather (``hvd.allgather``).

Each rank encodes its bucket (:func:`codec.encode`, fixed length for the bucket at a
given step on every rank), Horovod concatenates the P messages (``[P * nbytes]``) and
every rank decodes all P and scatter-adds them into the flat fp32 sum
(:func:`codec.accumulate`, one fused decode + scatter-add per segment over all P).

Bytes per rank (ring allgather): sent = received = ``(P-1) * nbytes``.

No host synchronisation: the encode buffer and the flat sum are reused per bucket
(:class:`.base.BufferPool`); the cost model's figures (sum of the P ranks' ``count``
fields, read from the gathered bytes, so identical on every rank) stay on the device
and reach the host through :class:`.base.DeferredFigures`.
"""
from __future__ import annotations

import time

import torch

from .. import codec
from .base import BucketSpec, ExchangeContext, Pending

NAME = "allgather"
_COUNT_FIELD = 16   # offset of the u32 count inside a codec segment record


def _count_byte_offsets(nseg: int):
    return [codec.HEADER_SIZE + codec.RECORD_SIZE * s + _COUNT_FIELD + b
            for s in range(nseg) for b in range(4)]


class AllgatherPending(Pending):
    def finish(self) -> torch.Tensor:
        if self.result is not None:
            return self.result
        t0 = time.perf_counter()
        gathered = self.ctx.comm().synchronize(self._handle)
        t1 = time.perf_counter()
        P, nbytes = self.ctx.world_size, self._nbytes
        if gathered.numel() != P * nbytes:
            raise RuntimeError(
                f"hvdsparse allgather of bucket {self.spec.bucket_id} ({self.spec.names}): "
                f"received {gathered.numel()} bytes, expected {P} x {nbytes}; the ranks "
                f"disagree on the bucket layout (compressor settings differ across ranks?)")
        rows = gathered.view(P, nbytes)
        flat = self.ctx.buffer("allgather.sum", self.spec.bucket_id, self.spec.numel,
                               torch.float32, rows.device).zero_()
        codec.accumulate(rows, self.payloads, self.spec.views(flat), validate=self.ctx.validate,
                         error_flag=None if self.ctx.validate else self.ctx.error_flag)
        if self.ctx.want_figures:
            nseg = sum(len(p.segments) for p in self.payloads)
            if nseg:
                offs = self.ctx.pool().const_index(_count_byte_offsets(nseg), rows.device)
                # integers read from the gathered bytes: identical on every rank
                counts = rows.index_select(1, offs).contiguous().view(torch.int32)
                total = counts.to(torch.int64).sum().reshape(1)
                N = self.spec.numel
                self._defer_figures(total, lambda v, P=P, N=N: dict(
                    pairs=float(v[0]) / P, reduced=int(min(N, max(0, v[0])))))
        self.decode_s += time.perf_counter() - t1
        self.wait_s += t1 - t0
        self.result = flat
        return flat


def launch(spec: BucketSpec, payloads, ctx: ExchangeContext) -> Pending:
    nbytes = codec.encoded_nbytes(payloads)
    device = None
    for p in payloads:
        for s in p.segments:
            device = s.count.device
            break
        if device is not None:
            break
    # reused: the previous step's allgather of this bucket completed in its finish()
    out = ctx.buffer("allgather.msg", spec.bucket_id, nbytes, torch.uint8,
                     device if device is not None else torch.device("cpu"))
    buf = codec.encode(payloads, out=out)
    pend = AllgatherPending(spec, NAME, list(payloads), ctx)
    pend._nbytes = nbytes
    pend._handle = ctx.comm().allgather_async(buf, name=ctx.name(spec.bucket_id, NAME))
    pend.sent_bytes = pend.recv_bytes = (ctx.world_size - 1) * nbytes
    pend.figures["wire_nbytes"] = nbytes
    return pend
