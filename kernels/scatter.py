"""Bounds-checked, deterministic scatter-add decode of a batch of payloads (operation 4
of docs/design.md).

One launch per row ``p = 0, 1, ..., P-1``, issued in that order on the current stream,
grid ``(cdiv(cap, BLOCK),)``: program ``b`` handles slots ``[b*BLOCK, (b+1)*BLOCK)`` of
row ``p``; slot ``j < count[p, 0]`` adds its decoded value (fp32/fp16/bf16 value; or
``fp32(fp32(q * scale[j // bucket]) / s)`` from the packed ``bits``-wide code; or
``+-sign_scale[p]`` from the sign bit) into ``dense[indices[p, j]]`` with a relaxed
``tl.atomic_add`` (no fence: nothing else is published through these writes).
Decoding happens in registers: no dense temporary per row.

Determinism: stream order makes row ``p``'s additions land after row ``p-1``'s, so every
element of ``dense`` receives its addends in rank order, on every rank and every run,
bit for bit. Inside one valid row the indices are unique, so its atomics never contend
and their order does not matter; only a malformed row with repeated indices sums those
repeats in an unspecified order.

Errors never write out of bounds: an index ``< 0`` or ``>= dense.numel()`` is skipped
and ORs 1 into ``error_flag[0]``; a count outside ``[0, cap]`` is clamped and ORs 2
(relaxed atomics). The caller reads the flag where it synchronises anyway.

Integer widths: slot offsets, ``j * BITS`` and row offsets are int64; grid axis x
(``< 2**31`` programs) is the only one used.
"""
import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["p"])
def _scatter_row_kernel(dense_ptr, idx_ptr, cnt_ptr, src_ptr, scales_ptr, flag_ptr,
                        N, cap, B, p, s_idx, s_cnt, s_src, s_sc,
                        MODE: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    row = p.to(tl.int64)
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    c = tl.load(cnt_ptr + row * s_cnt).to(tl.int64)
    bad_c = (c < 0) | (c > cap)
    tl.atomic_or(flag_ptr, 2, mask=bad_c & (pid == 0), sem="relaxed")
    c = tl.minimum(tl.maximum(c, 0), cap)
    m = j < c
    idx = tl.load(idx_ptr + row * s_idx + j, mask=m, other=0).to(tl.int64)
    ok = (idx >= 0) & (idx < N)
    nbad = tl.sum((m & ~ok).to(tl.int32), axis=0)
    tl.atomic_or(flag_ptr, 1, mask=nbad > 0, sem="relaxed")
    w = m & ok
    if MODE == 0:  # float values
        v = tl.load(src_ptr + row * s_src + j, mask=w, other=0.0).to(tl.float32)
    elif MODE == 1:  # packed BITS-wide codes + per-bucket scales
        S: tl.constexpr = (1 << (BITS - 1)) - 1
        jb = j * BITS
        byt = tl.load(src_ptr + row * s_src + (jb >> 3), mask=w, other=0).to(tl.int32)
        code = (byt >> (jb & 7).to(tl.int32)) & ((1 << BITS) - 1)
        q = (code - (1 << (BITS - 1))).to(tl.float32)
        sc = tl.load(scales_ptr + row * s_sc + j // B, mask=w, other=0.0)
        v = tl.math.div_rn(q * sc, tl.full([BLOCK], S, tl.float32))
    else:  # sign bits, one scale per row
        byt = tl.load(src_ptr + row * s_src + (j >> 3), mask=w, other=0).to(tl.int32)
        sc = tl.load(scales_ptr + row * s_sc)
        v = tl.where(((byt >> (j & 7).to(tl.int32)) & 1) != 0, -sc, sc)
    tl.atomic_add(dense_ptr + idx, v, mask=w, sem="relaxed")


def _rows(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def scatter_add_decode(dense, indices, count, values=None, *, codes=None, scales=None,
                       bits=0, bucket_size=512, signs=None, sign_scale=None,
                       error_flag=None, block=1024):
    """Triton version of ``hvdsparse.cpu.scatter_add_decode`` for 2-D inputs
    (``indices`` [P, cap], ``count`` [P, >=1], ``values``/``codes``/``scales``/``signs``
    [P, ...], ``sign_scale`` fp32[P]); ``error_flag`` int32[>=1] device tensor, required.
    Rows are added in order 0..P-1 (one launch each; see module doc). Returns
    error_flag."""
    P, cap = indices.shape
    if P == 0 or cap == 0:
        return error_flag
    indices = _rows(indices)
    if values is not None:
        mode, src, sc, bits = 0, _rows(values), dense, 1
        s_sc = 0
    elif codes is not None:
        mode, src, sc = 1, _rows(codes), _rows(scales)
        s_sc = sc.stride(0)
    else:
        mode, src, sc, bits = 2, _rows(signs), sign_scale.reshape(-1).contiguous(), 1
        s_sc = sc.stride(0)
    block = min(block, triton.next_power_of_2(cap))
    grid = (triton.cdiv(cap, block),)
    for p in range(P):
        _scatter_row_kernel[grid](
            dense, indices, count, src, sc, error_flag, dense.numel(), cap,
            int(bucket_size), p, indices.stride(0), count.stride(0), src.stride(0), s_sc,
            MODE=mode, BITS=int(bits), BLOCK=block)
    return error_flag
