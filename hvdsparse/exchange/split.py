"""``split``: SparCML's split + allgather sparse allreduce (SC'19, section 5.3.2-5.3.3).

The bucket's flat index space ``[0, N)`` is cut into P contiguous ranges
``R_r = [r*N//P, (r+1)*N//P)``; rank r *owns* ``R_r``.

Phase 1 (split, one ``hvd.alltoall`` with splits): every rank expands its payloads to
the flat vector ``S`` (this rank's error-fed selection), takes its non-zeros
``{(i, S_i)}`` (ascending, so each range is a contiguous run) and sends the pairs of
``R_r`` to rank r as rows of ``[int32 index | value]`` bytes (value dtype fp16/bf16 when
every segment of the bucket travels in that dtype, else fp32).

Phase 2 (reduce + allgather): owner r sums what it received into ``T_r`` (length
``N_r``), counts ``K_r = nnz(T_r)`` and sends one message through ``hvd.allgather``:
a 16-byte header ``int32[mode, K_r, pairs_received, 0]`` and

* sparse (mode 0): ``K_r`` int32 range-relative indices and ``K_r`` values, while
  ``K_r (c + v) <= N_r q`` -- i.e. ``K_r <= delta_r = N_r q / (c + v)``, SparCML's switch
  point (SSAR_Split_allgather);
* dense (mode 1, fp32, q = 4) or dense quantised (mode 2, ``split_dense_bits`` in
  {8, 4, 2}: ``ops.quantize_pack`` codes + one fp32 scale per ``quant_bucket``, QSGD
  stochastic rounding, unbiased) otherwise (DSAR_Split_allgather).

Every rank (the owner included) decodes all P ranges from the gathered bytes, so all
ranks end with bit-identical sums even when the dense phase is quantised. Message
lengths follow from the header and ``N_r`` (known to all), so no size exchange is needed.

Host synchronisation: building the alltoall splits needs the number of non-zeros per
range on the host (one ``nonzero``), and phase 2 needs ``K_r``: both unavoidable for a
variable-size sparse collective; they happen at launch / completion of the bucket, not
per element.

Bytes per rank: phase 1 sent = pairs to other ranks x (4 + v), received = pairs from
other ranks x (4 + v); phase 2 (ring allgather) sent = received = sum of the other
ranks' range messages.
"""
from __future__ import annotations

import time

import torch

from .. import ops
from ..payload import ValueEncoding
from .base import BucketSpec, ExchangeContext, Pending, bucket_device, own_dense

NAME = "split"
HEADER_BYTES = 16
MODE_SPARSE, MODE_DENSE, MODE_QUANT = 0, 1, 2


