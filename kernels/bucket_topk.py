"""TopK over a whole bucket: every layer of a fusion bucket compressed in a fixed number
of launches (launches per step proportional to buckets, not to layers x operations).

The per-layer path (``kernels/clean.py``, ``residual.py``, ``refine.py``,
``select.py``, ``masking.py`` plus ~12 torch ops) issues ~25 launches per layer. Here the
layers of a bucket are *segments* described by one int64 table ``tab[L, W]`` (one
host-to-device copy per bucket and step) whose rows hold each segment's tensor
addresses (gradient, residual, velocity, parameter, non-finite counter: the tensors stay
where they are, so residuals, checkpoints and rollbacks are unchanged) and its host
integers (size, capacity, the threshold estimate's sample layout); fp32 scalars travel
as their bit patterns. A cached int32 ``blk[nblocks]`` maps each program of the
streaming kernels to its segment; the segment's first program is ``tab[j, BLK0]``.

Per bucket and step (``hvdsparse/compressors/topk_bucket.py`` drives them)::

    accumulate  1 launch   per element of segment j (bit for bit the per-layer path):
                           d = fp32(grad) * s                     (s: AMP scale, or none)
                           fin = |d| < inf;  nonfinite_j += #not fin
                           momentum segments (DGC momentum correction):
                             g = fin ? d : +0;  g = g + fp32(wd) * fp32(param)  (if wd)
                             u = u * m;  u = u + c * g            (c = fp32(1 - dampening))
                             x = nesterov ? g + m * u : u
                             fin2 = |x| < inf;  nonfinite_j += #not fin2
                             r = fin2 ? r + x : r
                           plain segments: r = fin ? r + d : r
    sample      1 launch   S[j, i] = |r_j[off_j + stride_j * i]| for i < s_j, -1 after;
                           zeroes the round counts and the payload counts (a group
                           without a sampled row: none; the accumulate zeroes the
                           payload counts)
    topk        torch.topk(S, M, dim=1, sorted=True)  (M = max_j m_j; the -1 padding
                           sorts last and is never read: every rank used is <= s_j);
                           with the counting rounds, skipped when no row is sampled
    count x R   1 launch per refinement round: counts[j, round] += #{|r_j| >= t_j}
    ladder      (Threshold's guard rows; zeroed lad[L, J] + 1 launch) lad[j, q] +=
                           #{|r_j| >= t_j * gam[q]}, t_j = max(tau_j * f_j, TINY) (f_j
                           at C_TGT); the select
                           then uses t_j * gam[r], r = min(#{q : lad[j, q] > cap_j}, J-1)
    select      1 launch   t_j = max(replay of all rounds, TINY) stored in tau[j]; select
                           |r_j| >= t_j into slots out_j + [0, cap_j) (indices local to the
                           layer), residual zeroed where sent (fp32) or left with the cast
                           error (fp16 / bf16); count[j] = [sent, selected]
    radix       (ROUTE_FRESH rows: Threshold's refresh steps, TopK's score rows; 4
                           launches, before the sample; the accumulate zeroed their
                           scratch) the exact k-th largest |r_j|: 8-bit digits of the
                           fp32 bit patterns, most significant first, a histogram per
                           pass (each program walks the earlier passes' histograms for
                           their digits); the select reads the last digit and writes
                           tau_j = max(that value, TINY) to C_TIN
    clamp       1 launch   (MODE_TIES rows: count[j, 1] += the ties sent first)
                           count[j, 0] = min(count[j, 1], cap_j); MODE_GUARD rows
                           (Threshold's overflow guard) set count[j, 1] = lad[j, 0] (the
                           count at tau) and write the next step's
                           threshold to C_TOUT: ratio = fp32(selected) / fp32(cap_j),
                           tau' = ratio > 1 ? tau * min(sqrt(ratio), 2) : tau (div_rn,
                           sqrt_rn: threshold.py's torch expression, bit for bit)
    mask        1 launch   (after the exchange) u_j[idx] = 0 for the sent slots

MODE_SCORE rows (``fresh_weight = w``: TopK's, ROUTE_FRESH; Threshold's, ROUTE_GIVEN or
ROUTE_FRESH): the radix select, the ladder and the select rank the score ``|r_j + w
x_j|`` instead of ``|r_j|`` (``x_j``: the row's fp32 input at ``C_G``, non-finite
elements 0; ``w`` in ``C_W``; ``w * x`` rounded, then the sum) and send ``r_j``'s
values. MODE_TIES rows (TopK's, with MODE_SCORE, capacity k) send the exact k largest
scores, i.e. every score above the k-th and, of those equal to it, as many as k leaves
(counted by their own counter: the first reserved, in ascending index order through the
interpreter as the per-layer path's ties to the lower index, in the launch's block order
on a GPU); a k-th score below TINY sends every score >= TINY. Threshold's rows send
every score at or above their threshold, up to the capacity, as unscored rows do.

Each segment's threshold follows ``kernels/refine.py``'s rule (the same ``replay_rounds``):
``v`` is row ``j`` of the sorted sample, ``r0``, ``m``, ``k``, ``capacity`` its own.
Rows on ``ROUTE_GIVEN`` (``Threshold``, DCT-DP, between its refreshes) read their
threshold from the fp32 tensor at ``C_TIN`` instead, times the fp32 factor at
``C_TGT`` (one rounding): one sampled element, no counting rounds, the same select.
Small layers take the exact route of ``estimate_topk_threshold`` (the sample is the whole
layer, ``r0 = k``, no refinement: ``t`` = the k-th largest ``|r|``); their
programs skip the counting passes. Every product and sum is its own fp32 rounding
(``enable_fp_fusion=False``; ``div_rn`` in the replay), so a segment's payload,
residual, velocity and count equal the per-layer path's bit for bit (slot order aside:
see ``kernels/select.py``; tests/test_bucket_topk.py compares them).

Loads through table addresses carry no alignment the compiler can prove, so these
kernels use 32-bit (coalesced) loads where the per-layer kernels get 128-bit ones; the
saving is in launches, not in bandwidth. Offsets are int64. Atomics are relaxed (slot
reservations and counters only; consumers read after the launch). The accumulate and
select kernels run 16 warps: at 8, a 4096-element block needs 210 / 150 registers per
thread on sm_80 (one 8-warp block per SM); at 16, 102 / 80 (offline ``ptxas -v``, no
spills; tests/test_compile_offline.py).
"""
import torch
import triton
import triton.language as tl

