"""The CPU path of decoding received payloads into a dense buffer:
:func:`scatter_add_decode` (a batch of (index, value) rows, values as floats, quantised
codes or sign bits) and :func:`dense_add_decode` (DENSE rows, slot j is element j).

Rows are added in row order, so the fp32 sum at every element is the same on every
rank and every run, and the same bits as ``kernels/scatter.py``; every row is checked
before anything is written. fp32 and sign rows, and quantised DENSE rows, go through
the compiled loops (``native/``) where they are built.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import native
from .cpu_checks import check_bits, check_scatter_args
from .cpu_quantize import dequantize_unpack, unpack_bits
from .philox import check_pos_int


def _check_counts(counts, cap: int) -> None:
    """Every row's count (host ints) in [0, cap], else ValueError naming the first bad
    row; the compiled decodes check all rows before anything is written."""
    for p, c in enumerate(counts):
        if not 0 <= int(c) <= cap:
            raise ValueError(f"count[{p}] = {int(c)} is outside [0, cap={cap}]")


def _native_scatter(dense, ind, rows) -> bool:
    """Whether the compiled decode (``native.scatter_add_f32`` / ``scatter_add_sign``)
    takes these rows (fp32 values or sign bytes)."""
    return ind.dtype == torch.int32 and dense.is_contiguous() and ind.stride(1) == 1 and \
        rows.stride(1) == 1 and dense.device.type == "cpu" and native.available()


def scatter_add_decode(dense: torch.Tensor, indices: torch.Tensor, count: torch.Tensor,
                       values: Optional[torch.Tensor] = None, *,
                       codes: Optional[torch.Tensor] = None,
                       scales: Optional[torch.Tensor] = None, bits: int = 0,
                       bucket_size: int = 512, signs: Optional[torch.Tensor] = None,
                       sign_scale=None, error_flag: Optional[torch.Tensor] = None
                       ) -> Optional[torch.Tensor]:
    """``dense[indices[p, j]] += value(p, j)`` for every row p and ``j < count[p, 0]``.

    Value of slot j: ``values[p, j]`` (float), ``dequantize_unpack(codes[p], scales[p],
    bits, bucket_size)[j]``, or ``+-sign_scale[p]`` from the sign bits. 1-D inputs are a
    batch of one row. Rows are added in row order (row 0 first), each element's addends
    in that order: deterministic, and the same bits as the kernels. Repeated indices
    inside one row (malformed) accumulate. Raises IndexError naming the row, slot
    and index of the first index < 0 or >= dense.numel(), and ValueError for a count
    outside [0, cap]; nothing is written in either case. Returns ``error_flag`` unchanged
    (the CPU path never sets it; errors raise instead).
    """
    ind, P, cap, cnt, vals, cds, scl, bits, B, sgn, ssc = check_scatter_args(
        dense, indices, count, values, codes, scales, bits, bucket_size, signs, sign_scale)
    N = dense.numel()
    counts = cnt[:, 0].tolist()
    fp32_rows = vals is not None and vals.dtype == torch.float32
    if (fp32_rows or sgn is not None) and _native_scatter(dense, ind, vals if fp32_rows
                                                          else sgn):
        # fp32 (index, value) or sign-bit rows: one compiled pass per row (hvdsparse/
        # native/scatter_add.c), the same checks first and the same bits as the
        # torch.where + index_add_ route below
        _check_counts(counts, cap)
        if fp32_rows:
            bad = native.scatter_add_f32(dense, ind, counts, vals)
        else:
            bad = native.scatter_add_sign(dense, ind, counts, sgn, ssc)
        if bad is not None:
            p, j = bad
            raise IndexError(f"scatter_add_decode: index {int(ind[p, j])} at row {p}, slot "
                             f"{j} is out of range for dense of {N} elements")
        return error_flag
    rows_idx, rows_val = [], []
    for p in range(P):
        c = int(counts[p])
        if c < 0 or c > cap:
            raise ValueError(f"count[{p}] = {c} is outside [0, cap={cap}]")
        if c == 0:
            continue
        ix = ind[p, :c].to(torch.int64)
        bad = (ix < 0) | (ix >= N)
        if bool(bad.any()):
            j = int(torch.nonzero(bad)[0, 0])
            raise IndexError(f"scatter_add_decode: index {int(ix[j])} at row {p}, slot {j} is "
                             f"out of range for dense of {N} elements")
        if vals is not None:
            v = vals[p, :c].to(torch.float32)
        elif cds is not None:
            v = dequantize_unpack(cds[p].contiguous(), scl[p].contiguous(), bits, B, cap)[:c]
        else:
            b = unpack_bits(sgn[p, : -(-c // 8)].contiguous(), 1, c)
            v = torch.where(b.bool(), -ssc[p], ssc[p])
        rows_idx.append(ix)
        rows_val.append(v)
    # every row is checked before anything is written; then rows are added one after
    # the other in row (rank) order, like the kernels' stream-ordered launches, so the
    # fp32 sum at every element is the same on every rank and every run
    for ix, v in zip(rows_idx, rows_val):
        dense.index_add_(0, ix, v)
    return error_flag


def dense_add_decode(dense: torch.Tensor, count: torch.Tensor, capacity: int,
                     values: Optional[torch.Tensor] = None, *,
                     codes: Optional[torch.Tensor] = None,
                     scales: Optional[torch.Tensor] = None, bits: int = 0,
                     bucket_size: int = 512) -> None:
    """:func:`scatter_add_decode` of DENSE segments, whose slot j is element j:
    ``dense[j] += value(p, j)`` for every row p (in order) and ``j < count[p, 0]``, with
    fp32 ``values`` [P, >= cap] or quantised ``codes`` [P, >= ceil(cap * bits / 8)] +
    ``scales`` [P, >= ceil(cap / bucket_size)] rows, ``cap = capacity <= dense.numel()``.
    The same bits as :func:`scatter_add_decode` with indices ``arange(cap)``; no index
    array is read. ValueError for a count outside
    [0, cap] (nothing written)."""
    if (values is None) == (codes is None):
        raise ValueError("exactly one of values, codes (+scales, bits) must be given")
    rows = values if values is not None else codes
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise ValueError("values / codes must be [P, ...] rows")
    cnt = count.reshape(rows.shape[0], -1) if isinstance(count, torch.Tensor) else None
    if cnt is None or cnt.shape[1] < 1 or cnt.dtype not in (torch.int32, torch.int64):
        raise ValueError("count must be an int32 tensor [P, >=1]")
    cap = check_pos_int("capacity", capacity, 0)
    if values is not None:
        have = values.shape[1]
    else:
        bits = check_bits(bits)
        bucket_size = check_pos_int("bucket_size", bucket_size)
        have = codes.shape[1] * 8 // bits
        if not isinstance(scales, torch.Tensor) or scales.dim() != 2 or \
                scales.shape[0] != codes.shape[0] or scales.shape[1] < -(-cap // bucket_size):
            raise ValueError(f"scales must be [P={codes.shape[0]}, >= "
                             f"{-(-cap // bucket_size)}] rows")
    if cap > dense.numel() or have < cap:
        raise ValueError(f"dense_add_decode: capacity {cap} with rows of {have} slots and "
                         f"dense of {dense.numel()} elements")
    counts = cnt[:, 0].tolist()
    _check_counts(counts, cap)
    native_ok = dense.device.type == "cpu" and dense.is_contiguous() and \
        dense.dtype == torch.float32 and rows.stride(1) == 1 and native.available()
    if values is not None:
        values = values[:, :cap]
        if native_ok and values.dtype == torch.float32:
            native.dense_add_f32(dense, counts, values)
            return
        for p, c in enumerate(counts):
            dense[:c].add_(values[p, :c].to(torch.float32))
        return
    codes = codes[:, : -(-cap * bits // 8)]
    if native_ok and scales.dim() == 2 and scales.stride(1) == 1 and \
            scales.dtype == torch.float32:
        native.dense_add_dequantize(dense, counts, codes, scales, bits, bucket_size)
        return
    for p, c in enumerate(counts):
        if c:
            dense[:c].add_(dequantize_unpack(codes[p].contiguous(), scales[p].contiguous(),
                                             bits, bucket_size, c))
