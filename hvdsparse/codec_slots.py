"""A segment's rows decoded on the device: every slot's absolute element index, and the
scatter-add of the slots' values (the format: :mod:`hvdsparse.codec_format`).

:func:`slot_indices` turns P rows of one segment's index section (any index encoding)
into absolute int32 indices [P, capacity] with tensor operations, no host sync; a slot
that cannot be valid gets the out-of-range index ``numel``. Given the rows' counts it also
checks the content rules of the format on the device and returns each row's error codes
(``codec_format.ERROR_CODES``). :func:`scatter_rows` adds the rows' values into a dense
fp32 output through ``ops.scatter_add_decode`` (``ops.dense_add_decode`` for DENSE fp32
and quantised segments), rows in order, slots in order.

Both serve :func:`hvdsparse.codec_accumulate.accumulate` and, here, one rank's own payload
decoded without serialising: :func:`payload_to_dense` (the dense sum of its segments) and
:func:`sent_positions` (which elements it sends; DGC's momentum masking). Slot numbers
and DENSE indices come from cached temporaries (:func:`cached_arange`, up to
``_CACHE_ELEMS`` elements; larger ones are allocated per call).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import native, ops
from .codec_format import (ERR_BIN_COUNTS, ERR_BITMASK, ERR_INDEX, LRU, MAX_BIN, CodecError,
                           SegLayout, section_lengths, seg_params)
from .codec_encode import count_bytes, segment_pieces
from .payload import (FLOAT_DTYPES, QUANT_BITS, IndexEncoding, LayerPayload,
                      ValueEncoding)


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


_SLOTS = LRU(64)


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


def slot_indices(sl: SegLayout, ind: Optional[torch.Tensor], bc: Optional[torch.Tensor],
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
    if ienc in MAX_BIN:
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


def scatter_rows(dense: torch.Tensor, venc: ValueEncoding, capacity: int, quant_bucket: int,
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


def check_out(out, numel: int, what: str, device=None) -> torch.Tensor:
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
    slot's absolute index, ``slot_indices``) and ``count`` int32 [1, 1]."""
    numel = payload.numel
    for s, seg in enumerate(payload.segments):
        where = f"{payload.name!r} segment {s}"
        n, cap, ienc, venc, bs, qb = seg_params(seg)
        if n != numel:
            raise CodecError(f"{where}: segment numel {n} != layer numel {numel}")
        ienc, venc, lens = section_lengths(where, n, cap, ienc, venc, bs, qb)
        sl = SegLayout(0, n, cap, ienc, venc, bs, qb, lens, (0, 0, 0, 0))
        segment_pieces(seg, sl, where, dev)
        count = count_bytes(seg, where, dev).view(torch.int32).reshape(1, 1)
        ind = seg.indices.reshape(1, -1) if ienc not in (IndexEncoding.DENSE,
                                                          IndexEncoding.IMPLICIT) else None
        if ind is not None and ind.dtype == torch.uint16:
            ind = ind.view(torch.int16)
        bc = None
        if ienc in MAX_BIN:
            bc = seg.bin_counts.reshape(1, -1) if seg.bin_counts is not None else \
                torch.zeros((1, 0), dtype=torch.int32, device=dev)
        idx, _ = slot_indices(sl, ind, bc, seg.implicit_indices, 1, dev)
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
    flat = check_out(out, payload.numel, f"payload_to_dense out for {payload.name!r}")
    for ienc, idx, count, venc, cap, qb, vals, scales in _own_segments(payload, dev):
        scatter_rows(flat, venc, cap, qb, idx, count, vals, scales, None, ienc)
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
