"""Dispatcher of the compression kernels: Triton on GPUs, :mod:`hvdsparse.cpu` on CPU.

Every function here has the signature of the same-named function in
:mod:`hvdsparse.cpu` (which documents the math and the layouts; see also
``docs/design.md``). Dispatch rule, per call:

* ``HVDSPARSE_FORCE_TRITON=1`` in the environment -> the Triton kernel, whatever the
  device (tests set it together with ``TRITON_INTERPRET=1`` to run kernels on CPU
  tensors through Triton's interpreter);
* else the Triton kernel when the (first) tensor argument is a CUDA tensor (ImportError
  with an install hint if Triton does not import: no silent CPU fallback on a GPU);
  the CPU path otherwise.

Triton and the kernels are imported lazily, on the first call that needs them, so a
CPU-only process never imports Triton, and nothing here ever probes Triton's driver
(which raises without a GPU): a CUDA tensor already proves there is a GPU.

On the Triton path nothing synchronises with the host: counts, flags, thresholds and
scales stay device tensors.

Importing the kernels: the Triton modules live in the repository's top-level
``kernels/`` directory, which ``setup.cfg`` installs as the subpackage
``hvdsparse.kernels`` (``package_dir``), so an installed (or ``pip install -e``)
hvdsparse simply imports ``hvdsparse.kernels``. In a bare checkout used through
``PYTHONPATH`` that subpackage does not exist on disk; :func:`_kernels` then loads
``<repo>/kernels/__init__.py`` by path *under the same name* ``hvdsparse.kernels`` (with
its directory as the package search path), so relative imports inside ``kernels/`` and
``sys.modules`` look exactly as in the installed layout, and no generic top-level
``kernels`` module is ever created.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Optional

import torch

from . import cpu as _ref
from . import native

__all__ = [
    "residual_add", "residual_add_binmax", "select_compact", "quantize_pack", "dequantize_unpack",
    "sign_unpack", "scatter_add_decode", "dense_add_decode", "philox_uniform", "use_triton",
    "pack_bits", "unpack_bits", "row_threshold_kernel", "row_threshold_max_d", "count_abs_ge",
    "has_cpu_path", "binned_select", "select_if_in_range", "refine_topk_threshold",
    "clean_grad", "zero_slots", "binned_pack", "binned_max_bin",
]

_KERNELS = None


def _kernels():
    """The hvdsparse.kernels package (imports triton), loaded once. See module doc."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    name = __package__ + ".kernels"
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        kdir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "kernels")
        init = os.path.join(kdir, "__init__.py")
        if not os.path.isfile(init):
            raise ImportError(f"hvdsparse.kernels is not installed and {init} does not "
                              f"exist") from e
        spec = importlib.util.spec_from_file_location(name, init,
                                                      submodule_search_locations=[kdir])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]
            raise
    _KERNELS = mod
    return mod


def kernels_package():
    """The ``hvdsparse.kernels`` package (imports Triton), loaded once (module docstring):
    for tools that compile or count the kernels themselves (``scripts/compile_kernels.py``)."""
    return _kernels()


def bucket_kernels(family: str):
    """The Triton module of a bucket-path kernel family, ``kernels/bucket_<family>.py``
    (``topk``, ``dense``, ...: whole buckets of layers as rows of one segment table,
    driven by ``hvdsparse/compressors/bucket.py``), imported once with the kernels
    package."""
    if not isinstance(family, str) or not family.isidentifier():
        raise ValueError(f"bucket_kernels: family must be an identifier, got {family!r}")
    return importlib.import_module(_kernels().__name__ + ".bucket_" + family)


def compiled_cpu_available() -> bool:
    """Whether the compiled CPU loops (:mod:`hvdsparse.native`) are built and loaded; False
    with ``HVDSPARSE_NATIVE=0``, without a C compiler or after a failed build (the numpy
    CPU path then runs, with the same bits). Compressors ask here, never ``native``."""
    return native.available()


def bucket_topk_kernels(t: torch.Tensor):
    """TopK's bucket path for tensor ``t``'s device: ``kernels/bucket_topk.py`` on the
    Triton path, else its compiled CPU twin (``native.bucket_topk()``: the same segment
    table, the same bits; only when :func:`compiled_cpu_available`)."""
    return bucket_kernels("topk") if use_triton(t) else native.bucket_topk()


#: the most slots per bin :func:`adacomp_select` keeps
ADACOMP_MAX_C = native.ADACOMP_MAX_C


