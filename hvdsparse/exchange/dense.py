"""``dense``: allreduce of the error-fed gradient as the compressor selected it.

Each rank expands its own payloads into the flat bucket vector (``S_r``: exactly what
it would have sent sparse, so the compressor's residual bookkeeping is unchanged) and
the ranks allreduce it (op Sum) in fp32, or in fp16 with Horovod's pre/post scaling by
``gradient_predivide_factor`` (``S_r / f`` summed, times ``f``) to keep fp16 in range.
The result equals the allgather strategy's sum up to float summation order (fp32) or
fp16 rounding. With ``NoCompression`` it is a plain dense allreduce.

Bytes per rank (ring allreduce): sent = received = ``2 (P-1)/P * N * d`` (d = 4 or 2).
"""
from __future__ import annotations

import time

import torch

from .base import BucketSpec, ExchangeContext, Pending, bucket_device, own_dense

NAME = "dense"


class DensePending(Pending):
    def finish(self) -> torch.Tensor:
        import horovod.torch as hvd
        if self.result is not None:
            return self.result
        t0 = time.perf_counter()
        hvd.synchronize(self._handle)
        t1 = time.perf_counter()
        flat = self._tensor if self._tensor.dtype == torch.float32 else self._tensor.float()
        if self.ctx.want_figures:
            # every rank holds the identical allreduced bytes -> identical count
            self.figures["reduced"] = int(torch.count_nonzero(flat).item())
        self.wait_s += t1 - t0
        self.decode_s += time.perf_counter() - t1
        self.result = flat
        return flat


def launch(spec: BucketSpec, payloads, ctx: ExchangeContext) -> Pending:
    import horovod.torch as hvd
    flat = own_dense(spec, payloads, bucket_device(payloads))
    f = float(ctx.gradient_predivide_factor)
    if ctx.dense_dtype == torch.float32:
        t, pre, post = flat, 1.0, 1.0
    else:
        t, pre, post = flat.to(ctx.dense_dtype), 1.0 / f, f
    pend = DensePending(spec, NAME, list(payloads), ctx)
    pend._tensor = t
    pend._handle = hvd.allreduce_async_(t, name=ctx.name(spec.bucket_id, NAME), op=hvd.Sum,
                                        prescale_factor=pre, postscale_factor=post)
    P = ctx.world_size
    vb = t.element_size()
    pend.sent_bytes = pend.recv_bytes = int(round(2 * (P - 1) / P * spec.numel * vb))
    return pend
