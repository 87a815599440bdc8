"""Fused residual add + per-bin abs max (operation 1 of docs/design.md).

Math (bit for bit the same in the kernels, ``hvdsparse.cpu`` and ``hvdsparse.oracle``)::

    d[i]      = fp32(grad[i]) * s            one fp32 rounding; s = grad_scale[0] (fp32),
                                              no multiply at all when grad_scale is None
    fin[i]    = |d[i]| < inf                  False for NaN and +-Inf
    res[i]    = res[i] + d[i]  if fin[i]      second, separate fp32 rounding (never an FMA:
              = res[i]         otherwise      the kernels are compiled with
                                              ``enable_fp_fusion=False``)
    binmax[b] = max |res[b*L : (b+1)*L]|      NaN if the bin holds a NaN (torch.amax rule)
    nonfinite[0] += #{i : not fin[i]}         when a ``nonfinite`` int32[1] tensor is given

The max is taken on the int32 bit patterns of ``|res|`` (sign bit cleared): for
non-negative floats the pattern is monotone in the value and every NaN pattern lies
above +Inf, so an integer max is exact, order-independent and propagates NaN (the
compiled ``tl.maximum`` would drop it); a NaN result is stored as the canonical quiet
NaN ``0x7FC00000``.

Two launch layouts, both with a grid proportional to ``n`` whatever the bin size:

* ``L < flat_min`` (small bins): program ``p`` owns ``ROWS`` whole bins as a
  ``[ROWS, CHUNK]`` tile (``CHUNK = min(next_pow2(L), max_chunk)``, looping over the
  bin when ``L > CHUNK``) and stores their maxima: no atomics. The tile holds at most
  ``TILE_PER_THREAD`` elements per thread (``ROWS * CHUNK <= 8 * 32 * num_warps``,
  except one row of ``CHUNK`` when that is wider): each element carries an int64 offset
  and a mask, and 16 per thread made ptxas spill on sm_90 (Triton 3.6, L = 500).
* ``L >= flat_min`` (large bins, e.g. ``bin_size = n``): program ``p`` streams the
  contiguous elements ``[p*BLOCK, (p+1)*BLOCK)`` (every block but the last unmasked, so
  128-bit loads for any ``n`` when the tensors are 16-byte aligned); since
  ``BLOCK <= L`` they touch at most two bins, whose partial maxima go to ``binmax`` with
  ``tl.atomic_max`` on the int32 view (relaxed; ``binmax`` is zeroed first, and +0.0 is
  the identity of a max of non-negative floats). An integer max is commutative and
  exact, so the result is deterministic.

The ``nonfinite`` counter gets one relaxed ``tl.atomic_add`` per program that saw a
non-finite element (none otherwise).
"""
import torch
import triton
import triton.language as tl

_CANON_NAN = 0x7FC00000
_INF_BITS = 0x7F800000
#: most elements per thread in one [ROWS, CHUNK] tile of the small-bin layout
TILE_PER_THREAD = 8


@triton.jit
def load_block(ptr, offs, mask, FULL: tl.constexpr):
    """Load; unmasked for a full block, so the compiler can prove 16-byte contiguity and
    emit 128-bit loads whatever ``n`` is (a mask ``offs < n`` only allows that when the
    specialisation knows 16 | n)."""
    if FULL:
        x = tl.load(ptr + offs)
    else:
        x = tl.load(ptr + offs, mask=mask, other=0.0)
    return x


@triton.jit
def store_block(ptr, offs, x, mask, FULL: tl.constexpr):
    """Store; unmasked for a full block (as :func:`load_block`)."""
    if FULL:
        tl.store(ptr + offs, x)
    else:
        tl.store(ptr + offs, x, mask=mask)


@triton.jit
def _add_scaled(g_ptr, r_ptr, offs, mask, s, HAS_SCALE: tl.constexpr,
                FULL: tl.constexpr = False):
    """(new residual, non-finite mask) for the elements ``offs`` (see module doc)."""
    g = load_block(g_ptr, offs, mask, FULL).to(tl.float32)
    r = load_block(r_ptr, offs, mask, FULL)
    if HAS_SCALE:
        d = g * s
    else:
        d = g
    fin = tl.abs(d) < float("inf")
    a = tl.where(fin, r + d, r)
    return a, (~fin) & mask


