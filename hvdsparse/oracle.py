"""Plain definitions of every compression operation: the test oracle.

Each function is a few lines of ordinary torch (CPU, slow, no chunking, no threads, no
in-place tricks) whose docstring is the math. The optimised CPU path
(:mod:`hvdsparse.cpu`) and the Triton kernels (``kernels/``) are tested against these
definitions bit for bit (``tests/test_oracle.py``); this module is never used on the
training path. It imports nothing of hvdsparse and shares no code with the modules it
checks (its Philox is written out again from the paper).

Floating point: every line below is one IEEE fp32 operation with round-to-nearest-even
(torch on CPU never fuses a multiply and an add); the kernels are compiled with
``enable_fp_fusion=False`` where a product feeds a sum, so they round the same way.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

_M32 = 0xFFFFFFFF


def _mulhilo(a: int, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * x`` (a, x < 2**32; int64 tensors), using 16-bit
    halves so no intermediate exceeds 2**63."""
    lo_part = (x & 0xFFFF) * a
    hi_part = (x >> 16) * a + (lo_part >> 16)
    return hi_part >> 16, ((hi_part & 0xFFFF) << 16) | (lo_part & 0xFFFF)


def philox_uint32(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """Philox 4x32-10 (Salmon et al., SC'11), first output word, for each int64 counter:
    block ``(c_lo, c_hi, 0, 0)``, key ``(seed_lo, seed_hi)``, round constants
    0xD2511F53 / 0xCD9E8D57, key bumps 0x9E3779B9 / 0xBB67AE85. Returns int64 in
    [0, 2**32). Triton's ``tl.randint(seed, c)`` is this function."""
    c = [counters.to(torch.int64) & _M32, (counters.to(torch.int64) >> 32) & _M32,
         torch.zeros_like(counters, dtype=torch.int64), torch.zeros_like(counters, dtype=torch.int64)]
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi0, lo0 = _mulhilo(0xD2511F53, c[0])
        hi1, lo1 = _mulhilo(0xCD9E8D57, c[2])
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return c[0]


def philox_uniform(seed: int, n: int, offset: int = 0) -> torch.Tensor:
    """fp32[n]: ``u_i = fp32(j) * fp32(4.6566127342e-10)`` with ``w`` = Philox word of
    counter ``offset + i``, ``j = int32(w)`` and ``j -> -j - 1`` when negative (Triton's
    ``uint_to_uniform_float``); u in [0, 1)."""
    w = philox_uint32(seed, torch.arange(offset, offset + n, dtype=torch.int64))
    j = torch.where(w >= 2**31, w - 2**32, w)
    j = torch.where(j < 0, -j - 1, j)
    return j.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)


