"""Mutation test of the wire codec: thousands of malformed messages, both decode paths.

Valid messages (all 6 index encodings x 7 value encodings, INT32 narrowed to BIN_U16
on the wire (``Segment.narrow_indices``), 0-element layers,
capacity-0 segments, 1-3 layers per bucket, P = 1..4 ranks) are generated, encoded and
then mutated: bit flips, byte overwrites in header / records / sections, counts
(off by one, huge, >= 2**31), INT32 indices (negative, numel, duplicates), bin counts
(+-1, moved, negative, huge), bin-relative indices, bitmask bits (inside and beyond
numel), swapped / copied / zeroed / shifted rows, values and scales (NaN included), and
structurally wrong inputs (truncated / extended rows, wrong dtype incl. bool, wrong
shape, non-tensor rows, zero rows). Unaligned views of valid messages are included too.

For every mutated input an independent plain decoder written here from the documented
format (``struct`` + numpy, nothing from hvdsparse) decides whether the message is
valid for the template and what it decodes to (fp32, segments in record order, ranks
in rank order, slots in slot order). Then, with the output tensors embedded between
guard regions filled with a sentinel NaN pattern:

* ``accumulate(validate=True)`` raises CodecError exactly when the plain decoder says
  invalid (and then writes nothing), else writes bit for bit the plain decoder's sums;
* ``accumulate(validate=False)`` (CPU reference path, and the Triton path under
  ``TRITON_INTERPRET=1 HVDSPARSE_FORCE_TRITON=1`` for a subset) never raises on a
  well-shaped uint8 [P, n] input; it sets the error flag exactly when the plain decoder
  says invalid, else writes bit for bit the plain decoder's sums; structurally wrong
  inputs raise CodecError on both paths;
* the guard regions are never touched (validate=True runs ``decode`` on every row, so
  ``decode`` too raises nothing but CodecError).

Fixed seed; ``HVDSPARSE_MUTATIONS=100000`` runs more (the Triton subset is 1/30 of it).
"""
from __future__ import annotations

import math
import os
import struct
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch

from hvdsparse import codec, ops
from hvdsparse.codec import CodecError, accumulate, encode
from hvdsparse.payload import IndexEncoding, ValueEncoding
from tests.workers.allgather_worker import ALL_IE, ALL_VE, fill_payloads, seg_spec

