"""Fused residual add + per-bin abs max (operation 1 of docs/design.md).

``residual += grad.float()`` in place and ``binmax[b] = max |residual[b*L:(b+1)*L]|``
in one launch. Each program owns ``ROWS`` whole bins and walks them as a
``[ROWS, CHUNK]`` tile (``CHUNK = min(next_pow2(L), max_chunk)``), looping over the bin
in ``CHUNK`` steps when ``L > CHUNK``: grad and residual are read once, residual written
once, binmax written once (by the program that owns the bin), no atomics.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _residual_add_binmax_kernel(grad_ptr, res_ptr, binmax_ptr, n, nbins, L,
                                ROWS: tl.constexpr, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < nbins
    row_start = rows.to(tl.int64) * L
    cols = tl.arange(0, CHUNK)
    m = tl.zeros([ROWS], dtype=tl.float32)
    for c0 in range(0, L, CHUNK):
        col = c0 + cols
        offs = row_start[:, None] + col[None, :]
        mask = row_ok[:, None] & (col[None, :] < L) & (offs < n)
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        a = r + g
        tl.store(res_ptr + offs, a, mask=mask)
        m = tl.maximum(m, tl.max(tl.abs(a), axis=1))
    tl.store(binmax_ptr + rows, m, mask=row_ok)


def residual_add_binmax(grad, residual, bin_size, *, out=None, block=4096, max_chunk=1024):
    """Triton version of ``hvdsparse.reference.residual_add_binmax`` (same contract).

    ``block``: elements per program (rounded to whole bins, at least one bin);
    ``max_chunk``: widest column tile (power of 2).
    """
    n = residual.numel()
    L = int(bin_size)
    nbins = -(-n // L)
    if out is None:
        out = torch.empty(nbins, dtype=torch.float32, device=residual.device)
    if n == 0:
        return out
    chunk = min(triton.next_power_of_2(L), max_chunk)
    rows = triton.next_power_of_2(max(1, block // chunk))
    rows = min(rows, triton.next_power_of_2(nbins))
    grid = (triton.cdiv(nbins, rows),)
    _residual_add_binmax_kernel[grid](grad, residual, out, n, nbins, L, ROWS=rows, CHUNK=chunk)
    return out
