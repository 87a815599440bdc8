"""DENSE segments of a whole bucket in one launch: the layers that go dense by policy
(every compressor), and QSGD's quantised layers. The layers are *segments* described
by one int64 table ``tab[L, W]`` (one host-to-device copy per bucket and step, as in
``kernels/bucket_topk.py``): tensor addresses (gradient, residual, non-finite counter),
host integers (size, output offsets, the first program), the per-layer Philox seed.
A cached int32 ``blk[nprograms]`` maps each program to its segment.

Policy-dense (``dense_copy``, one launch; ``Compressor._policy_dense`` bit for bit)::

    d     = fp32(grad) * s                     (s: AMP's inverse loss scale, or none)
    fin   = |d| < inf;   nonfinite_j += #not fin
    out   = fin ? d : +0.0                     (-0.0 stays -0.0)
    out   = out + r                            (MODE_RES: a pending residual, flushed)
    out[OUT_j + i] = out;   count[j] = n_j

Whole (``whole_cast``, one launch; ``Compressor._whole`` bit for bit: a layer sent
every element in fp32 / fp16 / bf16 with error feedback): the accumulator as QSGD's
below, then ``out[OUT_j + i] = cast(acc)`` (``kernels/select.py``'s
``store_float_values``: saturated, round to nearest even) and with ``MODE_EF`` the
residual ``acc - fp32(cast(acc))`` (0 for fp32); ``count[j] = n_j``.

QSGD (``qsgd_pack``, one launch; ``QSGD._compress`` = residual add + ``quantize_pack``
+ ``dequantize_unpack`` + ``acc -= deq``, bit for bit). The accumulator of element i::

    MODE_EF, raw gradient      acc = fin ? r + d : r      (ops.residual_add's rule)
    MODE_EF | MODE_PRE         acc = r + (fin ? d : +0.0) (a gradient cleaned before, by
                                                           the local update)
    no error feedback          acc = fin ? (d == 0 ? +0.0 : d) : +0.0   (= 0.0 + d: the
                                                           zeroed scratch accumulator)

then ``kernels/quantize.py``'s quantiser with the layer's own seed and element counter
(``m_b`` = max of the bit patterns of ``|acc|`` over quantisation bucket ``b``,
``r = div_rn(|acc| * S, m_b)``, ``q = min(S, floor(r) + (u < r - floor(r)))``,
``u = tl.rand(seed_j, i)`` with the int64 in-layer index ``i``), codes packed at the
layer's byte offset, scales at its scale offset, ``count[j] = n_j``; with error
feedback the residual becomes ``acc - div_rn(q * m_b, S)`` (the decoder's value).
Program ``p`` owns ``ROWS`` whole quantisation buckets of one segment (``ROWS *
bucket_size * bits`` a multiple of 8: no output byte straddles two programs); phase A
writes the scales, a CTA barrier, phase B recomputes ``acc`` (the same bits: the
residual is only written in phase B, each element by the program that read it),
quantises, packs and writes the residual. Layout never changes a result: every scale
is its own bucket's max, every random number its element's.

Every product and sum is its own fp32 rounding (``enable_fp_fusion=False``). Atomics:
one relaxed add per program that saw a non-finite element. Offsets are int64. No host
synchronisation.
"""
import torch
import triton
import triton.language as tl

from .quantize import stochastic_level
from .select import store_float_values
from .table import add_nonfinite, fptr, gptr, program_row, scaled

# columns of the segment table (int64)
C_G, C_R, C_N, C_NF, C_MODE, C_OUT, C_SOFF, C_BLK0, C_SEED = range(9)
W = 9
MODE_RES, MODE_EF, MODE_PRE = 1, 2, 4
GDT_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_G = tl.constexpr(C_G)
_R = tl.constexpr(C_R)
_N = tl.constexpr(C_N)
_NF = tl.constexpr(C_NF)
_MODE = tl.constexpr(C_MODE)
_OUT = tl.constexpr(C_OUT)
_SOFF = tl.constexpr(C_SOFF)
_BLK0 = tl.constexpr(C_BLK0)
_SEED = tl.constexpr(C_SEED)


