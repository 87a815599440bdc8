"""Decode + accumulate: P ranks' messages of one bucket summed into per-layer fp32
outputs (the format and its validity rules: :mod:`hvdsparse.codec_format`).

:func:`accumulate` takes the layout from this rank's own payload list (the template).
``validate=True`` parses every row on the host (``codec_decode``) and compares it with
the template, raising :class:`CodecError` before anything is written. ``validate=False``
(the no-host-sync path) checks every row on the device against the same rules and ORs
the error codes into ``error_flag``; a bad (rank, segment) contributes nothing. On the
Triton path, a bucket whose segments are all DENSE / INT32 / BIN_* / IMPLICIT and whose
outputs are slices of one storage goes through the table-driven bucket decode
(``kernels/bucket_decode.py`` through ``ops.bucket_decode``: one check launch and one
scatter launch per rank) with the same sums, error codes and zeroed contributions;
otherwise each segment is decoded by ``codec_slots``.

Decode order: for every segment (record order), rank rows are added in rank order
0..P-1, inside a row in slot order (``ops.scatter_add_decode``), so every rank computes
bitwise identical sums from the same P messages.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from . import ops
from .codec_decode import decode_message
from .codec_format import (ALIGN, COUNT_OFFSET, DEVICE_BYTES, ERR_COUNT, ERR_HEADER,
                           ERROR_CODES, HEADER_SIZE, LRU, MAX_BIN, RECORD_SIZE, CodecError,
                           LayoutPlan, SegLayout, describe_error, layout_plan, plan_bytes,
                           to_device, widen_bin_counts)
from .codec_slots import check_out, scatter_rows, slot_indices
from .payload import FLOAT_DTYPES, QUANT_BITS, IndexEncoding, LayerPayload, bin_count_width


def _bin_limits(plan: LayoutPlan, s: int, sl: SegLayout, device) -> torch.Tensor:
    """int32[nbins]: ``min(B, N - k*B)``, the most slots bin k can own (cached)."""
    key = (plan.sig, str(device), ("limits", s))
    ent = DEVICE_BYTES.get_lru(key)
    if ent is None:
        k = torch.arange(sl.nbins, dtype=torch.int64)
        lim = (sl.numel - k * sl.bin_size).clamp(max=sl.bin_size).to(torch.int32)
        ent = DEVICE_BYTES.put(key, to_device(lim.numpy().tobytes(), device))
    return ent.get().view(torch.int32)


_CODE_BITS: dict = {}


def _code_bits(device) -> torch.Tensor:
    key = str(device)
    t = _CODE_BITS.get(key)
    if t is None:
        t = torch.tensor(sorted(ERROR_CODES), dtype=torch.int32, device=device)
        _CODE_BITS[key] = t
    return t


#: index encodings the table-driven bucket decode handles (``kernels/bucket_decode.py``)
_BUCKET_DECODE_INDEX = (IndexEncoding.DENSE, IndexEncoding.INT32, IndexEncoding.BIN_U8,
                        IndexEncoding.BIN_U16, IndexEncoding.IMPLICIT)
_BUCKET_META = LRU(512)     # (signature, device, out offsets) -> the kernel's meta


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


def _bucket_table(plan: LayoutPlan, device, out_offs, imps):
    """The bucket decode's device table for this layout, output placement and IMPLICIT
    index addresses (built once from host ints, one host-to-device copy) and its meta."""
    key = (plan.sig, str(device), ("bucket_decode", out_offs, imps))
    ent = DEVICE_BYTES.get_lru(key)
    meta = _BUCKET_META.get_lru(key)
    if ent is None or meta is None:
        rows = []
        for s, sl in enumerate(plan.segs):
            w = bin_count_width(sl.bin_size) if sl.ienc in MAX_BIN else 0
            rows.append((out_offs[sl.layer], sl.layer, sl.numel, sl.capacity, int(sl.ienc),
                         int(sl.venc), sl.bin_size, sl.quant_bucket,
                         QUANT_BITS.get(sl.venc, 0), sl.offsets,
                         HEADER_SIZE + RECORD_SIZE * s + COUNT_OFFSET, w, imps[s]))
        host, meta = ops.bucket_decode_table(rows)
        ent = DEVICE_BYTES.put(key, to_device(host.tobytes(), device))
        _BUCKET_META.put(key, meta)
    return ent.get().view(torch.int64), meta


def _zero_outs(flat_outs) -> None:
    """Every output set to 0: one launch where they tile one span without gaps."""
    shared = _shared_out(flat_outs)
    if shared is not None and shared[0].numel() == sum(o.numel() for o in flat_outs):
        shared[0].zero_()
        return
    for o in flat_outs:
        o.zero_()


def _decode_segment(b2, base, zero, table, meta_items, image, mask, hdr_bytes, error_flag,
                    counts_out):
    """The bucket decode's device launches (a device segment of
    :mod:`hvdsparse.device_graphs`: everything it reads is an argument): ``base`` zeroed
    when ``zero``, then the check launch and the scatter launches. Returns the error
    table int32 [P, S]."""
    if zero:
        base.zero_()
    _, err, _ = ops.bucket_decode(b2, base, table, dict(meta_items), image, mask, hdr_bytes,
                                  error_flag, counts_out=counts_out)
    return err


def _bucket_accumulate(b2: torch.Tensor, plan: LayoutPlan, flat_outs, error_flag, flat_segs,
                       counts_out=None, zero=False, graphs=None, rows_kept=False):
    """validate=False on the Triton path, every segment DENSE / INT32 / BIN_* /
    IMPLICIT (int64 indices on the messages' device): one check launch + one scatter
    launch per rank and pass (:func:`ops.bucket_decode`); the same sums, error codes and
    zeroed contributions as the per-segment decode. ``zero``: the outputs are zeroed
    first (in the same segment; they tile one span). ``graphs``
    (:class:`hvdsparse.device_graphs.SegmentGraphs` whose backend applies to the
    messages' device): the messages are copied to a persistent home (the collective's
    output moves from step to step; not when ``rows_kept``: they already live at an
    address that repeats) and the segment replays from a capture. Returns the
    per-(rank, segment) error table int32 [P, S], or None when not applicable (the
    caller then decodes per segment)."""
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
    if zero and base.numel() != sum(o.numel() for o in flat_outs):
        for o in flat_outs:              # gaps between the outputs are not ours to zero
            o.zero_()
        zero = False
    table, meta = _bucket_table(plan, device, out_offs, tuple(imps))
    args = (base, zero, table, tuple(sorted(meta.items())), plan_bytes(plan, device, "image"),
            plan_bytes(plan, device, "mask"), plan.data_start, error_flag, counts_out)
    if graphs is not None and graphs.backend.applies(device):
        return graphs.run(_decode_segment, None, b2 if rows_kept else graphs.home(b2),
                          *args)
    return _decode_segment(b2, *args)


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
    if b2.stride(1) != 1 or b2.stride(0) % ALIGN or b2.storage_offset() % ALIGN:
        b2 = torch.empty(b2.shape, dtype=torch.uint8, device=b2.device).copy_(b2)
    return b2


def _validate_rows(b2: torch.Tensor, plan: LayoutPlan, template, flat_segs) -> None:
    """validate=True: host parse of every row (:func:`decode`) + comparison with the
    template's layout; CodecError naming the rank and the segment."""
    segs = plan.segs
    expected = [(sl.layer, sl.numel, sl.capacity, int(sl.ienc), int(sl.venc),
                 sl.bin_size, sl.quant_bucket) for sl in segs]
    fields = ("layer", "numel", "capacity", "index_encoding", "value_encoding", "bin_size",
              "quant_bucket")
    for r in range(b2.shape[0]):
        try:
            nlayers, dec = decode_message(b2[r])
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
               counts_out: Optional[torch.Tensor] = None, zero: bool = False,
               graphs=None, rows_kept: bool = False) -> Optional[torch.Tensor]:
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

    ``zero``: ``outs`` are set to 0 first (after the host validation, so a rejected
    message leaves them as they were); the result is then the sum itself. ``graphs``
    (:class:`hvdsparse.device_graphs.SegmentGraphs`; ``validate=False``): the bucket
    decode's launches replay as one captured graph where its backend applies, reading
    the messages from a kept copy (one copy launch), or in place with ``rows_kept`` (the
    caller's ``buffers`` tensor is one it reuses every step, at the same address).

    Returns ``error_flag`` (validate=True: as passed).
    """
    plan = layout_plan(template)
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
    flat_outs = [check_out(o, p.numel, f"accumulate outs[{i}] ({p.name!r})", device)
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
            err = _bucket_accumulate(b2, plan, flat_outs, error_flag, flat_segs, counts_out,
                                     zero, graphs, rows_kept)
            if err is not None:
                if own_flag:
                    _raise_flag(error_flag, [(s, sl.layer, err[:, s])
                                             for s, sl in enumerate(segs)])
                return error_flag
        # header + records must equal this rank's, except the count fields
        hdr = b2[:, :plan.data_start]
        row_hdr = ((hdr & plan_bytes(plan, device, "mask")) !=
                   plan_bytes(plan, device, "image")).any(1).to(torch.int32) * ERR_HEADER
        row_err = row_hdr
        seg_errs = []
    if zero:
        _zero_outs(flat_outs)
    if counts_out is not None:
        _read_counts(b2, len(segs), counts_out)
    for s, (sl, tseg) in enumerate(zip(segs, flat_segs)):
        rec = HEADER_SIZE + RECORD_SIZE * s + COUNT_OFFSET
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
        bc = widen_bin_counts(b2[:, ob:ob + bl], sl.bin_size) if sl.ienc in MAX_BIN \
            else None
        dense = flat_outs[sl.layer]
        if validate:
            idx, _ = slot_indices(sl, ind, bc, tseg.implicit_indices, P, device)
        else:
            c = count[:, 0]
            cnt = c.clamp(0, sl.capacity)
            limits = _bin_limits(plan, s, sl, device) if sl.ienc in MAX_BIN else None
            idx, err = slot_indices(sl, ind, bc, tseg.implicit_indices, P, device,
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
        scatter_rows(dense, sl.venc, sl.capacity, sl.quant_bucket, idx, count, vals, scales,
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
    lo = HEADER_SIZE + COUNT_OFFSET
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
