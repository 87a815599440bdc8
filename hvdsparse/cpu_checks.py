"""The argument contract of the compression operations: dtypes, value encodings, bit
widths and the shape / device checks of every operation's inputs and outputs.

One set of checks for both implementations: the CPU path (``cpu_*.py``) and
:mod:`hvdsparse.ops`, which runs them before it launches a Triton kernel. A check
raises ``TypeError`` / ``ValueError`` naming the argument; the ``check_*_args``
functions return the normalised arguments the operation uses. On the dependency floor:
imports nothing of hvdsparse but :mod:`hvdsparse.philox`.
"""
from __future__ import annotations

from typing import Optional

import torch

from .philox import check_pos_int


# Value-encoding codes: identical to hvdsparse.payload.ValueEncoding (an IntEnum, so the
# enum members compare equal to these ints). Duplicated here because the CPU
# path and kernels/ must not import hvdsparse; tests check that the two agree.
VE_FP32, VE_FP16, VE_BF16, VE_SIGN1 = 0, 1, 2, 6
_FLOAT_VE = {VE_FP32: torch.float32, VE_FP16: torch.float16, VE_BF16: torch.bfloat16}
QUANT_BITS_ALLOWED = (8, 4, 2)
FLOAT_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


def _check_index_width(name: str, n: int) -> None:
    """int32 indices / counts address at most 2**31 - 1 elements."""
    if n >= (1 << 31):
        raise ValueError(f"{name} has {n} elements; hvdsparse addresses elements with int32 "
                         f"indices, so a layer must have fewer than 2**31 elements (split "
                         f"the parameter)")


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


def check_clean_args(grad, grad_scale, nonfinite):
    """Validation shared by :func:`clean_grad` and ops (kernel)."""
    check_1d("grad", grad, FLOAT_INPUT_DTYPES)
    check_grad_scale(grad_scale, grad.device)
    _check_nonfinite(nonfinite, "grad", grad.device)


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
