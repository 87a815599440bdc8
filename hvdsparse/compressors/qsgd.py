"""QSGD: dense stochastic quantisation (Alistarh et al.; Slim-DP's "Quant-DP" baseline,
SparCML's dense phase).

Per layer, buckets of ``bucket_size`` consecutive elements (last one partial), one fp32
scale per bucket ``m_b = max_{i in b} |v_i|``, ``s = 2^(bits-1) - 1`` levels per sign:

    q_i = sign(v_i) * floor(|v_i| / m_b * s + u_i),   u_i ~ U[0, 1) (Philox, per rank)
    deq_i = q_i * m_b / s,      E[deq_i] = v_i,   |deq_i - v_i| <= m_b / s

(``ops.quantize_pack``; codes packed 8/4/2 bits per value.) One DENSE segment with
INT8/INT4/INT2 values and ``ceil(n / bucket_size)`` scales.

Note that QSGD's ``bits`` here counts the sign: 8 bits = 127 levels per sign, 4 bits = 7,
2 bits = 1 (ternary ``{-m, 0, +m}``), the same as SparCML's 2/4/8-bit formats. The QSGD
paper's norm is the bucket's max-norm (its "variant with max normalisation"), as
CGX/SparCML do, rather than the 2-norm.

``error_feedback=False`` (default) is QSGD as published: unbiased, nothing remembered.
``error_feedback=True`` keeps ``v - deq`` in a residual added to the next step
(``v = residual + grad``), so ``deq + residual == v`` up to one fp32 rounding.
"""
from __future__ import annotations

from ..payload import ValueEncoding
from .base import PURPOSE_QUANT, Compressor
from .checks import check_bool

__all__ = ["QSGD"]

#: bits per value -> the value encoding on the wire
ENCODING_OF_BITS = {8: ValueEncoding.INT8, 4: ValueEncoding.INT4, 2: ValueEncoding.INT2}


class QSGD(Compressor):
    """``QSGD(bits, bucket_size=512, error_feedback=False, **policy)``: bits in {8, 4, 2}."""

    _settings = ("bits", "bucket_size", "error_feedback")

    def __init__(self, bits: int, bucket_size: int = 512, error_feedback: bool = False, **kw):
        super().__init__(**kw)
        cfg = self._validate_cfg(dict(bits=bits, bucket_size=bucket_size,
                                      error_feedback=error_feedback))
        for key, v in cfg.items():
            setattr(self, key, v)
        self._validate_overrides()

    def _validate_cfg(self, cfg, where=""):
        b = cfg["bits"]
        if isinstance(b, bool) or b not in ENCODING_OF_BITS:
            raise ValueError(f"{where}bits must be one of 8, 4, 2, got {b!r}")
        bs = cfg["bucket_size"]
        if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1:
            raise ValueError(f"{where}bucket_size must be an int >= 1, got {bs!r}")
        check_bool(cfg["error_feedback"], "error_feedback", where)
        return dict(cfg)

    def _compress(self, name, flat, shape, step, cfg, param):
        ef = cfg["error_feedback"]
        seed = self._seed(name, step, PURPOSE_QUANT)
        return (self._send_all(name, flat, shape, ENCODING_OF_BITS[cfg["bits"]], seed,
                               cfg["bucket_size"], ef), dict())
