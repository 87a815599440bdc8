"""``split``: SparCML's split + allgather sparse allreduce (SC'19, section 5.3.2-5.3.3).

The bucket's flat index space ``[0, N)`` is cut into P contiguous ranges
``R_r = [r*N//P, (r+1)*N//P)``; rank r *owns* ``R_r``.

Phase 1 (split, one ``hvd.alltoall`` with splits): every rank expands its payloads to
the flat vector ``S`` (this rank's error-fed selection), takes its non-zeros
``{(i, S_i)}`` (ascending, so each range is a contiguous run) and sends the pairs of
``R_r`` to rank r as rows of ``[int32 index | value]`` bytes (value dtype fp16/bf16 when
every segment of the bucket travels in that dtype, else fp32).

Phase 2 (reduce + gather of the reduced ranges): owner r sums what it received into
``T_r`` (length ``N_r``), sender by sender in rank order (so the sum is bitwise
reproducible: within one sender's rows the indices are unique), counts
``K_r = nnz(T_r)`` and sends one message to every rank (one ``hvd.alltoall`` in which
each rank sends the same message to all; per rank the same link bytes as a ring
allgather, and the receivers learn every message's length from Horovod's received
splits, on the host): a 16-byte header ``int32[mode, K_r, pairs_received, e]`` and

* sparse (mode 0): ``K_r`` int32 range-relative indices, then ``K_r`` values (the
  pairs' dtype), while that message is strictly shorter than the dense one -- i.e.
  ``K_r (c + v) < N_r q``, SparCML's switch point ``delta_r = N_r q / (c + v)``
  (SSAR_Split_allgather);
* dense (mode 1, fp32, q = 4) or dense quantised (mode 2, ``split_dense_bits`` in
  {8, 4, 2}: ``ops.quantize_pack`` codes + one fp32 scale per ``quant_bucket``, QSGD
  stochastic rounding, unbiased) otherwise (DSAR_Split_allgather).

Message lengths (padded to 4 bytes): sparse ``pad4(16 + K (4 + v))``, dense
``16 + 4 N_r``, quantised ``16 + pad4(ceil(N_r b / 8)) + 4 ceil(N_r / Q)``. Because a
sparse message is sent only when strictly shorter than the dense one, the length alone
tells the receiver the mode and ``K_r = (len - 16) // (4 + v)``; the header is checked
against it on the validated (CPU) path.

Every rank (the owner included) decodes all P ranges from the same bytes, so all ranks
end with bit-identical sums even when the dense phase is quantised.

fp16 sums out of range: each rank's fp16 values are finite (compressors saturate them
at 65504), but their *sum* can exceed 65504, and a plain cast would deliver +-inf to
every rank where ``allgather`` (fp32 sums) delivers the right value. A sparse fp16
message therefore travels as ``fp16(T * 2^-e)`` with ``e`` = :func:`wire_exponent`
(0 while ``max |T| <= 65504``, else the smallest shift that brings the maximum below
2^15) in the header's last field; receivers multiply by ``2^e``. Scaling by a power of
two is exact, so the message's length, mode and rounding stay those of fp16 (values
that the shift moves below fp16's normal range, ``2^e * 6.1e-5``, keep fewer bits).
fp32 / bf16 pairs and the dense modes (fp32 values or fp32 scales) always have
``e = 0``.

Precision of phase 2 (no error feedback): the reduced sums travel as the pairs' dtype
(fp16/bf16 when every segment is fp16/bf16: one extra rounding of the *sum*) or, in
mode 2, quantised (unbiased, variance ``<= scale^2 / (4 s^2)`` per element). That error
is not fed back: the compressors' residuals hold each rank's own selection error only.
``scripts/split_phase2_error.py`` measures bytes vs accuracy.

Host synchronisation: the alltoall needs, on the host, the number of pairs per owner
(phase 1 splits) and ``K_r`` (the length of the phase-2 message). Both are computed on
the device and copied with :class:`.base.HostReadout` (one non-blocking copy + event
each); :meth:`SplitPending.advance` (called from the scheduler's hooks) starts the next
phase only when that event has completed, and :meth:`SplitPending.finish` waits on the
event otherwise. So a split bucket costs at most two event waits, in ``finish()``,
and no blocking read elsewhere. With an ordered transport (torch.distributed, which
matches collectives by issue order) phase 1 starts in ``launch()`` -- waiting on the
counts' event there -- and phase 2 in ``finish()``, never from a poll.

Decoding phase 2 (:func:`decode_ranges`): on the Triton path the sparse and dense
range messages of a bucket are written by one launch (``kernels/split_ranges.py``, its
row table staged host-to-device once), whatever P; quantised ranges one at a time.

Allocations: the own flat vector, the owner's reduced range and the flat sum are reused
per bucket (:class:`.base.BufferPool`); the pair rows and range messages change size
every step and are allocated per step. With the step engine's ``cuda_graphs`` on
(``ExchangeContext.graphs``), :func:`.base.own_dense` and the per-owner counts (fixed
sizes, reused buffers) replay as captured graphs; the phases after the counts' host
read depend on sizes the host learns each step and run eagerly.

Bytes per rank: phase 1 sent = pairs to other ranks x (4 + v), received = pairs from
other ranks x (4 + v); phase 2 sent = (P-1) x own message, received = the other ranks'
messages.
"""
from __future__ import annotations

