"""``balanced``: Ok-Topk's balanced split sparse allreduce (Li & Hoefler, PPoPP'22).

Regions
-------
The bucket's flat index space ``[0, N)`` is cut at boundaries ``0 = b_0 <= b_1 <= ...
<= b_P = N``; rank r *owns* ``R_r = [b_r, b_{r+1})``. Unlike ``split`` (equal widths)
the boundaries follow where the selected coordinates fall, so every owner receives
about the same number of pairs (:class:`Balance`, below). They start equal-width and are
reused from step to step.

Phase 1 (alltoall with splits, as ``split``): every rank expands its payloads into the
flat vector ``S`` (its error-fed selection) and sends the non-zeros of ``R_r`` to rank r
as rows ``[int32 index | value]`` (value dtype fp16/bf16 when every segment of the
bucket travels in it, else fp32). The per-owner pair counts are computed on the device
and read on the host once (:class:`.base.HostReadout`): **the one host synchronisation
of a bucket** (Horovod's alltoall needs its splits on the host).

Phase 2a (owner r): ``T_r`` = the received pairs summed sender by sender in rank order
(indices are unique within one sender, so every ``index_add_`` is collision-free and the
sum is reproducible); then Ok-Topk's global top-k, owner by owner: r keeps the ``c``
entries of largest ``|T_r|`` (ties: ``torch.topk``'s choice, made by the owner alone),
``c = phase2_capacity(P, N, capacity, n_max)`` (:mod:`.cost_model`): ``ceil(k / P)``
for a selection of ``k`` slots per rank, so the P owners together keep the global budget
``k`` -- or everything (``c = max_r |R_r|``, exact) when the payloads may be dense
(``k >= N``). With balanced regions each owner's share of the global top-k is about
``k / P``, which is what makes a fixed per-owner share a good approximation of one
global top-k.

Phase 2b (one allgather of equal-length messages: no size exchange, no host read):
owner r's message, ``L = 32 + 4 H + 4 c + pad4(c v)`` bytes::

    int32[8]  header: kept (non-zeros among the c values), nnz(T_r), pairs received,
              r, then fp32 sum(T_r^2), fp32 sum(kept^2), int32 e, 0
    int32[H]  histogram of the received pairs' positions over H equal sub-bins of R_r
    int32[c]  range-relative indices; padding slots (when |R_r| < c) hold |R_r|
    v[c]      values in the pairs' dtype (padding 0), zero-padded to 4 bytes

Every rank (the owner included) decodes all P messages from the same gathered bytes, so
all replicas end with bit-identical sums. fp16 values whose sum leaves fp16's range
travel as ``fp16(v * 2^-e)``, ``e`` in the header, as in :mod:`.split`
(:func:`.split.wire_exponent`; 0 for other dtypes and while ``max |v| <= 65504``).

Truncation error (fed back; reported)
-------------------------------------
Phase 2 sends ``top_c(T_r)``, not ``T_r``: the dropped part ``T_r - top_c(T_r)`` is not
delivered this step. As in Ok-Topk it goes back into the local residuals: every rank
knows the delivered coordinates (the gathered indices), so ``finish()`` sets
``Pending.undelivered`` = this rank's own phase-1 values (as they went on the wire, in
the pairs' dtype) at the coordinates it sent that no owner delivered, 0 elsewhere. The
sum of these over the ranks is exactly the dropped part. The front doors
(``LayerScheduler``, the DDP hook) add it into each layer's residual (device ops, inside
the step's transaction, so a skipped step's rollback undoes it) and mask DGC's velocity
only where an element was delivered; each rank's residual then ends the step as
``v - (what of v was delivered)``. Only when no truncation is possible (``c`` >= the
widest region) is ``undelivered`` left None. A policy-dense layer (no residual of its
own) in a bucket whose capacity is below ``N`` (mixed with sparse layers) can be
truncated too; it takes its share back into a residual made for it
(``Compressor.take_back``), which its next dense send flushes. Only a layer with
``error_feedback=False`` loses its share. A bucket of dense payloads only (``k >= N``)
is kept whole. The error is
reported per bucket in ``Pending.figures`` (on CPU at once, on CUDA through
``deferred_figures``): ``p2_kept`` / ``reduced`` (entries kept / non-zeros of the sum)
and ``p2_dropped_energy`` = ``1 - sum kept^2 / sum T^2`` (share of the sum's squared
norm not delivered this step, fed back as above). Values in fp16/bf16 round the *sum*
once more, as in ``split`` (that rounding is not fed back). When the union of the
ranks' selections fits (``nnz(T_r) <= c`` for every owner) nothing is dropped and the
result is the exact sum (up to float order).

Balancing (identical on every rank, no extra collective)
---------------------------------------------------------
The gathered headers give every rank the same P x H histogram of where phase-1 pairs
fell. From it every exchange computes, on the device, *candidate* boundaries: the
positions where the cumulative pair count crosses ``j M / P`` (``j = 1..P-1``, linear
within a sub-bin; integer arithmetic) and the imbalance ``max_r m_r / (M / P)``
(``m_r`` = pairs received by owner r). Both reach the host through a
:class:`.base.HostReadout`; the exchange ``n`` of a bucket reads those of exchange
``n - 2`` (whose copy completed before exchange ``n - 1``'s collectives could, so the
read never stalls and every rank reads the same values) and adopts the candidate when
they were computed under the current boundaries and either the imbalance exceeds
``IMBALANCE_BOUND`` or ``REBALANCE_EVERY`` exchanges have passed since the last change.
The decision depends only on values every rank holds, so all ranks switch at the same
exchange.

The boundaries live in the optimizer's buffer pool, not in its ``state_dict``: a run
resumed from a checkpoint starts again from equal-width regions, so once phase 2 drops
entries it is not bitwise the uninterrupted run (the kept set depends on the regions).

Bytes per rank: phase 1 sent = pairs to other owners x (4 + v), received = pairs from
other ranks x (4 + v); phase 2 sent = received = ``(P - 1) L`` (ring allgather).
"""
from __future__ import annotations

