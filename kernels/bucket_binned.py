"""AdaComp over a whole bucket: the layers of a group (one bin size ``L``, one
``max_per_bin`` ``C``, one ``scale``) as rows of one int64 table ``tab[L_rows, W]``
(one host-to-device copy per group and step), bit for bit the per-layer Triton path
(``AdaComp._compress``: ``ops.residual_add_binmax``, ``ops.segment_mean(gmax)``,
``ops.binned_pack`` = ``kernels/binned.py``). Every layer's bins are numbered within
the bucket (``BIN0_j + b``); a cached int32 ``blk[nprograms]`` maps each program to its
row, and program ``p`` owns ``ROWS`` whole bins of that row as a ``[ROWS, next_pow2(L)]``
tile (the three kernels share the layout; no result depends on it).

Per group and step (``hvdsparse/compressors/bucket.py`` drives them)::

    accumulate  1 launch   zeroes one int32 buffer (every row's slots, bin-relative
                           indices; sign words; ``selected`` counter: each program a
                           stripe);
                           G = fin ? G + d : G   (MODE_PRE: G + (fin ? d : +0), a
                           gradient the local update cleaned), d = fp32(grad) * s;
                           MODE_MOMENTUM (DGC, kernels/bucket_topk.py's accumulate):
                             g = (fin ? d : +0) [+ fp32(wd) * fp32(param)],
                             u = u * m;  u = u + c * g;  x = nesterov ? g + m * u : u,
                             G = |x| < inf ? G + x : G  (d' below is then x, read
                             back from the updated velocity)
                           nonfinite_j += #not fin;  gmax[BIN0_j + b] = max |G| over
                           bin b (integer max of the bit patterns; NaN canonical)
    mean        1 launch   scale_j = the mean of gmax[bins of j]
                           (kernels/segment_mean.py, the per-layer path's bits), into
                           scales[j]
    count       1 launch   h = G + d' * (scale - 1), d' = fin ? d : 0 (or x);
                           thr = gmax < TINY ? TINY : gmax (NaN stays NaN);
                           cnt[bin] = min(#{|h| >= thr}, C); selected_j += #{|h| >= thr}
    quota       1 launch   only when a row's ``BUDGET`` is below ``NB * C`` (AdaComp's
                           ``mean_per_bin``): each row's ``cnt`` becomes its quota,
                           ``BUDGET`` slots dealt from bin ``ROT`` (kernels/bin_quota.py)
    cumsum      1 op       cum = cumsum(cnt) over the whole bucket (exact integers)
    pack        1 launch   kernels/binned.py's pick / pack / residue per bin, the bin's
                           first slot ``cum[bin] - cnt[bin] - base_j`` (``base_j`` =
                           the bucket prefix before row j), slots at ``SLOT0_j``, sign
                           bits in the row's words from ``WORD0_j`` (word aligned);
                           count_j = cum[last bin of j] - base_j

Compiled with ``enable_fp_fusion=False``: every product and sum its own fp32 rounding.
Atomics: relaxed adds (non-finite, selected) and ORs (sign words). No host
synchronisation.
"""
import torch
import triton
import triton.language as tl

from . import bin_quota
from .binned import pick_one
from .table import add_nonfinite, f32, fptr, gptr, program_row, scaled

C_G, C_R, C_N, C_NF, C_MODE, C_NB, C_BIN0, C_SLOT0, C_WORD0, C_BLK0 = range(10)
C_U, C_P, C_M, C_C, C_WD = range(10, 15)
C_BUDGET, C_ROT = 15, 16
W = 17
MODE_PRE, MODE_MOMENTUM, MODE_NESTEROV, MODE_WD = 1, 2, 4, 8
GDT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_TINY = float(torch.finfo(torch.float32).tiny)

_G = tl.constexpr(C_G)
_R = tl.constexpr(C_R)
_N = tl.constexpr(C_N)
_NF = tl.constexpr(C_NF)
_MODE = tl.constexpr(C_MODE)
_NB = tl.constexpr(C_NB)
_BIN0 = tl.constexpr(C_BIN0)
_SLOT0 = tl.constexpr(C_SLOT0)
_WORD0 = tl.constexpr(C_WORD0)
_BLK0 = tl.constexpr(C_BLK0)
_U = tl.constexpr(C_U)
_P = tl.constexpr(C_P)
_M = tl.constexpr(C_M)
_C = tl.constexpr(C_C)
_WD = tl.constexpr(C_WD)


@triton.jit
def _tile(tab_ptr, blk_ptr, L, W: tl.constexpr, ROWS: tl.constexpr, LP: tl.constexpr):
    """(row index, row pointer, local bins, bins valid, columns, offsets, mask)."""
    j, row, n, lb = program_row(tab_ptr, blk_ptr, W, _N, _BLK0)
    bins = lb * ROWS + tl.arange(0, ROWS)
    bin_ok = bins < tl.load(row + _NB)
    cols = tl.arange(0, LP)
    offs = bins[:, None] * L + cols[None, :]
    mask = bin_ok[:, None] & (cols[None, :] < L) & (offs < n)
    return j, row, lb, bins, bin_ok, cols, offs, mask