import time
from typing import List

import numpy as np
import torch

from .. import codec, device_graphs, ops
from ..payload import ValueEncoding
from .wire import pad4
from .base import (BucketSpec, ExchangeContext, HostReadout, Pending, bucket_device,
                   host_list, own_dense)

NAME = "split"
if codec.ERR_INDEX != 1:      # flag_index_error ORs a bool into the flag
    raise ImportError(f"hvdsparse.exchange.split needs codec.ERR_INDEX == 1, got "
                      f"{codec.ERR_INDEX}")
HEADER_BYTES = 16
MODE_SPARSE, MODE_DENSE, MODE_QUANT = 0, 1, 2
#: the largest finite fp16 value; a shifted maximum ends below 2^FP16_SAFE_BITS
FP16_MAX, FP16_SAFE_BITS = 65504.0, 15
#: a received shift above this cannot come from finite fp32 sums (2^128 > fp32 max)
MAX_WIRE_EXPONENT = 128 - FP16_SAFE_BITS


def wire_exponent(vals: torch.Tensor, vdtype: torch.dtype) -> torch.Tensor:
    """int32[1] ``e >= 0`` such that ``vals * 2^-e`` fits fp16 (module docstring): 0 for
    non-fp16 pairs, while ``max |vals| <= 65504``, and for a non-finite maximum (which
    travels as before). Device ops, no host read."""
    if vdtype != torch.float16 or not vals.numel():
        return torch.zeros(1, dtype=torch.int32, device=vals.device)
    m = vals.abs().max()
    _, x = torch.frexp(m)                     # m = f * 2^x, f in [0.5, 1): m < 2^x
    e = torch.where(m > FP16_MAX, x - FP16_SAFE_BITS, torch.zeros_like(x))
    return e.clamp(min=0).to(torch.int32).reshape(1)


def to_wire_values(vals: torch.Tensor, vdtype: torch.dtype, e: torch.Tensor) -> torch.Tensor:
    """``vals * 2^-e`` in the pairs' dtype (exact shift, then the dtype's rounding)."""
    if vdtype != torch.float16:
        return vals.to(vdtype)
    return torch.ldexp(vals, -e).to(vdtype)


