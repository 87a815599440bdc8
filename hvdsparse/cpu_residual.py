"""The CPU path of the element-wise passes over a gradient and its residual:
:func:`residual_add_binmax` / :func:`residual_add` (error-feedback accumulation with the
non-finite policy, and the per-bin abs max), :func:`clean_grad` (the same non-finite
rule for a gradient that is not accumulated) and :func:`zero_slots` (zeroing the sent
slots of a buffer).

Same results bit for bit as ``kernels/residual.py``, ``kernels/clean.py`` and
``kernels/masking.py``; the math is stated in :mod:`hvdsparse.oracle`. Chunked and
threaded as :mod:`hvdsparse.cpu_chunking` says.
"""
from __future__ import annotations

import threading
from typing import Optional

import numpy as np
import torch

from . import cpu_chunking
from .cpu_checks import check_clean_args, check_residual_args, check_zero_slots_args
from .philox import par_ranges, par_run


def clean_grad(grad: torch.Tensor, *, grad_scale: Optional[torch.Tensor] = None,
               nonfinite: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``d = fp32(grad) * grad_scale``; returns ``where(isfinite(d), d, +0.0)`` (a new fp32
    tensor; -0.0 stays -0.0) and adds ``#non-finite(d)`` to ``nonfinite[0]`` -- the
    residual add's rule (:func:`residual_add_binmax`) for gradients that go elsewhere.
    Torch ops (any device, no host sync); the Triton kernel is ``kernels/clean.py``."""
    check_clean_args(grad, grad_scale, nonfinite)
    d = grad.float() if grad_scale is None else grad.float() * grad_scale.reshape(1)
    fin = torch.isfinite(d)
    if nonfinite is not None:
        nonfinite[:1].add_((~fin).sum(dtype=torch.int32).reshape(1))
    return torch.where(fin, d, torch.zeros((), dtype=torch.float32, device=d.device))


def zero_slots(flat: torch.Tensor, positions: torch.Tensor, count: torch.Tensor) -> None:
    """``flat[positions[j]] = 0`` for ``j < count`` (DGC's momentum-factor masking of one
    own payload segment). CPU tensors: numpy (the count is read from host memory).
    Other devices: device ops only (no host sync): slots at or past ``count``
    are pointed at slot 0's position and write what is there (0 when ``count > 0``:
    slot 0 is then a sent one; its old value otherwise). An out-of-range position of a
    sent slot raises (index_put_). The Triton kernel is ``kernels/masking.py``."""
    check_zero_slots_args(flat, positions, count)
    C = positions.numel()
    if C == 0 or flat.numel() == 0:
        return
    if flat.device.type == "cpu" and flat.dtype in (torch.float32, torch.float64):
        # host memory: read the count and zero the sent slots directly (numpy fancy
        # indexing; ~5x fewer passes than the device-op form below)
        c = min(int(count.reshape(-1).numpy()[0]), C)
        if c > 0:
            pn = positions.numpy()[:c]
            if int(pn.min()) < 0 or int(pn.max()) >= flat.numel():
                raise IndexError(f"zero_slots: a sent position is outside [0, "
                                 f"{flat.numel()})")
            flat.detach().numpy()[pn] = 0
        return
    pos = positions.long()
    cnt = count.reshape(()).long()
    first = pos[:1].clamp(0, flat.numel() - 1)
    valid = torch.arange(C, device=flat.device) < cnt
    target = torch.where(valid, pos, first)
    fill = torch.where(cnt > 0, torch.zeros((), dtype=flat.dtype, device=flat.device),
                       flat[first])
    flat.index_put_((target,), fill.expand(C))


def _add_chunk_torch(r: torch.Tensor, g: torch.Tensor, s) -> int:
    """``r[i] += fp32(g[i]) * s`` where that addend is finite; returns the number of
    non-finite addends (host int). Two separate roundings (torch never contracts)."""
    d = g.to(torch.float32)
    if s is not None:
        d = d * s
    fin = torch.isfinite(d)
    if bool(fin.all()):
        r.add_(d)
        return 0
    r.copy_(torch.where(fin, r + d, r))
    return int((~fin).sum())


def residual_add(grad: torch.Tensor, residual: torch.Tensor, *,
                 grad_scale: Optional[torch.Tensor] = None,
                 nonfinite: Optional[torch.Tensor] = None) -> None:
    """:func:`residual_add_binmax` without the bin maxima, for callers that ignore them
    (TopK, Threshold, RandomK, QSGD): the same residual bits and non-finite count, one
    pass fewer over the layer (no ``|residual|`` and max per chunk)."""
    L = min(max(residual.numel(), 1), cpu_chunking.CHUNK)   # one "bin" per chunk: never read
    check_residual_args(grad, residual, L, None, grad_scale, nonfinite)
    _residual_add(grad, residual, L, None, grad_scale, nonfinite, want_binmax=False)


def residual_add_binmax(grad: torch.Tensor, residual: torch.Tensor, bin_size: int,
                        *, out: Optional[torch.Tensor] = None,
                        grad_scale: Optional[torch.Tensor] = None,
                        nonfinite: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Error-feedback accumulation with the non-finite policy, and per-bin abs max.

    ``d = fp32(grad) * grad_scale`` (one fp32 rounding; no multiply when grad_scale is
    None); where ``d`` is finite ``residual += d`` (a second, separate rounding; never an
    FMA), where it is NaN/+-Inf the residual keeps its old value and the element is
    counted into ``nonfinite[0]`` (int32 tensor, added to). Returns ``binmax``
    fp32[ceil(n / bin_size)], ``binmax[b] = max |residual[b*L:(b+1)*L]|`` after the
    update (last bin partial; NaN where the bin holds a NaN, like ``torch.amax``).
    ``out`` optionally receives binmax. Same math as ``kernels/residual.py``.
    """
    _, _, nbins = check_residual_args(grad, residual, bin_size, out, grad_scale, nonfinite)
    if out is None:
        out = torch.empty(nbins, dtype=torch.float32, device=residual.device)
    return _residual_add(grad, residual, bin_size, out, grad_scale, nonfinite,
                         want_binmax=True)


