"""Slim-DP's layers of a whole bucket: every layer's core gather and explorer draw in one
launch.

The rows are ``kernels/bucket_topk.py``'s segment table (its columns, its accumulate
launch: error feedback, DGC's velocity update, AMP's scale and the non-finite count,
bit for bit the per-layer path; its mask launch after the exchange), with five cells
read differently: ``C_CAP`` holds the row's slots ``nc_j + e_j``, ``C_NCORE`` its core
size ``nc_j``, ``C_NEX`` its explorer size ``e_j``, ``C_CORE`` the address of its core
(int64, ascending) and ``C_SEED`` its explorer's Philox seed (the layer's own, from the
host's step counter). After the accumulate, per slot ``s < nc_j + e_j`` of row ``j``
(``hvdsparse/compressors/slimdp.py``'s core and explorer, the same bits)::

    core slot  (s < nc):   i = core_j[s]
    explorer slot t = s - nc,  m = n_j - nc:
        u  = tl.rand(seed_j, t)                           (ops.philox_uniform's stream)
        lo = (t * m) // e;   size = ((t + 1) * m) // e - lo
        p  = lo + ((int64(u * 2**31) * size) >> 31)     (a position outside the core)
        i  = p + #{q : core_j[q] - q <= p}               (binary search: NIT rounds)
    a = r_j[i]
    val[OUT_j + s] = cast(a)   (fp32 / fp16 / bf16, kernels/select.py's casts)
    r_j[i] = a - fp32(cast(a)) (0 for fp32: error feedback keeps the cast error)
    idx[OUT_j + s] = i (int32);   count[j] = [nc + e, nc + e];   parts[j] = [nc, e]

The core and the explorer are disjoint and each is distinct, so the residual writes never
collide; a row's slots are its core in index order, then its explorer in index order
(``count`` covers both: the mask launch zeroes the velocity at every sent index).
``NIT`` (constexpr) is ``max_j nc_j``'s bit length: a search over ``nc`` sorted entries
halves its range each round, so it ends in ``bit_length(nc)`` rounds. One program per
``CB`` slots of a row; grid ``(rows, ceil(max (nc + e) / CB))``. No atomics, no host
synchronisation.
"""
import triton
import triton.language as tl

from .bucket_randomk import send_slots, stratum_index
from .bucket_topk import C_CAP, C_N, C_OFF, C_RCAP, C_RK, C_TIN

#: the table cells a Slim-DP row reads beyond the accumulate's
C_SEED, C_NCORE, C_NEX, C_CORE = C_OFF, C_RK, C_RCAP, C_TIN

_CAP = tl.constexpr(C_CAP)
_N = tl.constexpr(C_N)
_SEED = tl.constexpr(C_SEED)
_NCORE = tl.constexpr(C_NCORE)
_NEX = tl.constexpr(C_NEX)
_CORE = tl.constexpr(C_CORE)


@triton.jit
def _gather_kernel(tab_ptr, idx_ptr, val_ptr, cnt_ptr, parts_ptr, W: tl.constexpr,
                   VE: tl.constexpr, NIT: tl.constexpr, CB: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    row = tab_ptr + j * W
    tot = tl.load(row + _CAP)
    n = tl.load(row + _N)
    nc = tl.load(row + _NCORE)
    e = tl.load(row + _NEX)
    seed = tl.load(row + _SEED)
    core_ptr = tl.load(row + _CORE).to(tl.pointer_type(tl.int64))
    s = tl.program_id(1).to(tl.int64) * CB + tl.arange(0, CB).to(tl.int64)
    m = s < tot
    is_core = m & (s < nc)
    is_ex = m & (s >= nc)
    # core slots: the core's own index
    ic = tl.load(core_ptr + tl.where(is_core, s, 0), mask=is_core, other=0)
    # explorer slots: a stratified position among the m elements outside the core ...
    t = tl.where(is_ex, s - nc, 0)
    p = stratum_index(seed, t, n - nc, tl.maximum(e, 1))
    # ... mapped past the core entries at or before it: #{q : core[q] - q <= p}
    a_lo = tl.zeros([CB], dtype=tl.int64)
    a_hi = tl.zeros([CB], dtype=tl.int64) + nc
    for _ in range(NIT):
        act = is_ex & (a_lo < a_hi)
        mid = (a_lo + a_hi) // 2
        c = tl.load(core_ptr + mid, mask=act, other=0)
        right = act & (c - mid <= p)
        a_lo = tl.where(right, mid + 1, a_lo)
        a_hi = tl.where(act & (c - mid > p), mid, a_hi)
    i = tl.where(is_core, ic, tl.where(is_ex, p + a_lo, 0))
    send_slots(row, i, s, m, val_ptr, idx_ptr, VE)
    if tl.program_id(1) == 0:
        tl.store(cnt_ptr + j * 2, tot.to(tl.int32))
        tl.store(cnt_ptr + j * 2 + 1, tot.to(tl.int32))
        tl.store(parts_ptr + j * 2, nc.to(tl.int32))
        tl.store(parts_ptr + j * 2 + 1, e.to(tl.int32))


def gather(tab, idx, vals, cnt, parts, L, totmax, ncmax, ve, *, W, block=512):
    """The core gather and explorer draw of ``L`` rows (``totmax``: the most slots of a
    row, ``ncmax``: the largest core; ``ve``: the value encoding code of
    ``kernels/select.py``): writes ``idx`` (int32), ``vals``, ``cnt`` (int32 ``[L, 2]``:
    ``[slots, slots]``), ``parts`` (int32 ``[L, 2]``: ``[core, explorer]``) and the
    residuals' sent elements."""
    if L == 0 or totmax == 0:
        return
    _gather_kernel[(L, triton.cdiv(totmax, block))](
        tab, idx, vals, cnt, parts, W=W, VE=ve, NIT=int(ncmax).bit_length(), CB=block,
        num_warps=4, enable_fp_fusion=False)
