"""INT32 indices narrowed on the wire (``Segment.narrow_indices``,
``hvdsparse.payload.wire_indexing``): the sparsifiers' absolute int32 indices travel as
uint16 positions inside bins of ``min(numel, 65536)`` elements plus one count per bin,
with the used slots sorted by index.

Checked against an independent rule and reference, on fresh random data (seed printed):

* the narrowed message is exactly as much shorter as the documented rule says, its
  records say BIN_U16 with that bin size, and an independent numpy parse of its
  sections gives back the used (index, value) pairs, sorted by index;
* every decode path (``accumulate`` validated / trusted, on the CPU and through the
  Triton kernels) gives bit for bit the sums of the same payloads sent un-narrowed
  (garbage in the padding slots included), and the stats' byte accounting agrees;
* what cannot be narrowed is not (quantised values, no flag, not shorter);
* a used index outside the layer is still rejected (validated: CodecError; trusted:
  the bin-count flag, nothing added);
* encode issues no host-synchronising op (dispatch-mode detector);
* the compressors that set the flag (TopK, the bucket path, Threshold, RandomK, Slim-DP's
  explorer) send narrowed messages that decode to their own payloads.
"""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch

from hvdsparse import RandomK, SlimDP, Threshold, TopK, codec, stats
from hvdsparse.codec import CodecError, accumulate, decode, encode, encoded_nbytes
from hvdsparse.payload import IndexEncoding, ValueEncoding
from tests.workers.allgather_worker import fill_payloads

IE, VE = IndexEncoding, ValueEncoding
FLOATS = [VE.FP32, VE.FP16, VE.BF16]
SIZES = [1, 2, 7, 300, 65535, 65536, 65537, 200003]
REC = struct.Struct("<QQIIIIIBBHQQQQ")