@triton.jit
def _dense_copy_kernel(tab_ptr, blk_ptr, scale_ptr, out_ptr, cnt_ptr, W: tl.constexpr,
                       HAS_SCALE: tl.constexpr, GDT: tl.constexpr, BLOCK: tl.constexpr):
    j, row, n, lb = program_row(tab_ptr, blk_ptr, W, _N, _BLK0)
    offs = lb * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    d, fin = scaled(gptr(row, _G, GDT), offs, mask, scale_ptr, HAS_SCALE)
    v = tl.where(fin, d, 0.0)
    if (tl.load(row + _MODE) & 1) != 0:
        rp = fptr(row, _R)
        v = v + tl.load(rp + offs, mask=mask, other=0.0)
    tl.store(out_ptr + tl.load(row + _OUT) + offs, v, mask=mask)
    nbad = tl.sum(((~fin) & mask).to(tl.int32), axis=0)
    add_nonfinite(row, _NF, nbad)
    if lb == 0:
        tl.store(cnt_ptr + j, n.to(tl.int32))


@triton.jit
def _qsgd_acc(row, gp, offs, mask, scale_ptr, mode, HAS_SCALE: tl.constexpr):
    """(acc, non-finite mask) of the elements ``offs`` (module doc)."""
    d, fin = scaled(gp, offs, mask, scale_ptr, HAS_SCALE)
    if (mode & 2) != 0:
        rp = fptr(row, _R)
        r = tl.load(rp + offs, mask=mask, other=0.0)
        if (mode & 4) != 0:
            a = r + tl.where(fin, d, 0.0)
        else:
            a = tl.where(fin, r + d, r)
    else:
        a = tl.where(fin & (d != 0.0), d, 0.0)
    return a, (~fin) & mask


