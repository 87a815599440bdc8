"""Means of segments of an fp32 vector in one launch (AdaComp's per-layer scale: the
mean of a layer's bin maxima, for every layer of a bucket at once).

``out[j] = fp32(S_j) / len_j`` (division correctly rounded), ``(start_j, len_j)`` read
from an int64 table ``tab[j, C_START]``, ``tab[j, C_LEN]`` (row width ``W``), where
``S_j`` sums ``x[start_j : start_j + len_j]`` in one fully defined order, every step a
single fp32 addition:

1. lanes: ``a[i] = (((0 + x[i]) + x[BLOCK + i]) + x[2 BLOCK + i]) + ...`` for ``i <
   BLOCK`` (elements past the segment read as +0);
2. a pairwise tree over adjacent lanes: ``a'[i] = a[2i] + a[2i + 1]``, ``log2(BLOCK)``
   times (a sum of two is one rounding whatever the operand order), ``S = a[0]``.

So the result does not depend on the device, the compiler or the other segments: the
CPU path (``hvdsparse.cpu_residual.segment_mean``) and the oracle compute the same bits.
One program per segment, no atomics. A NaN or Inf in a segment propagates as in any sum.
No host synchronisation.
"""
import triton
import triton.language as tl

#: lanes of the accumulator (part of the result's definition: the CPU path uses it)
BLOCK = 1024
LOG2_BLOCK = BLOCK.bit_length() - 1


@triton.jit
def _segment_mean_kernel(x_ptr, tab_ptr, out_ptr, W: tl.constexpr, C_START: tl.constexpr,
                         C_LEN: tl.constexpr, BLOCK: tl.constexpr, LOG2: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    start = tl.load(tab_ptr + j * W + C_START)
    length = tl.load(tab_ptr + j * W + C_LEN)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for b in range(0, tl.cdiv(length, BLOCK)):
        offs = b * BLOCK + lanes
        acc += tl.load(x_ptr + start + offs, mask=offs < length, other=0.0)
    s = acc
    for lvl in tl.static_range(LOG2):        # a'[i] = a[2i] + a[2i + 1]
        s = tl.sum(tl.reshape(s, (BLOCK >> (lvl + 1), 2)), axis=1)
    total = tl.sum(s, axis=0)                # one element
    tl.store(out_ptr + j, tl.math.div_rn(total, length.to(tl.float32)))


def segment_means(x, table, width: int, c_start: int, c_len: int, rows: int, out):
    """``out[:rows]`` = the means of ``rows`` segments of ``x`` (see the module doc)."""
    if rows:
        _segment_mean_kernel[(rows,)](x, table, out, W=width, C_START=c_start, C_LEN=c_len,
                                      BLOCK=BLOCK, LOG2=LOG2_BLOCK, num_warps=4,
                                      enable_fp_fusion=False)
    return out