from .refine import replay_rounds
from .select import reserve_slots, store_float_values
from .table import f32, fptr, gptr, program_row

# columns of the segment table (int64); fp32 values are stored as their bits
C_G, C_R, C_U, C_P, C_N, C_MODE, C_M, C_C, C_WD, C_NF = range(10)
C_RK, C_RCAP, C_CAP, C_STRIDE, C_OFF, C_S, C_R0, C_MLEN, C_OUT, C_BLK0 = range(10, 20)
C_EXACT, C_TGT, C_TIN, C_TOUT, C_W = 20, 21, 22, 23, 24
#: C_TGT: a sampled row's target count; a ROUTE_GIVEN row's fp32 factor f, its reused
#: tau used at max(fp32(tau * f), TINY) (Threshold's ``tau_follows_rate``; 1.0 otherwise)
W = 25
MODE_MOMENTUM, MODE_NESTEROV, MODE_WD, MODE_GUARD, MODE_SCORE, MODE_TIES = 1, 2, 4, 8, 16, 32
#: threshold routes (column C_EXACT): sampled + refined, the exact k-th largest of a
#: small layer, given (Threshold / DCT: the reused tau read from C_TIN), or fresh
#: (Threshold's refresh step: the exact k-th largest |r|, k in C_RK, found by the radix
#: select and written to C_TIN before the select reads it there)
ROUTE_SAMPLED, ROUTE_EXACT, ROUTE_GIVEN, ROUTE_FRESH = 0, 1, 2, 3
#: grad / param dtypes the accumulate kernel reads (``GDT``)
GDT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
VE_FP32, VE_FP16, VE_BF16 = 0, 1, 2
_VE_DTYPE = {VE_FP32: torch.float32, VE_FP16: torch.float16, VE_BF16: torch.bfloat16}
_TINY = float(torch.finfo(torch.float32).tiny)
#: int32 cells of a row's radix scratch: four 256-bin histograms, the NaN count, the
#: MODE_SCORE rows' tie counter and the number of ties they send
RS = tl.constexpr(4 * 256 + 3)



