"""What a compressor hands to the wire: one or more *segments* per layer.

A segment is a fixed-capacity description of part of one layer's gradient:

* ``indices``  -- where the values go (absolute int32 element indices, bin-relative
  uint8/uint16 indices plus per-bin counts, implicit indices that every rank already
  knows, or none at all for a dense segment);
* ``values``   -- what goes there (fp32 / fp16 / bf16 floats, 8/4/2-bit codes with one
  fp32 scale per quantisation bucket, or 1-bit signs with one fp32 scale: AdaComp's
  ternary ``sign x scale`` for the selected elements);
* ``count``    -- how many of the ``capacity`` slots are used, a 1-element int32
  *device* tensor, so producing a segment never synchronises with the host.

Capacities are fixed per layer (they depend only on the layer size and the compressor's
settings, never on the data), so every rank's encoded bucket has the same length at
every step. Slots ``>= count`` are padding: their content is unspecified and decoders
ignore them.

This module only describes data. It imports nothing of hvdsparse and is shared by
``compressors/`` (which produce segments), ``codec`` (which serialises them) and
``exchange/`` (which moves and decodes them).
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Optional

import torch


class IndexEncoding(enum.IntEnum):
    """How element positions travel (wire code in the codec's layer record)."""

    DENSE = 0      # no indices: values cover elements [0, numel) in order
    INT32 = 1      # absolute element index, int32, one per slot
    BIN_U8 = 2     # bin-relative uint8 index per slot + per-bin counts (bin_size <= 256)
    BIN_U16 = 3    # bin-relative uint16 index per slot + per-bin counts (bin_size <= 65536)
    IMPLICIT = 4   # indices known to every rank (Slim-DP core, shared-seed RandomK):
                   # nothing travels; ``implicit_indices`` holds them locally
    BITMASK = 5    # one bit per element of the layer (bit i%8 of byte i//8), values of the
                   # set bits in ascending element order (DCT-MP rows when denser than ~1/32)


class ValueEncoding(enum.IntEnum):
    """How values travel (wire code in the codec's layer record)."""

    FP32 = 0
    FP16 = 1
    BF16 = 2
    INT8 = 3       # stochastic rounding, 1 value per byte, one fp32 scale per bucket
    INT4 = 4       # 2 values per byte
    INT2 = 5       # 4 values per byte
    SIGN1 = 6      # 1 bit per value (1 = negative), one fp32 scale for the segment


#: bits per value of each quantised encoding
QUANT_BITS = {ValueEncoding.INT8: 8, ValueEncoding.INT4: 4, ValueEncoding.INT2: 2}

#: bytes per value of each float encoding
FLOAT_BYTES = {ValueEncoding.FP32: 4, ValueEncoding.FP16: 2, ValueEncoding.BF16: 2}

FLOAT_DTYPES = {ValueEncoding.FP32: torch.float32, ValueEncoding.FP16: torch.float16,
                ValueEncoding.BF16: torch.bfloat16}

#: largest finite value of each narrow float encoding. Values beyond it travel saturated
#: (a plain cast of |x| > 65504 to fp16 gives inf, which would reach every rank's
#: parameters); with error feedback the excess stays in the residual and goes out later.
FLOAT_MAX = {ValueEncoding.FP16: 65504.0,
             ValueEncoding.BF16: float(torch.finfo(torch.bfloat16).max)}


def to_wire_float(v: torch.Tensor, enc: ValueEncoding) -> torch.Tensor:
    """fp32 ``v`` -> the wire dtype of float encoding ``enc``, saturated at
    ``+-FLOAT_MAX[enc]`` (round to nearest even otherwise; NaN stays NaN). The one
    definition of a sent float value: the CPU select, the compressors' encoder and the
    Triton select (``kernels/select.py``, which repeats the two constants) agree on it."""
    enc = ValueEncoding(enc)
    if enc == ValueEncoding.FP32:
        return v.float()
    m = FLOAT_MAX[enc]
    return v.clamp(-m, m).to(FLOAT_DTYPES[enc])


VALUE_ENCODING_NAMES = {"fp32": ValueEncoding.FP32, "fp16": ValueEncoding.FP16,
                        "bf16": ValueEncoding.BF16, "int8": ValueEncoding.INT8,
                        "int4": ValueEncoding.INT4, "int2": ValueEncoding.INT2}


def bin_count_width(bin_size: int) -> int:
    """Bytes per bin count on the wire (BIN_* encodings): the smallest unsigned integer
    that holds ``bin_size`` (a bin's count is at most its size): 1 (uint8) for
    ``bin_size <= 255``, 2 (uint16) up to 65535, else 4 (int32). In memory,
    ``Segment.bin_counts`` is always int32; the codec narrows it."""
    return 1 if bin_size <= 0xFF else 2 if bin_size <= 0xFFFF else 4


#: bins of an INT32 segment narrowed for the wire (see :func:`wire_indexing`)
NARROW_BIN = 65536
#: ``HVDSPARSE_NARROW_INDICES=0`` sends int32 indices as they are (for A/B benchmarks;
#: read once at import; it is in the settings fingerprint: ranks that disagree fail at
#: the first step, naming it)
NARROW_INDICES = os.environ.get("HVDSPARSE_NARROW_INDICES", "1") != "0"


def wire_indexing(seg: "Segment"):
    """``(index_encoding, bin_size)`` with which ``seg``'s indices travel.

    A segment with ``narrow_indices=True``, absolute INT32 indices and float values
    travels bin-relative: BIN_U16 with bins of ``B = min(numel, 65536)`` elements (a
    uint16 position inside the bin per slot, one count per bin), when that is shorter
    than 4 bytes per slot (``2 C + w ceil(N / B) < 4 C``, ``w`` the count width). The
    codec then writes the used slots sorted by index (the order inside a row does not
    change a decoded sum: a row's indices are distinct), so the receiver finds each
    slot's bin from the counts. Lossless; 2 bytes fewer per sent element (8 -> 6 with
    fp32 values, 6 -> 4 with fp16 / bf16). Every other segment travels as it is in
    memory."""
    ienc = IndexEncoding(int(seg.index_encoding))
    if not NARROW_INDICES or not getattr(seg, "narrow_indices", False) or \
            ienc != IndexEncoding.INT32 or \
            int(seg.value_encoding) not in FLOAT_BYTES:
        return ienc, (int(seg.bin_size) if ienc in (IndexEncoding.BIN_U8,
                                                    IndexEncoding.BIN_U16) else 0)
    n, c = int(seg.numel), int(seg.capacity)
    if n < 1 or c < 1:
        return ienc, 0
    b = min(n, NARROW_BIN)
    if 2 * c + bin_count_width(b) * (-(-n // b)) >= 4 * c:
        return ienc, 0
    return IndexEncoding.BIN_U16, b


@dataclass
class Segment:
    """Part of one layer's message. See the module docstring.

    Tensor fields by encoding:

    * ``indices``: INT32 -> int32[capacity]; BIN_U8/BIN_U16 -> uint8/int16-viewed
      uint16 [capacity] bin-relative positions, sorted by bin, with
      ``bin_counts`` int32[nbins] (how many slots belong to each bin, in bin order);
      BITMASK -> uint8[ceil(numel/8)] mask (then ``capacity`` >= popcount, values in
      ascending element order); DENSE / IMPLICIT -> None.
    * ``values``: FP32/FP16/BF16 -> that dtype [capacity];
      INT8/INT4/INT2 -> uint8 packed codes [ceil(capacity * bits / 8)] with ``scales``
      fp32[ceil(capacity / quant_bucket)];
      SIGN1 -> uint8 packed sign bits [ceil(capacity / 8)] with ``scales`` fp32[1].
    * ``implicit_indices``: IMPLICIT only, int64[capacity] indices into the layer,
      identical on every rank; never serialised.
    """

    numel: int                      # elements in the whole layer
    capacity: int                   # fixed number of slots
    index_encoding: IndexEncoding
    value_encoding: ValueEncoding
    count: torch.Tensor             # int32[1] on the gradient's device
    values: torch.Tensor
    indices: Optional[torch.Tensor] = None
    scales: Optional[torch.Tensor] = None
    bin_counts: Optional[torch.Tensor] = None
    bin_size: int = 0               # BIN_* encodings
    quant_bucket: int = 512         # INT8/INT4/INT2 encodings
    implicit_indices: Optional[torch.Tensor] = field(default=None, repr=False)
    #: INT32 with float values only: the codec may send the indices bin-relative
    #: (:func:`wire_indexing`); set by the sparsifiers, whose slots hold distinct indices
    narrow_indices: bool = False


@dataclass
class LayerPayload:
    """Everything one rank sends for one layer this step (one or more segments)."""

    name: str
    shape: torch.Size
    segments: list
    #: int32[1] device tensor: how many elements of this rank's gradient for the layer
    #: were not finite (NaN/Inf). Such elements are never absorbed into the residual and
    #: never sent; the scheduler combines the counts of all ranks and applies the
    #: optimizer's non-finite policy. None = the producer did not check (counts as 0).
    nonfinite: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n