IE, VE = IndexEncoding, ValueEncoding
SEED = 20261122
N_MUTATIONS = int(os.environ.get("HVDSPARSE_MUTATIONS", "2500"))
N_TRITON = max(40, N_MUTATIONS // 30)
PER_BASE = 10                       # mutations drawn from one valid bundle of P messages
GUARD = 8                           # sentinel elements around every output layer
SENTINEL = np.uint32(0x7FA5A5A5)    # a NaN bit pattern nothing computes

# ----------------------------------------------------------------- the documented format

HDR = struct.Struct("<4sHHIIQ")
REC = struct.Struct("<QQIIIIIBBHQQQQ")
QBITS = {VE.INT8: 8, VE.INT4: 4, VE.INT2: 2}
FBYTES = {VE.FP32: 4, VE.FP16: 2, VE.BF16: 2}


def _cdiv(a, b):
    return -(-a // b)


def _al8(n):
    return (n + 7) // 8 * 8


def expected_layout(layout):
    """Independent layout from the spec: per segment a dict with the expected record
    fields and section offsets/lengths; plus (nlayers, nseg, total)."""
    segs = []
    nseg = sum(len(specs) for _, _, specs in layout)
    pos = 24 + 72 * nseg
    for li, (_, shape, specs) in enumerate(layout):
        N = math.prod(shape)
        for sp in specs:
            ie, ve, C = IE(sp["ienc"]), VE(sp["venc"]), sp["cap"]
            B = sp["bin_size"] if ie in (IE.BIN_U8, IE.BIN_U16) else 0
            if sp.get("narrow") and ie == IE.INT32 and ve in FBYTES and N and C:
                # documented: INT32 travels as BIN_U16 in bins of min(N, 65536) when
                # 2 C + w * nbins < 4 C
                nb = min(N, 65536)
                if 2 * C + (1 if nb <= 255 else 2 if nb <= 65535 else 4) * _cdiv(N, nb) < 4 * C:
                    ie, B = IE.BIN_U16, nb
            Q = sp["qb"] if ve in QBITS else 0
            il = {IE.DENSE: 0, IE.INT32: 4 * C, IE.BIN_U8: C, IE.BIN_U16: 2 * C,
                  IE.IMPLICIT: 0, IE.BITMASK: _cdiv(N, 8)}[ie]
            # bin counts: the smallest unsigned int holding B: u8 / u16 / i32 (format v2)
            bl = (1 if B <= 255 else 2 if B <= 65535 else 4) * _cdiv(N, B) if B else 0
            if ve in QBITS:
                vl, sl = _cdiv(C * QBITS[ve], 8), 4 * _cdiv(C, Q)
            elif ve == VE.SIGN1:
                vl, sl = _cdiv(C, 8), 4
            else:
                vl, sl = FBYTES[ve] * C, 0
            offs = []
            for ln in (il, bl, vl, sl):
                offs.append(pos)
                pos += _al8(ln)
            segs.append(dict(layer=li, N=N, C=C, ie=ie, ve=ve, B=B, Q=Q,
                             lens=(il, bl, vl, sl), offs=tuple(offs),
                             implicit=sp["implicit"]))
    return segs, len(layout), nseg, pos


def _slot_values(row, sg, count):
    """fp32 values of slots 0..count-1 (plain numpy from the format table)."""
    ve, off, C = sg["ve"], sg["offs"][2], sg["C"]
    j = np.arange(count)
    if ve == VE.FP32:
        return np.frombuffer(row, "<f4", C, off)[:count].copy()
    if ve == VE.FP16:
        return np.frombuffer(row, "<f2", C, off)[:count].astype(np.float32)
    if ve == VE.BF16:
        u = np.frombuffer(row, "<u2", C, off)[:count].astype(np.uint32) << 16
        return u.view(np.float32)
    if ve == VE.SIGN1:
        sc = np.frombuffer(row, "<f4", 1, sg["offs"][3])[0]
        byt = np.frombuffer(row, np.uint8, sg["lens"][2], off)
        neg = (byt[j // 8] >> (j % 8)) & 1 if count else np.zeros(0, np.uint8)
        return np.where(neg == 1, -sc, sc).astype(np.float32)
    b, Q = QBITS[ve], sg["Q"]
    byt = np.frombuffer(row, np.uint8, sg["lens"][2], off).astype(np.int64)
    sc = np.frombuffer(row, "<f4", sg["lens"][3] // 4, sg["offs"][3])
    code = (byt[(j * b) // 8] >> ((j * b) % 8)) & ((1 << b) - 1) if count else j
    q = (code - (1 << (b - 1))).astype(np.float32)
    with np.errstate(all="ignore"):
        return (q * sc[j // Q]).astype(np.float32) / np.float32((1 << (b - 1)) - 1)


def _slot_indices(row, sg, count):
    """Absolute indices of slots 0..count-1, or a string saying why the row is invalid."""
    ie, N, off = sg["ie"], sg["N"], sg["offs"][0]
    if ie == IE.DENSE:
        return np.arange(count)
    if ie == IE.IMPLICIT:
        return sg["implicit"][:count]
    if ie == IE.INT32:
        idx = np.frombuffer(row, "<i4", sg["C"], off)[:count].astype(np.int64)
        return "index" if ((idx < 0) | (idx >= N)).any() else idx
    if ie in (IE.BIN_U8, IE.BIN_U16):
        B = sg["B"]
        nb = _cdiv(N, B)
        bc = np.frombuffer(row, "<u1" if B <= 255 else "<u2" if B <= 65535 else "<i4", nb,
                           sg["offs"][1]).astype(np.int64)
        lim = np.minimum(B, N - np.arange(nb) * B)
        if ((bc < 0) | (bc > lim)).any() or bc.sum() != count:
            return "bin counts"
        rel = np.frombuffer(row, "<u1" if ie == IE.BIN_U8 else "<u2", sg["C"],
                            off)[:count].astype(np.int64)
        a = np.repeat(np.arange(nb), bc) * B + rel
        return "index" if ((rel >= B) | (a >= N)).any() else a
    bits = np.unpackbits(np.frombuffer(row, np.uint8, sg["lens"][0], off),
                         bitorder="little")
    if bits[N:].any() or int(bits[:N].sum()) != count:
        return "bitmask"
    return np.nonzero(bits[:N])[0]


def plain_decode(rows: np.ndarray, layout, inits):
    """(None, reason) if the [P, n] messages are not valid for the template ``layout``,
    else (sums, None): ``inits`` (fp32 per layer) plus every slot value, added in the
    documented order (segment, then rank, then slot), each addition rounded to fp32."""
    segs, L, S, total = expected_layout(layout)
    if rows.ndim != 2 or rows.shape[1] != total or rows.shape[0] == 0:
        return None, "shape"
    parsed = []
    for r in range(rows.shape[0]):
        row = rows[r].tobytes()
        if HDR.unpack_from(row, 0) != (b"HVSP", 2, 72, L, S, total):
            return None, f"rank {r}: header"
        for s, sg in enumerate(segs):
            f = REC.unpack_from(row, 24 + 72 * s)
            want = (sg["N"], sg["offs"][0], sg["C"], sg["layer"], sg["B"], sg["Q"],
                    int(sg["ie"]), int(sg["ve"]), 0) + sg["lens"]
            if f[:2] + f[3:] != want:
                return None, f"rank {r} segment {s}: record"
            count = f[2]
            if count > sg["C"]:
                return None, f"rank {r} segment {s}: count"
            idx = _slot_indices(row, sg, count)
            if isinstance(idx, str):
                return None, f"rank {r} segment {s}: {idx}"
            parsed.append((s, r, idx, _slot_values(row, sg, count)))
    outs = [x.copy() for x in inits]
    parsed.sort(key=lambda t: (t[0], t[1]))           # segment-major, then rank order
    with np.errstate(all="ignore"):
        for s, r, idx, vals in parsed:
            np.add.at(outs[segs[s]["layer"]], idx, vals)
    return outs, None


# ----------------------------------------------------------------- valid messages

_PAIRS = [(i, v) for i in ALL_IE for v in ALL_VE]


def random_bundle(rng, k):
    """(layout, payloads of rank 0 (the template), rows uint8 [P, n]) -- segment
    encodings rotate through all 42 pairs; numel 0 layers and capacity 0 segments."""
    layout = []
    for li in range(int(rng.integers(1, 4))):
        numel = int(rng.choice([0, 1, 5, int(rng.integers(2, 70))]))
        shape = (numel,) if numel % 2 or rng.random() < 0.5 else (2, numel // 2)
        specs = []
        for _ in range(int(rng.integers(1, 3))):
            ie, ve = _PAIRS[k % len(_PAIRS)]
            k += 1
            sp = seg_spec(rng, numel, ie, ve)
            if ie == IE.INT32 and ve in FBYTES and rng.random() < 0.5:
                sp["narrow"] = True                              # bin-relative on the wire
                sp["cap"] = min(sp["cap"], numel)                # distinct indices
            if ie != IE.DENSE and rng.random() < 0.15:          # capacity-0 segment
                sp["cap"] = 0
                if sp["implicit"] is not None:
                    sp["implicit"] = sp["implicit"][:0]
            specs.append(sp)
        layout.append((f"l{li}", shape, specs))
    P = int(rng.integers(1, 5))
    ranks = [fill_payloads(np.random.default_rng(rng.integers(2 ** 63)), layout)
             for _ in range(P)]
    for pl, _ in ranks:
        for p, (_, _, specs) in zip(pl, layout):
            for seg, sp in zip(p.segments, specs):
                seg.narrow_indices = bool(sp.get("narrow"))
    rows = torch.stack([encode(p) for p, _ in ranks])
    return layout, ranks[0][0], rows, [t for _, t in ranks], k


# ----------------------------------------------------------------- mutations

def _u32(rng):
    return int(rng.choice([0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, int(rng.integers(2 ** 32))]))


def _put(rows, r, off, fmt, val):
    b = bytearray(rows[r].numpy().tobytes())
    struct.pack_into(fmt, b, off, val)
    rows[r] = torch.frombuffer(b, dtype=torch.uint8)


def _get(rows, r, off, fmt):
    return struct.unpack_from(fmt, rows[r].numpy().tobytes(), off)[0]


BYTE_KINDS = ["bitflip", "header", "record", "section", "count", "index", "bin_counts",
              "bin_rel", "bitmask", "values", "swap_rows", "copy_row", "zero_row", "shift",
              "unaligned"]
STRUCT_KINDS = ["truncate", "extend", "dtype", "shape", "non_tensor", "zero_rows"]
# content mutations are drawn more often (they only apply to some bundles), host-known
# structural ones less (they are all caught by the same few checks)
_W = {"count": 3, "index": 4, "bin_counts": 4, "bin_rel": 4, "bitmask": 4, "section": 2,
      "record": 2, "bitflip": 2, **{k: 0.5 for k in STRUCT_KINDS}}
WEIGHTS = np.array([_W.get(k, 1.0) for k in BYTE_KINDS + STRUCT_KINDS])
WEIGHTS = WEIGHTS / WEIGHTS.sum()


def mutate(rng, kind, rows0, segs):
    """Returns ('bytes', [P, n] uint8 tensor (possibly an unaligned view)) or
    ('struct', buffers argument that is wrong in a host-known way)."""
    rows = rows0.clone()
    P, n = rows.shape
    r = int(rng.integers(P))
    S = len(segs)
    sg = segs[int(rng.integers(S))] if S else None
    rec = 24 + 72 * segs.index(sg) if S else 0

    def pick(ies):
        c = [s for s in segs if s["ie"] in ies and s["C"]]
        return c[int(rng.integers(len(c)))] if c else None

    def slot(sg):
        """A used slot most of the time (count read from the record), else any."""
        c = min(_get(rows, r, 24 + 72 * segs.index(sg) + 16, "<I"), sg["C"])
        return int(rng.integers(c)) if c and rng.random() < 0.8 else int(rng.integers(sg["C"]))

    if kind == "bitflip":
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(n))
            rows[r, pos] ^= 1 << int(rng.integers(8))
    elif kind == "header":
        rows[r, int(rng.integers(24))] = int(rng.integers(256))
    elif kind == "record" and S:
        field = rng.choice(["numel", "doff", "cap", "layer", "bs", "qb", "ie", "ve", "res",
                            "len", "byte"])
        fo = dict(numel=(0, "<Q"), doff=(8, "<Q"), cap=(20, "<I"), layer=(24, "<I"),
                  bs=(28, "<I"), qb=(32, "<I"), ie=(36, "<B"), ve=(37, "<B"),
                  res=(38, "<H"), len=(40 + 8 * int(rng.integers(4)), "<Q"))
        if field == "byte":
            rows[r, rec + int(rng.integers(72))] = int(rng.integers(256))
        else:
            o, fmt = fo[field]
            cur = _get(rows, r, rec + o, fmt)
            mx = {"<Q": 2 ** 64 - 1, "<I": 2 ** 32 - 1, "<H": 2 ** 16 - 1, "<B": 255}[fmt]
            val = int(rng.choice([cur + 1, max(cur - 1, 0), 0, mx, cur ^ 8]))
            _put(rows, r, rec + o, fmt, min(val, mx))
    elif kind == "section" and any(sum(x["lens"]) for x in segs):
        sg = [x for x in segs if sum(x["lens"])][int(rng.integers(
            sum(1 for x in segs if sum(x["lens"]))))]
        k = int(rng.choice([i for i in range(4) if sg["lens"][i]]))
        rows[r, sg["offs"][k] + int(rng.integers(_al8(sg["lens"][k])))] = int(rng.integers(256))
    elif kind == "count" and S:
        c = _get(rows, r, rec + 16, "<I")
        C = sg["C"]
        val = int(rng.choice([c + 1, max(c - 1, 0), 0, C, C + 1, _u32(rng)]))
        _put(rows, r, rec + 16, "<I", val % 2 ** 32)
    elif kind == "index" and pick([IE.INT32]) is not None:
        sg = pick([IE.INT32])
        j, N = slot(sg), sg["N"]
        val = int(rng.choice([-1, N, N + 1, -2 ** 31, 2 ** 31 - 1,
                              int(rng.integers(max(N, 1)))]))
        _put(rows, r, sg["offs"][0] + 4 * j, "<i", val)
    elif kind == "bin_counts" and any(x["ie"] in (IE.BIN_U8, IE.BIN_U16) and x["N"]
                                      for x in segs):
        sg = [x for x in segs if x["ie"] in (IE.BIN_U8, IE.BIN_U16) and x["N"]][0]
        w = 1 if sg["B"] <= 255 else 2 if sg["B"] <= 65535 else 4
        fmt, wrap = {1: ("<B", 256), 2: ("<H", 65536), 4: ("<i", None)}[w]

        def put(o, v):      # uint8 counts wrap (a "-1" arrives as 255)
            _put(rows, r, o, fmt, v % wrap if wrap else v)
        nb = sg["lens"][1] // w
        if nb:
            k = int(rng.integers(nb))
            o = sg["offs"][1] + w * k
            cur = _get(rows, r, o, fmt)
            how = rng.choice(["inc", "dec", "move", "neg", "huge", "swap"])
            if how in ("move", "swap") and nb > 1:
                k2 = int(rng.integers(nb))
                o2 = sg["offs"][1] + w * k2
                cur2 = _get(rows, r, o2, fmt)
                if how == "move":
                    put(o, cur - 1)
                    put(o2, cur2 + 1)
                else:
                    put(o, cur2)
                    put(o2, cur)
            else:
                val = {"inc": cur + 1, "dec": cur - 1, "neg": -1,
                       "huge": {1: 255, 2: 65535, 4: 2 ** 31 - 1}[w],
                       "move": cur + 1, "swap": cur - 1}[how]
                put(o, val)
    elif kind == "bin_rel" and pick([IE.BIN_U8, IE.BIN_U16]) is not None:
        sg = pick([IE.BIN_U8, IE.BIN_U16])
        j, B = slot(sg), sg["B"]
        w = 1 if sg["ie"] == IE.BIN_U8 else 2
        mx = 255 if w == 1 else 65535
        val = int(rng.choice([min(B, mx), B - 1, mx, int(rng.integers(mx + 1))]))
        _put(rows, r, sg["offs"][0] + w * j, "<B" if w == 1 else "<H", val)
    elif kind == "bitmask" and any(x["ie"] == IE.BITMASK and x["N"] for x in segs):
        sg = [x for x in segs if x["ie"] == IE.BITMASK and x["N"]][0]
        N = sg["N"]
        nbits = 8 * sg["lens"][0]
        if nbits:
            bit = int(rng.integers(nbits)) if rng.random() < 0.5 or nbits == N else \
                int(rng.integers(N, nbits))
            rows[r, sg["offs"][0] + bit // 8] ^= 1 << (bit % 8)
    elif kind == "values" and any(x["lens"][2] for x in segs):
        sg = [x for x in segs if x["lens"][2]][0]
        k = 3 if sg["lens"][3] and rng.random() < 0.3 else 2
        o = sg["offs"][k] + int(rng.integers(sg["lens"][k]))
        rows[r, o] = int(rng.choice([0xFF, 0x7F, 0x80, int(rng.integers(256))]))
    elif kind == "swap_rows" and P > 1:
        a, b = rng.permutation(P)[:2]
        rows[[a, b]] = rows[[b, a]]
    elif kind == "copy_row" and P > 1:
        a, b = rng.permutation(P)[:2]
        rows[a] = rows[b]
    elif kind == "zero_row":
        rows[r] = 0
    elif kind == "shift":
        rows[r] = torch.roll(rows[r], 8 * int(rng.integers(1, 4)))
    elif kind == "unaligned":
        off = int(rng.integers(1, 8))
        big = torch.empty(P * n + off, dtype=torch.uint8)
        view = big[off:].view(P, n)
        view.copy_(rows)
        return "bytes", view
    elif kind == "truncate":
        k = int(rng.integers(1, min(n, 16) + 1))
        if rng.random() < 0.5:
            return "struct", rows[:, :n - k]
        lst = list(rows.unbind(0))
        lst[r] = lst[r][:n - k]
        return "struct", lst
    elif kind == "extend":
        k = int(rng.integers(1, 16))
        ext = torch.cat([rows, torch.zeros(P, k, dtype=torch.uint8)], 1)
        if rng.random() < 0.5:
            return "struct", ext
        lst = list(rows.unbind(0))
        lst[r] = ext[r]
        return "struct", lst
    elif kind == "dtype":
        how = rng.choice(["bool", "int8", "int32", "float32", "list_bool", "list_int8"])
        if how == "bool":
            return "struct", rows.bool()
        if how == "int8":
            return "struct", rows.view(torch.int8)
        if how == "int32":
            return "struct", rows.view(torch.int32)
        if how == "float32":
            return "struct", rows.view(torch.float32)
        lst = list(rows.unbind(0))
        lst[r] = lst[r].bool() if how == "list_bool" else lst[r].view(torch.int8)
        return "struct", lst
    elif kind == "shape":
        how = rng.choice(["3d", "1d", "list_2d"])
        if how == "3d":
            return "struct", rows.unsqueeze(1)
        if how == "1d":
            return "struct", rows.reshape(-1)
        lst = list(rows.unbind(0))
        lst[r] = lst[r].unsqueeze(0)
        return "struct", lst
    elif kind == "non_tensor":
        how = rng.choice(["none", "bytes", "numpy", "list", "int"])
        if how == "int":
            return "struct", 42
        lst = list(rows.unbind(0))
        lst[r] = {"none": None, "bytes": bytes(rows[r].numpy()),
                  "numpy": rows[r].numpy(), "list": rows[r].tolist()}[how]
        return "struct", lst
    elif kind == "zero_rows":
        return "struct", rows[:0] if rng.random() < 0.5 else []
    else:
        return None                     # not applicable to this bundle: draw another kind
    return "bytes", rows


# ----------------------------------------------------------------- the harness

def _guarded_outs(layout, rng):
    """(big fp32 buffer, views per layer, fp32 initial values per layer): layers at
    GUARD-element gaps, guards filled with the sentinel bit pattern."""
    numels = [math.prod(shape) for _, shape, _ in layout]
    big = torch.from_numpy(np.full(GUARD * (len(numels) + 1) + sum(numels), SENTINEL,
                                   dtype=np.uint32).view(np.float32))
    views, inits, pos = [], [], GUARD
    for n in numels:
        init = rng.standard_normal(n).astype(np.float32)
        v = big[pos:pos + n]
        v.copy_(torch.from_numpy(init))
        views.append(v)
        inits.append(init)
        pos += n + GUARD
    return big, views, inits


def _guards_intact(big, layout):
    b = big.numpy().view(np.uint32)
    pos = 0
    for _, shape, _ in layout:
        if not (b[pos:pos + GUARD] == SENTINEL).all():
            return False
        pos += GUARD + math.prod(shape)
    return bool((b[pos:pos + GUARD] == SENTINEL).all())


def _same(got: torch.Tensor, want: np.ndarray) -> bool:
    g = got.numpy()
    return g.shape == want.shape and bool(np.all((g.view(np.uint32) == want.view(np.uint32))
                                                 | (np.isnan(g) & np.isnan(want))))


def _check_one(kind, how, arg, layout, template, rng, paths, stats):
    """Run every decode path on one input and assert the contract (see module doc)."""
    big0, _, inits0 = _guarded_outs(layout, rng)
    if how == "bytes":
        want, reason = plain_decode(arg.contiguous().numpy(), layout, inits0)
        stats[kind]["valid" if want is not None else "invalid"] += 1
    else:
        want, reason = None, "structural"
        stats[kind]["invalid"] += 1
    for validate in paths:
        big = big0.clone()
        views, pos = [], GUARD
        for i0 in inits0:
            views.append(big[pos:pos + len(i0)])
            pos += len(i0) + GUARD
        flag = torch.zeros(1, dtype=torch.int32)
        what = f"{kind}: validate={validate} reason={reason}"
        try:
            accumulate(arg, template, views, validate=validate,
                       error_flag=None if validate else flag)
            raised = None
        except CodecError as e:
            raised = e
        assert _guards_intact(big, layout), f"{what}: write outside the outputs"
        if how == "struct":
            assert raised is not None, f"{what}: structurally wrong input accepted"
            continue
        if validate:
            if want is None:
                assert raised is not None, f"{what}: invalid message accepted"
                for v, i0 in zip(views, inits0):
                    assert _same(v, i0), f"{what}: CodecError after a partial write"
            else:
                assert raised is None, f"{what}: valid message rejected: {raised}"
        else:
            assert raised is None, f"{what}: trusted path raised {raised!r}"
            code = int(flag[0])
            if want is None:
                assert code != 0, f"{what}: invalid message, error flag not set"
            else:
                assert code == 0, f"{what}: valid message flagged {codec.describe_error(code)}"
        if want is not None:
            for li, (v, w) in enumerate(zip(views, want)):
                assert _same(v, w), (f"{what}: layer {li} differs from the plain decoder "
                                     f"at {np.nonzero(v.numpy() != w)[0][:8]}")


def _run(n_mutations, paths, seed):
    rng = np.random.default_rng(seed)
    stats = defaultdict(Counter)
    pairs_seen = set()
    kinds = BYTE_KINDS + STRUCT_KINDS
    k = 0
    done = 0
    while done < n_mutations:
        layout, template, rows, truths, k = random_bundle(rng, k)
        segs = expected_layout(layout)[0]
        pairs_seen.update((sg["ie"], sg["ve"]) for sg in segs)
        # the plain decoder agrees with the generator's ground truth on the intact bundle
        zeros = [np.zeros(math.prod(s), np.float32) for _, s, _ in layout]
        intact, why = plain_decode(rows.numpy(), layout, zeros)
        assert intact is not None, why
        for li in range(len(layout)):
            ref = np.zeros(len(zeros[li]))
            for tr in truths:
                for idx, vals in tr[li]:
                    np.add.at(ref, idx, vals)
            np.testing.assert_allclose(intact[li], ref, rtol=1e-5, atol=1e-5)
        _check_one("intact", "bytes", rows, layout, template, rng, paths, stats)
        for _ in range(PER_BASE):
            res = None
            while res is None:
                kind = kinds[rng.choice(len(kinds), p=WEIGHTS)]
                res = mutate(rng, kind, rows, segs)
            how, arg = res
            _check_one(kind, how, arg, layout, template, rng, paths, stats)
            done += 1
    return stats, pairs_seen


def _report(stats):
    print("mutation outcomes (kind: valid / invalid):")
    for kind, c in sorted(stats.items()):
        print(f"  {kind:12s} {c['valid']:6d} {c['invalid']:6d}")


# huge random scales overflow to inf in the CPU dequantizer: expected, not a failure
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_mutations_cpu_both_paths():
    """validate=True and the CPU trusted path on N_MUTATIONS mutated messages."""
    stats, pairs = _run(N_MUTATIONS, (True, False), SEED)
    _report(stats)
    assert pairs == set(_PAIRS), f"encoding pairs never generated: {set(_PAIRS) - pairs}"
    for kind in BYTE_KINDS + STRUCT_KINDS:
        assert sum(stats[kind].values()) > 0, f"mutation {kind} never drawn"
    # the mutations do both: some messages stay valid, most become invalid
    tot = Counter()
    for kind in BYTE_KINDS:
        tot.update(stats[kind])
    assert tot["valid"] > 50 and tot["invalid"] > 50, tot
    for kind in ("count", "index", "bin_counts", "bitmask", "header", "zero_row"):
        assert stats[kind]["invalid"] > 0, f"{kind} never produced an invalid message"
    for kind in ("swap_rows", "copy_row", "unaligned", "values"):
        assert stats[kind]["valid"] > 0, f"{kind} never produced a valid message"


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_mutations_triton_interpreter(monkeypatch):
    """The trusted path through the Triton scatter kernel (interpreter), a subset."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py)")
    monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    assert ops.use_triton(torch.zeros(1))
    stats, _ = _run(N_TRITON, (False,), SEED + 1)
    _report(stats)
    tot = Counter()
    for c in stats.values():
        tot.update(c)
    assert tot["valid"] > 5 and tot["invalid"] > 5, tot