# the same columns as constexpr globals (what a jit function may read)
_G = tl.constexpr(C_G)
_R = tl.constexpr(C_R)
_U = tl.constexpr(C_U)
_P = tl.constexpr(C_P)
_N = tl.constexpr(C_N)
_MODE = tl.constexpr(C_MODE)
_M = tl.constexpr(C_M)
_C = tl.constexpr(C_C)
_WD = tl.constexpr(C_WD)
_NF = tl.constexpr(C_NF)
_RK = tl.constexpr(C_RK)
_RCAP = tl.constexpr(C_RCAP)
_CAP = tl.constexpr(C_CAP)
_STRIDE = tl.constexpr(C_STRIDE)
_OFF = tl.constexpr(C_OFF)
_S = tl.constexpr(C_S)
_R0 = tl.constexpr(C_R0)
_MLEN = tl.constexpr(C_MLEN)
_OUT = tl.constexpr(C_OUT)
_BLK0 = tl.constexpr(C_BLK0)
_EXACT = tl.constexpr(C_EXACT)
_TGT = tl.constexpr(C_TGT)
_TIN = tl.constexpr(C_TIN)
_TOUT = tl.constexpr(C_TOUT)
_W = tl.constexpr(C_W)


@triton.jit
def _where_am_i(tab_ptr, blk_ptr, W: tl.constexpr, BLOCK: tl.constexpr):
    """(segment row, segment row pointer, element offsets, in-segment mask, local block
    index) of this program."""
    j, row, n, lb = program_row(tab_ptr, blk_ptr, W, _N, _BLK0)
    offs = lb * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    return j, row, offs, offs < n, lb


@triton.jit
def _ranked(row, a, offs, mask):
    """What a row ranks: ``a`` (= r), or with MODE_SCORE (``fresh_weight``) the
    score ``a + w * x``, ``x`` = the row's fp32 input at ``C_G`` with its non-finite
    elements 0 (as the residual saw it), ``w`` in ``C_W``."""
    if (tl.load(row + _MODE) & 16) != 0:
        x = tl.load(fptr(row, _G) + offs, mask=mask, other=0.0)
        x = tl.where(tl.abs(x) < float("inf"), x, 0.0)
        a = a + f32(row, _W) * x
    return a


