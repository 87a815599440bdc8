"""Triton kernel for DCT-MP's row-wise threshold (``hvdsparse.mp``).

One program per row of a contiguous ``B x d`` activation. The whole row lives in
registers (``BLOCK_D = next_pow2(d)``, up to :data:`MAX_D` columns), so selection and
compaction happen in a single launch with no host synchronisation:

1. ``a_j = |x_j|`` in fp32, reinterpreted as int32 bits ``b_j``. For non-negative
   floats the bit pattern is monotone in the value (NaN, 0x7FC00000, sorts above
   +inf), so order statistics of ``a`` equal those of ``b``.
2. The k-th largest bit pattern ``t`` is built bit by bit from bit 30 down to bit 0
   (31 row reductions): ``t <- t | 2^p`` whenever ``#{j : b_j >= t | 2^p} >= k``.
   The result is the largest ``t`` with at least ``k`` elements ``>= t``, i.e. exactly
   the k-th largest ``|x|``.
3. Tie rule (exactly ``k`` kept): every element with ``b_j > t`` is kept
   (``n_gt < k`` of them); of the elements with ``b_j == t`` the ``k - n_gt`` with the
   lowest column index are kept (inclusive prefix sum over the tie indicator).
4. Compaction: slot ``pos_j = cumsum(keep)_j - 1`` (ascending column order) receives
   ``cols[row, pos_j] = j`` (int32) and ``vals[row, pos_j] = x_j`` cast to the output
   dtype (fp32 / fp16 / bf16); ``mask[row, j] = keep_j`` (uint8 0/1).

This module imports nothing of hvdsparse (design rule: kernels/ are leaves).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: widest row the register-resident kernel handles; wider rows use mp.row_threshold_reference
MAX_D = 8192


@triton.jit
def _row_threshold_kernel(x_ptr, cols_ptr, vals_ptr, mask_ptr, d, k,
                          BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D).to(tl.int64)   # int64 offsets throughout
    inb = offs < d
    x = tl.load(x_ptr + row * d + offs, mask=inb, other=0.0)
    a = tl.abs(x.to(tl.float32))
    bits = a.to(tl.int32, bitcast=True)
    bits = tl.where(inb, bits, -1)          # padding lanes are never selected
    t = tl.zeros((), dtype=tl.int32)
    for i in range(31):
        cand = t | (1 << (30 - i))
        cnt = tl.sum((bits >= cand).to(tl.int32), axis=0)
        t = tl.where(cnt >= k, cand, t)
    gt = bits > t
    n_gt = tl.sum(gt.to(tl.int32), axis=0)
    eq = (bits == t).to(tl.int32)
    eq_rank = tl.cumsum(eq, axis=0)          # inclusive rank among ties, by column
    keep = gt | ((eq > 0) & (eq_rank <= k - n_gt))
    keep_i = keep.to(tl.int32)
    pos = tl.cumsum(keep_i, axis=0) - 1
    out = row * k + pos
    tl.store(cols_ptr + out, offs.to(tl.int32), mask=keep)
    tl.store(vals_ptr + out, x.to(vals_ptr.dtype.element_ty), mask=keep)
    tl.store(mask_ptr + row * d + offs, keep_i.to(tl.uint8), mask=inb)


def row_threshold(x: torch.Tensor, k: int, cols: torch.Tensor, vals: torch.Tensor,
                  mask: torch.Tensor) -> None:
    """Launch the row-threshold kernel.

    ``x``: contiguous [B, d] fp32/fp16/bf16; ``k``: 1 <= k <= d kept per row;
    outputs (pre-allocated, contiguous): ``cols`` int32[B, k], ``vals`` [B, k] of the
    wire value dtype, ``mask`` uint8[B, d]. ``d`` must be <= :data:`MAX_D`.
    """
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 2-D tensor, got shape {tuple(x.shape)}")
    B, d = x.shape
    if not 1 <= k <= d:
        raise ValueError(f"k must be in [1, d={d}], got {k}")
    if d > MAX_D:
        raise ValueError(f"row width d={d} exceeds MAX_D={MAX_D}")
    if B == 0:
        return
    block = triton.next_power_of_2(d)
    num_warps = max(1, min(16, block // 256))
    _row_threshold_kernel[(B,)](x, cols, vals, mask, d, k, BLOCK_D=block,
                                num_warps=num_warps)
