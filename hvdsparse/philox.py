"""Philox 4x32-10 counter-based RNG, bit-identical to Triton's ``tl.rand(seed, offset)``
and ``tl.randint`` (the uniforms of stochastic quantisation), and the CPU worker-thread
helpers shared with :mod:`hvdsparse.cpu`.

Stream: counter block ``(offset_lo, offset_hi, 0, 0)``, key ``(seed_lo, seed_hi)``,
10 rounds with Triton's constants; the first output word ``w`` maps to fp32 as
Triton's ``uint_to_uniform_float``: ``i = int32(w)``, ``i < 0 -> -i - 1``,
``u = fp32(i) * fp32(4.6566127342e-10)`` in [0, 1). On the CPU it runs in numpy
(uint64 mulhilo, cache-sized blocks, split across threads); the torch code is used on
other devices and gives the same bits. ``hvdsparse.oracle`` has an independent
textbook version that the tests compare against.

With the compiled CPU loops (``hvdsparse/native/philox.c``, the same stream bit for
bit; ``scripts/bench_overhead.py`` measures what it saves QSGD) the CPU stream is
generated there; without them (no compiler, ``HVDSPARSE_NATIVE=0``) in numpy.

Imports nothing of hvdsparse but :mod:`hvdsparse.native` (itself on the floor).
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import native

__all__ = ["philox_uint32", "philox_uniform"]


def check_pos_int(name: str, v, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < (1 << 63):
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    return seed


# --------------------------------------------------------------------------------------
# Philox 4x32-10, bit-identical to triton.language.random (rand/randint)
# --------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_ROUNDS = 10
# scale of uint_to_uniform_float for 32-bit inputs, rounded to fp32 like Triton does
_U32_TO_UNIFORM = 4.6566127342e-10

#: elements per block of the numpy Philox (6 uint64 scratch arrays of 512 KiB: ~90 ufunc
#: calls per block make smaller blocks dispatch/GIL-bound -- measured best on 2 cores)
PHILOX_CHUNK = 1 << 16
#: at least this many elements per worker thread before the numpy Philox is split
#: across threads (numpy releases the GIL inside ufuncs)
PHILOX_PAR_MIN = 1 << 17
_NP_M32 = np.uint64(_M32)
_NP_32 = np.uint64(32)
_NP_ROUND_A = np.uint64(_PHILOX_ROUND_A)
_NP_ROUND_B = np.uint64(_PHILOX_ROUND_B)
_NP_U32_TO_UNIFORM = np.float32(_U32_TO_UNIFORM)
_philox_tls = threading.local()
_philox_pool = None
_philox_pool_lock = threading.Lock()


def _mulhilo32(a: int, x: torch.Tensor):
    """(hi, lo) 32-bit halves of a * x, a a uint32 constant, x int64 holding uint32."""
    xl = x & 0xFFFF
    xh = x >> 16
    t = xl * a                      # < 2**48
    u = xh * a + (t >> 16)          # < 2**48 + 2**32
    hi = u >> 16
    lo = ((u & 0xFFFF) << 16) | (t & 0xFFFF)
    return hi, lo


def _philox_uint32_torch(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """Torch Philox (any device): int64 words in [0, 2**32) for int64 counters."""
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    c = counters.to(torch.int64)
    c0 = c & _M32
    c1 = (c >> 32) & _M32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(_PHILOX_ROUNDS):
        hi_b, lo_b = _mulhilo32(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo32(_PHILOX_ROUND_A, c0)
        c0 = hi_b ^ c1 ^ k0
        c2 = hi_a ^ c3 ^ k1
        c1 = lo_b
        c3 = lo_a
        k0 = (k0 + _PHILOX_KEY_A) & _M32
        k1 = (k1 + _PHILOX_KEY_B) & _M32
    return c0


def philox_scratch():
    """Per-thread scratch: 6 uint64[PHILOX_CHUNK] arrays and a uint64 ramp."""
    s = getattr(_philox_tls, "s", None)
    if s is None or s[0].shape[0] != PHILOX_CHUNK:
        s = [np.empty(PHILOX_CHUNK, np.uint64) for _ in range(6)]
        s.append(np.arange(PHILOX_CHUNK, dtype=np.uint64))
        _philox_tls.s = s
    return s



def _philox_np_block(seed: int, ctr: np.ndarray, out_u32: np.ndarray, scratch) -> None:
    """``out_u32[i]`` = first Philox 4x32-10 word of uint64 counter ``ctr[i]``.

    uint64 arithmetic: a uint32 by uint32 product is exact in uint64, so mulhilo is one
    multiply, a shift and a mask. Round 1 (c2 = c3 = 0), round 2 (c1 = 0) and round 10
    (only c0 is returned) skip their dead work.
    """
    m = ctr.shape[0]
    c0, c1, c2, c3, pa, pb = (b[:m] for b in scratch[:6])
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    # round 1: counter (lo, hi, 0, 0)
    np.bitwise_and(ctr, _NP_M32, out=c0)
    np.multiply(c0, _NP_ROUND_A, out=pa)
    np.right_shift(ctr, _NP_32, out=c0)
    np.bitwise_xor(c0, np.uint64(k0), out=c0)          # hi(B*0) ^ c1 ^ k0
    np.right_shift(pa, _NP_32, out=c2)
    np.bitwise_xor(c2, np.uint64(k1), out=c2)          # hi(A*c0) ^ 0 ^ k1
    np.bitwise_and(pa, _NP_M32, out=c3)                # c1 = lo(B*0) = 0
    for r in range(1, _PHILOX_ROUNDS - 1):
        k0 = (k0 + _PHILOX_KEY_A) & _M32
        k1 = (k1 + _PHILOX_KEY_B) & _M32
        np.multiply(c2, _NP_ROUND_B, out=pb)
        np.multiply(c0, _NP_ROUND_A, out=pa)
        np.right_shift(pb, _NP_32, out=c0)
        if r > 1:
            np.bitwise_xor(c0, c1, out=c0)
        np.bitwise_xor(c0, np.uint64(k0), out=c0)
        np.right_shift(pa, _NP_32, out=c2)
        np.bitwise_xor(c2, c3, out=c2)
        np.bitwise_xor(c2, np.uint64(k1), out=c2)
        np.bitwise_and(pb, _NP_M32, out=c1)
        np.bitwise_and(pa, _NP_M32, out=c3)
    # round 10: c0 only
    k0 = (k0 + _PHILOX_KEY_A) & _M32
    np.multiply(c2, _NP_ROUND_B, out=pb)
    np.right_shift(pb, _NP_32, out=pb)
    np.bitwise_xor(pb, c1, out=pb)
    np.bitwise_xor(pb, np.uint64(k0), out=out_u32, casting="unsafe")


def _uint32_to_uniform_np(w_u32: np.ndarray, out_f32: np.ndarray, tmp_i32: np.ndarray) -> None:
    """numpy :func:`_uint32_to_uniform`: ``i ^ (i >> 31)`` is ``-i - 1`` for ``i < 0``."""
    i = w_u32.view(np.int32)
    np.right_shift(i, 31, out=tmp_i32)
    np.bitwise_xor(i, tmp_i32, out=i)
    np.copyto(out_f32, i, casting="unsafe")            # int32 -> fp32, round to nearest
    np.multiply(out_f32, _NP_U32_TO_UNIFORM, out=out_f32)


def par_ranges(n: int, align: int, min_per: int):
    """Contiguous ``align``-aligned ranges covering [0, n), one per thread: up to
    torch.get_num_threads() (and os.cpu_count()) of them, at least ``min_per`` elements
    each; a single range when n is small."""
    nt = max(1, min(torch.get_num_threads(), os.cpu_count() or 1, n // max(1, min_per)))
    if nt <= 1:
        return [(0, n)]
    per = -(-n // nt)
    per = -(-per // align) * align
    return [(s, min(s + per, n)) for s in range(0, n, per)]


def par_run(work, items) -> None:
    """``work(*item)`` for every item: the first inline, the others on the shared pool
    (created lazily; numpy releases the GIL inside ufuncs). Waits for all of them."""
    global _philox_pool
    items = list(items)
    if len(items) > 1:
        with _philox_pool_lock:
            if _philox_pool is None or _philox_pool._max_workers < len(items) - 1:
                _philox_pool = ThreadPoolExecutor(max_workers=max(1, len(items) - 1),
                                                  thread_name_prefix="hvdsparse-philox")
            pool = _philox_pool
        futs = [pool.submit(work, *it) for it in items[1:]]
    else:
        futs = []
    try:
        if items:
            work(*items[0])
    finally:
        for f in futs:
            f.result()


def philox_parallel(n: int, work, align: int = 0, min_per: int = 0) -> None:
    """Run ``work(start, end)`` over [0, n) in ``align``-aligned pieces (default
    PHILOX_CHUNK), one per thread (up to torch.get_num_threads(), at least ``min_per``
    elements each, default PHILOX_PAR_MIN), or inline when n is small."""
    par_run(work, par_ranges(n, align or PHILOX_CHUNK, min_per or PHILOX_PAR_MIN))


def _philox_uint32_np(seed: int, ctr: np.ndarray) -> np.ndarray:
    """numpy Philox: int64 words in [0, 2**32) for a uint64 counter array."""
    n = ctr.shape[0]
    out = np.empty(n, np.int64)
    out32 = np.empty(n, np.uint32)

    def work(s0, e0):
        scratch = philox_scratch()
        for s in range(s0, e0, PHILOX_CHUNK):
            e = min(s + PHILOX_CHUNK, e0)
            _philox_np_block(seed, ctr[s:e], out32[s:e], scratch)

    philox_parallel(n, work)
    np.copyto(out, out32, casting="unsafe")
    return out


def uniform_block(seed: int, start: int, out_f32: np.ndarray, scratch) -> None:
    """``out_f32[i] = tl.rand(seed, start + i)`` for one contiguous block: the compiled
    loop when available, else numpy (``scratch``: :func:`philox_scratch`, blocks of at
    most ``PHILOX_CHUNK``)."""
    if native.available():
        native.philox_uniform(seed, start, out_f32)
        return
    m = out_f32.shape[0]
    ctr = scratch[5][:m]
    np.add(scratch[6][:m], np.uint64(start), out=ctr)
    w = out_f32.view(np.uint32)
    _philox_np_block(seed, ctr, w, scratch)
    _uint32_to_uniform_np(w, out_f32, scratch[4][:m].view(np.int32)[:m])


def _philox_uniform_np(seed: int, n: int, offset: int, out_f32: np.ndarray) -> None:
    """``out_f32[i] = tl.rand(seed, offset + i)`` on the CPU, block by block
    (:func:`uniform_block`: the compiled loop when available)."""

    def work(s0, e0):
        scratch = philox_scratch()
        for s in range(s0, e0, PHILOX_CHUNK):
            uniform_block(seed, offset + s, out_f32[s:min(s + PHILOX_CHUNK, e0)], scratch)

    philox_parallel(n, work)


def philox_uint32(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """First output word of Philox 4x32-10 for each 64-bit counter (int64 tensor).

    Counter block ``(c & 0xffffffff, c >> 32, 0, 0)``, key ``(seed & 0xffffffff,
    seed >> 32)``; exactly ``triton.language.randint(seed, offset)`` with an int64
    ``offset`` (and with an int32 ``offset`` for counters < 2**31). Returns int64 in
    [0, 2**32).
    """
    seed = check_seed(seed)
    if counters.device.type != "cpu":
        return _philox_uint32_torch(seed, counters)
    ctr = counters.to(torch.int64).contiguous().reshape(-1).numpy().view(np.uint64)
    out = _philox_uint32_np(seed, ctr)
    return torch.from_numpy(out).reshape(counters.shape)


def _uint32_to_uniform(x: torch.Tensor) -> torch.Tensor:
    """Triton's uint_to_uniform_float for 32-bit words: fp32 in [0, 1).

    The word is read as int32 ``i``; ``i < 0`` maps to ``-i - 1`` (so the result lies in
    [0, 2**31 - 1]), converted to fp32 (round to nearest) and multiplied in fp32 by
    fp32(4.6566127342e-10).
    """
    v = torch.where(x >= (1 << 31), _M32 - x, x)
    return v.to(torch.float32) * torch.tensor(_U32_TO_UNIFORM, dtype=torch.float32)


def philox_uniform(seed: int, n: int, offset: int = 0, device=None) -> torch.Tensor:
    """fp32[n] uniforms in [0, 1): element i is ``tl.rand(seed, offset + i)``.

    Counter-based: any slice of the stream can be generated independently, and the
    Triton kernels draw exactly the same numbers for the same (seed, counter).
    On the CPU the stream is generated in numpy, in L2-sized blocks (and threads).
    """
    n = check_pos_int("n", n, 0)
    offset = check_pos_int("offset", offset, 0)
    seed = check_seed(seed)
    if offset + n > (1 << 63):
        raise ValueError("offset + n must be < 2**63")
    dev = torch.device(device) if device is not None else torch.get_default_device()
    if dev.type == "cpu":
        out = torch.empty(n, dtype=torch.float32)
        if n:
            _philox_uniform_np(seed, n, offset, out.numpy())
        return out
    idx = torch.arange(offset, offset + n, dtype=torch.int64, device=dev)
    return _uint32_to_uniform(_philox_uint32_torch(seed, idx))
