"""Wire format: one flat ``uint8`` tensor per message (a bucket of layers).

One collective carries a whole bucket. Every rank's message for the same bucket has the
same length at every step: lengths depend only on the *layout* (numel, capacity,
encodings of every segment), never on the data; only the ``count`` fields and the
section contents differ between ranks and steps.

Byte order is little-endian throughout (x86 / CUDA hosts; asserted at import).

Message layout
--------------

::

    +---------------------------+  offset 0
    | header (24 bytes)         |
    +---------------------------+  24
    | segment record 0 (72 B)   |
    | ...                       |
    | segment record S-1        |
    +---------------------------+  24 + 72*S   (multiple of 8)
    | data of segment 0:        |
    |   indices section         |  each section starts at a multiple of 8;
    |   bin-counts section      |  its recorded length is the unpadded length,
    |   values / codes section  |  followed by 0..7 zero padding bytes
    |   scales section          |  (empty sections take no space)
    | data of segment 1 ...     |
    +---------------------------+  total_nbytes (multiple of 8)

Header (24 bytes)

========  =====  ======  ==========================================================
offset    size   type    field
========  =====  ======  ==========================================================
0         4      bytes   magic ``b"HVSP"``
4         2      u16     version (currently 2)
6         2      u16     record size (72)
8         4      u32     number of layers L (segments name their layer 0..L-1)
12        4      u32     number of segments S
16        8      u64     total message length in bytes
========  =====  ======  ==========================================================

Segment record (72 bytes, record ``s`` at ``24 + 72*s``)

========  =====  ======  ==========================================================
offset    size   type    field
========  =====  ======  ==========================================================
0         8      u64     numel: elements of the whole layer
8         8      u64     data offset: absolute byte offset of the segment's first
                         section (= end of the previous segment's data, 8-aligned)
16        4      u32     count: used slots (written on the device from the
                         segment's int32 ``count`` tensor, no host sync)
20        4      u32     capacity: slots
24        4      u32     layer index (non-decreasing over the records)
28        4      u32     bin size (BIN_U8 / BIN_U16 only, else 0)
32        4      u32     quantisation bucket (INT8 / INT4 / INT2 only, else 0)
36        1      u8      index encoding (:class:`IndexEncoding` code)
37        1      u8      value encoding (:class:`ValueEncoding` code)
38        2      u16     reserved, 0
40        8      u64     indices section length (bytes)
48        8      u64     bin-counts section length
56        8      u64     values section length
64        8      u64     scales section length
========  =====  ======  ==========================================================

Section lengths, with ``C`` = capacity, ``N`` = numel, ``B`` = bin size,
``Q`` = quantisation bucket, ``b`` = bits of the code:

=================  =======================  ===================================
encoding           section                  content
=================  =======================  ===================================
DENSE              (none)                   requires ``C == N``; slot j is element j
INT32              indices ``4*C``          int32 absolute element index per slot
BIN_U8             indices ``C``            uint8 bin-relative index per slot
                   bin counts ``w*ceil(N/B)``  slots per bin (``1 <= B <= 256``)
BIN_U16            indices ``2*C``          uint16 bin-relative index per slot
                   bin counts ``w*ceil(N/B)``  slots per bin (``1 <= B <= 65536``)
IMPLICIT           (none)                   indices known to every rank, not sent
BITMASK            indices ``ceil(N/8)``    bit ``i%8`` of byte ``i//8`` set = element
                                            ``i`` sent; bits ``>= N`` are 0
FP32/FP16/BF16     values ``C*4`` / ``C*2`` float per slot
INT8/INT4/INT2     values ``ceil(C*b/8)``   code of slot j in byte ``j*b//8`` at bit
                                            ``(j*b)%8``; ``v = (code - 2^(b-1)) *
                                            scale[j//Q] / (2^(b-1)-1)``
                   scales ``4*ceil(C/Q)``   fp32 per bucket of Q slots
SIGN1              values ``ceil(C/8)``     bit ``j%8`` of byte ``j//8``: 1 = negative
                   scales ``4``             fp32: ``v = +-scale``
=================  =======================  ===================================

Bin counts (BIN_*): a bin holds at most ``B`` elements, so its count travels in the
smallest unsigned integer that holds ``B``: ``w = 1`` byte (uint8) for ``B <= 255``,
``w = 2`` (uint16) for ``B <= 65535``, else ``w = 4`` (int32; only ``B = 65536``).
(Version 2; version 1 sent int32 always: for AdaComp's 50-element conv bins the counts
were 47% of the bytes.) Payloads carry int32 ``bin_counts``; the encoder narrows them
(a count above ``B`` is invalid anyway; after wrapping it fails the receiver's sum or
range check).

Narrowed INT32 (``Segment.narrow_indices``, set by TopK, Threshold, RandomK and Slim-DP's
explorer; rule: :func:`hvdsparse.payload.wire_indexing`): a segment held in memory with
absolute int32 indices and float values is written as BIN_U16 with bins of
``min(N, 65536)`` elements when that is shorter, its used slots sorted by index and its
values in the same order (:class:`_Narrowing`, a fixed number of device ops per message,
no host sync). Its record says BIN_U16, so receivers and :func:`decode` see an ordinary
BIN_U16 segment; the sum is the same (a row's indices are distinct, and the decode adds
by index). 6 bytes per fp32 slot instead of 8, 4 instead of 6 for fp16 / bf16.

Slot semantics: slots ``j < count`` are used, the rest is padding (copied verbatim,
content unspecified, ignored by decoders). BIN_*: slots are sorted by bin, bin ``k``
owns ``bin_counts[k]`` consecutive slots, so the absolute index of slot j is
``bin(j) * B + rel[j]`` with ``bin(j)`` found by a search in the cumulative bin counts;
``sum(bin_counts) == count`` and ``bin_counts[k] <= min(B, N - k*B)``.
BITMASK: the value of the k-th set bit (ascending element order) is slot k;
``popcount == count``.

Validation
----------

A message is *valid* for a template (the receiving rank's own payload list) when

* header and records are byte-identical to the template's (magic, version, record size,
  layer count, segment count, total length, and every record field except ``count``:
  numel, data offset, capacity, layer, bin size, quantisation bucket, encodings,
  reserved = 0, section lengths);
* every ``count <= capacity`` (read as u32);
* INT32: the first ``count`` indices lie in ``[0, numel)``;
* BIN_*: ``0 <= bin_counts[k] <= min(B, N - k*B)``, ``sum(bin_counts) == count``, and
  the first ``count`` relative indices are ``< B`` with absolute index ``< N``;
* BITMASK: no bit ``>= N`` set, ``popcount == count``.

Padding bytes and padding slots are not checked (they are never read). Repeated indices
inside one row are legal and accumulate (no compressor produces them; on the GPU their
summation order is unspecified).

Two ways to decode, one notion of validity:

* :func:`decode` parses on the host and checks all of the above except the comparison
  with a template (it checks the records' internal consistency instead); any problem
  raises :class:`CodecError` naming the field, the segment and what was expected. It
  never reads outside the buffer. :func:`accumulate` with ``validate=True`` runs it on
  every rank's message and compares the result with the template (CodecError naming the
  rank and the segment). On CUDA this costs a device->host copy per message.
* :func:`accumulate` with ``validate=False`` (the trusted, no-host-sync path used on
  CUDA) checks exactly the same conditions *on the device* with tensor operations and
  ORs what it finds into ``error_flag`` (int32[1]) -- see :data:`ERROR_CODES`:

  ==  ======================================================================
  1   an index outside its layer (INT32 / IMPLICIT index, BIN relative index >= B or
      absolute >= N; also set by the Triton kernel's own bounds check)
  2   a count above its capacity (or >= 2**31)
  4   bin counts out of range or not summing to the count (BIN_*)
  8   bitmask popcount != count, or bits set beyond numel (BITMASK)
  16  header / records differ from this rank's layout (any field but ``count``)
  ==  ======================================================================

  A (rank, segment) pair with any of these problems contributes nothing (its count is
  zeroed on the device before the scatter), except that on the Triton path an INT32
  index out of range is skipped slot by slot by the kernel itself. A row whose header
  differs contributes nothing at all. Nothing is ever written outside the output tensors.

Decode order: for every segment (record order), rank rows are added in rank order
0..P-1, inside a row in slot order (``ops.scatter_add_decode``), so every rank computes
bitwise identical sums from the same P messages.
"""
from __future__ import annotations

import struct
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import numpy as np
import torch

from . import native, ops
from .payload import (FLOAT_BYTES, FLOAT_DTYPES, QUANT_BITS, IndexEncoding, LayerPayload,
                      Segment, ValueEncoding, bin_count_width, wire_indexing)

assert sys.byteorder == "little", "hvdsparse wire format assumes a little-endian host"

__all__ = ["CodecError", "DecodedSegment", "MAGIC", "VERSION", "HEADER_SIZE", "RECORD_SIZE",
           "ERROR_CODES", "ERR_INDEX", "ERR_COUNT", "ERR_BIN_COUNTS", "ERR_BITMASK",
           "ERR_HEADER", "describe_error", "encoded_nbytes", "encode", "decode",
           "accumulate", "payload_to_dense", "sent_positions", "layout_signature"]

MAGIC = b"HVSP"
VERSION = 2
_HEADER = struct.Struct("<4sHHIIQ")
_RECORD = struct.Struct("<QQIIIIIBBHQQQQ")
HEADER_SIZE = _HEADER.size          # 24
RECORD_SIZE = _RECORD.size          # 72
_COUNT_OFFSET = 16                  # of the count field inside a record
_ALIGN = 8
_U32_MAX = 2 ** 32 - 1
_I32_MAX = 2 ** 31 - 1
_MAX_BIN = {IndexEncoding.BIN_U8: 256, IndexEncoding.BIN_U16: 65536}


