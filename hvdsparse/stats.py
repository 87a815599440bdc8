"""Per-layer compression statistics: bytes, densities, thresholds.

Cheap on the hot path: a compressor calls :meth:`StatsCollector.record` with the
payload it just produced and the *device* tensors it already has (the ``count`` of each
segment, the ``selected`` count, the threshold). Nothing is copied to the host there;
running sums are kept as device tensors (one tiny device add per step and layer).
:meth:`StatsCollector.as_dict` converts everything to Python numbers, and that is where
the (single) host synchronisation happens.

Byte accounting (what :func:`segment_nbytes` counts for one fixed-capacity segment):

* a 4-byte ``count`` word per segment;
* indices: INT32 -> ``4 * capacity``; BIN_U8 -> ``capacity`` + ``4 * nbins``
  (the int32 ``bin_counts``); BIN_U16 -> ``2 * capacity + 4 * nbins``;
  BITMASK -> ``ceil(numel / 8)``; DENSE / IMPLICIT -> 0 (implicit indices never travel);
* values: fp32 4, fp16/bf16 2 bytes per slot; INT8/INT4/INT2 ``ceil(capacity*bits/8)``
  bytes plus 4 bytes per quantisation bucket scale; SIGN1 ``ceil(capacity/8)`` + 4.

*Payload bytes* are what travels with fixed capacities (padding included): every rank
sends exactly this many bytes every step. *Effective bytes* count only the used slots
(``sent = count``), i.e. what a variable-length encoding would need, the quantity the
AdaComp paper calls the effective compression rate. ``dense bytes = 4 * numel`` (fp32).
``compression_rate = dense / payload``, ``effective_rate = dense / effective``.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from .payload import (FLOAT_BYTES, QUANT_BITS, IndexEncoding, LayerPayload, Segment,
                      ValueEncoding)

__all__ = ["segment_nbytes", "segment_slot_bytes", "segment_fixed_bytes",
           "payload_nbytes", "LayerStats", "StatsCollector"]

_INDEX_SLOT_BYTES = {IndexEncoding.DENSE: 0.0, IndexEncoding.INT32: 4.0,
                     IndexEncoding.BIN_U8: 1.0, IndexEncoding.BIN_U16: 2.0,
                     IndexEncoding.IMPLICIT: 0.0, IndexEncoding.BITMASK: 0.0}


def _value_slot_bytes(enc: ValueEncoding) -> float:
    if enc in FLOAT_BYTES:
        return float(FLOAT_BYTES[enc])
    if enc in QUANT_BITS:
        return QUANT_BITS[enc] / 8.0
    if enc == ValueEncoding.SIGN1:
        return 1.0 / 8.0
    raise ValueError(f"unknown value encoding {enc!r}")


def segment_slot_bytes(seg: Segment) -> float:
    """Bytes one used slot costs (index + value), fractional for packed encodings."""
    return _INDEX_SLOT_BYTES[IndexEncoding(seg.index_encoding)] + \
        _value_slot_bytes(ValueEncoding(seg.value_encoding))


def segment_fixed_bytes(seg: Segment) -> int:
    """Bytes of a segment that do not scale with the used slots: count word, scales,
    bin counts, bitmask."""
    b = 4
    if seg.scales is not None:
        b += 4 * int(seg.scales.numel())
    if seg.bin_counts is not None:
        b += 4 * int(seg.bin_counts.numel())
    if seg.index_encoding == IndexEncoding.BITMASK:
        b += (seg.numel + 7) // 8
    return b


def segment_nbytes(seg: Segment) -> int:
    """Wire bytes of a fixed-capacity segment (padding included); see module docstring."""
    enc = ValueEncoding(seg.value_encoding)
    cap = int(seg.capacity)
    if enc in FLOAT_BYTES:
        vbytes = FLOAT_BYTES[enc] * cap
    elif enc in QUANT_BITS:
        vbytes = (cap * QUANT_BITS[enc] + 7) // 8
    else:  # SIGN1
        vbytes = (cap + 7) // 8
    ibytes = int(_INDEX_SLOT_BYTES[IndexEncoding(seg.index_encoding)] * cap)
    return vbytes + ibytes + segment_fixed_bytes(seg)


def payload_nbytes(payload: LayerPayload) -> int:
    """Wire bytes of all segments of one layer's payload."""
    return sum(segment_nbytes(s) for s in payload.segments)


