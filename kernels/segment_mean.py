"""Means of segments of an fp32 vector in one launch (AdaComp's per-layer scale: the
mean of a layer's bin maxima, for every layer of a bucket at once).

``out[j] = fp32(S_j) / len_j`` (division correctly rounded), ``(start_j, len_j)`` read
from an int64 table ``tab[j, C_START]``, ``tab[j, C_LEN]`` (row width ``W``), where
``S_j`` sums ``x[start_j : start_j + len_j]`` in a fixed order: lane ``i`` of a
``BLOCK``-wide fp32 accumulator adds ``x[start_j + b * BLOCK + i]`` for ``b = 0, 1,
...`` in turn, then one ``tl.sum`` over the lanes. One program per segment and no
atomics: a segment's result depends on its own elements only, so it has the same bits
computed alone (the per-layer path) or among others (the bucket path). It is not
``torch.mean``'s reduction order (the CPU path keeps that). A NaN or Inf in a segment
propagates as in any sum. No host synchronisation.
"""
import triton
import triton.language as tl

#: lanes of the accumulator (fixed: part of the result's definition)
BLOCK = 1024


@triton.jit
def _segment_mean_kernel(x_ptr, tab_ptr, out_ptr, W: tl.constexpr, C_START: tl.constexpr,
                         C_LEN: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    start = tl.load(tab_ptr + j * W + C_START)
    length = tl.load(tab_ptr + j * W + C_LEN)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for b in range(0, tl.cdiv(length, BLOCK)):
        offs = b * BLOCK + lanes
        acc += tl.load(x_ptr + start + offs, mask=offs < length, other=0.0)
    tl.store(out_ptr + j, tl.math.div_rn(tl.sum(acc, axis=0), length.to(tl.float32)))


def segment_means(x, table, width: int, c_start: int, c_len: int, rows: int, out):
    """``out[:rows]`` = the means of ``rows`` segments of ``x`` (see the module doc)."""
    if rows:
        _segment_mean_kernel[(rows,)](x, table, out, W=width, C_START=c_start, C_LEN=c_len,
                                      BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)
    return out
