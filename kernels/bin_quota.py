"""AdaComp's layer budget: how many of each bin's slots a layer's message keeps when its
bins want more than the layer's capacity (``hvdsparse.oracle.bin_quota`` states the
rule; this module computes it on the device, in place, one program per layer).

Input: ``cnt[b]`` (int32, ``0 <= cnt[b] <= C``) the slots bin ``b`` of a layer of
``nb`` bins wants, a budget ``B`` and a rotation ``rot`` in ``[0, nb)``. Output, in
place: the quota ``q[b]``, the deal of ``B`` slots one per bin per round, round ``r``
giving one more slot to every bin that wants more than ``r - 1``, bins dealt in cyclic
order from ``rot``, until the budget is spent::

    S(r)   = sum_b min(cnt[b], r)                  (r = 0..C; S(0) = 0)
    r*     = max {r : S(r) <= B}
    q[b]   = min(cnt[b], r*) + [cnt[b] > r*  and  rank(b) < B - S(r*)]
    rank(b) = #{bins b' with cnt[b'] > r* before b, counting cyclically from rot}

So ``sum q = min(B, sum cnt)``, ``q <= cnt``, and no bin gets two slots more than
another that wants them. With ``B >= nb * C`` the program returns at once (``q = cnt``).

Program ``j`` handles row ``j`` of an int64 table (bucket rows: ``BIN0``, ``NB``,
``BUDGET``, ``ROT`` at the given columns; its bins are ``cnt[BIN0 + b]``) or, for one
layer, the scalar arguments. Two passes over the row's counts in blocks of ``BLOCK``:
the first sums ``S(r)``, ``T(r) = #{cnt > r}`` and ``A(r) = #{b < rot : cnt[b] > r}``
for every level at once (a ``[BLOCK, CP]`` int32 tile per block, int64 sums); the
second writes ``q`` with a running prefix count of the bins that want more. No atomics,
no host synchronisation.
"""
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _quota_row(cnt_ptr, bin0, nb, budget, rot, C: tl.constexpr, CP: tl.constexpr,
               BLOCK: tl.constexpr):
    if budget < nb * C:
        lv = tl.arange(0, CP)
        s = tl.zeros([CP], dtype=tl.int64)
        t = tl.zeros([CP], dtype=tl.int64)
        a = tl.zeros([CP], dtype=tl.int64)
        for b0 in range(0, nb, BLOCK):
            b = tl.arange(0, BLOCK).to(tl.int64) + b0
            ok = b < nb
            k = tl.load(cnt_ptr + bin0 + b, mask=ok, other=0)
            more = k[:, None] > lv[None, :]
            s += tl.sum(tl.minimum(k[:, None], lv[None, :]), axis=0).to(tl.int64)
            t += tl.sum(more.to(tl.int32), axis=0).to(tl.int64)
            a += tl.sum((more & (b < rot)[:, None]).to(tl.int32), axis=0).to(tl.int64)
        fits = (s <= budget) & (lv <= C)
        rs = tl.max(tl.where(fits, lv, 0), axis=0)
        at = lv == rs
        left = budget - tl.sum(tl.where(at, s, 0), axis=0)
        want = tl.sum(tl.where(at, t, 0), axis=0)
        first = tl.sum(tl.where(at, a, 0), axis=0)
        span = tl.maximum(want, 1)
        carry = tl.zeros([], dtype=tl.int64)
        for b0 in range(0, nb, BLOCK):
            b = tl.arange(0, BLOCK).to(tl.int64) + b0
            ok = b < nb
            k = tl.load(cnt_ptr + bin0 + b, mask=ok, other=0)
            e = ((k > rs) & ok).to(tl.int32)
            ex = carry + (tl.cumsum(e, axis=0) - e).to(tl.int64)
            carry += tl.sum(e, axis=0).to(tl.int64)
            rank = (ex - first + want) % span
            q = tl.minimum(k, rs) + ((e != 0) & (rank < left)).to(tl.int32)
            tl.store(cnt_ptr + bin0 + b, q, mask=ok)


@triton.jit
def _quota_kernel(cnt_ptr, nb, budget, rot, C: tl.constexpr, CP: tl.constexpr,
                  BLOCK: tl.constexpr):
    _quota_row(cnt_ptr, 0, nb, budget, rot, C, CP, BLOCK)


@triton.jit
def _quota_table_kernel(tab_ptr, cnt_ptr, W: tl.constexpr, C_BIN0: tl.constexpr,
                        C_NB: tl.constexpr, C_BUDGET: tl.constexpr, C_ROT: tl.constexpr,
                        C: tl.constexpr, CP: tl.constexpr, BLOCK: tl.constexpr):
    row = tab_ptr + tl.program_id(0).to(tl.int64) * W
    _quota_row(cnt_ptr, tl.load(row + C_BIN0), tl.load(row + C_NB),
               tl.load(row + C_BUDGET), tl.load(row + C_ROT), C, CP, BLOCK)


def quota(cnt, budget, rot, c):
    """One layer's counts ``cnt`` (int32, contiguous, ``nb`` bins) become its quota in
    place (arguments validated by ``hvdsparse.ops.bin_quota``). One launch."""
    nb = cnt.numel()
    _quota_kernel[(1,)](cnt, nb, int(budget), int(rot), C=int(c),
                        CP=triton.next_power_of_2(int(c) + 1), BLOCK=BLOCK, num_warps=4)
    return cnt


def quota_rows(tab, cnt, rows, width, c_bin0, c_nb, c_budget, c_rot, c):
    """Rows ``0..rows-1`` of the int64 device table ``tab`` (``width`` columns): each
    row's counts ``cnt[BIN0 : BIN0 + NB]`` become its quota in place. One launch."""
    _quota_table_kernel[(int(rows),)](tab, cnt, W=int(width), C_BIN0=int(c_bin0),
                                      C_NB=int(c_nb), C_BUDGET=int(c_budget),
                                      C_ROT=int(c_rot), C=int(c),
                                      CP=triton.next_power_of_2(int(c) + 1), BLOCK=BLOCK,
                                      num_warps=4)
    return cnt
