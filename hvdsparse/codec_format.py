"""Wire format: one flat ``uint8`` tensor per message (a bucket of layers).

This module is the format itself: the header and record layouts, the section lengths of
every encoding, the validity rules and error codes, and the *layout plan* of a payload
list (everything host-known about its message, computed once per layout signature and
cached, with the header image and count mask cached on each device). The encoder is
``codec_encode.py``, the host decoder ``codec_decode.py``, the device decode
``codec_slots.py`` and ``codec_accumulate.py``; :mod:`hvdsparse.codec` gathers them, and
the functions named below (:func:`encode`, :func:`decode`, :func:`accumulate`) are its.

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
values in the same order (``codec_encode._Narrowing``, a fixed number of device ops per message,
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
"""
from __future__ import annotations

import struct
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from .payload import (FLOAT_BYTES, QUANT_BITS, IndexEncoding, LayerPayload, Segment,
                      ValueEncoding, bin_count_width, wire_indexing)

assert sys.byteorder == "little", "hvdsparse wire format assumes a little-endian host"


MAGIC = b"HVSP"
VERSION = 2
HEADER_STRUCT = struct.Struct("<4sHHIIQ")
RECORD_STRUCT = struct.Struct("<QQIIIIIBBHQQQQ")
HEADER_SIZE = HEADER_STRUCT.size          # 24
RECORD_SIZE = RECORD_STRUCT.size          # 72
COUNT_OFFSET = 16                  # of the count field inside a record
ALIGN = 8
_U32_MAX = 2 ** 32 - 1
_I32_MAX = 2 ** 31 - 1
MAX_BIN = {IndexEncoding.BIN_U8: 256, IndexEncoding.BIN_U16: 65536}


BIN_COUNT_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def widen_bin_counts(raw: torch.Tensor, bin_size: int) -> torch.Tensor:
    """Wire bytes (uint8 [..., w * nbins]) -> int32 counts (uint16 read unsigned)."""
    w = bin_count_width(bin_size)
    c = raw.view(BIN_COUNT_DTYPE[w]).to(torch.int32)
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


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class LRU(OrderedDict):
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
class SegLayout:
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


def section_lengths(where: str, numel: int, capacity: int, ienc, venc, bin_size: int,
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
    if ienc in MAX_BIN:
        if not 1 <= bin_size <= MAX_BIN[ienc]:
            raise CodecError(f"{where}: bin_size {bin_size} invalid for {ienc.name} "
                             f"(expected 1..{MAX_BIN[ienc]})")
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


def seg_params(seg: Segment):
    """Host-known fields of a segment as plain ints (encodings checked later, by
    :func:`section_lengths`, which names the segment)."""
    ienc, venc = int(seg.index_encoding), int(seg.value_encoding)
    bin_size = int(seg.bin_size) if ienc in MAX_BIN else 0
    qb = int(seg.quant_bucket) if venc in QUANT_BITS else 0
    return int(seg.numel), int(seg.capacity), ienc, venc, bin_size, qb


def _wire_params(seg: Segment):
    """:func:`seg_params` as the segment travels (:func:`payload.wire_indexing`), plus
    whether its INT32 indices are narrowed to BIN_U16 on the way."""
    numel, cap, ienc, venc, bs, qb = seg_params(seg)
    wienc, wbs = wire_indexing(seg) if ienc == IndexEncoding.INT32 else (ienc, bs)
    narrowed = wienc != ienc
    return numel, cap, int(wienc), venc, (wbs if narrowed else bs), qb, narrowed


def segment_layouts(payloads: Sequence[LayerPayload]):
    """(list[SegLayout], data_start, total_nbytes) from host-known fields only."""
    plan = layout_plan(payloads)
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
            ienc, venc, lengths = section_lengths(where, numel, cap, ienc, venc, bs, qb)
            offsets = []
            for ln in lengths:
                offsets.append(pos)
                pos += align(ln)
            segs.append(SegLayout(li, numel, cap, ienc, venc, bs, qb, lengths,
                                   tuple(offsets), narrowed))
            s += 1
    return segs, HEADER_SIZE + RECORD_SIZE * nseg, pos


@dataclass(frozen=True)
class LayoutPlan:
    """Everything host-known about one layout, computed once per layout signature."""

    sig: tuple
    segs: tuple              # of SegLayout
    nlayers: int
    data_start: int          # end of the records
    total: int               # message length
    header: bytes            # header + records with every count field 0
    narrowed: bool = False   # some segment's INT32 indices travel as BIN_U16


_PLANS = LRU(1024)          # layout signature -> LayoutPlan
DEVICE_BYTES = LRU(512)    # (signature, device, kind) -> _DeviceBytes


def layout_plan(payloads: Sequence[LayerPayload]) -> LayoutPlan:
    sig = _plan_key(payloads)
    plan = _PLANS.get_lru(sig)
    if plan is not None:
        return plan
    segs, data_start, total = _layout_uncached(payloads)
    raw = bytearray(data_start)
    HEADER_STRUCT.pack_into(raw, 0, MAGIC, VERSION, RECORD_SIZE, len(payloads), len(segs), total)
    for s, sl in enumerate(segs):
        RECORD_STRUCT.pack_into(raw, HEADER_SIZE + RECORD_SIZE * s, sl.numel, sl.offsets[0], 0,
                          sl.capacity, sl.layer, sl.bin_size, sl.quant_bucket, int(sl.ienc),
                          int(sl.venc), 0, *sl.lengths)
    return _PLANS.put(sig, LayoutPlan(sig, tuple(segs), len(payloads), data_start, total,
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


def to_device(raw: bytes, device: torch.device) -> _DeviceBytes:
    return _DeviceBytes(raw, device)


def plan_bytes(plan: LayoutPlan, device: torch.device, kind: str) -> torch.Tensor:
    """Cached device copy of a per-layout byte string: ``"image"`` (header + records,
    counts 0) or ``"mask"`` (0xFF everywhere except 0 on the count fields)."""
    key = (plan.sig, str(device), kind)
    ent = DEVICE_BYTES.get_lru(key)
    if ent is None:
        if kind == "image":
            raw = plan.header
        else:
            m = bytearray(b"\xff" * plan.data_start)
            for s in range(len(plan.segs)):
                rec = HEADER_SIZE + RECORD_SIZE * s + COUNT_OFFSET
                m[rec:rec + 4] = b"\0\0\0\0"
            raw = bytes(m)
        ent = DEVICE_BYTES.put(key, to_device(raw, device))
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
    return layout_plan(payloads).total