def _residual_add(grad, residual, L, out, grad_scale, nonfinite, want_binmax: bool):
    """The chunked loop of :func:`residual_add_binmax` (``want_binmax=False``: no
    ``|residual|`` / max per chunk, ``out`` unused); arguments already checked."""
    n = residual.numel()
    if n == 0:
        return out
    s = grad_scale.reshape(()).to(torch.float32) if grad_scale is not None else None
    bad = [0]
    if L <= cpu_chunking.CHUNK:
        bins_per_chunk = max(1, cpu_chunking.CHUNK // L)
        ch = bins_per_chunk * L
        # CPU: numpy on views of the same memory (no OpenMP region per chunk: torch's
        # per-op thread pool stalls badly when the cores are shared), contiguous ranges
        # of whole chunks split across up to torch.get_num_threads() Python threads;
        # bf16 (no numpy dtype) and other devices use the same steps in torch.
        use_np = residual.device.type == "cpu" and grad.dtype != torch.bfloat16 and \
            cpu_chunking.USE_NUMPY
        if use_np:
            rn, gn = residual.detach().numpy(), grad.detach().numpy()
            on = out.detach().numpy() if want_binmax else None
            s32 = np.float32(float(s)) if s is not None else None
            lock = threading.Lock()

            def work(s0, e0):
                tn, mn = cpu_chunking.chunk_scratch(min(ch, e0 - s0))
                nb = 0
                for st in range(s0, e0, ch):
                    e = min(st + ch, e0)
                    m = e - st
                    b0 = st // L
                    nfull = m // L
                    r = rn[st:e]
                    if s32 is not None:
                        d = tn[:m]
                        np.multiply(gn[st:e], s32, out=d, dtype=np.float32)
                    else:
                        d = gn[st:e]              # fp32 or fp16 (widened exactly in add)
                    # one reduction decides the common case: a NaN/Inf element makes the
                    # fp32 sum non-finite (an overflowing sum of finite values only
                    # sends the chunk to the exact per-element path below)
                    with np.errstate(invalid="ignore", over="ignore"):
                        total = np.add.reduce(d, dtype=np.float32)
                    if np.isfinite(total):
                        np.add(r, d, out=r, dtype=np.float32)
                    else:
                        fin = np.isfinite(d, out=mn[:m])
                        np.add(r, d, out=r, where=fin, dtype=np.float32)
                        nb += m - int(np.count_nonzero(fin))
                    if not want_binmax:
                        continue
                    a = np.abs(r, out=tn[:m])
                    if nfull:
                        np.max(a[: nfull * L].reshape(nfull, L), axis=1, out=on[b0:b0 + nfull])
                    if nfull * L < m:
                        on[b0 + nfull] = a[nfull * L:].max()
                if nb:
                    with lock:
                        bad[0] += nb

            par_run(work, par_ranges(n, ch, max(ch, cpu_chunking.CHUNK_PAR_MIN)))
        else:
            tmp = torch.empty(min(ch, n), dtype=torch.float32, device=residual.device)
            for st in range(0, n, ch):
                e = min(st + ch, n)
                b0 = st // L
                nfull = (e - st) // L
                r = residual[st:e]
                bad[0] += _add_chunk_torch(r, grad[st:e], s)
                if not want_binmax:
                    continue
                a = torch.abs(r, out=tmp[: e - st])
                if nfull:
                    torch.amax(a[: nfull * L].view(nfull, L), dim=1, out=out[b0:b0 + nfull])
                if nfull * L < e - st:
                    out[b0 + nfull] = a[nfull * L:].amax()
    else:  # huge bins: running max over sub-chunks of one bin
        tmp = torch.empty(cpu_chunking.CHUNK, dtype=torch.float32, device=residual.device)
        for b in range(out.numel()):
            bs, be = b * L, min((b + 1) * L, n)
            m = None
            for st in range(bs, be, cpu_chunking.CHUNK):
                e = min(st + cpu_chunking.CHUNK, be)
                r = residual[st:e]
                bad[0] += _add_chunk_torch(r, grad[st:e], s)
                cm = torch.abs(r, out=tmp[: e - st]).amax()
                # NaN propagates (torch.maximum does, unlike a compiled tl.maximum)
                m = cm if m is None else torch.maximum(m, cm)
            out[b] = m
    if nonfinite is not None and bad[0]:
        nonfinite.view(-1)[0] += bad[0]
    return out


#: the lanes of ``kernels/segment_mean.py``'s order (the kernels package is not imported
#: on the CPU path; ``tests/test_oracle.py`` checks the two agree)
SEGMENT_MEAN_LANES = 1024


def segment_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean of a 1-D fp32 CPU tensor in ``kernels/segment_mean.py``'s order (a 0-d
    tensor): lanes ``a[i]`` add ``x[i], x[L + i], ...`` in turn (past the end: +0), then
    ``a'[i] = a[2i] + a[2i + 1]`` until one is left, then one correctly rounded
    division by ``n``: the Triton path's bits."""
    n = x.numel()
    L = SEGMENT_MEAN_LANES
    chunks = -(-n // L)
    padded = torch.zeros(chunks * L, dtype=torch.float32)
    padded[:n] = x.reshape(-1)
    rows = padded.view(chunks, L)
    acc = torch.zeros(L, dtype=torch.float32)
    for r in range(chunks):
        acc = acc + rows[r]
    while acc.numel() > 1:
        acc = acc[0::2] + acc[1::2]
    return (acc / torch.tensor([float(n)], dtype=torch.float32)).reshape(())
