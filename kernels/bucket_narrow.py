"""Index narrowing of a whole message's segments in one launch: INT32 slots (a layer's
element indices, in any order) -> the BIN_U16 / BIN_U8 wire form (per-bin counts, the
position inside the bin, the values grouped by bin in ascending bin order).

The members (segments of one value dtype in one message) are rows of an int64 table
``tab[L, W]`` (columns ``N_*`` below): the member's first slot ``s0`` and capacity
``C`` in the joined slot arrays, its first bin ``b0`` and bin count ``nb`` in the joined
count arrays, its bin size ``B``, the wire width ``w`` (1, 2 or 4 bytes) of its bin
counts, and the layer's size ``N``. ``cnt[j * cnt_stride]`` (int32, on the device) is
member ``j``'s used slots ``c`` (clamped to ``[0, C]``).

One program per member (``grid = (L,)``), four passes separated by block barriers::

    zero       counts[b0 + k] = 0                               k < nb
    histogram  counts[b0 + idx[s0 + t] // B] += 1               t < c, valid index
    scan       start[b0 + k] = sum(counts[b0 : b0 + k])         (exclusive; also the
               w = 2 / w = 1 copies of counts, written as int16 / uint8 bits)
    place      t < c, valid:  p = start[b0 + b]++ (b = idx // B)
                              rel[s0 + p] = idx - b * B  (low 16 bits), pval[s0 + p] = val[s0 + t]
               c <= t < C:    rel[s0 + t] = 0, pval[s0 + t] = val[s0 + t]  (padding, verbatim)

An index is *valid* when ``0 <= idx < N`` (the layer's size); an invalid one is neither
counted nor placed, so the bin counts sum to less than ``c`` and every receiver's check
rejects the segment (``kernels/bucket_decode.py``: error 4) -- never a silent drop.

Order inside a bin is the order in which the slot reservations (relaxed atomics) land:
on a GPU not necessarily by index. The receiver's sum does not depend on it (a
segment's indices are distinct, each lands in its own element; ranks are added in rank
order), so replicas stay bitwise identical; the message bytes themselves are fixed only
up to that order, as the select's slot order already is (``kernels/select.py``). Triton's
interpreter runs the lanes in order, so there the order is the slots' order.

Counts and reservations are relaxed atomics on global memory, read back after a block
barrier (``__syncthreads`` orders the block's global writes) with volatile loads. Offsets
are int64.
"""
import triton
import triton.language as tl

# columns of the member table (int64)
N_S0, N_CAP, N_B0, N_NB, N_B, N_W, N_N = range(7)
W_TAB = 7


@triton.jit
def _narrow_kernel(tab_ptr, idx_ptr, val_ptr, cnt_ptr, cnt_stride, rel_ptr, pval_ptr, c32_ptr,
                   c16_ptr, c8_ptr, start_ptr, W: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0)
    row = tab_ptr + j.to(tl.int64) * W
    s0 = tl.load(row + 0)
    cap = tl.load(row + 1)
    b0 = tl.load(row + 2)
    nb = tl.load(row + 3)
    B = tl.load(row + 4)
    w = tl.load(row + 5)
    n = tl.load(row + 6)
    c = tl.load(cnt_ptr + j.to(tl.int64) * cnt_stride).to(tl.int64)
    c = tl.minimum(tl.maximum(c, 0), cap)
    offs = tl.arange(0, BLOCK).to(tl.int64)

    for k0 in range(0, nb, BLOCK):
        k = k0 + offs
        tl.store(c32_ptr + b0 + k, tl.zeros([BLOCK], dtype=tl.int32), mask=k < nb)
    tl.debug_barrier()

    ones = tl.full([BLOCK], 1, tl.int32)
    for t0 in range(0, c, BLOCK):
        t = t0 + offs
        used = t < c
        i = tl.load(idx_ptr + s0 + t, mask=used, other=0).to(tl.int64)
        b = i // B
        ok = used & (i >= 0) & (i < n)
        tl.atomic_add(c32_ptr + b0 + b, ones, mask=ok, sem="relaxed")
    tl.debug_barrier()

    carry = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), axis=0)
    for k0 in range(0, nb, BLOCK):
        k = k0 + offs
        m = k < nb
        x = tl.load(c32_ptr + b0 + k, mask=m, other=0, volatile=True)
        tl.store(start_ptr + b0 + k, tl.cumsum(x, axis=0) - x + carry, mask=m)
        carry += tl.sum(x, axis=0)
        tl.store(c16_ptr + b0 + k, x.to(tl.int16), mask=m & (w == 2))
        tl.store(c8_ptr + b0 + k, x.to(tl.uint8), mask=m & (w == 1))
    tl.debug_barrier()

    for t0 in range(0, cap, BLOCK):
        t = t0 + offs
        inb = t < cap
        used = t < c
        i = tl.load(idx_ptr + s0 + t, mask=used, other=0).to(tl.int64)
        b = i // B
        ok = used & (i >= 0) & (i < n)
        p = tl.atomic_add(start_ptr + b0 + b, ones, mask=ok, sem="relaxed").to(tl.int64)
        dst = tl.where(used, p, t)
        put = inb & (ok | (t >= c))
        v = tl.load(val_ptr + s0 + t, mask=put)
        r = tl.where(used, i - b * B, 0).to(tl.int16)
        tl.store(rel_ptr + s0 + dst, r, mask=put)
        tl.store(pval_ptr + s0 + dst, v, mask=put)


def narrow(tab, idx, vals, cnt, rel, pvals, counts, counts16, counts8, start, *,
           block: int = 1024):
    """Launch :func:`_narrow_kernel` over ``tab``'s ``L`` members (module docstring).
    ``counts`` / ``start``: int32 over all members' bins; ``counts16`` (int16) /
    ``counts8`` (uint8): the same length, or any tensor of that dtype when no member
    has that width (never written then)."""
    L = tab.shape[0]
    if L:
        _narrow_kernel[(L,)](tab, idx, vals, cnt, cnt.stride(0), rel, pvals, counts,
                             counts16, counts8, start, W=W_TAB, BLOCK=block, num_warps=4)