@triton.jit
def _qsgd_pack_kernel(tab_ptr, blk_ptr, scale_ptr, codes_ptr, scales_ptr, cnt_ptr, B,
                 W: tl.constexpr, HAS_SCALE: tl.constexpr, GDT: tl.constexpr,
                 BITS: tl.constexpr, ROWS: tl.constexpr, BPAD: tl.constexpr,
                 NBYTES: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    HALF: tl.constexpr = 1 << (BITS - 1)
    S: tl.constexpr = HALF - 1
    CH: tl.constexpr = NBYTES * PER
    j, row, n, lb = program_row(tab_ptr, blk_ptr, W, _N, _BLK0)
    mode = tl.load(row + _MODE)
    gp = gptr(row, _G, GDT)
    seed = tl.load(row + _SEED)
    sp = scales_ptr + tl.load(row + _SOFF)
    nbuckets = (n + B - 1) // B
    # phase A: the scales of this program's buckets (integer max of |acc|'s bits)
    rows = lb * ROWS + tl.arange(0, ROWS)
    row_ok = rows < nbuckets
    rstart = rows * B
    cols = tl.arange(0, BPAD)
    m = tl.zeros([ROWS], dtype=tl.int32)
    bad = tl.zeros([ROWS], dtype=tl.int32)
    for c0 in range(0, B, BPAD):
        col = c0 + cols
        offs = rstart[:, None] + col[None, :]
        mask = row_ok[:, None] & (col[None, :] < B) & (offs < n)
        x, nb = _qsgd_acc(row, gp, offs, mask, scale_ptr, mode, HAS_SCALE)
        bits = tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        m = tl.maximum(m, tl.max(bits, axis=1))
        bad += tl.sum(nb.to(tl.int32), axis=1)
    m = tl.where(m > 0x7F800000, 0x7FC00000, m)
    tl.store(sp + rows, m.to(tl.float32, bitcast=True), mask=row_ok)
    nbad = tl.sum(bad, axis=0)
    add_nonfinite(row, _NF, nbad)
    if lb == 0:
        tl.store(cnt_ptr + j, n.to(tl.int32))
    tl.debug_barrier()
    # phase B: quantise + pack byte-major, CH elements at a time; the residual update
    cp = codes_ptr + tl.load(row + _OUT)
    e0 = lb * ROWS * B
    e_end = tl.minimum(e0 + ROWS * B, n)
    byte_i = tl.arange(0, NBYTES)
    k = tl.arange(0, PER)
    for c in range(0, ROWS * B, CH):
        e = e0 + c + byte_i[:, None] * PER + k[None, :]
        emask = e < e_end
        x, nb = _qsgd_acc(row, gp, e, emask, scale_ptr, mode, HAS_SCALE)
        sc = tl.load(sp + e // B, mask=emask, other=0.0)
        q = stochastic_level(x, sc, seed, e, S)
        code = (q.to(tl.int32) + HALF) & ((1 << BITS) - 1)
        packed = tl.sum(tl.where(emask, code, 0) << (k[None, :] * BITS), axis=1)
        first = e0 + c + byte_i * PER
        tl.store(cp + first * BITS // 8, packed.to(tl.uint8), mask=first < e_end)
        if (mode & 2) != 0:
            # the decoder's value: div_rn((code - HALF) * m_b, S)
            qd = (code - HALF).to(tl.float32)
            deq = tl.math.div_rn(qd * sc, tl.full(qd.shape, S, tl.float32))
            rp = fptr(row, _R)
            tl.store(rp + e, x - deq, mask=emask)


@triton.jit
def _whole_cast_kernel(tab_ptr, blk_ptr, scale_ptr, out_ptr, cnt_ptr, W: tl.constexpr,
                       HAS_SCALE: tl.constexpr, GDT: tl.constexpr, VE: tl.constexpr,
                       BLOCK: tl.constexpr):
    j, row, n, lb = program_row(tab_ptr, blk_ptr, W, _N, _BLK0)
    offs = lb * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < n
    mode = tl.load(row + _MODE)
    a, bad = _qsgd_acc(row, gptr(row, _G, GDT), offs, mask, scale_ptr, mode, HAS_SCALE)
    newr = store_float_values(a, out_ptr + tl.load(row + _OUT), offs, mask, VE)
    if (mode & 2) != 0:
        tl.store(fptr(row, _R) + offs, newr, mask=mask)
    add_nonfinite(row, _NF, tl.sum(bad.to(tl.int32), axis=0))
    if lb == 0:
        tl.store(cnt_ptr + j, n.to(tl.int32))


def whole_cast(tab, blk, grad_scale, out, cnt, gdt, ve, *, block):
    """Whole segments: ``out`` in the wire dtype of value code ``ve`` (0 fp32, 1 fp16,
    2 bf16), ``cnt`` int32[L] (module doc)."""
    has_scale = grad_scale is not None
    _whole_cast_kernel[(blk.numel(),)](
        tab, blk, grad_scale.reshape(1) if has_scale else cnt, out, cnt, W=W,
        HAS_SCALE=has_scale, GDT=gdt, VE=ve, BLOCK=block, num_warps=8,
        enable_fp_fusion=False)


def dense_copy(tab, blk, grad_scale, out, cnt, gdt, *, block):
    """Policy-dense segments: ``out`` fp32[sum n_j], ``cnt`` int32[L] (module doc)."""
    has_scale = grad_scale is not None
    _dense_copy_kernel[(blk.numel(),)](
        tab, blk, grad_scale.reshape(1) if has_scale else out, out, cnt, W=W,
        HAS_SCALE=has_scale, GDT=gdt, BLOCK=block, num_warps=8, enable_fp_fusion=False)


def qsgd_rows(bucket_size, bits, *, block=2048):
    """Quantisation buckets per program: a power of 2, ``rows * bucket_size * bits`` a
    multiple of 8 (the driver lays out ``blk`` with it)."""
    B = int(bucket_size)
    r = 8 // _gcd(B * int(bits), 8)
    return max(triton.next_power_of_2(max(1, block // B)), r)


def _gcd(a, b):
    while b:
        a, b = b, a % b
    return a


def qsgd_pack(tab, blk, grad_scale, codes, scales, cnt, gdt, bits, bucket_size, rows, *,
              max_bucket_tile=4096, max_phase_b=1024):
    """QSGD segments: ``codes`` uint8 (segment j at byte ``tab[j, OUT]``), ``scales``
    fp32 (segment j at ``tab[j, SOFF]``), ``cnt`` int32[L] (module doc)."""
    B = int(bucket_size)
    bits = int(bits)
    per = 8 // bits
    bpad = min(triton.next_power_of_2(B), max_bucket_tile)
    nbytes = min(triton.next_power_of_2(-(-rows * B // per)), max(1, max_phase_b // per))
    has_scale = grad_scale is not None
    _qsgd_pack_kernel[(blk.numel(),)](
        tab, blk, grad_scale.reshape(1) if has_scale else scales, codes, scales, cnt, B,
        W=W, HAS_SCALE=has_scale, GDT=gdt, BITS=bits, ROWS=rows, BPAD=bpad,
        NBYTES=nbytes, num_warps=8, enable_fp_fusion=False)
