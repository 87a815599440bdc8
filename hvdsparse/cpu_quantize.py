"""The CPU path of quantisation and bit packing: :func:`quantize_pack` (stochastic
rounding to 8/4/2-bit codes with one fp32 scale per bucket, packed), its inverse
:func:`dequantize_unpack`, :func:`sign_unpack`, and :func:`pack_bits` /
:func:`unpack_bits`, the one bit packer of the project (also for sign bits and
bitmasks).

Same results bit for bit as ``kernels/quantize.py``; the math is stated in
:mod:`hvdsparse.oracle`. On the CPU the quantiser runs in blocks of whole buckets
split across threads: the compiled loops (``native/quantize.c``) where they are built,
else numpy; the torch code serves other devices and :data:`cpu_chunking.USE_NUMPY` off,
with the same bits.
"""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np
import torch

from . import cpu_chunking, native
from .cpu_checks import FLOAT_INPUT_DTYPES, check_1d, check_bits, scalar_tensor
from .philox import (check_pos_int, check_seed, philox_parallel, philox_scratch,
                     PHILOX_CHUNK, PHILOX_PAR_MIN, philox_uniform, uniform_block)


def pack_bits(codes_u8: torch.Tensor, bits: int) -> torch.Tensor:
    """The project's one bit packer: ``bits``-wide codes (``bits`` in {1, 2, 4, 8}, values
    < 2**bits, any integer/bool dtype, any device) -> uint8[ceil(n*bits/8)], element j at
    byte ``j*bits // 8``, bit ``(j*bits) % 8`` (little end first); unused high bits of the
    last byte are 0. bits=1 packs sign bits and bitmasks (bit j%8 of byte j//8)."""
    per = 8 // bits
    n = codes_u8.numel()
    nbytes = -(-n * bits // 8)
    c = codes_u8.to(torch.int32)
    if nbytes * per != n:
        c = torch.cat([c, c.new_zeros(nbytes * per - n)])
    c = c.view(nbytes, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=c.device)
    return (c << shifts).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: int32[n] codes."""
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    c = (packed.to(torch.int32)[:, None] >> shifts) & ((1 << bits) - 1)
    return c.reshape(-1)[:n]


def _count_value(name: str, count, n: int) -> int:
    """Host int from count=None | int | int tensor (first element). Clamped to [0, n]."""
    if count is None:
        return n
    if isinstance(count, torch.Tensor):
        if count.numel() < 1:
            raise ValueError(f"{name} must have at least one element")
        c = int(count.reshape(-1)[0])
    elif isinstance(count, int) and not isinstance(count, bool):
        c = count
    else:
        raise TypeError(f"{name} must be None, an int or an int tensor, got {type(count).__name__}")
    return max(0, min(c, n))


#: target elements per block of the numpy quantise / dequantise path (whole buckets)
_Q_CHUNK = 1 << 16


def _q_block_len(B: int, bits: int) -> int:
    """Block length for the numpy quantise path: whole buckets, ~_Q_CHUNK elements,
    a multiple of 8 // bits so every block starts on a byte of the packed codes."""
    per = 8 // bits
    rows = max(1, _Q_CHUNK // B)
    step = per // math.gcd(B, per)
    rows = -(-rows // step) * step
    return rows * B


def _q_parallel(n: int, B: int, bits: int, work) -> None:
    """Run ``work(start, end)`` over the elements [0, n) of a quantised layer in pieces of
    whole :func:`_q_block_len` blocks (each piece starts on a bucket and a code byte),
    one per thread (:func:`hvdsparse.philox.philox_parallel`)."""
    L = _q_block_len(B, bits)
    philox_parallel(n, work, align=L, min_per=max(L, PHILOX_PAR_MIN))


def _quantize_pack_np(v: np.ndarray, c: int, bits: int, B: int, seed: int,
                      codes: np.ndarray, scales: np.ndarray) -> None:
    """numpy :func:`quantize_pack` of fp32 ``v`` (count ``c``), block by block, with the
    same fp32 operations (hence results) as the torch path."""
    n = v.shape[0]
    s = (1 << (bits - 1)) - 1
    half = 1 << (bits - 1)
    per = 8 // bits
    L = _q_block_len(B, bits)
    fs = np.float32(s)

    def work(s0, e0):
        scratch = philox_scratch()
        a = np.empty(L, np.float32)       # |v| -> r -> r - floor(r)
        fl = np.empty(L, np.float32)      # floor(r) -> q
        u = np.empty(L, np.float32)
        lt = np.empty(L, np.bool_)
        ci = np.empty(L, np.int32)
        cu = np.empty(L, np.uint8)
        sh = np.empty(L // per if per > 1 else 1, np.uint8)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            for bs in range(s0, e0, L):
                be = min(bs + L, e0)               # elements [bs, be): be - bs <= L
                m = be - bs
                R = -(-m // B)                     # buckets (the last may be partial)
                mp = R * B
                A = a[:mp]
                np.abs(v[bs:be], out=A[:m])
                if c < be:
                    A[max(c - bs, 0):m] = 0.0      # slots >= count are 0
                if mp > m:
                    A[m:] = 0.0
                A2 = A.reshape(R, B)
                sc = scales[bs // B: bs // B + R]
                np.max(A2, axis=1, out=sc)
                # r = fp32(fp32(|v| * s) / scale); 0 where the scale is 0, Inf or NaN
                np.multiply(A, fs, out=A)
                ok = (sc > 0) & (sc < np.inf)      # Inf/NaN scale: q = 0 (design.md)
                if ok.all():
                    np.divide(A2, sc[:, None], out=A2)
                else:
                    np.divide(A2, np.where(ok, sc, np.float32(1))[:, None], out=A2)
                    A2[~ok] = 0.0
                A = A[:m]
                # u = tl.rand(seed, j)
                U = u[:m]
                for ps in range(0, m, PHILOX_CHUNK):
                    uniform_block(seed, bs + ps, U[ps:min(ps + PHILOX_CHUNK, m)], scratch)
                # q = sign(v) * min(s, floor(r) + (u < r - floor(r)))
                F = fl[:m]
                np.floor(A, out=F)
                np.subtract(A, F, out=A)
                np.less(U, A, out=lt[:m])
                np.add(F, lt[:m], out=F)
                np.minimum(F, fs, out=F)
                np.copysign(F, v[bs:be], out=F)    # v < 0 -> -q; q is 0 where v is -0.0
                CI = ci[:m]
                np.copyto(CI, F, casting="unsafe")  # exact: integer-valued (NaN -> INT_MIN
                np.add(CI, half, out=CI)            # like the torch cast)
                CU = cu[:m]
                np.copyto(CU, CI, casting="unsafe")  # to uint8 (mod 256), like .to(uint8)
                ob = bs // per
                if per == 1:
                    codes[ob: ob + m] = CU
                    continue
                nbytes = -(-m // per)
                if nbytes * per != m:              # last block: pad codes with 0
                    cu[m: nbytes * per] = 0
                CU = cu[: nbytes * per].reshape(nbytes, per)
                out = codes[ob: ob + nbytes]
                np.copyto(out, CU[:, 0])
                S = sh[:nbytes]
                for k in range(1, per):
                    np.left_shift(CU[:, k], np.uint8(k * bits), out=S)
                    np.bitwise_or(out, S, out=out)

    _q_parallel(n, B, bits, work)


def quantize_pack(values: torch.Tensor, bits: int, bucket_size: int, seed: int,
                  count=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stochastic rounding to ``bits`` in {8, 4, 2} with one fp32 scale per bucket.

    ``s = 2**(bits-1) - 1``; for bucket ``b`` of ``bucket_size`` consecutive values,
    ``scale[b] = max |v|`` over the bucket (slots ``j >= count`` count as 0 and get
    code ``2**(bits-1)``, i.e. q = 0). With ``r = fp32(fp32(|v| * s) / scale)`` and
    ``u = philox_uniform(seed)[j]``: ``q = sign(v) * min(s, floor(r) + (u < r - floor(r)))``
    -- the same distribution as ``floor(|v| / scale * s + u)`` (so ``E[q * scale / s] = v``),
    written so that every fp32 operation is exact or correctly rounded and no
    multiply-add can be contracted (the kernels are bit-identical). ``scale == 0`` gives
    q = 0. ``code = q + 2**(bits-1)`` (unsigned, ``bits`` wide), element j at byte
    ``j*bits // 8``, bit ``(j*bits) % 8``; unused high bits of the last byte are 0.

    Returns ``(codes uint8[ceil(n*bits/8)], scales fp32[ceil(n / bucket_size)])``.
    On the CPU this runs in numpy, in cache-sized blocks of whole buckets (and threads).
    """
    check_1d("values", values, FLOAT_INPUT_DTYPES)
    bits = check_bits(bits)
    B = check_pos_int("bucket_size", bucket_size)
    seed = check_seed(seed)
    n = values.numel()
    c = _count_value("count", count, n)
    if values.device.type != "cpu" or not cpu_chunking.USE_NUMPY:
        return _quantize_pack_torch(values, bits, B, seed, c)
    nb = -(-n // B)
    codes = torch.empty(-(-n * bits // 8), dtype=torch.uint8)
    scales = torch.empty(nb, dtype=torch.float32)
    if n:
        v = values.to(torch.float32).contiguous().numpy()
        if native.available():
            # hvdsparse/native/quantize.c: the same bits, Philox drawn inline
            cn, sn = codes.numpy(), scales.numpy()
            _q_parallel(n, B, bits, lambda s0, e0: native.quantize_pack(
                v, c, bits, B, seed, cn, sn, s0, e0))
        else:
            _quantize_pack_np(v, c, bits, B, seed, codes.numpy(), scales.numpy())
    return codes, scales


def _quantize_pack_torch(values: torch.Tensor, bits: int, B: int, seed: int,
                         c: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Torch :func:`quantize_pack` (any device; arguments already checked)."""
    n = values.numel()
    s = (1 << (bits - 1)) - 1
    nb = -(-n // B)
    v = values.to(torch.float32)
    if c < n:
        v = v.clone()
        v[c:] = 0.0
    av = v.abs()
    pad = nb * B - n
    avp = torch.cat([av, av.new_zeros(pad)]) if pad else av
    scales = avp.view(nb, B).amax(dim=1) if n else av.new_zeros(0)
    scale_e = scales.repeat_interleave(B)[:n]
    r = (av * float(s)) / scale_e
    r = torch.where((scale_e > 0) & (scale_e < math.inf), r, torch.zeros_like(r))
    fl = torch.floor(r)
    u = philox_uniform(seed, n, device=values.device)
    q = fl + (u < (r - fl)).to(torch.float32)
    q = torch.clamp(q, max=float(s))
    q = torch.where(v < 0, -q, q)
    codes = (q.to(torch.int32) + (1 << (bits - 1))).to(torch.uint8)
    return pack_bits(codes, bits), scales


def _dequantize_unpack_np(codes: np.ndarray, scales: np.ndarray, bits: int, B: int, n: int,
                          out: np.ndarray) -> None:
    """numpy :func:`dequantize_unpack` into fp32 ``out[n]``, block by block."""
    s = np.float32((1 << (bits - 1)) - 1)
    half = np.float32(1 << (bits - 1))
    per = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    L = _q_block_len(B, bits)

    def work(s0, e0):
        cu = np.empty(L, np.uint8)
        f = np.empty(L, np.float32)
        for bs in range(s0, e0, L):
            be = min(bs + L, e0)
            m = be - bs
            R = -(-m // B)
            nbytes = -(-m // per)
            src = codes[bs // per: bs // per + nbytes]
            if per == 1:
                CU = src
            else:
                C2 = cu[: nbytes * per].reshape(nbytes, per)
                for k in range(per):
                    if k:
                        np.right_shift(src, np.uint8(k * bits), out=C2[:, k])
                        if k < per - 1:
                            np.bitwise_and(C2[:, k], mask, out=C2[:, k])
                    else:
                        np.bitwise_and(src, mask, out=C2[:, 0])
                CU = cu[:m]
            F = f[: R * B]
            np.copyto(F[:m], CU[:m], casting="unsafe")
            np.subtract(F[:m], half, out=F[:m])      # q, exact
            if R * B > m:
                F[m:] = 0.0
            F2 = F.reshape(R, B)
            with np.errstate(invalid="ignore"):          # 0 * Inf = NaN is the rule
                np.multiply(F2, scales[bs // B: bs // B + R, None], out=F2)
            np.divide(F[:m], s, out=out[bs:be])

    _q_parallel(n, B, bits, work)


def dequantize_unpack(codes: torch.Tensor, scales: torch.Tensor, bits: int,
                      bucket_size: int, n: int) -> torch.Tensor:
    """Inverse map of :func:`quantize_pack`: fp32[n] with
    ``v[j] = fp32(fp32(q_j * scale[j // bucket_size]) / s)``, ``q_j = code_j - 2**(bits-1)``.
    """
    check_1d("codes", codes, (torch.uint8,))
    check_1d("scales", scales, (torch.float32,))
    bits = check_bits(bits)
    B = check_pos_int("bucket_size", bucket_size)
    n = check_pos_int("n", n, 0)
    if codes.numel() < -(-n * bits // 8):
        raise ValueError(f"codes has {codes.numel()} bytes, needs ceil(n*bits/8) = "
                         f"{-(-n * bits // 8)} for n={n}, bits={bits}")
    if scales.numel() < -(-n // B):
        raise ValueError(f"scales has {scales.numel()} elements, needs ceil(n/bucket_size) = "
                         f"{-(-n // B)}")
    if codes.device.type == "cpu" and scales.device.type == "cpu" and cpu_chunking.USE_NUMPY:
        out = torch.empty(n, dtype=torch.float32)
        if n:
            cn, sn, on = codes.contiguous().numpy(), scales.contiguous().numpy(), out.numpy()
            if native.available():              # hvdsparse/native/quantize.c, same bits
                _q_parallel(n, B, bits, lambda s0, e0: native.dequantize(
                    cn, sn, bits, B, s0, e0, on[s0:e0]))
            else:
                _dequantize_unpack_np(cn, sn, bits, B, n, on)
        return out
    s = (1 << (bits - 1)) - 1
    q = (unpack_bits(codes[: -(-n * bits // 8)], bits, n) - (1 << (bits - 1))).to(torch.float32)
    scale_e = scales[: -(-n // B)].repeat_interleave(B)[:n]
    return (q * scale_e) / float(s)


def sign_unpack(bits_u8: torch.Tensor, scale, n: int) -> torch.Tensor:
    """fp32[n]: ``-scale`` where bit j (bit j%8 of byte j//8) is 1, ``+scale`` otherwise."""
    check_1d("bits_u8", bits_u8, (torch.uint8,))
    n = check_pos_int("n", n, 0)
    if bits_u8.numel() < -(-n // 8):
        raise ValueError(f"bits_u8 has {bits_u8.numel()} bytes, needs ceil(n/8) = {-(-n // 8)}")
    sc = scalar_tensor("scale", scale, bits_u8.device)
    b = unpack_bits(bits_u8[: -(-n // 8)], 1, n)
    return torch.where(b.bool(), -sc, sc)