def fresh_seed() -> int:
    seed = int(os.environ.get("HVDSPARSE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={seed} (replay: HVDSPARSE_TEST_SEED={seed})")
    return seed


def _al8(n):
    return (n + 7) // 8 * 8


def _rule(N, C):
    """The documented rule, written again: (narrowed?, bin size, saved bytes)."""
    if N < 1 or C < 1:
        return False, 0, 0
    B = min(N, 65536)
    w = 1 if B <= 255 else 2 if B <= 65535 else 4
    nb = -(-N // B)
    if 2 * C + w * nb >= 4 * C:
        return False, 0, 0
    return True, B, _al8(4 * C) - _al8(2 * C) - _al8(w * nb)


def _layout(rng, n_layers):
    layout = []
    for li in range(n_layers):
        N = int(rng.choice(SIZES))
        C = int(rng.integers(1, min(N, 3000) + 1))
        ve = FLOATS[int(rng.integers(3))]
        layout.append((f"l{li}", (N,), [dict(ienc=IE.INT32, venc=ve, cap=C, bin_size=0,
                                              qb=512, implicit=None)]))
    return layout


def _payloads(rng, layout, narrow):
    pl, truth = fill_payloads(rng, layout)
    for p in pl:
        for s in p.segments:
            s.narrow_indices = narrow
    return pl, truth


def _parse(buf: np.ndarray, nseg):
    """Records of a message, by hand."""
    return [REC.unpack_from(buf, 24 + 72 * s) for s in range(nseg)]


@pytest.mark.parametrize("triton", [False, True], ids=["cpu", "triton"])
def test_narrowed_messages_decode_to_the_unnarrowed_sums(monkeypatch, triton):
    if triton:
        pytest.importorskip("triton")
        monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    else:
        monkeypatch.delenv("HVDSPARSE_FORCE_TRITON", raising=False)
    seed = fresh_seed()
    for trial in range(4 if triton else 12):
        rng_layout = np.random.default_rng([seed, trial])
        layout = _layout(rng_layout, int(rng_layout.integers(1, 4)))
        P = int(rng_layout.integers(1, 4))
        ranks_n = [_payloads(np.random.default_rng([seed, trial, r]), layout, True)
                   for r in range(P)]
        ranks_w = [_payloads(np.random.default_rng([seed, trial, r]), layout, False)
                   for r in range(P)]
        where = f"seed {seed} trial {trial}"
        narrow = torch.stack([encode(p) for p, _ in ranks_n])
        wide = torch.stack([encode(p) for p, _ in ranks_w])
        # lengths and records: the documented rule
        saved = sum(_rule(sh[0], sp[0]["cap"])[2] for _, sh, sp in layout)
        assert narrow.shape[1] == wide.shape[1] - saved == encoded_nbytes(ranks_n[0][0]), where
        for r, (pl, truth) in enumerate(ranks_n):
            buf = narrow[r].numpy()
            recs = _parse(buf, len(layout))
            for li, ((_, (N,), (sp,)), rec) in enumerate(zip(layout, recs)):
                numel, off, count, cap, layer, B, Q, ie, ve, _, il, bl, vl, sl = rec
                ok, want_b, _ = _rule(N, sp["cap"])
                assert (ie, B) == ((IE.BIN_U16, want_b) if ok else (IE.INT32, 0)), where
                idx_true, val_true = truth[li][0]
                assert count == len(idx_true), where
                if not ok:
                    continue
                # independent parse: bin counts, then uint16 positions, then values
                w = 1 if B <= 255 else 2 if B <= 65535 else 4
                cdt = {1: np.uint8, 2: np.uint16, 4: np.int32}[w]
                ind_off = off
                bc_off = ind_off + _al8(il)
                v_off = bc_off + _al8(bl)
                bc = np.frombuffer(buf[bc_off:bc_off + bl].tobytes(), cdt).astype(np.int64)
                rel = np.frombuffer(buf[ind_off:ind_off + 2 * count].tobytes(), np.uint16)
                assert bc.sum() == count, where
                bins = np.repeat(np.arange(len(bc)), bc)
                got_idx = bins * B + rel.astype(np.int64)
                order = np.argsort(idx_true)
                # bins ascend; inside a bin the Triton encoder's order is free
                # (kernels/bucket_narrow.py), the CPU encoder's ascends
                mine_order = np.argsort(got_idx, kind="stable") if triton else \
                    np.arange(count)
                assert np.array_equal(got_idx[mine_order], idx_true[order]), where
                vdt = {VE.FP32: np.float32, VE.FP16: np.float16, VE.BF16: np.uint16}[VE(ve)]
                vals = np.frombuffer(buf[v_off:v_off + vl].tobytes(), vdt)[:count]
                seg = pl[li].segments[0]
                mine = seg.values[:count].contiguous().view(
                    torch.int16 if seg.values.element_size() == 2 else torch.int32).numpy()
                assert np.array_equal(vals.view(mine.dtype)[mine_order], mine[order]), where
        # sums: every decode path, bit for bit the un-narrowed messages' sums
        for validate in (True, False):
            if triton and validate:
                continue
            outs_n = [torch.zeros(N) for _, (N,), _ in layout]
            outs_w = [torch.zeros(N) for _, (N,), _ in layout]
            flag = torch.zeros(1, dtype=torch.int32)
            accumulate(narrow, ranks_n[0][0], outs_n, validate=validate,
                       error_flag=None if validate else flag)
            accumulate(wide, ranks_w[0][0], outs_w, validate=validate)
            assert int(flag[0]) == 0, where
            for a, b in zip(outs_n, outs_w):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), where
        # the stats count what travels (sections unpadded + the count word)
        for p in ranks_n[0][0]:
            seg = p.segments[0]
            d = decode(encode([p]))[0]
            il = {IE.INT32: 4, IE.BIN_U16: 2}[d.index_encoding] * d.capacity
            bl = 0 if d.bin_counts is None else \
                (1 if d.bin_size <= 255 else 2 if d.bin_size <= 65535 else 4) * d.bin_counts.numel()
            assert stats.segment_nbytes(seg) == 4 + il + bl + d.values.numel() * \
                d.values.element_size(), where


def test_what_is_not_narrowed():
    rng = np.random.default_rng(fresh_seed())
    cases = [(IE.INT32, VE.INT4, 500, 10000, True),        # quantised values
             (IE.INT32, VE.FP32, 500, 10000, False),       # no flag
             (IE.INT32, VE.FP32, 1, 10 ** 6, True),        # 16 bins x 4 bytes for 1 slot
             (IE.INT32, VE.FP16, 0, 300, True)]            # capacity 0
    for ie, ve, cap, N, flag in cases:
        layout = [("l", (N,), [dict(ienc=ie, venc=ve, cap=cap, bin_size=0, qb=64,
                                    implicit=None)])]
        pl, _ = _payloads(rng, layout, flag)
        d = decode(encode(pl))[0]
        assert d.index_encoding == IE.INT32, (ie, ve, cap, N, flag)
        assert stats.segment_nbytes(pl[0].segments[0]) == 4 + 4 * cap + \
            d.values.numel() * d.values.element_size() + \
            (0 if d.scales is None else 4 * d.scales.numel())


@pytest.mark.parametrize("triton", [False, True], ids=["cpu", "triton"])
@pytest.mark.parametrize("bad", [-1, "N", "N+70000"])
def test_a_used_index_outside_the_layer_is_still_rejected(monkeypatch, bad, triton):
    if triton:                     # the one-launch encoder (kernels/bucket_narrow.py)
        pytest.importorskip("triton")
        monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    else:
        monkeypatch.delenv("HVDSPARSE_FORCE_TRITON", raising=False)
    rng = np.random.default_rng(fresh_seed())
    N = int(rng.choice([300, 65536, 200003]))
    layout = [("l", (N,), [dict(ienc=IE.INT32, venc=VE.FP32, cap=50, bin_size=0, qb=512,
                                implicit=None)])]
    pl, _ = fill_payloads(rng, layout)
    seg = pl[0].segments[0]
    seg.narrow_indices = True
    seg.count.fill_(50)
    seg.indices[:50] = torch.from_numpy(rng.permutation(N)[:50].astype(np.int32))
    seg.indices[int(rng.integers(50))] = {-1: -1, "N": N, "N+70000": N + 70000}[bad]
    good = fill_payloads(np.random.default_rng(1), layout)[0]
    good[0].segments[0].narrow_indices = True
    rows = torch.stack([encode(good), encode(pl)])
    if not triton:
        with pytest.raises(CodecError, match="rank 1"):
            accumulate(rows, good, [torch.zeros(N)], validate=True)
    flag = torch.zeros(1, dtype=torch.int32)
    out = torch.zeros(N)
    accumulate(rows, good, [out], validate=False, error_flag=flag)
    assert int(flag[0]) & codec.ERR_BIN_COUNTS, int(flag[0])
    only_good = torch.zeros(N)
    accumulate(rows[:1], good, [only_good], validate=not triton,
               error_flag=None if not triton else torch.zeros(1, dtype=torch.int32))
    assert torch.equal(out, only_good)      # the bad rank's segment added nothing


def test_encode_narrowed_never_syncs(monkeypatch):
    pytest.importorskip("triton")
    from tests.workers.sync_worker import HostSyncDetector
    monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    # a layout no other test made (first encode builds the scratch buffers)
    layout = [("a", (70001 + seed % 1000,), [dict(ienc=IE.INT32, venc=VE.FP32, cap=700,
                                                  bin_size=0, qb=512, implicit=None)]),
              ("b", (3001 + seed % 997,), [dict(ienc=IE.INT32, venc=VE.BF16, cap=40,
                                                bin_size=0, qb=512, implicit=None)])]
    pl, _ = _payloads(rng, layout, True)
    det = HostSyncDetector()
    with det:
        det.phase = "encode"
        encode(pl)
        out = codec.new_message(pl)
        encode(pl, out=out)
        det.phase = None
    assert det.hvd_ops["encode"] > 0
    assert not det.records, [(r["phase"], r["reason"], r["site"]) for r in det.records]
    assert decode(out)[0].index_encoding == IE.BIN_U16


COMPRESSORS = {
    "topk": lambda: TopK(0.01, output_ratio=None, seed=1),
    "topk_exact_bf16": lambda: TopK(0.01, exact=True, values="bf16", output_ratio=None, seed=1),
    "threshold": lambda: Threshold(0.99, output_ratio=None, seed=1),
    "randomk": lambda: RandomK(0.01, shared_seed=False, seed=1),
    "slimdp": lambda: SlimDP(0.05, 0.02, core_period=10, seed=1),   # step 0: dense push
}


@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
def test_compressors_send_narrowed_messages(kind):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    shapes = [("w1", (300, 400)), ("w2", (64, 70))]
    comp = COMPRESSORS[kind]()
    comp.register_layers(shapes)
    comp.bind(0, 2, broadcast=lambda t, name: t)
    narrowed = 0
    for step in range(3):
        comp.begin_step(step)
        pls = [comp.compress(n, torch.randn(s, generator=g), step, param=torch.randn(s))
               for n, s in shapes]
        buf = encode(pls)
        narrowed += sum(d.index_encoding == IE.BIN_U16 for d in decode(buf))
        outs = [torch.zeros(p.numel) for p in pls]
        accumulate(buf.unsqueeze(0), pls, outs, validate=True)
        for p, o in zip(pls, outs):
            want = codec.payload_to_dense(p).reshape(-1)
            assert torch.equal(o, want), (kind, seed, step, p.name)
    assert narrowed >= 2, (kind, seed, narrowed)
