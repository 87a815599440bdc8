"""Phase 2 of the ``split`` exchange decoded in one launch: every owner's range message
of a bucket written into the flat sum (``hvdsparse/exchange/split.py``).

The gathered bytes hold P range messages back to back, each starting at a multiple of 4
bytes: a header ``int32[mode, K, pairs, e]`` then

* sparse: ``K`` int32 range-relative indices, then ``K`` values (fp32, bf16, or fp16
  times ``2^-e``);
* dense: ``n`` fp32 values (the range in full).

Row ``r`` of the int64 table ``tab[R, W]`` (the host knows every message's length, so
its mode, ``K`` and offsets) describes one message: ``C_IDX`` the int32 word where its
indices start, ``C_VAL`` the element (of the value dtype's view; of the fp32 view for a
dense range) where its values start, ``C_K`` its element count (``n`` for a dense
range), ``C_LO`` / ``C_N`` the range's first flat index and length, ``C_DENSE`` 1 for a
dense range, ``C_HDR`` the int32 word of its header. Program ``(b, r)`` handles elements
``[b*BLOCK, (b+1)*BLOCK)`` of row ``r``:

    out[lo + i] = v                 (dense: i = the element's position)
    out[lo + i] = fp32(v) * 2^e     (sparse fp16, e = clamp(header e, 0, MAX_SHIFT))
    out[lo + i] = fp32(v)           (sparse fp32 / bf16)

``2^e`` is built from its exponent bits (exact), and the product is the one rounding of
``torch.ldexp`` (the per-range decode's). An index outside ``[0, n)`` writes nothing
and ORs ``ERR_INDEX`` into ``flag[0]`` (relaxed atomic). Ranges are disjoint and a valid
range's indices unique, so no two programs write one element: the result does not depend
on the order programs run in. Integer widths: table cells, offsets and flat indices are
int64. Grid ``(cdiv(max K, BLOCK), R)``: R (<= P) on axis y. No host synchronisation.
"""
import triton
import triton.language as tl

#: the table's columns
C_IDX, C_VAL, C_K, C_LO, C_N, C_DENSE, C_HDR = range(7)
WIDTH = 7
BLOCK = 1024
#: an out-of-range index (``hvdsparse.codec_format.ERR_INDEX``)
ERR_INDEX = 1
_ERR_INDEX = tl.constexpr(ERR_INDEX)
_IDX, _VAL, _K, _LO, _N, _DENSE, _HDR = (
    tl.constexpr(c) for c in (C_IDX, C_VAL, C_K, C_LO, C_N, C_DENSE, C_HDR))


@triton.jit
def _split_ranges_kernel(w32_ptr, f32_ptr, v_ptr, tab_ptr, out_ptr, flag_ptr, max_shift,
                         W: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(1).to(tl.int64)
    b = tl.program_id(0).to(tl.int64)
    row = tab_ptr + r * W
    at_idx = tl.load(row + _IDX)
    at_val = tl.load(row + _VAL)
    k = tl.load(row + _K)
    lo = tl.load(row + _LO)
    n = tl.load(row + _N)
    dense = tl.load(row + _DENSE) != 0
    offs = b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    live = offs < k
    sparse_live = live & (dense == 0)
    idx = tl.load(w32_ptr + at_idx + offs, mask=sparse_live, other=0).to(tl.int64)
    idx = tl.where(dense, offs, idx)
    v = tl.load(v_ptr + at_val + offs, mask=sparse_live, other=0).to(tl.float32)
    if SHIFT:
        e = tl.load(w32_ptr + tl.load(row + _HDR) + 3)
        e = tl.minimum(tl.maximum(e, 0), max_shift)
        scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
        v = v * scale
    v = tl.where(dense, tl.load(f32_ptr + at_val + offs, mask=live & dense, other=0.0), v)
    bad = live & ((idx < 0) | (idx >= n))
    tl.store(out_ptr + lo + idx, v, mask=live & (bad == 0))
    nbad = tl.sum(bad.to(tl.int32), axis=0)
    tl.atomic_or(flag_ptr, _ERR_INDEX, mask=nbad > 0, sem="relaxed")


def decode_ranges(w32, f32, vals, table, rows: int, max_k: int, out, flag, shift: bool,
                  max_shift: int):
    """Write the ``rows`` messages of ``table`` into ``out`` (see the module doc);
    ``w32`` / ``f32`` / ``vals``: the gathered bytes as int32, fp32 and the pairs' value
    dtype."""
    if rows and max_k:
        _split_ranges_kernel[(triton.cdiv(max_k, BLOCK), rows)](
            w32, f32, vals, table, out, flag, max_shift, W=WIDTH, SHIFT=shift, BLOCK=BLOCK,
            num_warps=4)
    return out
