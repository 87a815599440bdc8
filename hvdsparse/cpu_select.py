"""The CPU path of threshold selection: :func:`select_compact` (select ``|h| >= thr``,
compact into fixed-capacity buffers in ascending index order, update the residual),
:func:`select_if_in_range` (TopK's first refinement round by selecting),
:func:`count_abs_ge` (TopK's threshold count) and :func:`binned_select` (AdaComp's
per-bin capped selection).

Same results bit for bit as ``kernels/select.py`` and ``kernels/binned.py``, except the
slot order of ``select_compact`` (ascending here; see docs/design.md); the math is
stated in :mod:`hvdsparse.oracle`. Chunked and threaded as :mod:`hvdsparse.cpu_chunking`
says; ``select_compact`` runs in two phases (count / collect per range, prefix over
ranges, then write) so the output order does not depend on the threads.
"""
from __future__ import annotations

import threading
from typing import Optional, Tuple

import numpy as np
import torch

from . import cpu_chunking
from .cpu_checks import (FLOAT_INPUT_DTYPES, VE_FP32, VE_SIGN1, alloc_select_out, check_1d,
                         check_grad_scale, check_select_args)
from .cpu_quantize import pack_bits
from .payload import to_wire_float
from .philox import par_ranges, par_run


#: elements per chunk of :func:`count_abs_ge` (256 KiB of fp32: the |x| chunk and its
#: mask stay in L2)
_COUNT_CHUNK = 1 << 16


def count_abs_ge(x: torch.Tensor, threshold: torch.Tensor, same_as=None) -> torch.Tensor:
    """``#{i : |x_i| >= t}`` as a fp32 0-d tensor (NaN never counts), ``t`` a 1-element
    fp32 tensor. Same value as ``torch.count_nonzero(torch.abs(x) >= t).float()``, but
    one chunked numpy pass (no full-size |x| or mask, split across threads like the
    residual add).

    ``same_as = (t_prev, c_prev)``: when ``t == t_prev`` (both read on the host: CPU
    tensors) the count is ``c_prev`` and no pass is made -- the count of an unchanged
    threshold cannot change."""
    check_1d("x", x, (torch.float32,))
    t32 = np.float32(threshold.detach().reshape(-1).numpy()[0])
    if same_as is not None:
        tp, cp = same_as
        if np.float32(tp.detach().reshape(-1).numpy()[0]) == t32:
            return cp
    xn = x.detach().numpy()
    n = xn.shape[0]
    counts = []
    lock = threading.Lock()

    def work(s0, e0):
        tn, mn = cpu_chunking.chunk_scratch(min(_COUNT_CHUNK, e0 - s0))
        c = 0
        for st in range(s0, e0, _COUNT_CHUNK):
            e = min(st + _COUNT_CHUNK, e0)
            m = e - st
            a = np.abs(xn[st:e], out=tn[:m])
            c += int(np.count_nonzero(np.greater_equal(a, t32, out=mn[:m])))
        with lock:
            counts.append(c)

    if n:
        par_run(work, par_ranges(n, _COUNT_CHUNK, max(_COUNT_CHUNK, cpu_chunking.CHUNK_PAR_MIN)))
    # exact: a count < 2**24 is an fp32 integer, larger ones round once (as .float())
    return torch.tensor(float(sum(counts)), dtype=torch.float32)


