"""TopK's threshold refinement (step 4 of ``hvdsparse/compressors/topk.py``): one launch
per counting round plus one single-program launch for the result, instead of ~14 small
device ops per round.

Inputs: the layer's fp32 ``acc`` (n elements), ``v`` = the ``m`` largest ``|sample|``
sorted descending, the host integers ``k <= capacity``, the first sample rank ``r0``
and the number of rounds ``R``. The rule, with ``target = (k + capacity) / 2`` and every
step one fp32 rounding (``oracle.refine_topk_threshold`` is the plain definition)::

    r = r0; t = v[r - 1]
    for round j < R:
        c_j = #{i : |acc_i| >= t}                       # the counting pass
        if not (k <= c_j <= capacity):
            r = clamp(round_half_even(r * target / max(c_j, 1)), 1, m); t = v[r - 1]
    return max(t, smallest normal fp32)

Launch layout: round j is ``_refine_count_kernel`` with ``ROUND = j``, program ``p``
counting elements ``[p*BLOCK, (p+1)*BLOCK)`` (int64 offsets; every block but the last
read unmasked, so 128-bit loads) into ``counts[j]`` with one relaxed ``atomic_add`` per
program. Every program first replays rounds ``0 .. j-1`` from ``counts[0 .. j-1]`` (a
few scalar loads; every program computes the same ``t``), so no launch has to publish
``t`` to the next. ``_refine_final_kernel`` (one program) replays all ``R`` rounds and
writes the threshold. Counts are int32 (n < 2**31, checked by the caller), compared as
fp32 as the torch definition does. Nothing synchronises with the host.

Rounding: ``r * target`` and the division are separate fp32 roundings (``div_rn``, the
IEEE division, not the approximate one; compiled with ``enable_fp_fusion=False``);
round-half-even is ``floor(x + 0.5)`` corrected on exact ties to odd, exact for
``x < 2**22`` -- larger ``x`` is clamped to ``2**22`` first, which changes nothing
because the result is clamped to ``m`` anyway, and TopK's ``m = min(s, 4 r0 + 16)``
with ``r0 <= 4096`` is far below ``2**22`` (checked by ``hvdsparse.ops``).
"""
import torch
import triton
import triton.language as tl

_TINY = float(torch.finfo(torch.float32).tiny)


@triton.jit
def replay_rounds(v_ptr, cnt_ptr, r0, mf, kf, capf, target, ROUNDS: tl.constexpr):
    """``t`` after rounds ``0 .. ROUNDS-1`` (the module docstring's rule).

    ``r0`` may arrive as a runtime i32 or as a Python int (a JIT specialises an integer
    argument equal to 1 to a constexpr, which has no ``.to``): ``tl.cast`` takes both,
    and int -> fp32 is exact here (``r0 <= 4096``)."""
    r = tl.cast(r0, tl.float32)
    t = tl.load(v_ptr + (r0 - 1))
    for j in tl.static_range(ROUNDS):
        c = tl.load(cnt_ptr + j).to(tl.float32)
        ok = (c >= kf) & (c <= capf)
        x = tl.math.div_rn(r * target, tl.maximum(c, 1.0))
        x = tl.minimum(x, 4194304.0)
        f = tl.floor(x + 0.5)
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        f = tl.where(((f - x) == 0.5) & odd, f - 1.0, f)
        r_new = tl.minimum(tl.maximum(f, 1.0), mf)
        t_new = tl.load(v_ptr + (r_new.to(tl.int32) - 1))
        t = tl.where(ok, t, t_new)
        r = tl.where(ok, r, r_new)
    return t


#: ``r0`` is not specialised (1 / divisible by 16 / other): it is a scalar rank that no
#: address or loop depends on, so every value shares one compiled kernel per round.
@triton.jit(do_not_specialize=["r0"])
def _refine_count_kernel(acc_ptr, v_ptr, cnt_ptr, n, r0, mf, kf, capf, target,
                         ROUND: tl.constexpr, BLOCK: tl.constexpr):
    t = replay_rounds(v_ptr, cnt_ptr, r0, mf, kf, capf, target, ROUND)
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:       # every block but the last: unmasked, 128-bit loads
        ge = tl.abs(tl.load(acc_ptr + offs)) >= t
    else:
        inb = offs < n
        ge = (tl.abs(tl.load(acc_ptr + offs, mask=inb, other=0.0)) >= t) & inb
    c = tl.sum(ge.to(tl.int32), axis=0)
    tl.atomic_add(cnt_ptr + ROUND, c, mask=c > 0, sem="relaxed")


@triton.jit(do_not_specialize=["r0"])
def _refine_final_kernel(v_ptr, cnt_ptr, out_ptr, r0, mf, kf, capf, target, tiny,
                         ROUNDS: tl.constexpr):
    t = replay_rounds(v_ptr, cnt_ptr, r0, mf, kf, capf, target, ROUNDS)
    tl.store(out_ptr, tl.maximum(t, tiny))


def refine_topk_threshold(acc, v, k, capacity, r0, rounds, *, counts=None, block=4096,
                          num_warps=8):
    """Triton version of ``hvdsparse.oracle.refine_topk_threshold`` (arguments already
    validated by ``hvdsparse.ops``). Returns a 0-d fp32 tensor on ``acc``'s device.
    ``counts``: optional int32[>= rounds] scratch (zeroed here)."""
    n = acc.numel()
    m = v.numel()
    dev = acc.device
    if counts is None:
        counts = torch.zeros(max(rounds, 1), dtype=torch.int32, device=dev)
    else:
        counts = counts[:max(rounds, 1)]
        counts.zero_()
    out = torch.empty((), dtype=torch.float32, device=dev)
    kf, capf, mf = float(k), float(capacity), float(m)
    target = 0.5 * (k + capacity)
    grid = (triton.cdiv(max(n, 1), block),)
    for j in range(rounds):
        _refine_count_kernel[grid](acc, v, counts, n, int(r0), mf, kf, capf, target,
                                   ROUND=j, BLOCK=block, num_warps=num_warps,
                                   enable_fp_fusion=False)
    _refine_final_kernel[(1,)](v, counts, out, int(r0), mf, kf, capf, target, _TINY,
                               ROUNDS=rounds, num_warps=1, enable_fp_fusion=False)
    return out