_BIN_COUNT_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _narrow_bin_counts(bc: torch.Tensor, bin_size: int) -> torch.Tensor:
    """int32 counts -> their wire dtype (uint16 travels as int16 bits)."""
    dt = _BIN_COUNT_DTYPE[bin_count_width(bin_size)]
    return bc if dt == torch.int32 else bc.to(dt)


def _widen_bin_counts(raw: torch.Tensor, bin_size: int) -> torch.Tensor:
    """Wire bytes (uint8 [..., w * nbins]) -> int32 counts (uint16 read unsigned)."""
    w = bin_count_width(bin_size)
    c = raw.view(_BIN_COUNT_DTYPE[w]).to(torch.int32)
    return c & 0xFFFF if w == 2 else c

assert HEADER_SIZE == 24 and RECORD_SIZE == 72

#: error codes ORed into ``error_flag`` by ``accumulate(validate=False)`` (see module doc)
ERR_INDEX = 1
ERR_COUNT = 2
ERR_BIN_COUNTS = 4
ERR_BITMASK = 8
ERR_HEADER = 16
ERROR_CODES = {
    ERR_INDEX: "an index outside its layer",
    ERR_COUNT: "a count above its capacity",
    ERR_BIN_COUNTS: "bin counts out of range or not summing to the count",
    ERR_BITMASK: "a bitmask whose popcount differs from the count or with bits beyond numel",
    ERR_HEADER: "a header or segment record that differs from this rank's layout",
}


def describe_error(code: int) -> str:
    """Human-readable list of the problems encoded in an error-flag value."""
    code = int(code)
    parts = [v for k, v in ERROR_CODES.items() if code & k]
    rest = code & ~sum(ERROR_CODES)
    if rest:
        parts.append(f"unknown error bits 0x{rest:x}")
    return ", ".join(parts) if parts else "no error"


class CodecError(ValueError):
    """A message or payload does not follow the wire format (see module docstring)."""


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _LRU(OrderedDict):
    """A small bounded cache: the least recently used entry goes first."""

    def __init__(self, maxsize: int):
        super().__init__()
        self.maxsize = maxsize

    def get_lru(self, key):
        v = self.get(key)
        if v is not None:
            self.move_to_end(key)
        return v

    def put(self, key, value):
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)
        return value


# --------------------------------------------------------------------------- layout

@dataclass(frozen=True)
class _SegLayout:
    """Host-known description of one segment inside a message."""

    layer: int
    numel: int
    capacity: int
    ienc: IndexEncoding
    venc: ValueEncoding
    bin_size: int          # 0 unless BIN_*
    quant_bucket: int      # 0 unless INT*
    lengths: tuple         # (indices, bin_counts, values, scales) unpadded byte lengths
    offsets: tuple         # absolute start of each section
    narrowed: bool = False  # INT32 in memory, BIN_U16 on the wire (payload.wire_indexing)

    @property
    def nbins(self) -> int:
        return _cdiv(self.numel, self.bin_size) if self.bin_size else 0


def _section_lengths(where: str, numel: int, capacity: int, ienc, venc, bin_size: int,
                     quant_bucket: int):
    """Unpadded byte lengths (indices, bin_counts, values, scales); raises CodecError."""
    try:
        ienc = IndexEncoding(int(ienc))
    except ValueError:
        raise CodecError(f"{where}: unknown index encoding code {int(ienc)} "
                         f"(known: {[int(e) for e in IndexEncoding]})") from None
    try:
        venc = ValueEncoding(int(venc))
    except ValueError:
        raise CodecError(f"{where}: unknown value encoding code {int(venc)} "
                         f"(known: {[int(e) for e in ValueEncoding]})") from None
    if numel < 0 or numel > _I32_MAX:
        raise CodecError(f"{where}: numel {numel} outside [0, {_I32_MAX}]")
    if capacity < 0 or capacity > _U32_MAX:
        raise CodecError(f"{where}: capacity {capacity} outside [0, {_U32_MAX}]")
    # ---- indices
    bins = 0
    if ienc in _MAX_BIN:
        if not 1 <= bin_size <= _MAX_BIN[ienc]:
            raise CodecError(f"{where}: bin_size {bin_size} invalid for {ienc.name} "
                             f"(expected 1..{_MAX_BIN[ienc]})")
        bins = _cdiv(numel, bin_size)
    elif bin_size != 0:
        raise CodecError(f"{where}: bin_size must be 0 for {ienc.name}, got {bin_size}")
    if ienc == IndexEncoding.DENSE:
        if capacity != numel:
            raise CodecError(f"{where}: DENSE segment needs capacity == numel, "
                             f"got capacity {capacity}, numel {numel}")
        il = 0
    elif ienc == IndexEncoding.INT32:
        il = 4 * capacity
    elif ienc == IndexEncoding.BIN_U8:
        il = capacity
    elif ienc == IndexEncoding.BIN_U16:
        il = 2 * capacity
    elif ienc == IndexEncoding.IMPLICIT:
        il = 0
    else:  # BITMASK
        il = _cdiv(numel, 8)
    bl = bin_count_width(bin_size) * bins
    # ---- values
    if venc in QUANT_BITS:
        if quant_bucket < 1 or quant_bucket > _U32_MAX:
            raise CodecError(f"{where}: quant_bucket {quant_bucket} invalid for "
                             f"{venc.name} (expected >= 1)")
        bits = QUANT_BITS[venc]
        vl = _cdiv(capacity * bits, 8)
        sl = 4 * _cdiv(capacity, quant_bucket)
    else:
        if quant_bucket != 0:
            raise CodecError(f"{where}: quant_bucket must be 0 for {venc.name}, "
                             f"got {quant_bucket}")
        if venc == ValueEncoding.SIGN1:
            vl = _cdiv(capacity, 8)
            sl = 4
        else:
            vl = FLOAT_BYTES[venc] * capacity
            sl = 0
    return ienc, venc, (il, bl, vl, sl)


def _seg_params(seg: Segment):
    """Host-known fields of a segment as plain ints (encodings checked later, by
    :func:`_section_lengths`, which names the segment)."""
    ienc, venc = int(seg.index_encoding), int(seg.value_encoding)
    bin_size = int(seg.bin_size) if ienc in _MAX_BIN else 0
    qb = int(seg.quant_bucket) if venc in QUANT_BITS else 0
    return int(seg.numel), int(seg.capacity), ienc, venc, bin_size, qb


def _wire_params(seg: Segment):
    """:func:`_seg_params` as the segment travels (:func:`payload.wire_indexing`), plus
    whether its INT32 indices are narrowed to BIN_U16 on the way."""
    numel, cap, ienc, venc, bs, qb = _seg_params(seg)
    wienc, wbs = wire_indexing(seg) if ienc == IndexEncoding.INT32 else (ienc, bs)
    narrowed = wienc != ienc
    return numel, cap, int(wienc), venc, (wbs if narrowed else bs), qb, narrowed


def _layout(payloads: Sequence[LayerPayload]):
    """(list[_SegLayout], data_start, total_nbytes) from host-known fields only."""
    plan = _plan(payloads)
    return list(plan.segs), plan.data_start, plan.total


def _layout_uncached(payloads: Sequence[LayerPayload]):
    segs = []
    nseg = sum(len(p.segments) for p in payloads)
    pos = HEADER_SIZE + RECORD_SIZE * nseg
    s = 0
    for li, p in enumerate(payloads):
        lnumel = p.numel
        for seg in p.segments:
            where = f"layer {li} ({p.name!r}) segment {s}"
            numel, cap, ienc, venc, bs, qb, narrowed = _wire_params(seg)
            if numel != lnumel:
                raise CodecError(f"{where}: segment numel {numel} != layer numel {lnumel} "
                                 f"(shape {tuple(p.shape)})")
            ienc, venc, lengths = _section_lengths(where, numel, cap, ienc, venc, bs, qb)
            offsets = []
            for ln in lengths:
                offsets.append(pos)
                pos += _align(ln)
            segs.append(_SegLayout(li, numel, cap, ienc, venc, bs, qb, lengths,
                                   tuple(offsets), narrowed))
            s += 1
    return segs, HEADER_SIZE + RECORD_SIZE * nseg, pos


@dataclass(frozen=True)
class _Plan:
    """Everything host-known about one layout, computed once per layout signature."""

    sig: tuple
    segs: tuple              # of _SegLayout
    nlayers: int
    data_start: int          # end of the records
    total: int               # message length
    header: bytes            # header + records with every count field 0
    narrowed: bool = False   # some segment's INT32 indices travel as BIN_U16


_PLANS = _LRU(1024)          # layout signature -> _Plan
_DEVICE_BYTES = _LRU(512)    # (signature, device, kind) -> _DeviceBytes


def _plan(payloads: Sequence[LayerPayload]) -> _Plan:
    sig = _plan_key(payloads)
    plan = _PLANS.get_lru(sig)
    if plan is not None:
        return plan
    segs, data_start, total = _layout_uncached(payloads)
    raw = bytearray(data_start)
    _HEADER.pack_into(raw, 0, MAGIC, VERSION, RECORD_SIZE, len(payloads), len(segs), total)
    for s, sl in enumerate(segs):
        _RECORD.pack_into(raw, HEADER_SIZE + RECORD_SIZE * s, sl.numel, sl.offsets[0], 0,
                          sl.capacity, sl.layer, sl.bin_size, sl.quant_bucket, int(sl.ienc),
                          int(sl.venc), 0, *sl.lengths)
    return _PLANS.put(sig, _Plan(sig, tuple(segs), len(payloads), data_start, total,
                                 bytes(raw), any(sl.narrowed for sl in segs)))


