"""``allgather``: every rank's encoded bucket through one allgather (``hvd.allgather``).

Each rank encodes its bucket (:func:`codec.encode`, fixed length for the bucket at a
given step on every rank), Horovod concatenates the P messages (``[P * nbytes]``) and
every rank decodes all P and scatter-adds them into the flat fp32 sum
(:func:`codec.accumulate`: on the CUDA path one check launch for the bucket plus one
scatter-add launch per rank, ``kernels/bucket_decode.py``).

Non-finite counts (:mod:`hvdsparse.nonfinite`) ride in the same message: with a
``nonfinite_row`` (int32[1, L], this rank's counts for the bucket's L layers) each
message is ``codec bytes | L x int32 counts | 0-7 zero bytes`` (the codec part is a
multiple of 8 bytes, so the counts start 8-aligned and the row stays 8-aligned), and
the gathered rows' tails are the bucket's [P, L] table -- no collective of its own.
The validated (CPU) path rejects a negative count naming the rank; unvalidated, a
malformed count is non-zero, so the policy flags the layer rather than missing it.

Bytes per rank (ring allgather): sent = received = ``(P-1) * nbytes`` (with the counts'
tail).

With the step engine's ``cuda_graphs`` on (``ExchangeContext.graphs``), the encode's and
the decode's launches replay as captured graphs (the decode after a copy of the gathered
rows to a fixed home).

No host synchronisation: the encode buffer and the flat sum are reused per bucket
(:class:`.base.BufferPool`); the cost model's figures (the P ranks' ``count`` fields,
read from the gathered bytes by the decode, so identical on every rank) stay on the
device, reach the host through :class:`.base.DeferredFigures` and are summed there.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from .. import codec
from ..codec_format import align
from .base import BucketSpec, ExchangeContext, Pending, bucket_device

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
        if self.carries_nonfinite:
            self.nonfinite = read_counts(rows, self._codec_nbytes, len(self.spec.names),
                                         self.spec, self.ctx.validate)
            rows = rows[:, :self._codec_nbytes]      # 8-aligned rows: no copy
        flat = self.ctx.buffer("allgather.sum", self.spec.bucket_id, self.spec.numel,
                               torch.float32, rows.device)
        nseg = sum(len(p.segments) for p in self.payloads)
        counts = None
        if self.ctx.want_figures and nseg:
            # every rank's count fields, read from the gathered bytes (identical on every
            # rank) by the decode itself; summed on the host when read back
            counts = self.ctx.buffer("allgather.counts", self.spec.bucket_id, P * nseg,
                                     torch.int32, rows.device)
        codec.accumulate(rows, self.payloads, self.spec.views(flat), validate=self.ctx.validate,
                         error_flag=None if self.ctx.validate else self.ctx.error_flag,
                         counts_out=counts, zero=True, graphs=self.ctx.graphs)
        if counts is not None:
            N = self.spec.numel
            self._defer_figures(counts, lambda v, P=P, N=N: _figures(sum(v), P, N))
        self.decode_s += time.perf_counter() - t1
        self.wait_s += t1 - t0
        self.result = flat
        return flat


def counts_nbytes(nlayers: int) -> int:
    """Bytes of the non-finite counts' tail: ``nlayers`` int32, padded as
    :func:`codec.encode` pads its ``tail``."""
    return align(4 * nlayers)


def read_counts(rows: torch.Tensor, at: int, nlayers: int, spec: BucketSpec,
                validate: bool) -> torch.Tensor:
    """The gathered messages' counts tails as an int32 [P, nlayers] view (rank order);
    ``validate``: a negative count raises, naming the rank and the bucket's layers."""
    table = rows[:, at:at + 4 * nlayers].view(torch.int32)
    if validate:
        bad = (table < 0).nonzero().tolist()
        if bad:
            r, j = bad[0]
            raise RuntimeError(
                f"hvdsparse allgather of bucket {spec.bucket_id}: rank {r}'s message "
                f"carries a negative non-finite count ({int(table[r, j])}) for layer "
                f"{spec.names[j]!r}; the message is malformed")
    return table


def launch(spec: BucketSpec, payloads, ctx: ExchangeContext,
           nonfinite_row: Optional[torch.Tensor] = None) -> Pending:
    codec_nbytes = codec.encoded_nbytes(payloads)
    width = 0 if nonfinite_row is None else nonfinite_row.numel()
    nbytes = codec_nbytes + counts_nbytes(width)
    device = nonfinite_row.device if width and not any(p.segments for p in payloads) \
        else bucket_device(payloads)
    # reused: the previous step's allgather of this bucket completed in its finish()
    out = ctx.buffer("allgather.msg", spec.bucket_id, nbytes, torch.uint8, device)
    # the counts' tail is written by the encode's own cat (no launch of its own)
    codec.encode(payloads, out=out, tail=None if not width else
                 nonfinite_row.reshape(-1).contiguous().view(torch.uint8),
                 graphs=ctx.graphs)
    pend = AllgatherPending(spec, NAME, list(payloads), ctx)
    pend._nbytes, pend._codec_nbytes = nbytes, codec_nbytes
    pend.carries_nonfinite = bool(width)
    pend._handle = ctx.comm().allgather_async(out, name=ctx.name(spec.bucket_id, NAME))
    pend.sent_bytes = pend.recv_bytes = (ctx.world_size - 1) * nbytes
    pend.figures["wire_nbytes"] = nbytes
    return pend
