"""A gradient made safe to accumulate: scaled to fp32, non-finite elements zeroed and
counted, in one pass (the first step of the paths whose gradient does not go through
the residual add: policy-dense layers, momentum correction's velocity, the Adam recipe).

Math (bit for bit the same as ``hvdsparse.cpu.clean_grad`` and ``hvdsparse.oracle``)::

    d[i]   = fp32(grad[i]) * s        one fp32 rounding; s = grad_scale[0], no multiply
                                       at all when grad_scale is None
    out[i] = d[i] if |d[i]| < inf     (NaN and +-Inf fail the test; -0.0 stays -0.0)
           = +0.0 otherwise
    nonfinite[0] += #{i : not |d[i]| < inf}      when a ``nonfinite`` tensor is given

Launch layout: program ``p`` owns ``[p*BLOCK, (p+1)*BLOCK)`` (int64 offsets; every block
but the last unmasked, so 128-bit loads); one relaxed ``atomic_add`` per program that
saw a non-finite element. No host synchronisation.
"""
import torch
import triton
import triton.language as tl

from .residual import load_block, store_block


@triton.jit
def _clean_block(g_ptr, o_ptr, nf_ptr, start, n, s, HAS_SCALE: tl.constexpr,
                 HAS_NF: tl.constexpr, BLOCK: tl.constexpr, FULL: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    d = load_block(g_ptr, offs, mask, FULL).to(tl.float32)
    if HAS_SCALE:
        d = d * s
    fin = tl.abs(d) < float("inf")
    store_block(o_ptr, offs, tl.where(fin, d, 0.0), mask, FULL)
    if HAS_NF:
        bad = tl.sum(((~fin) & mask).to(tl.int32), axis=0)
        tl.atomic_add(nf_ptr, bad, mask=bad > 0, sem="relaxed")


@triton.jit
def _clean_kernel(g_ptr, o_ptr, scale_ptr, nf_ptr, n, HAS_SCALE: tl.constexpr,
                  HAS_NF: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    s = 1.0
    if HAS_SCALE:
        s = tl.load(scale_ptr)
    if start + BLOCK <= n:       # every block but the last: unmasked, 128-bit loads
        _clean_block(g_ptr, o_ptr, nf_ptr, start, n, s, HAS_SCALE, HAS_NF, BLOCK, True)
    else:
        _clean_block(g_ptr, o_ptr, nf_ptr, start, n, s, HAS_SCALE, HAS_NF, BLOCK, False)


def clean_grad(grad, *, grad_scale=None, nonfinite=None, out=None, block=4096,
               num_warps=8):
    """Triton version of ``hvdsparse.cpu.clean_grad`` (arguments validated by
    ``hvdsparse.ops``): returns the fp32 ``out`` (new unless given)."""
    n = grad.numel()
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=grad.device)
    if n == 0:
        return out
    has_scale = grad_scale is not None
    has_nf = nonfinite is not None
    _clean_kernel[(triton.cdiv(n, block),)](
        grad, out, grad_scale.reshape(-1) if has_scale else out,
        nonfinite if has_nf else out, n, HAS_SCALE=has_scale, HAS_NF=has_nf, BLOCK=block,
        num_warps=num_warps)
    return out
