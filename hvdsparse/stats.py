"""Per-layer compression statistics: bytes, densities, thresholds.

Cheap on the hot path: a compressor calls :meth:`StatsCollector.record` with the
payload it just produced and the *device* tensors it already has (the ``count`` of each
segment, the ``selected`` count, the threshold). Nothing is copied to the host there;
running sums are kept as device tensors, and a :class:`StatsCollector` folds every
layer's counts of a step into them at once (:meth:`StatsCollector.fold`, at the
compressor's next ``begin_step`` or read: two tiny device ops per step and device, a
copy of all counts and one add, instead of two per segment; bytes are derived on the
host when read).
:meth:`StatsCollector.as_dict` converts everything to Python numbers, and that is where
the (single) host synchronisation happens: every device tensor of every layer is
flattened into one float64 vector per device and copied to the host at once
(:func:`host_values`), so ``stats()`` costs one device-to-host copy, not one per layer
or per field. Integers up to 2^53 and fp32 values survive the float64 round trip
exactly; integer and bool tensors come back as ``int`` / ``bool``.

Byte accounting (what :func:`segment_nbytes` counts for one fixed-capacity segment):

* a 4-byte ``count`` word per segment;
* indices, as they travel (an INT32 segment may go bin-relative:
  :func:`hvdsparse.payload.wire_indexing`): INT32 -> ``4 * capacity``; BIN_U8 ->
  ``capacity`` + ``w * nbins`` (the ``bin_counts``: ``w`` = 1, 2 or 4 bytes by bin size, see
  :func:`hvdsparse.payload.bin_count_width`); BIN_U16 -> ``2 * capacity + w * nbins``;
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
                      ValueEncoding, bin_count_width, wire_indexing)

__all__ = ["empty_totals", "add_totals", "segment_nbytes", "segment_slot_bytes", "segment_fixed_bytes",
           "payload_nbytes", "LayerStats", "StatsCollector", "host_values"]

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
    """Bytes one used slot costs (index + value) as it travels
    (:func:`hvdsparse.payload.wire_indexing`), fractional for packed encodings."""
    return _INDEX_SLOT_BYTES[wire_indexing(seg)[0]] + \
        _value_slot_bytes(ValueEncoding(seg.value_encoding))


def segment_fixed_bytes(seg: Segment) -> int:
    """Bytes of a segment that do not scale with the used slots: count word, scales,
    bin counts, bitmask."""
    b = 4
    if seg.scales is not None:
        b += 4 * int(seg.scales.numel())
    ienc, bs = wire_indexing(seg)
    if seg.bin_counts is not None:
        b += bin_count_width(seg.bin_size) * int(seg.bin_counts.numel())
    elif ienc != IndexEncoding(seg.index_encoding):          # INT32 narrowed for the wire
        b += bin_count_width(bs) * (-(-int(seg.numel) // bs))
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
    ibytes = int(_INDEX_SLOT_BYTES[wire_indexing(seg)[0]] * cap)
    return vbytes + ibytes + segment_fixed_bytes(seg)


#: (segment layout key) -> (slot bytes, fixed bytes, wire bytes, index name, value name)
_FIGURES: Dict[tuple, tuple] = {}


def segment_figures(seg: Segment) -> tuple:
    """``(segment_slot_bytes, segment_fixed_bytes, segment_nbytes, index encoding name,
    value encoding name)`` of ``seg``, cached by the fields they are computed from (a
    per-layer host cost every step otherwise)."""
    key = (int(seg.numel), int(seg.capacity), int(seg.index_encoding),
           int(seg.value_encoding), int(seg.bin_size or 0),
           bool(getattr(seg, "narrow_indices", False)),
           None if seg.scales is None else int(seg.scales.numel()),
           None if seg.bin_counts is None else int(seg.bin_counts.numel()))
    got = _FIGURES.get(key)
    if got is None:
        if len(_FIGURES) > 65536:
            _FIGURES.clear()
        got = _FIGURES[key] = (segment_slot_bytes(seg), segment_fixed_bytes(seg),
                               segment_nbytes(seg),
                               IndexEncoding(seg.index_encoding).name,
                               ValueEncoding(seg.value_encoding).name)
    return got


def payload_nbytes(payload: LayerPayload) -> int:
    """Wire bytes of all segments of one layer's payload."""
    return sum(segment_nbytes(s) for s in payload.segments)


