"""Wire codec: round trip, decoding against an independent numpy reference, validation of
corrupted / truncated messages.

The payload generator and the dense reference live in tests/workers/allgather_worker.py
(shared with the horovodrun test); they compute every slot's absolute index and value
with plain numpy (own bit-unpacking of codes and signs), never through hvdsparse.
Random data: seeds come from hypothesis (shown on failure) or are printed.
"""
from __future__ import annotations

import contextlib
import os
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvdsparse import codec, codec_format, codec_slots
from hvdsparse.codec import CodecError, accumulate, decode, encode, encoded_nbytes
from hvdsparse.payload import (QUANT_BITS, IndexEncoding, LayerPayload, Segment,
                               ValueEncoding, bin_count_width)
from tests.workers.allgather_worker import (ALL_IE, ALL_VE, assert_close, dense_reference,
                                            fill_payloads, fill_segment, random_layout, seg_spec)

IE, VE = IndexEncoding, ValueEncoding
H, R = codec.HEADER_SIZE, codec.RECORD_SIZE
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def fresh_seed() -> int:
    seed = int(os.environ.get("HVDSPARSE_TEST_SEED") or int.from_bytes(os.urandom(4),
                                                                        "little"))
    print(f"seed={seed} (replay: HVDSPARSE_TEST_SEED={seed})")
    return seed


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return a.dtype == b.dtype and a.numel() == b.numel()
    a, b = a.reshape(-1).contiguous(), b.reshape(-1).contiguous()
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_round_trip(payloads, truths):
    buf = encode(payloads)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert buf.numel() == encoded_nbytes(payloads) and buf.numel() % 8 == 0
    dec = decode(buf)
    flat = [(li, seg) for li, p in enumerate(payloads) for seg in p.segments]
    assert len(dec) == len(flat)
    for s, (d, (li, seg)) in enumerate(zip(dec, flat)):
        assert (d.segment, d.layer, d.numel, d.capacity) == (s, li, seg.numel, seg.capacity)
        assert d.count == int(seg.count[0])
        assert (d.index_encoding, d.value_encoding) == (seg.index_encoding, seg.value_encoding)
        ie, ve = seg.index_encoding, seg.value_encoding
        # every slot, padding included, comes back byte-identical
        if ie in (IE.INT32, IE.BIN_U8, IE.BIN_U16, IE.BITMASK):
            assert _same_bytes(d.indices, seg.indices.view(d.indices.dtype)), f"seg {s} idx"
        else:
            assert d.indices is None
        if ie in (IE.BIN_U8, IE.BIN_U16):
            assert d.bin_size == seg.bin_size
            assert torch.equal(d.bin_counts, seg.bin_counts)
        else:
            assert d.bin_counts is None and d.bin_size == 0
        assert _same_bytes(d.values, seg.values), f"segment {s} values"
        if ve in QUANT_BITS or ve == VE.SIGN1:
            assert torch.equal(d.scales, seg.scales.reshape(-1))
        else:
            assert d.scales is None
        assert d.quant_bucket == (seg.quant_bucket if ve in QUANT_BITS else 0)
    return buf


# --------------------------------------------------------------------------- round trip

