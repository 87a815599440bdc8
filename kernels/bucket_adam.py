"""The Adam recipe's update wire for a whole bucket: every rank's own Adam step of every
layer of a group in one launch (``hvdsparse/adam_bucket.py`` drives it; the per-layer
form is ``AdamRecipe._own_step``, the same bits).

One int64 table ``tab[L, W]``, a row per layer: the addresses of its gradient, Adam
moments (read), the new moments and the step ``x`` (written: one fp32 buffer each for
the group, the layer's slice at the row's addresses), its parameter (Adam's L2 weight
decay), its non-finite counter, and fp32 constants as their bits. Per element of row
``j`` (every product and sum its own fp32 rounding: ``enable_fp_fusion=False``,
``div_rn`` / ``sqrt_rn``)::

    d   = fp32(grad) * s                 (s: AMP's inverse loss scale, or none)
    fin = |d| < inf;   nonfinite_j += #not fin;   g = fin ? d : +0
    g   = g + wd * fp32(param)           (MODE_L2: Adam's coupled weight decay)
    g   = -g                             (MODE_MAXIMIZE)
    m'  = m * b1 + c1 * g                (c1 = fp32(1 - b1))
    v'  = v * b2 + c2 * (g * g)          (c2 = fp32(1 - b2))
    x   = m' / (sqrt(v') * ib2 + eps) * ib1 * lr
                                         (ib2 = fp32(1 / sqrt(1 - b2^t)),
                                          ib1 = fp32(1 / (1 - b1^t)), t = Adam's step + 1)

``x`` is what the compressor then receives as the layer's input (error feedback adds it
to the residual); ``m'``, ``v'`` wait for the optimizer's ``step()`` to commit them.
Loads through table addresses: 32-bit, offsets int64; the counter's atomic is relaxed.
"""
import torch
import triton
import triton.language as tl

from .table import add_nonfinite, f32, fptr, gptr, program_row, scaled

# columns of the table (int64; fp32 constants as their bits)
C_G, C_N, C_BLK0, C_NF, C_M, C_V, C_MO, C_VO, C_X, C_P = range(10)
C_B1, C_C1, C_B2, C_C2, C_IB2, C_EPS, C_IB1, C_LR, C_WD, C_MODE = range(10, 20)
W = 20
MODE_L2, MODE_MAXIMIZE = 1, 2
GDT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_G = tl.constexpr(C_G)
_N = tl.constexpr(C_N)
_BLK0 = tl.constexpr(C_BLK0)
_NF = tl.constexpr(C_NF)
_M = tl.constexpr(C_M)
_V = tl.constexpr(C_V)
_MO = tl.constexpr(C_MO)
_VO = tl.constexpr(C_VO)
_X = tl.constexpr(C_X)
_P = tl.constexpr(C_P)
_B1 = tl.constexpr(C_B1)
_C1 = tl.constexpr(C_C1)
_B2 = tl.constexpr(C_B2)
_C2 = tl.constexpr(C_C2)
_IB2 = tl.constexpr(C_IB2)
_EPS = tl.constexpr(C_EPS)
_IB1 = tl.constexpr(C_IB1)
_LR = tl.constexpr(C_LR)
_WD = tl.constexpr(C_WD)
_MODE = tl.constexpr(C_MODE)


@triton.jit
def _own_step_kernel(tab_ptr, blk_ptr, scale_ptr, W: tl.constexpr, HAS_SCALE: tl.constexpr,
                     GDT: tl.constexpr, BLOCK: tl.constexpr):
    j, row, n, lb = program_row(tab_ptr, blk_ptr, W, _N, _BLK0)
    offs = lb * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    d, fin = scaled(gptr(row, _G, GDT), offs, mask, scale_ptr, HAS_SCALE)
    add_nonfinite(row, _NF, tl.sum(((~fin) & mask).to(tl.int32), axis=0))
    g = tl.where(fin, d, 0.0)
    mode = tl.load(row + _MODE)
    if (mode & 1) != 0:
        p = tl.load(gptr(row, _P, GDT) + offs, mask=mask, other=0.0).to(tl.float32)
        g = g + f32(row, _WD) * p
    if (mode & 2) != 0:
        g = -g
    m = tl.load(fptr(row, _M) + offs, mask=mask, other=0.0)
    v = tl.load(fptr(row, _V) + offs, mask=mask, other=0.0)
    m = m * f32(row, _B1) + f32(row, _C1) * g
    v = v * f32(row, _B2) + f32(row, _C2) * (g * g)
    den = tl.math.sqrt_rn(v) * f32(row, _IB2) + f32(row, _EPS)
    x = tl.math.div_rn(m, den) * f32(row, _IB1) * f32(row, _LR)
    tl.store(fptr(row, _MO) + offs, m, mask=mask)
    tl.store(fptr(row, _VO) + offs, v, mask=mask)
    tl.store(fptr(row, _X) + offs, x, mask=mask)


def own_step(tab, blk, grad_scale, gdt, *, block):
    """One launch over ``blk.numel()`` programs (``blk``: the row of every program)."""
    has_scale = grad_scale is not None
    _own_step_kernel[(blk.numel(),)](
        tab, blk, grad_scale.reshape(1) if has_scale else tab, W=W, HAS_SCALE=has_scale,
        GDT=gdt, BLOCK=block, num_warps=8, enable_fp_fusion=False)