def host_values(tensors) -> Dict[int, object]:
    """``id(t) -> value`` for every tensor in ``tensors``: a Python number for a
    one-element tensor, a (nested) list otherwise. One batched device-to-host copy per
    device (the tensors are cast to float64 and concatenated on their device first)."""
    out: Dict[int, object] = {}
    by_dev: Dict[str, list] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in out:
            out[id(t)] = None
            by_dev.setdefault(str(t.device), []).append(t)
    for ts in by_dev.values():
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in ts])
        host = flat.cpu().numpy()          # the one synchronisation for this device
        pos = 0
        for t in ts:
            n = t.numel()
            vals = host[pos:pos + n]
            pos += n
            if t.dtype == torch.bool:
                conv = [bool(v) for v in vals]
            elif not (t.dtype.is_floating_point or t.dtype.is_complex):
                conv = [int(v) for v in vals]
            else:
                conv = [float(v) for v in vals]
            if n == 1:
                out[id(t)] = conv[0]
            else:
                out[id(t)] = _nest(conv, tuple(t.shape))
    return out


def _nest(vals: list, shape: tuple):
    if len(shape) <= 1:
        return vals
    step = len(vals) // shape[0] if shape[0] else 0
    return [_nest(vals[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


class LayerStats:
    """Statistics of one layer: the latest step plus running sums (device tensors).

    Filled through a :class:`StatsCollector`: :meth:`_note` books a step on the host,
    and :meth:`StatsCollector.fold` later copies every layer's segment ``count`` (the
    latest step's value, kept apart from a buffer a compressor may reuse) and adds it
    into the running sum of counts for the segment (keyed by its position and slot
    size), for all layers of a step at once. Everything derived (``sent`` as the sum over
    segments, effective bytes = slot bytes x count + fixed bytes, their running totals)
    is computed from those on the host, in :meth:`as_dict` / :meth:`state` (host-known
    slot and fixed sizes)."""

    def __init__(self, numel: int):
        self.numel = int(numel)
        self.steps = 0
        self.last: dict = {}
        self.total_payload_bytes = 0
        self.total_dense_bytes = 0
        # running sums: (segment position, slot bytes) -> int64[1] device sum of counts
        # (through a StatsCollector: a view of its per-device vector); fixed bytes (host)
        self._count_sums: Dict[tuple, torch.Tensor] = {}
        self._fixed_total = 0
        # totals carried in from a checkpoint (``from_state``), added to the sums above
        self._base_effective: Optional[torch.Tensor] = None
        self._base_sent: Optional[torch.Tensor] = None
        self._last_counts: list = []       # [(count copy int32[1], slot bytes)]
        self._last_fixed = 0

    def _note(self, step: int, payload: LayerPayload, selected: Optional[torch.Tensor],
              threshold=None, density: Optional[float] = None,
              extra: Optional[dict] = None) -> list:
        """Book one step on the host; returns ``[(key, count)]`` per segment for
        :meth:`StatsCollector.fold`: ``count`` the payload's own int32[1] view (not
        copied yet, not yet in the running sums), ``key`` = (segment position, slot
        bytes)."""
        segs = payload.segments
        figs = [segment_figures(s) for s in segs]
        pbytes = sum(f[2] for f in figs)
        dbytes = 4 * self.numel
        counts = []
        fixed = 0
        for i, (s, f) in enumerate(zip(segs, figs)):
            counts.append(((i, f[0]), s.count.reshape(-1)[:1]))
            fixed += f[1]
        self.steps += 1
        self.total_payload_bytes += pbytes
        self.total_dense_bytes += dbytes
        self._fixed_total += fixed
        self._last_counts = [(c, key[1]) for key, c in counts]
        self._last_fixed = fixed
        self.last = dict(step=int(step), capacity=sum(int(s.capacity) for s in segs),
                         segments=len(segs), selected=selected,
                         payload_bytes=pbytes, dense_bytes=dbytes,
                         threshold=threshold, density=density,
                         index_encodings=[f[3] for f in figs],
                         value_encodings=[f[4] for f in figs])
        if extra:
            self.last.update(extra)
        return counts

    def _tensors(self) -> list:
        ts = [v for v in self.last.values() if isinstance(v, torch.Tensor)]
        ts += [c for c, _ in self._last_counts]
        ts += list(self._count_sums.values())
        ts += [t for t in (self._base_effective, self._base_sent) if t is not None]
        return ts

    @staticmethod
    def _num(x, host: Dict[int, object]):
        if isinstance(x, torch.Tensor):
            return host[id(x)]
        return x

    def _totals(self, host: Dict[int, object]):
        """(total effective bytes, total sent) as host numbers."""
        eff = float(self._fixed_total) + sum(key[1] * host[id(t)]
                                             for key, t in self._count_sums.items())
        sent = sum(int(host[id(t)]) for t in self._count_sums.values())
        if self._base_effective is not None:
            eff += float(host[id(self._base_effective)])
        if self._base_sent is not None:
            sent += int(host[id(self._base_sent)])
        return eff, sent

    def as_dict(self, _host: Optional[Dict[int, object]] = None) -> dict:
        """Host copy of everything (one batched device-to-host copy, see
        :func:`host_values`; ``StatsCollector.as_dict`` batches all layers at once)."""
        host = host_values(self._tensors()) if _host is None else _host
        d = {k: self._num(v, host) for k, v in self.last.items()}
        if self.last:
            sent = sum(int(host[id(c)]) for c, _ in self._last_counts)
            d["sent"] = sent
            d["effective_bytes"] = float(self._last_fixed) + sum(
                sb * host[id(c)] for c, sb in self._last_counts)
            if d.get("selected") is None:
                d["selected"] = sent
        if d.get("selected") is not None:
            d["selected"] = int(d["selected"])
        pb, db, eb = d.get("payload_bytes"), d.get("dense_bytes"), d.get("effective_bytes")
        d["compression_rate"] = db / pb if pb else math.inf
        d["effective_rate"] = db / eb if eb else math.inf
        d["numel"] = self.numel
        d["steps"] = self.steps
        d["total_payload_bytes"] = self.total_payload_bytes
        d["total_dense_bytes"] = self.total_dense_bytes
        te, ts = self._totals(host)
        d["total_effective_bytes"] = te
        d["total_sent"] = ts
        d["mean_compression_rate"] = (self.total_dense_bytes / self.total_payload_bytes
                                      if self.total_payload_bytes else math.inf)
        d["mean_effective_rate"] = self.total_dense_bytes / te if te else math.inf
        return d

    def state(self) -> dict:
        """Checkpoint form (unchanged since version 1): running totals as fp64 / int64
        one-element tensors on the stats' device (device ops, no host read)."""
        eff = sent = None
        for (_, sb), t in self._count_sums.items():
            e = t.to(torch.float64) * sb
            eff = e if eff is None else eff + e
            sent = t.clone() if sent is None else sent + t
        if eff is not None:
            eff = eff + float(self._fixed_total)
        if self._base_effective is not None:
            eff = self._base_effective.clone() if eff is None else \
                eff + self._base_effective.to(eff.device)
            sent = self._base_sent.clone() if sent is None else \
                sent + self._base_sent.to(sent.device)
        return dict(numel=self.numel, steps=self.steps,
                    total_payload_bytes=self.total_payload_bytes,
                    total_dense_bytes=self.total_dense_bytes,
                    total_effective=eff, total_sent=sent)

    @classmethod
    def from_state(cls, st: dict) -> "LayerStats":
        s = cls(st["numel"])
        s.steps = st["steps"]
        s.total_payload_bytes = st["total_payload_bytes"]
        s.total_dense_bytes = st["total_dense_bytes"]
        s._base_effective = st["total_effective"]
        s._base_sent = st["total_sent"]
        return s

    def total_effective_tensors(self) -> list:
        """Tensors :meth:`total_effective` reads (for one batched host copy)."""
        return [t for t in (*self._count_sums.values(), self._base_effective,
                            self._base_sent) if t is not None]

    def total_effective(self, host: Dict[int, object]) -> float:
        return self._totals(host)[0]


class StatsCollector:
    """Map layer name -> :class:`LayerStats`."""

    def __init__(self):
        self.layers: Dict[str, LayerStats] = {}
        self._reset_sums()

    def _reset_sums(self):
        # recorded since the last fold: [(name, LayerStats, [(key, count view)])]
        self._pending: list = []
        self._pending_names: set = set()
        # per device: one int64 vector holding every layer's running sums of counts, and
        # (layer name, key) -> its index (LayerStats._count_sums holds views of it)
        self._sums: Dict[torch.device, torch.Tensor] = {}
        self._slots: Dict[torch.device, Dict[tuple, int]] = {}
        self._index_cache: Dict[tuple, torch.Tensor] = {}   # fold: slot index tensors

    def record(self, name: str, step: int, payload: LayerPayload,
               selected: Optional[torch.Tensor] = None, threshold=None,
               density: Optional[float] = None, extra: Optional[dict] = None):
        """Host bookkeeping now; the segment counts (device tensors) are copied and added
        into the running sums at the next :meth:`fold`, together with every other layer
        recorded since. The payload's ``count`` tensors must not change until then: a
        compressor folds at ``begin_step`` and before compressing a layer again."""
        if name in self._pending_names:
            self.fold()
        st = self.layers.get(name)
        if st is None:
            st = self.layers[name] = LayerStats(payload.numel)
        counts = st._note(step, payload, selected, threshold, density, extra)
        self._pending.append((name, st, counts))
        self._pending_names.add(name)

    def pending(self, name: str) -> bool:
        """Whether ``name``'s last recorded counts are not folded in yet."""
        return name in self._pending_names

    def fold(self):
        """Copy the counts recorded since the last fold and add them into the running
        sums, per device with one ``cat`` (the copies: the latest counts, kept apart from
        the payloads' tensors, which a compressor may reuse later) and one ``add_`` into
        the slice of the sums vector they occupy (in the steady state every step records
        the same layers and segments in the same order); a step whose layout differs
        (first step, warm-up, a layer absent) adds per segment. Device ops only."""
        if not self._pending:
            return
        pending, self._pending, self._pending_names = self._pending, [], set()
        by_dev: Dict[torch.device, list] = {}
        for name, st, counts in pending:
            for key, c in counts:
                by_dev.setdefault(c.device, []).append(((name, key), c))
        copy_of: Dict[int, torch.Tensor] = {}
        for dev, items in by_dev.items():
            slots = self._slots.setdefault(dev, {})
            idx = [slots.setdefault(k, len(slots)) for k, _ in items]
            copies = torch.cat([c for _, c in items])
            sums = self._sums.get(dev)
            if sums is None or sums.numel() < len(slots):
                grown = torch.zeros(len(slots), dtype=torch.int64, device=dev)
                if sums is not None:
                    grown[:sums.numel()].copy_(sums)
                sums = self._sums[dev] = grown
                for (n, key), i in slots.items():
                    self.layers[n]._count_sums[key] = sums[i:i + 1]
            a, n = idx[0], len(idx)
            if idx == list(range(a, a + n)):
                sums[a:a + n].add_(copies)
            else:
                # another order than the slots' (the scheduler's bucket path records a
                # bucket's layers together): one index_add_ through a cached index
                # tensor (integer sums: exact in any order)
                key = (dev, tuple(idx))
                where = self._index_cache.get(key)
                if where is None:
                    if len(self._index_cache) > 64:
                        self._index_cache.clear()
                    where = self._index_cache[key] = torch.tensor(idx, device=dev)
                sums.index_add_(0, where, copies.to(sums.dtype))
            for j, (_, c) in enumerate(items):
                copy_of[id(c)] = copies[j:j + 1]
        for name, st, counts in pending:
            st._last_counts = [(copy_of[id(c)], key[1]) for key, c in counts]

    def as_dict(self) -> Dict[str, dict]:
        self.fold()
        host = host_values([t for st in self.layers.values() for t in st._tensors()])
        return {name: st.as_dict(host) for name, st in self.layers.items()}

    def totals(self) -> dict:
        """Whole-model sums over all layers and steps."""
        self.fold()
        pb = sum(s.total_payload_bytes for s in self.layers.values())
        db = sum(s.total_dense_bytes for s in self.layers.values())
        host = host_values([t for s in self.layers.values()
                            for t in s.total_effective_tensors()])
        eb = float(sum(s.total_effective(host) for s in self.layers.values()))
        return dict(payload_bytes=pb, dense_bytes=db, effective_bytes=eb,
                    compression_rate=db / pb if pb else math.inf,
                    effective_rate=db / eb if eb else math.inf)

    def state_dict(self) -> dict:
        self.fold()
        return {n: s.state() for n, s in self.layers.items()}

    def load_state_dict(self, sd: dict):
        self._reset_sums()
        self.layers = {n: LayerStats.from_state(st) for n, st in sd.items()}


def empty_totals() -> dict:
    """Running totals of the per-step exchange statistics (both front doors)."""
    return dict(steps=0, bytes_sent={}, bytes_recv={}, bytes_sent_total=0,
                bytes_recv_total=0, dense_allreduce_bytes=0, strategy_counts={},
                time_compress_s=0.0, time_wait_s=0.0, time_decode_s=0.0, skipped_steps=0)


def add_totals(t: dict, s: dict):
    """Add one step's ``last_stats`` to the running totals."""
    t["steps"] += 1
    for key in ("bytes_sent", "bytes_recv"):
        for k, v in s[key].items():
            t[key][k] = t[key].get(k, 0) + v
    for key in ("bytes_sent_total", "bytes_recv_total", "dense_allreduce_bytes",
                "time_compress_s", "time_wait_s", "time_decode_s"):
        t[key] += s[key]
    t["skipped_steps"] += int(bool(s.get("skipped")))
    for st in s["strategies"]:
        t["strategy_counts"][st] = t["strategy_counts"].get(st, 0) + 1
