"""The encoder: a payload list -> one ``uint8`` message (the format:
:mod:`hvdsparse.codec_format`).

:func:`encode` copies the header and records from the layout plan's cached device image,
each record's ``count`` from the segment's int32 device tensor, and the sections with
tensor operations, all in one ``torch.cat`` into ``out`` (a reused buffer from
:func:`new_message`): nothing synchronises with the host. Padding bytes are zero,
padding slots are copied verbatim. Bin counts are narrowed from int32 to their wire width
(:func:`_narrow_bin_counts`). Narrowed INT32 segments (``Segment.narrow_indices``, rule:
:func:`hvdsparse.payload.wire_indexing`) are written as BIN_U16 by :class:`_Narrowing`:
all such segments of one value dtype sorted and binned together, a fixed number of device
operations per message (one Triton launch on CUDA).

:func:`segment_pieces` and :func:`count_bytes` check a segment's tensors against its
layout (presence, dtype, element count, device) and raise :class:`CodecError` naming the
layer, the segment and the field; the device decode of a rank's own payload
(``codec_slots.py``) uses them too.
"""
from __future__ import annotations

import threading
from typing import Optional, Sequence

import numpy as np
import torch

from . import ops
from .codec_format import (ALIGN, BIN_COUNT_DTYPE, COUNT_OFFSET, HEADER_SIZE, LRU,
                           RECORD_SIZE, CodecError, LayoutPlan, SegLayout, align,
                           layout_plan, plan_bytes)
from .payload import FLOAT_DTYPES, IndexEncoding, LayerPayload, Segment, bin_count_width


def _narrow_bin_counts(bc: torch.Tensor, bin_size: int) -> torch.Tensor:
    """int32 counts -> their wire dtype (uint16 travels as int16 bits)."""
    dt = BIN_COUNT_DTYPE[bin_count_width(bin_size)]
    return bc if dt == torch.int32 else bc.to(dt)


_ZEROS_CACHE: dict = {}


def _zeros(device) -> torch.Tensor:
    key = str(device)
    z = _ZEROS_CACHE.get(key)
    if z is None:
        z = torch.zeros(ALIGN, dtype=torch.uint8, device=device)
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


def count_bytes(seg: Segment, where: str, device) -> torch.Tensor:
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


