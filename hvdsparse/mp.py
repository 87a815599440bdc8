"""DCT-MP: thresholded activations and activation gradients across a model-parallel split.

Seed: DCT (KDD'21), section 2.2, Algorithm 2, Appendix B.

Selection rule
--------------
Let ``X`` be the ``B x d`` activation at the split (inputs with more than two dims are
flattened to ``(B, -1)`` -- the first dim is the sample dim -- and the result is
restored to the input shape). For sparsity ``s`` (``0 <= s < 1``) every row keeps

    k = d - floor(s * d)        (at least 1; ``s * d`` is rounded to 9 decimals first
                                 so that e.g. 0.29 * 100 drops 29, not 28)

entries: the ``k`` largest ``|x|``, i.e. ``m_ij = 1`` iff ``|X_ij| > tau_i`` or
(``|X_ij| == tau_i`` and ``j`` is among the first ``k - #{|X_i.| > tau_i}`` columns
with ``|X_ij| == tau_i``), with ``tau_i`` the k-th largest ``|X_i.|``. So exactly ``k``
entries are kept in every row (ties at ``tau_i`` broken by ascending column index) and
an all-zero row keeps its first ``k`` columns (zeros). Algorithm 2 keeps every
``|x| >= tau_i``, which can keep more than ``k`` on ties; exactly-``k`` makes the wire
size a function of the shape only, so both sides know every buffer length. NaN counts
as larger than any number (as ``torch.sort``).

Forward sends ``X * M``; backward receives ``G`` and passes ``G * M`` (the same mask),
so only the kept entries travel back (:class:`ActivationThreshold` is the autograd
form for a single process; :class:`SplitSender` / :class:`SplitReceiver` the wire form).

Wire format (through :mod:`hvdsparse.codec`, one :class:`LayerPayload` with one
:class:`Segment`, ``numel = B*d``, ``capacity = count = B*k``)
------------------------------------------------------------------------------------
Forward (activation), index encoding chosen by size (value bytes ``v`` = 4 fp32, 2
fp16/bf16; with ``C = B*k``):

* ``INT32``   : ``4C`` index bytes, absolute element index ``i*d + j``;
* ``BIN_U8``  : ``C + 4B`` (``d <= 256``): per-row column ``j`` as uint8, bins = rows
  (``bin_size = d``), ``bin_counts = [k]*B``;
* ``BIN_U16`` : ``2C + 4B`` (``d <= 65536``): the same with uint16 columns;
* ``BITMASK`` : ``ceil(B*d/8)``: bit ``e % 8`` of byte ``e // 8`` set for kept element
  ``e = i*d + j``;
* ``DENSE``   : no indices, all ``B*d`` values (wins only at very low sparsity);

plus ``vC`` value bytes (``vBd`` for DENSE) in ascending element order. The smallest
total wins; ties prefer BITMASK, BIN_U8, BIN_U16, INT32, DENSE. Compare dense fp32
``4Bd``: at s = 0.9, d = 256 (k = 26) BIN_U8+fp32 is ``(26*5 + 4)/1024 = 13.1 %``
(BITMASK ``(32 + 104)/1024 = 13.3 %``); at s = 0.95 (k = 13) BIN_U8+fp32 is
``(13*5 + 4)/1024 = 6.7 %``; plus the codec's 96-byte header+record and 8-byte section
padding. BITMASK wins for wider rows at moderate sparsity (d = 512, s = 0.75).

Backward (gradient): the receiver already knows the positions, so the gradient travels
as an ``IMPLICIT`` segment: values only (``vC`` bytes) in the same ascending element
order; each side supplies its own positions.

Dispatch: the Triton kernel (``kernels/rowthreshold.py``) for CUDA tensors when a GPU
is present, or for any tensor when ``HVDSPARSE_FORCE_TRITON=1`` (tests, with
``TRITON_INTERPRET=1``); rows wider than ``kernels.rowthreshold.MAX_D`` and all other
cases use :func:`row_threshold_reference` (torch; the CPU path and the test oracle).
Nothing here synchronises with the host (counts are ``B*k`` by construction;
bitmask positions use ``nonzero_static``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from . import ops
from .payload import (FLOAT_BYTES, FLOAT_DTYPES, IndexEncoding, LayerPayload, Segment,
                      ValueEncoding, bin_count_width)

__all__ = [
    "kept_per_row", "row_threshold", "row_threshold_reference", "activation_threshold",
    "ActivationThreshold", "choose_index_encoding", "wire_index_bytes",
    "threshold_payload", "payload_positions", "payload_dense", "gradient_payload",
    "gradient_dense", "pack_bits", "unpack_bits", "SplitSender", "SplitReceiver",
]

_FLOAT_ENCODINGS = (ValueEncoding.FP32, ValueEncoding.FP16, ValueEncoding.BF16)


# ----------------------------------------------------------------------------- helpers
def kept_per_row(d: int, sparsity: float) -> int:
    """``k = d - floor(sparsity * d)`` entries kept per row (clamped to >= 1)."""
    if not isinstance(d, int) or d < 1:
        raise ValueError(f"d (row width) must be a positive int, got {d!r}")
    _check_sparsity(sparsity)
    drop = math.floor(round(float(sparsity) * d, 9))
    return max(1, d - drop)


def _check_sparsity(sparsity) -> None:
    if not isinstance(sparsity, (int, float)) or not 0.0 <= float(sparsity) < 1.0:
        raise ValueError(f"sparsity must be a number in [0, 1), got {sparsity!r}")


def _value_encoding(value_encoding) -> ValueEncoding:
    if isinstance(value_encoding, str):
        names = {"fp32": ValueEncoding.FP32, "fp16": ValueEncoding.FP16,
                 "bf16": ValueEncoding.BF16}
        if value_encoding not in names:
            raise ValueError(f"value_encoding must be one of {sorted(names)}, "
                             f"got {value_encoding!r}")
        return names[value_encoding]
    ve = ValueEncoding(value_encoding)
    if ve not in _FLOAT_ENCODINGS:
        raise ValueError(f"value_encoding must be FP32, FP16 or BF16, got {ve.name}")
    return ve


def _as_rows(x: torch.Tensor, argname: str = "x") -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{argname} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{argname} must have >= 2 dims (batch, features...), "
                         f"got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{argname} must be fp32/fp16/bf16, got {x.dtype}")
    if x.shape[0] > 0 and x[0].numel() == 0:
        raise ValueError(f"{argname} has zero features per row: shape {tuple(x.shape)}")
    return x.reshape(x.shape[0], -1).contiguous()


def _use_triton(x: torch.Tensor) -> bool:
    return ops.use_triton(x)


# ----------------------------------------------------------------------- selection ops
def row_threshold_reference(x: torch.Tensor, k: int, value_dtype=None
                            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of the row threshold (see module docstring for the rule).

    ``x`` [B, d] -> ``cols`` int32[B, k] (ascending per row), ``vals`` [B, k]
    (``x`` cast to ``value_dtype``, default x.dtype), ``mask`` uint8[B, d] (0/1).
    """
    B, d = x.shape
    value_dtype = value_dtype or x.dtype
    xd = x.detach()
    # |x| as int32 bit patterns: monotone for non-negative floats, NaN above +inf --
    # the same order the kernel uses, so ties and NaN behave identically.
    bits = xd.abs().float().contiguous().view(torch.int32)
    tau = torch.topk(bits, k, dim=1, sorted=False).values.min(dim=1, keepdim=True).values
    gt = bits > tau
    eq = bits == tau
    need = k - gt.sum(dim=1, keepdim=True)
    keep = gt | (eq & (eq.cumsum(dim=1) <= need))      # ties: lowest columns first
    flat = torch.nonzero_static(keep.reshape(-1), size=B * k).reshape(B, k)
    row0 = torch.arange(B, device=x.device, dtype=flat.dtype).unsqueeze(1) * d
    cols = flat - row0
    vals = xd.reshape(-1)[flat].to(value_dtype)
    mask = keep.to(torch.uint8)
    return cols.to(torch.int32), vals, mask