class _DeviceBytes:
    """A cached device tensor uploaded without blocking the host: on CUDA through
    pinned memory with a non-blocking copy on the current stream. ``event`` marks the
    copy's end; a use from another stream waits for it on the device (never on the
    host) until a non-blocking query shows it complete. The pinned source lives as
    long as the entry (the caching host allocator also tracks the copy)."""

    __slots__ = ("tensor", "pinned", "event")

    def __init__(self, raw: bytes, device: torch.device):
        self.pinned = self.event = None
        if not raw:
            self.tensor = torch.empty(0, dtype=torch.uint8, device=device)
            return
        host = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if device.type == "cpu":
            self.tensor = host
        elif device.type == "cuda":
            self.pinned = host.pin_memory()
            self.tensor = torch.empty(host.numel(), dtype=torch.uint8, device=device)
            self.tensor.copy_(self.pinned, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))
        else:
            self.tensor = host.to(device)

    def get(self) -> torch.Tensor:
        ev = self.event
        if ev is not None:
            if ev.query():                                 # host-side poll, no sync
                self.event = None
            else:
                torch.cuda.current_stream(self.tensor.device).wait_event(ev)
        return self.tensor


def _to_device(raw: bytes, device: torch.device) -> _DeviceBytes:
    return _DeviceBytes(raw, device)


def _plan_bytes(plan: _Plan, device: torch.device, kind: str) -> torch.Tensor:
    """Cached device copy of a per-layout byte string: ``"image"`` (header + records,
    counts 0) or ``"mask"`` (0xFF everywhere except 0 on the count fields)."""
    key = (plan.sig, str(device), kind)
    ent = _DEVICE_BYTES.get_lru(key)
    if ent is None:
        if kind == "image":
            raw = plan.header
        else:
            m = bytearray(b"\xff" * plan.data_start)
            for s in range(len(plan.segs)):
                rec = HEADER_SIZE + RECORD_SIZE * s + _COUNT_OFFSET
                m[rec:rec + 4] = b"\0\0\0\0"
            raw = bytes(m)
        ent = _DEVICE_BYTES.put(key, _to_device(raw, device))
    return ent.get()


def layout_signature(payloads: Sequence[LayerPayload]) -> tuple:
    """Hashable description of the wire layout: per layer ``(numel, segments)`` with
    per segment ``(numel, capacity, index_encoding, value_encoding, bin_size,
    quant_bucket)`` as the segment travels (a narrowed INT32 segment reads BIN_U16 with
    its bins), bin_size / quant_bucket 0 where the encoding does not use them. Two
    payload lists with equal signatures encode to messages of equal length and
    identical section offsets."""
    return tuple((p.numel, tuple(w[:6] for w in map(_wire_params, p.segments)))
                 for p in payloads)


def _plan_key(payloads: Sequence[LayerPayload]) -> tuple:
    """:func:`layout_signature` plus, per segment, whether it is narrowed: the encoder's
    work differs from a BIN_U16 segment's of the same layout."""
    return tuple((p.numel, tuple(map(_wire_params, p.segments))) for p in payloads)


def encoded_nbytes(payloads: Sequence[LayerPayload]) -> int:
    """Length in bytes of ``encode(payloads)``; uses capacities and encodings only."""
    return _plan(payloads).total


# ------------------------------------------------------------------ cached temporaries

_ARANGES: dict = {}
#: largest cached temporaries (elements): beyond this they are allocated per call, so a
#: huge DENSE layer does not pin an index vector of its size on the device for good
_CACHE_ELEMS = 1 << 22