@triton.jit
def _d(row, offs, mask, scale_ptr, HAS_SCALE: tl.constexpr, GDT: tl.constexpr):
    return scaled(gptr(row, _G, GDT), offs, mask, scale_ptr, HAS_SCALE)


@triton.jit
def _ada_accumulate_kernel(tab_ptr, blk_ptr, scale_ptr, gmax_ptr, zero_ptr, zn, L,
                           W: tl.constexpr, HAS_SCALE: tl.constexpr, GDT: tl.constexpr,
                           ROWS: tl.constexpr, LP: tl.constexpr, ZB: tl.constexpr):
    # the group's int32 slot / sign-word / counter buffer: program p zeroes its stripe
    # [p * z, (p + 1) * z), z = cdiv(zn, programs) (read by the later launches only)
    p = tl.program_id(0).to(tl.int64)
    z = tl.cdiv(zn, tl.num_programs(0))
    zend = tl.minimum((p + 1) * z, zn)
    for i in range(0, z, ZB):
        zo = p * z + i + tl.arange(0, ZB)
        tl.store(zero_ptr + zo, tl.zeros([ZB], dtype=tl.int32), mask=zo < zend)
    j, row, lb, bins, bin_ok, cols, offs, mask = _tile(tab_ptr, blk_ptr, L, W, ROWS, LP)
    d, fin = _d(row, offs, mask, scale_ptr, HAS_SCALE, GDT)
    rp = fptr(row, _R)
    r = tl.load(rp + offs, mask=mask, other=0.0)
    mode = tl.load(row + _MODE)
    bad2 = tl.zeros([ROWS, LP], dtype=tl.int32)
    if (mode & 2) != 0:
        # DGC's momentum correction (LocalUpdate.corrected's roundings), then the
        # compressor's residual add of x
        m = f32(row, _M)
        g = tl.where(fin, d, 0.0)
        if (mode & 8) != 0:
            w = tl.load(gptr(row, _P, GDT) + offs, mask=mask, other=0.0).to(tl.float32)
            g = g + f32(row, _WD) * w
        up = fptr(row, _U)
        u = tl.load(up + offs, mask=mask, other=0.0)
        u = u * m
        u = u + f32(row, _C) * g
        tl.store(up + offs, u, mask=mask)
        if (mode & 4) != 0:
            x = g + m * u
        else:
            x = u
        fin2 = tl.abs(x) < float("inf")
        a = tl.where(fin2, r + x, r)
        bad2 = ((~fin2) & mask).to(tl.int32)
    elif (mode & 1) != 0:
        a = r + tl.where(fin, d, 0.0)
    else:
        a = tl.where(fin, r + d, r)
    tl.store(rp + offs, a, mask=mask)
    bits = tl.where(mask, a.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
    m = tl.max(bits, axis=1)
    m = tl.where(m > 0x7F800000, 0x7FC00000, m)
    tl.store(gmax_ptr + tl.load(row + _BIN0) + bins, m.to(tl.float32, bitcast=True),
             mask=bin_ok)
    nbad = tl.sum(tl.sum(((~fin) & mask).to(tl.int32) + bad2, axis=1), axis=0)
    add_nonfinite(row, _NF, nbad)


@triton.jit
def _abs_h_thr(row, offs, mask, bins, bin_ok, scale_ptr, gmax_ptr, hm1, tiny,
               HAS_SCALE: tl.constexpr, GDT: tl.constexpr):
    """(|h|, per-bin threshold) as kernels/binned.py computes them."""
    d, fin = _d(row, offs, mask, scale_ptr, HAS_SCALE, GDT)
    d = tl.where(fin, d, 0.0)
    mode = tl.load(row + _MODE)
    if (mode & 2) != 0:
        # x from the velocity the accumulate launch wrote (the same bits as there)
        if (mode & 4) != 0:
            g = d
            if (mode & 8) != 0:
                w = tl.load(gptr(row, _P, GDT) + offs, mask=mask, other=0.0).to(tl.float32)
                g = g + f32(row, _WD) * w
            up = fptr(row, _U)
            x = g + f32(row, _M) * tl.load(up + offs, mask=mask, other=0.0)
        else:
            up = fptr(row, _U)
            x = tl.load(up + offs, mask=mask, other=0.0)
        d = tl.where(tl.abs(x) < float("inf"), x, 0.0)
    rp = fptr(row, _R)
    a = tl.load(rp + offs, mask=mask, other=0.0)
    gm = tl.load(gmax_ptr + tl.load(row + _BIN0) + bins, mask=bin_ok, other=float("inf"))
    thr = tl.where(gm < tiny, tiny, gm)            # clamp_min(TINY); NaN stays NaN
    return tl.abs(a + d * hm1), thr


@triton.jit
def _ada_count_kernel(tab_ptr, blk_ptr, scale_ptr, gmax_ptr, cnt_ptr, sel_ptr, L, hm1, tiny, C,
                  W: tl.constexpr, HAS_SCALE: tl.constexpr, GDT: tl.constexpr,
                  ROWS: tl.constexpr, LP: tl.constexpr):
    j, row, lb, bins, bin_ok, cols, offs, mask = _tile(tab_ptr, blk_ptr, L, W, ROWS, LP)
    a, thr = _abs_h_thr(row, offs, mask, bins, bin_ok, scale_ptr, gmax_ptr, hm1, tiny,
                        HAS_SCALE, GDT)
    ps = (a >= thr[:, None]) & mask
    npass = tl.sum(ps.to(tl.int32), axis=1)
    tl.store(cnt_ptr + tl.load(row + _BIN0) + bins, tl.minimum(npass, C), mask=bin_ok)
    tot = tl.sum(npass, axis=0)
    tl.atomic_add(sel_ptr + j, tot, mask=tot > 0, sem="relaxed")


@triton.jit
def _ada_pack_kernel(tab_ptr, blk_ptr, scale_ptr, gmax_ptr, cnt_ptr, cum_ptr, s_ptr, rel_ptr,
                 words_ptr, count_ptr, L, hm1, tiny, W: tl.constexpr,
                 HAS_SCALE: tl.constexpr, GDT: tl.constexpr, C: tl.constexpr,
                 ROWS: tl.constexpr, LP: tl.constexpr):
    j, row, lb, bins, bin_ok, cols, offs, mask = _tile(tab_ptr, blk_ptr, L, W, ROWS, LP)
    a, thr = _abs_h_thr(row, offs, mask, bins, bin_ok, scale_ptr, gmax_ptr, hm1, tiny,
                        HAS_SCALE, GDT)
    bin0 = tl.load(row + _BIN0)
    base = tl.load(cum_ptr + bin0 - 1, mask=bin0 > 0, other=0)
    if lb == 0:
        nb = tl.load(row + _NB)
        tl.store(count_ptr + j, tl.load(cum_ptr + bin0 + nb - 1) - base)
    avail = (a >= thr[:, None]) & mask
    cnt = tl.load(cnt_ptr + bin0 + bins, mask=bin_ok, other=0)
    start = tl.load(cum_ptr + bin0 + bins, mask=bin_ok, other=0) - cnt - base
    s = tl.load(s_ptr + j)
    rp = fptr(row, _R)
    slot0 = tl.load(row + _SLOT0)
    word0 = tl.load(row + _WORD0)
    for q in tl.static_range(C):
        avail = pick_one(q, a, avail, cols, bins, bin_ok, cnt, start, s, L, rp, rel_ptr,
                         slot0, words_ptr, word0, ROWS, LP)


def tile_rows(L, *, block=4096):
    """Bins per program for bin size ``L`` (a power of 2)."""
    return max(1, block // triton.next_power_of_2(int(L)))


def accumulate(tab, blk, grad_scale, gmax, zero, gdt, L, rows):
    """``zero``: the group's int32 buffer the count and pack launches add and OR into,
    zeroed here."""
    has = grad_scale is not None
    _ada_accumulate_kernel[(blk.numel(),)](
        tab, blk, grad_scale.reshape(1) if has else gmax, gmax, zero, zero.numel(), int(L),
        W=W, HAS_SCALE=has, GDT=gdt, ROWS=rows, LP=triton.next_power_of_2(int(L)), ZB=1024,
        num_warps=8, enable_fp_fusion=False)


def count(tab, blk, grad_scale, gmax, cnt, selected, gdt, L, hm1, c, rows):
    has = grad_scale is not None
    _ada_count_kernel[(blk.numel(),)](
        tab, blk, grad_scale.reshape(1) if has else gmax, gmax, cnt, selected, int(L),
        float(hm1), _TINY, int(c), W=W, HAS_SCALE=has, GDT=gdt, ROWS=rows,
        LP=triton.next_power_of_2(int(L)), num_warps=8, enable_fp_fusion=False)


def quota(tab, cnt, rows, c):
    """Every row's counts become its quota under ``BUDGET`` (one launch)."""
    bin_quota.quota_rows(tab, cnt, rows, W, C_BIN0, C_NB, C_BUDGET, C_ROT, c)


def pack(tab, blk, grad_scale, gmax, cnt, cum, scales, rel, words, counts, gdt, L, hm1, c,
         rows):
    has = grad_scale is not None
    _ada_pack_kernel[(blk.numel(),)](
        tab, blk, grad_scale.reshape(1) if has else gmax, gmax, cnt, cum, scales, rel,
        words, counts, int(L), float(hm1), _TINY, W=W, HAS_SCALE=has, GDT=gdt, C=int(c),
        ROWS=rows, LP=triton.next_power_of_2(int(L)), num_warps=8, enable_fp_fusion=False)
