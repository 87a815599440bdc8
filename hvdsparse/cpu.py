"""The CPU path of the compression operations (what :mod:`hvdsparse.ops` runs for CPU
tensors), written for memory bandwidth.

Same functions and signatures as the Triton kernels in ``kernels/`` (dispatched by
:mod:`hvdsparse.ops`) and the same results bit for bit, except the slot order of
``select_compact`` (ascending here; see docs/design.md). The math of every operation is
stated once, plainly, in :mod:`hvdsparse.oracle`; the tests check this module and the
kernels against it. Imports nothing of hvdsparse but :mod:`hvdsparse.philox` (dependency
floor). All tensors are 1-D and contiguous unless stated. Gradients may be fp32, fp16
or bf16; residuals / accumulators are fp32.

Operations (see ``docs/design.md``):

1. :func:`residual_add_binmax` -- ``residual += grad * grad_scale`` in place (non-finite
   addends skipped and counted) and the per-bin abs max.
2. :func:`select_compact` -- threshold selection, compaction into fixed-capacity buffers
   and the residual update, in ascending index order.
3. :func:`quantize_pack` / :func:`dequantize_unpack` / :func:`sign_unpack` --
   stochastic rounding to 8/4/2-bit codes with one fp32 scale per bucket, bit packing,
   and the inverse maps; :func:`pack_bits` / :func:`unpack_bits` are the one bit packer
   of the project (also used for sign bits and bitmasks).
4. :func:`scatter_add_decode` -- bounds-checked scatter-add of a batch of payloads,
   rows added in row order (deterministic).

How it is fast: (1) and (2) walk the tensors in cache-sized chunks (``_CHUNK``
elements, rounded to whole bins) and reuse scratch buffers, so each element is read
from DRAM once per operation and no full-size temporary is allocated; on the CPU they
run in numpy, contiguous ranges of whole chunks split across up to
``torch.get_num_threads()`` threads (inputs under ``_CHUNK_PAR_MIN`` elements per
thread stay on one), with (2) in two phases (count / collect per range, prefix over
ranges, then write) so the output order is unchanged. Philox (:mod:`hvdsparse.philox`)
and (3) run in numpy on the CPU (blocks of whole buckets, split across threads); the
torch code is kept for other devices and gives identical bits.
"""
from __future__ import annotations

import math
import threading
from typing import Optional, Tuple

import numpy as np
import torch

from . import native
from .payload import to_wire_float
from .philox import (check_pos_int, check_seed, par_ranges, par_run,  # noqa: F401
                     philox_parallel, philox_scratch, PHILOX_CHUNK, PHILOX_PAR_MIN,
                     philox_uint32, philox_uniform, uniform_block)

__all__ = [
    "residual_add_binmax", "select_compact", "quantize_pack", "dequantize_unpack",
    "sign_unpack", "scatter_add_decode", "dense_add_decode", "philox_uniform",
    "philox_uint32", "pack_bits", "unpack_bits", "count_abs_ge", "binned_select",
    "VE_FP32", "VE_FP16", "VE_BF16", "VE_SIGN1", "QUANT_BITS_ALLOWED",
]

