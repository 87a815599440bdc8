"""The host decoder: one message parsed and validated on the host (the format and its
validity rules: :mod:`hvdsparse.codec_format`).

:func:`decode` returns one :class:`DecodedSegment` per record, its tensors views into the
host copy of the buffer; :func:`decode_message` also returns the header's layer count
(what ``accumulate(validate=True)`` compares with its template). Every structural rule is
checked (magic, version, record size, lengths, offsets, layer order, reserved fields,
section lengths against capacity / numel / encodings, ``count <= capacity``), and with
``check_content`` the data rules on the first ``count`` slots (index ranges, bin counts,
bitmask popcount). Anything inconsistent raises :class:`CodecError` naming the field, the
segment and what was expected; nothing is read outside the buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from .codec_format import (ALIGN, HEADER_SIZE, HEADER_STRUCT, MAGIC, MAX_BIN, RECORD_SIZE,
                           RECORD_STRUCT, VERSION, CodecError, align, section_lengths,
                           widen_bin_counts)
from .payload import FLOAT_DTYPES, QUANT_BITS, IndexEncoding, Segment, ValueEncoding


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
    if buf.stride(0) != 1 or buf.storage_offset() % ALIGN:
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
    elif ienc in MAX_BIN:
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
    return decode_message(buffer, check_content)[1]


def decode_message(buffer: torch.Tensor, check_content: bool = True):
    """(layer count from the header, list of DecodedSegment); see :func:`decode`."""
    buf = _host_bytes(buffer)
    n = buf.numel()
    raw = memoryview(buf.numpy())
    if n < HEADER_SIZE:
        raise CodecError(f"truncated buffer: {n} bytes, the header alone needs {HEADER_SIZE}")
    magic, version, rsize, nlayers, nseg, total = HEADER_STRUCT.unpack_from(raw, 0)
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
         *lens) = RECORD_STRUCT.unpack_from(raw, HEADER_SIZE + RECORD_SIZE * s)
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
        ienc, venc, expected = section_lengths(where, numel, cap, ienc, venc, bs, qb)
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
            pos += align(ln)
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
        bin_counts = widen_bin_counts(view(1, torch.uint8), bs) if ienc in MAX_BIN \
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