def range_bounds(numel: int, world_size: int):
    """Start of every owner's range plus N: ``[r*N//P for r in 0..P]``."""
    return [r * numel // world_size for r in range(world_size + 1)]


def pair_dtype(payloads) -> torch.dtype:
    encs = {s.value_encoding for p in payloads for s in p.segments}
    if encs == {ValueEncoding.FP16}:
        return torch.float16
    if encs == {ValueEncoding.BF16}:
        return torch.bfloat16
    return torch.float32


def _pad4(n: int) -> int:
    return (n + 3) & ~3


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def dense_range_nbytes(n: int, bits: int, quant_bucket: int) -> int:
    if not bits:
        return 4 * n
    return _pad4(-(-n * bits // 8)) + 4 * (-(-n // quant_bucket))


class SplitPending(Pending):
    _phase = 1

    def advance(self) -> None:
        import horovod.torch as hvd
        if self._phase == 1 and hvd.poll(self._handle):
            self._start_phase2()

    def _start_phase2(self) -> None:
        import horovod.torch as hvd
        t0 = time.perf_counter()
        rows_in, recv_splits = hvd.synchronize(self._handle)
        t1 = time.perf_counter()
        ctx, P, r = self.ctx, self.ctx.world_size, self.ctx.rank
        lo, hi = self._bounds[r], self._bounds[r + 1]
        n_r = hi - lo
        vb = self._vb
        m = int(rows_in.shape[0])
        self.recv_bytes += (m - int(recv_splits[r])) * (4 + vb)
        reduced = torch.zeros(n_r, dtype=torch.float32, device=self._device)
        if m:
            idx = rows_in[:, :4].contiguous().view(torch.int32).reshape(-1).to(torch.int64) - lo
            if int(idx.min()) < 0 or int(idx.max()) >= n_r:
                raise RuntimeError(
                    f"hvdsparse split bucket {self.spec.bucket_id}: rank {r} received an "
                    f"index outside its range [{lo}, {hi}) (ranks disagree on the layout)")
            vals = rows_in[:, 4:].contiguous().view(self._vdtype).reshape(-1).float()
            reduced.index_add_(0, idx.to(reduced.device), vals.to(reduced.device))
        nz = torch.nonzero(reduced).reshape(-1)
        k = int(nz.numel())
        bits, qb = ctx.split_dense_bits, ctx.quant_bucket
        if k * (4 + vb) <= dense_range_nbytes(n_r, bits, qb):
            mode = MODE_SPARSE
            body = [_bytes(nz.to(torch.int32)), _bytes(reduced[nz].to(self._vdtype))]
        elif not bits:
            mode = MODE_DENSE
            body = [_bytes(reduced)]
        else:
            mode = MODE_QUANT
            seed = (ctx.step * 1_000_003 + self.spec.bucket_id * 7919 + r) % (1 << 62)
            codes, scales = ops.quantize_pack(reduced, bits, qb, seed)
            body = [codes.reshape(-1)]
            pad = _pad4(codes.numel()) - codes.numel()
            if pad:
                body.append(torch.zeros(pad, dtype=torch.uint8, device=codes.device))
            body.append(_bytes(scales))
        header = torch.tensor([mode, k, m, 0], dtype=torch.int32, device=self._device)
        parts = [_bytes(header)] + [b.to(self._device) for b in body]
        msg = torch.cat(parts)
        if msg.numel() % 4:
            msg = torch.cat([msg, torch.zeros(4 - msg.numel() % 4, dtype=torch.uint8,
                                              device=msg.device)])
        self._msg_len = int(msg.numel())
        self._handle2 = hvd.allgather_async(msg, name=ctx.name(self.spec.bucket_id, NAME, "ag"))
        self._phase = 2
        self.wait_s += t1 - t0
        self.decode_s += time.perf_counter() - t1

    def _msg_nbytes(self, mode: int, k: int, n_r: int) -> int:
        if mode == MODE_SPARSE:
            n = HEADER_BYTES + 4 * k + k * self._vb
        elif mode == MODE_DENSE:
            n = HEADER_BYTES + 4 * n_r
        elif mode == MODE_QUANT:
            n = HEADER_BYTES + dense_range_nbytes(n_r, self.ctx.split_dense_bits,
                                                  self.ctx.quant_bucket)
        else:
            raise RuntimeError(f"hvdsparse split bucket {self.spec.bucket_id}: unknown "
                               f"range mode {mode}")
        return _pad4(n)

    def finish(self) -> torch.Tensor:
        import horovod.torch as hvd
        if self.result is not None:
            return self.result
        if self._phase == 1:
            self._start_phase2()
        t0 = time.perf_counter()
        gathered = hvd.synchronize(self._handle2)
        t1 = time.perf_counter()
        P, me, vb = self.ctx.world_size, self.ctx.rank, self._vb
        flat = torch.zeros(self.spec.numel, dtype=torch.float32, device=self._device)
        g = gathered.to(self._device)
        off, total_k, total_pairs, others = 0, 0, 0, 0
        modes = [0, 0, 0]
        for r in range(P):
            lo, hi = self._bounds[r], self._bounds[r + 1]
            n_r = hi - lo
            if off + HEADER_BYTES > g.numel():
                raise RuntimeError(f"hvdsparse split bucket {self.spec.bucket_id}: gathered "
                                   f"message truncated at range {r}")
            mode, k, pairs, _ = (int(x) for x in g[off:off + HEADER_BYTES].clone()
                                 .view(torch.int32).tolist())
            ln = self._msg_nbytes(mode, k, n_r)
            if k < 0 or k > n_r or off + ln > g.numel():
                raise RuntimeError(f"hvdsparse split bucket {self.spec.bucket_id}: bad header "
                                   f"from rank {r} (mode {mode}, nnz {k}, range {n_r})")
            b = off + HEADER_BYTES
            if mode == MODE_SPARSE:
                idx = g[b:b + 4 * k].clone().view(torch.int32).to(torch.int64) + lo
                vals = g[b + 4 * k:b + 4 * k + k * vb].clone().view(self._vdtype).float()
                flat.index_copy_(0, idx, vals)
            elif mode == MODE_DENSE:
                flat[lo:hi] = g[b:b + 4 * n_r].clone().view(torch.float32)
            else:
                bits, qb = self.ctx.split_dense_bits, self.ctx.quant_bucket
                nc = -(-n_r * bits // 8)
                codes = g[b:b + nc].clone()
                sb = b + _pad4(nc)
                scales = g[sb:sb + 4 * (-(-n_r // qb))].clone().view(torch.float32)
                flat[lo:hi] = ops.dequantize_unpack(codes, scales, bits, qb, n_r)
            modes[mode] += 1
            if r != me:
                others += ln
            total_k += k
            total_pairs += pairs
            off += ln
        self.sent_bytes += others
        self.recv_bytes += others
        self.figures["pairs"] = total_pairs / P
        self.figures["reduced"] = total_k
        self.figures["range_modes"] = dict(sparse=modes[0], dense=modes[1], quantised=modes[2])
        self.wait_s += t1 - t0
        self.decode_s += time.perf_counter() - t1
        self.result = flat
        return flat


def launch(spec: BucketSpec, payloads, ctx: ExchangeContext) -> Pending:
    import horovod.torch as hvd
    device = bucket_device(payloads)
    P, N = ctx.world_size, spec.numel
    if N >= 2 ** 31:
        raise ValueError(f"hvdsparse split: bucket {spec.bucket_id} has {N} elements; "
                         f"int32 indices need < 2**31 (lower fusion_threshold)")
    flat = own_dense(spec, payloads, device)
    vdtype = pair_dtype(payloads)
    vb = torch.tensor([], dtype=vdtype).element_size()
    nz = torch.nonzero(flat).reshape(-1)
    bounds = range_bounds(N, P)
    if P > 1:
        edges = torch.tensor(bounds[1:P], dtype=nz.dtype, device=nz.device)
        dest = torch.bucketize(nz, edges, right=True)
        counts = torch.bincount(dest, minlength=P).cpu()
    else:
        counts = torch.tensor([nz.numel()], dtype=torch.int64)
    rows = torch.cat([nz.to(torch.int32).view(torch.uint8).reshape(-1, 4),
                      flat[nz].to(vdtype).contiguous().view(torch.uint8).reshape(-1, vb)], 1)
    pend = SplitPending(spec, NAME, list(payloads), ctx)
    pend._bounds, pend._vdtype, pend._vb, pend._device = bounds, vdtype, vb, device
    splits = counts.to(torch.int32)
    pend._handle = hvd.alltoall_async(rows.contiguous(), splits=splits,
                                      name=ctx.name(spec.bucket_id, NAME, "a2a"))
    pend.sent_bytes = (int(nz.numel()) - int(counts[ctx.rank])) * (4 + vb)
    return pend