def segment_pieces(seg: Segment, sl: SegLayout, where: str, device, bin_counts=None):
    """Byte views of the four sections (None for empty), validated against layout;
    ``bin_counts``: the counts' wire bytes when the caller narrowed them already."""
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
    if bl and bin_counts is not None:
        pieces[1] = bin_counts
    elif bl:
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

    def __init__(self, plan: LayoutPlan, members, device, vdtype):
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
        self.wide = {w: (self.counts if w == 4 else e(nbt, BIN_COUNT_DTYPE[w]))
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
        cnts = [count_bytes(seg, w, device).view(torch.int32) for seg, w in zip(segs, wheres)]
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


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether 1-D ``b`` starts where 1-D ``a`` ends, in the same storage (both dense)."""
    return a.dtype == b.dtype and (a.numel() <= 1 or a.stride(0) == 1) and \
        (b.numel() <= 1 or b.stride(0) == 1) and \
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and \
        b.storage_offset() == a.storage_offset() + a.numel()


def _narrow_all_bin_counts(plan: LayoutPlan, flat_segs, device) -> dict:
    """``{segment ordinal: its bin counts in their wire dtype, as bytes}`` for the
    segments whose counts travel narrower than int32 (``bin_count_width``): each run of
    counts of one width that lie end to end in one buffer (a bucket group's) is cast in
    one op."""
    runs: list = []               # [width, bin size, [(s, bc), ...]] in message order
    for s, ((li, p, seg), sl) in enumerate(zip(flat_segs, plan.segs)):
        w = bin_count_width(sl.bin_size)
        if sl.narrowed or not sl.lengths[1] or w == 4:
            continue
        where = f"layer {li} ({p.name!r}) segment {s}"
        bc = _as_bytes(seg.bin_counts, where, "bin_counts", (torch.int32,), sl.nbins,
                       device).view(torch.int32)
        if runs and runs[-1][0] == w and _follows(runs[-1][2][-1][1], bc):
            runs[-1][2].append((s, bc))
        else:
            runs.append([w, sl.bin_size, [(s, bc)]])
    out = {}
    for _, bin_size, members in runs:
        first = members[0][1]
        n = sum(bc.numel() for _, bc in members)
        run = first.as_strided((n,), (1,), first.storage_offset())
        wide, pos = _narrow_bin_counts(run, bin_size), 0
        for s, bc in members:
            out[s] = wide[pos:pos + bc.numel()].view(torch.uint8)
            pos += bc.numel()
    return out


#: (layout signature, device, value dtype, thread) -> _Narrowing. Per thread: its
#: buffers hold a message's sections until they are copied in, so two threads encoding
#: the same layout at once (ranks on threads, autograd's per-device threads) must not
#: share them.
_NARROWINGS = LRU(256)


def _narrow_message(plan: LayoutPlan, flat_segs, device) -> dict:
    """``{segment ordinal: its four sections}`` for every narrowed segment of a message
    (see :class:`_Narrowing`): one batch per value dtype."""
    groups = {}
    for s, sl in enumerate(plan.segs):
        if sl.narrowed:
            groups.setdefault(FLOAT_DTYPES[sl.venc], []).append(s)
    out = {}
    for vdt, members in groups.items():
        key = (plan.sig, str(device), vdt, threading.get_ident())
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
    return torch.empty(layout_plan(payloads).total, dtype=torch.uint8, device=device)


def _payload_device(payloads) -> Optional[torch.device]:
    for p in payloads:
        for seg in p.segments:
            c = seg.count
            return c.device if isinstance(c, torch.Tensor) else None
    return None


def _encode_segment(layers: tuple, out: torch.Tensor, tail: Optional[torch.Tensor]):
    """The encode's device launches (a device segment of :mod:`hvdsparse.device_graphs`):
    ``layers`` holds each payload's ``(name, shape, segments)``, what the encode reads
    of it."""
    return encode([LayerPayload(n, s, list(segs)) for n, s, segs in layers], out=out,
                  tail=tail)


def encode(payloads: Sequence[LayerPayload], out: Optional[torch.Tensor] = None,
           tail: Optional[torch.Tensor] = None, graphs=None) -> torch.Tensor:
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

    ``tail`` (contiguous uint8 on the same device, optional): bytes that follow the
    message in the same buffer, written by the same ``cat`` and zero-padded to a
    multiple of 8 (the allgather exchange's non-finite counts); ``out`` then holds
    ``encoded_nbytes(payloads) + pad8(tail.numel())`` bytes. Decoders see the message
    part only.

    ``graphs`` (:class:`hvdsparse.device_graphs.SegmentGraphs`, with ``out``): the
    encode's launches replay as one captured graph where its backend applies to
    ``out``'s device (keyed by every payload field, ``out`` and ``tail``; the first
    sighting of a key runs, and checks, eagerly).
    """
    if graphs is not None and isinstance(out, torch.Tensor) and \
            graphs.backend.applies(out.device):
        return graphs.run(_encode_segment, None, tuple(
            (p.name, p.shape, tuple(p.segments)) for p in payloads), out, tail)
    plan = layout_plan(payloads)
    segs, data_start, total = plan.segs, plan.data_start, plan.total
    device = _payload_device(payloads)
    if tail is not None and (not isinstance(tail, torch.Tensor) or tail.dtype != torch.uint8
                             or tail.dim() != 1 or not tail.is_contiguous()):
        raise CodecError("encode: tail must be a contiguous 1-D uint8 tensor")
    ntail = 0 if tail is None else align(tail.numel())
    total += ntail
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
    img = plan_bytes(plan, device, "image")
    zeros = _zeros(device)
    pieces = []
    pos = 0
    flat_segs = [(li, p, seg) for li, p in enumerate(payloads) for seg in p.segments]
    for s, (li, p, seg) in enumerate(flat_segs):
        where = f"layer {li} ({p.name!r}) segment {s}"
        rec = HEADER_SIZE + RECORD_SIZE * s + COUNT_OFFSET
        pieces.append(img[pos:rec])
        pieces.append(count_bytes(seg, where, device))
        pos = rec + 4
    pieces.append(img[pos:data_start])
    narrowed = _narrow_message(plan, flat_segs, device) if plan.narrowed else {}
    counts = _narrow_all_bin_counts(plan, flat_segs, device)
    for s, (li, p, seg) in enumerate(flat_segs):
        where = f"layer {li} ({p.name!r}) segment {s}"
        sl = segs[s]
        secs = narrowed[s] if sl.narrowed else segment_pieces(seg, sl, where, device,
                                                              counts.get(s))
        for piece, ln in zip(secs, sl.lengths):
            if piece is not None:
                pieces.append(piece)
            pad = align(ln) - ln
            if pad:
                pieces.append(zeros[:pad])
    if tail is not None:
        if tail.device != device:
            raise CodecError(f"encode: tail on {tail.device}, message on {device}")
        pieces.append(tail)
        pieces.append(zeros[:ntail - tail.numel()])
    pieces = [t for t in pieces if t.numel()]
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=device)
    torch.cat(pieces, out=out)
    return out
