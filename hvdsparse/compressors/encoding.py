"""How selected values travel: the ``values=`` argument (:func:`check_values`), the
sign-bit packer, and :class:`ValueEncoder`, the compressors' encode step with error
feedback.

:class:`ValueEncoder` is a mixin of :class:`~hvdsparse.compressors.base.Compressor`; it
keeps no state of its own. Its contract: ``_encode`` turns fp32 values into the wire
encoding (fp32 as is, fp16 / bf16 saturated, INT-b by ``ops.quantize_pack``) and gives
the dequantised values back; ``_dense_from_acc`` and ``_take`` send all of, or the
selected slots of, an accumulator and, with error feedback, leave ``acc - deq`` in it
(0 for fp32), so ``sent + residual == acc`` up to one rounding of the encoding.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import ops
from ..payload import (FLOAT_BYTES, FLOAT_DTYPES, QUANT_BITS, VALUE_ENCODING_NAMES,
                       IndexEncoding, LayerPayload, Segment, ValueEncoding, to_wire_float)


def check_values(values) -> ValueEncoding:
    """Parse the ``values=`` argument (fp32, fp16, bf16, int8, int4, int2)."""
    if isinstance(values, ValueEncoding) and values != ValueEncoding.SIGN1:
        return values
    if isinstance(values, str) and values.lower() in VALUE_ENCODING_NAMES:
        return VALUE_ENCODING_NAMES[values.lower()]
    raise ValueError(f"values must be one of {sorted(VALUE_ENCODING_NAMES)}, got {values!r}")


def value_name(enc: ValueEncoding) -> str:
    for k, v in VALUE_ENCODING_NAMES.items():
        if v == enc:
            return k
    return ValueEncoding(enc).name.lower()


def pack_signs(negative: torch.Tensor) -> torch.Tensor:
    """bool[n] -> uint8[ceil(n/8)], bit j%8 of byte j//8 set when element j is negative
    (the project's one bit packer, ``ops.pack_bits``, at 1 bit)."""
    return ops.pack_bits(negative.to(torch.uint8), 1)


class ValueEncoder:
    """The encode step of every compressor (see the module docstring)."""

    @staticmethod
    def _count(n: int, device) -> torch.Tensor:
        return torch.full((1,), n, dtype=torch.int32, device=device)

    def _encode(self, vals: torch.Tensor, enc: ValueEncoding, seed: int, quant_bucket: int,
                count: Optional[torch.Tensor] = None, want_deq: bool = True):
        """Encode fp32 ``vals`` -> (values tensor, scales or None, dequantised fp32;
        None with ``want_deq=False``: nothing to put back into a residual)."""
        if enc in FLOAT_DTYPES:
            if enc == ValueEncoding.FP32:
                return vals, None, vals
            v = to_wire_float(vals, enc)       # saturated: fp16 has no room above 65504
            return v, None, (v.float() if want_deq else None)
        bits = QUANT_BITS[enc]
        codes, scales = ops.quantize_pack(vals, bits, quant_bucket, seed, count=count)
        if not want_deq:
            return codes, scales, None
        deq = ops.dequantize_unpack(codes, scales, bits, quant_bucket, vals.numel())
        return codes, scales, deq

    def _dense_from_acc(self, name, acc, shape, enc, seed, quant_bucket,
                        error_feedback=True) -> LayerPayload:
        """All of ``acc`` as one DENSE segment in encoding ``enc``; with error feedback
        the residual (``acc`` itself) becomes ``acc - deq`` (0 for fp32)."""
        n = acc.numel()
        # fp32 travels as a copy (acc is zeroed below, or is a scratch buffer); the
        # other encodings only read acc into fresh tensors
        vals = acc.clone() if enc == ValueEncoding.FP32 else acc
        values, scales, deq = self._encode(vals, enc, seed, quant_bucket,
                                           want_deq=error_feedback)
        if error_feedback:
            if enc == ValueEncoding.FP32:
                acc.zero_()
            else:
                acc.sub_(deq)
        seg = Segment(numel=n, capacity=n, index_encoding=IndexEncoding.DENSE,
                      value_encoding=enc, count=self._count(n, acc.device), values=values,
                      scales=scales, quant_bucket=quant_bucket)
        return LayerPayload(name, shape, [seg])

    def _take(self, acc, idx, valid, count, enc, seed, quant_bucket, error_feedback=True):
        """Gather ``acc[idx]`` for the valid slots (a prefix of length ``count``),
        encode, and with error feedback set ``acc[i] -= deq`` on the valid slots.

        ``idx`` int64[cap] (padding slots must hold an in-range index, e.g. 0);
        ``valid`` bool[cap] or None (all valid). Returns (values, scales, idx_int32).
        """
        v = acc[idx]
        if valid is not None:
            v = torch.where(valid, v, torch.zeros((), dtype=v.dtype, device=v.device))
        values, scales, deq = self._encode(v, enc, seed, quant_bucket,
                                           count=count if valid is not None else None,
                                           want_deq=error_feedback)
        if error_feedback:
            delta = -deq
            if valid is not None:
                delta = torch.where(valid, delta, torch.zeros((), dtype=delta.dtype,
                                                              device=delta.device))
            # unique valid indices; padding slots add 0.0 (no change)
            acc.index_add_(0, idx, delta)
        return values, scales

    @staticmethod
    def _sparse_is_worth_it(numel: int, capacity: int, enc: ValueEncoding,
                            index_bytes: float = 4.0) -> bool:
        """True when ``capacity`` index/value pairs are smaller than the dense layer in
        the same value encoding (quantisation scales are ignored on both sides)."""
        if enc in FLOAT_BYTES:
            vb = FLOAT_BYTES[enc]
        else:
            vb = QUANT_BITS[enc] / 8.0
        return capacity * (index_bytes + vb) < numel * vb