@triton.jit
def _residual_tile_kernel(grad_ptr, res_ptr, binmax_ptr, scale_ptr, nf_ptr, n, nbins, L,
                          HAS_SCALE: tl.constexpr, HAS_NF: tl.constexpr,
                          ROWS: tl.constexpr, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < nbins
    row_start = rows * L
    cols = tl.arange(0, CHUNK)
    s = 1.0
    if HAS_SCALE:
        s = tl.load(scale_ptr)
    m = tl.zeros([ROWS], dtype=tl.int32)
    nbad = tl.zeros([ROWS], dtype=tl.int32)
    for c0 in range(0, L, CHUNK):
        col = c0 + cols
        offs = row_start[:, None] + col[None, :]
        mask = row_ok[:, None] & (col[None, :] < L) & (offs < n)
        a, bad = _add_scaled(grad_ptr, res_ptr, offs, mask, s, HAS_SCALE)
        tl.store(res_ptr + offs, a, mask=mask)
        bits = tl.where(mask, a.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        m = tl.maximum(m, tl.max(bits, axis=1))
        nbad += tl.sum(bad.to(tl.int32), axis=1)
    m = tl.where(m > 0x7F800000, 0x7FC00000, m)
    tl.store(binmax_ptr + rows, m.to(tl.float32, bitcast=True), mask=row_ok)
    if HAS_NF:
        tot = tl.sum(nbad, axis=0)
        tl.atomic_add(nf_ptr, tot, mask=tot > 0, sem="relaxed")


@triton.jit
def _residual_flat_block(grad_ptr, res_ptr, binmax_i32_ptr, nf_ptr, start, n, L, s,
                         HAS_SCALE: tl.constexpr, HAS_NF: tl.constexpr,
                         BLOCK: tl.constexpr, FULL: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    a, bad = _add_scaled(grad_ptr, res_ptr, offs, mask, s, HAS_SCALE, FULL)
    store_block(res_ptr, offs, a, mask, FULL)
    bits = tl.where(mask, a.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
    bits = tl.where(bits > 0x7F800000, 0x7FC00000, bits)
    # BLOCK <= L: the block meets bin b0 and possibly b0 + 1
    b0 = start // L
    split = (b0 + 1) * L
    m0 = tl.max(tl.where(offs < split, bits, 0), axis=0)
    m1 = tl.max(tl.where(offs >= split, bits, 0), axis=0)
    tl.atomic_max(binmax_i32_ptr + b0, m0, sem="relaxed")
    tl.atomic_max(binmax_i32_ptr + b0 + 1, m1, mask=(split < start + BLOCK) & (split < n),
                  sem="relaxed")
    if HAS_NF:
        tot = tl.sum(bad.to(tl.int32), axis=0)
        tl.atomic_add(nf_ptr, tot, mask=tot > 0, sem="relaxed")


@triton.jit
def _residual_flat_kernel(grad_ptr, res_ptr, binmax_i32_ptr, scale_ptr, nf_ptr, n, L,
                          HAS_SCALE: tl.constexpr, HAS_NF: tl.constexpr,
                          BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    s = 1.0
    if HAS_SCALE:
        s = tl.load(scale_ptr)
    if start + BLOCK <= n:       # every block but the last: unmasked, 128-bit loads
        _residual_flat_block(grad_ptr, res_ptr, binmax_i32_ptr, nf_ptr, start, n, L, s,
                             HAS_SCALE, HAS_NF, BLOCK, True)
    else:
        _residual_flat_block(grad_ptr, res_ptr, binmax_i32_ptr, nf_ptr, start, n, L, s,
                             HAS_SCALE, HAS_NF, BLOCK, False)


def residual_add_binmax(grad, residual, bin_size, *, out=None, grad_scale=None,
                        nonfinite=None, block=4096, max_chunk=1024, flat_min=None,
                        num_warps=8):
    """Triton version of ``hvdsparse.cpu.residual_add_binmax`` (same contract; arguments
    validated by ``hvdsparse.ops``). ``grad_scale``: None or an fp32 1-element device
    tensor; ``nonfinite``: None or an int32[>=1] device tensor (``[0]`` is added to).

    ``block``: elements per program (tile layout: at most ``TILE_PER_THREAD * 32 *
    num_warps`` of them, rounded to whole bins, at least one;
    flat layout: a power of 2); ``max_chunk``: widest column tile (power of 2);
    ``flat_min``: smallest bin size that takes the flat layout (default ``block``).
    """
    n = residual.numel()
    L = int(bin_size)
    nbins = -(-n // L)
    if out is None:
        out = torch.empty(nbins, dtype=torch.float32, device=residual.device)
    if n == 0:
        return out
    has_scale = grad_scale is not None
    has_nf = nonfinite is not None
    sc = grad_scale.reshape(-1) if has_scale else out
    nf = nonfinite if has_nf else out
    flat_min = block if flat_min is None else max(int(flat_min), block)
    if L >= flat_min:
        blk = triton.next_power_of_2(block)
        if blk > block:
            blk //= 2
        out.zero_()
        _residual_flat_kernel[(triton.cdiv(n, blk),)](
            grad, residual, out.view(torch.int32), sc, nf, n, L,
            HAS_SCALE=has_scale, HAS_NF=has_nf, BLOCK=blk, num_warps=num_warps,
            enable_fp_fusion=False)
        return out
    chunk = min(triton.next_power_of_2(L), max_chunk)
    tile = min(block, TILE_PER_THREAD * 32 * num_warps)
    rows = triton.next_power_of_2(max(1, tile // chunk))
    rows = min(rows, triton.next_power_of_2(nbins))
    grid = (triton.cdiv(nbins, rows),)
    _residual_tile_kernel[grid](grad, residual, out, sc, nf, n, nbins, L,
                                HAS_SCALE=has_scale, HAS_NF=has_nf, ROWS=rows, CHUNK=chunk,
                                num_warps=num_warps, enable_fp_fusion=False)
    return out