def cached_arange(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``arange(n)`` as a slice of a cached, geometrically grown tensor (one per device
    and dtype): slot numbers and DENSE indices without a per-step allocation."""
    if n > _CACHE_ELEMS:
        return torch.arange(n, dtype=dtype, device=device)
    key = (str(device), dtype)
    t = _ARANGES.get(key)
    if t is None or t.numel() < n:
        size = max(64, 1 << max(0, n - 1).bit_length())
        t = torch.arange(size, dtype=dtype, device=device)
        _ARANGES[key] = t
    return t[:n]


def _bin_limits(plan: _Plan, s: int, sl: _SegLayout, device) -> torch.Tensor:
    """int32[nbins]: ``min(B, N - k*B)``, the most slots bin k can own (cached)."""
    key = (plan.sig, str(device), ("limits", s))
    ent = _DEVICE_BYTES.get_lru(key)
    if ent is None:
        k = torch.arange(sl.nbins, dtype=torch.int64)
        lim = (sl.numel - k * sl.bin_size).clamp(max=sl.bin_size).to(torch.int32)
        ent = _DEVICE_BYTES.put(key, _to_device(lim.numpy().tobytes(), device))
    return ent.get().view(torch.int32)


_SLOTS = _LRU(64)


def _ones_like_int64(t: torch.Tensor) -> torch.Tensor:
    """int64 ones of ``t``'s shape (an expanded scalar: no allocation per call)."""
    return torch.ones((), dtype=torch.int64, device=t.device).expand(t.shape)


def _slots(P: int, C: int, dtype: torch.dtype, device, start: int = 0) -> torch.Tensor:
    """Contiguous [P, C] rows ``start .. start+C-1`` (cached: searchsorted wants a
    contiguous input and would copy an expanded one at every call)."""
    if P * C > _CACHE_ELEMS:
        return cached_arange(start + C, dtype, device)[start:].expand(P, C).contiguous()
    key = (P, C, dtype, str(device), start)
    t = _SLOTS.get_lru(key)
    if t is None:
        t = _SLOTS.put(key, cached_arange(start + C, dtype, device)[start:].expand(P, C)
                       .contiguous())
    return t


_CODE_BITS: dict = {}


def _code_bits(device) -> torch.Tensor:
    key = str(device)
    t = _CODE_BITS.get(key)
    if t is None:
        t = torch.tensor(sorted(ERROR_CODES), dtype=torch.int32, device=device)
        _CODE_BITS[key] = t
    return t


# --------------------------------------------------------------------------- encode

_ZEROS_CACHE: dict = {}


def _zeros(device) -> torch.Tensor:
    key = str(device)
    z = _ZEROS_CACHE.get(key)
    if z is None:
        z = torch.zeros(_ALIGN, dtype=torch.uint8, device=device)
        _ZEROS_CACHE[key] = z
    return z


def _as_bytes(t: Optional[torch.Tensor], where: str, field: str, dtypes, numel: int,
              device) -> torch.Tensor:
    if t is None:
        raise CodecError(f"{where}: {field} is required by the encoding but is None")
    if not isinstance(t, torch.Tensor):
        raise CodecError(f"{where}: {field} is a {type(t).__name__}, expected a tensor")
    if t.dtype not in dtypes:
        raise CodecError(f"{where}: {field} dtype {t.dtype}, expected "
                         f"{' or '.join(str(d) for d in dtypes)}")
    if t.numel() != numel:
        raise CodecError(f"{where}: {field} has {t.numel()} elements, expected {numel}")
    if t.device != device:
        raise CodecError(f"{where}: {field} on {t.device}, message on {device}")
    return t.reshape(-1).contiguous().view(torch.uint8)


def _count_bytes(seg: Segment, where: str, device) -> torch.Tensor:
    c = seg.count
    if not isinstance(c, torch.Tensor) or c.numel() < 1:
        raise CodecError(f"{where}: count must be an int32 tensor with >= 1 element")
    if c.device != device:
        raise CodecError(f"{where}: count on {c.device}, message on {device}")
    if c.dtype not in (torch.int32, torch.int64):
        raise CodecError(f"{where}: count dtype {c.dtype}, expected int32")
    c = c.reshape(-1)[:1]
    if c.dtype != torch.int32:
        c = c.to(torch.int32)
    return c.contiguous().view(torch.uint8)


def _segment_pieces(seg: Segment, sl: _SegLayout, where: str, device):
    """Byte views of the four sections (None for empty), validated against layout."""
    il, bl, vl, sll = sl.lengths
    pieces = [None, None, None, None]
    if il:
        if sl.ienc == IndexEncoding.INT32:
            pieces[0] = _as_bytes(seg.indices, where, "indices", (torch.int32,),
                                  sl.capacity, device)
        elif sl.ienc == IndexEncoding.BIN_U8:
            pieces[0] = _as_bytes(seg.indices, where, "indices", (torch.uint8,),
                                  sl.capacity, device)
        elif sl.ienc == IndexEncoding.BIN_U16:
            pieces[0] = _as_bytes(seg.indices, where, "indices", (torch.int16, torch.uint16),
                                  sl.capacity, device)
        else:  # BITMASK
            pieces[0] = _as_bytes(seg.indices, where, "indices (bitmask)", (torch.uint8,),
                                  il, device)
    if bl:
        bc = _as_bytes(seg.bin_counts, where, "bin_counts", (torch.int32,), sl.nbins, device)
        pieces[1] = _narrow_bin_counts(bc.view(torch.int32), sl.bin_size).view(torch.uint8)
    if vl:
        if sl.venc in FLOAT_DTYPES:
            pieces[2] = _as_bytes(seg.values, where, "values", (FLOAT_DTYPES[sl.venc],),
                                  sl.capacity, device)
        else:
            pieces[2] = _as_bytes(seg.values, where, "values (packed codes)", (torch.uint8,),
                                  vl, device)
    if sll:
        pieces[3] = _as_bytes(seg.scales, where, "scales", (torch.float32,), sll // 4, device)
    return pieces


class _Narrowing:
    """Everything host-known about narrowing one message's segments of one value dtype
    (:func:`payload.wire_indexing`), with reused device buffers: built once per layout,
    device and dtype, then :meth:`run` makes every member's sections in a fixed number
    of launches, whatever the number of members.

    All members' slots are sorted at once: member ``j``'s key of slot ``i`` is
    ``j * 2^32 + index`` for a used slot (``i < count``) and ``j * 2^32 + 2^31`` for
    padding, so the sorted keys keep each member in its own range of slots, used slots
    first, by index. A bin's count is the difference of two ``searchsorted`` positions
    of the bin bounds ``j * 2^32 + min(k B_j, N_j)``; the uint16 position inside the bin
    is the key's low 16 bits (``B_j`` is 65536, or ``N_j <= 65536`` with one bin)."""

    def __init__(self, plan: _Plan, members, device, vdtype):
        self.members = members
        self.caps = caps = [plan.segs[s].capacity for s in members]
        self.slot_off = np.concatenate([[0], np.cumsum(caps)]).astype(np.int64)
        T = int(self.slot_off[-1])
        member = np.repeat(np.arange(len(members), dtype=np.int64), caps)
        local = np.concatenate([np.arange(c, dtype=np.int32) for c in caps])
        bounds, diff_pos, self.bin_off, self.widths = [], [], [0], []
        for j, s in enumerate(members):
            sl = plan.segs[s]
            nb = sl.nbins
            start = len(bounds)
            k = np.arange(nb + 1, dtype=np.int64)
            bounds.extend(((j << 32) + np.minimum(k * sl.bin_size, sl.numel)).tolist())
            diff_pos.extend(range(start, start + nb))
            self.bin_off.append(self.bin_off[-1] + nb)
            self.widths.append(bin_count_width(sl.bin_size))
        dev = device

        def up(a, dt):
            return torch.from_numpy(np.ascontiguousarray(a)).to(dt).to(dev)
        self.member = up(member, torch.int64)
        self.local = up(local, torch.int32)
        self.base = up(member << 32, torch.int64)
        self.pad = up((member << 32) + (1 << 31), torch.int64)
        self.bounds = up(np.asarray(bounds, np.int64), torch.int64)
        self.diff_pos = up(np.asarray(diff_pos, np.int64), torch.int64)
        nbt = self.bin_off[-1]

        def e(n, dt):
            return torch.empty(n, dtype=dt, device=dev)
        self.idx, self.cnt, self.cslot = e(T, torch.int32), e(len(members), torch.int32), \
            e(T, torch.int32)
        self.used, self.keys, self.skeys, self.perm = e(T, torch.bool), e(T, torch.int64), \
            e(T, torch.int64), e(T, torch.int64)
        self.rel, self.vals, self.pvals = e(T, torch.int16), e(T, vdtype), e(T, vdtype)
        self.cum, self.dcum = e(len(bounds), torch.int32), e(max(len(bounds) - 1, 0), torch.int32)
        self.counts = e(nbt, torch.int32)
        # the counts at each wire width (uint8 / uint16 as int16 bits / int32)
        self.wide = {w: (self.counts if w == 4 else e(nbt, _BIN_COUNT_DTYPE[w]))
                     for w in set(self.widths)}
        # the Triton path: one launch (kernels/bucket_narrow.py) over this member table
        self.tab = up(np.array([[self.slot_off[j], caps[j], self.bin_off[j],
                                 plan.segs[s].nbins, plan.segs[s].bin_size, self.widths[j],
                                 plan.segs[s].numel]
                                for j, s in enumerate(members)], np.int64).reshape(-1, 7),
                      torch.int64)
        self.start = e(nbt, torch.int32)

    def run(self, segs, wheres, device):
        """``[(s, pieces)]`` for the member segments ``segs`` (in member order)."""
        T = self.idx.numel()
        idx = [_as_bytes(seg.indices, w, "indices", (torch.int32,), n, device)
               .view(torch.int32)
               for seg, w, n in zip(segs, wheres, self.caps)]
        vdt = self.vals.dtype
        vals = [_as_bytes(seg.values, w, "values", (vdt,), n, device).view(vdt)
                for seg, w, n in zip(segs, wheres, self.caps)]
        cnts = [_count_bytes(seg, w, device).view(torch.int32) for seg, w in zip(segs, wheres)]
        idx = _joined(idx, T, self.idx)
        vals = _joined(vals, T, self.vals)
        cnt = _joined(cnts, len(cnts), self.cnt)
        if ops.use_triton(idx):
            wide = self.wide
            ops.bucket_kernels("narrow").narrow(
                self.tab, idx, vals, cnt, self.rel, self.pvals, self.counts,
                wide.get(2, self.rel), wide.get(1, self.used.view(torch.uint8)), self.start)
            return self._sections(self.pvals)
        torch.index_select(cnt, 0, self.member, out=self.cslot)
        torch.lt(self.local, self.cslot, out=self.used)
        torch.add(self.base, idx, out=self.keys)
        torch.where(self.used, self.keys, self.pad, out=self.keys)
        skeys, perm = self.skeys, self.perm
        kn = self.keys.numpy() if self.keys.device.type == "cpu" else None
        if kn is not None and (kn.size < 2 or bool((kn[1:] >= kn[:-1]).all())):
            # the CPU selects write their slots in ascending index order: already sorted
            # (a host check only where the data is on the host)
            skeys, perm = self.keys, None
        else:
            torch.sort(self.keys, out=(skeys, perm))
        torch.searchsorted(skeys, self.bounds, out_int32=True, out=self.cum)
        torch.diff(self.cum, out=self.dcum)
        torch.index_select(self.dcum, 0, self.diff_pos, out=self.counts)
        for w, t in self.wide.items():
            if w != 4:
                t.copy_(self.counts)
        self.rel.copy_(skeys)                     # the low 16 bits: position in the bin
        pvals = vals if perm is None else torch.index_select(vals, 0, perm, out=self.pvals)
        return self._sections(pvals)

    def _sections(self, pvals):
        out = []
        for j, s in enumerate(self.members):
            a, b = int(self.slot_off[j]), int(self.slot_off[j + 1])
            c0, c1 = self.bin_off[j], self.bin_off[j + 1]
            cw = self.wide[self.widths[j]]
            out.append((s, [self.rel[a:b].view(torch.uint8), cw[c0:c1].view(torch.uint8),
                            pvals[a:b].view(torch.uint8), None]))
        return out


def _joined(ts, n, buf):
    """``ts`` (1-D tensors of one dtype, ``n`` elements in all) as one tensor: a view when
    they lie in order in one storage, evenly spaced (a bucket's slices of one buffer, or
    its ``count`` rows), so nothing is copied; else concatenated into ``buf``."""
    t0 = ts[0] if ts else None
    if t0 is not None and all(t.dim() == 1 and t.dtype == t0.dtype for t in ts) and \
            all(t.untyped_storage().data_ptr() == t0.untyped_storage().data_ptr()
                for t in ts):
        offs = [t.storage_offset() for t in ts]
        if all(t.numel() == 1 for t in ts):
            step = offs[1] - offs[0] if len(ts) > 1 else 1
            if step > 0 and all(b - a == step for a, b in zip(offs, offs[1:])):
                return t0.as_strided((len(ts),), (step,), offs[0])
        elif all(t.numel() <= 1 or t.stride(0) == 1 for t in ts):
            pos = offs[0]
            if all(o == p for o, p in zip(offs, np.cumsum([pos] + [t.numel() for t in ts]))):
                return t0.as_strided((n,), (1,), offs[0])
    return torch.cat(ts, out=buf) if ts else buf


_NARROWINGS = _LRU(256)      # (layout signature, device, value dtype) -> _Narrowing


def _narrow_message(plan: _Plan, flat_segs, device) -> dict:
    """``{segment ordinal: its four sections}`` for every narrowed segment of a message
    (see :class:`_Narrowing`): one batch per value dtype."""
    groups = {}
    for s, sl in enumerate(plan.segs):
        if sl.narrowed:
            groups.setdefault(FLOAT_DTYPES[sl.venc], []).append(s)
    out = {}
    for vdt, members in groups.items():
        key = (plan.sig, str(device), vdt)
        nar = _NARROWINGS.get_lru(key)
        if nar is None:
            nar = _NARROWINGS.put(key, _Narrowing(plan, members, device, vdt))
        segs = [flat_segs[s][2] for s in members]
        wheres = [f"layer {flat_segs[s][0]} ({flat_segs[s][1].name!r}) segment {s}"
                  for s in members]
        out.update(nar.run(segs, wheres, device))
    return out


def new_message(payloads: Sequence[LayerPayload], device=None) -> torch.Tensor:
    """An uninitialised uint8 buffer of ``encoded_nbytes(payloads)`` bytes on ``device``
    (default: the payloads' device): allocate it once per bucket and pass it to
    :func:`encode` as ``out`` at every step (the layout, hence the length, is fixed)."""
    if device is None:
        device = _payload_device(payloads) or torch.device("cpu")
    return torch.empty(_plan(payloads).total, dtype=torch.uint8, device=device)


def _payload_device(payloads) -> Optional[torch.device]:
    for p in payloads:
        for seg in p.segments:
            c = seg.count
            return c.device if isinstance(c, torch.Tensor) else None
    return None


def encode(payloads: Sequence[LayerPayload], out: Optional[torch.Tensor] = None
           ) -> torch.Tensor:
    """Serialise ``payloads`` into one uint8 message on the payloads' device.

    Header and records come from a per-layout image built once on the host and cached
    on the device (LRU over layouts; on CUDA it is uploaded with one non-blocking copy
    from pinned memory), the counts and sections are copied with tensor operations (one
    ``torch.cat`` into ``out``): nothing synchronises with the host. Padding bytes are
    zero; padding *slots* (``>= count``) are copied verbatim.

    ``out`` (uint8, ``encoded_nbytes(payloads)`` elements, contiguous, on the payloads'
    device) is filled and returned when given: keep one per bucket (see
    :func:`new_message`) and pass it every step, so encoding allocates nothing. The
    caller must not overwrite it while a collective still reads it.
    """
    plan = _plan(payloads)
    segs, data_start, total = plan.segs, plan.data_start, plan.total
    device = _payload_device(payloads)
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1 \
                or out.numel() != total or not out.is_contiguous():
            raise CodecError(f"encode: out must be a contiguous 1-D uint8 tensor of {total} "
                             f"bytes, got {getattr(out, 'dtype', type(out).__name__)} shape "
                             f"{tuple(getattr(out, 'shape', ()))}")
        if device is not None and out.device != device:
            raise CodecError(f"encode: out on {out.device}, payloads on {device}")
        device = out.device
    if device is None:
        device = torch.device("cpu")
    img = _plan_bytes(plan, device, "image")
    zeros = _zeros(device)
    pieces = []
    pos = 0
    flat_segs = [(li, p, seg) for li, p in enumerate(payloads) for seg in p.segments]
    for s, (li, p, seg) in enumerate(flat_segs):
        where = f"layer {li} ({p.name!r}) segment {s}"
        rec = HEADER_SIZE + RECORD_SIZE * s + _COUNT_OFFSET
        pieces.append(img[pos:rec])
        pieces.append(_count_bytes(seg, where, device))
        pos = rec + 4
    pieces.append(img[pos:data_start])
    narrowed = _narrow_message(plan, flat_segs, device) if plan.narrowed else {}
    for s, (li, p, seg) in enumerate(flat_segs):
        where = f"layer {li} ({p.name!r}) segment {s}"
        sl = segs[s]
        secs = narrowed[s] if sl.narrowed else _segment_pieces(seg, sl, where, device)
        for piece, ln in zip(secs, sl.lengths):
            if piece is not None:
                pieces.append(piece)
            pad = _align(ln) - ln
            if pad:
                pieces.append(zeros[:pad])
    pieces = [t for t in pieces if t.numel()]
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=device)
    torch.cat(pieces, out=out)
    return out


# --------------------------------------------------------------------------- decode

@dataclass
class DecodedSegment:
    """One segment parsed from a message. Tensors are views into the CPU copy of the
    buffer (clone them to keep them past the buffer's reuse), at full capacity; only
    the first ``count`` slots are meaningful.

    * ``indices``: INT32 int32[C]; BIN_U8 uint8[C]; BIN_U16 int16[C] (uint16 bits);
      BITMASK uint8[ceil(N/8)]; DENSE / IMPLICIT None.
    * ``bin_counts``: int32[ceil(N/B)] for BIN_*, else None.
    * ``values``: fp32/fp16/bf16[C], or uint8 packed codes / sign bits.
    * ``scales``: fp32 per bucket (INT*), fp32[1] (SIGN1), else None.
    """

    segment: int
    layer: int
    numel: int
    capacity: int
    count: int
    index_encoding: IndexEncoding
    value_encoding: ValueEncoding
    bin_size: int
    quant_bucket: int
    indices: Optional[torch.Tensor]
    bin_counts: Optional[torch.Tensor]
    values: torch.Tensor
    scales: Optional[torch.Tensor]

    def as_segment(self, implicit_indices: Optional[torch.Tensor] = None) -> Segment:
        """A :class:`Segment` with these tensors (``count`` as int32[1])."""
        return Segment(numel=self.numel, capacity=self.capacity,
                       index_encoding=self.index_encoding,
                       value_encoding=self.value_encoding,
                       count=torch.tensor([self.count], dtype=torch.int32),
                       values=self.values, indices=self.indices, scales=self.scales,
                       bin_counts=self.bin_counts, bin_size=self.bin_size,
                       quant_bucket=self.quant_bucket or 512,
                       implicit_indices=implicit_indices)

    def layout_key(self) -> tuple:
        return (self.layer, self.numel, self.capacity, int(self.index_encoding),
                int(self.value_encoding), self.bin_size, self.quant_bucket)


def _host_bytes(buffer: torch.Tensor) -> torch.Tensor:
    if not isinstance(buffer, torch.Tensor):
        raise CodecError(f"buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dtype != torch.uint8:
        raise CodecError(f"buffer dtype {buffer.dtype}, expected torch.uint8")
    if buffer.dim() != 1:
        raise CodecError(f"buffer must be 1-D, got shape {tuple(buffer.shape)}")
    buf = buffer.detach().to("cpu")
    # a view that starts at an offset not divisible by 8 (a slice of a larger buffer)
    # cannot be reinterpreted as int32 / fp32 sections: copy it to a fresh buffer
    if buf.stride(0) != 1 or buf.storage_offset() % _ALIGN:
        buf = buf.clone(memory_format=torch.contiguous_format)
    return buf


def _check_content(where: str, sl_numel: int, count: int, ienc, indices, bin_counts,
                   bin_size: int, capacity: int):
    """Data checks on the first ``count`` slots (numpy, host)."""
    if ienc == IndexEncoding.INT32:
        idx = indices[:count].numpy()
        if count:
            bad = np.nonzero((idx < 0) | (idx >= sl_numel))[0]
            if bad.size:
                j = int(bad[0])
                raise CodecError(f"{where}: index out of range: slot {j} has index "
                                 f"{int(idx[j])}, layer numel {sl_numel} "
                                 f"({bad.size} bad slots)")
    elif ienc in _MAX_BIN:
        bc = bin_counts.numpy().astype(np.int64)
        nbins = bc.size
        limits = np.minimum(bin_size, sl_numel - np.arange(nbins, dtype=np.int64) * bin_size)
        bad = np.nonzero((bc < 0) | (bc > limits))[0]
        if bad.size:
            k = int(bad[0])
            raise CodecError(f"{where}: bin_counts[{k}] = {int(bc[k])} outside "
                             f"[0, {int(limits[k])}] (bin size {bin_size}, numel {sl_numel})")
        total = int(bc.sum())
        if total != count:
            raise CodecError(f"{where}: bin_counts sum to {total}, expected count {count}")
        if count:
            rel = indices[:count].numpy()
            rel = rel.view(np.uint16) if ienc == IndexEncoding.BIN_U16 else rel.view(np.uint8)
            # absolute = k B + rel < N  <=>  rel < B in every bin but the last (whose
            # (k + 1) B <= N), and rel < N - k B in the last: one pass, none when B is
            # the index type's whole range
            bad = np.nonzero(rel >= bin_size)[0] if bin_size <= np.iinfo(rel.dtype).max \
                else np.zeros(0, np.int64)
            last = nbins - 1
            first = count - int(bc[last])
            tail = np.nonzero(rel[first:] >= sl_numel - last * bin_size)[0] + first
            bad = np.concatenate([bad, tail])
            if bad.size:
                j = int(bad.min())
                k = int(np.searchsorted(np.cumsum(bc), j, side="right"))
                raise CodecError(f"{where}: index out of range: slot {j} has bin-relative "
                                 f"index {int(rel[j])} in bin {k} (bin size "
                                 f"{bin_size}, absolute {k * bin_size + int(rel[j])}, "
                                 f"numel {sl_numel})")
    elif ienc == IndexEncoding.BITMASK:
        mask = indices.numpy()
        tail = sl_numel % 8
        if tail and int(mask[-1]) >> tail:
            raise CodecError(f"{where}: bitmask has bits set beyond numel {sl_numel} "
                             f"(last byte 0x{int(mask[-1]):02x})")
        pop = int(np.unpackbits(mask).sum())
        if pop != count:
            raise CodecError(f"{where}: bitmask popcount {pop} != count {count}")
        if pop > capacity:
            raise CodecError(f"{where}: bitmask popcount {pop} > capacity {capacity}")


def decode(buffer: torch.Tensor, *, check_content: bool = True) -> List[DecodedSegment]:
    """Parse and validate one message (host side; a CUDA buffer is copied to the host).

    Raises :class:`CodecError` naming the field, the segment and expected vs. found
    values for anything inconsistent (see the module docstring). ``check_content=False``
    skips the data checks (index ranges, bin counts, bitmask popcount) but keeps all
    structural checks.
    """
    return _decode(buffer, check_content)[1]


def _decode(buffer: torch.Tensor, check_content: bool = True):
    """(layer count from the header, list of DecodedSegment); see :func:`decode`."""
    buf = _host_bytes(buffer)
    n = buf.numel()
    raw = memoryview(buf.numpy())
    if n < HEADER_SIZE:
        raise CodecError(f"truncated buffer: {n} bytes, the header alone needs {HEADER_SIZE}")
    magic, version, rsize, nlayers, nseg, total = _HEADER.unpack_from(raw, 0)
    if magic != MAGIC:
        raise CodecError(f"bad magic {magic!r}, expected {MAGIC!r} (not an hvdsparse message)")
    if version != VERSION:
        raise CodecError(f"unsupported version {version}, expected {VERSION}")
    if rsize != RECORD_SIZE:
        raise CodecError(f"header record size {rsize}, expected {RECORD_SIZE}")
    if total != n:
        kind = "truncated buffer" if n < total else "buffer length mismatch"
        raise CodecError(f"{kind}: header total length {total}, buffer has {n} bytes")
    data_start = HEADER_SIZE + RECORD_SIZE * nseg
    if data_start > n:
        raise CodecError(f"truncated buffer: {nseg} segment records need {data_start} bytes, "
                         f"buffer has {n}")
    out = []
    pos = data_start
    prev_layer = 0
    layer_numel = {}
    for s in range(nseg):
        (numel, doff, count, cap, layer, bs, qb, ienc, venc, reserved,
         *lens) = _RECORD.unpack_from(raw, HEADER_SIZE + RECORD_SIZE * s)
        where = f"segment {s} (layer {layer})"
        if layer >= nlayers:
            raise CodecError(f"segment {s}: layer index {layer} >= layer count {nlayers}")
        if layer < prev_layer:
            raise CodecError(f"segment {s}: layer index {layer} < previous segment's "
                             f"layer {prev_layer} (records must be in layer order)")
        prev_layer = layer
        if layer in layer_numel and layer_numel[layer] != numel:
            raise CodecError(f"{where}: numel {numel} != numel {layer_numel[layer]} of an "
                             f"earlier segment of the same layer")
        layer_numel[layer] = numel
        if reserved != 0:
            raise CodecError(f"{where}: reserved field is {reserved}, expected 0")
        ienc, venc, expected = _section_lengths(where, numel, cap, ienc, venc, bs, qb)
        names = ("indices", "bin_counts", "values", "scales")
        for name, got, exp in zip(names, lens, expected):
            if got != exp:
                raise CodecError(f"{where}: {name} section length {got} inconsistent with "
                                 f"capacity {cap} / numel {numel} / {ienc.name}+{venc.name}: "
                                 f"expected {exp}")
        if doff != pos:
            raise CodecError(f"{where}: data offset {doff}, expected {pos}")
        if count > cap:
            raise CodecError(f"{where}: count {count} > capacity {cap}")
        offs = []
        for ln in expected:
            offs.append(pos)
            pos += _align(ln)
        if pos > n:
            raise CodecError(f"truncated buffer: {where} data ends at byte {pos}, buffer has "
                             f"{n} bytes")
        il, bl, vl, sl = expected

        def view(i, dtype):
            if expected[i] == 0:
                return torch.empty(0, dtype=dtype)
            return buf[offs[i]:offs[i] + expected[i]].view(dtype)

        indices = None
        if ienc == IndexEncoding.INT32:
            indices = view(0, torch.int32)
        elif ienc == IndexEncoding.BIN_U8 or ienc == IndexEncoding.BITMASK:
            indices = view(0, torch.uint8)
        elif ienc == IndexEncoding.BIN_U16:
            indices = view(0, torch.int16)
        bin_counts = _widen_bin_counts(view(1, torch.uint8), bs) if ienc in _MAX_BIN \
            else None
        values = view(2, FLOAT_DTYPES.get(venc, torch.uint8))
        scales = view(3, torch.float32) if venc in QUANT_BITS or \
            venc == ValueEncoding.SIGN1 else None
        if check_content:
            _check_content(where, numel, count, ienc, indices, bin_counts, bs, cap)
        out.append(DecodedSegment(s, layer, numel, cap, count, ienc, venc, bs, qb,
                                  indices, bin_counts, values, scales))
    if pos != n:
        raise CodecError(f"buffer length mismatch: segments end at byte {pos}, header total "
                         f"{n}")
    return nlayers, out


# --------------------------------------------------------------------- decode helpers

def _slot_indices(sl: _SegLayout, ind: Optional[torch.Tensor], bc: Optional[torch.Tensor],
                  implicit: Optional[torch.Tensor], P: int, device,
                  count: Optional[torch.Tensor] = None, cnt: Optional[torch.Tensor] = None,
                  check_int32: bool = False, limits: Optional[torch.Tensor] = None):
    """``(idx, err)``: absolute int32 indices [P, capacity] of every slot, computed on the
    device (no host sync), and the content error codes int32 [P] of every row.

    ``count`` (int32 [P], as received) and ``cnt`` (the same clamped to [0, capacity])
    switch the content checks on (see the module doc); ``err`` is None without them.
    INT32 ranges are checked only with ``check_int32`` (the Triton kernel checks them
    itself). Slots that cannot be valid get the out-of-range index ``numel``.
    """
    C, N, ienc = sl.capacity, sl.numel, sl.ienc
    checks = cnt is not None
    err = None
    if ienc == IndexEncoding.DENSE:
        return cached_arange(C, torch.int32, device).expand(P, C), err
    if ienc in (IndexEncoding.INT32, IndexEncoding.IMPLICIT):
        if ienc == IndexEncoding.INT32:
            idx = ind
        else:
            if implicit is None:
                raise CodecError("IMPLICIT segment without implicit_indices in the template")
            if implicit.numel() != C:
                raise CodecError(f"implicit_indices has {implicit.numel()} elements, "
                                 f"expected capacity {C}")
            idx = implicit.reshape(1, -1).to(device=device)
            # the template's own indices: checked before the int32 cast can wrap them
            check_int32 = True
        if checks and check_int32:
            used = cached_arange(C, torch.int32, device) < cnt.unsqueeze(1)      # [P, C]
            bad = ((idx < 0) | (idx >= N)) & used
            err = bad.any(1).to(torch.int32) * ERR_INDEX
        if ienc == IndexEncoding.IMPLICIT:
            idx = idx.to(torch.int32).expand(P, C)
        return idx, err
    if ienc in _MAX_BIN:
        B, nb = sl.bin_size, sl.nbins
        if not checks and device.type == "cpu" and native.available() and \
                ind.stride(1) == 1 and bc.dtype == torch.int32 and bc.stride(1) == 1:
            # the validated CPU path: one compiled pass per row (the same rule as below)
            return native.bin_slot_indices(ind[:, :C], bc, B, N), err
        mask_bits = 0xFFFF if ienc == IndexEncoding.BIN_U16 else 0xFF
        rel = ind.to(torch.int32) & mask_bits                                    # [P, C]
        cum = bc.cumsum(1, dtype=torch.int64)                                    # [P, nb]
        slots = _slots(P, C, torch.int64, device)
        # bin of slot j = number of cumulative counts <= j
        if ops.use_triton(cum):
            # device: one launch (the launch count is what costs there)
            b = torch.searchsorted(cum, slots, right=True)                       # [P, C]
        else:
            # CPU path: a histogram of the cumulative counts over the slots (clamped to
            # [0, C]; C takes those past the last slot), summed up to j: O(nb + C)
            # where searchsorted is O(C log nb) (AdaComp decode of the wide MLP at P = 4
            # 18.9 -> 12.0 ms). The same count as searchsorted on every valid row
            # (sorted cum); on a malformed row (a negative bin count) both give some
            # index, and the row is rejected either way (bc_bad)
            hist = torch.zeros(P, C + 1, dtype=torch.int64, device=device)
            hist.scatter_add_(1, cum.clamp(0, C), _ones_like_int64(cum))
            b = hist[:, :C].cumsum(1)                                            # [P, C]
        a = b * B + rel
        bad = (rel >= B) | (a >= N)
        idx = torch.where(bad, N, a).to(torch.int32)
        if checks:
            total = cum[:, -1] if nb else torch.zeros_like(count, dtype=torch.int64)
            bc_bad = ((bc < 0) | (bc > limits)).any(1) | (total != count)
            rel_bad = (bad & (slots < cnt.unsqueeze(1))).any(1) & ~bc_bad
            err = bc_bad.to(torch.int32) * ERR_BIN_COUNTS | rel_bad.to(torch.int32) * ERR_INDEX
        return idx, err
    # BITMASK: slot k <- the k-th set bit, found as the first element whose inclusive
    # running popcount reaches k+1 (k >= popcount finds numel: out of range)
    nbits = 8 * sl.lengths[0]
    bits = ((ind.unsqueeze(-1) >> cached_arange(8, torch.uint8, device)) & 1).reshape(P, nbits)
    cum = bits[:, :N].cumsum(1, dtype=torch.int32)                                 # [P, N]
    if N and C:
        idx = torch.searchsorted(cum, _slots(P, C, torch.int32, device, start=1))
        idx = idx.to(torch.int32)
    else:
        idx = torch.full((P, C), N, dtype=torch.int32, device=device)
    if checks:
        pop = cum[:, -1] if N else torch.zeros_like(count)
        bm_bad = pop != count
        if nbits > N:
            bm_bad = bm_bad | bits[:, N:].any(1)
        err = bm_bad.to(torch.int32) * ERR_BITMASK
    return idx, err


def _scatter(dense: torch.Tensor, venc: ValueEncoding, capacity: int, quant_bucket: int,
             idx: torch.Tensor, count: torch.Tensor, values: torch.Tensor,
             scales: Optional[torch.Tensor], error_flag, ienc=None):
    """One batched ops.scatter_add_decode call (rows in rank order); all tensors have a
    leading P dim. A DENSE segment (slot j is element j: ``idx`` is ``arange``) of fp32
    or quantised values goes through ops.dense_add_decode (no index array read)."""
    if capacity == 0:
        return
    if ienc == IndexEncoding.DENSE and (venc == ValueEncoding.FP32 or venc in QUANT_BITS):
        if venc == ValueEncoding.FP32:
            ops.dense_add_decode(dense, count, capacity, values, error_flag=error_flag,
                                 indices=idx)
        else:
            ops.dense_add_decode(dense, count, capacity, codes=values, scales=scales,
                                 bits=QUANT_BITS[venc], bucket_size=quant_bucket,
                                 error_flag=error_flag, indices=idx)
        return
    if venc in FLOAT_DTYPES:
        ops.scatter_add_decode(dense, idx, count, values, error_flag=error_flag)
    elif venc in QUANT_BITS:
        ops.scatter_add_decode(dense, idx, count, codes=values, scales=scales,
                               bits=QUANT_BITS[venc], bucket_size=quant_bucket,
                               error_flag=error_flag)
    else:  # SIGN1
        ops.scatter_add_decode(dense, idx, count, signs=values, sign_scale=scales,
                               error_flag=error_flag)


#: index encodings the table-driven bucket decode handles (``kernels/bucket_decode.py``)
_BUCKET_DECODE_INDEX = (IndexEncoding.DENSE, IndexEncoding.INT32, IndexEncoding.BIN_U8,
                        IndexEncoding.BIN_U16, IndexEncoding.IMPLICIT)
_BUCKET_META = _LRU(512)     # (signature, device, out offsets) -> the kernel's meta


def _shared_out(flat_outs):
    """``(base, offsets)`` when every output is a slice of one storage (a bucket's flat
    sum): ``base`` is a 1-D view spanning them, ``offsets`` each one's element offset
    in it; else None."""
    if not flat_outs:
        return None
    st = flat_outs[0].untyped_storage().data_ptr()
    if any(o.untyped_storage().data_ptr() != st for o in flat_outs):
        return None
    lo = min(o.storage_offset() for o in flat_outs)
    hi = max(o.storage_offset() + o.numel() for o in flat_outs)
    base = flat_outs[0].as_strided((hi - lo,), (1,), lo)
    return base, tuple(o.storage_offset() - lo for o in flat_outs)


def _bucket_table(plan: _Plan, device, out_offs, imps):
    """The bucket decode's device table for this layout, output placement and IMPLICIT
    index addresses (built once from host ints, one host-to-device copy) and its meta."""
    key = (plan.sig, str(device), ("bucket_decode", out_offs, imps))
    ent = _DEVICE_BYTES.get_lru(key)
    meta = _BUCKET_META.get_lru(key)
    if ent is None or meta is None:
        rows = []
        for s, sl in enumerate(plan.segs):
            w = bin_count_width(sl.bin_size) if sl.ienc in _MAX_BIN else 0
            rows.append((out_offs[sl.layer], sl.layer, sl.numel, sl.capacity, int(sl.ienc),
                         int(sl.venc), sl.bin_size, sl.quant_bucket,
                         QUANT_BITS.get(sl.venc, 0), sl.offsets,
                         HEADER_SIZE + RECORD_SIZE * s + _COUNT_OFFSET, w, imps[s]))
        host, meta = ops.bucket_decode_table(rows)
        ent = _DEVICE_BYTES.put(key, _to_device(host.tobytes(), device))
        _BUCKET_META.put(key, meta)
    return ent.get().view(torch.int64), meta


def _bucket_accumulate(b2: torch.Tensor, plan: _Plan, flat_outs, error_flag, flat_segs,
                       counts_out=None):
    """validate=False on the Triton path, every segment DENSE / INT32 / BIN_* /
    IMPLICIT (int64 indices on the messages' device): one check launch + one scatter
    launch per rank and pass (:func:`ops.bucket_decode`); the same sums, error codes and
    zeroed contributions as the per-segment decode. Returns the per-(rank, segment)
    error table int32 [P, S], or None when not applicable (the caller then decodes per
    segment)."""
    if not plan.segs or any(sl.ienc not in _BUCKET_DECODE_INDEX for sl in plan.segs):
        return None
    shared = _shared_out(flat_outs)
    if shared is None:
        return None
    device = b2.device
    imps = []
    for sl, tseg in zip(plan.segs, flat_segs):
        if sl.ienc != IndexEncoding.IMPLICIT:
            imps.append(0)
            continue
        imp = tseg.implicit_indices
        if imp.dtype != torch.int64 or imp.device != device or not imp.is_contiguous():
            return None
        imps.append(imp.data_ptr() if imp.numel() else 0)
    base, out_offs = shared
    table, meta = _bucket_table(plan, device, out_offs, tuple(imps))
    _, err, _ = ops.bucket_decode(b2, base, table, meta, _plan_bytes(plan, device, "image"),
                                  _plan_bytes(plan, device, "mask"), plan.data_start,
                                  error_flag, counts_out=counts_out)
    return err


def _check_out(out, numel: int, what: str, device=None) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise CodecError(f"{what}: a {type(out).__name__}, expected a torch.Tensor")
    if out.dtype != torch.float32:
        raise CodecError(f"{what}: dtype {out.dtype}, expected torch.float32")
    if out.numel() != numel:
        raise CodecError(f"{what}: {out.numel()} elements, expected numel {numel}")
    if not out.is_contiguous():
        raise CodecError(f"{what}: must be contiguous")
    if device is not None and out.device != device:
        raise CodecError(f"{what}: on {out.device}, the messages are on {device}")
    return out.view(-1)


def _own_segments(payload: LayerPayload, dev):
    """Each segment of one rank's own payload, parsed for decoding without serialising:
    ``(idx, count, venc, cap, qb, vals, scales)`` with ``idx`` int32 [1, cap] (every
    slot's absolute index, ``_slot_indices``) and ``count`` int32 [1, 1]."""
    numel = payload.numel
    for s, seg in enumerate(payload.segments):
        where = f"{payload.name!r} segment {s}"
        n, cap, ienc, venc, bs, qb = _seg_params(seg)
        if n != numel:
            raise CodecError(f"{where}: segment numel {n} != layer numel {numel}")
        ienc, venc, lens = _section_lengths(where, n, cap, ienc, venc, bs, qb)
        sl = _SegLayout(0, n, cap, ienc, venc, bs, qb, lens, (0, 0, 0, 0))
        _segment_pieces(seg, sl, where, dev)
        count = _count_bytes(seg, where, dev).view(torch.int32).reshape(1, 1)
        ind = seg.indices.reshape(1, -1) if ienc not in (IndexEncoding.DENSE,
                                                          IndexEncoding.IMPLICIT) else None
        if ind is not None and ind.dtype == torch.uint16:
            ind = ind.view(torch.int16)
        bc = None
        if ienc in _MAX_BIN:
            bc = seg.bin_counts.reshape(1, -1) if seg.bin_counts is not None else \
                torch.zeros((1, 0), dtype=torch.int32, device=dev)
        idx, _ = _slot_indices(sl, ind, bc, seg.implicit_indices, 1, dev)
        vals = seg.values.reshape(1, -1)
        scales = seg.scales.reshape(1, -1) if seg.scales is not None and \
            venc not in FLOAT_DTYPES else None
        yield ienc, idx, count, venc, cap, qb, vals, scales


def _own_device(payload: LayerPayload, out=None) -> torch.device:
    return payload.segments[0].count.device if payload.segments else (
        out.device if out is not None else torch.device("cpu"))


def payload_to_dense(payload: LayerPayload, out: Optional[torch.Tensor] = None
                     ) -> torch.Tensor:
    """Dense fp32 tensor of ``payload.shape`` holding the sum of the payload's segments
    (one rank's own message, decoded without serialising). ``out`` is overwritten."""
    dev = _own_device(payload, out)
    if out is None:
        out = torch.zeros(tuple(payload.shape), dtype=torch.float32, device=dev)
    else:
        out.zero_()
    flat = _check_out(out, payload.numel, f"payload_to_dense out for {payload.name!r}")
    for ienc, idx, count, venc, cap, qb, vals, scales in _own_segments(payload, dev):
        _scatter(flat, venc, cap, qb, idx, count, vals, scales, None, ienc)
    return out


def sent_positions(payload: LayerPayload):
    """Which elements one rank's own payload sends, per segment, without decoding
    values: a list of ``(positions, count)`` where ``positions`` is int32 [capacity]
    (the absolute element index of every slot; ``arange`` for a DENSE segment) and
    ``count`` int32 [1]: the slots ``j < count`` are sent. On the device, no host sync
    (DGC's momentum masking uses it)."""
    dev = _own_device(payload)
    return [(idx.reshape(-1), count.reshape(1))
            for _, idx, count, *_ in _own_segments(payload, dev)]


def _rows(buffers, nbytes: int) -> torch.Tensor:
    """The P messages as one uint8 [P, nbytes] tensor whose rows start at multiples of 8
    bytes (so sections can be reinterpreted as int32 / fp32 in place); everything here
    is host-known (shapes, dtypes, devices), so it raises CodecError on both paths."""
    if isinstance(buffers, torch.Tensor):
        if buffers.dim() != 2:
            raise CodecError(f"accumulate: buffers must be [P, nbytes], got shape "
                             f"{tuple(buffers.shape)}")
        if buffers.dtype != torch.uint8:
            raise CodecError(f"accumulate: buffers dtype {buffers.dtype}, expected "
                             f"torch.uint8")
        b2 = buffers
    else:
        try:
            rows = list(buffers)
        except TypeError:
            raise CodecError(f"accumulate: buffers must be a uint8 [P, nbytes] tensor or a "
                             f"sequence of uint8 tensors, got {type(buffers).__name__}"
                             ) from None
        if not rows:
            raise CodecError("accumulate: no buffers")
        for r, b in enumerate(rows):
            if not isinstance(b, torch.Tensor):
                raise CodecError(f"accumulate: buffer of rank {r} is a {type(b).__name__}, "
                                 f"expected a uint8 torch.Tensor")
            if b.dtype != torch.uint8:
                raise CodecError(f"accumulate: buffer of rank {r} has dtype {b.dtype}, "
                                 f"expected torch.uint8")
            if b.dim() != 1 or b.numel() != nbytes:
                raise CodecError(f"accumulate: buffer of rank {r} has shape "
                                 f"{tuple(b.shape)}, expected ({nbytes},)")
            if b.device != rows[0].device:
                raise CodecError(f"accumulate: buffer of rank {r} on {b.device}, rank 0's "
                                 f"on {rows[0].device}")
        b2 = torch.stack(rows)
    if b2.shape[0] == 0:
        raise CodecError("accumulate: no messages (0 rows)")
    if b2.shape[1] != nbytes:
        raise CodecError(f"accumulate: messages are {b2.shape[1]} bytes, the template's "
                         f"layout needs {nbytes}")
    if b2.stride(1) != 1 or b2.stride(0) % _ALIGN or b2.storage_offset() % _ALIGN:
        b2 = torch.empty(b2.shape, dtype=torch.uint8, device=b2.device).copy_(b2)
    return b2


def _validate_rows(b2: torch.Tensor, plan: _Plan, template, flat_segs) -> None:
    """validate=True: host parse of every row (:func:`decode`) + comparison with the
    template's layout; CodecError naming the rank and the segment."""
    segs = plan.segs
    expected = [(sl.layer, sl.numel, sl.capacity, int(sl.ienc), int(sl.venc),
                 sl.bin_size, sl.quant_bucket) for sl in segs]
    fields = ("layer", "numel", "capacity", "index_encoding", "value_encoding", "bin_size",
              "quant_bucket")
    for r in range(b2.shape[0]):
        try:
            nlayers, dec = _decode(b2[r])
        except CodecError as exc:
            raise CodecError(f"message of rank {r}: {exc}") from None
        if nlayers != plan.nlayers:
            raise CodecError(f"message of rank {r}: header layer count {nlayers}, template "
                             f"has {plan.nlayers} layers")
        if len(dec) != len(segs):
            raise CodecError(f"message of rank {r}: {len(dec)} segments, template has "
                             f"{len(segs)}")
        for d, e in zip(dec, expected):
            if d.layout_key() != e:
                diff = [f"{f} {g} != {x}" for f, g, x in zip(fields, d.layout_key(), e)
                        if g != x]
                raise CodecError(f"message of rank {r} segment {d.segment}: layout differs "
                                 f"from the template: {', '.join(diff)}")
    # the template's own IMPLICIT indices (they never travel) must lie in their layer
    for s, (sl, tseg) in enumerate(zip(segs, flat_segs)):
        if sl.ienc == IndexEncoding.IMPLICIT and sl.capacity:
            a = tseg.implicit_indices.detach().reshape(-1).to("cpu", torch.int64)
            if bool(((a < 0) | (a >= sl.numel)).any()):
                raise CodecError(f"template segment {s} (layer {sl.layer}): implicit_indices "
                                 f"outside [0, {sl.numel})")


def accumulate(buffers: Union[torch.Tensor, Sequence[torch.Tensor]],
               template: Sequence[LayerPayload], outs: Sequence[torch.Tensor],
               validate: bool = True, *, error_flag: Optional[torch.Tensor] = None,
               counts_out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Add the decoded values of P ranks' messages into ``outs`` (summed over ranks).

    ``buffers``: uint8 [P, nbytes] (allgathered equal-size messages) or a list of P
    uint8 [nbytes] tensors (stacked into one). ``template``: this rank's payload list
    (its layout is the layout of every message; IMPLICIT indices come from it).
    ``outs``: one contiguous fp32 tensor per layer with the layer's numel, on the
    messages' device; added to. Per segment, rank rows are added in rank order (see the
    module doc), so all ranks get bitwise identical sums.

    Wrong Python types, dtypes, shapes, devices or message lengths (all host-known)
    raise :class:`CodecError` in both modes. Then:

    ``validate=True``: every message is parsed on the host (:func:`decode`) and must
    match the template's layout, else CodecError naming rank and segment; nothing is
    written in that case.

    ``validate=False`` (CUDA, no host sync): the layout comes from the template; every
    message is checked on the device against the same rules (header bytes, counts,
    bin counts, bitmasks, index ranges) and problems are ORed into ``error_flag``
    (int32[>= 1], contiguous, on the messages' device; codes in :data:`ERROR_CODES`);
    a bad (rank, segment) contributes nothing. With ``error_flag=None`` a flag is made
    here and read once at the end (a host sync on CUDA), raising CodecError naming the
    first bad rank and segment.

    ``counts_out`` (contiguous int32 with P x S elements, S the template's segment
    count, on the messages' device): receives every message's count fields as sent
    (u32 read as int32, row r = rank r, record order), read from the same bytes on
    every rank; on the bucket decode's path the check launch writes them.

    Returns ``error_flag`` (validate=True: as passed).
    """
    plan = _plan(template)
    segs, total = plan.segs, plan.total
    b2 = _rows(buffers, total)
    P, device = b2.shape[0], b2.device
    if isinstance(outs, torch.Tensor):
        raise CodecError(f"accumulate: outs must be a sequence of {len(template)} tensors "
                         f"(one per layer), got a tensor")
    outs = list(outs)
    if len(outs) != len(template):
        raise CodecError(f"accumulate: outs must be a sequence of {len(template)} tensors "
                         f"(one per layer), got {len(outs)}")
    flat_outs = [_check_out(o, p.numel, f"accumulate outs[{i}] ({p.name!r})", device)
                 for i, (o, p) in enumerate(zip(outs, template))]
    if error_flag is not None:
        if not isinstance(error_flag, torch.Tensor) or error_flag.dtype != torch.int32 or \
                error_flag.numel() < 1 or not error_flag.is_contiguous() or \
                error_flag.device != device:
            raise CodecError(f"accumulate: error_flag must be a contiguous int32 tensor with "
                             f">= 1 element on {device}")
    flat_segs = [seg for p in template for seg in p.segments]
    for s, (sl, tseg) in enumerate(zip(segs, flat_segs)):
        # host-known template fields, checked before anything is written
        if sl.ienc == IndexEncoding.IMPLICIT:
            imp = tseg.implicit_indices
            if not isinstance(imp, torch.Tensor) or imp.numel() != sl.capacity:
                raise CodecError(f"template segment {s} (layer {sl.layer}): IMPLICIT needs "
                                 f"implicit_indices with capacity {sl.capacity} elements, "
                                 f"got {None if imp is None else tuple(imp.shape)}")
    if counts_out is not None:
        if not isinstance(counts_out, torch.Tensor) or counts_out.dtype != torch.int32 or \
                not counts_out.is_contiguous() or counts_out.numel() != P * len(segs) or \
                counts_out.device != device:
            raise CodecError(f"accumulate: counts_out must be a contiguous int32 tensor of "
                             f"{P} x {len(segs)} elements on {device}")
    own_flag = False
    if validate:
        _validate_rows(b2, plan, template, flat_segs)
    else:
        if error_flag is None:
            error_flag = torch.zeros(1, dtype=torch.int32, device=device)
            own_flag = True
        if ops.use_triton(flat_outs[0] if flat_outs else None):
            err = _bucket_accumulate(b2, plan, flat_outs, error_flag, flat_segs, counts_out)
            if err is not None:
                if own_flag:
                    _raise_flag(error_flag, [(s, sl.layer, err[:, s])
                                             for s, sl in enumerate(segs)])
                return error_flag
        # header + records must equal this rank's, except the count fields
        hdr = b2[:, :plan.data_start]
        row_hdr = ((hdr & _plan_bytes(plan, device, "mask")) !=
                   _plan_bytes(plan, device, "image")).any(1).to(torch.int32) * ERR_HEADER
        row_err = row_hdr
        seg_errs = []
    if counts_out is not None:
        _read_counts(b2, len(segs), counts_out)
    for s, (sl, tseg) in enumerate(zip(segs, flat_segs)):
        rec = HEADER_SIZE + RECORD_SIZE * s + _COUNT_OFFSET
        # u32 on the wire, read as int32: a corrupt count >= 2^31 reads negative
        count = b2[:, rec:rec + 4].view(torch.int32)                          # [P, 1]
        (oi, ob, ov, osc), (il, bl, vl, scl) = sl.offsets, sl.lengths
        ind = None
        if sl.ienc == IndexEncoding.INT32:
            ind = b2[:, oi:oi + il].view(torch.int32)
        elif sl.ienc in (IndexEncoding.BIN_U8, IndexEncoding.BITMASK):
            ind = b2[:, oi:oi + il]
        elif sl.ienc == IndexEncoding.BIN_U16:
            ind = b2[:, oi:oi + il].view(torch.int16)
        bc = _widen_bin_counts(b2[:, ob:ob + bl], sl.bin_size) if sl.ienc in _MAX_BIN \
            else None
        dense = flat_outs[sl.layer]
        if validate:
            idx, _ = _slot_indices(sl, ind, bc, tseg.implicit_indices, P, device)
        else:
            c = count[:, 0]
            cnt = c.clamp(0, sl.capacity)
            limits = _bin_limits(plan, s, sl, device) if sl.ienc in _MAX_BIN else None
            idx, err = _slot_indices(sl, ind, bc, tseg.implicit_indices, P, device,
                                     count=c, cnt=cnt,
                                     check_int32=not ops.use_triton(dense), limits=limits)
            c_bad = (c < 0) | (c > sl.capacity)
            seg_err = c_bad.to(torch.int32) * ERR_COUNT
            if err is not None:
                # content checks ran on the clamped count: meaningless if it was bad
                seg_err = torch.where(c_bad, seg_err, err)
            seg_err = seg_err | row_hdr
            # a (rank, segment) with any problem contributes nothing
            count = torch.where(seg_err != 0, 0, c).unsqueeze(1)
            row_err = row_err | seg_err
            if own_flag:
                seg_errs.append((s, sl.layer, seg_err))
        vals = b2[:, ov:ov + vl].view(FLOAT_DTYPES.get(sl.venc, torch.uint8))
        scales = b2[:, osc:osc + scl].view(torch.float32) if scl else None
        _scatter(dense, sl.venc, sl.capacity, sl.quant_bucket, idx, count, vals, scales,
                 error_flag, sl.ienc)
    if not validate:
        bits = _code_bits(device)
        present = ((row_err.unsqueeze(1) & bits) != 0).any(0)
        error_flag.view(-1)[:1].bitwise_or_((present.to(torch.int32) * bits).sum()
                                            .to(torch.int32))
        if own_flag:
            _raise_flag(error_flag, seg_errs)
    return error_flag


def _read_counts(b2: torch.Tensor, nseg: int, counts_out: torch.Tensor) -> None:
    """``counts_out`` (int32, P x nseg) <- every row's count fields: one strided copy."""
    if nseg == 0:
        return
    P = b2.shape[0]
    lo = HEADER_SIZE + _COUNT_OFFSET
    # the 4 count bytes of each record, as one strided view (the last record's count may
    # end fewer than RECORD_SIZE bytes before the row does)
    assert b2.stride(1) == 1 and lo + RECORD_SIZE * (nseg - 1) + 4 <= b2.shape[1]
    src = b2.as_strided((P, nseg, 4), (b2.stride(0), RECORD_SIZE, 1),
                        b2.storage_offset() + lo)
    counts_out.view(P, nseg, 1).view(torch.uint8).copy_(src)


def _raise_flag(error_flag: torch.Tensor, seg_errs) -> None:
    """accumulate(validate=False) with its own flag: read it (the one documented host
    read) and raise CodecError naming the first bad segment and rank."""
    code = int(error_flag.view(-1)[0])
    if code:
        where = ""
        for s, layer, e in seg_errs:
            rows = [r for r, v in enumerate(e.tolist()) if v]
            if rows:
                where = (f"message of rank {rows[0]} segment {s} (layer {layer}): "
                         f"{describe_error(e[rows[0]])}; ")
                break
        raise CodecError(f"accumulate(validate=False): {where}error flag {code} = "
                         f"{describe_error(code)}")
