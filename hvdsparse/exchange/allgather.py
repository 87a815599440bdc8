"""``allgather``: every rank's encoded bucket through one allgather (``hvd.allgather``).

Each rank encodes its bucket (:func:`codec.encode`, fixed length for the bucket at a
given step on every rank), Horovod concatenates the P messages (``[P * nbytes]``) and
every rank decodes all P and scatter-adds them into the flat fp32 sum
(:func:`codec.accumulate`: on the CUDA path one check launch for the bucket plus one
scatter-add launch per rank, ``kernels/bucket_decode.py``).

Bytes per rank (ring allgather): sent = received = ``(P-1) * nbytes``.

No host synchronisation: the encode buffer and the flat sum are reused per bucket
(:class:`.base.BufferPool`); the cost model's figures (the P ranks' ``count`` fields,
read from the gathered bytes by the decode, so identical on every rank) stay on the
device, reach the host through :class:`.base.DeferredFigures` and are summed there.
"""
from __future__ import annotations

import time

import torch

from .. import codec
from .base import BucketSpec, ExchangeContext, Pending

NAME = "allgather"


def _figures(total: int, P: int, N: int) -> dict:
    """The cost model's figures from the sum of the P ranks' count fields."""
    return dict(pairs=float(total) / P, reduced=int(min(N, max(0, total))))


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
        nseg = sum(len(p.segments) for p in self.payloads)
        counts = None
        if self.ctx.want_figures and nseg:
            # every rank's count fields, read from the gathered bytes (identical on every
            # rank) by the decode itself; summed on the host when read back
            counts = self.ctx.buffer("allgather.counts", self.spec.bucket_id, P * nseg,
                                     torch.int32, rows.device)
        codec.accumulate(rows, self.payloads, self.spec.views(flat), validate=self.ctx.validate,
                         error_flag=None if self.ctx.validate else self.ctx.error_flag,
                         counts_out=counts)
        if counts is not None:
            N = self.spec.numel
            self._defer_figures(counts, lambda v, P=P, N=N: _figures(sum(v), P, N))
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