@triton.jit
def _accumulate_kernel(tab_ptr, blk_ptr, scale_ptr, rad_ptr, cnt_ptr, W: tl.constexpr,
                       HAS_SCALE: tl.constexpr, GDT: tl.constexpr, RADIX: tl.constexpr,
                       ZERO_CNT: tl.constexpr, BLOCK: tl.constexpr):
    j, row, offs, mask, lb = _where_am_i(tab_ptr, blk_ptr, W, BLOCK)
    if ZERO_CNT:
        # the payload counts zeroed by each row's first program (instead of a sample
        # launch: the group has no sampled row)
        if lb == 0:
            c2 = tl.arange(0, 2).to(tl.int64)
            tl.store(cnt_ptr + j * 2 + c2, tl.zeros([2], dtype=tl.int32))
    if RADIX:
        # a ROUTE_FRESH row's radix scratch (histograms, NaN count) zeroed by its first
        # program: the radix select's first pass runs after this launch
        if (lb == 0) & (tl.load(row + _EXACT) == 3):
            z = tl.arange(0, 2048).to(tl.int64)
            tl.store(rad_ptr + j * RS + z, tl.zeros([2048], dtype=tl.int32), mask=z < RS)
    gp = gptr(row, _G, GDT)
    rp = fptr(row, _R)
    d = tl.load(gp + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        d = d * tl.load(scale_ptr)
    fin = tl.abs(d) < float("inf")
    nbad = tl.sum(((~fin) & mask).to(tl.int32), axis=0)
    r = tl.load(rp + offs, mask=mask, other=0.0)
    mode = tl.load(row + _MODE)
    if (mode & 1) != 0:
        up = fptr(row, _U)
        m = f32(row, _M)
        g = tl.where(fin, d, 0.0)
        if (mode & 4) != 0:
            pp = gptr(row, _P, GDT)
            w = tl.load(pp + offs, mask=mask, other=0.0).to(tl.float32)
            g = g + f32(row, _WD) * w
        u = tl.load(up + offs, mask=mask, other=0.0)
        u = u * m
        u = u + f32(row, _C) * g
        tl.store(up + offs, u, mask=mask)
        if (mode & 2) != 0:
            x = g + m * u
        else:
            x = u
        fin2 = tl.abs(x) < float("inf")
        nbad += tl.sum(((~fin2) & mask).to(tl.int32), axis=0)
        r = tl.where(fin2, r + x, r)
    else:
        r = tl.where(fin, r + d, r)
    tl.store(rp + offs, r, mask=mask)
    nfp = tl.load(row + _NF).to(tl.pointer_type(tl.int32))
    tl.atomic_add(nfp, nbad, mask=nbad > 0, sem="relaxed")


@triton.jit
def _sample_kernel(tab_ptr, s_ptr, counts_ptr, cnt_ptr, Smax, R, W: tl.constexpr,
                   RP: tl.constexpr, SB: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    q = tl.program_id(1)
    row = tab_ptr + j * W
    i = q.to(tl.int64) * SB + tl.arange(0, SB)
    take = i < tl.load(row + _S)
    rp = fptr(row, _R)
    a = tl.load(rp + tl.load(row + _OFF) + i * tl.load(row + _STRIDE), mask=take,
                other=0.0)
    tl.store(s_ptr + j * Smax + i, tl.where(take, tl.abs(a), -1.0), mask=i < Smax)
    if q == 0:
        c = tl.arange(0, RP).to(tl.int64)
        tl.store(counts_ptr + j * R + c, tl.zeros([RP], dtype=tl.int32), mask=c < R)
        c2 = tl.arange(0, 2).to(tl.int64)
        tl.store(cnt_ptr + j * 2 + c2, tl.zeros([2], dtype=tl.int32))


@triton.jit
def _row_replay(row, v_ptr, Mmax, counts_ptr, R, j, ROUNDS: tl.constexpr):
    """Segment ``j``'s threshold after rounds ``0 .. ROUNDS-1`` (refine.py's rule)."""
    kf = tl.load(row + _RK).to(tl.float32)
    capf = tl.load(row + _RCAP).to(tl.float32)
    mf = tl.load(row + _MLEN).to(tl.float32)
    return replay_rounds(v_ptr + j * Mmax, counts_ptr + j * R, tl.load(row + _R0), mf, kf,
                         capf, f32(row, _TGT), ROUNDS)


@triton.jit
def _count_kernel(tab_ptr, blk_ptr, v_ptr, Mmax, counts_ptr, R, W: tl.constexpr,
                  ROUND: tl.constexpr, BLOCK: tl.constexpr):
    j, row, offs, mask, lb = _where_am_i(tab_ptr, blk_ptr, W, BLOCK)
    if tl.load(row + _EXACT) == 0:
        t = _row_replay(row, v_ptr, Mmax, counts_ptr, R, j, ROUND)
        rp = fptr(row, _R)
        ge = (tl.abs(tl.load(rp + offs, mask=mask, other=0.0)) >= t) & mask
        c = tl.sum(ge.to(tl.int32), axis=0)
        tl.atomic_add(counts_ptr + j * R + ROUND, c, mask=c > 0, sem="relaxed")


@triton.jit
def _is_ladder_row(row):
    """ROUTE_GIVEN with MODE_GUARD: Threshold's overflow ladder applies."""
    return (tl.load(row + _EXACT) == 2) & ((tl.load(row + _MODE) & 8) != 0)


@triton.jit
def _ladder_kernel(tab_ptr, blk_ptr, lad_ptr, gam_ptr, tiny, W: tl.constexpr,
                   J: tl.constexpr, BLOCK: tl.constexpr):
    """Threshold's overflow ladder: lad[j, q] += #{|r_j| >= max(tau_j * f_j, tiny) *
    gam[q]} (MODE_SCORE rows: their score's magnitude)."""
    j, row, offs, mask, lb = _where_am_i(tab_ptr, blk_ptr, W, BLOCK)
    if _is_ladder_row(row):
        t = tl.maximum(tl.load(fptr(row, _TIN)) * f32(row, _TGT), tiny)
        a = tl.abs(_ranked(row, tl.load(fptr(row, _R) + offs, mask=mask, other=0.0), offs,
                           mask))
        for q in tl.static_range(J):
            c = tl.sum(((a >= t * tl.load(gam_ptr + q)) & mask).to(tl.int32), axis=0)
            tl.atomic_add(lad_ptr + j * J + q, c, mask=c > 0, sem="relaxed")


@triton.jit
def _select_kernel(tab_ptr, blk_ptr, v_ptr, Mmax, counts_ptr, R, tau_ptr, idx_ptr, val_ptr,
                   cnt_ptr, tiny, lad_ptr, gam_ptr, rad_ptr, W: tl.constexpr,
                   ROUNDS: tl.constexpr, VE: tl.constexpr, J: tl.constexpr,
                   RADIX: tl.constexpr, BLOCK: tl.constexpr):
    j, row, offs, mask, lb = _where_am_i(tab_ptr, blk_ptr, W, BLOCK)
    route = tl.load(row + _EXACT)
    if RADIX:
        # ROUTE_FRESH rows: the radix select's k-th largest key (the other rows' scratch
        # is not written: not read)
        rad = rad_ptr + j * RS
        traw = tl.full([], -1.0, tl.float32)
        krem = tl.full([], 0, tl.int32)
        if route == 3:
            prefix, krem = _radix_walk(rad, row, 4)
            traw = prefix.to(tl.float32, bitcast=True)
            traw = tl.where(tl.load(rad + 1024) > 0, float("nan"), traw)
    if route == 2:                             # GIVEN: Threshold's reused tau, times f
        t = tl.load(fptr(row, _TIN)) * f32(row, _TGT)
    elif route == 3:                           # FRESH: the radix select's
        if RADIX:
            t = tl.where(traw < tiny, tiny, traw)
            if lb == 0:
                tl.store(fptr(row, _TIN), t)
                tl.store(rad + 1026, krem)
        else:
            t = tl.load(fptr(row, _TIN))
    else:
        t = _row_replay(row, v_ptr, Mmax, counts_ptr, R, j, ROUNDS)
    t = tl.maximum(t, tiny)
    if lb == 0:
        tl.store(tau_ptr + j, t)
    ts = t
    if J > 0:
        if _is_ladder_row(row):
            # the lowest rung whose count fits: r = min(#{q : c_q > cap}, J - 1)
            q = tl.arange(0, J).to(tl.int64)
            c = tl.load(lad_ptr + j * J + q).to(tl.int64)
            r = tl.minimum(tl.sum((c > tl.load(row + _CAP)).to(tl.int64), axis=0), J - 1)
            ts = t * tl.load(gam_ptr + r)
    rp = fptr(row, _R)
    a = tl.load(rp + offs, mask=mask, other=0.0)
    s = tl.abs(_ranked(row, a, offs, mask))
    cap = tl.load(row + _CAP)
    if RADIX:
        # MODE_TIES rows whose k-th score is >= TINY send the exact top k: every score
        # above it (k - krem of them: slots [0, k - krem)) and krem of those equal to it
        # (slots [k - krem, k), the first reserved: ascending index order through the
        # interpreter, as the per-layer path's ties to the lower index; the launch's
        # block order on a GPU). Other rows: every score >= t, as below.
        ties = (route == 3) & ((tl.load(row + _MODE) & 32) != 0) & (traw >= tiny)
        # -1: a value no |score| equals (other rows: no tie slots); a tie row's ts = traw
        teq = tl.where(ties, traw, -1.0)
        eq = (s == teq) & mask
        gt = (s >= ts) & (s != teq) & mask
        slot, w = reserve_slots(gt, cnt_ptr + j * 2 + 1, cap)
        kr = tl.where(ties, krem, 0).to(tl.int64)
        slot_e, w_e = reserve_slots(eq, rad + 1025, kr)
        slot = tl.where(eq, cap - kr + slot_e, slot)
        w = w | w_e
    else:
        slot, w = reserve_slots((s >= ts) & mask, cnt_ptr + j * 2 + 1, cap)
    out = tl.load(row + _OUT) + slot
    tl.store(idx_ptr + out, offs.to(tl.int32), mask=w)
    newa = store_float_values(a, val_ptr, out, w, VE)
    tl.store(rp + offs, newa, mask=w)


@triton.jit
def _radix_walk(rad, row, PASSES: tl.constexpr):
    """A ROUTE_FRESH row after ``PASSES`` passes (``rad``: its scratch): the digits of
    the k-th largest key found so far (``prefix``) and its rank among the keys that
    share them (``krem``). Each pass's digit: the largest ``d`` with ``#{digit >= d} >=
    krem``."""
    b = tl.arange(0, 256)
    krem = tl.load(row + _RK).to(tl.int32)
    prefix = krem * 0
    for q in tl.static_range(PASSES):
        h = tl.load(rad + q * 256 + b.to(tl.int64))
        ge = tl.sum(h, axis=0) - tl.cumsum(h, 0) + h        # #{digit >= d}
        d = tl.max(tl.where(ge >= krem, b, -1), axis=0)
        krem = krem - tl.sum(tl.where(b == d, ge - h, 0), axis=0)
        prefix = (prefix << 8) | d
    return prefix, krem


@triton.jit
def _radix_hist_kernel(tab_ptr, blk_ptr, rad_ptr, W: tl.constexpr, PASS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """ROUTE_FRESH rows, pass ``PASS`` of the radix select: hist[j, PASS, d] += #{i : the
    key of the ranked |r_i| has the digits the earlier passes chose (each program walks
    their histograms itself: no launch between passes) and digit d at this pass}."""
    j, row, offs, mask, lb = _where_am_i(tab_ptr, blk_ptr, W, BLOCK)
    if tl.load(row + _EXACT) == 3:
        rad = rad_ptr + j * RS
        SHIFT: tl.constexpr = 24 - 8 * PASS
        a = _ranked(row, tl.load(fptr(row, _R) + offs, mask=mask, other=0.0), offs, mask)
        key = a.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        ok = mask
        if PASS > 0:
            prefix, krem = _radix_walk(rad, row, PASS)
            ok = ok & ((key >> (SHIFT + 8)) == prefix)
        else:
            nn = tl.sum((mask & (key > 0x7F800000)).to(tl.int32), axis=0)
            tl.atomic_add(rad + 1024, nn, mask=nn > 0, sem="relaxed")
        b = tl.arange(0, 256)
        h = tl.histogram(tl.where(ok, (key >> SHIFT) & 255, 0), 256)
        h = h - tl.where(b == 0, BLOCK - tl.sum(ok.to(tl.int32), axis=0), 0)
        tl.atomic_add(rad + PASS * 256 + b.to(tl.int64), h, mask=h > 0, sem="relaxed")


@triton.jit
def _clamp_kernel(tab_ptr, cnt_ptr, tau_ptr, lad_ptr, rad_ptr, W: tl.constexpr,
                  J: tl.constexpr, RADIX: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    row = tab_ptr + j * W
    cap = tl.load(row + _CAP)
    sel = tl.load(cnt_ptr + j * 2 + 1).to(tl.int64)
    if RADIX:
        if (tl.load(row + _EXACT) == 3) & ((tl.load(row + _MODE) & 32) != 0):
            # a MODE_TIES row: the scores above its k-th plus the ties it sent
            rad = rad_ptr + j * RS
            sel += tl.minimum(tl.load(rad + 1025), tl.load(rad + 1026)).to(tl.int64)
            tl.store(cnt_ptr + j * 2 + 1, sel.to(tl.int32))
    tl.store(cnt_ptr + j * 2, tl.minimum(sel, cap).to(tl.int32))
    if J > 0:
        if _is_ladder_row(row):
            # selected: the count at tau (the ladder's rung 0), not at the rung used
            sel = tl.load(lad_ptr + j * J).to(tl.int64)
            tl.store(cnt_ptr + j * 2 + 1, sel.to(tl.int32))
    if (tl.load(row + _MODE) & 8) != 0:
        # MODE_GUARD (Threshold's overflow guard): the next step's tau, into a new tensor
        # ratio = fp32(selected) / fp32(cap); tau' = ratio > 1 ? tau * min(sqrt(ratio), 2)
        t = tl.load(tau_ptr + j)
        ratio = tl.math.div_rn(sel.to(tl.float32), cap.to(tl.float32))
        up = tl.minimum(tl.math.sqrt_rn(ratio), 2.0)
        tl.store(fptr(row, _TOUT), tl.where(ratio > 1.0, t * up, t))


@triton.jit
def _mask_kernel(tab_ptr, idx_ptr, cnt_ptr, W: tl.constexpr, CB: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    row = tab_ptr + j * W
    if (tl.load(row + _MODE) & 1) != 0:
        i = tl.program_id(1).to(tl.int64) * CB + tl.arange(0, CB)
        c = tl.load(cnt_ptr + j * 2).to(tl.int64)
        m = i < c
        pos = tl.load(idx_ptr + tl.load(row + _OUT) + i, mask=m, other=0).to(tl.int64)
        m = m & (pos >= 0) & (pos < tl.load(row + _N))
        up = fptr(row, _U)
        tl.store(up + pos, tl.zeros([CB], dtype=tl.float32), mask=m)


def radix_scratch(L, device):
    """The radix select's scratch of ``L`` rows (int32 [L, RS]; :func:`accumulate` with
    ``radix=`` zeroes the ROUTE_FRESH rows' parts, the other rows' are never read)."""
    return torch.empty((L, RS.value), dtype=torch.int32, device=device)


def accumulate(tab, blk, grad_scale, gdt, *, block, radix=None, counts=None):
    """``radix``: :func:`radix_scratch` when ROUTE_FRESH rows follow (zeroed here);
    ``counts``: the group's int32 [L, 2] payload counts, zeroed here (for
    :func:`threshold_and_select` without a sampled row: no sample launch then)."""
    has_scale = grad_scale is not None
    _accumulate_kernel[(blk.numel(),)](
        tab, blk, grad_scale.reshape(1) if has_scale else tab,
        radix if radix is not None else tab, counts if counts is not None else tab, W=W,
        HAS_SCALE=has_scale, GDT=gdt, RADIX=radix is not None, ZERO_CNT=counts is not None,
        BLOCK=block, num_warps=16, enable_fp_fusion=False)


def radix_select(tab, blk, radix, *, block):
    """ROUTE_FRESH rows' histograms for tau_j = max(the exact k_j-th largest ranked
    ``|r_j|``, TINY) (``Threshold``'s refresh: ``topk(|acc|, k).values.min().clamp_min(
    TINY)``, the same value; MODE_SCORE rows rank their score): the fp32 bit patterns
    order like the values (NaN above Inf), so four passes of 8-bit digits, most
    significant first, each a histogram launch (one 256-bin histogram per program, one
    atomic add per bin; each program finds the digits of the earlier passes from their
    histograms), find the key exactly; :func:`threshold_and_select`'s select launch
    reads the last digit and writes tau to C_TIN. 4 launches per group, whatever L;
    ``radix`` zeroed by :func:`accumulate`."""
    nblk = blk.numel()
    for p in range(4):
        _radix_hist_kernel[(nblk,)](tab, blk, radix, W=W, PASS=p, BLOCK=block, num_warps=8,
                                    enable_fp_fusion=False)


def threshold_and_select(tab, blk, L, smax, mmax, rounds, capacity_total, ve, ladder=None,
                         *, block, sample_block=1024, radix=None, sampled=True,
                         counts=None):
    """Sample, sort, ``rounds`` counting passes, (the ladder's counting pass), select
    and clamp. Returns ``(indices int32[capacity_total], values, counts int32[L, 2], tau
    fp32[L])``; the slots of segment ``j`` are ``[tab[j, _OUT], tab[j, _OUT] + cap_j)``.
    ``ladder``: Threshold's rung factors (``threshold.ladder_factors``), given when a
    row has MODE_GUARD (the driver's rule: the table is on the device, not checked
    here); ``None``: no ladder pass. ``radix``: the scratch of :func:`radix_select`
    (ROUTE_FRESH rows: their tau from it); ``sampled=False``: no row is ROUTE_SAMPLED or
    ROUTE_EXACT (no sort, no counting round; with ``counts``, the [L, 2] payload counts
    :func:`accumulate` zeroed, no sample launch either)."""
    dev = tab.device
    S = torch.empty((L, smax), dtype=torch.float32, device=dev)
    R = max(int(rounds), 1)
    counts_r = torch.empty((L, R), dtype=torch.int32, device=dev)
    if counts is not None and not sampled:
        cnt = counts                # zeroed by the accumulate launch; nothing to sample
    else:
        cnt = torch.empty((L, 2), dtype=torch.int32, device=dev)
        _sample_kernel[(L, triton.cdiv(smax, sample_block))](
            tab, S, counts_r, cnt, smax, R, W=W, RP=triton.next_power_of_2(R),
            SB=sample_block, num_warps=4)
    nblk = blk.numel()
    if not sampled:                 # GIVEN / FRESH rows only: nothing sorted or counted
        V, rounds = S, 0
    else:
        V = torch.topk(S, mmax, dim=1, largest=True, sorted=True).values
    for j in range(rounds):
        _count_kernel[(nblk,)](tab, blk, V, mmax, counts_r, R, W=W, ROUND=j, BLOCK=block,
                               num_warps=8, enable_fp_fusion=False)
    J = 0 if ladder is None else ladder.numel()
    lad = torch.zeros((L, J), dtype=torch.int32, device=dev) if J else cnt
    if J:
        _ladder_kernel[(nblk,)](tab, blk, lad, ladder, _TINY, W=W, J=J, BLOCK=block,
                                num_warps=8, enable_fp_fusion=False)
    idx = torch.empty(capacity_total, dtype=torch.int32, device=dev)
    vals = torch.empty(capacity_total, dtype=_VE_DTYPE[ve], device=dev)
    tau = torch.empty(L, dtype=torch.float32, device=dev)
    _select_kernel[(nblk,)](tab, blk, V, mmax, counts_r, R, tau, idx, vals, cnt, _TINY, lad,
                            ladder if J else S, radix if radix is not None else cnt, W=W,
                            ROUNDS=rounds, VE=ve, J=J, RADIX=radix is not None, BLOCK=block,
                            num_warps=16, enable_fp_fusion=False)
    _clamp_kernel[(L,)](tab, cnt, tau, lad, radix if radix is not None else cnt, W=W, J=J,
                        RADIX=radix is not None, num_warps=1, enable_fp_fusion=False)
    return idx, vals, cnt, tau


def mask(tab, idx, cnt, L, capmax, *, block=1024):
    if capmax == 0:
        return
    _mask_kernel[(L, triton.cdiv(capmax, block))](tab, idx, cnt, W=W, CB=block, num_warps=4)
