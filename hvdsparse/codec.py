"""The wire codec: one flat ``uint8`` message per bucket of layers, its validation, and
the decode + accumulate of P ranks' messages. This module is the codec's public face
(callers import from here); it gathers the parts, each stating its contract:

* ``codec_format.py`` -- the wire format: the 24-byte versioned header, one 72-byte
  record per segment, 8-byte aligned sections, the section lengths of every encoding,
  the validity rules and error codes (the full tables are its docstring); the layout
  plan of a payload list (:func:`encoded_nbytes`, :func:`layout_signature`).
* ``codec_encode.py`` -- :func:`encode` / :func:`new_message`: a payload list into one
  message on the device, no host sync (narrowed INT32 indices written as BIN_U16).
* ``codec_decode.py`` -- :func:`decode`: one message parsed and validated on the host
  (:class:`DecodedSegment` per record, :class:`CodecError` naming what is wrong).
* ``codec_slots.py`` -- a segment's rows on the device: every slot's absolute index and
  the scatter-add of its values; one rank's own payload decoded without serialising
  (:func:`payload_to_dense`, :func:`sent_positions`); :func:`cached_arange`.
* ``codec_accumulate.py`` -- :func:`accumulate`: P ranks' messages summed into per-layer
  outputs, validated on the host or checked on the device (``error_flag``, codes in
  :data:`ERROR_CODES`), the table-driven bucket decode on the Triton path; every rank
  gets bitwise identical sums.
"""
# outside __all__ but reached through this module: new_message, cached_arange
# (compressors/topk.py), and ops, native, IndexEncoding, bin_count_width (tests)
from . import native, ops
from .codec_accumulate import accumulate
from .codec_decode import DecodedSegment, decode
from .codec_encode import encode, new_message
from .codec_format import (ERR_BIN_COUNTS, ERR_BITMASK, ERR_COUNT, ERR_HEADER, ERR_INDEX,
                           ERROR_CODES, HEADER_SIZE, MAGIC, RECORD_SIZE, VERSION, CodecError,
                           describe_error, encoded_nbytes, layout_signature,
                           segment_layouts, widen_bin_counts)
from .codec_slots import cached_arange, payload_to_dense, sent_positions
from .payload import IndexEncoding, bin_count_width

__all__ = ["CodecError", "DecodedSegment", "MAGIC", "VERSION", "HEADER_SIZE", "RECORD_SIZE",
           "ERROR_CODES", "ERR_INDEX", "ERR_COUNT", "ERR_BIN_COUNTS", "ERR_BITMASK",
           "ERR_HEADER", "describe_error", "encoded_nbytes", "encode", "decode",
           "accumulate", "payload_to_dense", "sent_positions", "layout_signature"]
