"""Stochastic quantisation with bit packing, its inverse, sign unpacking and the Philox
uniform stream (operation 3 of docs/design.md).

RNG: ``u = tl.rand(seed, e)`` with the int64 element index ``e`` as counter (Philox
4x32-10, Triton's own implementation); ``hvdsparse.cpu.philox_uniform`` is
bit-identical.

Quantiser math (bit-identical to hvdsparse.cpu and hvdsparse.oracle): ``s = 2**(bits-1)-1``,
``scale = max |v|`` per bucket, ``r = (|v| * s) / scale`` (correctly rounded division,
``tl.math.div_rn``), ``q = min(s, floor(r) + (u < r - floor(r)))`` with the sign of v:
``E[q] = r``, unbiased; ``r - floor(r)`` is exact and there is no multiply feeding an add,
so FMA contraction cannot change the result on a GPU either.

Non-finite input: ``scale`` is the max of the bit patterns of ``|v|`` (an exact integer
max in which NaN lies above +Inf), so a bucket holding a NaN gets ``scale = NaN``
(canonical ``0x7FC00000``; ``torch.amax`` rule) and one holding an Inf gets
``scale = Inf``; a bucket whose scale is not finite and > 0 quantises every element to
``q = 0``, so it decodes as NaN (``0 * Inf``, ``0 * NaN``): the bad value stays
visible downstream instead of becoming a full-scale code (what compiled
``tl.maximum``/``tl.minimum``, which drop NaN, would produce). Same rule in
``hvdsparse.cpu`` and ``hvdsparse.oracle``.

Launch layout of :func:`quantize_pack`: program ``p`` owns ``ROWS`` whole buckets, with
``ROWS`` a power of 2 such that ``ROWS * bucket_size * bits`` is a multiple of 8, so no
output byte straddles two programs. Phase A loads the buckets as a ``[ROWS, BPAD]`` tile
and writes their scales; after a CTA barrier, phase B walks the same elements byte-major
(``[bytes, 8 // bits]`` tile; these loads hit the cache), reads back the scales it just
wrote, quantises and packs each output byte in registers, ``max_phase_b`` elements
per loop step (so registers stay bounded and nothing spills for any bucket size).
Buckets wider than ``max_bucket_tile`` are reduced in a loop in phase A. All element
and byte offsets are int64.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def stochastic_level(x, sc, seed, e, S: tl.constexpr):
    """The signed level ``q`` in ``[-S, S]`` of the elements ``x`` (counters ``e``) under
    their buckets' scales ``sc``: ``r = div_rn(|x| * S, sc)``, ``q = min(S, floor(r) +
    (u < r - floor(r)))`` with ``u = tl.rand(seed, e)``, negated where ``x < 0``."""
    ax = tl.abs(x)
    # a scale that is 0, Inf or NaN quantises its whole bucket to q = 0 (it decodes
    # as 0 or NaN: a non-finite value stays visible, never becomes full scale)
    ok = (sc > 0) & (sc < float("inf"))
    r = tl.math.div_rn(ax * S, tl.where(ok, sc, 1.0))
    r = tl.where(ok, r, 0.0)
    fl = tl.floor(r)
    u = tl.rand(seed, e)
    q = fl + tl.where(u < (r - fl), 1.0, 0.0)
    q = tl.minimum(q, S)          # r is finite here, so min never meets a NaN
    return tl.where(x < 0, -q, q)


@triton.jit
def _quantize_pack_kernel(v_ptr, count_ptr, codes_ptr, scales_ptr, n, nbuckets, B, seed,
                          HAS_COUNT: tl.constexpr, BITS: tl.constexpr, ROWS: tl.constexpr,
                          BPAD: tl.constexpr, NBYTES: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    HALF: tl.constexpr = 1 << (BITS - 1)
    S: tl.constexpr = HALF - 1
    CH: tl.constexpr = NBYTES * PER
    pid = tl.program_id(0)
    nv = n
    if HAS_COUNT:
        nv = tl.minimum(tl.maximum(tl.load(count_ptr), 0), n).to(tl.int64)
    # phase A: per-bucket max |v| as an integer max of the bit patterns (exact, and NaN
    # propagates: every NaN pattern lies above +Inf; stored as the canonical NaN)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < nbuckets
    rstart = rows * B
    cols = tl.arange(0, BPAD)
    m = tl.zeros([ROWS], dtype=tl.int32)
    for c0 in range(0, B, BPAD):
        col = c0 + cols
        offs = rstart[:, None] + col[None, :]
        mask = row_ok[:, None] & (col[None, :] < B) & (offs < nv)
        x = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        bits = tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        m = tl.maximum(m, tl.max(bits, axis=1))
    m = tl.where(m > 0x7F800000, 0x7FC00000, m)
    tl.store(scales_ptr + rows, m.to(tl.float32, bitcast=True), mask=row_ok)
    tl.debug_barrier()
    # phase B: quantise + pack, byte-major, CH elements at a time (bounded registers)
    e0 = pid.to(tl.int64) * ROWS * B
    e_end = tl.minimum(e0 + ROWS * B, n)
    byte_i = tl.arange(0, NBYTES)
    k = tl.arange(0, PER)
    for c in range(0, ROWS * B, CH):
        e = e0 + c + byte_i[:, None] * PER + k[None, :]
        emask = e < e_end
        x = tl.load(v_ptr + e, mask=emask & (e < nv), other=0.0).to(tl.float32)
        sc = tl.load(scales_ptr + e // B, mask=emask, other=0.0)
        q = stochastic_level(x, sc, seed, e, S)
        code = tl.where(emask, (q.to(tl.int32) + HALF) & ((1 << BITS) - 1), 0)  # pad: 0
        packed = tl.sum(code << (k[None, :] * BITS), axis=1)
        first = e0 + c + byte_i * PER          # first element of each output byte
        tl.store(codes_ptr + first * BITS // 8, packed.to(tl.uint8), mask=first < e_end)


def _rows_for(B, bits, block):
    r = 8 // _gcd(B * bits, 8)  # buckets per program must be a multiple of r
    rows = triton.next_power_of_2(max(1, block // B))
    return max(rows, r)


def _gcd(a, b):
    while b:
        a, b = b, a % b
    return a


def quantize_pack(values, bits, bucket_size, seed, count=None, *, block=2048,
                  max_bucket_tile=4096, max_phase_b=4096):
    """Triton version of ``hvdsparse.cpu.quantize_pack``; ``count`` is None or an
    int32 device tensor (``count[0]`` used). Returns ``(codes uint8[ceil(n*bits/8)],
    scales fp32[ceil(n / bucket_size)])``. ``max_phase_b``: elements per phase-B step
    (a power of 2): registers stay bounded for any bucket size."""
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
    nbytes = min(triton.next_power_of_2(-(-rows * B // per)), max(1, max_phase_b // per))
    grid = (triton.cdiv(nb, rows),)
    _quantize_pack_kernel[grid](values, count if count is not None else scales, codes, scales,
                                n, nb, B, int(seed), HAS_COUNT=count is not None, BITS=bits,
                                ROWS=rows, BPAD=bpad, NBYTES=nbytes, num_warps=8)
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
    """Triton version of ``hvdsparse.cpu.dequantize_unpack``: fp32[n]."""
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    if n == 0:
        return out
    per = 8 // int(bits)
    nbytes = triton.next_power_of_2(max(1, block // per))
    grid = (triton.cdiv(-(-n // per), nbytes),)
    _unpack_kernel[grid](codes, scales, out, n, int(bucket_size), BITS=int(bits), SIGN=False,
                         NBYTES=nbytes, num_warps=8)
    return out


def sign_unpack(bits_u8, scale, n, *, block=4096):
    """Triton version of ``hvdsparse.cpu.sign_unpack`` (``scale`` an fp32 tensor)."""
    out = torch.empty(n, dtype=torch.float32, device=bits_u8.device)
    if n == 0:
        return out
    nbytes = triton.next_power_of_2(max(1, block // 8))
    grid = (triton.cdiv(-(-n // 8), nbytes),)
    _unpack_kernel[grid](bits_u8, scale.reshape(1), out, n, 1, BITS=1, SIGN=True,
                         NBYTES=nbytes, num_warps=8)
    return out


@triton.jit
def _philox_uniform_kernel(out_ptr, n, offset, seed, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.rand(seed, i + offset), mask=i < n)


def philox_uniform(seed, n, offset=0, device=None, *, block=2048):
    """fp32[n]: element i = ``tl.rand(seed, offset + i)`` (int64 counter)."""
    out = torch.empty(n, dtype=torch.float32, device=device)
    if n:
        _philox_uniform_kernel[(triton.cdiv(n, block),)](out, n, int(offset), int(seed),
                                                          BLOCK=block, num_warps=8)
    return out