@st.composite
def layouts(draw):
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    layout = []
    for li in range(draw(st.integers(1, 3))):
        numel = draw(st.one_of(st.just(1), st.integers(1, 9), st.integers(1, 400)))
        specs = []
        for _ in range(draw(st.integers(1, 2))):
            ie = draw(st.sampled_from(ALL_IE))
            ve = draw(st.sampled_from(ALL_VE))
            specs.append(seg_spec(rng, numel, ie, ve))
        shape = (numel,) if numel % 3 else (3, numel // 3)
        layout.append((f"l{li}", shape, specs))
    return seed, layout


@SETTINGS
@given(layouts(), st.integers(1, 3))
def test_round_trip_and_accumulate_hypothesis(seed_layout, P):
    seed, layout = seed_layout
    ranks = [fill_payloads(np.random.default_rng([seed, r]), layout) for r in range(P)]
    bufs = [check_round_trip(p, t) for p, t in ranks]
    assert len({b.numel() for b in bufs}) == 1
    sig = codec.layout_signature(ranks[0][0])
    assert all(codec.layout_signature(p) == sig for p, _ in ranks)
    hash(sig)
    # payload_to_dense of each rank's own payload
    for p, t in ranks:
        ref = dense_reference(layout, [t])
        for li, lp in enumerate(p):
            d = codec.payload_to_dense(lp)
            assert d.shape == lp.shape and d.dtype == torch.float32
            assert_close(d, ref[li], f"payload_to_dense layer {li}")
    # accumulate of all ranks, tensor and list forms, both validation modes
    ref = dense_reference(layout, [t for _, t in ranks])
    template = ranks[0][0]
    for bufs_arg, validate in ((torch.stack(bufs), True), (bufs, True),
                               (torch.stack(bufs), False)):
        outs = [torch.full((p.numel,), 0.5) for p in template]   # accumulate adds
        accumulate(bufs_arg, template, outs, validate=validate)
        for li, o in enumerate(outs):
            assert_close(o, ref[li] + 0.5, f"accumulate layer {li} validate={validate}")


@pytest.mark.parametrize("ie", ALL_IE, ids=lambda e: e.name)
def test_every_encoding_pair_round_trip(ie):
    """Deterministic coverage of all 6 x 7 pairs, each at count 0, full and random."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    for ve in ALL_VE:
        for numel in (0, 1, 37, 200):
            spec = seg_spec(rng, numel, ie, ve)
            maxc = spec["cap"] if ie in (IE.DENSE, IE.IMPLICIT) else min(spec["cap"], numel)
            for count in sorted({0, maxc, int(rng.integers(0, maxc + 1))}):
                seg, truth = fill_segment(rng, numel, spec, count=count)
                p = [LayerPayload("x", torch.Size([numel]), [seg])]
                buf = check_round_trip(p, [[truth]])
                ref = dense_reference([("x", (numel,), [spec])], [[[truth]]])[0]
                assert_close(codec.payload_to_dense(p[0]), ref, f"{ie.name}/{ve.name} {count}")
                out = torch.zeros(numel)
                accumulate(torch.stack([buf, buf]), p, [out])
                assert_close(out, 2 * ref, f"{ie.name}/{ve.name} accumulate")


def test_layout_signature_and_nbytes_host_only():
    seed = fresh_seed()
    layout = random_layout(np.random.default_rng(seed), n_layers=4)
    a, _ = fill_payloads(np.random.default_rng([seed, 0]), layout)
    b, _ = fill_payloads(np.random.default_rng([seed, 1]), layout)
    assert codec.layout_signature(a) == codec.layout_signature(b)
    assert encoded_nbytes(a) == encoded_nbytes(b) == encode(a).numel()
    # encoded_nbytes never touches data: works on payloads whose tensors are meta
    for p in a:
        for seg in p.segments:
            for f in ("values", "indices", "scales", "bin_counts", "count"):
                if getattr(seg, f) is not None:
                    setattr(seg, f, torch.empty(getattr(seg, f).shape, device="meta"))
    assert encoded_nbytes(a) == encoded_nbytes(b)
    b[0].segments[0].capacity += 1
    if b[0].segments[0].index_encoding != IE.DENSE:
        assert codec.layout_signature(b) != codec.layout_signature(a)


def test_encode_into_out_and_manual_layout():
    """Spot-check the documented byte layout on a hand-built message."""
    seg = Segment(numel=10, capacity=3, index_encoding=IE.INT32, value_encoding=VE.FP16,
                  count=torch.tensor([2, 5], dtype=torch.int32),   # [sent, selected]
                  values=torch.tensor([1.5, -2.0, 9.0], dtype=torch.float16),
                  indices=torch.tensor([7, 0, 123], dtype=torch.int32))
    seg2 = Segment(numel=10, capacity=5, index_encoding=IE.BITMASK,
                   value_encoding=VE.SIGN1, count=torch.tensor([3], dtype=torch.int32),
                   values=torch.tensor([0b010], dtype=torch.uint8),
                   indices=torch.tensor([0b0100_0001, 0b10], dtype=torch.uint8),
                   scales=torch.tensor([0.25]))
    p = [LayerPayload("w", torch.Size([2, 5]), [seg, seg2])]
    n = encoded_nbytes(p)
    data0 = H + 2 * R
    # seg: indices 12 -> 16, values 6 -> 8; seg2: mask 2 -> 8, signs 1 -> 8, scale 4 -> 8
    assert n == data0 + 16 + 8 + 8 + 8 + 8
    out = torch.full((n,), 0xAB, dtype=torch.uint8)
    res = encode(p, out=out)
    assert res.data_ptr() == out.data_ptr()
    raw = bytes(out.tolist())
    assert struct.unpack_from("<4sHHIIQ", raw, 0) == (b"HVSP", 2, R, 1, 2, n)
    rec = struct.unpack_from("<QQIIIIIBBHQQQQ", raw, H)
    assert rec == (10, data0, 2, 3, 0, 0, 0, int(IE.INT32), int(VE.FP16), 0, 12, 0, 6, 0)
    rec2 = struct.unpack_from("<QQIIIIIBBHQQQQ", raw, H + R)
    assert rec2 == (10, data0 + 24, 3, 5, 0, 0, 0, int(IE.BITMASK), int(VE.SIGN1), 0,
                    2, 0, 1, 4)
    assert struct.unpack_from("<3i", raw, data0) == (7, 0, 123)
    assert raw[data0 + 12:data0 + 16] == b"\0" * 4            # zero padding
    assert struct.unpack_from("<3e", raw, data0 + 16) == (1.5, -2.0, 9.0)
    ref = np.zeros(10)
    ref[7] += 1.5
    ref[0] += -2.0
    ref[[0, 6, 9]] += [0.25, -0.25, 0.25]                      # mask bits 0, 6, 9
    assert_close(codec.payload_to_dense(p[0]), ref, "manual")
    o = torch.zeros(10)
    accumulate(out.unsqueeze(0), p, [o])
    assert_close(o, ref, "manual accumulate")
    with pytest.raises(CodecError, match="out must be a contiguous 1-D uint8 tensor of"):
        encode(p, out=torch.empty(n + 8, dtype=torch.uint8))


@pytest.mark.parametrize("B,width", [(50, 1), (255, 1), (256, 2), (500, 2), (65535, 2),
                                     (65536, 4)])
def test_bin_counts_width_on_the_wire(B, width):
    """Bin counts travel in the smallest unsigned int that holds the bin size (uint8,
    uint16, int32; the record's section length says so); decode and accumulate read
    them back (a uint16 count >= 32768 too)."""
    rng = np.random.default_rng(B)
    nb = 3
    N = nb * B - 7
    counts = [2, 0, 3]
    big = B > 40000                 # a uint16 count with its top bit set
    if big:
        counts = [33000, 0, 3]
    rel = np.concatenate([rng.choice(min(B, N - k * B), c, replace=False)
                          for k, c in enumerate(counts)])
    ienc = IE.BIN_U8 if B <= 256 else IE.BIN_U16
    idt = torch.uint8 if ienc == IE.BIN_U8 else torch.int16
    cap = sum(counts) + 1
    vals = torch.tensor(rng.standard_normal(cap), dtype=torch.float32)
    seg = Segment(numel=N, capacity=cap, index_encoding=ienc, value_encoding=VE.FP32,
                  count=torch.tensor([sum(counts)], dtype=torch.int32), values=vals,
                  indices=torch.tensor(list(rel) + [0], dtype=torch.int64).to(idt),
                  bin_counts=torch.tensor(counts, dtype=torch.int32), bin_size=B)
    p = [LayerPayload("w", torch.Size([N]), [seg])]
    raw = bytes(encode(p).tolist())
    rec = struct.unpack_from("<QQIIIIIBBHQQQQ", raw, H)
    assert rec[11] == width * nb                          # bin-counts section length
    off = rec[1] + (-(-rec[10] // 8) * 8)
    fmt = {1: "<3B", 2: "<3H", 4: "<3i"}[width]
    assert struct.unpack_from(fmt, raw, off) == tuple(counts)
    ref = np.zeros(N)
    j = 0
    for k, c in enumerate(counts):
        for _ in range(c):
            ref[k * B + rel[j]] += float(vals[j])
            j += 1
    (d,) = codec.decode(encode(p))
    assert d.bin_counts.dtype == torch.int32 and d.bin_counts.tolist() == counts
    o = torch.zeros(N)
    accumulate(encode(p).unsqueeze(0), p, [o], validate=False,
               error_flag=torch.zeros(1, dtype=torch.int32))
    assert_close(o, ref, f"bin counts width {width}")
    o2 = torch.zeros(N)
    accumulate(encode(p).unsqueeze(0), p, [o2])                 # host-validated path
    assert_close(o2, ref, f"bin counts width {width}, validated")


def test_encode_rejects_inconsistent_payloads():
    seg, _ = fill_segment(np.random.default_rng(0), 50,
                          seg_spec(np.random.default_rng(1), 50, IE.INT32, VE.FP32), 0)
    seg.capacity = 10
    seg.values = torch.zeros(10, dtype=torch.float16)
    seg.indices = torch.zeros(10, dtype=torch.int32)
    lp = LayerPayload("lay", torch.Size([50]), [seg])
    with pytest.raises(CodecError, match=r"layer 0 \('lay'\) segment 0: values dtype "
                                         r"torch.float16, expected torch.float32"):
        encode([lp])
    seg.values = torch.zeros(9)
    with pytest.raises(CodecError, match="values has 9 elements, expected 10"):
        encode([lp])
    seg.values = torch.zeros(10)
    seg.indices = torch.zeros(10, dtype=torch.int64)
    with pytest.raises(CodecError, match="indices dtype torch.int64, expected torch.int32"):
        encode([lp])
    seg.indices = torch.zeros(10, dtype=torch.int32)
    seg.numel = 49
    with pytest.raises(CodecError, match="segment numel 49 != layer numel 50"):
        encode([lp])
    seg.numel = 50
    seg.index_encoding, seg.bin_size = IE.BIN_U8, 300
    with pytest.raises(CodecError, match="bin_size 300 invalid for BIN_U8"):
        encode([lp])
    seg.index_encoding = IE.DENSE
    with pytest.raises(CodecError, match="DENSE segment needs capacity == numel"):
        encode([lp])


# --------------------------------------------------------------------------- corruption

def _small_message(seed):
    """Two layers: BIN_U16+INT4 and BITMASK+FP32 / INT32+SIGN1, all with count > 0."""
    rng = np.random.default_rng(seed)
    specs0 = [dict(ienc=IE.BIN_U16, venc=VE.INT4, cap=12, bin_size=5, qb=4, implicit=None)]
    specs1 = [dict(ienc=IE.BITMASK, venc=VE.FP32, cap=9, bin_size=0, qb=512, implicit=None),
              dict(ienc=IE.INT32, venc=VE.SIGN1, cap=6, bin_size=0, qb=512, implicit=None)]
    layout = [("a", (23,), specs0), ("b", (19,), specs1)]
    payloads, truths = [], []
    for name, shape, specs in layout:
        segs = []
        for spec in specs:
            seg, _ = fill_segment(rng, shape[0], spec, count=spec["cap"] - 2)
            segs.append(seg)
        payloads.append(LayerPayload(name, torch.Size(shape), segs))
    return payloads, encode(payloads)


def _patch(buf, offset, fmt, value):
    b = bytearray(bytes(buf.tolist()))
    struct.pack_into(fmt, b, offset, value)
    return torch.tensor(list(b), dtype=torch.uint8)


def _offsets(payloads):
    segs, _, _ = codec_format.segment_layouts(payloads)
    return segs


CORRUPTIONS = [
    # (description, patcher(buf, payloads) -> buf, expected message regex)
    ("magic", lambda b, p: _patch(b, 0, "<4s", b"HVSQ"), r"bad magic b'HVSQ'"),
    ("version", lambda b, p: _patch(b, 4, "<H", 1), r"unsupported version 1, expected 2"),
    ("record size", lambda b, p: _patch(b, 6, "<H", 64), r"record size 64, expected 72"),
    ("total length", lambda b, p: _patch(b, 16, "<Q", b.numel() + 8),
     r"truncated buffer: header total length"),
    ("segment count", lambda b, p: _patch(b, 12, "<I", 5000), r"5000 segment records need"),
    ("layer count", lambda b, p: _patch(b, 8, "<I", 1),
     r"segment 1: layer index 1 >= layer count 1"),
    ("index encoding", lambda b, p: _patch(b, H + R + 36, "<B", 99),
     r"segment 1 \(layer 1\): unknown index encoding code 99"),
    ("value encoding", lambda b, p: _patch(b, H + 2 * R + 37, "<B", 7),
     r"segment 2 \(layer 1\): unknown value encoding code 7"),
    ("count > capacity", lambda b, p: _patch(b, H + 2 * R + 16, "<I", 7),
     r"segment 2 \(layer 1\): count 7 > capacity 6"),
    ("count u32 max", lambda b, p: _patch(b, H + 16, "<I", 2 ** 32 - 1),
     r"segment 0 \(layer 0\): count 4294967295 > capacity 12"),
    ("capacity", lambda b, p: _patch(b, H + 20, "<I", 13),
     r"segment 0 \(layer 0\): indices section length 24 inconsistent with capacity 13"),
    ("numel", lambda b, p: _patch(b, H + R, "<Q", 16),
     r"segment 1 \(layer 1\): indices section length 3 inconsistent with capacity 9 / "
     r"numel 16 / BITMASK\+FP32: expected 2"),
    ("numel same-length", lambda b, p: _patch(b, H + 2 * R, "<Q", 20),
     r"segment 2 \(layer 1\): numel 20 != numel 19 of an earlier segment"),
    ("bin size", lambda b, p: _patch(b, H + 28, "<I", 0),
     r"segment 0 \(layer 0\): bin_size 0 invalid for BIN_U16"),
    ("quant bucket", lambda b, p: _patch(b, H + R + 32, "<I", 4),
     r"segment 1 \(layer 1\): quant_bucket must be 0 for FP32, got 4"),
    ("data offset", lambda b, p: _patch(b, H + R + 8, "<Q", _offsets(p)[1].offsets[0] + 8),
     r"segment 1 \(layer 1\): data offset \d+, expected \d+"),
    ("layer order", lambda b, p: _patch(b, H + 2 * R + 24, "<I", 0),
     r"segment 2: layer index 0 < previous segment's layer 1"),
    ("reserved", lambda b, p: _patch(b, H + 38, "<H", 1), r"reserved field is 1"),
    # bins of 5 elements: the counts travel as uint8 (codec doc: bin counts)
    ("bin count too big", lambda b, p: _patch(b, _offsets(p)[0].offsets[1], "<B", 6),
     r"segment 0 \(layer 0\): bin_counts\[0\] = 6 outside \[0, 5\]"),
    ("last bin too big", lambda b, p: _patch(b, _offsets(p)[0].offsets[1] + 4, "<B", 4),
     r"bin_counts\[4\] = 4 outside \[0, 3\]"),
    ("bin counts sum", lambda b, p: _patch(b, _offsets(p)[0].offsets[1], "<B", 255),
     r"bin_counts\[0\] = 255 outside"),
    ("bin relative index", lambda b, p: _patch(b, _offsets(p)[0].offsets[0], "<H", 5),
     r"segment 0 \(layer 0\): index out of range: slot 0 has bin-relative index 5"),
    ("int32 index", lambda b, p: _patch(b, _offsets(p)[2].offsets[0], "<i", 19),
     r"segment 2 \(layer 1\): index out of range: slot 0 has index 19, layer numel 19"),
    ("negative index", lambda b, p: _patch(b, _offsets(p)[2].offsets[0] + 4, "<i", -3),
     r"index out of range: slot 1 has index -3"),
    ("bitmask tail", lambda b, p: _patch(b, _offsets(p)[1].offsets[0] + 2, "<B", 0x80),
     r"segment 1 \(layer 1\): bitmask has bits set beyond numel 19"),
]


@pytest.mark.parametrize("name,patch,msg", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corrupted_message_raises_codec_error(name, patch, msg):
    seed = fresh_seed()
    payloads, buf = _small_message(seed)
    decode(buf)                                   # the intact message is fine
    bad = patch(buf, payloads)
    assert not torch.equal(bad, buf)
    with pytest.raises(CodecError, match=msg):
        decode(bad)
    # accumulate(validate=True) reports the rank whose message is bad
    outs = [torch.zeros(p.numel) for p in payloads]
    with pytest.raises(CodecError, match=r"message of rank 1: .*" + msg.split("|")[0]):
        accumulate(torch.stack([buf, bad]), payloads, outs)


def test_bin_counts_sum_and_bitmask_popcount():
    payloads, buf = _small_message(fresh_seed())
    segs = _offsets(payloads)
    # the bin counts travel as u8 here (bins of 5): decrement the first non-zero one,
    # so every count stays in [0, bin size] and only their sum is wrong (patching a
    # 4-byte word instead made the result depend on the random counts: a zero first
    # bin borrowed into 255 and failed the range check first)
    seg0 = payloads[0].segments[0]
    assert bin_count_width(seg0.bin_size) == 1
    counts = list(bytes(buf.tolist())[segs[0].offsets[1]:segs[0].offsets[1] + 5])
    b = next(i for i, c in enumerate(counts) if c > 0)
    bad = _patch(buf, segs[0].offsets[1] + b, "<B", counts[b] - 1)
    with pytest.raises(CodecError, match=r"segment 0 \(layer 0\): bin_counts sum to \d+, "
                                         r"expected count 10"):
        decode(bad)
    # bitmask: count field != popcount
    bad = _patch(buf, H + R + 16, "<I", 6)
    with pytest.raises(CodecError, match=r"segment 1 \(layer 1\): bitmask popcount 7 != count 6"):
        decode(bad)


def test_every_truncation_raises():
    payloads, buf = _small_message(fresh_seed())
    n = buf.numel()
    for length in range(n):
        part = buf[:length].clone()
        with pytest.raises(CodecError, match="truncated buffer"):
            decode(part)
        # same, with the header's total patched to the truncated length: the record /
        # data bounds checks must catch it (never read past the end)
        if length >= H:
            forged = _patch(part, 16, "<Q", length)
            with pytest.raises(CodecError):
                decode(forged)
    with pytest.raises(CodecError, match=r"buffer length mismatch: header total length"):
        decode(torch.cat([buf, torch.zeros(8, dtype=torch.uint8)]))
    with pytest.raises(CodecError, match="expected torch.uint8"):
        decode(buf.view(torch.int32))


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.lists(st.tuples(st.integers(0, 10 ** 6),
                                                       st.integers(0, 255)), min_size=1,
                                             max_size=4))
def test_random_byte_corruption_only_codec_error(seed, flips):
    """Any byte flips: decode succeeds or raises CodecError, nothing else."""
    payloads, buf = _small_message(seed)
    b = buf.clone()
    for pos, val in flips:
        b[pos % b.numel()] = val
    try:
        decode(b)
    except CodecError:
        pass


def test_accumulate_index_out_of_range():
    payloads, buf = _small_message(fresh_seed())
    segs = _offsets(payloads)
    bad = _patch(buf, segs[2].offsets[0], "<i", 1000)          # INT32 slot 0 -> 1000
    outs = [torch.zeros(p.numel) for p in payloads]
    with pytest.raises(CodecError, match=r"message of rank 0: segment 2 \(layer 1\): index "
                                         r"out of range: slot 0 has index 1000"):
        accumulate(torch.stack([bad, buf]), payloads, outs)
    # validate=False (the no-host-sync path) reports through the device error flag, and
    # the bad (rank, segment) contributes nothing; without a flag it raises CodecError
    # naming the rank and segment (one host read)
    cases = [
        (bad, 0, 2, codec.ERR_INDEX),
        # BIN relative index >= bin size
        (_patch(buf, segs[0].offsets[0] + 2, "<H", 7), 1, 0, codec.ERR_INDEX),
        # BITMASK with fewer set bits than count
        (_patch(buf, segs[1].offsets[0], "<3s", b"\0\0\0"), 0, 1, codec.ERR_BITMASK),
        # count > capacity
        (_patch(buf, H + 2 * R + 16, "<I", 7), 1, 2, codec.ERR_COUNT),
        # bin counts that no longer sum to the count
        (_patch(buf, segs[0].offsets[1], "<B", 0), 0, 0, codec.ERR_BIN_COUNTS),
        # a record field other than count
        (_patch(buf, H + R + 32, "<I", 4), 1, None, codec.ERR_HEADER),
    ]
    for corrupt, rank, seg, code in cases:
        if torch.equal(corrupt, buf):
            continue                      # e.g. bin count already 0
        rows = torch.stack([corrupt, buf] if rank == 0 else [buf, corrupt])
        flag = torch.zeros(1, dtype=torch.int32)
        outs = [torch.zeros(p.numel) for p in payloads]
        assert accumulate(rows, payloads, outs, validate=False, error_flag=flag) is flag
        assert int(flag[0]) == code, (code, int(flag[0]))
        # what was written is the sum of the valid (rank, segment) pairs only
        ref = [torch.zeros(p.numel) for p in payloads]
        for s_, sl in enumerate(segs):
            for r in range(2):
                if r == rank and (seg is None or s_ == seg):
                    continue
                single = _single_segment_sum(payloads, buf, s_)
                ref[sl.layer] += single
        for o, r_ in zip(outs, ref):
            assert torch.allclose(o, r_, atol=1e-5), (code, o, r_)
        where = rf"message of rank {rank} segment {seg}" if seg is not None else \
            rf"message of rank {rank} segment 0"
        with pytest.raises(CodecError, match=where + r".*" + codec.ERROR_CODES[code][:20]):
            accumulate(rows, payloads, [torch.zeros(p.numel) for p in payloads],
                       validate=False)


def _single_segment_sum(payloads, buf, s):
    """Dense contribution of segment s of one (valid) message, through payload_to_dense
    of a one-segment payload decoded from the buffer."""
    dec = decode(buf)[s]
    p = payloads[dec.layer]
    lp = LayerPayload(p.name, p.shape, [dec.as_segment(
        [seg for q in payloads for seg in q.segments][s].implicit_indices)])
    return codec.payload_to_dense(lp).reshape(-1)


def test_accumulate_layout_mismatch_and_bad_args():
    payloads, buf = _small_message(fresh_seed())
    other, _ = _small_message(1)
    other[0].segments[0].quant_bucket = 2                 # 6 scales instead of 3
    with pytest.raises(CodecError, match=r"messages are \d+ bytes, the template's layout "
                                         r"needs \d+"):
        accumulate(torch.stack([buf]), other, [torch.zeros(23), torch.zeros(19)])
    # same byte length, different layout: numel 23 -> 24 keeps ceil(n/5) = 5 bins
    tmpl, _ = _small_message(2)
    tmpl[0].shape = torch.Size([24])
    for s in tmpl[0].segments:
        s.numel = 24
    assert encoded_nbytes(tmpl) == buf.numel()
    with pytest.raises(CodecError, match=r"message of rank 0 segment 0: layout differs from "
                                         r"the template: numel 23 != 24"):
        accumulate(buf.unsqueeze(0), tmpl, [torch.zeros(24), torch.zeros(19)])
    with pytest.raises(CodecError, match=r"outs\[1\] \('b'\): 18 elements, expected numel 19"):
        accumulate(buf.unsqueeze(0), payloads, [torch.zeros(23), torch.zeros(18)])
    with pytest.raises(CodecError, match=r"dtype torch.float16, expected torch.float32"):
        accumulate(buf.unsqueeze(0), payloads, [torch.zeros(23, dtype=torch.float16),
                                                torch.zeros(19)])
    with pytest.raises(CodecError, match=r"buffer of rank 1 has shape \(8,\)"):
        accumulate([buf, buf[:8]], payloads, [torch.zeros(23), torch.zeros(19)])


_TRITON_SCRIPT = r"""
import os, struct, sys
import numpy as np, torch
from tests.workers.allgather_worker import (ALL_IE, ALL_VE, assert_close, dense_reference,
                                            fill_payloads, random_layout)
from hvdsparse import codec, codec_format, ops
seed = int(sys.argv[1])
assert ops.use_triton(torch.zeros(1))
pairs = [(i, v) for i in ALL_IE for v in ALL_VE]
layout = random_layout(np.random.default_rng(seed), pairs=pairs,
                       shapes=[(int(n),) for n in np.random.default_rng(seed + 1).integers(1, 90, 42)])
ranks = [fill_payloads(np.random.default_rng([seed, r]), layout) for r in range(2)]
bufs = torch.stack([codec.encode(p) for p, _ in ranks])
template = ranks[0][0]
ref = dense_reference(layout, [t for _, t in ranks])
flag = torch.zeros(1, dtype=torch.int32)
outs = [torch.zeros(p.numel) for p in template]
codec.accumulate(bufs, template, outs, validate=False, error_flag=flag)
assert int(flag[0]) == 0, flag
for li, (o, r) in enumerate(zip(outs, ref)):
    assert_close(o, r, f"triton accumulate layer {li}")
for li, lp in enumerate(template):
    assert_close(codec.payload_to_dense(lp), dense_reference(layout, [ranks[0][1]])[li],
                 f"triton payload_to_dense layer {li}")
# corrupt: INT32 index out of range in rank 1 -> flag 1; count > capacity -> flag 2
segs, _, _ = codec_format.segment_layouts(template)
s = next(k for k, sl in enumerate(segs) if sl.ienc == codec.IndexEncoding.INT32 and sl.capacity)
bad = bufs.clone()
struct_bytes = torch.tensor(list(struct.pack("<i", 10 ** 6)), dtype=torch.uint8)
bad[1, segs[s].offsets[0]:segs[s].offsets[0] + 4] = struct_bytes
rec = codec.HEADER_SIZE + codec.RECORD_SIZE * s + 16
bad[1, rec:rec + 4] = torch.tensor(list(struct.pack("<I", segs[s].capacity)), dtype=torch.uint8)
flag.zero_()
codec.accumulate(bad, template, [torch.zeros(p.numel) for p in template], validate=False,
                 error_flag=flag)
assert int(flag[0]) == 1, flag
bad[1, rec:rec + 4] = torch.tensor(list(struct.pack("<I", segs[s].capacity + 1)), dtype=torch.uint8)
flag.zero_()
codec.accumulate(bad, template, [torch.zeros(p.numel) for p in template], validate=False,
                 error_flag=flag)
assert int(flag[0]) & 2, flag
print("TRITON-CODEC-OK")
"""


def test_accumulate_through_triton_interpreter():
    """The validate=False path through the Triton scatter kernel (TRITON_INTERPRET=1 on
    CPU, in a subprocess so triton is imported with the interpreter on): all 42 encoding
    pairs, strided [P, nbytes] row views, error flag for a bad index and a bad count."""
    import subprocess
    import sys
    from pathlib import Path
    pytest.importorskip("triton")
    seed = fresh_seed()
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", HVDSPARSE_FORCE_TRITON="1",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT, str(seed)], cwd=str(root),
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "TRITON-CODEC-OK" in proc.stdout, proc.stdout[-4000:]


def test_encode_and_trusted_accumulate_never_sync(monkeypatch):
    """encode (first call per layout included: the header image upload) and
    accumulate(validate=False) on the forced-Triton path issue no op that would block
    the host on CUDA (HostSyncDetector: item/tolist/nonzero/masked_select/bool-mask
    indexing/equal/cpu()), also on corrupt messages that set the flag; an unseen
    layout is used so the cached-image path is exercised from empty."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    from tests.workers.sync_worker import HostSyncDetector
    monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    pairs = [(i, VE.FP32) for i in ALL_IE] + [(IE.INT32, VE.INT4), (IE.BIN_U8, VE.SIGN1)]
    layout = random_layout(rng, pairs=pairs, shapes=[(int(n) + 1000 * (seed % 7),) for n in
                                                     rng.integers(1, 40, len(pairs))])
    ranks = [fill_payloads(np.random.default_rng([seed, r]), layout) for r in range(2)]
    template = ranks[0][0]
    outs = [torch.zeros(p.numel) for p in template]
    flag = torch.zeros(1, dtype=torch.int32)
    segs = _offsets(template)
    det = HostSyncDetector()
    with det:
        det.phase = "encode"
        bufs = [codec.encode(p) for p, _ in ranks]
        out = codec.new_message(template)
        codec.encode(template, out=out)
        det.phase = "accumulate"
        bad = torch.stack(bufs)
        bad[1, H + 16:H + 20] = 0xFF                         # count of segment 0 > capacity
        bad[0, 8] ^= 1                                       # header layer count
        codec.accumulate(bad, template, outs, validate=False, error_flag=flag)
        det.phase = None
    assert det.hvd_ops["accumulate"] > 0 and det.hvd_ops["encode"] > 0
    assert not det.records, [(r["phase"], r["reason"], r["site"]) for r in det.records]
    assert int(flag[0]) & codec.ERR_HEADER and int(flag[0]) & codec.ERR_COUNT, int(flag[0])
    assert torch.equal(out, bufs[0]) and len(segs) == len(pairs)


def test_wire_defect_regressions():
    """The decode defects found by the first mutation run, one by
    one: each now decodes correctly or is reported (CodecError / error flag)."""
    rng = np.random.default_rng(fresh_seed())
    # a valid message with a 0-element layer and bin-relative indices, both paths
    specs = [dict(ienc=IE.BIN_U8, venc=VE.FP32, cap=0, bin_size=7, qb=512, implicit=None),
             dict(ienc=IE.BIN_U16, venc=VE.INT4, cap=0, bin_size=3, qb=8, implicit=None)]
    spec_b = dict(ienc=IE.BITMASK, venc=VE.SIGN1, cap=5, bin_size=0, qb=512, implicit=None)
    layout = [("empty", (0,), specs), ("b", (13,), [spec_b]),
              ("c", (9,), [dict(ienc=IE.INT32, venc=VE.FP32, cap=0, bin_size=0, qb=512,
                                implicit=None)])]
    (payloads, truths) = fill_payloads(rng, layout)
    buf = encode(payloads)
    ref = dense_reference(layout, [truths, truths])
    for validate in (True, False):
        outs = [torch.zeros(p.numel) for p in payloads]
        accumulate(torch.stack([buf, buf]), payloads, outs, validate=validate)
        for o, r in zip(outs, ref):
            assert_close(o, r, f"0-element layer validate={validate}")
    # unaligned views (a slice of a larger buffer at offset 3) decode like aligned ones
    n = buf.numel()
    big = torch.zeros(3 + 2 * n, dtype=torch.uint8)
    big[3:].view(2, n).copy_(torch.stack([buf, buf]))
    decode(big[3:3 + n])
    for bufs_arg in (big[3:].view(2, n), [big[3:3 + n], big[3 + n:]]):
        for validate in (True, False):
            outs = [torch.zeros(p.numel) for p in payloads]
            accumulate(bufs_arg, payloads, outs, validate=validate)
            for o, r in zip(outs, ref):
                assert_close(o, r, f"unaligned validate={validate}")
    # count > capacity on a capacity-0 segment: CodecError / flag 2 on the trusted path
    bad = _patch(buf, H + 3 * R + 16, "<I", 1)            # segment 3: INT32, capacity 0
    outs = [torch.zeros(p.numel) for p in payloads]
    with pytest.raises(CodecError, match=r"message of rank 1: segment 3 .*count 1 > "
                                         r"capacity 0"):
        accumulate(torch.stack([buf, bad]), payloads, outs)
    flag = torch.zeros(1, dtype=torch.int32)
    accumulate(torch.stack([bad, buf]), payloads, outs, validate=False, error_flag=flag)
    assert int(flag[0]) == codec.ERR_COUNT
    # bin counts on the trusted path: a (sum-preserving) move beyond a bin's size
    spec = dict(ienc=IE.BIN_U8, venc=VE.FP32, cap=6, bin_size=4, qb=512, implicit=None)
    (p2, _) = fill_payloads(rng, [("x", (10,), [spec])])
    p2[0].segments[0].count.fill_(4)
    p2[0].segments[0].bin_counts.copy_(torch.tensor([2, 1, 1], dtype=torch.int32))
    p2[0].segments[0].indices[:4] = torch.tensor([0, 1, 2, 0], dtype=torch.uint8)
    b2 = encode(p2)
    off = _offsets(p2)[0].offsets[1]
    flag.zero_()
    o = torch.zeros(10)
    accumulate(b2.unsqueeze(0), p2, [o], validate=False, error_flag=flag)
    assert int(flag[0]) == 0
    # uint8 counts (bins of 4): (255, 4, 1) sums to 4 modulo 256 -- must not pass
    for bcs in ((4, 0, 0), (0, 0, 4), (3, 0, 1), (255, 4, 1)):  # last bin holds only 2
        moved = _patch(_patch(_patch(b2, off, "<B", bcs[0]), off + 1, "<B", bcs[1]),
                       off + 2, "<B", bcs[2])
        flag.zero_()
        o = torch.zeros(10)
        accumulate(moved.unsqueeze(0), p2, [o], validate=False, error_flag=flag)
        ok = bcs[0] <= 4 and bcs[2] <= 2 and min(bcs) >= 0
        assert bool(int(flag[0])) != ok, (bcs, int(flag[0]))
        if not ok:
            assert int(flag[0]) == codec.ERR_BIN_COUNTS and not o.any()
        with pytest.raises(CodecError) if not ok else contextlib.nullcontext():
            accumulate(moved.unsqueeze(0), p2, [torch.zeros(10)])
    # non-tensor rows, bool rows, zero rows (with a BITMASK segment): CodecError, both paths
    outs = [torch.zeros(p.numel) for p in payloads]
    for arg, msg in (([buf, None], r"buffer of rank 1 is a NoneType"),
                     ([buf, bytes(n)], r"buffer of rank 1 is a bytes"),
                     (42, r"got int"),
                     ([buf, buf.bool()], r"buffer of rank 1 has dtype torch.bool"),
                     (torch.stack([buf, buf]).bool(), r"buffers dtype torch.bool"),
                     (torch.empty(0, n, dtype=torch.uint8), r"no messages \(0 rows\)"),
                     ([], r"no buffers")):
        for validate in (True, False):
            with pytest.raises(CodecError, match=msg):
                accumulate(arg, payloads, outs, validate=validate)


def test_uncached_temporaries_decode_alike(monkeypatch):
    """Above codec_slots._CACHE_ELEMS the slot / index temporaries are allocated per call
    instead of cached: same sums either way (all encodings, both paths)."""
    seed = fresh_seed()
    layout = random_layout(np.random.default_rng(seed), pairs=[(i, VE.FP32) for i in ALL_IE],
                           shapes=[(60,)] * 6)
    ranks = [fill_payloads(np.random.default_rng([seed, r]), layout) for r in range(3)]
    rows = torch.stack([encode(p) for p, _ in ranks])
    template = ranks[0][0]
    sums = {}
    for limit in (codec_slots._CACHE_ELEMS, 4):
        monkeypatch.setattr(codec_slots, "_CACHE_ELEMS", limit)
        for validate in (True, False):
            outs = [torch.zeros(p.numel) for p in template]
            flag = torch.zeros(1, dtype=torch.int32)
            accumulate(rows, template, outs, validate=validate,
                       error_flag=None if validate else flag)
            assert int(flag[0]) == 0
            sums[(limit, validate)] = torch.cat(outs)
    first = next(iter(sums.values()))
    assert all(torch.equal(v, first) for v in sums.values())
    assert_close(first, np.concatenate(dense_reference(layout, [t for _, t in ranks])),
                 "uncached")


@pytest.mark.parametrize("ie", ALL_IE, ids=lambda e: e.name)
def test_sent_positions_and_momentum_masking(ie):
    """``codec.sent_positions`` (used by DGC's momentum masking) names exactly the
    elements of the generator's truth, for every index encoding and count (0, full,
    random); ``ops.zero_slots`` (the CPU path here) zeroes exactly those and nothing
    else."""
    from hvdsparse.ops import zero_slots as _zero_slots
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    for ve in ALL_VE:
        for numel in (1, 37, 200):
            spec = seg_spec(rng, numel, ie, ve)
            maxc = spec["cap"] if ie in (IE.DENSE, IE.IMPLICIT) else min(spec["cap"], numel)
            for count in sorted({0, maxc, int(rng.integers(0, maxc + 1))}):
                seg, (idx, _) = fill_segment(rng, numel, spec, count=count)
                p = LayerPayload("x", torch.Size([numel]), [seg])
                (positions, cnt), = codec.sent_positions(p)
                u = torch.randn(numel) + 10.0          # no zeros before masking
                before = u.clone()
                assert positions.dtype == torch.int32 and cnt.dtype == torch.int32
                assert int(cnt[0]) == count
                got = positions[:count].tolist()
                assert sorted(got) == sorted(int(i) for i in idx), \
                    f"{ie.name}/{ve.name} count {count}"
                want = set(got)
                _zero_slots(u, positions, cnt)
                for i in range(numel):
                    expect = 0.0 if i in want else float(before[i])
                    assert float(u[i]) == expect, f"{ie.name}/{ve.name} element {i}"
