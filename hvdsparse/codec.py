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
4         2      u16     version (currently 1)
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
                   bin counts ``4*ceil(N/B)``  int32 slots per bin (``1 <= B <= 256``)
BIN_U16            indices ``2*C``          uint16 bin-relative index per slot
                   bin counts ``4*ceil(N/B)``  int32 slots per bin (``1 <= B <= 65536``)
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

Slot semantics: slots ``j < count`` are used, the rest is padding (copied verbatim,
content unspecified, ignored by decoders). BIN_*: slots are sorted by bin, bin ``k``
owns ``bin_counts[k]`` consecutive slots, so the absolute index of slot j is
``bin(j) * B + rel[j]`` with ``bin(j)`` found by a search in the cumulative bin counts;
``sum(bin_counts) == count`` and ``bin_counts[k] <= min(B, N - k*B)``.
BITMASK: the value of the k-th set bit (ascending element order) is slot k;
``popcount == count``.

Validation
----------

:func:`decode` parses on the host and validates everything (magic, version, lengths
against capacity/encodings, offsets, counts, encoding codes, bin counts, index ranges,
bitmask popcount, layer numel consistency); any problem raises :class:`CodecError`
naming the field, the segment and what was expected. It never reads outside the buffer.

:func:`accumulate` with ``validate=True`` runs that host parse on every rank's message
(cheap on CPU; on CUDA it costs a device->host copy and synchronisation) and checks each
message's layout against the local template. With ``validate=False`` (the CUDA path)
nothing is read on the host: the layout is computed from the template (identical on all
ranks by construction: capacities depend only on the layer sizes and settings) and only
the device-side ``count`` fields and sections are used. Corrupted indices then surface
through ``ops.scatter_add_decode``'s bounds check (IndexError on the reference path,
``error_flag`` set by the Triton kernel, to be checked by the caller where it already
synchronises; a count outside [0, capacity] is a ValueError / flag 2). Malformed BIN
bin counts or relative indices ``>= B`` and BITMASK slots without a set bit are mapped to
the out-of-range index ``numel`` so that the bounds check reports them.
"""
from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import numpy as np
import torch

from . import ops
from .payload import (FLOAT_BYTES, FLOAT_DTYPES, QUANT_BITS, IndexEncoding, LayerPayload,
                      Segment, ValueEncoding)

assert sys.byteorder == "little", "hvdsparse wire format assumes a little-endian host"

__all__ = ["CodecError", "DecodedSegment", "MAGIC", "VERSION", "HEADER_SIZE", "RECORD_SIZE",
           "encoded_nbytes", "encode", "decode", "accumulate", "payload_to_dense",
           "layout_signature"]

MAGIC = b"HVSP"
VERSION = 1
_HEADER = struct.Struct("<4sHHIIQ")
_RECORD = struct.Struct("<QQIIIIIBBHQQQQ")
HEADER_SIZE = _HEADER.size          # 24
RECORD_SIZE = _RECORD.size          # 72
_COUNT_OFFSET = 16                  # of the count field inside a record
_ALIGN = 8
_U32_MAX = 2 ** 32 - 1
_I32_MAX = 2 ** 31 - 1
_MAX_BIN = {IndexEncoding.BIN_U8: 256, IndexEncoding.BIN_U16: 65536}

assert HEADER_SIZE == 24 and RECORD_SIZE == 72


class CodecError(ValueError):
    """A message or payload does not follow the wire format (see module docstring)."""


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    bl = 4 * bins
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
    ienc = IndexEncoding(int(seg.index_encoding))
    venc = ValueEncoding(int(seg.value_encoding))
    bin_size = int(seg.bin_size) if ienc in _MAX_BIN else 0
    qb = int(seg.quant_bucket) if venc in QUANT_BITS else 0
    return int(seg.numel), int(seg.capacity), ienc, venc, bin_size, qb


def _layout(payloads: Sequence[LayerPayload]):
    """(list[_SegLayout], data_start, total_nbytes) from host-known fields only."""
    segs = []
    nseg = sum(len(p.segments) for p in payloads)
    pos = HEADER_SIZE + RECORD_SIZE * nseg
    s = 0
    for li, p in enumerate(payloads):
        lnumel = p.numel
        for seg in p.segments:
            where = f"layer {li} ({p.name!r}) segment {s}"
            numel, cap, ienc, venc, bs, qb = _seg_params(seg)
            if numel != lnumel:
                raise CodecError(f"{where}: segment numel {numel} != layer numel {lnumel} "
                                 f"(shape {tuple(p.shape)})")
            ienc, venc, lengths = _section_lengths(where, numel, cap, ienc, venc, bs, qb)
            offsets = []
            for ln in lengths:
                offsets.append(pos)
                pos += _align(ln)
            segs.append(_SegLayout(li, numel, cap, ienc, venc, bs, qb, lengths,
                                   tuple(offsets)))
            s += 1
    return segs, HEADER_SIZE + RECORD_SIZE * nseg, pos


def layout_signature(payloads: Sequence[LayerPayload]) -> tuple:
    """Hashable description of the wire layout: per layer ``(numel, segments)`` with
    per segment ``(numel, capacity, index_encoding, value_encoding, bin_size,
    quant_bucket)`` (bin_size / quant_bucket 0 where the encoding does not use them).
    Two payload lists with equal signatures encode to messages of equal length and
    identical section offsets."""
    return tuple(
        (p.numel, tuple((n, c, int(i), int(v), b, q)
                        for n, c, i, v, b, q in map(_seg_params, p.segments)))
        for p in payloads)


def encoded_nbytes(payloads: Sequence[LayerPayload]) -> int:
    """Length in bytes of ``encode(payloads)``; uses capacities and encodings only."""
    return _layout(payloads)[2]


# --------------------------------------------------------------------------- encode

_STATIC_CACHE: dict = {}
_ZEROS_CACHE: dict = {}
_CACHE_MAX = 256


def _static_image(payloads, segs, data_start, total, device) -> torch.Tensor:
    """Header + records (count fields 0) as a uint8 tensor on ``device``, cached per
    layout and device so that encoding only copies device memory."""
    key = (layout_signature(payloads), str(device))
    img = _STATIC_CACHE.get(key)
    if img is not None:
        return img
    raw = bytearray(data_start)
    _HEADER.pack_into(raw, 0, MAGIC, VERSION, RECORD_SIZE, len(payloads), len(segs), total)
    for s, sl in enumerate(segs):
        _RECORD.pack_into(raw, HEADER_SIZE + RECORD_SIZE * s, sl.numel, sl.offsets[0], 0,
                          sl.capacity, sl.layer, sl.bin_size, sl.quant_bucket, int(sl.ienc),
                          int(sl.venc), 0, *sl.lengths)
    img = torch.frombuffer(raw, dtype=torch.uint8).clone().to(device)
    if len(_STATIC_CACHE) >= _CACHE_MAX:
        _STATIC_CACHE.clear()
    _STATIC_CACHE[key] = img
    return img


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
        pieces[1] = _as_bytes(seg.bin_counts, where, "bin_counts", (torch.int32,),
                              sl.nbins, device)
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


def encode(payloads: Sequence[LayerPayload], out: Optional[torch.Tensor] = None
           ) -> torch.Tensor:
    """Serialise ``payloads`` into one uint8 message on the payloads' device.

    Everything host-known (header, records) comes from a cached device image; counts
    and sections are copied with tensor operations (one ``torch.cat`` into ``out``), so
    nothing synchronises with the host. Padding bytes are zero; padding *slots*
    (``>= count``) are copied verbatim. ``out`` (uint8, ``encoded_nbytes(payloads)``
    elements, contiguous) is filled and returned when given.
    """
    segs, data_start, total = _layout(payloads)
    device = None
    for p in payloads:
        for seg in p.segments:
            device = seg.count.device
            break
        if device is not None:
            break
    if out is not None:
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != total \
                or not out.is_contiguous():
            raise CodecError(f"encode: out must be a contiguous 1-D uint8 tensor of {total} "
                             f"bytes, got {out.dtype} shape {tuple(out.shape)}")
        if device is not None and out.device != device:
            raise CodecError(f"encode: out on {out.device}, payloads on {device}")
        device = out.device
    if device is None:
        device = torch.device("cpu")
    img = _static_image(payloads, segs, data_start, total, device)
    zeros = _zeros(device)
    pieces = []
    pos = 0
    s = 0
    flat_segs = [(li, p, seg) for li, p in enumerate(payloads) for seg in p.segments]
    for s, (li, p, seg) in enumerate(flat_segs):
        where = f"layer {li} ({p.name!r}) segment {s}"
        rec = HEADER_SIZE + RECORD_SIZE * s + _COUNT_OFFSET
        pieces.append(img[pos:rec])
        pieces.append(_count_bytes(seg, where, device))
        pos = rec + 4
    pieces.append(img[pos:data_start])
    for s, (li, p, seg) in enumerate(flat_segs):
        where = f"layer {li} ({p.name!r}) segment {s}"
        sl = segs[s]
        for piece, ln in zip(_segment_pieces(seg, sl, where, device), sl.lengths):
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
    return buffer.detach().to("cpu").contiguous()


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
            rel = rel.astype(np.int64) & (0xFFFF if ienc == IndexEncoding.BIN_U16 else 0xFF)
            bins = np.repeat(np.arange(nbins, dtype=np.int64), bc)
            absidx = bins * bin_size + rel
            bad = np.nonzero((rel >= bin_size) | (absidx >= sl_numel))[0]
            if bad.size:
                j = int(bad[0])
                raise CodecError(f"{where}: index out of range: slot {j} has bin-relative "
                                 f"index {int(rel[j])} in bin {int(bins[j])} (bin size "
                                 f"{bin_size}, absolute {int(absidx[j])}, numel {sl_numel})")
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
        bin_counts = view(1, torch.int32) if ienc in _MAX_BIN else None
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
    return out


# --------------------------------------------------------------------- decode helpers

def _abs_indices(ienc: IndexEncoding, numel: int, capacity: int, bin_size: int,
                 indices: Optional[torch.Tensor], bin_counts: Optional[torch.Tensor],
                 implicit: Optional[torch.Tensor], P: int, device) -> torch.Tensor:
    """Absolute int32 indices [P, capacity] of every slot, device-side (no host sync).

    Slots that cannot be valid get the out-of-range index ``numel`` (beyond the used
    slots they are ignored; within them the bounds check of scatter_add_decode
    reports them).
    """
    if ienc == IndexEncoding.DENSE:
        return torch.arange(capacity, dtype=torch.int32, device=device).expand(P, capacity)
    if ienc == IndexEncoding.INT32:
        return indices
    if ienc == IndexEncoding.IMPLICIT:
        if implicit is None:
            raise CodecError("IMPLICIT segment without implicit_indices in the template")
        if implicit.numel() != capacity:
            raise CodecError(f"implicit_indices has {implicit.numel()} elements, expected "
                             f"capacity {capacity}")
        imp = implicit.reshape(1, -1).to(device=device, dtype=torch.int32)
        return imp.expand(P, capacity)
    if ienc in _MAX_BIN:
        mask_bits = 0xFFFF if ienc == IndexEncoding.BIN_U16 else 0xFF
        rel = indices.to(torch.int32) & mask_bits                     # [P, C]
        cum = bin_counts.to(torch.int64).cumsum(1).contiguous()        # [P, nbins]
        slots = torch.arange(capacity, dtype=torch.int64, device=device)
        slots = slots.expand(P, capacity).contiguous()
        if cum.shape[1] == 0:
            return torch.full((P, capacity), numel, dtype=torch.int32, device=device)
        b = torch.searchsorted(cum, slots, right=True)                 # [P, C] int64
        a = b * bin_size + rel
        bad = (rel >= bin_size) | (a > numel)
        a = torch.where(bad, torch.full_like(a, numel), a)
        return a.to(torch.int32)
    # BITMASK: slot k <- k-th set bit
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    bits = ((indices.unsqueeze(-1) >> shifts) & 1).reshape(P, -1)[:, :numel]   # [P, N]
    pos = bits.to(torch.int64).cumsum(1) - 1
    slot = torch.where(bits.bool(), pos.clamp(max=capacity), torch.full_like(pos, capacity))
    idx = torch.full((P, capacity + 1), numel, dtype=torch.int32, device=device)
    elem = torch.arange(numel, dtype=torch.int32, device=device).expand(P, numel)
    idx.scatter_(1, slot, elem)
    return idx[:, :capacity]


def _scatter(dense: torch.Tensor, venc: ValueEncoding, capacity: int, quant_bucket: int,
             idx: torch.Tensor, count: torch.Tensor, values: torch.Tensor,
             scales: Optional[torch.Tensor], error_flag):
    """One batched ops.scatter_add_decode call; all tensors have a leading P dim."""
    if capacity == 0:
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


def _check_out(out: torch.Tensor, numel: int, what: str) -> torch.Tensor:
    if out.dtype != torch.float32:
        raise CodecError(f"{what}: dtype {out.dtype}, expected torch.float32")
    if out.numel() != numel:
        raise CodecError(f"{what}: {out.numel()} elements, expected numel {numel}")
    if not out.is_contiguous():
        raise CodecError(f"{what}: must be contiguous")
    return out.view(-1)


def payload_to_dense(payload: LayerPayload, out: Optional[torch.Tensor] = None
                     ) -> torch.Tensor:
    """Dense fp32 tensor of ``payload.shape`` holding the sum of the payload's segments
    (one rank's own message, decoded without serialising). ``out`` is overwritten."""
    numel = payload.numel
    dev = payload.segments[0].count.device if payload.segments else (
        out.device if out is not None else torch.device("cpu"))
    if out is None:
        out = torch.zeros(tuple(payload.shape), dtype=torch.float32, device=dev)
    else:
        out.zero_()
    flat = _check_out(out, numel, f"payload_to_dense out for {payload.name!r}")
    for s, seg in enumerate(payload.segments):
        where = f"{payload.name!r} segment {s}"
        n, cap, ienc, venc, bs, qb = _seg_params(seg)
        if n != numel:
            raise CodecError(f"{where}: segment numel {n} != layer numel {numel}")
        _, _, lens = _section_lengths(where, n, cap, ienc, venc, bs, qb)
        pieces = _segment_pieces(seg, _SegLayout(0, n, cap, ienc, venc, bs, qb, lens,
                                                 (0, 0, 0, 0)), where, dev)
        count = _count_bytes(seg, where, dev).view(torch.int32).reshape(1, 1)
        ind = seg.indices.reshape(1, -1) if ienc not in (IndexEncoding.DENSE,
                                                          IndexEncoding.IMPLICIT) else None
        if ind is not None and ind.dtype == torch.uint16:
            ind = ind.view(torch.int16)
        bc = seg.bin_counts.reshape(1, -1) if ienc in _MAX_BIN else None
        idx = _abs_indices(ienc, n, cap, bs, ind, bc, seg.implicit_indices, 1, dev)
        vals = seg.values.reshape(1, -1)
        scales = seg.scales.reshape(1, -1) if seg.scales is not None and \
            venc not in FLOAT_DTYPES else None
        _scatter(flat, venc, cap, qb, idx, count, vals, scales, None)
    return out


def _rows(buffers, nbytes: int) -> torch.Tensor:
    if isinstance(buffers, torch.Tensor):
        if buffers.dim() != 2:
            raise CodecError(f"accumulate: buffers must be [P, nbytes], got shape "
                             f"{tuple(buffers.shape)}")
        b2 = buffers
    else:
        buffers = list(buffers)
        if not buffers:
            raise CodecError("accumulate: no buffers")
        for r, b in enumerate(buffers):
            if b.dim() != 1 or b.numel() != nbytes:
                raise CodecError(f"accumulate: buffer of rank {r} has shape "
                                 f"{tuple(b.shape)}, expected ({nbytes},)")
        b2 = torch.stack([b.reshape(-1) for b in buffers])
    if b2.dtype != torch.uint8:
        raise CodecError(f"accumulate: buffers dtype {b2.dtype}, expected torch.uint8")
    if b2.shape[1] != nbytes:
        raise CodecError(f"accumulate: messages are {b2.shape[1]} bytes, the template's "
                         f"layout needs {nbytes}")
    if b2.stride(1) != 1 or b2.stride(0) % _ALIGN:
        b2 = b2.contiguous()
    return b2


def accumulate(buffers: Union[torch.Tensor, Sequence[torch.Tensor]],
               template: Sequence[LayerPayload], outs: Sequence[torch.Tensor],
               validate: bool = True, *, error_flag: Optional[torch.Tensor] = None) -> None:
    """Add the decoded values of P ranks' messages into ``outs`` (summed over ranks).

    ``buffers``: uint8 [P, nbytes] (allgathered equal-size messages) or a list of P
    uint8 [nbytes] tensors (stacked into one). ``template``: this rank's payload list
    (its layout is the layout of every message; IMPLICIT indices come from it).
    ``outs``: one contiguous fp32 tensor per layer with the layer's numel; added to.

    ``validate=True``: every message is parsed on the host (:func:`decode`) and must
    match the template's layout, else :class:`CodecError` (naming rank and segment).
    ``validate=False`` (CUDA, no host sync): the layout is taken from the template and
    bad indices are caught by ``ops.scatter_add_decode`` (IndexError from the reference,
    ``error_flag`` from the Triton kernel). One scatter call per segment covers all P.
    """
    segs, _, total = _layout(template)
    if len(outs) != len(template):
        raise CodecError(f"accumulate: {len(outs)} output tensors for {len(template)} layers")
    flat_outs = [_check_out(o, p.numel, f"accumulate outs[{i}] ({p.name!r})")
                 for i, (o, p) in enumerate(zip(outs, template))]
    b2 = _rows(buffers, total)
    P = b2.shape[0]
    device = b2.device
    if validate:
        expected = [(sl.layer, sl.numel, sl.capacity, int(sl.ienc), int(sl.venc),
                     sl.bin_size, sl.quant_bucket) for sl in segs]
        for r in range(P):
            try:
                dec = decode(b2[r])
            except CodecError as exc:
                raise CodecError(f"message of rank {r}: {exc}") from None
            if len(dec) != len(segs):
                raise CodecError(f"message of rank {r}: {len(dec)} segments, template has "
                                 f"{len(segs)}")
            for d, e in zip(dec, expected):
                if d.layout_key() != e:
                    fields = ("layer", "numel", "capacity", "index_encoding",
                              "value_encoding", "bin_size", "quant_bucket")
                    diff = [f"{f} {g} != {x}" for f, g, x in zip(fields, d.layout_key(), e)
                            if g != x]
                    raise CodecError(f"message of rank {r} segment {d.segment}: layout differs "
                                     f"from the template: {', '.join(diff)}")
    flat_segs = [seg for p in template for seg in p.segments]
    for s, (sl, tseg) in enumerate(zip(segs, flat_segs)):
        rec = HEADER_SIZE + RECORD_SIZE * s + _COUNT_OFFSET
        # u32 on the wire, read as int32: a corrupt count >= 2^31 reads negative; the
        # kernel's count check ([0, capacity]) reports either way
        count = b2[:, rec:rec + 4].view(torch.int32)                 # [P, 1]
        (oi, ob, ov, osc), (il, bl, vl, scl) = sl.offsets, sl.lengths
        ind = None
        if sl.ienc == IndexEncoding.INT32:
            ind = b2[:, oi:oi + il].view(torch.int32)
        elif sl.ienc in (IndexEncoding.BIN_U8, IndexEncoding.BITMASK):
            ind = b2[:, oi:oi + il]
        elif sl.ienc == IndexEncoding.BIN_U16:
            ind = b2[:, oi:oi + il].view(torch.int16)
        bc = b2[:, ob:ob + bl].view(torch.int32) if bl else None
        idx = _abs_indices(sl.ienc, sl.numel, sl.capacity, sl.bin_size, ind, bc,
                           tseg.implicit_indices, P, device)
        vals = b2[:, ov:ov + vl].view(FLOAT_DTYPES.get(sl.venc, torch.uint8))
        scales = b2[:, osc:osc + scl].view(torch.float32) if scl else None
        _scatter(flat_outs[sl.layer], sl.venc, sl.capacity, sl.quant_bucket, idx, count,
                 vals, scales, error_flag)
