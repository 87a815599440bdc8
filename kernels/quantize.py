"""Stochastic quantisation with bit packing, its inverse, sign unpacking and the Philox
uniform stream (operation 3 of docs/design.md).

RNG: ``u = tl.rand(seed, e)`` with the int64 element index ``e`` as counter (Philox
4x32-10, Triton's own implementation); ``hvdsparse.reference.philox_uniform`` is
bit-identical.

Quantiser math (bit-identical to the reference in the interpreter): ``s = 2**(bits-1)-1``,
``scale = max |v|`` per bucket, ``r = (|v| * s) / scale`` (correctly rounded division,
``tl.math.div_rn``), ``q = min(s, floor(r) + (u < r - floor(r)))`` with the sign of v:
``E[q] = r``, unbiased; ``r - floor(r)`` is exact and there is no multiply feeding an add,
so FMA contraction cannot change the result on a GPU either.

Launch layout of :func:`quantize_pack`: program ``p`` owns ``ROWS`` whole buckets, with
``ROWS`` a power of 2 such that ``ROWS * bucket_size * bits`` is a multiple of 8, so no
output byte straddles two programs. Phase A loads the buckets as a ``[ROWS, BPAD]`` tile
and writes their scales; after a CTA barrier, phase B walks the same elements byte-major
(``[bytes, 8 // bits]`` tile; these loads hit the cache), reads back the scales it just
wrote, quantises and packs each output byte in registers. Buckets wider than
``max_bucket_tile`` are reduced in a loop in phase A.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _quantize_pack_kernel(v_ptr, count_ptr, codes_ptr, scales_ptr, n, nbuckets, B, seed,
                          HAS_COUNT: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr,
                          BPAD: tl.constexpr, NBYTES: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    HALF: tl.constexpr = 1 << (BITS - 1)
    S: tl.constexpr = HALF - 1
    pid = tl.program_id(0)
    nv = n
    if HAS_COUNT:
        nv = tl.minimum(tl.maximum(tl.load(count_ptr), 0), n).to(tl.int64)
    # phase A: per-bucket max |v|
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < nbuckets
    rstart = rows.to(tl.int64) * B
    cols = tl.arange(0, BPAD)
    m = tl.zeros([ROWS], dtype=tl.float32)
    for c0 in range(0, B, BPAD):
        col = c0 + cols
        offs = rstart[:, None] + col[None, :]
        mask = row_ok[:, None] & (col[None, :] < B) & (offs < nv)
        x = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.maximum(m, tl.max(tl.abs(x), axis=1))
    tl.store(scales_ptr + rows, m, mask=row_ok)
    tl.debug_barrier()
    # phase B: quantise + pack, byte-major
    e0 = pid.to(tl.int64) * ROWS * B
    e_end = tl.minimum(e0 + ROWS * B, n)
    byte_i = tl.arange(0, NBYTES)
    k = tl.arange(0, PER)
    e = e0 + byte_i[:, None] * PER + k[None, :]
    emask = e < e_end
    x = tl.load(v_ptr + e, mask=emask & (e < nv), other=0.0).to(tl.float32)
    sc = tl.load(scales_ptr + e // B, mask=emask, other=0.0)
    ax = tl.abs(x)
    r = tl.math.div_rn(ax * S, tl.where(sc > 0, sc, 1.0))
    r = tl.where(sc > 0, r, 0.0)
    fl = tl.floor(r)
    u = tl.rand(seed, e)
    q = fl + tl.where(u < (r - fl), 1.0, 0.0)
    q = tl.minimum(q, S)
    q = tl.where(x < 0, -q, q)
    code = tl.where(emask, (q.to(tl.int32) + HALF) & ((1 << BITS) - 1), 0)  # pad bits: 0
    packed = tl.sum(code << (k[None, :] * BITS), axis=1)
    b_glob = e0 * BITS // 8 + byte_i
    nbytes_total = (n * BITS + 7) // 8
    bmask = (b_glob < nbytes_total) & ((e0 + byte_i * PER) < e_end)
    tl.store(codes_ptr + b_glob, packed.to(tl.uint8), mask=bmask)


def _rows_for(B, bits, block):
    r = 8 // _gcd(B * bits, 8)  # buckets per program must be a multiple of r
    rows = triton.next_power_of_2(max(1, block // B))
    return max(rows, r)


def _gcd(a, b):
    while b:
        a, b = b, a % b
    return a


def quantize_pack(values, bits, bucket_size, seed, count=None, *, block=2048,
                  max_bucket_tile=4096):
    """Triton version of ``hvdsparse.reference.quantize_pack``; ``count`` is None or an
    int32 device tensor (``count[0]`` used). Returns ``(codes uint8[ceil(n*bits/8)],
    scales fp32[ceil(n / bucket_size)])``."""
    n = values.numel()
    B = int(bucket_size)
    bits = int(bits)
    nb = -(-n // B)
    codes = torch.empty(-(-n * bits // 8), dtype=torch.uint8, device=values.device)
    scales = torch.empty(nb, dtype=torch.float32, device=values.device)
    if n == 0:
        return codes, scales
    rows = min(_rows_for(B, bits, block), max(triton.next_power_of_2(nb), 8 // _gcd(B * bits, 8)))
    bpad = min(triton.next_power_of_2(B), max_bucket_tile)
    per = 8 // bits
    nbytes = triton.next_power_of_2(-(-rows * B // per))
    grid = (triton.cdiv(nb, rows),)
    _quantize_pack_kernel[grid](values, count if count is not None else scales, codes, scales,
                                n, nb, B, int(seed), HAS_COUNT=count is not None, BITS=bits,
                                ROWS=rows, BPAD=bpad, NBYTES=nbytes)
    return codes, scales


@triton.jit
def _unpack_kernel(src_ptr, scales_ptr, out_ptr, n, B, BITS: tl.constexpr,
                   SIGN: tl.constexpr, NBYTES: tl.constexpr):
    """SIGN: out = +-scales[0] from bits (BITS == 1); else dequantised BITS-bit codes."""
    PER: tl.constexpr = 8 // BITS
    pid = tl.program_id(0)
    byte_i = pid.to(tl.int64) * NBYTES + tl.arange(0, NBYTES)
    k = tl.arange(0, PER)
    e = byte_i[:, None] * PER + k[None, :]
    emask = e < n
    byt = tl.load(src_ptr + byte_i, mask=byte_i * PER < n, other=0).to(tl.int32)
    c = (byt[:, None] >> (k[None, :] * BITS)) & ((1 << BITS) - 1)
    if SIGN:
        sc = tl.load(scales_ptr)
        v = tl.where(c != 0, -sc, sc)
    else:
        S: tl.constexpr = (1 << (BITS - 1)) - 1
        q = (c - (1 << (BITS - 1))).to(tl.float32)
        sc = tl.load(scales_ptr + e // B, mask=emask, other=0.0)
        v = tl.math.div_rn(q * sc, tl.full(q.shape, S, tl.float32))
    tl.store(out_ptr + e, v, mask=emask)


def dequantize_unpack(codes, scales, bits, bucket_size, n, *, block=4096):
    """Triton version of ``hvdsparse.reference.dequantize_unpack``: fp32[n]."""
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    if n == 0:
        return out
    per = 8 // int(bits)
    nbytes = triton.next_power_of_2(max(1, block // per))
    grid = (triton.cdiv(-(-n // per), nbytes),)
    _unpack_kernel[grid](codes, scales, out, n, int(bucket_size), BITS=int(bits), SIGN=False,
                         NBYTES=nbytes)
    return out


def sign_unpack(bits_u8, scale, n, *, block=4096):
    """Triton version of ``hvdsparse.reference.sign_unpack`` (``scale`` an fp32 tensor)."""
    out = torch.empty(n, dtype=torch.float32, device=bits_u8.device)
    if n == 0:
        return out
    nbytes = triton.next_power_of_2(max(1, block // 8))
    grid = (triton.cdiv(-(-n // 8), nbytes),)
    _unpack_kernel[grid](bits_u8, scale.reshape(1), out, n, 1, BITS=1, SIGN=True,
                         NBYTES=nbytes)
    return out


@triton.jit
def _philox_uniform_kernel(out_ptr, n, offset, seed, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.rand(seed, i + offset), mask=i < n)


def philox_uniform(seed, n, offset=0, device=None, *, block=4096):
    """fp32[n]: element i = ``tl.rand(seed, offset + i)`` (int64 counter)."""
    out = torch.empty(n, dtype=torch.float32, device=device)
    if n:
        _philox_uniform_kernel[(triton.cdiv(n, block),)](out, n, int(offset), int(seed),
                                                          BLOCK=block)
    return out
