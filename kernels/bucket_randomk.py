"""RandomK's layers of a whole bucket: the draw and the pick of every layer in one launch.

The rows are ``kernels/bucket_topk.py``'s segment table (its columns, its accumulate
launch: error feedback, DGC's velocity update, AMP's scale and the non-finite count,
bit for bit the per-layer path; its mask launch after the exchange), with two cells
read differently: ``C_CAP`` holds the row's ``k`` and ``C_OFF`` its Philox seed (the
layer's own, from the host's step counter). After the accumulate, per slot ``s < k_j``
of row ``j`` (``hvdsparse/compressors/randomk.py``'s stratified draw, the same bits)::

    u    = tl.rand(seed_j, s)                         (ops.philox_uniform's stream)
    lo   = (s * n_j) // k_j;   size = ((s + 1) * n_j) // k_j - lo
    i    = lo + ((int64(u * 2**31) * size) >> 31)    (int64 throughout: exact)
    a    = r_j[i]
    val[OUT_j + s] = cast(a)   (fp32 / fp16 / bf16, kernels/select.py's casts)
    r_j[i] = a - fp32(cast(a)) (0 for fp32: error feedback keeps the cast error)
    idx[OUT_j + s] = i (int32; and int64 into ``wide`` when given: the shared-seed
    layers' ``implicit_indices``);   count[j] = [k_j, k_j]

The indices of a row are distinct (one per stratum), so the residual writes never
collide and the slot order is the index order. One program per ``CB`` slots of a row;
grid ``(rows, ceil(max k / CB))``. No atomics, no host synchronisation.
"""
import triton
import triton.language as tl

from .bucket_topk import C_CAP, C_N, C_OFF, C_OUT, C_R
from .select import store_float_values
from .table import fptr

_CAP = tl.constexpr(C_CAP)
_N = tl.constexpr(C_N)
_SEED = tl.constexpr(C_OFF)
_OUT = tl.constexpr(C_OUT)
_R = tl.constexpr(C_R)
#: the table cell holding a RandomK row's Philox seed
C_SEED = C_OFF


@triton.jit
def stratum_index(seed, s, n, k):
    """Slot ``s``'s index in ``[0, n)`` under the stratified draw of ``k`` (> 0) slots
    (the module docstring: ``u = tl.rand(seed, s)``, one index per stratum, int64
    throughout: exact)."""
    u = tl.rand(seed, s)
    lo = (s * n) // k
    size = ((s + 1) * n) // k - lo
    return lo + (((u * 2147483648.0).to(tl.int64) * size) >> 31)


@triton.jit
def send_slots(row, i, s, m, val_ptr, idx_ptr, VE: tl.constexpr):
    """Slots ``s`` (mask ``m``) of table row ``row`` send its residual's elements ``i``:
    ``val[OUT + s] = cast(r[i])``, ``r[i] = `` the cast error (0 for fp32), ``idx[OUT +
    s] = i`` (int32). Returns the row's ``OUT``."""
    rp = fptr(row, _R)
    a = tl.load(rp + i, mask=m, other=0.0)
    out = tl.load(row + _OUT)
    newa = store_float_values(a, val_ptr, out + s, m, VE)
    tl.store(rp + i, newa, mask=m)
    tl.store(idx_ptr + out + s, i.to(tl.int32), mask=m)
    return out


@triton.jit
def _pick_kernel(tab_ptr, idx_ptr, wide_ptr, val_ptr, cnt_ptr, W: tl.constexpr,
                 VE: tl.constexpr, WIDE: tl.constexpr, CB: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    row = tab_ptr + j * W
    k = tl.load(row + _CAP)
    n = tl.load(row + _N)
    seed = tl.load(row + _SEED)
    s = tl.program_id(1).to(tl.int64) * CB + tl.arange(0, CB).to(tl.int64)
    m = s < k
    i = tl.where(m, stratum_index(seed, s, n, k), 0)
    out = send_slots(row, i, s, m, val_ptr, idx_ptr, VE)
    if WIDE:
        tl.store(wide_ptr + out + s, i, mask=m)
    if tl.program_id(1) == 0:
        kk = k.to(tl.int32)
        tl.store(cnt_ptr + j * 2, kk)
        tl.store(cnt_ptr + j * 2 + 1, kk)


def pick(tab, idx, vals, cnt, L, kmax, ve, wide=None, *, W, block=1024):
    """The draw and pick of ``L`` rows (``kmax``: the largest ``k``; ``ve``: the value
    encoding code of ``kernels/select.py``): writes ``idx`` (int32), ``wide`` (int64,
    if given), ``vals`` and ``cnt`` (int32 ``[L, 2]``) and the residuals' sent
    elements."""
    if L == 0 or kmax == 0:
        return
    _pick_kernel[(L, triton.cdiv(kmax, block))](
        tab, idx, wide if wide is not None else idx, vals, cnt, W=W, VE=ve,
        WIDE=wide is not None, CB=block, num_warps=4, enable_fp_fusion=False)
