"""``dense``: allreduce of the error-fed gradient as the compressor selected it.

Each rank expands its own payloads into the flat bucket vector (``S_r``: exactly what
it would have sent sparse, so the compressor's residual bookkeeping is unchanged) and
the ranks allreduce it (op Sum) in fp32, or in fp16 with Horovod's pre/post scaling by
``gradient_predivide_factor`` (``S_r / f`` summed, times ``f``) to keep fp16 in range.
The result equals the allgather strategy's sum up to float summation order (fp32) or
fp16 rounding. With ``NoCompression`` it is a plain dense allreduce.

Bytes per rank (ring allreduce): sent = received = ``2 (P-1)/P * N * d`` (d = 4 or 2).

No host synchronisation: the flat vector (and its fp16 copy) are reused per bucket;
the cost model's figure (non-zeros of the allreduced sum, identical on every rank)
stays on the device (:class:`.base.DeferredFigures`).
"""
from __future__ import annotations

import time

import torch

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
            flat = self._tensor
        else:   # the fp32 launch buffer is free again: widen the fp16 sum into it
            flat = self._flat.copy_(self._tensor)
        if self.ctx.want_figures:
            # every rank holds the identical allreduced bytes -> identical count
            nnz = torch.count_nonzero(flat).reshape(1).to(torch.int64)
            self._defer_figures(nnz, lambda v: dict(reduced=int(v[0])))
        self.wait_s += t1 - t0
        self.decode_s += time.perf_counter() - t1
        self.result = flat
        return flat


def launch(spec: BucketSpec, payloads, ctx: ExchangeContext) -> Pending:
    device = bucket_device(payloads)
    # reused: the previous step's result of this bucket was consumed before this launch
    flat = own_dense(spec, payloads, device,
                     out=ctx.buffer("dense.flat", spec.bucket_id, spec.numel, torch.float32,
                                    device), ctx=ctx)
    f = float(ctx.gradient_predivide_factor)
    if ctx.dense_dtype == torch.float32:
        t, pre, post = flat, 1.0, 1.0
    else:
        t = ctx.buffer("dense.wire", spec.bucket_id, spec.numel, ctx.dense_dtype,
                       device).copy_(flat)
        pre, post = 1.0 / f, f
    pend = DensePending(spec, NAME, list(payloads), ctx)
    pend._tensor, pend._flat = t, flat
    pend._handle = ctx.comm().allreduce_async_(t, name=ctx.name(spec.bucket_id, NAME),
                                               prescale_factor=pre, postscale_factor=post)
    P = ctx.world_size
    vb = t.element_size()
    pend.sent_bytes = pend.recv_bytes = int(round(2 * (P - 1) / P * spec.numel * vb))
    return pend
