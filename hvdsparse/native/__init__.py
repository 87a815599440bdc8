"""Compiled CPU loops: TopK's bucket path on the CPU (``bucket_topk.c``), the twin of the
Triton kernels in ``kernels/bucket_topk.py`` with the same segment table and the same
bits (``hvdsparse/compressors/topk_bucket.py`` drives either); and the fp32 decode +
accumulate of received (index, value) rows (``scatter_add.c``, the twin of
``kernels/scatter.py``'s fp32 branch, called by ``hvdsparse/cpu.py``); and the Philox
uniforms of stochastic quantisation (``philox.c``, the twin of ``hvdsparse/philox.py``'s
numpy stream and of Triton's ``tl.rand``); AdaComp's accumulate + bin selection in one
pass (``adacomp.c``, ``cpu.residual_add_binmax`` + ``cpu.binned_select``'s bits; with
DGC's velocity update folded in when the scheduler hands it over) and its decode (sign
rows and bin-relative indices, in ``scatter_add.c``); QSGD's quantiser and dequantiser
and the decode of DENSE segments (``quantize.c``: the bits of ``cpu.py``'s numpy blocks,
Philox drawn inline through ``philox.h``).

Why C: the numpy CPU path walks a layer once per operation (velocity update, residual
add, finiteness check, counting, selection: ~10 passes over a layer per step for TopK
with momentum correction), each near memory speed but together the larger part of a
compressed step's overhead (``scripts/bench_overhead.py``). The C loops fuse them: one pass
for the velocity update and residual add, and usually one for the threshold count and
selection together. The decode reads each received int32 index and fp32 value once,
where ``torch.index_add_`` first copies the indices to int64 and checks their range in
separate passes.

Building: on first use the sources are compiled into one library with the system C compiler (``$CC`` or
``cc``; Triton builds its launchers the same way) with ``-O3 -ffp-contract=off`` (no
FMA contraction: every product and sum is its own fp32 rounding, as on the other paths)
and ``-fno-trapping-math`` (lets gcc if-convert the finiteness tests; IEEE results are
unchanged), into ``$HVDSPARSE_NATIVE_CACHE`` or ``~/.cache/hvdsparse/native/``, under a
name keyed by the sources, the flags and the compiler, written to a temporary file and
renamed (ranks starting together never load a half-written library). Loaded with
``ctypes`` (the GIL is released during calls).

When it cannot be used -- no compiler, a failed build, ``HVDSPARSE_NATIVE=0`` --
:func:`available` is False and TopK layers on the CPU go through the per-layer numpy
path and the decode uses ``torch.index_add_`` (the same bits, slower); a failed build is logged once as a warning with the
compiler's message. Nothing else depends on it.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

__all__ = ["adacomp_select", "available", "bin_slot_indices", "bucket_topk", "dense_add_f32",
           "dense_add_dequantize", "dequantize", "philox_uniform", "quantize_pack",
           "scatter_add_f32", "scatter_add_sign", "top_m", "why_unavailable"]

_log = logging.getLogger(__name__)
_SRCS = [Path(__file__).with_name(f) for f in ("bucket_topk.c", "scatter_add.c",
                                                 "philox.c", "adacomp.c", "quantize.c")]
#: included by the sources (part of the build's cache key)
_HDRS = [Path(__file__).with_name(f) for f in ("philox.h", "dgc.h")]
#: the most slots per bin adacomp.c keeps (its per-bin buffer)
ADACOMP_MAX_C = 256
#: Threshold's overflow ladder reads the hits at tau, not the layer, for an overflow of
#: up to this many times a row's capacity (hvd_select's scratch; larger ones read the
#: layer twice more)
LADDER_HITS = 8
_FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno",
          "-fno-trapping-math"]
_lock = threading.Lock()
_state: dict = {}


def _cache_dir() -> Path:
    d = os.environ.get("HVDSPARSE_NATIVE_CACHE")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                             ".cache")
    return Path(base) / "hvdsparse" / "native"


def _build() -> Path:
    """Compile (or find the cached build of) the sources; returns the library's path."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    srcs = [f.read_bytes() for f in (*_SRCS, *_HDRS)]
    st = os.stat(cc)
    key = hashlib.sha256(b"\0".join([*srcs, " ".join(_FLAGS).encode(), cc.encode(),
                                     str(st.st_mtime_ns).encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    out_dir = _cache_dir()
    out = out_dir / f"hvdsparse_native-{key}.so"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        res = subprocess.run([cc, *_FLAGS, "-I", str(_HDRS[0].parent), "-o", tmp,
                              *map(str, _SRCS), "-lm"],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{cc} failed ({res.returncode}): "
                               f"{(res.stderr or res.stdout).strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load():
    """The loaded library and its table layout, or the reason it is unavailable."""
    with _lock:
        if "lib" in _state or "why" in _state:
            return _state.get("lib")
        if os.environ.get("HVDSPARSE_NATIVE", "1") == "0":
            _state["why"] = "HVDSPARSE_NATIVE=0"
            return None
        try:
            lib = ctypes.CDLL(str(_build()))
        except (OSError, RuntimeError) as e:
            _state["why"] = str(e)
            _log.warning("hvdsparse: the compiled CPU loops are unavailable (%s); TopK "
                         "layers on the CPU use the per-layer numpy path (same results, "
                         "slower)", e)
            return None
        P, I64 = ctypes.c_void_p, ctypes.c_int64
        lib.hvd_layout.restype = ctypes.c_char_p
        lib.hvd_layout.argtypes = []
        lib.hvd_accumulate.argtypes = [P, I64, P]
        lib.hvd_sample.argtypes = [P, I64, P, I64]
        lib.hvd_select.argtypes = [P, I64, P, I64, P, I64, I64, P, P, P, P, ctypes.c_float,
                                   P, I64, P, I64]
        lib.hvd_mask.argtypes = [P, I64, P, P]
        lib.hvd_top_m.argtypes = [P, I64, I64, I64, P, P]
        for f in ("hvd_accumulate", "hvd_sample", "hvd_top_m", "hvd_select", "hvd_mask"):
            getattr(lib, f).restype = None
        lib.hvd_scatter_add_f32.argtypes = [P, I64, P, I64, P, I64, P, I64, P]
        lib.hvd_scatter_add_f32.restype = I64
        lib.hvd_scatter_add_sign.argtypes = [P, I64, P, I64, P, I64, P, P, I64, P]
        lib.hvd_scatter_add_sign.restype = I64
        lib.hvd_bin_slot_indices.argtypes = [P, I64, I64, P, I64, I64, I64, I64, I64, I64,
                                             P, P]
        lib.hvd_bin_slot_indices.restype = None
        lib.hvd_philox_uniform.argtypes = [ctypes.c_uint64, ctypes.c_uint64, I64, P]
        lib.hvd_philox_uniform.restype = None
        F = ctypes.c_float
        lib.hvd_adacomp_select.argtypes = [P, P, I64, I64, I64, P, F, F, P, P, P, P, P, P,
                                           P, P, F, F, F, ctypes.c_int]
        lib.hvd_adacomp_select.restype = I64
        lib.hvd_quantize_pack.argtypes = [P, I64, I64, I64, ctypes.c_int, I64,
                                          ctypes.c_uint64, P, P]
        lib.hvd_quantize_pack.restype = I64
        lib.hvd_dequantize.argtypes = [P, P, ctypes.c_int, I64, I64, I64, P]
        lib.hvd_dequantize.restype = None
        lib.hvd_dense_add_dequantize.argtypes = [P, P, I64, P, I64, P, I64, ctypes.c_int,
                                                 I64]
        lib.hvd_dense_add_dequantize.restype = None
        lib.hvd_dense_add_f32.argtypes = [P, P, I64, P, I64]
        lib.hvd_dense_add_f32.restype = None
        _state["lib"] = lib
        _state["bucket_topk"] = _bucket_topk_namespace(lib)
        return lib


def _lib():
    """The loaded library; RuntimeError when :func:`available` is False."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"hvdsparse.native is unavailable: {_state.get('why')}")
    return lib


def available() -> bool:
    """Whether the compiled CPU loops can be used (builds them on the first call)."""
    return _load() is not None


def why_unavailable() -> Optional[str]:
    """Why :func:`available` is False (None when it is True)."""
    _load()
    return _state.get("why")


def bucket_topk():
    """The CPU twin of ``kernels/bucket_topk.py``: the same table columns (``C_*``,
    ``W``, ``MODE_*``), ``GDT_CODE`` (fp32 only) and functions ``accumulate``,
    ``threshold_and_select`` and ``mask`` with the same arguments and results (slots
    in ascending index order within each segment). Raises RuntimeError when
    :func:`available` is False."""
    _lib()
    return _state["bucket_topk"]


def _bucket_topk_namespace(lib) -> SimpleNamespace:
    cols, modes = lib.hvd_layout().decode().split("|")
    ns = SimpleNamespace(**{c: i for i, c in enumerate(cols.split())})
    ns.W = len(cols.split())
    for kv in modes.split():
        k, v = kv.split("=")
        setattr(ns, k, int(v))
    ns.GDT_CODE = {torch.float32: 0}
    tiny = float(torch.finfo(torch.float32).tiny)

    def _cpu(name, t, dtype, dims=None):
        if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous() or \
                (dims is not None and t.dim() != dims):
            raise ValueError(f"hvdsparse.native: {name} must be a contiguous CPU {dtype} "
                             f"tensor, got {t.dtype} {tuple(t.shape)} on {t.device}")

    def _table(tab):
        _cpu("table", tab, torch.int64, 2)
        if tab.shape[1] != ns.W:
            raise ValueError(f"hvdsparse.native: the table has {tab.shape[1]} columns, "
                             f"the loops read {ns.W}")
        return tab.shape[0]

    def accumulate(tab, blk, grad_scale, gdt, *, block=None):
        """Residual add with the folded velocity update, every row (``blk``, ``block``:
        the Triton launch layout, unused here)."""
        if gdt != 0:
            raise ValueError("hvdsparse.native: fp32 gradients only")
        L = _table(tab)
        s = None
        if grad_scale is not None:
            s = grad_scale.reshape(1)
            _cpu("grad_scale", s, torch.float32)
        lib.hvd_accumulate(tab.data_ptr(), L, None if s is None else s.data_ptr())

    def threshold_and_select(tab, blk, L, smax, mmax, rounds, capacity_total, ve,
                             ladder=None, *, block=None):
        """Sample, ``torch.topk``, the refinement rounds and the selection. Returns
        ``(indices int32[capacity_total], values fp32, counts int32[L, 2], tau fp32[L])``
        as the Triton version does. ``ladder``: Threshold's rung factors
        (``threshold.ladder_factors``; fp32, 1 to 32), required when a row has
        MODE_GUARD."""
        guard = (tab[:, ns.C_MODE] & ns.MODE_GUARD) != 0 if _table(tab) else None
        nscratch = 0
        if guard is not None and bool(guard.any()):
            if ladder is None:
                raise ValueError("hvdsparse.native: a MODE_GUARD row needs the ladder")
            # room for the hits at tau of an overflow up to LADDER_HITS x the capacity,
            # so that the ladder reads the hits, not the layer (bucket_topk.c); at least
            # the capacity, which a step that fits copies from there
            rows = tab[guard]
            cap = rows[:, ns.C_CAP]
            nscratch = int(torch.maximum(cap, torch.minimum(rows[:, ns.C_N],
                                                            LADDER_HITS * cap)).max())
        if ladder is None:
            ladder = torch.ones(1, dtype=torch.float32)
        _cpu("ladder", ladder, torch.float32, 1)
        if not 1 <= ladder.numel() <= 32:
            raise ValueError(f"hvdsparse.native: 1 to 32 ladder rungs, got {ladder.numel()}")
        if float(ladder[0]) != 1.0:
            raise ValueError(f"hvdsparse.native: the ladder's first rung factor must be 1, "
                             f"got {float(ladder[0])}")
        if ve != 0:
            raise ValueError("hvdsparse.native: fp32 values only")
        if _table(tab) != L:
            raise ValueError(f"hvdsparse.native: L={L} but the table has {tab.shape[0]} rows")
        S = torch.empty((L, smax), dtype=torch.float32)
        lib.hvd_sample(tab.data_ptr(), L, S.data_ptr(), smax)
        V = top_m(S, mmax)
        R = max(int(rounds), 1)
        counts = torch.zeros((L, R), dtype=torch.int32)
        idx = torch.empty(capacity_total, dtype=torch.int32)
        vals = torch.empty(capacity_total, dtype=torch.float32)
        cnt = torch.empty((L, 2), dtype=torch.int32)
        tau = torch.empty(L, dtype=torch.float32)
        # untouched pages cost nothing: only the hits of a guard row are written
        scratch = torch.empty(2 * nscratch, dtype=torch.int32)      # indices, magnitudes
        lib.hvd_select(tab.data_ptr(), L, V.data_ptr(), mmax, counts.data_ptr(), R,
                       int(rounds), tau.data_ptr(), idx.data_ptr(), vals.data_ptr(),
                       cnt.data_ptr(), tiny, ladder.data_ptr(), ladder.numel(),
                       scratch.data_ptr() if nscratch else None, LADDER_HITS)
        return idx, vals, cnt, tau

    def mask(tab, idx, cnt, L, capmax, *, block=None):
        """``u[idx] = 0`` for the sent slots of every momentum row."""
        if _table(tab) != L:
            raise ValueError(f"hvdsparse.native: L={L} but the table has {tab.shape[0]} rows")
        _cpu("indices", idx, torch.int32, 1)
        _cpu("counts", cnt, torch.int32, 2)
        lib.hvd_mask(tab.data_ptr(), L, idx.data_ptr(), cnt.data_ptr())

    ns.accumulate = accumulate
    ns.threshold_and_select = threshold_and_select
    ns.mask = mask
    return ns


def top_m(S: torch.Tensor, m: int) -> torch.Tensor:
    """``torch.topk(S, m, dim=1, sorted=True).values`` of a contiguous fp32 CPU ``[L, n]``
    sample of magnitudes (values >= +0, or -1 padding; NaN sorts first, as in
    torch.topk): the same values, by a radix select in ``bucket_topk.c`` (O(n) per row
    whatever the data). Raises RuntimeError when :func:`available` is False."""
    lib = _lib()
    if S.device.type != "cpu" or S.dtype != torch.float32 or not S.is_contiguous() or \
            S.dim() != 2:
        raise ValueError(f"hvdsparse.native.top_m: S must be a contiguous 2-d CPU fp32 "
                         f"tensor, got {S.dtype} {tuple(S.shape)} on {S.device}")
    L, n = S.shape
    if not 0 < m <= n:
        raise ValueError(f"hvdsparse.native.top_m: m must be in [1, {n}], got {m}")
    V = torch.empty((L, m), dtype=torch.float32)
    scratch = torch.empty(2 * n, dtype=torch.int32)
    lib.hvd_top_m(S.data_ptr(), L, n, m, V.data_ptr(), scratch.data_ptr())
    return V


def _scatter_checks(fn, dense, indices, counts, rows, rows_name, rows_dtype, cap_of_rows):
    """Shared argument checks of the scatter entry points; returns the int64 counts."""
    P = indices.shape[0] if indices.dim() == 2 else -1
    for name, t, dt in (("dense", dense, torch.float32), ("indices", indices, torch.int32),
                        (rows_name, rows, rows_dtype)):
        if t.device.type != "cpu" or t.dtype != dt:
            raise ValueError(f"hvdsparse.native.{fn}: {name} must be a CPU {dt} "
                             f"tensor, got {t.dtype} on {t.device}")
    if not dense.is_contiguous() or indices.dim() != 2 or rows.dim() != 2 or \
            rows.shape[0] != P or indices.stride(1) != 1 or rows.stride(1) != 1:
        raise ValueError(f"hvdsparse.native.{fn}: dense must be contiguous and indices / "
                         f"{rows_name} [P, cap] rows with unit column stride, got "
                         f"{tuple(indices.shape)} / {tuple(rows.shape)}")
    cnt = torch.tensor([int(c) for c in counts], dtype=torch.int64)
    lim = min(indices.shape[1], cap_of_rows)
    if cnt.numel() != P or bool(((cnt < 0) | (cnt > lim)).any()):
        raise ValueError(f"hvdsparse.native.{fn}: counts must be P={P} ints in "
                         f"[0, {lim}], got {cnt.tolist()}")
    return cnt


def scatter_add_sign(dense: torch.Tensor, indices: torch.Tensor, counts,
                     signs: torch.Tensor, scale: torch.Tensor):
    """``dense[indices[p, j]] += -scale[p] if sign bit j of row p else scale[p]`` (bit
    ``j % 8`` of byte ``j // 8``), rows in order, ``j < counts[p]``; the same bits as
    ``torch.where`` + ``index_add_`` row by row. ``signs``: uint8 [P, >= ceil(cap / 8)]
    with unit column stride; ``scale``: fp32 [P]. Returns None or the first bad
    ``(row, slot)`` (nothing written then), as :func:`scatter_add_f32`."""
    lib = _lib()
    cnt = _scatter_checks("scatter_add_sign", dense, indices, counts, signs, "signs",
                          torch.uint8, 8 * signs.shape[1] if signs.dim() == 2 else 0)
    sc = scale.detach().reshape(-1).to(torch.float32).contiguous()
    if sc.numel() != indices.shape[0]:
        raise ValueError(f"hvdsparse.native.scatter_add_sign: scale must have P="
                         f"{indices.shape[0]} elements, got {sc.numel()}")
    bad = torch.zeros(2, dtype=torch.int64)
    if lib.hvd_scatter_add_sign(dense.data_ptr(), dense.numel(), indices.data_ptr(),
                                indices.stride(0), signs.data_ptr(), signs.stride(0),
                                sc.data_ptr(), cnt.data_ptr(), indices.shape[0],
                                bad.data_ptr()):
        return int(bad[0]), int(bad[1])
    return None


def scatter_add_f32(dense: torch.Tensor, indices: torch.Tensor, counts, values: torch.Tensor):
    """``dense[indices[p, j]] += values[p, j]`` for every row ``p`` (in order) and ``j <
    counts[p]`` (host ints, each in ``[0, indices.shape[1]]``); the same bits as
    ``index_add_`` row by row. Returns None, or the first ``(row, slot)`` whose index is
    outside ``[0, dense.numel())`` -- then nothing was written. ``dense``: contiguous
    fp32 CPU; ``indices`` int32 and ``values`` fp32 CPU ``[P, >= cap]`` with unit
    column stride (rows may be strided views into a message). Raises RuntimeError when
    :func:`available` is False."""
    lib = _lib()
    P = indices.shape[0] if indices.dim() == 2 else -1
    cnt = _scatter_checks("scatter_add_f32", dense, indices, counts, values, "values",
                          torch.float32, values.shape[1] if values.dim() == 2 else 0)
    bad = torch.zeros(2, dtype=torch.int64)
    if lib.hvd_scatter_add_f32(dense.data_ptr(), dense.numel(), indices.data_ptr(),
                               indices.stride(0), values.data_ptr(), values.stride(0),
                               cnt.data_ptr(), P, bad.data_ptr()):
        return int(bad[0]), int(bad[1])
    return None


def philox_uniform(seed: int, offset: int, out) -> None:
    """``out[i] = tl.rand(seed, offset + i)`` for a contiguous fp32 numpy array or CPU
    tensor ``out`` (``hvdsparse.philox``'s stream, bit for bit). ``seed`` in [0, 2**63),
    ``offset + len(out)`` <= 2**63 (the caller checks). Raises RuntimeError when
    :func:`available` is False."""
    lib = _lib()
    if isinstance(out, torch.Tensor):
        ok = out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous()
        ptr, n = out.data_ptr(), out.numel()
    else:
        ok = str(out.dtype) == "float32" and out.flags["C_CONTIGUOUS"]
        ptr, n = out.ctypes.data, out.size
    if not ok:
        raise ValueError("hvdsparse.native.philox_uniform: out must be a contiguous CPU "
                         "fp32 array")
    if n:
        lib.hvd_philox_uniform(int(seed), int(offset), int(n), ptr)


def adacomp_select(grad: torch.Tensor, residual: torch.Tensor, bin_size: int, c: int,
                   h_scale: float, grad_scale: Optional[torch.Tensor],
                   nonfinite: torch.Tensor, momentum=None, param=None):
    """AdaComp's accumulate and bin selection in one pass (``adacomp.c``): the residual
    becomes ``G`` in place (non-finite gradient elements add nothing and are counted into
    ``nonfinite``), and returns ``(gmax fp32[nb], gidx int64[nb*c], rel int64[nb*c],
    vmask bool[nb*c], count int32[1], bin_counts int32[nb], selected int32[1])`` -- the
    bits of ``cpu.residual_add_binmax`` followed by ``cpu.binned_select`` with the
    threshold ``gmax.clamp_min(TINY)``. ``grad`` / ``residual``: contiguous fp32 CPU of
    the same size; ``c`` in [1, ADACOMP_MAX_C].

    ``momentum`` (a ``topk_bucket.MomentumSpec``; its velocity ``u`` updated in place,
    ``param`` read when it has weight decay): DGC's velocity update in the same pass,
    the bits of ``LocalUpdate.corrected`` followed by the plain call on its result."""
    lib = _lib()
    n = residual.numel()
    mc_args = (None, None, 0.0, 1.0, 0.0, 0)
    if momentum is not None:
        u = momentum.u
        wd = float(momentum.weight_decay)
        need = [("velocity", u)] + ([("param", param)] if wd else [])
        for name, t in need:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or \
                    t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n:
                raise ValueError(f"hvdsparse.native.adacomp_select: {name} must be a "
                                 f"contiguous CPU fp32 tensor of {n} elements")
        mc_args = (u.data_ptr(), param.data_ptr() if wd else None, float(momentum.momentum),
                   1.0 - float(momentum.dampening), wd, int(bool(momentum.nesterov)))
    for name, t in (("grad", grad), ("residual", residual)):
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() \
                or t.numel() != n:
            raise ValueError(f"hvdsparse.native.adacomp_select: {name} must be a contiguous "
                             f"CPU fp32 tensor of {n} elements, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    L, c = int(bin_size), int(c)
    if not 1 <= L <= 65536 or not 1 <= c <= min(L, ADACOMP_MAX_C):
        raise ValueError(f"hvdsparse.native.adacomp_select: bin_size {L} / c {c} outside "
                         f"[1, 65536] / [1, min(bin_size, {ADACOMP_MAX_C})]")
    if nonfinite.dtype != torch.int32 or nonfinite.device.type != "cpu" or \
            not nonfinite.is_contiguous():
        raise ValueError("hvdsparse.native.adacomp_select: nonfinite must be a CPU int32 "
                         "counter")
    s = None
    if grad_scale is not None:
        s = grad_scale.detach().reshape(-1)[:1].to(torch.float32).contiguous()
    nb = -(-n // L)
    gmax = torch.empty(nb, dtype=torch.float32)
    gidx = torch.zeros(nb * c, dtype=torch.int64)
    rel = torch.zeros(nb * c, dtype=torch.int64)
    bin_counts = torch.empty(nb, dtype=torch.int32)
    sel = torch.zeros(1, dtype=torch.int64)
    hm1 = ctypes.c_float(float(h_scale) - 1.0).value      # fp32(scale - 1), as numpy's
    tiny = float(torch.finfo(torch.float32).tiny)
    count = lib.hvd_adacomp_select(grad.data_ptr(), residual.data_ptr(), n, L, c,
                                   None if s is None else s.data_ptr(), hm1, tiny,
                                   gmax.data_ptr(), gidx.data_ptr(), rel.data_ptr(),
                                   bin_counts.data_ptr(), sel.data_ptr(),
                                   nonfinite.data_ptr(), *mc_args)
    if count < 0:
        raise MemoryError("hvdsparse.native.adacomp_select: out of memory for a bin")
    vmask = torch.zeros(nb * c, dtype=torch.bool)
    vmask[:count] = True
    return (gmax, gidx, rel, vmask, torch.tensor([count], dtype=torch.int32), bin_counts,
            sel.to(torch.int32))


def bin_slot_indices(rel: torch.Tensor, bin_counts: torch.Tensor, bin_size: int,
                     numel: int) -> torch.Tensor:
    """Layer indices int32 [P, C] of bin-relative slots (``codec_slots.slot_indices``'s rule
    for BIN_U8 / BIN_U16 segments, bit for bit): ``rel`` uint8 or int16 (uint16 bits)
    [P, C] and ``bin_counts`` int32 [P, nb], CPU, unit column stride."""
    lib = _lib()
    if rel.dim() != 2 or bin_counts.dim() != 2 or rel.shape[0] != bin_counts.shape[0] or \
            rel.dtype not in (torch.uint8, torch.int16) or bin_counts.dtype != torch.int32 or \
            rel.device.type != "cpu" or bin_counts.device.type != "cpu" or \
            rel.stride(1) != 1 or bin_counts.stride(1) != 1:
        raise ValueError(f"hvdsparse.native.bin_slot_indices: rel must be uint8 / int16 "
                         f"[P, C] and bin_counts int32 [P, nb] CPU rows, got {rel.dtype} "
                         f"{tuple(rel.shape)} / {bin_counts.dtype} {tuple(bin_counts.shape)}")
    P, C = rel.shape
    out = torch.empty((P, C), dtype=torch.int32)
    hist = torch.empty(C + 1, dtype=torch.int64)
    lib.hvd_bin_slot_indices(rel.data_ptr(), rel.stride(0) * rel.element_size(),
                             rel.element_size(), bin_counts.data_ptr(), bin_counts.stride(0),
                             bin_counts.shape[1], P, C, int(bin_size), int(numel),
                             hist.data_ptr(), out.data_ptr())
    return out


def _np_ptr(name: str, a, dtype: str, n: int) -> int:
    """The data pointer of a contiguous numpy array of ``dtype`` with >= ``n`` elements."""
    if str(a.dtype) != dtype or not a.flags["C_CONTIGUOUS"] or a.size < n:
        raise ValueError(f"hvdsparse.native: {name} must be a contiguous {dtype} array of "
                         f">= {n} elements, got {a.dtype} [{a.size}]")
    return a.ctypes.data


def _check_quant(bits: int, bucket_size: int):
    if bits not in (2, 4, 8) or bucket_size < 1:
        raise ValueError(f"hvdsparse.native: bits must be 2, 4 or 8 and bucket_size >= 1, "
                         f"got {bits} / {bucket_size}")


def quantize_pack(v, count: int, bits: int, bucket_size: int, seed: int, codes, scales,
                  start: int, end: int) -> None:
    """``cpu.quantize_pack``'s bits for elements ``[start, end)`` of the fp32 numpy array
    ``v`` (``count`` valid elements, the rest read as 0): their bucket scales into
    ``scales`` and their packed codes into ``codes`` (uint8 numpy arrays of the whole
    layer). ``start`` is a multiple of ``bucket_size`` and of ``8 // bits``; so is ``end``
    unless it is ``len(v)``. Raises RuntimeError when :func:`available` is False."""
    lib = _lib()
    _check_quant(bits, bucket_size)
    n = v.size
    per = 8 // bits
    if not (0 <= start <= end <= n) or start % bucket_size or start % per or \
            (end != n and (end % bucket_size or end % per)):
        raise ValueError(f"hvdsparse.native.quantize_pack: range [{start}, {end}) of {n} is "
                         f"not aligned to the bucket size {bucket_size} and {per} codes/byte")
    pv = _np_ptr("v", v, "float32", n)
    pc = _np_ptr("codes", codes, "uint8", -(-n * bits // 8))
    ps = _np_ptr("scales", scales, "float32", -(-n // bucket_size))
    if end > start and lib.hvd_quantize_pack(pv, int(start), int(end), int(count), int(bits),
                                             int(bucket_size), int(seed), pc, ps):
        raise MemoryError("hvdsparse.native.quantize_pack: out of memory for a block")


def dequantize(codes, scales, bits: int, bucket_size: int, start: int, end: int,
               out) -> None:
    """``cpu.dequantize_unpack``'s values of elements ``[start, end)`` into the fp32 numpy
    array ``out`` (element ``start`` at ``out[0]``); ``codes`` / ``scales`` numpy arrays
    of the whole layer."""
    lib = _lib()
    _check_quant(bits, bucket_size)
    if not 0 <= start <= end:
        raise ValueError(f"hvdsparse.native.dequantize: bad range [{start}, {end})")
    pc = _np_ptr("codes", codes, "uint8", -(-end * bits // 8))
    ps = _np_ptr("scales", scales, "float32", -(-end // bucket_size))
    po = _np_ptr("out", out, "float32", end - start)
    if end > start:
        lib.hvd_dequantize(pc, ps, int(bits), int(bucket_size), int(start), int(end), po)


def _dense_rows_checks(fn, dense, counts, rows, rows_name, dtype, per_row):
    if dense.device.type != "cpu" or dense.dtype != torch.float32 or \
            not dense.is_contiguous():
        raise ValueError(f"hvdsparse.native.{fn}: dense must be a contiguous CPU fp32 tensor")
    if rows.device.type != "cpu" or rows.dtype != dtype or rows.dim() != 2 or \
            rows.stride(1) != 1:
        raise ValueError(f"hvdsparse.native.{fn}: {rows_name} must be CPU {dtype} [P, ...] "
                         f"rows with unit column stride, got {rows.dtype} "
                         f"{tuple(rows.shape)} on {rows.device}")
    P = rows.shape[0]
    cnt = torch.tensor([int(c) for c in counts], dtype=torch.int64)
    lim = min(dense.numel(), per_row)
    if cnt.numel() != P or bool(((cnt < 0) | (cnt > lim)).any()):
        raise ValueError(f"hvdsparse.native.{fn}: counts must be P={P} ints in [0, {lim}], "
                         f"got {cnt.tolist()}")
    return cnt


def dense_add_dequantize(dense: torch.Tensor, counts, codes: torch.Tensor,
                         scales: torch.Tensor, bits: int, bucket_size: int) -> None:
    """The decode of quantised DENSE segments: ``dense[j] += dequantize(codes[p],
    scales[p])[j]`` for ``j < counts[p]``, rows in order (the bits of ``index_add_`` of
    ``cpu.dequantize_unpack`` rows at indices ``arange``). ``codes`` uint8 [P, >=
    ceil(cap * bits / 8)], ``scales`` fp32 [P, >= ceil(cap / bucket_size)], unit column
    stride."""
    lib = _lib()
    _check_quant(bits, bucket_size)
    cnt = _dense_rows_checks("dense_add_dequantize", dense, counts, codes, "codes",
                             torch.uint8, codes.shape[1] * 8 // bits if codes.dim() == 2
                             else 0)
    lim = int(cnt.max()) if cnt.numel() else 0
    if scales.device.type != "cpu" or scales.dtype != torch.float32 or scales.dim() != 2 or \
            scales.shape[0] != codes.shape[0] or scales.stride(1) != 1 or \
            scales.shape[1] < -(-lim // bucket_size):
        raise ValueError(f"hvdsparse.native.dense_add_dequantize: scales must be CPU fp32 "
                         f"[P={codes.shape[0]}, >= {-(-lim // bucket_size)}] rows, got "
                         f"{scales.dtype} {tuple(scales.shape)}")
    lib.hvd_dense_add_dequantize(dense.data_ptr(), codes.data_ptr(), codes.stride(0),
                                 scales.data_ptr(), scales.stride(0), cnt.data_ptr(),
                                 codes.shape[0], int(bits), int(bucket_size))


def dense_add_f32(dense: torch.Tensor, counts, values: torch.Tensor) -> None:
    """The decode of fp32 DENSE segments: ``dense[j] += values[p, j]`` for ``j <
    counts[p]``, rows in order (``index_add_`` at indices ``arange``, row by row)."""
    lib = _lib()
    cnt = _dense_rows_checks("dense_add_f32", dense, counts, values, "values", torch.float32,
                             values.shape[1] if values.dim() == 2 else 0)
    lib.hvd_dense_add_f32(dense.data_ptr(), values.data_ptr(), values.stride(0),
                          cnt.data_ptr(), values.shape[0])