def adacomp_select(grad: torch.Tensor, residual: torch.Tensor, bin_size: int, c: int,
                   h_scale: float, grad_scale: Optional[torch.Tensor],
                   nonfinite: torch.Tensor, momentum=None, param=None):
    """AdaComp's accumulate, bin maxima and selection in one pass over a CPU layer (the
    compiled loop; only when :func:`compiled_cpu_available`, ``c <= ADACOMP_MAX_C``).
    Contract, layouts and bits: :func:`hvdsparse.native.adacomp_select`."""
    return native.adacomp_select(grad, residual, bin_size, c, h_scale, grad_scale, nonfinite,
                                 momentum=momentum, param=param)


def sqrt_rn(t: torch.Tensor) -> torch.Tensor:
    """``sqrt(t)`` correctly rounded (IEEE), as a new tensor: CUDA's ``torch.sqrt`` is;
    the CPU's vectorised fp32 ``torch.sqrt`` is not (1 ulp off on ~16% of elements,
    measured on torch 2.13), so an fp32 CPU tensor takes the root in fp64 (exact after
    rounding back: 53 >= 2 * 24 + 2 bits). What ``kernels/``' ``sqrt_rn`` computes."""
    if t.device.type == "cpu" and t.dtype == torch.float32:
        return t.double().sqrt_().float()
    return t.sqrt()


def use_triton(t: Optional[torch.Tensor]) -> bool:
    """True when calls on tensor ``t`` go to the Triton kernels (see module doc).

    A CUDA tensor with no importable Triton raises ImportError: falling back to the CPU
    path there would silently run a slow, host-synchronising path on the GPU."""
    if os.environ.get("HVDSPARSE_FORCE_TRITON", "") == "1":
        return True
    if t is None or not t.is_cuda:
        return False
    _triton_or_raise()
    return True


_TRITON_OK = False


def _triton_or_raise() -> None:
    global _TRITON_OK
    if _TRITON_OK:
        return
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "hvdsparse: a CUDA tensor needs the Triton kernels, but `import triton` failed "
            f"({e}); install the triton version your torch pins (pip install triton)") from e
    _TRITON_OK = True


def residual_add_binmax(grad: torch.Tensor, residual: torch.Tensor, bin_size: int, *,
                        out: Optional[torch.Tensor] = None,
                        grad_scale: Optional[torch.Tensor] = None,
                        nonfinite: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``d = fp32(grad) * grad_scale``; ``residual += d`` where ``d`` is finite (else the
    residual keeps its value and ``nonfinite[0]`` is incremented); returns the per-bin
    ``max |residual|``. See :func:`hvdsparse.cpu.residual_add_binmax` for the exact
    rounding (two separate fp32 roundings, never an FMA) and NaN rule.

    ``grad_scale``: None or a 1-element fp32 tensor on the residual's device (read on the
    device, e.g. ``1 / loss_scale``); ``nonfinite``: None or an int32[>=1] tensor on that
    device. Neither synchronises with the host on the Triton path.
    """
    if not use_triton(residual):
        return _ref.residual_add_binmax(grad, residual, bin_size, out=out,
                                        grad_scale=grad_scale, nonfinite=nonfinite)
    _ref.check_residual_args(grad, residual, bin_size, out, grad_scale, nonfinite)
    return _kernels().residual_add_binmax(grad, residual, bin_size, out=out,
                                          grad_scale=grad_scale, nonfinite=nonfinite)


def clean_grad(grad: torch.Tensor, *, grad_scale: Optional[torch.Tensor] = None,
               nonfinite: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``where(isfinite(d), d, 0)`` with ``d = fp32(grad) * grad_scale`` (a new fp32
    tensor), non-finite elements added to ``nonfinite[0]``: see
    :func:`hvdsparse.cpu.clean_grad`. Triton: one launch (``kernels/clean.py``) instead
    of ~8 device ops; elsewhere torch ops. No host sync on either."""
    if not use_triton(grad):
        return _ref.clean_grad(grad, grad_scale=grad_scale, nonfinite=nonfinite)
    _ref.check_clean_args(grad, grad_scale, nonfinite)
    return _kernels().clean_grad(grad.contiguous(), grad_scale=grad_scale,
                                 nonfinite=nonfinite)


def zero_slots(flat: torch.Tensor, positions: torch.Tensor, count: torch.Tensor) -> None:
    """``flat[positions[j]] = 0`` for ``j < count[0]`` (momentum-factor masking), no
    host sync: see :func:`hvdsparse.cpu.zero_slots`. Triton: one launch
    (``kernels/masking.py``) instead of ~10 device ops."""
    if not use_triton(flat):
        _ref.zero_slots(flat, positions, count)
        return
    _ref.check_zero_slots_args(flat, positions, count)
    _kernels().zero_slots(flat, positions.contiguous(), count.reshape(1))