def from_wire_values(vals: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """fp32 ``vals * 2^e`` (``e`` broadcast: [1] for one message, [P, 1] for P rows),
    ``e`` clamped to ``[0, MAX_WIRE_EXPONENT]``: a received shift is range-checked on
    the validated path only, so the trusted path bounds it here."""
    return torch.ldexp(vals.float(), e.clamp(0, MAX_WIRE_EXPONENT))


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


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 view (a contiguous copy first when it is not)."""
    return t.contiguous().view(torch.uint8).reshape(-1)


def dense_range_nbytes(n: int, bits: int, quant_bucket: int) -> int:
    if not bits:
        return 4 * n
    return pad4(-(-n * bits // 8)) + 4 * (-(-n // quant_bucket))


def sparse_msg_nbytes(k: int, vb: int) -> int:
    return pad4(HEADER_BYTES + k * (4 + vb))


def dense_msg_nbytes(n_r: int, bits: int, quant_bucket: int) -> int:
    return HEADER_BYTES + dense_range_nbytes(n_r, bits, quant_bucket)


def range_mode(k: int, n_r: int, vb: int, bits: int, quant_bucket: int) -> int:
    """The owner's choice: sparse iff its message is strictly shorter than the dense one
    (an empty range is 'dense' with no body)."""
    if n_r == 0:
        return MODE_DENSE
    if sparse_msg_nbytes(k, vb) < dense_msg_nbytes(n_r, bits, quant_bucket):
        return MODE_SPARSE
    return MODE_QUANT if bits else MODE_DENSE


def parse_length(length: int, n_r: int, vb: int, bits: int, quant_bucket: int):
    """(mode, K) of a phase-2 message from its length alone (see the module docstring);
    None if no message of that length can exist."""
    dense = dense_msg_nbytes(n_r, bits, quant_bucket)
    if n_r == 0:
        return (MODE_DENSE, None) if length == HEADER_BYTES else None
    if length == dense:
        return (MODE_QUANT if bits else MODE_DENSE), None
    if HEADER_BYTES <= length < dense:
        k = (length - HEADER_BYTES) // (4 + vb)
        if sparse_msg_nbytes(k, vb) == length and k <= n_r:
            return MODE_SPARSE, k
    return None


def flag_index_error(ctx: ExchangeContext, bad: torch.Tensor) -> None:
    """Trusted path: OR the codec's 'index outside its layer' bit into the device error
    flag when any of ``bad`` is set (device-side; the scheduler reads it a step later)."""
    if ctx.error_flag is not None:
        # the bit is 1: the OR of a bool promotes it in place (two launches)
        ctx.error_flag.bitwise_or_(bad.any())


def owner_counts(flat: torch.Tensor, ends: torch.Tensor, nonempty: torch.Tensor,
                 ctx: ExchangeContext, tag: str, bucket_id: int) -> torch.Tensor:
    """Non-zeros of ``flat`` per owner region, on the device (int64[P]): the running
    count at each region's last index (``ends``), 0 for empty regions (``nonempty``),
    differenced. Phase 1's alltoall splits (``split``, ``balanced``)."""
    N, device = flat.numel(), flat.device
    if not N:
        return torch.zeros(ctx.world_size, dtype=torch.int64, device=device)
    if ops.has_cpu_path(flat):
        return _owner_counts_cpu(flat, ends, nonempty)
    return device_graphs.run_bare(
        ctx.graphs, device, _owner_counts_segment, flat, ends, nonempty,
        ctx.buffer(f"{tag}.cumsum", bucket_id, N, torch.int32, device))


def _owner_counts_segment(flat, ends, nonempty, running):
    """:func:`owner_counts`' device launches (a device segment of
    :mod:`hvdsparse.device_graphs`), ``running`` the int32 running-count buffer."""
    cs = torch.cumsum(flat != 0, 0, dtype=torch.int32, out=running)
    upto = cs.index_select(0, ends).to(torch.int64) * nonempty
    return torch.diff(upto, prepend=torch.zeros(1, dtype=torch.int64, device=flat.device))


def _owner_counts_cpu(flat: torch.Tensor, ends: torch.Tensor, nonempty: torch.Tensor):
    """:func:`owner_counts` on the CPU path: the same running counts from numpy
    ``count_nonzero`` over each region's new stretch (one read of the bucket, no int32
    running-count array: 26 -> ~3 ms per step on a 4.35 M-element bucket)."""
    fn = flat.detach().numpy()
    e, ne = ends.numpy(), nonempty.numpy()
    upto = np.zeros(e.shape[0], dtype=np.int64)
    last, acc = -1, 0
    for r in range(e.shape[0]):
        if not ne[r]:
            continue
        end = int(e[r])
        if end >= last:
            acc += int(np.count_nonzero(fn[last + 1:end + 1]))
            last = end
            upto[r] = acc
        else:                               # not reached for contiguous regions
            upto[r] = int(np.count_nonzero(fn[:end + 1]))
    return torch.from_numpy(np.diff(upto, prepend=np.int64(0)))


def send_pairs_to_owners(pend: Pending, tag: str) -> None:
    """Phase 1 of the split strategies (``split``, ``balanced``): this rank's non-zero
    pairs ``(int32 index, value)`` of the bucket's dense vector ``pend._own``, already
    ordered by owner, go to their owners in one alltoall. The per-owner counts
    (``pend._counts``, read here: the one host read per bucket) are Horovod's splits."""
    counts: List[int] = [int(c) for c in pend._counts.get()]
    total = sum(counts)
    flat, vb = pend._own, pend._vb
    # nonzero_static: the size is known on the host, so no device->host sync
    nz = torch.nonzero_static(flat, size=total).reshape(-1)
    rows = torch.cat([nz.to(torch.int32).view(torch.uint8).reshape(-1, 4),
                      flat[nz].to(pend._vdtype).contiguous().view(torch.uint8)
                      .reshape(-1, vb)], 1)
    splits = torch.tensor(counts, dtype=torch.int32)      # host tensor, as Horovod wants
    pend._handle = pend.ctx.comm().alltoall_async(
        rows.contiguous(), splits, name=pend.ctx.name(pend.spec.bucket_id, tag, "a2a"))
    pend.sent_bytes += (total - counts[pend.ctx.rank]) * (4 + vb)
    pend._phase = 1


def parse_pair_rows(rows: torch.Tensor, vdtype: torch.dtype):
    """Phase 1's received rows (uint8 [m, 4 + v]: int32 index, value in ``vdtype``) ->
    (int64 indices [m], fp32 values [m]). reshape(-1) before each view: with a single
    row, ``.contiguous()`` keeps the row stride (4 + v bytes, 6 for fp16 pairs) and a
    wider-dtype view of it is refused."""
    idx = rows[:, :4].reshape(-1).view(torch.int32).to(torch.int64)
    vals = rows[:, 4:].reshape(-1).view(vdtype).float()
    return idx, vals


def reduce_at_owner(pend: Pending, rows_in: torch.Tensor, recv_splits, lo: int, hi: int,
                    tag: str, region: str, disagree: str):
    """Phase 1's receiving side (``split``, ``balanced``): the owner of ``[lo, hi)`` sums
    the pairs it received into a reused fp32 buffer of ``hi - lo + 1`` elements, sender
    by sender in rank order (indices are unique within one sender's rows, so every
    ``index_add_`` is free of collisions and the sum is reproducible). The spare slot at
    ``hi - lo`` absorbs out-of-range indices on the trusted path (device error flag);
    with ``validate`` they raise, naming the rank, the bucket and the ``region``.
    Returns ``(buffer, local int64 indices or None, number of pairs)``."""
    ctx, r, b = pend.ctx, pend.ctx.rank, pend.spec.bucket_id
    n_r = hi - lo
    recv = host_list(recv_splits)
    m = int(rows_in.shape[0])
    if sum(recv) != m:
        raise RuntimeError(f"hvdsparse {tag} bucket {b}: received {m} pairs, splits say "
                           f"{sum(recv)}")
    pend.recv_bytes += (m - recv[r]) * (4 + pend._vb)
    red = ctx.buffer(f"{tag}.reduced", b, n_r + 1, torch.float32, pend._device).zero_()
    if not m:
        return red, None, m
    idx, vals = parse_pair_rows(rows_in, pend._vdtype)
    idx = idx - lo
    bad = (idx < 0) | (idx >= n_r)
    if ctx.validate:
        # host check (validated = CPU path, where reading values costs nothing)
        if bool(bad.any()):
            raise RuntimeError(f"hvdsparse {tag} bucket {b}: rank {r} received an index "
                               f"outside its {region} [{lo}, {hi}) (ranks disagree on "
                               f"{disagree})")
    else:
        idx = torch.where(bad, torch.full_like(idx, n_r), idx)
        flag_index_error(ctx, bad)
    a = 0
    for c in recv:
        if c:
            red.index_add_(0, idx[a:a + c], vals[a:a + c])
        a += c
    return red, idx, m


def decode_ranges(g: torch.Tensor, lens, bounds, spec: BucketSpec, ctx: ExchangeContext,
                  vdtype: torch.dtype, device):
    """Phase 2's receiving side: the P range messages ``g`` (uint8, ``lens[r]`` bytes from
    owner r of ``[bounds[r], bounds[r+1])``, back to back) decoded into the bucket's flat
    sum (a reused buffer, fp32 ``[N]``). Each message's mode and ``K`` come from its
    length (:func:`parse_length`); ``validate`` checks every header against them and
    raises on an index outside its range, naming the rank; the trusted path ORs
    ``ERR_INDEX`` into ``ctx.error_flag`` instead and writes nothing for that index. On
    the Triton path the sparse and dense ranges are written by one launch
    (:func:`ops.split_decode_ranges`, its row table staged in the pool); quantised ranges
    (and the CPU path's) one range at a time. Returns ``(flat, [sparse, dense,
    quantised] range counts, the P header views)``."""
    P, N, bid = ctx.world_size, spec.numel, spec.bucket_id
    vb = torch.finfo(vdtype).bits // 8
    bits, qb = ctx.split_dense_bits, ctx.quant_bucket
    # one spare slot at N absorbs out-of-range indices on the trusted per-range path
    buf = ctx.buffer("split.sum", bid, N + 1, torch.float32, device).zero_()
    flat = buf[:N]
    if g.numel() != sum(lens):
        raise RuntimeError(f"hvdsparse split bucket {bid}: received {g.numel()} bytes, "
                           f"splits say {sum(lens)}")
    off = 0
    modes = [0, 0, 0]
    hdr_views = []
    # (indices' int32 word, values' element, K, lo, n, dense, header's word) per range
    one_launch = not ctx.validate and ops.use_triton(buf) and g.data_ptr() % 4 == 0
    rows = []
    for r in range(P):
        lo, hi = bounds[r], bounds[r + 1]
        n_r, ln = hi - lo, lens[r]
        parsed = parse_length(ln, n_r, vb, bits, qb)
        if parsed is None:
            raise RuntimeError(
                f"hvdsparse split bucket {bid}: range message of rank {r} has {ln} bytes, "
                f"which no message for a range of {n_r} elements can have (ranks disagree "
                f"on the layout or split settings)")
        mode, k = parsed
        hdr_views.append(g[off:off + HEADER_BYTES])
        if ctx.validate:
            h = [int(x) for x in g[off:off + HEADER_BYTES].view(torch.int32).tolist()]
            if h[0] != mode or (k is not None and h[1] != k) or not 0 <= h[1] <= n_r:
                raise RuntimeError(
                    f"hvdsparse split bucket {bid}: header of rank {r} (mode {h[0]}, nnz "
                    f"{h[1]}) contradicts its length {ln} (mode {mode}, nnz {k}) for a "
                    f"range of {n_r} elements")
            shifted = mode == MODE_SPARSE and vdtype == torch.float16
            if not (0 <= h[3] <= MAX_WIRE_EXPONENT if shifted else h[3] == 0):
                raise RuntimeError(
                    f"hvdsparse split bucket {bid}: header of rank {r} carries the value "
                    f"shift {h[3]}, outside "
                    f"{'[0, %d]' % MAX_WIRE_EXPONENT if shifted else '{0}'} for a "
                    f"mode-{mode} range of {torch.finfo(vdtype).bits}-bit pairs")
        b = off + HEADER_BYTES
        if one_launch and mode != MODE_QUANT:
            rows.append((b // 4, b // 4, n_r, lo, n_r, 1, off // 4) if mode == MODE_DENSE
                        else (b // 4, (b + 4 * k) // vb, k, lo, n_r, 0, off // 4))
        elif mode == MODE_SPARSE:
            idx = g[b:b + 4 * k].view(torch.int32).to(torch.int64)
            vals = g[b + 4 * k:b + 4 * k + k * vb].view(vdtype)
            if vdtype == torch.float16:
                # the header's shift, read on the device
                vals = from_wire_values(vals, g[off + 12:off + 16].view(torch.int32))
            else:
                vals = vals.float()
            bad = (idx < 0) | (idx >= n_r)
            if ctx.validate:
                if bool(bad.any()):
                    raise RuntimeError(f"hvdsparse split bucket {bid}: rank {r} sent an "
                                       f"index outside its range")
                idx = idx + lo
            else:
                idx = torch.where(bad, torch.full_like(idx, N), idx + lo)
                flag_index_error(ctx, bad)
            buf.index_copy_(0, idx, vals)
        elif mode == MODE_DENSE:
            flat[lo:hi].copy_(g[b:b + 4 * n_r].view(torch.float32))
        else:
            nc = -(-n_r * bits // 8)
            codes = g[b:b + nc]
            sb = b + pad4(nc)
            scales = g[sb:sb + 4 * (-(-n_r // qb))].view(torch.float32)
            flat[lo:hi].copy_(ops.dequantize_unpack(codes, scales, bits, qb, n_r))
        modes[mode] += 1
        off += ln
    if rows:
        st = ctx.pool().tables().take(("split.ranges", bid), P, len(rows[0]), device)
        st.host[:len(rows)] = rows
        flag = ctx.error_flag if ctx.error_flag is not None else \
            torch.zeros(1, dtype=torch.int32, device=device)
        ops.split_decode_ranges(g, st.upload(), len(rows), max(row[2] for row in rows), buf,
                                flag, vdtype, MAX_WIRE_EXPONENT)
    return flat, modes, hdr_views


class SplitPending(Pending):
    """Phases: 0 = waiting for the per-owner counts on the host, 1 = alltoall of pairs
    in flight, 2 = reduced, waiting for ``K_r`` on the host, 3 = range messages in
    flight."""

    _phase = 0

    def advance(self) -> None:
        """Start whatever can start without waiting (called from the backward hooks).
        Nothing with an ordered transport: there a collective may only be issued where
        every rank issues it in the same order (launch / finish), not when a timing-
        dependent poll says so."""
        comm = self.ctx.comm()
        if comm.ordered:
            return
        if self._phase == 0 and self._counts.ready():
            self._start_phase1()
        if self._phase == 1 and comm.poll(self._handle):
            self._reduce()
        if self._phase == 2 and self._k.ready():
            self._start_phase2()

    # -- phase 1: alltoall of (index, value) pairs to the owners
    def _start_phase1(self) -> None:
        send_pairs_to_owners(self, NAME)

    # -- phase 2a: the owner sums its range
    def _reduce(self) -> None:
        t0 = time.perf_counter()
        rows_in, recv_splits = self.ctx.comm().synchronize(self._handle)
        t1 = time.perf_counter()
        r = self.ctx.rank
        lo, hi = self._bounds[r], self._bounds[r + 1]
        n_r = hi - lo
        red, _, m = reduce_at_owner(self, rows_in, recv_splits, lo, hi, NAME, "range",
                                    "the layout")
        self._reduced = red[:n_r]
        self._m = m
        k = torch.count_nonzero(self._reduced).reshape(1)
        self._k_dev = k.to(torch.int32)
        self._k = HostReadout(k.to(torch.int64))
        self._phase = 2
        self.wait_s += t1 - t0
        self.decode_s += time.perf_counter() - t1

    # -- phase 2b: the owner sends its range to every rank
    def _start_phase2(self) -> None:
        ctx, P, r = self.ctx, self.ctx.world_size, self.ctx.rank
        n_r, vb = self._reduced.numel(), self._vb
        k = int(self._k.get()[0])
        bits, qb = ctx.split_dense_bits, ctx.quant_bucket
        mode = range_mode(k, n_r, vb, bits, qb)
        red = self._reduced
        shift = torch.zeros(1, dtype=torch.int32, device=self._device)
        if mode == MODE_SPARSE:
            nz = torch.nonzero_static(red, size=k).reshape(-1)
            vals = red[nz]
            shift = wire_exponent(vals, self._vdtype)
            body = [as_bytes(nz.to(torch.int32)), as_bytes(to_wire_values(vals, self._vdtype, shift))]
            length = sparse_msg_nbytes(k, vb)
        elif mode == MODE_DENSE:
            body = [as_bytes(red)]
            length = dense_msg_nbytes(n_r, 0, qb)
        else:
            seed = (ctx.step * 1_000_003 + self.spec.bucket_id * 7919 + r) % (1 << 62)
            codes, scales = ops.quantize_pack(red, bits, qb, seed)
            body = [codes.reshape(-1)]
            pad = pad4(codes.numel()) - codes.numel()
            if pad:
                body.append(torch.zeros(pad, dtype=torch.uint8, device=codes.device))
            body.append(as_bytes(scales))
            length = dense_msg_nbytes(n_r, bits, qb)
        # header built on the device: host scalars are kernel arguments (no H2D copy of a
        # host buffer), K_r comes from the device count
        header = torch.zeros(4, dtype=torch.int32, device=self._device)
        header[0:1].fill_(mode)          # fill_ with a Python scalar: a kernel argument
        header[2:3].fill_(self._m)
        header[1:2].copy_(self._k_dev)
        header[3:4].copy_(shift)
        parts = [as_bytes(header)] + body
        used = HEADER_BYTES + sum(int(b.numel()) for b in body)
        if used < length:
            parts.append(torch.zeros(length - used, dtype=torch.uint8, device=self._device))
        msg = torch.cat(parts)
        assert msg.numel() == length, (msg.numel(), length)
        self._mode = mode
        out = msg.unsqueeze(0).expand(P, length).reshape(-1)
        splits = torch.full((P,), length, dtype=torch.int32)
        self._handle2 = ctx.comm().alltoall_async(
            out, splits, name=ctx.name(self.spec.bucket_id, NAME, "ranges"))
        self.sent_bytes += (P - 1) * length
        self._phase = 3

    def finish(self) -> torch.Tensor:
        if self.result is not None:
            return self.result
        t0 = time.perf_counter()
        booked = self.wait_s + self.decode_s   # phases below book their own wait / decode
        if self._phase == 0:
            self._start_phase1()          # waits on the counts' event if needed
        if self._phase == 1:
            self._reduce()
        if self._phase == 2:
            self._start_phase2()          # waits on K_r's event if needed
        t0b = time.perf_counter()
        gathered, recv_splits = self.ctx.comm().synchronize(self._handle2)
        t1 = time.perf_counter()
        ctx, P, me = self.ctx, self.ctx.world_size, self.ctx.rank
        lens = host_list(recv_splits)
        flat, modes, hdr_views = decode_ranges(gathered, lens, self._bounds, self.spec, ctx,
                                               self._vdtype, self._device)
        others = sum(lens) - lens[me]
        self.recv_bytes += others
        self.figures["range_modes"] = dict(sparse=modes[0], dense=modes[1], quantised=modes[2])
        if ctx.want_figures:
            # header int32[mode, K_r, pairs_received, 0] of every range, summed on the device
            h = torch.stack([v.view(torch.int32)[1:3] for v in hdr_views]).to(torch.int64)
            sums = h.sum(0)
            self._defer_figures(sums, lambda v, P=P: dict(pairs=float(v[1]) / P,
                                                          reduced=int(v[0])))
        self._book_finish(t0, booked, t0b, t1)
        self.result = flat
        return flat


def launch(spec: BucketSpec, payloads, ctx: ExchangeContext) -> Pending:
    device = bucket_device(payloads)
    P, N = ctx.world_size, spec.numel
    if N >= 2 ** 31 - 1:
        raise ValueError(f"hvdsparse split: bucket {spec.bucket_id} has {N} elements; "
                         f"int32 indices need < 2**31 - 1 (lower fusion_threshold)")
    # reused: phase 1 of the previous step's exchange of this bucket read it long ago
    flat = own_dense(spec, payloads, device, ctx=ctx,
                     out=ctx.buffer("split.own", spec.bucket_id, N, torch.float32, device))
    vdtype = pair_dtype(payloads)
    vb = torch.finfo(vdtype).bits // 8
    bounds = range_bounds(N, P)
    pool = ctx.pool()
    counts = owner_counts(flat, pool.const_index([max(b - 1, 0) for b in bounds[1:]], device),
                          pool.const_index([int(b > 0) for b in bounds[1:]], device),
                          ctx, NAME, spec.bucket_id)
    pend = SplitPending(spec, NAME, list(payloads), ctx)
    pend._bounds, pend._vdtype, pend._vb, pend._device = bounds, vdtype, vb, device
    pend._own = flat
    pend._counts = HostReadout(counts)
    if ctx.comm().ordered:
        pend._start_phase1()    # issue order must not depend on timing: start it here
    else:
        pend.advance()          # on CPU (or if the copy is already done) phase 1 starts now
    return pend