def residual_add_binmax(grad: torch.Tensor, residual: torch.Tensor, bin_size: int,
                        grad_scale: Optional[torch.Tensor] = None
                        ) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Returns ``(new_residual, binmax, nonfinite)`` (inputs untouched)::

        d        = fp32(grad) * grad_scale      (no multiply when grad_scale is None)
        new[i]   = residual[i] + d[i]   if d[i] is finite, else residual[i]
        binmax_b = max_{i in bin b} |new[i]|   (NaN if the bin holds a NaN, as torch.amax)
        nonfinite = #{i : d[i] is NaN or +-Inf}
    """
    d = grad.to(torch.float32)
    if grad_scale is not None:
        d = d * grad_scale.reshape(()).to(torch.float32)
    fin = torch.isfinite(d)
    new = torch.where(fin, residual + d, residual)
    return new, _bin_absmax(new, bin_size), int((~fin).sum())


def clean_grad(grad: torch.Tensor, grad_scale: Optional[torch.Tensor] = None
               ) -> Tuple[torch.Tensor, int]:
    """``d = fp32(grad) * s`` (``s = grad_scale[0]``, no multiply without one); each
    element kept if ``|d| < inf`` else +0.0. Returns (fp32 tensor, number of non-finite
    elements), element by element in Python floats rounded to fp32."""
    g = grad.float().tolist()
    s = None if grad_scale is None else float(grad_scale.reshape(-1)[0])
    out, bad = [], 0
    for x in g:
        d = x if s is None else float(torch.tensor(x, dtype=torch.float32) *
                                      torch.tensor(s, dtype=torch.float32))
        if abs(d) < float("inf"):
            out.append(d)
        else:
            out.append(0.0)
            bad += 1
    return torch.tensor(out, dtype=torch.float32), bad


def zero_slots(flat: torch.Tensor, positions: torch.Tensor, count: int) -> torch.Tensor:
    """A copy of ``flat`` with ``flat[positions[j]] = 0`` for every slot ``j < count``."""
    out = flat.clone()
    for j in range(min(int(count), positions.numel())):
        out[int(positions[j])] = 0
    return out


def binned_pack(acc: torch.Tensor, grad: torch.Tensor, h_scale: float,
                threshold: torch.Tensor, bin_size: int, c: int, scale: torch.Tensor,
                grad_scale: Optional[torch.Tensor] = None, budget: Optional[int] = None,
                rot: int = 0):
    """AdaComp's pack of one layer. ``d = fp32(grad) * grad_scale`` (0 if not finite),
    ``h = acc + d * (h_scale - 1)``. Per bin ``b`` (``bin_size`` consecutive elements,
    last one partial) the elements with ``|h| >= threshold[b]`` pass; the ``c`` with the
    largest ``|h|`` (ties: lower index) are sent in that order, bins one after another
    -- with a ``budget``, only the first ``bin_quota(counts, budget, rot)[b]`` of them.
    Sent element ``i``: sign bit ``acc_i < 0``, residue ``acc_i + (-q)``, ``q = -s`` if
    negative else ``s`` (``s = scale``). Returns ``(new acc, rel int64[cap], negative
    bool[cap], count, bin_counts list, selected)`` with ``cap = nb * c`` or the budget;
    unused slots 0 / False."""
    n, L = acc.numel(), int(bin_size)
    nb = -(-n // L)
    cap = nb * c if budget is None else int(budget)
    d = grad.reshape(-1).float()
    if grad_scale is not None:
        d = d * grad_scale.reshape(1)
    d = torch.where(torch.isfinite(d), d, torch.zeros(()))
    h = (acc + d * torch.tensor(float(h_scale) - 1.0)).abs()
    out = acc.clone()
    rel = torch.zeros(cap, dtype=torch.int64)
    neg = torch.zeros(cap, dtype=torch.bool)
    s = scale.reshape(()).float()
    selected, per_bin = 0, []
    for b in range(nb):
        lo, hi = b * L, min(n, (b + 1) * L)
        passing = [i for i in range(lo, hi) if float(h[i]) >= float(threshold[b])]
        selected += len(passing)
        passing.sort(key=lambda i: (-float(h[i]), i))
        per_bin.append(passing[:c])
    quota = [len(p) for p in per_bin]
    if budget is not None:
        quota = bin_quota(quota, budget, rot)
    slot = 0
    for b in range(nb):
        for i in per_bin[b][:quota[b]]:
            ng = bool(acc[i] < 0)
            q = -s if ng else s
            out[i] = acc[i] + (-q)
            rel[slot], neg[slot] = i - b * L, ng
            slot += 1
    return out, rel, neg, slot, quota, selected


def bin_quota(cnt: Sequence[int], budget: int, rot: int) -> List[int]:
    """AdaComp's layer budget: ``budget`` slots dealt to the bins one at a time, round
    after round, each round visiting the bins in cyclic order from bin ``rot`` and
    giving one more slot to every bin whose quota is still below ``cnt[b]``, until the
    budget or the demand runs out. Returns the quota per bin."""
    nb = len(cnt)
    q = [0] * nb
    left = int(budget)
    for _ in range(max(cnt, default=0)):
        for i in range(nb):
            b = (int(rot) + i) % nb
            if left and q[b] < int(cnt[b]):
                q[b] += 1
                left -= 1
    return q


#: lanes of the segment-mean order (kernels/segment_mean.py's BLOCK)
SEGMENT_MEAN_LANES = 1024


def segment_mean(x: torch.Tensor) -> torch.Tensor:
    """0-d fp32: the mean of fp32 ``x`` with its sum in this order, one fp32 addition at
    a time: lane ``i < 1024`` adds ``x[i], x[1024 + i], x[2048 + i], ...`` in turn
    (starting from +0), then the lanes are summed pairwise, ``a'[i] = a[2i] + a[2i+1]``,
    until one is left; the sum is divided by ``n`` once (correctly rounded)."""
    vals = [float(v) for v in x.reshape(-1).to(torch.float32)]
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))   # noqa: E731
    lanes = [0.0] * SEGMENT_MEAN_LANES
    for k, v in enumerate(vals):
        i = k % SEGMENT_MEAN_LANES
        lanes[i] = f32(lanes[i] + v)
    while len(lanes) > 1:
        lanes = [f32(lanes[2 * i] + lanes[2 * i + 1]) for i in range(len(lanes) // 2)]
    return (torch.tensor([lanes[0]], dtype=torch.float32)
            / torch.tensor([float(len(vals))], dtype=torch.float32)).reshape(())


def _bin_absmax(x: torch.Tensor, L: int) -> torch.Tensor:
    """``max |x[b*L:(b+1)*L]|`` per bin (last bin partial): zero-padded to whole bins
    (0 never exceeds an absolute value), then ``torch.amax`` per row (NaN propagates)."""
    nb = -(-x.numel() // L)
    return torch.nn.functional.pad(x.abs(), (0, nb * L - x.numel())).view(nb, L).amax(1) \
        if nb else torch.zeros(0)


def select_compact(acc: torch.Tensor, threshold: torch.Tensor, capacity: int, *,
                   bin_size: int = 0, grad: Optional[torch.Tensor] = None,
                   h_scale: float = 1.0, value_encoding: int = 0,
                   sign_scale: Optional[float] = None,
                   grad_scale: Optional[torch.Tensor] = None) -> dict:
    """Selection with error feedback, ascending index order. Returns a dict with
    ``selected`` (all selected indices, ascending), ``sent`` (the first ``capacity`` of
    them), ``values`` (the wire values of ``sent``: fp32/fp16/bf16 cast of acc, or for
    SIGN1 (code 6) the bools ``acc < 0``), ``new_acc`` (the residual after the update)::

        g     = fp32(grad) * grad_scale            h = acc + g * fp32(h_scale - 1)
        h     = acc when grad is None or h_scale == 1
        sel_i = |h_i| >= thr_i,  thr_i = threshold or threshold[i // bin_size]
        new_acc_i = acc_i - dequant(value_i) for sent i (0 for fp32, the cast error for
                    fp16/bf16, acc_i - (-s if acc_i < 0 else s) for SIGN1), else acc_i
    """
    h = acc
    hm1 = float(h_scale) - 1.0
    if grad is not None and hm1 != 0.0:
        g = grad.to(torch.float32)
        if grad_scale is not None:
            g = g * grad_scale.reshape(()).to(torch.float32)
        h = acc + g * torch.tensor(hm1, dtype=torch.float32)
    thr = threshold.reshape(-1)
    if bin_size and thr.numel() > 1:
        thr = thr.repeat_interleave(bin_size)[: acc.numel()]
    selected = torch.nonzero(h.abs() >= thr).reshape(-1)
    sent = selected[:capacity]
    a = acc[sent]
    new_acc = acc.clone()
    if value_encoding == 0:
        values, new_acc[sent] = a, 0.0
    elif value_encoding in (1, 2):
        values = a.to(torch.float16 if value_encoding == 1 else torch.bfloat16)
        new_acc[sent] = a - values.float()
    else:
        s = torch.tensor(float(sign_scale), dtype=torch.float32)
        values = a < 0
        new_acc[sent] = a - torch.where(values, -s, s)
    return dict(selected=selected, sent=sent, values=values, new_acc=new_acc)


def quantize(values: torch.Tensor, bits: int, bucket_size: int, seed: int,
             count: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(codes int64[n] unpacked, scales fp32[nbuckets])``::

        v_j      = fp32(values[j]), 0 for j >= count;  s = 2**(bits-1) - 1
        scale_b  = max_{j in bucket b} |v_j|            (NaN if the bucket holds a NaN)
        r_j      = fp32(fp32(|v_j| * s) / scale_b)  if 0 < scale_b < inf, else 0
        q_j      = min(s, floor(r_j) + (u_j < r_j - floor(r_j))), negated when v_j < 0
        code_j   = q_j + 2**(bits-1),   u = philox_uniform(seed, n)
    """
    v = values.to(torch.float32).clone()
    if count is not None:
        v[max(0, count):] = 0.0
    n, s, B = v.numel(), (1 << (bits - 1)) - 1, bucket_size
    scales = _bin_absmax(v, B)
    sc = scales.repeat_interleave(B)[:n]
    ok = (sc > 0) & (sc < float("inf"))
    r = torch.where(ok, (v.abs() * s) / torch.where(ok, sc, 1.0), 0.0)
    fl = torch.floor(r)
    q = torch.minimum(fl + (philox_uniform(seed, n) < r - fl).float(), torch.tensor(float(s)))
    q = torch.where(v < 0, -q, q)
    return q.to(torch.int64) + (1 << (bits - 1)), scales


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8[ceil(n*bits/8)]: code j (< 2**bits) ORed into byte ``j*bits // 8`` at bit
    ``(j*bits) % 8``."""
    n = codes.numel()
    j = torch.arange(n)
    out = torch.zeros(-(-n * bits // 8), dtype=torch.int64)
    out.index_add_(0, (j * bits) // 8, codes.to(torch.int64) << ((j * bits) % 8))
    return out.to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """int64[n]: code j = ``(packed[j*bits // 8] >> ((j*bits) % 8)) & (2**bits - 1)``."""
    j = torch.arange(n)
    return (packed.to(torch.int64)[(j * bits) // 8] >> ((j * bits) % 8)) & ((1 << bits) - 1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, bucket_size: int,
               n: int) -> torch.Tensor:
    """fp32[n]: ``fp32(fp32(q_j * scale[j // bucket_size]) / s)``, ``q = code - 2**(bits-1)``
    (a NaN/Inf scale with q = 0 gives NaN)."""
    q = (codes[:n].to(torch.int64) - (1 << (bits - 1))).to(torch.float32)
    sc = scales.to(torch.float32).repeat_interleave(bucket_size)[:n]
    return (q * sc) / float((1 << (bits - 1)) - 1)


def scatter_add_decode(dense: torch.Tensor,
                       rows: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Returns ``dense`` plus every row's values at its indices, rows added one after the
    other in row (rank) order: ``out = (((dense + row_0) + row_1) + ...)`` elementwise in
    fp32. ``rows``: (int64 indices, fp32 decoded values) per row; indices inside a row are
    unique (a valid message)."""
    out = dense.clone()
    for idx, val in rows:
        out[idx] = out[idx] + val.to(torch.float32)
    return out


def row_threshold(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """DCT-MP row threshold of a [B, d] tensor: ``(cols int64[B, k] ascending, mask
    bool[B, d])``. Every row keeps its ``k`` largest ``|x|``; ties keep the lowest
    columns; NaN counts as larger than any number. Written as: order the columns by
    the int32 bit pattern of ``|x|`` (monotone in the value, NaN above +Inf), largest
    first, ties by column (a stable sort), keep the first ``k``."""
    bits = x.abs().float().view(torch.int32)
    order = torch.sort(bits, dim=1, descending=True, stable=True).indices[:, :k]
    cols = order.sort(dim=1).values
    mask = torch.zeros(x.shape, dtype=torch.bool).scatter_(1, cols, True)
    return cols, mask


def refine_topk_threshold(acc: torch.Tensor, v: torch.Tensor, k: int, capacity: int,
                          r0: int, rounds: int) -> torch.Tensor:
    """TopK's threshold refinement. ``v``: the ``m`` largest ``|sample|``, descending;
    ``target = (k + capacity) / 2``; start at sample rank ``r = r0``, ``t = v[r - 1]``;
    each round counts ``c = #{|acc| >= t}`` and, unless ``k <= c <= capacity``, moves
    to ``r = clamp(round(r * target / max(c, 1)), 1, m)`` (round half to even),
    ``t = v[r - 1]``. Returns ``max(t, smallest normal fp32)``, 0-d fp32. Every value
    is an fp32 tensor, so each product and quotient is one fp32 rounding."""
    one = torch.tensor(1.0, dtype=torch.float32)
    target = torch.tensor(0.5 * (k + capacity), dtype=torch.float32)
    kf = torch.tensor(float(k), dtype=torch.float32)
    capf = torch.tensor(float(capacity), dtype=torch.float32)
    r = torch.tensor(float(r0), dtype=torch.float32)
    t = v[r0 - 1].clone()
    for _ in range(rounds):
        c = (acc.abs() >= t).sum().to(torch.float32)
        if bool(c >= kf) and bool(c <= capf):
            continue
        r = torch.round(r * target / torch.maximum(c, one)).clamp(1.0, float(v.numel()))
        t = v[int(r) - 1].clone()
    return torch.maximum(t, torch.tensor(torch.finfo(torch.float32).tiny))


__all__: List[str] = ["philox_uint32", "philox_uniform", "residual_add_binmax",
                      "select_compact", "quantize", "pack", "unpack", "dequantize",
                      "scatter_add_decode", "row_threshold", "refine_topk_threshold",
                      "clean_grad", "zero_slots", "binned_pack", "bin_quota"]