def binned_select(acc: torch.Tensor, grad: torch.Tensor, h_scale: float,
                  threshold: torch.Tensor, bin_size: int, c: int,
                  grad_scale: Optional[torch.Tensor] = None):
    """Per bin ``b`` of ``bin_size`` consecutive elements (last one partial), the up to
    ``c`` largest ``|h_i|`` with ``|h_i| >= threshold[b]``, where
    ``h = acc + (h_scale - 1) * d`` and ``d = fp32(grad) * grad_scale`` with non-finite
    ``d`` taken as 0 (each product and sum its own fp32 rounding, as the torch ops
    ``acc + (h_scale - 1) * where(isfinite(d), d, 0)`` round). Ties in ``|h|`` inside
    a bin that holds more than ``c`` passing elements go to the lower index.

    Returns ``(gidx int64[nb*c], rel int64[nb*c], vmask bool[nb*c], count int32[1],
    bin_counts int32[nb], selected int32[1])``: the sent slots first, by bin, largest
    ``|h|`` first within a bin (the layout of ``compressors.base.binned_topc``);
    padding slots hold index 0; ``selected`` counts every passing element (before the
    per-bin cap). One chunked numpy pass (no full-size temporary) plus a sort of the
    passing elements only."""
    check_1d("acc", acc, (torch.float32,))
    check_1d("grad", grad, FLOAT_INPUT_DTYPES)
    n = acc.numel()
    L = int(bin_size)
    nb = -(-n // L)
    thr = threshold.detach().reshape(-1)
    if thr.numel() != nb or grad.numel() != n:
        raise ValueError(f"binned_select: threshold has {thr.numel()} bins and grad "
                         f"{grad.numel()} elements, expected {nb} and {n}")
    an = acc.detach().numpy()
    gt = grad.detach()
    if gt.dtype == torch.bfloat16:            # numpy has no bf16: widen once (exact)
        gt = gt.to(torch.float32)
    gn = gt.numpy()
    thr_n = thr.to(torch.float32).numpy()
    s32 = (np.float32(grad_scale.detach().reshape(-1).numpy()[0])
           if grad_scale is not None else None)
    hm1 = np.float32(float(h_scale) - 1.0)
    ch = max(1, cpu_chunking.CHUNK // L) * L
    tn, mn = cpu_chunking.chunk_scratch(min(ch, n) if n else 1)
    cand_i, cand_v = [], []

    def h_abs(st: int, e: int, zero_nonfinite: bool) -> np.ndarray:
        """|h| of elements [st, e) into the chunk scratch; non-finite d as 0 if asked."""
        d = tn[:e - st]
        if s32 is not None:
            np.multiply(gn[st:e], s32, out=d, dtype=np.float32)
        else:
            d[:] = gn[st:e]                   # fp16 -> fp32 is exact
        if zero_nonfinite:
            fin = np.isfinite(d, out=mn[:e - st])
            np.copyto(d, np.float32(0.0), where=~fin)
        np.multiply(d, hm1, out=d)
        np.add(an[st:e], d, out=d)
        return np.abs(d, out=d)

    for st in range(0, n, ch):
        e = min(st + ch, n)
        m = e - st
        # the common case in one reduction, after the fact: a NaN / Inf in d makes its
        # |h| NaN or Inf (hm1 * Inf is Inf, or NaN for hm1 = 0; NaN stays NaN), which
        # the max (NaN-propagating, ~3x cheaper than a sum here) shows; then the chunk
        # is redone with the element-wise rule. A finite d whose h overflows is redone
        # too and gives the same bits (nothing to zero)
        with np.errstate(invalid="ignore", over="ignore"):
            d = h_abs(st, e, False)
            top = np.maximum.reduce(d)
        if not np.isfinite(top):
            d = h_abs(st, e, True)
        mk = mn[:m]
        b0 = st // L
        nfull = m // L
        if nfull:
            np.greater_equal(d[: nfull * L].reshape(nfull, L), thr_n[b0:b0 + nfull, None],
                             out=mk[: nfull * L].reshape(nfull, L))
        if nfull * L < m:
            np.greater_equal(d[nfull * L:], thr_n[b0 + nfull], out=mk[nfull * L:])
        idx = np.flatnonzero(mk)
        if idx.shape[0]:
            cand_v.append(d[idx])
            cand_i.append(idx + st)
    cap = nb * c
    gidx = np.zeros(cap, np.int64)
    rel = np.zeros(cap, np.int64)
    bin_counts = np.zeros(nb, np.int32)
    selected = count = 0
    if cand_i:
        ci = np.concatenate(cand_i)
        cv = np.concatenate(cand_v)
        selected = ci.shape[0]
        cb = ci // L
        # by bin, then |h| descending, then index ascending: one stable sort of the key
        # bin * 2^32 + ~bits(|h|) (|h| >= 0 is never NaN here, and the bits of a
        # non-negative fp32 grow with its value, so ~bits falls as |h| grows); the
        # candidates come in ascending index order, which the stable sort keeps among
        # equal keys (the order of np.lexsort((ci, -cv, cb)), ~10x faster)
        key = (cb.astype(np.uint64) << np.uint64(32)) | \
            np.invert(cv.view(np.uint32)).astype(np.uint64)
        order = np.argsort(key, kind="stable")
        ci, cb = ci[order], cb[order]
        # slot of each candidate within its bin: its position minus where the bin starts
        per_bin = np.bincount(cb, minlength=nb)
        first = (np.cumsum(per_bin) - per_bin)[cb]
        keep = (np.arange(ci.shape[0]) - first) < c
        ci, cb = ci[keep], cb[keep]
        count = ci.shape[0]
        gidx[:count] = ci
        rel[:count] = ci - cb * L
        bin_counts = np.bincount(cb, minlength=nb).astype(np.int32)
    vmask = np.zeros(cap, np.bool_)
    vmask[:count] = True
    return (torch.from_numpy(gidx), torch.from_numpy(rel), torch.from_numpy(vmask),
            torch.tensor([count], dtype=torch.int32), torch.from_numpy(bin_counts),
            torch.tensor([selected], dtype=torch.int32))


def bin_quota(cnt: torch.Tensor, budget: int, rot: int, c: int) -> torch.Tensor:
    """AdaComp's layer budget (:func:`hvdsparse.oracle.bin_quota`'s deal, in closed form;
    ``kernels/bin_quota.py`` computes the same on the Triton path): ``cnt`` int32 [nb]
    with ``0 <= cnt[b] <= c``; returns the quota int32 [nb]::

        S(r) = sum_b min(cnt[b], r) (r = 0..c),   r* = max {r : S(r) <= budget},
        q[b] = min(cnt[b], r*) + [cnt[b] > r* and rank(b) < budget - S(r*)]

    ``rank(b)`` the number of bins with ``cnt > r*`` before ``b`` counting cyclically
    from ``rot``. Device ops on ``cnt``'s device, no host synchronisation."""
    k = cnt.to(torch.int64)
    nb = k.numel()
    if nb == 0 or int(budget) >= nb * int(c):
        return cnt.clone()
    lv = torch.arange(int(c) + 1, device=k.device)
    s = torch.minimum(k.unsqueeze(1), lv).sum(0)                # S(r), non-decreasing
    rs = (s <= int(budget)).sum() - 1                          # S(0) = 0 always fits
    left = int(budget) - s[rs]
    more = k > rs
    m = more.to(torch.int64)
    ex = torch.cumsum(m, 0) - m
    want = m.sum()
    rank = torch.remainder(ex - ex[int(rot)] + want, want.clamp_min(1))
    return (torch.minimum(k, rs) + (more & (rank < left)).to(torch.int64)).to(torch.int32)


def _select_compact_chunks(acc, thr, capacity, L, ch, grad, use_h, hm1, ve, sscale,
                           indices, values) -> Tuple[int, int]:
    """In torch, chunk by chunk (devices other than the CPU, and
    ``cpu_chunking.USE_NUMPY`` off). Returns (sent, selected)."""
    n = acc.numel()
    tmp = torch.empty(ch, dtype=torch.float32, device=acc.device)
    sent = selected = 0
    signs = [] if ve == VE_SIGN1 else None
    for s in range(0, n, ch):
        e = min(s + ch, n)
        m = e - s
        a = acc[s:e]
        c = tmp[:m]
        if use_h:
            c.copy_(grad[s:e]).mul_(hm1).add_(a).abs_()
        else:
            torch.abs(a, out=c)
        # chunks start on bin boundaries (ch is a multiple of L)
        tt = thr[s // L: -(-e // L)].repeat_interleave(L)[:m] if L else thr
        idx = torch.nonzero(c >= tt).view(-1)
        k = idx.numel()
        selected += k
        room = capacity - sent
        if room <= 0 or k == 0:
            continue
        if k > room:
            idx = idx[:room]
            k = room
        indices[sent:sent + k] = (idx + s).to(torch.int32)
        v = a[idx]
        if ve == VE_FP32:
            values[sent:sent + k] = v
            a.index_fill_(0, idx, 0.0)
        elif ve == VE_SIGN1:
            neg = v < 0
            signs.append(neg)
            a.index_copy_(0, idx, v - torch.where(neg, -sscale, sscale))
        else:
            vc = to_wire_float(v, ve)          # saturated (payload.FLOAT_MAX)
            values[sent:sent + k] = vc
            a.index_copy_(0, idx, v - vc.float())
        sent += k
    if ve == VE_SIGN1 and sent:
        values[: -(-sent // 8)] = pack_bits(torch.cat(signs).to(torch.uint8), 1)
    return sent, selected


def _select_compact_np(acc, thr, capacity, L, ch, grad, use_h, hm1, ve, sscale,
                       indices, values) -> Tuple[int, int]:
    """On the CPU: numpy passes over chunks, contiguous ranges of whole chunks split
    across up to torch.get_num_threads() threads, in two phases that keep the ascending
    order. Phase 1: each range computes its chunks' masks and keeps its selected
    positions (at most ``capacity`` of them: a range cannot send more) and its count.
    An exclusive prefix over the ranges' counts gives each range its output offset and
    how many it may send (the first ``capacity`` selected overall, ascending). Phase 2:
    each range writes its indices / values and updates the residual of what it sends.
    Returns (sent, selected)."""
    n = acc.numel()
    an_all = acc.detach().numpy()
    # numpy has no bf16: a bf16 grad is cast in torch, which stays on one thread (torch
    # ops in several Python threads would each open an intra-op parallel region)
    gn_all = grad.detach().numpy() if use_h and grad.dtype != torch.bfloat16 else None
    thr_n = thr.detach().numpy() if L else np.float32(float(thr))
    hm1_32 = np.float32(hm1)
    if use_h and gn_all is None:
        ranges = [(0, n)]
    else:
        ranges = par_ranges(n, ch, max(ch, cpu_chunking.CHUNK_PAR_MIN))
    found = [None] * len(ranges)      # per range: (count, [(chunk start, local idx), ...])

    def phase1(i, s0, e0):
        tn, mn = cpu_chunking.chunk_scratch(min(ch, e0 - s0))
        cnt = 0
        keep = []
        for s in range(s0, e0, ch):
            e = min(s + ch, e0)
            m = e - s
            an = an_all[s:e]
            c = tn[:m]
            if use_h:
                if gn_all is not None:
                    np.multiply(gn_all[s:e], hm1_32, out=c)
                else:
                    torch.from_numpy(c).copy_(grad[s:e]).mul_(hm1)
                np.add(c, an, out=c)
                np.abs(c, out=c)
            else:
                np.abs(an, out=c)
            mk = mn[:m]
            if L:
                b0 = s // L
                nfull = m // L
                if nfull:
                    np.greater_equal(c[: nfull * L].reshape(nfull, L),
                                     thr_n[b0:b0 + nfull, None],
                                     out=mk[: nfull * L].reshape(nfull, L))
                if nfull * L < m:
                    np.greater_equal(c[nfull * L:], thr_n[b0 + nfull], out=mk[nfull * L:])
            else:
                np.greater_equal(c, thr_n, out=mk)
            idx = np.flatnonzero(mk)
            k = idx.shape[0]
            room = capacity - cnt
            if room > 0 and k:
                keep.append((s, idx[:room] if k > room else idx))
            cnt += k
        found[i] = (cnt, keep)

    par_run(phase1, [(i, s0, e0) for i, (s0, e0) in enumerate(ranges)])
    # exclusive prefix: output offset and number sent of each range
    plan = []
    total = 0
    for cnt, keep in found:
        off = min(total, capacity)
        plan.append((off, min(cnt, capacity - off), keep))
        total += cnt
    selected = total
    sent = min(total, capacity)
    ind_n = indices.numpy()
    val_n = values.detach().numpy() if ve == VE_FP32 else None
    signs = [None] * len(ranges)
    sc = np.float32(float(sscale)) if ve == VE_SIGN1 else None

    def phase2(i):
        off, quota, keep = plan[i]
        negs = []
        for s, idx in keep:
            if quota <= 0:
                break
            k = idx.shape[0]
            if k > quota:
                idx = idx[:quota]
                k = quota
            np.add(idx, s, out=ind_n[off:off + k], casting="unsafe")  # int64 -> int32
            an = an_all[s:]
            if ve == VE_FP32:
                np.take(an, idx, out=val_n[off:off + k])
                an[idx] = 0.0
            elif ve == VE_SIGN1:
                v = an[idx]
                neg = v < 0
                negs.append(neg)
                an[idx] = v - np.where(neg, -sc, sc)
            else:
                v = torch.from_numpy(an[idx])
                vc = to_wire_float(v, ve)          # saturated (payload.FLOAT_MAX)
                values[off:off + k] = vc
                an[idx] = (v - vc.float()).numpy()
            off += k
            quota -= k
        signs[i] = negs

    par_run(phase2, [(i,) for i in range(len(ranges)) if plan[i][1] > 0])
    if ve == VE_SIGN1 and sent:
        bits = np.concatenate([x for negs in signs if negs for x in negs])
        values[: -(-sent // 8)] = pack_bits(torch.from_numpy(bits).to(torch.uint8), 1)
    return sent, selected


def select_if_in_range(acc: torch.Tensor, threshold: torch.Tensor, k: int, capacity: int
                       ) -> Tuple[Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                                  Optional[torch.Tensor]]:
    """TopK's first refinement round on the CPU, counting by selecting: fp32
    :func:`select_compact` of ``|acc| >= threshold`` (0-d fp32); its ``selected`` is
    exactly the count a counting pass would give. If ``k <= selected <= capacity`` the
    estimate will be kept, so the select is kept too: returns ``((indices, values,
    count), selected)``. Otherwise the select is undone (``acc[idx] = values``: exact
    for fp32, the select wrote 0 there) and ``(None, selected)`` is returned. A
    threshold below the smallest normal fp32 (which the select would clamp) makes no
    pass: ``(None, None)``. ``selected`` is a 0-d fp32 tensor. Saves one pass over the
    layer whenever the first estimate is in range."""
    t = float(threshold)
    if not t >= float(torch.finfo(torch.float32).tiny):
        return None, None
    idx, vals, cnt = select_compact(acc, threshold, capacity)
    sent, selected = int(cnt[0]), int(cnt[1])
    c = torch.tensor(float(selected), dtype=torch.float32)
    if k <= selected <= capacity:
        return (idx, vals, cnt), c
    acc.index_copy_(0, idx[:sent].to(torch.long), vals[:sent])
    return None, c


def select_compact(acc: torch.Tensor, threshold, capacity: int, *, bin_size: int = 0,
                   grad: Optional[torch.Tensor] = None, h_scale: float = 1.0,
                   value_encoding=VE_FP32, sign_scale=None, out=None,
                   grad_scale: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Select ``|h[i]| >= thr(i)`` with ``h = acc + (h_scale - 1) * g``,
    ``g = fp32(grad) * grad_scale`` (``h = acc`` if grad is None or h_scale == 1; no
    grad_scale multiply when it is None), every product and sum its own fp32 rounding
    (never an FMA; the kernels are compiled without contraction, so bits agree);
    ``thr(i) = threshold`` (0-d) or ``threshold[i // bin_size]`` (fp32[nbins]). NaN is
    never selected.

    Returns ``(indices int32[capacity], values, count int32[2] = [sent, selected])``;
    values is [capacity] of fp32/fp16/bf16 (``acc`` cast) or, for SIGN1, uint8
    [ceil(capacity / 8)] sign bits (bit j%8 of byte j//8, 1 = negative, acc == 0 counts
    as positive). The first ``capacity`` selected elements in ascending index order are
    sent; slots >= sent are padding. ``acc`` becomes the new residual in place: for sent
    elements ``acc - dequant(value)`` (0 for fp32, the cast error for fp16/bf16,
    ``acc - (+-sign_scale)`` for SIGN1); every other element is unchanged.
    ``out`` = optional preallocated ``(indices, values, count)``.
    """
    n, thr, capacity, L, ve, sscale = check_select_args(
        acc, threshold, capacity, bin_size, grad, value_encoding, sign_scale)
    check_grad_scale(grad_scale, acc.device)
    indices, values, count = alloc_select_out(out, capacity, ve, acc.device)
    hm1 = float(h_scale) - 1.0
    use_h = grad is not None and hm1 != 0.0
    if use_h and grad_scale is not None:
        grad = grad.to(torch.float32) * grad_scale.reshape(()).to(torch.float32)
    sent = 0
    selected = 0
    if n:
        if L:
            ch = max(1, cpu_chunking.CHUNK // L) * L
        else:
            ch = cpu_chunking.CHUNK
        ch = min(ch, n)
        if acc.device.type == "cpu" and cpu_chunking.USE_NUMPY:
            sent, selected = _select_compact_np(acc, thr, capacity, L, ch, grad, use_h, hm1,
                                                ve, sscale, indices, values)
        else:
            sent, selected = _select_compact_chunks(acc, thr, capacity, L, ch, grad, use_h,
                                                    hm1, ve, sscale, indices, values)
    count[0] = sent
    count[1] = selected
    return indices, values, count