# Value-encoding codes: identical to hvdsparse.payload.ValueEncoding (an IntEnum, so the
# enum members compare equal to these ints). Duplicated here because cpu.py and
# kernels/ must not import hvdsparse; tests check that the two agree.
VE_FP32, VE_FP16, VE_BF16, VE_SIGN1 = 0, 1, 2, 6
_FLOAT_VE = {VE_FP32: torch.float32, VE_FP16: torch.float16, VE_BF16: torch.bfloat16}
QUANT_BITS_ALLOWED = (8, 4, 2)
FLOAT_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: elements per chunk of the CPU path (1 MiB of fp32: stays in L2/L3; the per-op
#: dispatch overhead of smaller chunks costs more than the cache misses it saves)
_CHUNK = 1 << 18
#: at least this many elements per worker thread before the CPU passes of (1) and (2)
#: are split across threads (whole chunks per thread; smaller inputs run inline)
_CHUNK_PAR_MIN = 1 << 19
#: CPU passes of (1) and (2) in numpy (False: the torch steps used off-CPU; for tests)
_USE_NUMPY = True

_tls = threading.local()


def _chunk_scratch(m: int):
    """Per-thread scratch of the CPU path of (1) and (2): (fp32[m], bool[m]), reused."""
    s = getattr(_tls, "c", None)
    if s is None or s[0].shape[0] < m:
        s = (np.empty(m, np.float32), np.empty(m, np.bool_))
        _tls.c = s
    return s[0][:m], s[1][:m]


# --------------------------------------------------------------------------------------
# argument checks (shared with ops.py / kernels through duplication-free import in ops)
# --------------------------------------------------------------------------------------


def check_1d(name: str, t, dtypes=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")


def check_bits(bits) -> int:
    if bits not in QUANT_BITS_ALLOWED:
        raise ValueError(f"bits must be one of {QUANT_BITS_ALLOWED}, got {bits!r}")
    return int(bits)


def _value_encoding(ve) -> int:
    v = int(ve)
    if v not in (VE_FP32, VE_FP16, VE_BF16, VE_SIGN1):
        raise ValueError(f"value_encoding must be FP32, FP16, BF16 or SIGN1 for "
                         f"select_compact (quantised encodings go through quantize_pack), "
                         f"got {ve!r}")
    return v


def scalar_tensor(name: str, x, device) -> torch.Tensor:
    """fp32 0-d/1-element tensor from a float or tensor (no host sync for tensors)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must have exactly one element, got shape {tuple(x.shape)}")
        return x.reshape(()).to(device=device, dtype=torch.float32)
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return torch.tensor(float(x), dtype=torch.float32, device=device)
    raise TypeError(f"{name} must be a float or a 1-element tensor, got {type(x).__name__}")


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


# --------------------------------------------------------------------------------------
# 1. residual add + per-bin abs max
# --------------------------------------------------------------------------------------


def check_residual_args(grad, residual, bin_size, out, grad_scale, nonfinite):
    """Validation shared by the CPU path and ops (kernels): returns (n, L, nbins)."""
    check_1d("grad", grad, FLOAT_INPUT_DTYPES)
    check_1d("residual", residual, (torch.float32,))
    if grad.numel() != residual.numel():
        raise ValueError(f"grad has {grad.numel()} elements but residual has {residual.numel()}")
    if grad.device != residual.device:
        raise ValueError(f"grad is on {grad.device} but residual is on {residual.device}")
    L = check_pos_int("bin_size", bin_size)
    n = residual.numel()
    nbins = -(-n // L)
    if out is not None:
        check_1d("out", out, (torch.float32,))
        if out.numel() != nbins:
            raise ValueError(f"out must have {nbins} elements, got {out.numel()}")
        if out.device != residual.device:
            raise ValueError(f"out is on {out.device} but residual is on {residual.device}")
    check_grad_scale(grad_scale, residual.device)
    _check_nonfinite(nonfinite, "residual", residual.device)
    return n, L, nbins


def _check_nonfinite(nonfinite, what: str, device) -> None:
    """``nonfinite``: None or a contiguous int32[>= 1] counter on ``device`` (the device
    of the tensor named ``what``)."""
    if nonfinite is None:
        return
    if not isinstance(nonfinite, torch.Tensor) or nonfinite.dtype != torch.int32 \
            or nonfinite.numel() < 1 or not nonfinite.is_contiguous():
        raise TypeError("nonfinite must be None or a contiguous int32 tensor with >= 1 "
                        "element")
    if nonfinite.device != device:
        raise ValueError(f"nonfinite is on {nonfinite.device} but {what} is on {device}")


def check_clean_args(grad, grad_scale, nonfinite):
    """Validation shared by :func:`clean_grad` and ops (kernel)."""
    check_1d("grad", grad, FLOAT_INPUT_DTYPES)
    check_grad_scale(grad_scale, grad.device)
    _check_nonfinite(nonfinite, "grad", grad.device)


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


def check_zero_slots_args(flat, positions, count):
    """Validation shared by :func:`zero_slots` and ops (kernel)."""
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("zero_slots: flat must be a contiguous 1-D tensor")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1 \
            or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError("zero_slots: positions must be a 1-D int32 / int64 tensor")
    if not isinstance(count, torch.Tensor) or count.numel() != 1 \
            or count.dtype not in (torch.int32, torch.int64):
        raise ValueError("zero_slots: count must be a 1-element int32 / int64 tensor")
    if positions.device != flat.device or count.device != flat.device:
        raise ValueError(f"zero_slots: positions ({positions.device}) and count "
                         f"({count.device}) must be on flat's device ({flat.device})")


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


def check_grad_scale(grad_scale, device) -> None:
    if grad_scale is None:
        return
    if not isinstance(grad_scale, torch.Tensor) or grad_scale.numel() != 1 \
            or grad_scale.dtype != torch.float32:
        raise TypeError("grad_scale must be None or a 1-element fp32 tensor, got "
                        f"{getattr(grad_scale, 'dtype', type(grad_scale).__name__)} "
                        f"of shape {tuple(getattr(grad_scale, 'shape', ()))}")
    if grad_scale.device != device:
        raise ValueError(f"grad_scale is on {grad_scale.device} but the data is on {device}")


def _check_index_width(name: str, n: int) -> None:
    """int32 indices / counts address at most 2**31 - 1 elements."""
    if n >= (1 << 31):
        raise ValueError(f"{name} has {n} elements; hvdsparse addresses elements with int32 "
                         f"indices, so a layer must have fewer than 2**31 elements (split "
                         f"the parameter)")


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
    L = min(max(residual.numel(), 1), _CHUNK)       # one "bin" per chunk: never read
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
    if L <= _CHUNK:
        bins_per_chunk = max(1, _CHUNK // L)
        ch = bins_per_chunk * L
        # CPU: numpy on views of the same memory (no OpenMP region per chunk: torch's
        # per-op thread pool stalls badly when the cores are shared), contiguous ranges
        # of whole chunks split across up to torch.get_num_threads() Python threads;
        # bf16 (no numpy dtype) and other devices use the same steps in torch.
        use_np = residual.device.type == "cpu" and grad.dtype != torch.bfloat16 and _USE_NUMPY
        if use_np:
            rn, gn = residual.detach().numpy(), grad.detach().numpy()
            on = out.detach().numpy() if want_binmax else None
            s32 = np.float32(float(s)) if s is not None else None
            lock = threading.Lock()

            def work(s0, e0):
                tn, mn = _chunk_scratch(min(ch, e0 - s0))
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

            par_run(work, par_ranges(n, ch, max(ch, _CHUNK_PAR_MIN)))
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
        tmp = torch.empty(_CHUNK, dtype=torch.float32, device=residual.device)
        for b in range(out.numel()):
            bs, be = b * L, min((b + 1) * L, n)
            m = None
            for st in range(bs, be, _CHUNK):
                e = min(st + _CHUNK, be)
                r = residual[st:e]
                bad[0] += _add_chunk_torch(r, grad[st:e], s)
                cm = torch.abs(r, out=tmp[: e - st]).amax()
                # NaN propagates (torch.maximum does, unlike a compiled tl.maximum)
                m = cm if m is None else torch.maximum(m, cm)
            out[b] = m
    if nonfinite is not None and bad[0]:
        nonfinite.view(-1)[0] += bad[0]
    return out


# --------------------------------------------------------------------------------------
# 1b. count of |x| >= t (TopK's threshold refinement)
# --------------------------------------------------------------------------------------

#: elements per chunk of :func:`count_abs_ge` (256 KiB of fp32: the |x| chunk and its
#: mask stay in L2)
_COUNT_CHUNK = 1 << 16


def count_abs_ge(x: torch.Tensor, threshold: torch.Tensor, same_as=None) -> torch.Tensor:
    """``#{i : |x_i| >= t}`` as a fp32 0-d tensor (NaN never counts), ``t`` a 1-element
    fp32 tensor. Same value as ``torch.count_nonzero(torch.abs(x) >= t).float()``, but
    one chunked numpy pass (no full-size |x| or mask, split across threads like (1)).

    ``same_as = (t_prev, c_prev)``: when ``t == t_prev`` (both read on the host: CPU
    tensors) the count is ``c_prev`` and no pass is made -- the count of an unchanged
    threshold cannot change."""
    check_1d("x", x, (torch.float32,))
    t32 = np.float32(threshold.detach().reshape(-1).numpy()[0])
    if same_as is not None:
        tp, cp = same_as
        if np.float32(tp.detach().reshape(-1).numpy()[0]) == t32:
            return cp
    xn = x.detach().numpy()
    n = xn.shape[0]
    counts = []
    lock = threading.Lock()

    def work(s0, e0):
        tn, mn = _chunk_scratch(min(_COUNT_CHUNK, e0 - s0))
        c = 0
        for st in range(s0, e0, _COUNT_CHUNK):
            e = min(st + _COUNT_CHUNK, e0)
            m = e - st
            a = np.abs(xn[st:e], out=tn[:m])
            c += int(np.count_nonzero(np.greater_equal(a, t32, out=mn[:m])))
        with lock:
            counts.append(c)

    if n:
        par_run(work, par_ranges(n, _COUNT_CHUNK, max(_COUNT_CHUNK, _CHUNK_PAR_MIN)))
    # exact: a count < 2**24 is an fp32 integer, larger ones round once (as .float())
    return torch.tensor(float(sum(counts)), dtype=torch.float32)


# --------------------------------------------------------------------------------------
# 1c. per-bin capped selection of |acc + (h_scale - 1) g| (AdaComp's pack on the CPU)
# --------------------------------------------------------------------------------------


def binned_select(acc: torch.Tensor, grad: torch.Tensor, h_scale: float,
                  threshold: torch.Tensor, bin_size: int, c: int,
                  grad_scale: Optional[torch.Tensor] = None):
    """Per bin ``b`` of ``bin_size`` consecutive elements (last one partial), the up to
    ``c`` largest ``|h_i|`` with ``|h_i| >= threshold[b]``, where
    ``h = acc + (h_scale - 1) * d`` and ``d = fp32(grad) * grad_scale`` with non-finite
    ``d`` taken as 0 (each product and sum its own fp32 rounding, as the torch ops
    ``acc + (h_scale - 1) * where(isfinite(d), d, 0)`` round). Ties in ``|h|`` inside
    a bin that holds more than ``c`` passing elements go to the lower index.

    Returns ``(gidx int64[nb*c], rel int64[nb*c], vmask bool[nb*c], count int32[1],
    bin_counts int32[nb], selected int32[1])``: the sent slots first, by bin, largest
    ``|h|`` first within a bin (the layout of ``compressors.base.binned_topc``);
    padding slots hold index 0; ``selected`` counts every passing element (before the
    per-bin cap). One chunked numpy pass (no full-size temporary) plus a sort of the
    passing elements only."""
    check_1d("acc", acc, (torch.float32,))
    check_1d("grad", grad, FLOAT_INPUT_DTYPES)
    n = acc.numel()
    L = int(bin_size)
    nb = -(-n // L)
    thr = threshold.detach().reshape(-1)
    if thr.numel() != nb or grad.numel() != n:
        raise ValueError(f"binned_select: threshold has {thr.numel()} bins and grad "
                         f"{grad.numel()} elements, expected {nb} and {n}")
    an = acc.detach().numpy()
    gt = grad.detach()
    if gt.dtype == torch.bfloat16:            # numpy has no bf16: widen once (exact)
        gt = gt.to(torch.float32)
    gn = gt.numpy()
    thr_n = thr.to(torch.float32).numpy()
    s32 = (np.float32(grad_scale.detach().reshape(-1).numpy()[0])
           if grad_scale is not None else None)
    hm1 = np.float32(float(h_scale) - 1.0)
    ch = max(1, _CHUNK // L) * L
    tn, mn = _chunk_scratch(min(ch, n) if n else 1)
    cand_i, cand_v = [], []

    def h_abs(st: int, e: int, zero_nonfinite: bool) -> np.ndarray:
        """|h| of elements [st, e) into the chunk scratch; non-finite d as 0 if asked."""
        d = tn[:e - st]
        if s32 is not None:
            np.multiply(gn[st:e], s32, out=d, dtype=np.float32)
        else:
            d[:] = gn[st:e]                   # fp16 -> fp32 is exact
        if zero_nonfinite:
            fin = np.isfinite(d, out=mn[:e - st])
            np.copyto(d, np.float32(0.0), where=~fin)
        np.multiply(d, hm1, out=d)
        np.add(an[st:e], d, out=d)
        return np.abs(d, out=d)

    for st in range(0, n, ch):
        e = min(st + ch, n)
        m = e - st
        # the common case in one reduction, after the fact: a NaN / Inf in d makes its
        # |h| NaN or Inf (hm1 * Inf is Inf, or NaN for hm1 = 0; NaN stays NaN), which
        # the max (NaN-propagating, ~3x cheaper than a sum here) shows; then the chunk
        # is redone with the element-wise rule. A finite d whose h overflows is redone
        # too and gives the same bits (nothing to zero)
        with np.errstate(invalid="ignore", over="ignore"):
            d = h_abs(st, e, False)
            top = np.maximum.reduce(d)
        if not np.isfinite(top):
            d = h_abs(st, e, True)
        mk = mn[:m]
        b0 = st // L
        nfull = m // L
        if nfull:
            np.greater_equal(d[: nfull * L].reshape(nfull, L), thr_n[b0:b0 + nfull, None],
                             out=mk[: nfull * L].reshape(nfull, L))
        if nfull * L < m:
            np.greater_equal(d[nfull * L:], thr_n[b0 + nfull], out=mk[nfull * L:])
        idx = np.flatnonzero(mk)
        if idx.shape[0]:
            cand_v.append(d[idx])
            cand_i.append(idx + st)
    cap = nb * c
    gidx = np.zeros(cap, np.int64)
    rel = np.zeros(cap, np.int64)
    bin_counts = np.zeros(nb, np.int32)
    selected = count = 0
    if cand_i:
        ci = np.concatenate(cand_i)
        cv = np.concatenate(cand_v)
        selected = ci.shape[0]
        cb = ci // L
        # by bin, then |h| descending, then index ascending: one stable sort of the key
        # bin * 2^32 + ~bits(|h|) (|h| >= 0 is never NaN here, and the bits of a
        # non-negative fp32 grow with its value, so ~bits falls as |h| grows); the
        # candidates come in ascending index order, which the stable sort keeps among
        # equal keys (the order of np.lexsort((ci, -cv, cb)), ~10x faster)
        key = (cb.astype(np.uint64) << np.uint64(32)) | \
            np.invert(cv.view(np.uint32)).astype(np.uint64)
        order = np.argsort(key, kind="stable")
        ci, cb = ci[order], cb[order]
        # slot of each candidate within its bin: its position minus where the bin starts
        per_bin = np.bincount(cb, minlength=nb)
        first = (np.cumsum(per_bin) - per_bin)[cb]
        keep = (np.arange(ci.shape[0]) - first) < c
        ci, cb = ci[keep], cb[keep]
        count = ci.shape[0]
        gidx[:count] = ci
        rel[:count] = ci - cb * L
        bin_counts = np.bincount(cb, minlength=nb).astype(np.int32)
    vmask = np.zeros(cap, np.bool_)
    vmask[:count] = True
    return (torch.from_numpy(gidx), torch.from_numpy(rel), torch.from_numpy(vmask),
            torch.tensor([count], dtype=torch.int32), torch.from_numpy(bin_counts),
            torch.tensor([selected], dtype=torch.int32))


# --------------------------------------------------------------------------------------
# 2. select + compact + residual update
# --------------------------------------------------------------------------------------


def check_select_args(acc, threshold, capacity, bin_size, grad, value_encoding, sign_scale):
    check_1d("acc", acc, (torch.float32,))
    n = acc.numel()
    _check_index_width("acc", n)
    capacity = check_pos_int("capacity", capacity, 0)
    if not isinstance(threshold, torch.Tensor):
        if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):
            threshold = torch.tensor(float(threshold), dtype=torch.float32, device=acc.device)
        else:
            raise TypeError(f"threshold must be a tensor or float, got {type(threshold).__name__}")
    if threshold.dtype != torch.float32:
        raise TypeError(f"threshold must be fp32, got {threshold.dtype}")
    if threshold.device != acc.device:
        raise ValueError(f"threshold is on {threshold.device} but acc is on {acc.device}")
    per_bin = threshold.dim() > 0 and bin_size
    if per_bin:
        L = check_pos_int("bin_size", bin_size)
        nbins = -(-n // L)
        check_1d("threshold", threshold)
        if threshold.numel() != nbins:
            raise ValueError(f"per-bin threshold must have ceil(n / bin_size) = {nbins} "
                             f"elements, got {threshold.numel()}")
    else:
        if threshold.numel() != 1:
            raise ValueError(f"threshold must be a 0-d tensor (or fp32[nbins] with "
                             f"bin_size > 0), got shape {tuple(threshold.shape)}")
        threshold = threshold.reshape(())
        L = 0
    if grad is not None:
        check_1d("grad", grad, FLOAT_INPUT_DTYPES)
        if grad.numel() != n:
            raise ValueError(f"grad has {grad.numel()} elements but acc has {n}")
        if grad.device != acc.device:
            raise ValueError(f"grad is on {grad.device} but acc is on {acc.device}")
    ve = _value_encoding(value_encoding)
    if ve == VE_SIGN1:
        if sign_scale is None:
            raise ValueError("sign_scale is required for value_encoding SIGN1")
        sign_scale = scalar_tensor("sign_scale", sign_scale, acc.device)
    return n, threshold, capacity, L, ve, sign_scale


def alloc_select_out(out, capacity, ve, device):
    vbytes = -(-capacity // 8)
    if out is None:
        indices = torch.zeros(capacity, dtype=torch.int32, device=device)
        if ve == VE_SIGN1:
            values = torch.zeros(vbytes, dtype=torch.uint8, device=device)
        else:
            values = torch.zeros(capacity, dtype=_FLOAT_VE[ve], device=device)
        count = torch.zeros(2, dtype=torch.int32, device=device)
        return indices, values, count
    indices, values, count = out
    check_1d("out indices", indices, (torch.int32,))
    if indices.numel() != capacity:
        raise ValueError(f"out indices must have capacity={capacity} elements, got {indices.numel()}")
    if ve == VE_SIGN1:
        check_1d("out values", values, (torch.uint8,))
        if values.numel() != vbytes:
            raise ValueError(f"out values (SIGN1) must have ceil(capacity/8)={vbytes} bytes, "
                             f"got {values.numel()}")
    else:
        check_1d("out values", values, (_FLOAT_VE[ve],))
        if values.numel() != capacity:
            raise ValueError(f"out values must have capacity={capacity} elements, got {values.numel()}")
    check_1d("out count", count, (torch.int32,))
    if count.numel() != 2:
        raise ValueError(f"out count must be int32[2], got {count.numel()} elements")
    return indices, values, count


def _select_compact_chunks(acc, thr, capacity, L, ch, grad, use_h, hm1, ve, sscale,
                           indices, values) -> Tuple[int, int]:
    """(2) in torch, chunk by chunk (devices other than the CPU, and ``_USE_NUMPY`` off).
    Returns (sent, selected)."""
    n = acc.numel()
    tmp = torch.empty(ch, dtype=torch.float32, device=acc.device)
    sent = selected = 0
    signs = [] if ve == VE_SIGN1 else None
    for s in range(0, n, ch):
        e = min(s + ch, n)
        m = e - s
        a = acc[s:e]
        c = tmp[:m]
        if use_h:
            c.copy_(grad[s:e]).mul_(hm1).add_(a).abs_()
        else:
            torch.abs(a, out=c)
        # chunks start on bin boundaries (ch is a multiple of L)
        tt = thr[s // L: -(-e // L)].repeat_interleave(L)[:m] if L else thr
        idx = torch.nonzero(c >= tt).view(-1)
        k = idx.numel()
        selected += k
        room = capacity - sent
        if room <= 0 or k == 0:
            continue
        if k > room:
            idx = idx[:room]
            k = room
        indices[sent:sent + k] = (idx + s).to(torch.int32)
        v = a[idx]
        if ve == VE_FP32:
            values[sent:sent + k] = v
            a.index_fill_(0, idx, 0.0)
        elif ve == VE_SIGN1:
            neg = v < 0
            signs.append(neg)
            a.index_copy_(0, idx, v - torch.where(neg, -sscale, sscale))
        else:
            vc = to_wire_float(v, ve)          # saturated (payload.FLOAT_MAX)
            values[sent:sent + k] = vc
            a.index_copy_(0, idx, v - vc.float())
        sent += k
    if ve == VE_SIGN1 and sent:
        values[: -(-sent // 8)] = pack_bits(torch.cat(signs).to(torch.uint8), 1)
    return sent, selected


def _select_compact_np(acc, thr, capacity, L, ch, grad, use_h, hm1, ve, sscale,
                       indices, values) -> Tuple[int, int]:
    """(2) on the CPU: numpy passes over chunks, contiguous ranges of whole chunks split
    across up to torch.get_num_threads() threads, in two phases that keep the ascending
    order. Phase 1: each range computes its chunks' masks and keeps its selected
    positions (at most ``capacity`` of them: a range cannot send more) and its count.
    An exclusive prefix over the ranges' counts gives each range its output offset and
    how many it may send (the first ``capacity`` selected overall, ascending). Phase 2:
    each range writes its indices / values and updates the residual of what it sends.
    Returns (sent, selected)."""
    n = acc.numel()
    an_all = acc.detach().numpy()
    # numpy has no bf16: a bf16 grad is cast in torch, which stays on one thread (torch
    # ops in several Python threads would each open an intra-op parallel region)
    gn_all = grad.detach().numpy() if use_h and grad.dtype != torch.bfloat16 else None
    thr_n = thr.detach().numpy() if L else np.float32(float(thr))
    hm1_32 = np.float32(hm1)
    if use_h and gn_all is None:
        ranges = [(0, n)]
    else:
        ranges = par_ranges(n, ch, max(ch, _CHUNK_PAR_MIN))
    found = [None] * len(ranges)      # per range: (count, [(chunk start, local idx), ...])

    def phase1(i, s0, e0):
        tn, mn = _chunk_scratch(min(ch, e0 - s0))
        cnt = 0
        keep = []
        for s in range(s0, e0, ch):
            e = min(s + ch, e0)
            m = e - s
            an = an_all[s:e]
            c = tn[:m]
            if use_h:
                if gn_all is not None:
                    np.multiply(gn_all[s:e], hm1_32, out=c)
                else:
                    torch.from_numpy(c).copy_(grad[s:e]).mul_(hm1)
                np.add(c, an, out=c)
                np.abs(c, out=c)
            else:
                np.abs(an, out=c)
            mk = mn[:m]
            if L:
                b0 = s // L
                nfull = m // L
                if nfull:
                    np.greater_equal(c[: nfull * L].reshape(nfull, L),
                                     thr_n[b0:b0 + nfull, None],
                                     out=mk[: nfull * L].reshape(nfull, L))
                if nfull * L < m:
                    np.greater_equal(c[nfull * L:], thr_n[b0 + nfull], out=mk[nfull * L:])
            else:
                np.greater_equal(c, thr_n, out=mk)
            idx = np.flatnonzero(mk)
            k = idx.shape[0]
            room = capacity - cnt
            if room > 0 and k:
                keep.append((s, idx[:room] if k > room else idx))
            cnt += k
        found[i] = (cnt, keep)

    par_run(phase1, [(i, s0, e0) for i, (s0, e0) in enumerate(ranges)])
    # exclusive prefix: output offset and number sent of each range
    plan = []
    total = 0
    for cnt, keep in found:
        off = min(total, capacity)
        plan.append((off, min(cnt, capacity - off), keep))
        total += cnt
    selected = total
    sent = min(total, capacity)
    ind_n = indices.numpy()
    val_n = values.detach().numpy() if ve == VE_FP32 else None
    signs = [None] * len(ranges)
    sc = np.float32(float(sscale)) if ve == VE_SIGN1 else None

    def phase2(i):
        off, quota, keep = plan[i]
        negs = []
        for s, idx in keep:
            if quota <= 0:
                break
            k = idx.shape[0]
            if k > quota:
                idx = idx[:quota]
                k = quota
            np.add(idx, s, out=ind_n[off:off + k], casting="unsafe")  # int64 -> int32
            an = an_all[s:]
            if ve == VE_FP32:
                np.take(an, idx, out=val_n[off:off + k])
                an[idx] = 0.0
            elif ve == VE_SIGN1:
                v = an[idx]
                neg = v < 0
                negs.append(neg)
                an[idx] = v - np.where(neg, -sc, sc)
            else:
                v = torch.from_numpy(an[idx])
                vc = to_wire_float(v, ve)          # saturated (payload.FLOAT_MAX)
                values[off:off + k] = vc
                an[idx] = (v - vc.float()).numpy()
            off += k
            quota -= k
        signs[i] = negs

    par_run(phase2, [(i,) for i in range(len(ranges)) if plan[i][1] > 0])
    if ve == VE_SIGN1 and sent:
        bits = np.concatenate([x for negs in signs if negs for x in negs])
        values[: -(-sent // 8)] = pack_bits(torch.from_numpy(bits).to(torch.uint8), 1)
    return sent, selected


def select_if_in_range(acc: torch.Tensor, threshold: torch.Tensor, k: int, capacity: int
                       ) -> Tuple[Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                                  Optional[torch.Tensor]]:
    """TopK's first refinement round on the CPU, counting by selecting: fp32
    :func:`select_compact` of ``|acc| >= threshold`` (0-d fp32); its ``selected`` is
    exactly the count a counting pass would give. If ``k <= selected <= capacity`` the
    estimate will be kept, so the select is kept too: returns ``((indices, values,
    count), selected)``. Otherwise the select is undone (``acc[idx] = values``: exact
    for fp32, the select wrote 0 there) and ``(None, selected)`` is returned. A
    threshold below the smallest normal fp32 (which the select would clamp) makes no
    pass: ``(None, None)``. ``selected`` is a 0-d fp32 tensor. Saves one pass over the
    layer whenever the first estimate is in range."""
    t = float(threshold)
    if not t >= float(torch.finfo(torch.float32).tiny):
        return None, None
    idx, vals, cnt = select_compact(acc, threshold, capacity)
    sent, selected = int(cnt[0]), int(cnt[1])
    c = torch.tensor(float(selected), dtype=torch.float32)
    if k <= selected <= capacity:
        return (idx, vals, cnt), c
    acc.index_copy_(0, idx[:sent].to(torch.long), vals[:sent])
    return None, c


def select_compact(acc: torch.Tensor, threshold, capacity: int, *, bin_size: int = 0,
                   grad: Optional[torch.Tensor] = None, h_scale: float = 1.0,
                   value_encoding=VE_FP32, sign_scale=None, out=None,
                   grad_scale: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Select ``|h[i]| >= thr(i)`` with ``h = acc + (h_scale - 1) * g``,
    ``g = fp32(grad) * grad_scale`` (``h = acc`` if grad is None or h_scale == 1; no
    grad_scale multiply when it is None), every product and sum its own fp32 rounding
    (never an FMA; the kernels are compiled without contraction, so bits agree);
    ``thr(i) = threshold`` (0-d) or ``threshold[i // bin_size]`` (fp32[nbins]). NaN is
    never selected.

    Returns ``(indices int32[capacity], values, count int32[2] = [sent, selected])``;
    values is [capacity] of fp32/fp16/bf16 (``acc`` cast) or, for SIGN1, uint8
    [ceil(capacity / 8)] sign bits (bit j%8 of byte j//8, 1 = negative, acc == 0 counts
    as positive). The first ``capacity`` selected elements in ascending index order are
    sent; slots >= sent are padding. ``acc`` becomes the new residual in place: for sent
    elements ``acc - dequant(value)`` (0 for fp32, the cast error for fp16/bf16,
    ``acc - (+-sign_scale)`` for SIGN1); every other element is unchanged.
    ``out`` = optional preallocated ``(indices, values, count)``.
    """
    n, thr, capacity, L, ve, sscale = check_select_args(
        acc, threshold, capacity, bin_size, grad, value_encoding, sign_scale)
    check_grad_scale(grad_scale, acc.device)
    indices, values, count = alloc_select_out(out, capacity, ve, acc.device)
    hm1 = float(h_scale) - 1.0
    use_h = grad is not None and hm1 != 0.0
    if use_h and grad_scale is not None:
        grad = grad.to(torch.float32) * grad_scale.reshape(()).to(torch.float32)
    sent = 0
    selected = 0
    if n:
        if L:
            ch = max(1, _CHUNK // L) * L
        else:
            ch = _CHUNK
        ch = min(ch, n)
        if acc.device.type == "cpu" and _USE_NUMPY:
            sent, selected = _select_compact_np(acc, thr, capacity, L, ch, grad, use_h, hm1,
                                                ve, sscale, indices, values)
        else:
            sent, selected = _select_compact_chunks(acc, thr, capacity, L, ch, grad, use_h,
                                                    hm1, ve, sscale, indices, values)
    count[0] = sent
    count[1] = selected
    return indices, values, count


# --------------------------------------------------------------------------------------
# 3. quantise + pack, and the inverses
# --------------------------------------------------------------------------------------


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


_pack_bits, _unpack_bits = pack_bits, unpack_bits   # old private names


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
    one per thread (:func:`hvdsparse.philox._philox_parallel`)."""
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
    if values.device.type != "cpu" or not _USE_NUMPY:
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
    if codes.device.type == "cpu" and scales.device.type == "cpu" and _USE_NUMPY:
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


# --------------------------------------------------------------------------------------
# 4. scatter-add decode
# --------------------------------------------------------------------------------------


def _as_2d(name: str, t: Optional[torch.Tensor], P: int, batched: bool):
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if not batched:
        if t.dim() > 1:
            raise ValueError(f"{name} must be 1-D when indices is 1-D, got shape {tuple(t.shape)}")
        t = t.reshape(1, -1)
    else:
        if t.dim() == 1 and t.shape[0] == P:
            t = t.reshape(P, 1)
        if t.dim() != 2 or t.shape[0] != P:
            raise ValueError(f"{name} must have shape [P={P}, ...], got {tuple(t.shape)}")
    return t


def check_scatter_args(dense, indices, count, values, codes, scales, bits, bucket_size,
                        signs, sign_scale):
    check_1d("dense", dense, (torch.float32,))
    if not isinstance(indices, torch.Tensor) or indices.dim() not in (1, 2):
        raise ValueError("indices must be a 1-D [cap] or 2-D [P, cap] tensor")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    batched = indices.dim() == 2
    ind = indices if batched else indices.reshape(1, -1)
    P, cap = ind.shape
    cnt = _as_2d("count", count, P, batched)
    if cnt is None or cnt.shape[1] < 1 or cnt.dtype not in (torch.int32, torch.int64):
        raise ValueError("count must be an int32 tensor [P, >=1] ([>=1] for 1-D indices)")
    modes = sum(x is not None for x in (values, codes, signs))
    if modes != 1:
        raise ValueError("exactly one of values, codes (+scales, bits), signs (+sign_scale) "
                         "must be given")
    vals = _as_2d("values", values, P, batched)
    if vals is not None:
        if vals.dtype not in FLOAT_INPUT_DTYPES:
            raise TypeError(f"values must be fp32/fp16/bf16, got {vals.dtype}")
        if vals.shape[1] < cap:
            raise ValueError(f"values must have >= cap={cap} columns, got {vals.shape[1]}")
    cds = _as_2d("codes", codes, P, batched)
    scl = None
    if cds is not None:
        bits = check_bits(bits)
        bucket_size = check_pos_int("bucket_size", bucket_size)
        if cds.dtype != torch.uint8:
            raise TypeError(f"codes must be uint8, got {cds.dtype}")
        if cds.shape[1] < -(-cap * bits // 8):
            raise ValueError(f"codes must have >= ceil(cap*bits/8) = {-(-cap * bits // 8)} "
                             f"bytes per row, got {cds.shape[1]}")
        if scales is None:
            raise ValueError("scales is required with codes")
        scl = _as_2d("scales", scales, P, batched)
        if scl.dtype != torch.float32:
            raise TypeError(f"scales must be fp32, got {scl.dtype}")
        if scl.shape[1] < -(-cap // bucket_size):
            raise ValueError(f"scales must have >= ceil(cap/bucket_size) = "
                             f"{-(-cap // bucket_size)} per row, got {scl.shape[1]}")
    sgn = _as_2d("signs", signs, P, batched)
    ssc = None
    if sgn is not None:
        if sgn.dtype != torch.uint8:
            raise TypeError(f"signs must be uint8, got {sgn.dtype}")
        if sgn.shape[1] < -(-cap // 8):
            raise ValueError(f"signs must have >= ceil(cap/8) = {-(-cap // 8)} bytes per row, "
                             f"got {sgn.shape[1]}")
        if sign_scale is None:
            raise ValueError("sign_scale is required with signs")
        if isinstance(sign_scale, torch.Tensor):
            ssc = sign_scale.reshape(-1).to(torch.float32)
            if ssc.numel() == 1 and P > 1:
                ssc = ssc.expand(P)
            if ssc.numel() != P:
                raise ValueError(f"sign_scale must have 1 or P={P} elements, got {ssc.numel()}")
        else:
            ssc = torch.full((P,), float(sign_scale), dtype=torch.float32, device=dense.device)
    return ind, P, cap, cnt, vals, cds, scl, bits, bucket_size, sgn, ssc


def _check_counts(counts, cap: int) -> None:
    """Every row's count (host ints) in [0, cap], else ValueError naming the first bad
    row; the compiled decodes check all rows before anything is written."""
    for p, c in enumerate(counts):
        if not 0 <= int(c) <= cap:
            raise ValueError(f"count[{p}] = {int(c)} is outside [0, cap={cap}]")


def _native_scatter(dense, ind, rows) -> bool:
    """Whether the compiled decode (``native.scatter_add_f32`` / ``scatter_add_sign``)
    takes these rows (fp32 values or sign bytes)."""
    return ind.dtype == torch.int32 and dense.is_contiguous() and ind.stride(1) == 1 and \
        rows.stride(1) == 1 and dense.device.type == "cpu" and native.available()


def scatter_add_decode(dense: torch.Tensor, indices: torch.Tensor, count: torch.Tensor,
                       values: Optional[torch.Tensor] = None, *,
                       codes: Optional[torch.Tensor] = None,
                       scales: Optional[torch.Tensor] = None, bits: int = 0,
                       bucket_size: int = 512, signs: Optional[torch.Tensor] = None,
                       sign_scale=None, error_flag: Optional[torch.Tensor] = None
                       ) -> Optional[torch.Tensor]:
    """``dense[indices[p, j]] += value(p, j)`` for every row p and ``j < count[p, 0]``.

    Value of slot j: ``values[p, j]`` (float), ``dequantize_unpack(codes[p], scales[p],
    bits, bucket_size)[j]``, or ``+-sign_scale[p]`` from the sign bits. 1-D inputs are a
    batch of one row. Rows are added in row order (row 0 first), each element's addends
    in that order: deterministic, and the same bits as the kernels. Repeated indices
    inside one row (malformed) accumulate. Raises IndexError naming the row, slot
    and index of the first index < 0 or >= dense.numel(), and ValueError for a count
    outside [0, cap]; nothing is written in either case. Returns ``error_flag`` unchanged
    (the CPU path never sets it; errors raise instead).
    """
    ind, P, cap, cnt, vals, cds, scl, bits, B, sgn, ssc = check_scatter_args(
        dense, indices, count, values, codes, scales, bits, bucket_size, signs, sign_scale)
    N = dense.numel()
    counts = cnt[:, 0].tolist()
    fp32_rows = vals is not None and vals.dtype == torch.float32
    if (fp32_rows or sgn is not None) and _native_scatter(dense, ind, vals if fp32_rows
                                                          else sgn):
        # fp32 (index, value) or sign-bit rows: one compiled pass per row (hvdsparse/
        # native/scatter_add.c), the same checks first and the same bits as the
        # torch.where + index_add_ route below
        _check_counts(counts, cap)
        if fp32_rows:
            bad = native.scatter_add_f32(dense, ind, counts, vals)
        else:
            bad = native.scatter_add_sign(dense, ind, counts, sgn, ssc)
        if bad is not None:
            p, j = bad
            raise IndexError(f"scatter_add_decode: index {int(ind[p, j])} at row {p}, slot "
                             f"{j} is out of range for dense of {N} elements")
        return error_flag
    rows_idx, rows_val = [], []
    for p in range(P):
        c = int(counts[p])
        if c < 0 or c > cap:
            raise ValueError(f"count[{p}] = {c} is outside [0, cap={cap}]")
        if c == 0:
            continue
        ix = ind[p, :c].to(torch.int64)
        bad = (ix < 0) | (ix >= N)
        if bool(bad.any()):
            j = int(torch.nonzero(bad)[0, 0])
            raise IndexError(f"scatter_add_decode: index {int(ix[j])} at row {p}, slot {j} is "
                             f"out of range for dense of {N} elements")
        if vals is not None:
            v = vals[p, :c].to(torch.float32)
        elif cds is not None:
            v = dequantize_unpack(cds[p].contiguous(), scl[p].contiguous(), bits, B, cap)[:c]
        else:
            b = unpack_bits(sgn[p, : -(-c // 8)].contiguous(), 1, c)
            v = torch.where(b.bool(), -ssc[p], ssc[p])
        rows_idx.append(ix)
        rows_val.append(v)
    # every row is checked before anything is written; then rows are added one after
    # the other in row (rank) order, like the kernels' stream-ordered launches, so the
    # fp32 sum at every element is the same on every rank and every run
    for ix, v in zip(rows_idx, rows_val):
        dense.index_add_(0, ix, v)
    return error_flag


def dense_add_decode(dense: torch.Tensor, count: torch.Tensor, capacity: int,
                     values: Optional[torch.Tensor] = None, *,
                     codes: Optional[torch.Tensor] = None,
                     scales: Optional[torch.Tensor] = None, bits: int = 0,
                     bucket_size: int = 512) -> None:
    """:func:`scatter_add_decode` of DENSE segments, whose slot j is element j:
    ``dense[j] += value(p, j)`` for every row p (in order) and ``j < count[p, 0]``, with
    fp32 ``values`` [P, >= cap] or quantised ``codes`` [P, >= ceil(cap * bits / 8)] +
    ``scales`` [P, >= ceil(cap / bucket_size)] rows, ``cap = capacity <= dense.numel()``.
    The same bits as :func:`scatter_add_decode` with indices ``arange(cap)``; no index
    array is read. ValueError for a count outside
    [0, cap] (nothing written)."""
    if (values is None) == (codes is None):
        raise ValueError("exactly one of values, codes (+scales, bits) must be given")
    rows = values if values is not None else codes
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2:
        raise ValueError("values / codes must be [P, ...] rows")
    cnt = count.reshape(rows.shape[0], -1) if isinstance(count, torch.Tensor) else None
    if cnt is None or cnt.shape[1] < 1 or cnt.dtype not in (torch.int32, torch.int64):
        raise ValueError("count must be an int32 tensor [P, >=1]")
    cap = check_pos_int("capacity", capacity, 0)
    if values is not None:
        have = values.shape[1]
    else:
        bits = check_bits(bits)
        bucket_size = check_pos_int("bucket_size", bucket_size)
        have = codes.shape[1] * 8 // bits
        if not isinstance(scales, torch.Tensor) or scales.dim() != 2 or \
                scales.shape[0] != codes.shape[0] or scales.shape[1] < -(-cap // bucket_size):
            raise ValueError(f"scales must be [P={codes.shape[0]}, >= "
                             f"{-(-cap // bucket_size)}] rows")
    if cap > dense.numel() or have < cap:
        raise ValueError(f"dense_add_decode: capacity {cap} with rows of {have} slots and "
                         f"dense of {dense.numel()} elements")
    counts = cnt[:, 0].tolist()
    _check_counts(counts, cap)
    native_ok = dense.device.type == "cpu" and dense.is_contiguous() and \
        dense.dtype == torch.float32 and rows.stride(1) == 1 and native.available()
    if values is not None:
        values = values[:, :cap]
        if native_ok and values.dtype == torch.float32:
            native.dense_add_f32(dense, counts, values)
            return
        for p, c in enumerate(counts):
            dense[:c].add_(values[p, :c].to(torch.float32))
        return
    codes = codes[:, : -(-cap * bits // 8)]
    if native_ok and scales.dim() == 2 and scales.stride(1) == 1 and \
            scales.dtype == torch.float32:
        native.dense_add_dequantize(dense, counts, codes, scales, bits, bucket_size)
        return
    for p, c in enumerate(counts):
        if c:
            dense[:c].add_(dequantize_unpack(codes[p].contiguous(), scales[p].contiguous(),
                                             bits, bucket_size, c))