def row_threshold(x: torch.Tensor, k: int, value_dtype=None
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dispatching row threshold: Triton kernel or :func:`row_threshold_reference`.

    Same contract as the reference: exactly ``k`` per row, ties by lowest column.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [B, d], got shape {tuple(x.shape)}")
    B, d = x.shape
    if not isinstance(k, int) or not 1 <= k <= d:
        raise ValueError(f"k must be an int in [1, d={d}], got {k!r}")
    value_dtype = value_dtype or x.dtype
    if _use_triton(x) and d <= ops.row_threshold_max_d():
        x = x.detach().contiguous()
        cols = torch.empty(B, k, dtype=torch.int32, device=x.device)
        vals = torch.empty(B, k, dtype=value_dtype, device=x.device)
        mask = torch.empty(B, d, dtype=torch.uint8, device=x.device)
        ops.row_threshold_kernel(x, k, cols, vals, mask)
        return cols, vals, mask
    return row_threshold_reference(x, k, value_dtype)


# ------------------------------------------------------------------------ autograd form
class _ThresholdFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sparsity):
        rows = _as_rows(x)
        if rows.shape[0] == 0:
            ctx.save_for_backward(torch.ones_like(x, dtype=torch.bool))
            return x.clone()
        k = kept_per_row(rows.shape[1], sparsity)
        _, _, mask = row_threshold(rows, k)
        mask = mask.view(x.shape).bool()
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask, None


