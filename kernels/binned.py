"""AdaComp's per-bin selection and packing (``pack()`` of the AdaComp seed) in two
launches, bit for bit the CPU path's ``hvdsparse.cpu.binned_select`` + the compressor's
sign / residue update.

Per bin ``b`` of ``L`` consecutive elements (last one partial), with ``G`` the layer's
accumulated gradient (residual already added), ``d = fp32(grad) * grad_scale`` (0 where
not finite) and ``h = G + d * (scale - 1)`` (two fp32 roundings; compiled with
``enable_fp_fusion=False``):

* pass: ``|h_i| >= thr[b]``; ``selected += #pass``; ``cnt_b = min(#pass, C)``;
* sent: the ``cnt_b`` passing elements with the largest ``|h|``, ties to the lower
  index, in that order (largest first);
* wire layout: slots of all bins packed in bin order, bin ``b`` starting at the
  exclusive prefix sum of ``cnt``; slot ``j`` holds the bin-relative index and one sign
  bit (1 = ``G < 0``, bit ``j % 32`` of int32 word ``j // 32``, i.e. bit ``j % 8`` of
  byte ``j // 8`` little-endian); unused slots stay 0;
* residue: ``G_i <- G_i + (-q_i)`` with ``q_i = -s`` if ``G_i < 0`` else ``s`` for every
  sent element (``s`` the layer scale, a device scalar).

With a layer budget below ``nb * C`` (AdaComp's ``mean_per_bin``), ``cnt`` becomes
each bin's quota (``kernels/bin_quota.py``, one launch after launch 1) and the message
holds the budget's slots.

Launch 1 (``_binned_count_kernel``) writes ``cnt`` and adds to ``selected``; one
``torch.cumsum`` gives the bin offsets and the total count; launch 2
(``_binned_pack_kernel``) recomputes ``|h|`` (same code, same bits), picks ``C`` times
the largest remaining passing element of every bin of its tile (a max and a min-index
reduction per pick) and writes slots, sign bits and the residue. Program ``p`` owns the
``ROWS`` bins ``[p*ROWS, (p+1)*ROWS)`` as a ``[ROWS, next_pow2(L)]`` tile (int64
offsets); bins of more than ``MAX_BIN`` elements are not handled here (the caller keeps
the torch path for them). Atomics: one relaxed add per program into ``selected``, one
relaxed OR per negative sent slot into its sign word. No host synchronisation.
"""
import torch
import triton
import triton.language as tl

from . import bin_quota

MAX_BIN = 4096


@triton.jit
def _abs_h(acc_ptr, grad_ptr, gscale_ptr, offs, mask, hm1, HAS_GSCALE: tl.constexpr):
    a = tl.load(acc_ptr + offs, mask=mask, other=0.0)
    d = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_GSCALE:
        d = d * tl.load(gscale_ptr)
    d = tl.where(tl.abs(d) < float("inf"), d, 0.0)
    return tl.abs(a + d * hm1)


@triton.jit
def _tile(pid, nb, L, n, ROWS: tl.constexpr, LP: tl.constexpr):
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < nb
    cols = tl.arange(0, LP)
    offs = rows[:, None] * L + cols[None, :]
    mask = row_ok[:, None] & (cols[None, :] < L) & (offs < n)
    return rows, row_ok, cols, offs, mask


@triton.jit
def _binned_count_kernel(acc_ptr, grad_ptr, gscale_ptr, thr_ptr, cnt_ptr, sel_ptr, n, nb,
                         L, hm1, C, HAS_GSCALE: tl.constexpr, ROWS: tl.constexpr,
                         LP: tl.constexpr):
    rows, row_ok, cols, offs, mask = _tile(tl.program_id(0), nb, L, n, ROWS, LP)
    a = _abs_h(acc_ptr, grad_ptr, gscale_ptr, offs, mask, hm1, HAS_GSCALE)
    thr = tl.load(thr_ptr + rows, mask=row_ok, other=float("inf"))
    ps = (a >= thr[:, None]) & mask
    npass = tl.sum(ps.to(tl.int32), axis=1)
    tl.store(cnt_ptr + rows, tl.minimum(npass, C), mask=row_ok)
    tot = tl.sum(npass, axis=0)
    tl.atomic_add(sel_ptr, tot, mask=tot > 0, sem="relaxed")


