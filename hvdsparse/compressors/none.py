"""No compression: every layer travels dense as fp32 (baselines, small layers)."""
from __future__ import annotations

from .base import Compressor

__all__ = ["NoCompression"]


class NoCompression(Compressor):
    """``NoCompression()``: one DENSE fp32 segment per layer, no residual."""

    compresses = False

    def __init__(self, **kw):
        kw.setdefault("min_numel", 0)
        super().__init__(**kw)

    def _compress(self, name, flat, shape, step, cfg, param):
        return self._policy_dense(name, flat, shape), dict(density=1.0)