def activation_threshold(x: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Functional DCT-MP threshold: ``y = x * M`` forward, ``g * M`` backward.

    ``x``: [B, ...] fp32/fp16/bf16; rows are ``x.reshape(B, -1)``; see module docstring
    for ``M``.
    """
    _check_sparsity(sparsity)
    return _ThresholdFn.apply(x, float(sparsity))


class ActivationThreshold(torch.nn.Module):
    """Autograd module for the split point (DCT-MP, Algorithm 2).

    Per row of the ``(B, -1)``-flattened input keep ``k = d - floor(sparsity*d)``
    largest ``|x|`` (ties by lowest column, exactly ``k``), zero the rest; backward
    applies the same mask to the incoming gradient. ``sparsity = 0`` is the identity.
    """

    def __init__(self, sparsity: float):
        super().__init__()
        _check_sparsity(sparsity)
        self.sparsity = float(sparsity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return activation_threshold(x, self.sparsity)

    def extra_repr(self) -> str:
        return f"sparsity={self.sparsity}"


# ------------------------------------------------------------------------- wire format
_PREFERENCE = (IndexEncoding.BITMASK, IndexEncoding.BIN_U8, IndexEncoding.BIN_U16,
               IndexEncoding.INT32, IndexEncoding.DENSE)


def wire_index_bytes(rows: int, d: int, k: int, value_encoding=ValueEncoding.FP32
                     ) -> dict:
    """Payload bytes (indices + values, no codec header) of each possible encoding."""
    vb = FLOAT_BYTES[_value_encoding(value_encoding)]
    cap = rows * k
    sizes = {IndexEncoding.BITMASK: (rows * d + 7) // 8 + vb * cap,
             IndexEncoding.DENSE: vb * rows * d}
    if rows * d < 2 ** 31:
        sizes[IndexEncoding.INT32] = 4 * cap + vb * cap
    w = bin_count_width(d)          # bytes per row count on the wire
    if d <= 256:
        sizes[IndexEncoding.BIN_U8] = cap + w * rows + vb * cap
    elif d <= 65536:
        sizes[IndexEncoding.BIN_U16] = 2 * cap + w * rows + vb * cap
    return sizes


def choose_index_encoding(rows: int, d: int, k: int, value_encoding=ValueEncoding.FP32,
                          allowed: Optional[Sequence[IndexEncoding]] = None
                          ) -> IndexEncoding:
    """Smallest encoding for ``rows`` rows of width ``d`` keeping ``k`` (see docstring)."""
    sizes = wire_index_bytes(rows, d, k, value_encoding)
    cands = [e for e in _PREFERENCE if e in sizes and (allowed is None or e in allowed)]
    if not cands:
        raise ValueError(f"allowed={allowed!r} leaves no usable index encoding for "
                         f"rows={rows}, d={d}")
    return min(cands, key=lambda e: (sizes[e], _PREFERENCE.index(e)))


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool/uint8 [n] -> uint8[ceil(n/8)], bit ``e % 8`` of byte ``e // 8``
    (:func:`hvdsparse.ops.pack_bits` with ``bits=1``: the project's one bit packer)."""
    return ops.pack_bits(mask.reshape(-1).to(torch.uint8), 1)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: bool[n]."""
    return ops.unpack_bits(packed.reshape(-1), 1, n).bool()


def threshold_payload(x: torch.Tensor, sparsity: float, *,
                      value_encoding=ValueEncoding.FP32,
                      index_encoding: Optional[IndexEncoding] = None,
                      name: str = "activation") -> Tuple[LayerPayload, torch.Tensor]:
    """Threshold ``x`` row-wise and describe the kept entries as a payload.

    Returns ``(payload, positions)``: ``positions`` int64[B*k] are the flat element
    indices ``i*d + j`` of the kept entries in ascending order (the sender keeps them
    to scatter the returning gradient). ``index_encoding`` None = smallest by size.
    """
    _check_sparsity(sparsity)
    ve = _value_encoding(value_encoding)
    rows2 = _as_rows(x)
    B, d = rows2.shape
    k = kept_per_row(d, sparsity) if B else 1
    ie = index_encoding if index_encoding is not None else choose_index_encoding(B, d, k, ve)
    ie = IndexEncoding(ie)
    dev = x.device
    vdtype = FLOAT_DTYPES[ve]
    if ie == IndexEncoding.DENSE:
        vals = rows2.detach().reshape(-1).to(vdtype)
        positions = torch.arange(B * d, device=dev)
        seg = Segment(numel=B * d, capacity=B * d, index_encoding=ie, value_encoding=ve,
                      count=torch.full((1,), B * d, dtype=torch.int32, device=dev),
                      values=vals)
        return LayerPayload(name, x.shape, [seg]), positions
    cols, vals, mask = row_threshold(rows2, k, vdtype)
    cap = B * k
    row_base = torch.arange(B, device=dev, dtype=torch.int64).unsqueeze(1) * d
    positions = (row_base + cols.to(torch.int64)).reshape(-1)
    count = torch.full((1,), cap, dtype=torch.int32, device=dev)
    kw = {}
    if ie == IndexEncoding.INT32:
        if B * d >= 2 ** 31:
            raise ValueError(f"index_encoding=INT32 needs B*d < 2^31, got {B * d}")
        kw["indices"] = positions.to(torch.int32)
    elif ie in (IndexEncoding.BIN_U8, IndexEncoding.BIN_U16):
        limit = 256 if ie == IndexEncoding.BIN_U8 else 65536
        if d > limit:
            raise ValueError(f"index_encoding={ie.name} needs d <= {limit}, got d={d}")
        c = cols.reshape(-1)
        if ie == IndexEncoding.BIN_U8:
            kw["indices"] = c.to(torch.uint8)
        else:  # uint16 stored in an int16 view
            kw["indices"] = torch.where(c >= 32768, c - 65536, c).to(torch.int16)
        kw["bin_counts"] = torch.full((B,), k, dtype=torch.int32, device=dev)
        kw["bin_size"] = d
    elif ie == IndexEncoding.BITMASK:
        kw["indices"] = pack_bits(mask)
    else:
        raise ValueError(f"index_encoding {ie.name} is not supported for activations")
    seg = Segment(numel=B * d, capacity=cap, index_encoding=ie, value_encoding=ve,
                  count=count, values=vals.reshape(-1), **kw)
    return LayerPayload(name, x.shape, [seg]), positions


def payload_positions(payload: LayerPayload) -> torch.Tensor:
    """Flat element positions (int64[capacity], ascending) of a threshold payload.

    Valid for payloads made by :func:`threshold_payload` (one segment, every slot used:
    ``count == capacity``), after a codec round trip too.
    """
    if len(payload.segments) != 1:
        raise ValueError(f"payload {payload.name!r} has {len(payload.segments)} segments, "
                         "a DCT-MP payload has exactly 1")
    seg = payload.segments[0]
    ie = IndexEncoding(seg.index_encoding)
    dev = seg.values.device
    if ie == IndexEncoding.DENSE:
        return torch.arange(seg.numel, device=dev)
    if ie == IndexEncoding.INT32:
        return seg.indices[:seg.capacity].to(torch.int64)
    if ie in (IndexEncoding.BIN_U8, IndexEncoding.BIN_U16):
        rel = seg.indices[:seg.capacity].to(torch.int64)
        if ie == IndexEncoding.BIN_U16:
            rel = rel & 0xFFFF
        nb = seg.bin_counts.numel()
        rows = torch.repeat_interleave(torch.arange(nb, device=dev),
                                       seg.bin_counts.to(torch.int64),
                                       output_size=seg.capacity)
        return rows * seg.bin_size + rel
    if ie == IndexEncoding.BITMASK:
        m = unpack_bits(seg.indices, seg.numel)
        return torch.nonzero_static(m, size=seg.capacity).reshape(-1)
    if ie == IndexEncoding.IMPLICIT:
        if seg.implicit_indices is None:
            raise ValueError("IMPLICIT segment without implicit_indices: pass positions")
        return seg.implicit_indices.to(torch.int64)
    raise ValueError(f"index encoding {ie.name} is not a DCT-MP encoding")


def payload_dense(payload: LayerPayload, positions: Optional[torch.Tensor] = None,
                  dtype=torch.float32) -> torch.Tensor:
    """Dense tensor of ``payload.shape``: kept values at their positions, 0 elsewhere."""
    if positions is None:
        positions = payload_positions(payload)
    seg = payload.segments[0]
    out = torch.zeros(seg.numel, dtype=dtype, device=seg.values.device)
    out[positions] = seg.values[:positions.numel()].to(dtype)
    return out.view(payload.shape)


def gradient_payload(grad: torch.Tensor, positions: torch.Tensor, *,
                     value_encoding=ValueEncoding.FP32, name: str = "gradient"
                     ) -> LayerPayload:
    """Gradient at the kept positions as an IMPLICIT payload (values only travel)."""
    ve = _value_encoding(value_encoding)
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"grad must be a torch.Tensor, got {type(grad).__name__}")
    cap = positions.numel()
    vals = grad.detach().reshape(-1)[positions].to(FLOAT_DTYPES[ve])
    seg = Segment(numel=grad.numel(), capacity=cap, index_encoding=IndexEncoding.IMPLICIT,
                  value_encoding=ve,
                  count=torch.full((1,), cap, dtype=torch.int32, device=grad.device),
                  values=vals, implicit_indices=positions)
    return LayerPayload(name, grad.shape, [seg])


def gradient_dense(payload: LayerPayload, positions: torch.Tensor,
                   dtype=torch.float32) -> torch.Tensor:
    """Inverse of :func:`gradient_payload` given the receiver's own ``positions``."""
    if positions.numel() != payload.segments[0].capacity:
        raise ValueError(f"positions has {positions.numel()} entries, the gradient payload "
                         f"{payload.segments[0].capacity}")
    return payload_dense(payload, positions, dtype)


# ------------------------------------------------------------------- both sides of a split
def _codec():
    from . import codec  # imported lazily: mp.py is usable (payload level) without it
    return codec


_INDEX_DTYPE = {IndexEncoding.INT32: torch.int32, IndexEncoding.BIN_U8: torch.uint8,
                IndexEncoding.BIN_U16: torch.int16, IndexEncoding.BITMASK: torch.uint8}


class _Layout:
    """Expected one-segment message of a split (both sides derive it from settings).

    Offsets and lengths come from the codec's own layout function (header, record and
    section sizes, alignment), computed from host-known fields only, so this class can
    never drift from :func:`hvdsparse.codec.encode`."""

    def __init__(self, ie, ve, numel, cap, nbins, bin_size):
        self.ie, self.ve, self.numel, self.cap = ie, ve, numel, cap
        self.nbins, self.bin_size = nbins, bin_size
        # host fields only: the codec's layout never touches the tensors
        seg = Segment(numel=numel, capacity=cap, index_encoding=ie, value_encoding=ve,
                      count=None, values=None, bin_size=bin_size)
        shape = torch.Size((numel,))
        (sl,), _, total = _codec().segment_layouts([LayerPayload("split", shape, [seg])])
        self.lengths = tuple(sl.lengths[:3])       # indices, bin_counts, values
        self.offsets, self.nbytes = tuple(sl.offsets[:3]), total

    def segment_from_device(self, buf: torch.Tensor) -> Segment:
        """Slice the sections of ``buf`` on its device (no host parse, no sync)."""
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != self.nbytes:
            raise ValueError(f"buffer must be uint8[{self.nbytes}] for this split, got "
                             f"{buf.dtype} shape {tuple(buf.shape)}")
        (io, bo, vo), (il, bl, vl) = self.offsets, self.lengths

        def sec(o, n, dt):
            return buf[o:o + n].view(dt)
        return Segment(numel=self.numel, capacity=self.cap, index_encoding=self.ie,
                       value_encoding=self.ve,
                       count=torch.full((1,), self.cap, dtype=torch.int32, device=buf.device),
                       values=sec(vo, vl, FLOAT_DTYPES[self.ve]),
                       indices=sec(io, il, _INDEX_DTYPE[self.ie]) if il else None,
                       bin_counts=_codec().widen_bin_counts(buf[bo:bo + bl], self.bin_size)
                       if bl else None,
                       bin_size=self.bin_size)

    def segment_from_host(self, buf: torch.Tensor, what: str) -> Segment:
        """Parse and validate with :func:`hvdsparse.codec.decode`, check the layout."""
        segs = _codec().decode(buf)
        if len(segs) != 1:
            raise ValueError(f"{what}: message has {len(segs)} segments, expected 1")
        d = segs[0]
        got = (d.index_encoding, d.value_encoding, d.numel, d.capacity, d.count)
        exp = (self.ie, self.ve, self.numel, self.cap, self.cap)
        if got != exp:
            raise ValueError(f"{what}: message layout (index enc, value enc, numel, "
                             f"capacity, count) = {got}, expected {exp}: do both sides "
                             "use the same sparsity / encodings / batch size?")
        return d.as_segment()


@dataclass
class _Pending:
    positions: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype


class SplitSender:
    """Upstream side of a split: ``buf = pack(act)`` ... ``g = unpack_grad(buf)``.

    ``pack`` thresholds the activation (detached), encodes it with the codec and keeps
    the positions; ``unpack_grad`` decodes the returning IMPLICIT gradient into a dense
    ``act``-shaped tensor (zero off the mask), ready for ``act.backward(g)``.
    ``validate`` (None = CPU buffers only) parses the gradient message with
    :func:`hvdsparse.codec.decode`; otherwise its sections are sliced on the device.
    """

    def __init__(self, sparsity: float, value_encoding=ValueEncoding.FP32,
                 index_encoding: Optional[IndexEncoding] = None, name: str = "split",
                 validate: Optional[bool] = None):
        _check_sparsity(sparsity)
        self.sparsity = float(sparsity)
        self.value_encoding = _value_encoding(value_encoding)
        self.index_encoding = index_encoding
        self.name = name
        self.validate = validate
        self._pending: Optional[_Pending] = None

    def pack(self, act: torch.Tensor) -> torch.Tensor:
        payload, pos = threshold_payload(act, self.sparsity,
                                         value_encoding=self.value_encoding,
                                         index_encoding=self.index_encoding,
                                         name=self.name)
        self._pending = _Pending(pos, act.shape, act.dtype)
        return _codec().encode([payload])

    def _grad_layout(self) -> "_Layout":
        if self._pending is None:
            raise RuntimeError("no activation packed: call pack first")
        p = self._pending
        return _Layout(IndexEncoding.IMPLICIT, self.value_encoding, p.shape.numel(),
                       p.positions.numel(), 0, 0)

    def grad_message_nbytes(self) -> int:
        """Length of the gradient message expected for the last packed activation
        (so a transport can post a receive of the right size without a length
        message)."""
        return self._grad_layout().nbytes

    def unpack_grad(self, buffer: torch.Tensor) -> torch.Tensor:
        if self._pending is None:
            raise RuntimeError("unpack_grad called before pack")
        lay = self._grad_layout()
        p = self._pending
        self._pending = None
        validate = (not buffer.is_cuda) if self.validate is None else self.validate
        seg = (lay.segment_from_host(buffer, "gradient message") if validate
               else lay.segment_from_device(buffer))
        payload = LayerPayload(self.name, p.shape, [seg])
        return gradient_dense(payload, p.positions.to(seg.values.device), p.dtype)


class SplitReceiver:
    """Downstream side: ``x = unpack(buf, rows)`` ... ``buf = pack_grad(x.grad)``.

    Configured like the sender (``sparsity``, encodings) plus the per-sample
    ``feature_shape`` of the activation, so it knows the message layout for ``rows``
    samples.
    """

    def __init__(self, sparsity: float, feature_shape, value_encoding=ValueEncoding.FP32,
                 index_encoding: Optional[IndexEncoding] = None, name: str = "split-grad",
                 validate: Optional[bool] = None):
        _check_sparsity(sparsity)
        self.sparsity = float(sparsity)
        self.feature_shape = torch.Size(feature_shape)
        self.d = self.feature_shape.numel()
        if self.d < 1:
            raise ValueError(f"feature_shape must have >= 1 element, got {feature_shape!r}")
        self.value_encoding = _value_encoding(value_encoding)
        self.index_encoding = index_encoding
        self.name = name
        self.validate = validate
        self._positions: Optional[torch.Tensor] = None

    def layout(self, rows: int) -> "_Layout":
        d = self.d
        k = kept_per_row(d, self.sparsity)
        ie = self.index_encoding
        if ie is None:
            ie = choose_index_encoding(rows, d, k, self.value_encoding)
        ie = IndexEncoding(ie)
        if ie == IndexEncoding.DENSE:
            return _Layout(ie, self.value_encoding, rows * d, rows * d, 0, 0)
        binned = ie in (IndexEncoding.BIN_U8, IndexEncoding.BIN_U16)
        return _Layout(ie, self.value_encoding, rows * d, rows * k,
                       rows if binned else 0, d if binned else 0)

    def message_nbytes(self, rows: int) -> int:
        """Length of the activation message for ``rows`` samples."""
        return self.layout(rows).nbytes

    def unpack(self, buffer: torch.Tensor, rows: int, dtype=torch.float32) -> torch.Tensor:
        """Dense ``[rows, *feature_shape]`` activation (0 off the mask)."""
        lay = self.layout(rows)
        validate = (not buffer.is_cuda) if self.validate is None else self.validate
        seg = (lay.segment_from_host(buffer, "activation message") if validate
               else lay.segment_from_device(buffer))
        payload = LayerPayload(self.name, torch.Size((rows, *self.feature_shape)), [seg])
        self._positions = payload_positions(payload)
        return payload_dense(payload, self._positions, dtype)

    def pack_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if self._positions is None:
            raise RuntimeError("pack_grad called before unpack")
        payload = gradient_payload(grad, self._positions.to(grad.device),
                                   value_encoding=self.value_encoding, name=self.name)
        self._positions = None
        return _codec().encode([payload])