@triton.jit
def pick_one(j, a, avail, cols, rows, row_ok, cnt, start, s, L, acc_ptr, rel_ptr, rel0,
             words_ptr, word0, ROWS: tl.constexpr, LP: tl.constexpr):
    """Pick ``j`` of every bin in ``rows`` (``[ROWS, LP]`` tile, bin ``b``'s elements at
    ``acc[b * L + col]``): the largest still available ``a`` (ties: the lower column)
    where ``j < cnt[b]``; writes its bin-relative index to ``rel[rel0 + start[b] + j]``,
    its sign bit into ``words`` (from word ``word0``) and ``acc[e] += -(+-s)``. Returns ``avail`` without it."""
    v = tl.where(avail, a, -1.0)               # passing |h| >= TINY > 0
    vmax = tl.max(v, axis=1)
    cand = (v == vmax[:, None]) & avail
    imin = tl.min(tl.where(cand, cols[None, :], LP), axis=1)   # ties: lower index
    has = row_ok & (imin < LP) & (j < cnt)
    avail = avail & (cols[None, :] != imin[:, None])
    e = rows * L + imin
    g = tl.load(acc_ptr + e, mask=has, other=0.0)
    neg = g < 0
    q = tl.where(neg, -s, s)
    tl.store(acc_ptr + e, g + (-q), mask=has)
    slot = (start + j).to(tl.int64)
    tl.store(rel_ptr + rel0 + slot, imin.to(rel_ptr.dtype.element_ty), mask=has)
    bit = tl.full([ROWS], 1, tl.int32) << (slot & 31).to(tl.int32)
    tl.atomic_or(words_ptr + word0 + (slot >> 5), bit, mask=has & neg, sem="relaxed")
    return avail


@triton.jit
def _binned_pack_kernel(acc_ptr, grad_ptr, gscale_ptr, thr_ptr, cnt_ptr, cum_ptr, s_ptr,
                        rel_ptr, words_ptr, n, nb, L, hm1, HAS_GSCALE: tl.constexpr,
                        C: tl.constexpr, ROWS: tl.constexpr, LP: tl.constexpr):
    rows, row_ok, cols, offs, mask = _tile(tl.program_id(0), nb, L, n, ROWS, LP)
    a = _abs_h(acc_ptr, grad_ptr, gscale_ptr, offs, mask, hm1, HAS_GSCALE)
    thr = tl.load(thr_ptr + rows, mask=row_ok, other=float("inf"))
    avail = (a >= thr[:, None]) & mask
    cnt = tl.load(cnt_ptr + rows, mask=row_ok, other=0)
    start = tl.load(cum_ptr + rows, mask=row_ok, other=0) - cnt     # exclusive prefix
    s = tl.load(s_ptr)
    for j in tl.static_range(C):
        avail = pick_one(j, a, avail, cols, rows, row_ok, cnt, start, s, L, acc_ptr, rel_ptr,
                         0, words_ptr, 0, ROWS, LP)


def binned_pack(acc, grad, h_scale, threshold, bin_size, c, scale, *, grad_scale=None,
                budget=None, rot=0, block=4096, num_warps=8):
    """Triton version of AdaComp's selection + packing (see the module docstring;
    arguments validated by ``hvdsparse.ops.binned_pack``). ``acc`` (fp32, the
    accumulated gradient G) is updated in place to the residue. Returns ``(rel,
    sign_bytes, count int32[1], bin_counts int32[nb], selected int32[1])`` with ``rel``
    uint8 (``L <= 256``) or int16 holding uint16 bits, ``nb * c`` slots, or ``budget``
    slots with the per-bin counts cut to their quota (``kernels/bin_quota.py``, one
    launch between the two) when a budget below ``nb * c`` is given."""
    n = acc.numel()
    L = int(bin_size)
    nb = -(-n // L)
    cap = nb * c if budget is None else min(nb * c, int(budget))
    dev = acc.device
    rel = torch.zeros(cap, dtype=torch.uint8 if L <= 256 else torch.int16, device=dev)
    words = torch.zeros(max(1, -(-cap // 32)), dtype=torch.int32, device=dev)
    cnt = torch.empty(nb, dtype=torch.int32, device=dev)
    selected = torch.zeros(1, dtype=torch.int32, device=dev)
    LP = triton.next_power_of_2(L)
    rows = max(1, min(triton.next_power_of_2(nb), block // LP))
    grid = (triton.cdiv(nb, rows),)
    hm1 = float(h_scale) - 1.0
    has_gs = grad_scale is not None
    gs = grad_scale.reshape(1) if has_gs else acc
    thr = threshold.reshape(-1)
    _binned_count_kernel[grid](acc, grad, gs, thr, cnt, selected, n, nb, L, hm1, int(c),
                               HAS_GSCALE=has_gs, ROWS=rows, LP=LP, num_warps=num_warps,
                               enable_fp_fusion=False)
    if cap < nb * c:
        bin_quota.quota(cnt, cap, rot, c)
    cum = torch.cumsum(cnt, 0, dtype=torch.int32)
    _binned_pack_kernel[grid](acc, grad, gs, thr, cnt, cum, scale.reshape(1), rel, words,
                              n, nb, L, hm1, HAS_GSCALE=has_gs, C=int(c), ROWS=rows,
                              LP=LP, num_warps=num_warps, enable_fp_fusion=False)
    return rel, words.view(torch.uint8)[:-(-cap // 8)], cum[-1:], cnt, selected