def residual_add(grad: torch.Tensor, residual: torch.Tensor, *,
                 grad_scale: Optional[torch.Tensor] = None,
                 nonfinite: Optional[torch.Tensor] = None) -> None:
    """:func:`residual_add_binmax` for callers that ignore the bin maxima. CPU: the
    chunked loop without ``|residual|`` / max (one pass fewer); Triton: the same fused
    kernel with one bin per 2^14 elements (the maxima cost nothing measurable there: the
    kernel is bound by reading grad and residual)."""
    if not use_triton(residual):
        _ref.residual_add(grad, residual, grad_scale=grad_scale, nonfinite=nonfinite)
        return
    n = residual.numel()
    residual_add_binmax(grad, residual, min(max(n, 1), 1 << 14), grad_scale=grad_scale,
                        nonfinite=nonfinite)


def count_abs_ge(x: torch.Tensor, threshold: torch.Tensor, *, same_as=None,
                 abs_out: Optional[torch.Tensor] = None,
                 mask_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``#{i : |x_i| >= threshold}`` as a fp32 0-d tensor on ``x``'s device (NaN never
    counts). CPU: one fused chunked pass (:func:`hvdsparse.cpu.count_abs_ge`, which
    also skips the pass when ``same_as = (t_prev, c_prev)`` has ``t_prev == threshold``).
    Elsewhere: ``abs`` (into ``abs_out``), ``ge`` (into ``mask_out``), ``count_nonzero``
    on the device, no host sync (``same_as`` ignored)."""
    if not use_triton(x) and x.device.type == "cpu" and x.dtype == torch.float32:
        return _ref.count_abs_ge(x.reshape(-1), threshold, same_as=same_as)
    a = torch.abs(x, out=abs_out) if abs_out is not None else x.abs()
    ge = torch.ge(a, threshold, out=mask_out) if mask_out is not None else a >= threshold
    # count_nonzero, not bool .sum(): the latter is ~7x slower on CPU (int64 cast)
    return torch.count_nonzero(ge).to(torch.float32)


def refine_topk_threshold(acc: torch.Tensor, v: torch.Tensor, k: int, capacity: int,
                          r0: int, rounds: int, *, counts: Optional[torch.Tensor] = None,
                          first_count=None) -> torch.Tensor:
    """TopK's threshold refinement (plain definition: :func:`hvdsparse.oracle.
    refine_topk_threshold`): ``rounds`` counting passes of ``|acc| >= t`` over the layer,
    each moving ``t`` along ``v`` (the sample's largest magnitudes, descending) unless
    the count is in ``[k, capacity]``. Returns a 0-d fp32 device tensor, no host sync.
    Triton: one launch per round plus one (``kernels/refine.py``; ``counts`` an optional
    int32[>= rounds] scratch). Elsewhere the same rule as device ops, each count on the
    CPU path one fused chunked pass (:func:`count_abs_ge`, skipped when ``t`` did not
    move), on other devices ``abs`` once then ``ge`` + ``count_nonzero`` per round.
    ``first_count`` (CPU path only): optional callable ``t -> count`` used instead of the
    first round's counting pass; it must return exactly ``#{|acc| >= t}``."""
    if not isinstance(acc, torch.Tensor) or acc.dim() != 1 or acc.dtype != torch.float32:
        raise ValueError(f"refine_topk_threshold: acc must be a 1-D fp32 tensor, got "
                         f"{getattr(acc, 'dtype', type(acc))} of shape "
                         f"{tuple(getattr(acc, 'shape', ()))}")
    if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.dtype != torch.float32 \
            or v.device != acc.device or v.numel() == 0:
        raise ValueError("refine_topk_threshold: v must be a non-empty 1-D fp32 tensor on "
                         "acc's device")
    m = v.numel()
    if not (1 <= int(r0) <= m):
        raise ValueError(f"refine_topk_threshold: r0 must be in [1, {m}], got {r0!r}")
    if not (0 <= int(k) <= int(capacity)):
        raise ValueError(f"refine_topk_threshold: need 0 <= k <= capacity, got k={k}, "
                         f"capacity={capacity}")
    if not (0 <= int(rounds) <= 16):
        raise ValueError(f"refine_topk_threshold: rounds must be in [0, 16], got {rounds}")
    if use_triton(acc):
        if acc.numel() >= 2**31 or m >= 2**22:
            raise ValueError(f"refine_topk_threshold: acc has {acc.numel()} elements and v "
                             f"{m}; the kernel counts in int32 (< 2**31) and needs "
                             f"m < 2**22")
        return _kernels().refine_topk_threshold(acc.contiguous(), v.contiguous(), int(k),
                                                int(capacity), int(r0), int(rounds),
                                                counts=counts)
    cpu = has_cpu_path(acc)
    target = 0.5 * (k + capacity)
    t = v[r0 - 1]
    r = torch.full((), float(r0), dtype=torch.float32, device=acc.device)
    a = acc.abs() if rounds > 0 and not cpu else None
    prev = None
    for _ in range(rounds):
        c = first_count(t) if first_count is not None and prev is None else None
        if c is None:
            # count_nonzero, not bool .sum(): the latter is ~7x slower on CPU (int64 cast)
            c = count_abs_ge(acc, t, same_as=prev) if cpu else \
                torch.count_nonzero(a >= t).to(torch.float32)
        prev = (t, c)
        ok = (c >= k) & (c <= capacity)
        r_new = (r * target / c.clamp_min(1.0)).round().clamp(1.0, float(m))
        # index_select with a 1-element tensor: indexing with a 0-d tensor would be
        # treated as a Python int (a host sync on CUDA)
        t_new = v.index_select(0, (r_new - 1).to(torch.long).reshape(1)).reshape(())
        t = torch.where(ok, t, t_new)
        r = torch.where(ok, r, r_new)
    return t.clamp_min(float(torch.finfo(torch.float32).tiny))


def has_cpu_path(t: torch.Tensor) -> bool:
    """True when operations on ``t`` run on the numpy CPU path (a CPU tensor and no
    forced Triton): callers may then use the CPU-only helpers below."""
    return not use_triton(t) and t.device.type == "cpu"


def binned_select(acc, grad, h_scale, threshold, bin_size, c, grad_scale=None):
    """CPU only (see :func:`has_cpu_path`): :func:`hvdsparse.cpu.binned_select`."""
    if not has_cpu_path(acc):
        raise RuntimeError("ops.binned_select is the CPU path; on other devices use "
                           "compressors.base.binned_topc")
    return _ref.binned_select(acc, grad, h_scale, threshold, bin_size, c,
                              grad_scale=grad_scale)


def segment_means(x: torch.Tensor, table: torch.Tensor, width: int, c_start: int,
                  c_len: int, rows: int, out: torch.Tensor) -> torch.Tensor:
    """Triton only: ``out[j]`` = the mean of ``x[start_j : start_j + len_j]`` for ``j <
    rows``, ``(start_j, len_j)`` = ``table[j, c_start]``, ``table[j, c_len]`` (an int64
    ``[>= rows, width]`` device table), in ``kernels/segment_mean.py``'s fixed order (the
    same bits alone or among others, and as :func:`segment_mean` on the CPU). One
    launch."""
    if not use_triton(x):
        raise RuntimeError("ops.segment_means is the Triton path")
    if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous():
        raise ValueError("segment_means: x must be a contiguous 1-D fp32 tensor")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != width or \
            table.shape[0] < rows or not table.is_contiguous():
        raise ValueError(f"segment_means: table must be a contiguous int64 [>= {rows}, "
                         f"{width}] tensor, got {table.dtype} {tuple(table.shape)}")
    if out.dtype != torch.float32 or out.numel() < rows or not out.is_contiguous():
        raise ValueError(f"segment_means: out must be a contiguous fp32 tensor of at least "
                         f"{rows} elements")
    return _kernels().segment_mean.segment_means(x, table, int(width), int(c_start),
                                                 int(c_len), int(rows), out)


def split_decode_ranges(gathered: torch.Tensor, table: torch.Tensor, rows: int, max_k: int,
                        out: torch.Tensor, flag: torch.Tensor, vdtype: torch.dtype,
                        max_shift: int) -> torch.Tensor:
    """Triton only: the ``split`` exchange's range messages in ``gathered`` (uint8, a
    multiple of 4 bytes) written into ``out`` (fp32) as ``table``'s ``rows`` rows
    describe them (int64 ``[>= rows, kernels/split_ranges.WIDTH]``, at most ``max_k``
    elements a row), fp16 values shifted by their header's ``e`` (at most
    ``max_shift``); an index outside its range ORs ``ERR_INDEX`` into ``flag`` (int32).
    One launch; ``kernels/split_ranges.py`` has the layout."""
    if not use_triton(out):
        raise RuntimeError("ops.split_decode_ranges is the Triton path")
    k = _kernels().split_ranges
    if gathered.dtype != torch.uint8 or gathered.dim() != 1 or not gathered.is_contiguous() \
            or gathered.numel() % 4 or gathered.data_ptr() % 4:
        raise ValueError("split_decode_ranges: gathered must be contiguous 1-D uint8 bytes, "
                         "4-aligned, a multiple of 4 long")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != k.WIDTH or \
            table.shape[0] < rows or not table.is_contiguous():
        raise ValueError(f"split_decode_ranges: table must be a contiguous int64 [>= {rows}, "
                         f"{k.WIDTH}] tensor, got {table.dtype} {tuple(table.shape)}")
    if out.dtype != torch.float32 or not out.is_contiguous() or \
            flag.dtype != torch.int32 or not flag.is_contiguous() or flag.numel() < 1:
        raise ValueError("split_decode_ranges: out must be contiguous fp32 and flag a "
                         "contiguous int32 tensor")
    if vdtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"split_decode_ranges: values must be fp32, fp16 or bf16, got {vdtype}")
    vals = gathered.view(vdtype)
    return k.decode_ranges(gathered.view(torch.int32), gathered.view(torch.float32), vals,
                           table, int(rows), int(max_k), out, flag,
                           vdtype == torch.float16, int(max_shift))


_WHOLE: dict = {}


def segment_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean of all of ``x`` (1-D fp32) in :func:`segment_means`' order (a 0-d
    tensor): the same bits on the CPU path (``cpu_residual.segment_mean``) and on the
    Triton path (one row of :func:`segment_means`, as a bucket's row of the same
    elements). The Triton path's one-row table is cached per length and device (copied
    without a stream synchronisation)."""
    if not use_triton(x):
        return _ref.segment_mean(x)
    n = x.numel()
    key = (n, str(x.device))
    tab = _WHOLE.get(key)
    if tab is None:
        if len(_WHOLE) > 4096:
            _WHOLE.clear()
        host = torch.tensor([[0, n]], dtype=torch.int64)
        # pinned + non_blocking: no stream synchronisation even on first use
        tab = _WHOLE[key] = host.pin_memory().to(x.device, non_blocking=True) \
            if x.is_cuda else host.to(x.device)
    out = torch.empty(1, dtype=torch.float32, device=x.device)
    return segment_means(x.reshape(-1), tab, 2, 0, 1, 1, out).reshape(())


def binned_pack(acc, grad, h_scale, threshold, bin_size, c, scale, grad_scale=None,
                budget=None, rot=0):
    """Triton only (``use_triton(acc)``, bins of at most ``kernels/binned.py``'s
    ``MAX_BIN`` elements): AdaComp's selection (:func:`hvdsparse.cpu.binned_select`'s
    rule, bit for bit) plus packing (bin-relative indices, sign bits) and the residue
    update ``acc[i] -= q_i`` in two launches. With ``budget`` (an int below ``nb * c``)
    the message holds ``budget`` slots and each bin sends its :func:`bin_quota` of the
    largest (one launch more). Returns ``(rel, sign_bytes, count, bin_counts,
    selected)``; see the kernel module."""
    if not use_triton(acc):
        raise RuntimeError("ops.binned_pack is the Triton path; on the CPU use "
                           "ops.binned_select")
    n = acc.numel()
    L = int(bin_size)
    if not isinstance(acc, torch.Tensor) or acc.dim() != 1 or acc.dtype != torch.float32:
        raise ValueError("binned_pack: acc must be a 1-D fp32 tensor")
    if not isinstance(grad, torch.Tensor) or grad.numel() != n or grad.device != acc.device:
        raise ValueError("binned_pack: grad must have acc's elements and device")
    if not 1 <= L <= binned_max_bin():
        raise ValueError(f"binned_pack: bin_size must be in [1, {binned_max_bin()}], "
                         f"got {bin_size}")
    nb = -(-n // L) if n else 0
    if threshold.numel() != nb or threshold.dtype != torch.float32:
        raise ValueError(f"binned_pack: threshold must be fp32 with {nb} bins, got "
                         f"{threshold.numel()} {threshold.dtype}")
    if not (isinstance(c, int) and 1 <= c <= L):
        raise ValueError(f"binned_pack: c must be an int in [1, {L}], got {c!r}")
    if n >= 2**31:
        raise ValueError(f"binned_pack: acc has {n} elements (int32 slot counts)")
    _ref.check_grad_scale(grad_scale, acc.device)
    if budget is not None:
        _check_budget("binned_pack", budget, rot, nb, c)
    return _kernels().binned_pack(acc, grad.reshape(-1).contiguous(), h_scale,
                                  threshold.contiguous(), L, c, scale,
                                  grad_scale=grad_scale, budget=budget, rot=int(rot))


def _check_budget(where, budget, rot, nb, c):
    if not isinstance(budget, int) or isinstance(budget, bool) or not 0 <= budget < nb * c:
        raise ValueError(f"{where}: budget must be an int in [0, {nb * c}) (bins x slots "
                         f"per bin), got {budget!r}")
    if not isinstance(rot, int) or isinstance(rot, bool) or not 0 <= rot < max(nb, 1):
        raise ValueError(f"{where}: rot must be an int in [0, {nb}), got {rot!r}")


def bin_quota(cnt, budget, rot, c):
    """AdaComp's layer budget: ``cnt`` (int32 [nb], every entry in ``[0, c]``) becomes
    the quota :func:`hvdsparse.oracle.bin_quota` deals (``budget`` slots one per bin per
    round, bins visited cyclically from ``rot``). On the Triton path ``cnt`` is
    overwritten in place (one launch) and returned; elsewhere a new tensor
    (:func:`hvdsparse.cpu.bin_quota`). ``budget >= nb * c`` returns ``cnt`` unchanged.
    No host synchronisation."""
    if not isinstance(cnt, torch.Tensor) or cnt.dtype != torch.int32 or cnt.dim() != 1 \
            or not cnt.is_contiguous():
        raise ValueError("bin_quota: cnt must be a contiguous 1-D int32 tensor")
    nb = cnt.numel()
    if not isinstance(c, int) or isinstance(c, bool) or not 1 <= c <= 65536:
        raise ValueError(f"bin_quota: c must be an int in [1, 65536], got {c!r}")
    if nb == 0 or (isinstance(budget, int) and budget >= nb * c):
        return cnt
    _check_budget("bin_quota", budget, rot, nb, c)
    if nb * c >= 2 ** 31:
        raise ValueError(f"bin_quota: {nb} bins x {c} slots exceed int32 slot counts")
    if not use_triton(cnt):
        return _ref.bin_quota(cnt, budget, rot, c)
    return _kernels().bin_quota.quota(cnt, budget, rot, c)


def binned_max_bin() -> int:
    """Largest bin :func:`binned_pack` takes (the kernel's tile width)."""
    return 4096


def select_if_in_range(acc, threshold, k, capacity):
    """CPU only (see :func:`has_cpu_path`): :func:`hvdsparse.cpu.select_if_in_range`."""
    if not has_cpu_path(acc):
        raise RuntimeError("ops.select_if_in_range is the CPU path (it reads the count "
                           "on the host)")
    return _ref.select_if_in_range(acc, threshold, k, capacity)


def select_compact(acc: torch.Tensor, threshold, capacity: int, *, bin_size: int = 0,
                   grad: Optional[torch.Tensor] = None, h_scale: float = 1.0,
                   value_encoding=_ref.VE_FP32, sign_scale=None, out=None,
                   grad_scale: Optional[torch.Tensor] = None):
    """See :func:`hvdsparse.cpu.select_compact` (GPU: slot order differs, see
    ``kernels/select.py``). ``grad_scale``: None or a 1-element fp32 device tensor that
    multiplies ``grad`` (as in :func:`residual_add_binmax`)."""
    if not use_triton(acc):
        return _ref.select_compact(acc, threshold, capacity, bin_size=bin_size, grad=grad,
                                   h_scale=h_scale, value_encoding=value_encoding,
                                   sign_scale=sign_scale, out=out, grad_scale=grad_scale)
    n, thr, capacity, L, ve, sscale = _ref.check_select_args(
        acc, threshold, capacity, bin_size, grad, value_encoding, sign_scale)
    _ref.check_grad_scale(grad_scale, acc.device)
    out = _ref.alloc_select_out(out, capacity, ve, acc.device) if out is not None else None
    return _kernels().select_compact(acc, thr, capacity, bin_size=L, grad=grad,
                                     h_scale=float(h_scale), value_encoding=ve,
                                     sign_scale=sscale, out=out, grad_scale=grad_scale)


def quantize_pack(values: torch.Tensor, bits: int, bucket_size: int, seed: int, count=None):
    """See :func:`hvdsparse.cpu.quantize_pack`."""
    if not use_triton(values):
        return _ref.quantize_pack(values, bits, bucket_size, seed, count)
    _ref.check_1d("values", values, _ref.FLOAT_INPUT_DTYPES)
    _ref.check_bits(bits)
    _ref.check_pos_int("bucket_size", bucket_size)
    _ref.check_seed(seed)
    if count is not None and not isinstance(count, torch.Tensor):
        count = torch.tensor([int(count)], dtype=torch.int32, device=values.device)
    return _kernels().quantize_pack(values, bits, bucket_size, seed, count)


def dequantize_unpack(codes: torch.Tensor, scales: torch.Tensor, bits: int,
                      bucket_size: int, n: int) -> torch.Tensor:
    """See :func:`hvdsparse.cpu.dequantize_unpack`."""
    if not use_triton(codes):
        return _ref.dequantize_unpack(codes, scales, bits, bucket_size, n)
    _ref.check_1d("codes", codes, (torch.uint8,))
    _ref.check_1d("scales", scales, (torch.float32,))
    _ref.check_bits(bits)
    _ref.check_pos_int("bucket_size", bucket_size)
    _ref.check_pos_int("n", n, 0)
    if codes.numel() < -(-n * bits // 8) or scales.numel() < -(-n // bucket_size):
        raise ValueError("codes/scales too short for n elements")
    return _kernels().dequantize_unpack(codes, scales, bits, bucket_size, n)


def sign_unpack(bits_u8: torch.Tensor, scale, n: int) -> torch.Tensor:
    """See :func:`hvdsparse.cpu.sign_unpack`."""
    if not use_triton(bits_u8):
        return _ref.sign_unpack(bits_u8, scale, n)
    _ref.check_1d("bits_u8", bits_u8, (torch.uint8,))
    _ref.check_pos_int("n", n, 0)
    if bits_u8.numel() < -(-n // 8):
        raise ValueError(f"bits_u8 has {bits_u8.numel()} bytes, needs ceil(n/8) = {-(-n // 8)}")
    return _kernels().sign_unpack(bits_u8, _ref.scalar_tensor("scale", scale, bits_u8.device), n)


def scatter_add_decode(dense: torch.Tensor, indices: torch.Tensor, count: torch.Tensor,
                       values: Optional[torch.Tensor] = None, *, codes=None, scales=None,
                       bits: int = 0, bucket_size: int = 512, signs=None, sign_scale=None,
                       error_flag: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """See :func:`hvdsparse.cpu.scatter_add_decode`.

    Returns the error flag: on the Triton path an int32[1] device tensor (``error_flag``
    if given, else a new zeroed one) that the kernel ORs with 1 for an out-of-range index
    (the write is skipped) and 2 for a count outside [0, cap] (clamped); the caller
    checks it where it synchronises anyway. The CPU path raises instead and returns
    ``error_flag`` untouched. Both add the rows in row order (bitwise deterministic).
    """
    if not use_triton(dense):
        return _ref.scatter_add_decode(dense, indices, count, values, codes=codes,
                                       scales=scales, bits=bits, bucket_size=bucket_size,
                                       signs=signs, sign_scale=sign_scale,
                                       error_flag=error_flag)
    ind, P, cap, cnt, vals, cds, scl, bits, B, sgn, ssc = _ref.check_scatter_args(
        dense, indices, count, values, codes, scales, bits, bucket_size, signs, sign_scale)
    if error_flag is None:
        error_flag = torch.zeros(1, dtype=torch.int32, device=dense.device)
    elif error_flag.dtype != torch.int32 or error_flag.numel() < 1:
        raise TypeError("error_flag must be an int32 tensor with >= 1 element")
    _kernels().scatter_add_decode(dense, ind, cnt, vals, codes=cds, scales=scl, bits=bits,
                                  bucket_size=B, signs=sgn, sign_scale=ssc,
                                  error_flag=error_flag)
    return error_flag


def dense_add_decode(dense: torch.Tensor, count: torch.Tensor, capacity: int,
                     values: Optional[torch.Tensor] = None, *, codes=None, scales=None,
                     bits: int = 0, bucket_size: int = 512,
                     error_flag: Optional[torch.Tensor] = None,
                     indices: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """:func:`scatter_add_decode` of DENSE segments (slot j is element j). On the CPU
    :func:`hvdsparse.cpu.dense_add_decode` (no index array); on the Triton path the
    scatter kernel with ``indices`` (``arange(capacity)`` rows: the caller's cached
    ones, or made here). Returns the error flag as :func:`scatter_add_decode` does."""
    if not use_triton(dense):
        _ref.dense_add_decode(dense, count, capacity, values, codes=codes, scales=scales,
                              bits=bits, bucket_size=bucket_size)
        return error_flag
    rows = values if values is not None else codes
    cap = _ref.check_pos_int("capacity", capacity, 0)
    idx = indices if indices is not None else torch.arange(
        cap, dtype=torch.int32, device=dense.device).expand(rows.shape[0], cap)
    return scatter_add_decode(dense, idx, count, values, codes=codes, scales=scales,
                              bits=bits, bucket_size=bucket_size, error_flag=error_flag)


def bucket_decode_table(segments):
    """Host table of a bucket's wire layout for :func:`bucket_decode`
    (``kernels/bucket_decode.py``'s ``build_table``: one tuple of host ints per
    segment). Returns ``(numpy int64 array, meta)``; the caller uploads the array once
    per layout."""
    return bucket_kernels("decode").build_table(segments)


def bucket_decode(msg: torch.Tensor, out: torch.Tensor, table: torch.Tensor, meta: dict,
                  image: torch.Tensor, mask: torch.Tensor, hdr_bytes: int,
                  error_flag: torch.Tensor, counts_out: Optional[torch.Tensor] = None):
    """Check and scatter-add P encoded messages of one bucket (``msg`` uint8 [P, n],
    rows 8-aligned) into the flat fp32 ``out``: one check launch plus one scatter
    launch per rank and pass (``kernels/bucket_decode.py``); problems are ORed into
    ``error_flag`` (int32, codes of ``hvdsparse.codec.ERROR_CODES``). Triton only (CUDA
    tensors, or ``HVDSPARSE_FORCE_TRITON=1``): the CPU decode is the codec's
    per-segment path. Returns ``(eff, err, raw)`` int32 [P, S]: the count each (rank,
    segment) contributed, its error code and the count field as received (written into
    ``counts_out``, contiguous int32 [P, S], when given)."""
    if not use_triton(out):
        raise NotImplementedError("ops.bucket_decode runs on the Triton path only "
                                  "(CUDA tensors or HVDSPARSE_FORCE_TRITON=1)")
    if msg.dtype != torch.uint8 or msg.dim() != 2 or msg.stride(1) != 1 or \
            msg.stride(0) % 8 or msg.storage_offset() % 8:
        raise ValueError("bucket_decode: msg must be uint8 [P, n] with 8-aligned rows")
    if out.dtype != torch.float32 or out.dim() != 1 or out.stride(0) != 1:
        raise ValueError("bucket_decode: out must be a contiguous 1-D fp32 tensor")
    if error_flag.dtype != torch.int32 or error_flag.numel() < 1:
        raise TypeError("error_flag must be an int32 tensor with >= 1 element")
    if counts_out is not None and (counts_out.dtype != torch.int32 or
                                   not counts_out.is_contiguous() or
                                   counts_out.numel() != msg.shape[0] * meta["S"]):
        raise ValueError("bucket_decode: counts_out must be a contiguous int32 [P, S] tensor")
    return bucket_kernels("decode").decode(msg, out, table, meta, image, mask,
                                           int(hdr_bytes), error_flag, raw=counts_out)


def philox_uniform(seed: int, n: int, offset: int = 0, device=None) -> torch.Tensor:
    """fp32[n] uniforms in [0, 1), element i = Triton ``tl.rand(seed, offset + i)``;
    generated by a Triton kernel on CUDA devices (or when forced), by the bit-identical
    torch Philox otherwise."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    forced = os.environ.get("HVDSPARSE_FORCE_TRITON", "") == "1"
    if forced or (dev.type == "cuda" and use_triton(torch.empty(0, device=dev))):
        _ref.check_seed(seed)
        _ref.check_pos_int("n", n, 0)
        _ref.check_pos_int("offset", offset, 0)
        return _kernels().philox_uniform(seed, n, offset, device=dev)
    return _ref.philox_uniform(seed, n, offset, device=dev)


#: the project's one bit packer (see :func:`hvdsparse.cpu.pack_bits`): plain torch ops,
#: so it runs on any device without a host sync
pack_bits = _ref.pack_bits
unpack_bits = _ref.unpack_bits


def row_threshold_max_d() -> int:
    """Widest row the Triton row-threshold kernel handles (``kernels.rowthreshold``)."""
    return _kernels().rowthreshold.MAX_D


def row_threshold_kernel(x: torch.Tensor, k: int, cols: torch.Tensor, vals: torch.Tensor,
                         mask: torch.Tensor) -> None:
    """DCT-MP row threshold through the Triton kernel (``kernels/rowthreshold.py``; the
    caller, :mod:`hvdsparse.mp`, checks :func:`use_triton` and the row width and owns the
    torch reference)."""
    _kernels().rowthreshold.row_threshold(x, k, cols, vals, mask)
