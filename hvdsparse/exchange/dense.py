"""``dense``: allreduce of the error-fed gradient as the compressor selected it.

Each rank expands its own payloads into the flat bucket vector (``S_r``: exactly what
it would have sent sparse, so the compressor's residual bookkeeping is unchanged) and
the ranks allreduce it (op Sum) in fp32, or in fp16 with Horovod's pre/post scaling by
``gradient_predivide_factor`` (``S_r / f`` summed, times ``f``) to keep fp16 in range.
The result equals the allgather strategy's sum up to float summation order (fp32) or
fp16 rounding. With ``NoCompression`` it is a plain dense allreduce.

Non-finite counts (:mod:`hvdsparse.nonfinite`) ride in the same allreduce: with a
``nonfinite_row`` (int32[1, L], this rank's counts for the bucket's L layers) the
vector is ``N`` gradient elements followed by a ``[P, L]`` block in which rank r writes
its row at row r and zeros elsewhere, so the sum is every rank's counts in rank order
(exactly one non-zero term per slot). In fp32 counts are exact up to 2^24 and non-zero
beyond; on a 16-bit wire a count saturates at ``2^m / 4`` (m: the dtype's mantissa
bits; 256 for fp16, 32 for bf16), where the predivide round trip still rounds back to
the integer. The validated (CPU) path rejects a slot that is negative, NaN or not an
integer, naming the rank; unvalidated, such a slot reads as -1, so the policy flags the
layer (:func:`read_counts`).

Bytes per rank (ring allreduce): sent = received = ``2 (P-1)/P * N * d`` (d = 4 or 2;
``N`` includes the counts' block).

No host synchronisation: the flat vector (and its fp16 copy) are reused per bucket;
the cost model's figure (non-zeros of the allreduced sum, identical on every rank)
stays on the device (:class:`.base.DeferredFigures`).

With the step engine's ``cuda_graphs`` on (``ExchangeContext.graphs``), the bucket's
device work replays as four captured graphs: :func:`.base.own_dense`'s encode and
decode, the counts' row and the 16-bit wire copy (:func:`_launch_segment`), and the
reads of the allreduced vector (:func:`_read_segment`); all read reused buffers.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from .. import device_graphs
from .base import BucketSpec, ExchangeContext, Pending, bucket_device, own_dense

NAME = "dense"


class DensePending(Pending):
    def finish(self) -> torch.Tensor:
        if self.result is not None:
            return self.result
        t0 = time.perf_counter()
        self.ctx.comm().synchronize(self._handle)
        t1 = time.perf_counter()
        if self._tensor.dtype == torch.float32:
            full = self._tensor
        else:   # the fp32 launch buffer is free again: widen the fp16 sum into it
            full = self._flat.copy_(self._tensor)
        N, P, ctx = self.spec.numel, self.ctx.world_size, self.ctx
        flat = full[:N]
        exact = full is self._tensor
        if self.carries_nonfinite and ctx.validate:
            counts = read_counts(full[N:].view(P, -1), self.spec, True, exact=exact)
            nnz = _nonzeros(flat) if ctx.want_figures else None
        else:
            counts, nnz = device_graphs.run_bare(ctx.graphs, full.device, _read_segment, full,
                                                 N, P, self.carries_nonfinite, exact,
                                                 ctx.want_figures)
        if self.carries_nonfinite:
            self.nonfinite = counts
        if nnz is not None:
            self._defer_figures(nnz, lambda v: dict(reduced=int(v[0])))
        self.wait_s += t1 - t0
        self.decode_s += time.perf_counter() - t1
        self.result = flat
        return flat


def _nonzeros(flat: torch.Tensor) -> torch.Tensor:
    """The cost model's figure: non-zeros of the allreduced sum (int64[1]; every rank
    holds the identical bytes, so the identical count)."""
    return torch.count_nonzero(flat).reshape(1).to(torch.int64)


def _read_segment(full, N, P, carries, exact, want_figures):
    """The trusted path's reads of the allreduced vector (a device segment of
    :mod:`hvdsparse.device_graphs`): the counts' block as int32 [P, L]
    (:func:`read_counts`) when ``carries``, the non-zeros when ``want_figures``."""
    counts = read_counts(full[N:].view(P, -1), None, False, exact) if carries else None
    return counts, (_nonzeros(full[:N]) if want_figures else None)


def _launch_segment(full, N, row, rank, saturation, wire):
    """This rank's counts row written into its row of the zeroed block (clamped to
    ``saturation`` on a 16-bit wire), then the vector copied into ``wire`` when the
    wire is 16-bit (a device segment of :mod:`hvdsparse.device_graphs`)."""
    if row is not None:
        block = full[N:].view(-1, row.numel())          # zeroed by own_dense
        row = row.reshape(-1)
        block[rank].copy_(row if saturation is None else row.clamp(max=saturation))
    if wire is not None:
        wire.copy_(full)
    return wire


def count_saturation(dtype: torch.dtype) -> int:
    """The largest count a ``dtype`` wire carries exactly through the predivide round
    trip (``2^m / 4``, m mantissa bits); fp32 needs no cap below 2^24."""
    return int(round(1.0 / torch.finfo(dtype).eps)) // 4


def read_counts(block: torch.Tensor, spec: BucketSpec, validate: bool,
                exact: bool) -> torch.Tensor:
    """The summed counts' block (fp32 [P, L]) as int32 [P, L]. ``exact``: the fp32 wire,
    where a valid slot is a non-negative integer; on a 16-bit wire a valid slot is 0
    exactly or within 0.25 of a positive integer (the predivide round trip's last ulp).
    A malformed slot (negative, fractional, NaN, or a 16-bit slot that rounds to 0 from
    non-zero) raises naming the rank and layer when ``validate``; otherwise it becomes
    -1, so the layer is flagged (never a silent 0)."""
    if exact and not validate:
        # a negative slot stays non-zero; a fractional or NaN one becomes -1
        return torch.where(block == block.trunc(), block, -1.0).to(torch.int32)
    if exact:
        r = block
        bad = (block != block.trunc()) | (block < 0)         # NaN != NaN: bad
    else:
        r = block.round()
        bad = ((block - r).abs() > 0.25) | ((r == 0) != (block == 0)) | (r < 0) \
            | block.isnan()
    if validate:
        hit = bad.nonzero().tolist()
        if hit:
            rk, j = hit[0]
            raise RuntimeError(
                f"hvdsparse dense allreduce of bucket {spec.bucket_id}: rank {rk}'s "
                f"non-finite count for layer {spec.names[j]!r} arrived as "
                f"{float(block[rk, j])!r}, not a count; the message is malformed")
        return r.to(torch.int32)
    return torch.where(bad, torch.full_like(r, -1.0), r).to(torch.int32)


def launch(spec: BucketSpec, payloads, ctx: ExchangeContext,
           nonfinite_row: Optional[torch.Tensor] = None) -> Pending:
    device = bucket_device(payloads)
    P, N = ctx.world_size, spec.numel
    width = 0 if nonfinite_row is None else nonfinite_row.numel()
    # reused: the previous step's result of this bucket was consumed before this launch
    full = ctx.buffer("dense.flat", spec.bucket_id, N + P * width, torch.float32, device)
    own_dense(spec, payloads, device, out=full, ctx=ctx)       # elements [0, N)
    f = float(ctx.gradient_predivide_factor)
    fp32 = ctx.dense_dtype == torch.float32
    if fp32:
        t, pre, post = full, 1.0, 1.0
    else:
        t = ctx.buffer("dense.wire", spec.bucket_id, full.numel(), ctx.dense_dtype, device)
        pre, post = 1.0 / f, f
    row = nonfinite_row if width else None
    wire = None if fp32 else t
    if row is not None or wire is not None:
        device_graphs.run_bare(ctx.graphs, device, _launch_segment, full, N, row, ctx.rank,
                               None if fp32 else count_saturation(ctx.dense_dtype), wire)
    pend = DensePending(spec, NAME, list(payloads), ctx)
    pend._tensor, pend._flat = t, full
    pend.carries_nonfinite = bool(width)
    pend._handle = ctx.comm().allreduce_async_(t, name=ctx.name(spec.bucket_id, NAME),
                                               prescale_factor=pre, postscale_factor=post)
    vb = t.element_size()
    pend.sent_bytes = pend.recv_bytes = int(round(2 * (P - 1) / P * full.numel() * vb))
    return pend