import time
from collections import deque
from typing import List

import torch

from . import cost_model
from .base import (BucketSpec, DeferredFigures, ExchangeContext, HostReadout, Pending,
                   bucket_device, own_dense)
from .split import (MAX_WIRE_EXPONENT, as_bytes, flag_index_error, from_wire_values,
                    owner_counts, pair_dtype, reduce_at_owner, send_pairs_to_owners,
                    to_wire_values, wire_exponent)
from .wire import HIST_BINS
from .wire import balanced_message_nbytes as message_nbytes

NAME = "balanced"
#: re-balance at least this often (exchanges of the bucket) ...
REBALANCE_EVERY = 16
#: ... or as soon as the most loaded owner receives this many times the mean
IMBALANCE_BOUND = 1.25


def equal_bounds(numel: int, world_size: int) -> List[int]:
    return [r * numel // world_size for r in range(world_size + 1)]


def sub_bin_edges(bounds: List[int], hist_bins: int = HIST_BINS) -> List[int]:
    """Edges of the P x H histogram: owner r's region cut into H equal sub-bins
    (``b_r + j |R_r| // H``); P H + 1 non-decreasing integers from 0 to N."""
    edges = []
    for r in range(len(bounds) - 1):
        lo, n = bounds[r], bounds[r + 1] - bounds[r]
        edges.extend(lo + (j * n) // hist_bins for j in range(hist_bins))
    edges.append(bounds[-1])
    return edges


def candidate_bounds(hist: torch.Tensor, edges: torch.Tensor, world_size: int) -> torch.Tensor:
    """Boundaries that split the pairs counted in ``hist`` (int64, P H sub-bins with
    ``edges``, int64[P H + 1]) into P equal shares: ``b_j`` = where the cumulative count
    reaches ``ceil(j M / P)``, interpolated linearly inside that sub-bin (integer
    arithmetic, so every rank computes the same numbers). Returns int64[P + 1] (the
    current edges' own boundaries when ``M = 0``). Device ops only."""
    P = int(world_size)
    C = hist.reshape(-1).to(torch.int64)
    cum = torch.cumsum(C, 0)
    M = cum[-1:]
    j = torch.arange(1, P, device=C.device, dtype=torch.int64)
    t = (j * M + (P - 1)) // P                       # ceil(j M / P), >= 1 when M > 0
    i = torch.searchsorted(cum, t).clamp_(max=C.numel() - 1)
    before = cum[i] - C[i]
    width = edges[i + 1] - edges[i]
    pos = edges[i] + ((t - before) * width) // C[i].clamp(min=1)
    H = C.numel() // P
    current = edges[H * j]                           # the edges at the owners' starts
    inner = torch.where(M > 0, pos, current)
    inner = torch.cummax(inner, 0).values
    return torch.cat([edges[:1], inner, edges[-1:]])


class Balance:
    """Per-bucket boundaries and their re-balancing history (kept in the optimizer's
    :class:`.base.BufferPool`, one per bucket, numel and world size)."""

    def __init__(self, numel: int, world_size: int, device):
        self.numel, self.world_size, self.device = int(numel), int(world_size), device
        self.version = 0
        self.since = 0                   # exchanges since the boundaries last changed
        self.changes = 0
        self.history = deque(maxlen=2)  # (version, HostReadout) of the last two exchanges
        self._set(equal_bounds(self.numel, self.world_size))

    def _set(self, bounds: List[int]) -> None:
        """Adopt ``bounds``; the device copies of everything derived from them are made
        here, once per change (pinned + non-blocking on CUDA: no stream sync)."""
        self.bounds = [int(b) for b in bounds]
        P = self.world_size

        def dev(values):
            t = torch.tensor(values, dtype=torch.int64)
            if self.device.type == "cuda":
                return t.pin_memory().to(self.device, non_blocking=True)
            return t.to(self.device)
        self.lo_t = dev(self.bounds[:-1]).view(P, 1)
        self.n_t = dev([b - a for a, b in zip(self.bounds, self.bounds[1:])]).view(P, 1)
        self.ends = dev([max(b - 1, 0) for b in self.bounds[1:]])
        self.nonempty = dev([int(b > 0) for b in self.bounds[1:]])
        self.edges = dev(sub_bin_edges(self.bounds))

    def before_launch(self) -> None:
        """Adopt the candidate of the exchange two back when the rule says so (module
        docstring); every rank reaches the same decision."""
        if len(self.history) == 2:
            version, readout = self.history[0]
            if version == self.version:
                v = readout.get()
                P = self.world_size
                M, maxm = v[0], v[3]
                imbalance = maxm * P / M if M > 0 else 1.0
                cand = [int(x) for x in v[6:6 + P + 1]]
                if (imbalance > IMBALANCE_BOUND or self.since >= REBALANCE_EVERY) \
                        and M > 0:
                    self.since = 0
                    if cand != self.bounds:
                        self._set(cand)
                        self.version += 1
                        self.changes += 1
        self.since += 1

    def record(self, readout: HostReadout) -> None:
        self.history.append((self.version, readout))


def _figures(v, P: int) -> dict:
    M, nnz, kept, maxm, ss_red, ss_kept = v[:6]
    return dict(pairs=float(M) / P, reduced=int(nnz), p2_kept=int(kept),
                p2_dropped_energy=float(max(0.0, 1.0 - ss_kept / ss_red)) if ss_red > 0
                else 0.0,
                imbalance=float(maxm * P / M) if M > 0 else 1.0)


class BalancedPending(Pending):
    """Phases: 0 = waiting for the per-owner counts on the host, 1 = alltoall of pairs
    in flight, 2 = allgather of the owners' selections in flight."""

    _phase = 0

    def advance(self) -> None:
        comm = self.ctx.comm()
        if comm.ordered:      # issue collectives only from launch() / finish()
            return
        if self._phase == 0 and self._counts.ready():
            self._start_phase1()
        if self._phase == 1 and comm.poll(self._handle):
            self._reduce_and_gather()

    def _start_phase1(self) -> None:
        send_pairs_to_owners(self, NAME)

    def _reduce_and_gather(self) -> None:
        t0 = time.perf_counter()
        rows_in, recv_splits = self.ctx.comm().synchronize(self._handle)
        t1 = time.perf_counter()
        ctx, P, r = self.ctx, self.ctx.world_size, self.ctx.rank
        bounds, c, H = self._bounds, self._c, HIST_BINS
        lo, hi = bounds[r], bounds[r + 1]
        n_r = hi - lo
        dev = self._device
        red, idx, m = reduce_at_owner(self, rows_in, recv_splits, lo, hi, NAME, "region",
                                      "the layout or the boundaries")
        hist = torch.zeros(H + 1, dtype=torch.int32, device=dev)
        if m:
            # sub-bin of every pair (bad ones land in the spare bin H); scatter_add_
            # rather than bincount, whose output size would need a host read
            sb = torch.where(idx < n_r, (idx * H) // max(n_r, 1), torch.full_like(idx, H))
            hist.scatter_add_(0, sb, torch.ones_like(sb, dtype=torch.int32))
        T = red[:n_r]
        if c < n_r:
            _, sel = torch.topk(T.abs(), c, sorted=False)
            sel_vals = T[sel]
        else:                         # everything fits: exact, padded with |R_r|
            sel = torch.arange(n_r, device=dev, dtype=torch.int64)
            sel_vals = T
            if c > n_r:
                sel = torch.cat([sel, torch.full((c - n_r,), n_r, dtype=torch.int64,
                                                 device=dev)])
                sel_vals = torch.cat([sel_vals, sel_vals.new_zeros(c - n_r)])
        shift = wire_exponent(sel_vals, self._vdtype)
        wire_vals = to_wire_values(sel_vals, self._vdtype, shift)
        hdr_i = torch.stack([torch.count_nonzero(wire_vals), torch.count_nonzero(T),
                             torch.zeros((), dtype=torch.int64, device=dev) + m,
                             torch.zeros((), dtype=torch.int64, device=dev) + r]
                            ).to(torch.int32)
        hdr_f = torch.stack([T.square().sum(),
                             from_wire_values(wire_vals, shift).square().sum()])
        tail = torch.cat([shift, shift.new_zeros(1)])
        parts = [as_bytes(hdr_i), as_bytes(hdr_f), as_bytes(tail), as_bytes(hist[:H]),
                 as_bytes(sel.to(torch.int32)), as_bytes(wire_vals)]
        used = sum(int(p.numel()) for p in parts)
        if used < self._L:
            parts.append(torch.zeros(self._L - used, dtype=torch.uint8, device=dev))
        msg = torch.cat(parts)
        assert msg.numel() == self._L, (msg.numel(), self._L)
        self._handle2 = ctx.comm().allgather_async(
            msg, name=ctx.name(self.spec.bucket_id, NAME, "gather"))
        self.sent_bytes += (P - 1) * self._L
        self.recv_bytes += (P - 1) * self._L
        self._phase = 2
        self.wait_s += t1 - t0
        self.decode_s += time.perf_counter() - t1

    def _undelivered(self, target: torch.Tensor, N: int) -> torch.Tensor:
        """This rank's own phase-1 values (as they went on the wire, in the pairs'
        dtype) at the coordinates no owner delivered in phase 2; 0 elsewhere. ``target``
        holds the gathered flat indices (padding and bad indices at ``N``). The sum of
        this over the ranks is exactly ``T - top_c(T)``, the part phase 2 dropped.
        Device ops only."""
        ctx, dev, b = self.ctx, self._device, self.spec.bucket_id
        hit = ctx.buffer("balanced.delivered", b, N + 1, torch.bool, dev).zero_()
        hit.index_fill_(0, target, True)
        own = self._own if self._vdtype == torch.float32 else \
            self._own.to(self._vdtype).float()
        out = ctx.buffer("balanced.undelivered", b, N, torch.float32, dev)
        return torch.where(hit[:N], torch.zeros((), dtype=torch.float32, device=dev), own,
                           out=out)

    def finish(self) -> torch.Tensor:
        if self.result is not None:
            return self.result
        t0 = time.perf_counter()
        booked = self.wait_s + self.decode_s   # phases below book their own wait / decode
        if self._phase == 0:
            self._start_phase1()          # waits on the counts' event if needed
        if self._phase == 1:
            self._reduce_and_gather()
        t0b = time.perf_counter()
        gathered = self.ctx.comm().synchronize(self._handle2)
        t1 = time.perf_counter()
        ctx, P, N, c, L, H = (self.ctx, self.ctx.world_size, self.spec.numel, self._c,
                              self._L, HIST_BINS)
        if gathered.numel() != P * L:
            raise RuntimeError(f"hvdsparse balanced bucket {self.spec.bucket_id}: received "
                               f"{gathered.numel()} bytes, expected {P} x {L} (ranks "
                               f"disagree on the layout or the boundaries)")
        g = gathered.view(P, L)
        hdr_i = g[:, :16].contiguous().view(torch.int32)                       # [P, 4]
        hdr_f = g[:, 16:24].contiguous().view(torch.float32)                   # [P, 2]
        shift = g[:, 24:28].contiguous().view(torch.int32)                     # [P, 1]
        hist = g[:, 32:32 + 4 * H].contiguous().view(torch.int32)              # [P, H]
        ib = 32 + 4 * H
        rel = g[:, ib:ib + 4 * c].contiguous().view(torch.int32).to(torch.int64)  # [P, c]
        vals = g[:, ib + 4 * c:ib + 4 * c + c * self._vb].contiguous().view(self._vdtype)
        bal = self._balance
        bad = (rel < 0) | (rel > bal.n_t)
        pad = rel == bal.n_t
        if ctx.validate:
            if bool(bad.any()) or bool((vals[pad] != 0).any()):
                who = sorted({int(x) for x in torch.nonzero(bad.any(1) | (pad & (vals != 0))
                                                            .any(1)).reshape(-1)})
                raise RuntimeError(f"hvdsparse balanced bucket {self.spec.bucket_id}: "
                                   f"owner(s) {who} sent an index outside their region")
            if not torch.equal(hdr_i[:, 3], torch.arange(P, dtype=torch.int32)):
                raise RuntimeError(f"hvdsparse balanced bucket {self.spec.bucket_id}: the "
                                   f"gathered messages are not in owner order")
            hi_e = MAX_WIRE_EXPONENT if self._vdtype == torch.float16 else 0
            off_range = ((shift < 0) | (shift > hi_e)).reshape(-1)
            if bool(off_range.any()):
                who = torch.nonzero(off_range).reshape(-1).tolist()
                raise RuntimeError(f"hvdsparse balanced bucket {self.spec.bucket_id}: "
                                   f"owner(s) {who} sent value shift(s) "
                                   f"{shift.reshape(-1)[off_range].tolist()}, outside "
                                   f"[0, {hi_e}] for {torch.finfo(self._vdtype).bits}-bit "
                                   f"values")
        else:
            flag_index_error(ctx, bad)
        # one spare slot at N takes padding (and, unvalidated, bad indices)
        buf = ctx.buffer("balanced.sum", self.spec.bucket_id, N + 1, torch.float32,
                         self._device).zero_()
        target = torch.where(bad | pad, torch.full_like(rel, N), rel + bal.lo_t)
        if self._vdtype == torch.float16:
            vals = from_wire_values(vals, shift)
        buf.index_copy_(0, target.reshape(-1), vals.reshape(-1).float())
        flat = buf[:N]
        if c < max(b - a for a, b in zip(self._bounds, self._bounds[1:])):
            # phase 2 may have dropped entries: hand back this rank's own share of them
            self.undelivered = self._undelivered(target.reshape(-1), N)
        # figures + candidate boundaries, from bytes every rank holds identically
        m = hdr_i[:, 2].to(torch.int64)
        cand = candidate_bounds(hist.to(torch.int64), bal.edges, P)
        v = torch.cat([torch.stack([m.sum(), hdr_i[:, 1].to(torch.int64).sum(),
                                    hdr_i[:, 0].to(torch.int64).sum(), m.max()]).double(),
                       hdr_f[:, :2].double().sum(0), cand.double()])
        readout = HostReadout(v)
        bal.record(readout)
        d = DeferredFigures(readout, lambda vv, P=P: _figures(vv, P))
        self.deferred_figures = d
        if v.device.type == "cpu":
            self.figures.update(d.get())
        self._book_finish(t0, booked, t0b, t1)
        self.result = flat
        return flat


def launch(spec: BucketSpec, payloads, ctx: ExchangeContext) -> Pending:
    device = bucket_device(payloads)
    P, N = ctx.world_size, spec.numel
    if N >= 2 ** 31 - 1:
        raise ValueError(f"hvdsparse balanced: bucket {spec.bucket_id} has {N} elements; "
                         f"int32 indices need < 2**31 - 1 (lower fusion_threshold)")
    bal = ctx.pool().state("balanced.bounds", spec.bucket_id,
                           (N, P, str(device)), lambda: Balance(N, P, device))
    bal.before_launch()
    bounds = list(bal.bounds)
    flat = own_dense(spec, payloads, device, ctx=ctx,
                     out=ctx.buffer("balanced.own", spec.bucket_id, N, torch.float32, device))
    vdtype = pair_dtype(payloads)
    vb = torch.finfo(vdtype).bits // 8
    cap = sum(int(s.capacity) for p in payloads for s in p.segments)
    n_max = max(b - a for a, b in zip(bounds, bounds[1:])) if P else 0
    c = cost_model.phase2_capacity(P, N, cap, n_max)
    counts = owner_counts(flat, bal.ends, bal.nonempty, ctx, NAME, spec.bucket_id)
    pend = BalancedPending(spec, NAME, list(payloads), ctx)
    pend._bounds, pend._vdtype, pend._vb, pend._device = bounds, vdtype, vb, device
    pend._own, pend._c, pend._balance = flat, c, bal
    pend._L = message_nbytes(c, vb)
    pend._counts = HostReadout(counts)
    pend.figures.update(bounds=bounds, bounds_version=bal.version, p2_capacity=c)
    if ctx.comm().ordered:
        pend._start_phase1()
    else:
        pend.advance()
    return pend


__all__ = ["NAME", "launch", "Balance", "candidate_bounds", "sub_bin_edges",
           "equal_bounds", "message_nbytes", "HIST_BINS", "REBALANCE_EVERY",
           "IMBALANCE_BOUND"]