class LayerStats:
    """Statistics of one layer: the latest step plus running sums (device tensors)."""

    def __init__(self, numel: int):
        self.numel = int(numel)
        self.steps = 0
        self.last: dict = {}
        self.total_payload_bytes = 0
        self.total_dense_bytes = 0
        self._total_effective: Optional[torch.Tensor] = None
        self._total_sent: Optional[torch.Tensor] = None

    def record(self, step: int, payload: LayerPayload, selected: Optional[torch.Tensor],
               threshold=None, density: Optional[float] = None, extra: Optional[dict] = None):
        segs = payload.segments
        pbytes = sum(segment_nbytes(s) for s in segs)
        dbytes = 4 * self.numel
        sent = None
        eff = None
        for s in segs:
            c = s.count.reshape(-1)[:1].to(torch.float64)
            sent = c if sent is None else sent + c
            e = c * segment_slot_bytes(s) + segment_fixed_bytes(s)
            eff = e if eff is None else eff + e
        if selected is None:
            selected = sent
        self.steps += 1
        self.total_payload_bytes += pbytes
        self.total_dense_bytes += dbytes
        self._total_effective = eff if self._total_effective is None else self._total_effective + eff
        self._total_sent = sent if self._total_sent is None else self._total_sent + sent
        self.last = dict(step=int(step), capacity=sum(int(s.capacity) for s in segs),
                         segments=len(segs), sent=sent, selected=selected,
                         payload_bytes=pbytes, dense_bytes=dbytes, effective_bytes=eff,
                         threshold=threshold, density=density,
                         index_encodings=[IndexEncoding(s.index_encoding).name for s in segs],
                         value_encodings=[ValueEncoding(s.value_encoding).name for s in segs])
        if extra:
            self.last.update(extra)

    @staticmethod
    def _num(x):
        if isinstance(x, torch.Tensor):
            if x.numel() == 1:
                v = x.reshape(-1)[0].item()
                return v
            return x.detach().cpu().tolist()
        return x

    def as_dict(self) -> dict:
        """Host copy of everything (synchronises with the device once per tensor)."""
        d = {k: self._num(v) for k, v in self.last.items()}
        if "sent" in d and d["sent"] is not None:
            d["sent"] = int(d["sent"])
        if d.get("selected") is not None:
            d["selected"] = int(d["selected"])
        pb, db, eb = d.get("payload_bytes"), d.get("dense_bytes"), d.get("effective_bytes")
        d["compression_rate"] = db / pb if pb else math.inf
        d["effective_rate"] = db / eb if eb else math.inf
        d["numel"] = self.numel
        d["steps"] = self.steps
        d["total_payload_bytes"] = self.total_payload_bytes
        d["total_dense_bytes"] = self.total_dense_bytes
        te = self._num(self._total_effective) if self._total_effective is not None else 0.0
        d["total_effective_bytes"] = te
        d["total_sent"] = int(self._num(self._total_sent)) if self._total_sent is not None else 0
        d["mean_compression_rate"] = (self.total_dense_bytes / self.total_payload_bytes
                                      if self.total_payload_bytes else math.inf)
        d["mean_effective_rate"] = self.total_dense_bytes / te if te else math.inf
        return d

    def state(self) -> dict:
        return dict(numel=self.numel, steps=self.steps,
                    total_payload_bytes=self.total_payload_bytes,
                    total_dense_bytes=self.total_dense_bytes,
                    total_effective=None if self._total_effective is None
                    else self._total_effective.detach().clone(),
                    total_sent=None if self._total_sent is None
                    else self._total_sent.detach().clone())

    @classmethod
    def from_state(cls, st: dict) -> "LayerStats":
        s = cls(st["numel"])
        s.steps = st["steps"]
        s.total_payload_bytes = st["total_payload_bytes"]
        s.total_dense_bytes = st["total_dense_bytes"]
        s._total_effective = st["total_effective"]
        s._total_sent = st["total_sent"]
        return s


class StatsCollector:
    """Map layer name -> :class:`LayerStats`."""

    def __init__(self):
        self.layers: Dict[str, LayerStats] = {}

    def record(self, name: str, step: int, payload: LayerPayload,
               selected: Optional[torch.Tensor] = None, threshold=None,
               density: Optional[float] = None, extra: Optional[dict] = None):
        st = self.layers.get(name)
        if st is None:
            st = self.layers[name] = LayerStats(payload.numel)
        st.record(step, payload, selected, threshold, density, extra)

    def as_dict(self) -> Dict[str, dict]:
        return {name: st.as_dict() for name, st in self.layers.items()}

    def totals(self) -> dict:
        """Whole-model sums over all layers and steps."""
        pb = sum(s.total_payload_bytes for s in self.layers.values())
        db = sum(s.total_dense_bytes for s in self.layers.values())
        eb = 0.0
        for s in self.layers.values():
            if s._total_effective is not None:
                eb += float(LayerStats._num(s._total_effective))
        return dict(payload_bytes=pb, dense_bytes=db, effective_bytes=eb,
                    compression_rate=db / pb if pb else math.inf,
                    effective_rate=db / eb if eb else math.inf)

    def state_dict(self) -> dict:
        return {n: s.state() for n, s in self.layers.items()}

    def load_state_dict(self, sd: dict):
        self.layers = {n: LayerStats.from_state(st) for n, st in sd.items()}
