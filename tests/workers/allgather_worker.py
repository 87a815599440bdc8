"""Random payload generator, independent dense reference, and the horovodrun worker that
allgathers encoded messages (run by tests/test_allgather_hvd.py with ``-np 2``).

The generator keeps the ground truth of every segment (absolute element index and
decoded value of every used slot) computed with plain numpy, without hvdsparse's codec
or ops, so the codec's decoders are checked against an independent reference. The value
of a quantised code is decoded here by a tiny decoder written from the documented format
(code of slot j in byte ``j*b//8`` at bit ``(j*b)%8``, ``v = (code - 2^(b-1)) *
scale[j//Q] / (2^(b-1)-1)``); SIGN1 bit j%8 of byte j//8, 1 = negative.

Worker checks (each rank):
1. message 1: same layout on all ranks (shared seed), different data per rank
   (per-rank seeds); ``hvd.allgather`` of the encoded buffers; every gathered row is
   byte-identical to the encoding of that rank's regenerated payloads; ``accumulate``
   (tensor [P, n] form, list form, validate=False) equals the numpy sum over ranks.
2. message 2: per-rank layouts (different capacities / encodings, same layer shapes),
   so encoded lengths differ: ``hvd.allgather`` with unequal first dims, split by the
   allgathered per-rank sizes, ``decode`` each part, check its layout signature, sum the
   ``payload_to_dense`` of every rank's decoded segments and compare to the reference.
3. strategies: ``exchange.launch`` + ``finish`` of every strategy (allgather, split with
   fp32 / 8-bit / 4-bit dense ranges, fp16 pairs, dense fp32 / fp16) on fresh random
   payloads, three steps per case with densities from very sparse to full (so split
   takes its sparse and its dense / quantised ranges), validate=True and False: the sum
   equals the numpy reference (exactly up to fp32 summation; within the quantisation /
   fp16 bound where the wire rounds), is bitwise identical on every rank, the
   cost-model figures are identical on every rank and ``deferred_figures.get()``
   equals ``figures``; reused buffers: a step's result is still intact after the next
   step's launch of *another* bucket, and two buckets never share a buffer.
"""
from __future__ import annotations

import os
import sys
from typing import List

import numpy as np
import torch

from hvdsparse.payload import (FLOAT_DTYPES, QUANT_BITS, IndexEncoding, LayerPayload, Segment,
                               ValueEncoding)

IE, VE = IndexEncoding, ValueEncoding
ALL_IE = list(IndexEncoding)
ALL_VE = list(ValueEncoding)


# --------------------------------------------------------------------------- layout

def seg_spec(rng: np.random.Generator, numel: int, ienc, venc) -> dict:
    """Host-known description of one segment (capacity, bin size, quant bucket,
    implicit indices), drawn at random for the encoding pair."""
    ienc, venc = IE(ienc), VE(venc)
    if ienc == IE.DENSE:
        cap = numel
    elif ienc == IE.INT32:
        cap = int(rng.integers(0, numel + 4))         # may exceed numel
    else:
        cap = int(rng.integers(0, numel + 1))
    spec = dict(ienc=ienc, venc=venc, cap=cap, bin_size=0, qb=512, implicit=None)
    if ienc == IE.BIN_U8:
        spec["bin_size"] = int(rng.choice([1, 2, 7, 16, 100, 256]))
    elif ienc == IE.BIN_U16:
        spec["bin_size"] = int(rng.choice([1, 3, 64, 257, 1000, 65536]))
    elif ienc == IE.IMPLICIT:
        spec["implicit"] = rng.permutation(numel)[:cap].astype(np.int64)
    if venc in QUANT_BITS:
        spec["qb"] = int(rng.choice([1, 3, 8, 32, 512]))
    return spec


def random_layout(rng: np.random.Generator, n_layers: int = 3, max_numel: int = 300,
                  shapes=None, pairs=None) -> list:
    """[(name, shape, [spec, ...]), ...]; ``shapes`` fixes the layer shapes, ``pairs``
    (list of (ienc, venc) per segment, flattened over layers) fixes the encodings."""
    layout = []
    k = 0
    for li in range(n_layers if shapes is None else len(shapes)):
        if shapes is None:
            numel = int(rng.choice([1, int(rng.integers(1, max_numel + 1))]))
            shape = (numel,) if rng.random() < 0.5 or numel % 2 else (2, numel // 2)
        else:
            shape = tuple(shapes[li])
        numel = int(np.prod(shape))
        nseg = 1 if pairs is not None else int(rng.integers(1, 3))
        specs = []
        for _ in range(nseg):
            if pairs is not None:
                ienc, venc = pairs[k % len(pairs)]
            else:
                ienc, venc = ALL_IE[rng.integers(len(ALL_IE))], ALL_VE[rng.integers(len(ALL_VE))]
            k += 1
            specs.append(seg_spec(rng, numel, ienc, venc))
        layout.append((f"layer{li}", shape, specs))
    return layout


# --------------------------------------------------------------------------- data

def _decode_code(codes: np.ndarray, scales: np.ndarray, bits: int, qb: int, j: int) -> float:
    byte = int(codes[(j * bits) // 8])
    code = (byte >> ((j * bits) % 8)) & ((1 << bits) - 1)
    q = code - (1 << (bits - 1))
    s = (1 << (bits - 1)) - 1
    return float(np.float32(np.float32(q) * np.float32(scales[j // qb])) / np.float32(s))


def fill_segment(rng: np.random.Generator, numel: int, spec: dict, count=None):
    """(Segment, truth) with random data; truth = (abs_idx int64[count], vals f64[count])."""
    ienc, venc, cap = spec["ienc"], spec["venc"], spec["cap"]
    maxc = cap if ienc in (IE.DENSE, IE.IMPLICIT) else min(cap, numel)
    if count is None:
        count = int(rng.integers(0, maxc + 1))
    assert 0 <= count <= maxc
    # ---- indices
    indices = bin_counts = None
    if ienc == IE.DENSE:
        abs_idx = np.arange(count, dtype=np.int64)
    elif ienc == IE.IMPLICIT:
        abs_idx = spec["implicit"][:count].copy()
    elif ienc == IE.INT32:
        abs_idx = rng.permutation(numel)[:count].astype(np.int64)
        arr = rng.integers(-2 ** 31, 2 ** 31, size=cap).astype(np.int32)  # garbage padding
        arr[:count] = abs_idx
        indices = torch.from_numpy(arr)
    elif ienc in (IE.BIN_U8, IE.BIN_U16):
        L = spec["bin_size"]
        nbins = -(-numel // L)
        chosen = rng.permutation(numel)[:count]
        # sorted by bin, arbitrary order inside a bin
        order = np.lexsort((rng.random(count), chosen // L))
        abs_idx = chosen[order].astype(np.int64)
        bc = np.bincount(abs_idx // L, minlength=nbins).astype(np.int32)
        rel = np.empty(cap, dtype=np.int64)
        rel[:] = rng.integers(0, 256 if ienc == IE.BIN_U8 else 65536, size=cap)
        rel[:count] = abs_idx % L
        if ienc == IE.BIN_U8:
            indices = torch.from_numpy(rel.astype(np.uint8))
        else:
            indices = torch.from_numpy(rel.astype(np.uint16).view(np.int16))
        bin_counts = torch.from_numpy(bc)
    else:  # BITMASK
        abs_idx = np.sort(rng.permutation(numel)[:count]).astype(np.int64)
        bits = np.zeros(-(-numel // 8) * 8, dtype=np.uint8)
        bits[abs_idx] = 1
        indices = torch.from_numpy(np.packbits(bits, bitorder="little"))
    # ---- values
    scales = None
    if venc in FLOAT_DTYPES:
        values = torch.randn(cap, generator=torch.Generator().manual_seed(
            int(rng.integers(2 ** 62)))).to(FLOAT_DTYPES[venc])
        vals = values[:count].double().numpy()
    elif venc in QUANT_BITS:
        b, qb = QUANT_BITS[venc], spec["qb"]
        codes = rng.integers(0, 256, size=-(-cap * b // 8)).astype(np.uint8)
        sc = rng.uniform(0.1, 2.0, size=-(-cap // qb)).astype(np.float32)
        values, scales = torch.from_numpy(codes), torch.from_numpy(sc)
        vals = np.array([_decode_code(codes, sc, b, qb, j) for j in range(count)])
    else:  # SIGN1
        signs = rng.integers(0, 256, size=-(-cap // 8)).astype(np.uint8)
        sc = np.array([rng.uniform(0.1, 2.0)], dtype=np.float32)
        values, scales = torch.from_numpy(signs), torch.from_numpy(sc)
        vals = np.array([-float(sc[0]) if (signs[j // 8] >> (j % 8)) & 1 else float(sc[0])
                         for j in range(count)])
    seg = Segment(numel=numel, capacity=cap, index_encoding=ienc, value_encoding=venc,
                  count=torch.tensor([count], dtype=torch.int32), values=values,
                  indices=indices, scales=scales, bin_counts=bin_counts,
                  bin_size=spec["bin_size"], quant_bucket=spec["qb"],
                  implicit_indices=None if spec["implicit"] is None
                  else torch.from_numpy(spec["implicit"].copy()))
    return seg, (abs_idx, np.asarray(vals, dtype=np.float64))


def fill_payloads(rng: np.random.Generator, layout, device="cpu"):
    """(list[LayerPayload], truths[layer][segment])."""
    payloads, truths = [], []
    for name, shape, specs in layout:
        numel = int(np.prod(shape))
        segs, tr = [], []
        for spec in specs:
            seg, t = fill_segment(rng, numel, spec)
            segs.append(seg)
            tr.append(t)
        if device != "cpu":
            for seg in segs:
                for f in ("count", "values", "indices", "scales", "bin_counts",
                          "implicit_indices"):
                    if getattr(seg, f) is not None:
                        setattr(seg, f, getattr(seg, f).to(device))
        payloads.append(LayerPayload(name, torch.Size(shape), segs))
        truths.append(tr)
    return payloads, truths


def dense_reference(layout, truths_per_rank) -> List[np.ndarray]:
    """float64 dense sum over ranks (plain Python loop over the truth)."""
    outs = [np.zeros(int(np.prod(shape))) for _, shape, _ in layout]
    for truths in truths_per_rank:
        for li, tr in enumerate(truths):
            for abs_idx, vals in tr:
                for i, v in zip(abs_idx.tolist(), vals.tolist()):
                    outs[li][i] += v
    return outs


def assert_close(got: torch.Tensor, ref: np.ndarray, what: str):
    g = got.detach().cpu().double().reshape(-1).numpy()
    if g.shape != ref.shape or not np.allclose(g, ref, rtol=1e-5, atol=1e-5):
        bad = np.nonzero(~np.isclose(g, ref, rtol=1e-5, atol=1e-5))[0] if g.shape == ref.shape \
            else "shape"
        raise AssertionError(f"{what}: mismatch at {bad if isinstance(bad, str) else bad[:10]}"
                             f"\n got {g[:20]}\n ref {ref[:20]}")


# --------------------------------------------------------------------------- worker

def main():
    import horovod.torch as hvd
    from hvdsparse import codec

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    draw = os.environ.get("HVDSPARSE_TEST_SEED") or int.from_bytes(os.urandom(4), "little")
    seed = torch.tensor([int(draw) if rank == 0 else 0],
                        dtype=torch.int64)
    seed = int(hvd.broadcast(seed, root_rank=0, name="seed").item())
    print(f"rank {rank}: base seed {seed}", flush=True)

    # ---------------- message 1: shared layout, per-rank data
    pairs = [(i, v) for i in ALL_IE for v in ALL_VE]           # all 42 combinations
    layout = random_layout(np.random.default_rng(seed), max_numel=200, pairs=pairs,
                           shapes=[(int(n),) for n in
                                   np.random.default_rng(seed + 1).integers(1, 120, 42)])
    def rank_data(r):
        return fill_payloads(np.random.default_rng([seed, 1, r]), layout)
    mine, _ = rank_data(rank)
    buf = codec.encode(mine)
    assert buf.numel() == codec.encoded_nbytes(mine)
    gathered = hvd.allgather(buf.unsqueeze(0), name="msg1")
    assert gathered.shape == (size, buf.numel()), gathered.shape
    all_truths = []
    for r in range(size):
        pr, tr = rank_data(r)
        all_truths.append(tr)
        expect = codec.encode(pr)
        assert torch.equal(gathered[r], expect), f"gathered row {r} != encoding of rank {r}"
    assert any(not torch.equal(gathered[0], gathered[r]) for r in range(1, size)), \
        "all ranks sent identical messages: the test would not see a mix-up"
    ref = dense_reference(layout, all_truths)
    for form, validate in (("tensor", True), ("list", True), ("tensor", False)):
        outs = [torch.zeros(p.numel) for p in mine]
        bufs = gathered if form == "tensor" else list(gathered.unbind(0))
        codec.accumulate(bufs, mine, outs, validate=validate)
        for li, (o, rf) in enumerate(zip(outs, ref)):
            assert_close(o, rf, f"msg1 accumulate({form}, validate={validate}) layer {li}")
    print(f"rank {rank}: message 1 ok ({buf.numel()} bytes x {size})", flush=True)

    # ---------------- message 2: per-rank layouts -> unequal lengths
    shapes = [(int(n),) for n in np.random.default_rng(seed + 2).integers(1, 300, 6)]
    draw = [0]
    def rank_layout(r):
        return random_layout(np.random.default_rng([seed, 2, r, draw[0]]), shapes=shapes)
    def rank_data2(r):
        return fill_payloads(np.random.default_rng([seed, 3, r, draw[0]]), rank_layout(r))
    # the first draw whose encoded lengths differ across ranks (every rank computes all
    # ranks' messages, so all pick the same draw): equal lengths happen by chance
    while size > 1 and len({codec.encode(rank_data2(r)[0]).numel()
                            for r in range(size)}) == 1:
        draw[0] += 1
        assert draw[0] < 100, "no draw with unequal message lengths"
    mine2, _ = rank_data2(rank)
    buf2 = codec.encode(mine2)
    sizes = hvd.allgather(torch.tensor([buf2.numel()], dtype=torch.int64), name="sizes")
    flat = hvd.allgather(buf2, name="msg2")
    sizes = sizes.tolist()
    assert flat.numel() == sum(sizes), (flat.numel(), sizes)
    assert len(set(sizes)) > 1 or size == 1, f"lengths should differ per rank: {sizes}"
    parts = torch.split(flat, sizes)
    total = [torch.zeros(int(np.prod(s))) for s in shapes]
    truths2 = []
    for r, part in enumerate(parts):
        pr, tr = rank_data2(r)
        truths2.append(tr)
        dec = codec.decode(part)
        assert codec.layout_signature(pr) == tuple(
            (p.numel, tuple((d.numel, d.capacity, int(d.index_encoding), int(d.value_encoding),
                             d.bin_size, d.quant_bucket)
                            for d in dec if d.layer == li)) for li, p in enumerate(pr)), \
            f"rank {r}: decoded layout != its layout"
        flat_tmpl = [seg for p in pr for seg in p.segments]
        for d, tseg in zip(dec, flat_tmpl):
            seg = d.as_segment(implicit_indices=tseg.implicit_indices)
            lp = LayerPayload("x", torch.Size([d.numel]), [seg])
            total[d.layer] += codec.payload_to_dense(lp)
    ref2 = dense_reference([(n, s, None) for n, s, _ in rank_layout(0)], truths2)
    for li, (o, rf) in enumerate(zip(total, ref2)):
        assert_close(o, rf, f"msg2 layer {li}")
    print(f"rank {rank}: message 2 ok (sizes {sizes})", flush=True)

    strategies_check(hvd, rank, size, seed)
    print(f"rank {rank}: strategies ok", flush=True)
    split_trusted_flag_check(hvd, rank, size, seed)
    print(f"rank {rank}: split trusted flag ok", flush=True)
    fp16_sum_overflow_check(hvd, rank, size, seed)
    print(f"rank {rank}: fp16 sum overflow ok", flush=True)
    hvd.shutdown()
    print(f"HVDSPARSE-OK rank={rank}", flush=True)


def _fill_dense_payloads(rng, layout, density):
    """Payloads whose used slots cover about ``density`` of each layer (capacities from
    the layout; counts drawn so that the union across ranks ranges sparse..dense)."""
    payloads, truths = [], []
    for name, shape, specs in layout:
        numel = int(np.prod(shape))
        segs, tr = [], []
        for spec in specs:
            maxc = spec["cap"] if spec["ienc"] in (IE.DENSE, IE.IMPLICIT) \
                else min(spec["cap"], numel)
            count = min(maxc, int(round(density * maxc)))
            seg, t = fill_segment(rng, numel, spec, count=count)
            segs.append(seg)
            tr.append(t)
        payloads.append(LayerPayload(name, torch.Size(shape), segs))
        truths.append(tr)
    return payloads, truths


def strategies_check(hvd, rank, size, seed):
    from hvdsparse import exchange
    from hvdsparse.exchange import BucketSpec, ExchangeContext
    cases = [("allgather", {}, [(IE.INT32, VE.FP32), (IE.BIN_U8, VE.INT8), (IE.DENSE, VE.FP16)]),
             ("split", {}, [(IE.INT32, VE.FP32), (IE.BIN_U16, VE.SIGN1)]),
             ("split", dict(split_dense_bits=8), [(IE.INT32, VE.FP32)]),
             ("split", dict(split_dense_bits=4, quant_bucket=64), [(IE.INT32, VE.FP32)]),
             ("split", {}, [(IE.INT32, VE.FP16)]),
             ("dense", {}, [(IE.INT32, VE.FP32), (IE.BITMASK, VE.BF16)]),
             ("dense", dict(dense_dtype=torch.float16, gradient_predivide_factor=2.0),
              [(IE.INT32, VE.FP32)])]
    for ci, (strategy, kw, pairs) in enumerate(cases):
        for validate in (True, False):
            shapes = [(int(n),) for n in np.random.default_rng([seed, 4, ci]).integers(50, 400, 3)]
            lay_rng = np.random.default_rng([seed, 5, ci])
            layout = random_layout(lay_rng, shapes=shapes, pairs=pairs)
            if strategy == "split" and kw.get("split_dense_bits"):
                # capacities of at least the layer (numel .. numel + 3): at density 1.0
                # every rank covers every element, so every owner range is dense and must
                # take the quantised mode, whatever the seed (a random capacity could
                # leave the union below the switch point on every step)
                for _, shp, specs in layout:
                    for sp in specs:
                        sp["cap"] = max(sp["cap"], int(np.prod(shp)))
            spec = BucketSpec.build(ci, [n for n, _, _ in layout],
                                    [int(np.prod(s)) for _, s, _ in layout])
            other = BucketSpec.build(100 + ci, ["x"], [7])
            prev, quantised = None, 0
            for step, density in enumerate((0.02, 0.5, 1.0)):
                ctx = ExchangeContext(rank=rank, world_size=size, prefix=f"t3.{int(validate)}",
                                      step=step, validate=validate, want_figures=True,
                                      error_flag=None if validate else
                                      torch.zeros(1, dtype=torch.int32), **kw)
                data = [_fill_dense_payloads(np.random.default_rng([seed, 6, ci, step, r]),
                                             layout, density) for r in range(size)]
                pend = exchange.launch(strategy, spec, data[rank][0], ctx)
                got = pend.finish()
                assert got.numel() == spec.numel
                ref = np.concatenate(dense_reference(layout, [t for _, t in data]))
                what = f"strategy {strategy} {kw} validate={validate} step {step}"
                g = got.double().numpy()
                if strategy == "split" and kw.get("split_dense_bits"):
                    bits = kw["split_dense_bits"]
                    modes = pend.figures["range_modes"]
                    # quantised ranges: |error| <= one level = max|range| / (2^(b-1)-1)
                    tol = np.abs(ref).max() / (2 ** (bits - 1) - 1) + 1e-6
                    assert np.abs(g - ref).max() <= tol, (what, np.abs(g - ref).max(), tol)
                    quantised += modes["quantised"]
                elif strategy == "split" and pairs[0][1] == VE.FP16 or \
                        kw.get("dense_dtype") == torch.float16:
                    assert np.allclose(g, ref, rtol=2e-3, atol=2e-3), what
                else:
                    assert_close(got, ref, what)
                if strategy == "split" and density == 0.02:
                    assert pend.figures["range_modes"]["sparse"] == size, pend.figures
                if not validate:
                    assert int(ctx.error_flag[0]) == 0, what
                # identical on every rank, bit for bit; figures identical too
                allg = hvd.allgather(got.reshape(1, -1).clone(), name=f"t3.res.{ci}.{validate}.{step}")
                assert all(torch.equal(allg[0], allg[r]) for r in range(size)), what
                figs = {k: v for k, v in pend.figures.items() if k in ("pairs", "reduced")}
                assert figs, (what, pend.figures)
                assert pend.deferred_figures is not None and \
                    pend.deferred_figures.get() == figs, (what, figs)
                everyone = hvd.allgather_object(figs, name=f"t3.fig.{ci}.{validate}.{step}")
                assert all(f == figs for f in everyone), (what, everyone)
                # the previous step's result of this bucket was overwritten (reuse) but a
                # launch of another bucket leaves this step's result alone
                snap = got.clone()
                op = exchange.launch(strategy, other, [_tiny_payload()], ctx)
                op.finish()
                assert torch.equal(got, snap), f"{what}: another bucket wrote into the result"
                if prev is not None:
                    assert prev.data_ptr() == got.data_ptr(), f"{what}: result buffer not reused"
                prev = got
            if strategy == "split" and kw.get("split_dense_bits"):
                # the dense step (density 1.0: every element on every rank) took the
                # quantised mode in every owner range
                assert quantised >= size, f"split {kw}: {quantised} ranges travelled quantised"


def split_trusted_flag_check(hvd, rank, size, seed):
    """Trusted path (validate=False): rank 1 corrupts the first pair it sends to owner 0
    (index moved into owner 1's range, as when ranks disagree on the layout). Owner 0
    must drop exactly that pair and set the codec's index bit in its device flag; every
    other element is summed as usual, and all ranks end with the same sum (owner 0's
    range, as it sent it). Nothing else is flagged."""
    from hvdsparse import exchange
    from hvdsparse.exchange import BucketSpec, ExchangeContext
    N = 64
    vals = [torch.from_numpy(np.random.default_rng([seed, 7, r]).standard_normal(N)
                             .astype(np.float32)) + 3.0 for r in range(size)]   # no zeros

    def payload(r):
        seg = Segment(numel=N, capacity=N, index_encoding=IE.DENSE, value_encoding=VE.FP32,
                      count=torch.tensor([N], dtype=torch.int32), values=vals[r].clone())
        return LayerPayload("w", torch.Size([N]), [seg])
    orig = hvd.alltoall_async

    def corrupting(tensor, splits=None, name=None, **kw):
        if rank == 1 and name is not None and name.endswith(".a2a") and int(splits[0]) > 0:
            tensor = tensor.clone()
            tensor[0, :4] = torch.tensor([N - 1], dtype=torch.int32).view(torch.uint8)
        return orig(tensor, splits=splits, name=name, **kw)
    hvd.alltoall_async = corrupting
    try:
        flag = torch.zeros(1, dtype=torch.int32)
        ctx = ExchangeContext(rank=rank, world_size=size, prefix="t4", step=0, validate=False,
                              error_flag=flag)
        got = exchange.launch("split", BucketSpec.build(0, ["w"], [N]), [payload(rank)],
                              ctx).finish()
    finally:
        hvd.alltoall_async = orig
    ref = sum(v.double() for v in vals)
    ref[0] -= vals[1][0].double()            # rank 1's pair (0, v) never reached owner 0
    assert np.allclose(got.double().numpy(), ref.numpy(), rtol=1e-6, atol=1e-6), \
        (got[:4], ref[:4])
    expect_flag = 1 if rank == 0 else 0
    assert int(flag[0]) == expect_flag, (rank, int(flag[0]))
    allg = hvd.allgather(got.reshape(1, -1).clone(), name="t4.res")
    assert all(torch.equal(allg[0], allg[r]) for r in range(size))


def fp16_sum_overflow_check(hvd, rank, size, seed):
    """fp16 pairs whose *sum* leaves fp16's range: every rank sends finite fp16 values
    (a compressor saturates them at 65504), but at planted positions the ranks' values
    share a sign and add up past 65504. ``split`` and ``balanced`` carry the reduced
    sums in the pairs' dtype, so a plain cast would deliver +-inf to every rank where
    ``allgather`` (fp32 sums) delivers the right value. Every strategy must deliver
    finite sums equal to the exact sum within fp16 rounding (rtol 2^-10), bitwise
    identical on every rank, with validate on and off, and the sparse range mode must
    survive (the fix scales the message, it does not fall back to dense)."""
    from hvdsparse import exchange
    from hvdsparse.exchange import BucketSpec, ExchangeContext
    N, K = 600, 200
    rng = np.random.default_rng([seed, 8])                    # shared: same positions
    hot = rng.choice(N, size=12, replace=False)
    hot_sign = np.where(rng.random(12) < 0.5, -1.0, 1.0)
    sel = np.union1d(hot, rng.choice(N, size=K - 40, replace=False))

    def values(r):
        g = np.random.default_rng([seed, 9, r])
        v = g.standard_normal(N)
        v[hot] = hot_sign * g.uniform(4.0e4, 65504.0, hot.size)
        return torch.from_numpy(v).to(torch.float16)        # finite fp16 on every rank
    mine = values(rank)
    assert torch.isfinite(mine).all()
    ref = sum(values(r).double() for r in range(size))
    assert ref.abs().max() > 65504.0 * 1.5, "the planted sums must leave fp16's range"

    def dense_payload():
        seg = Segment(numel=N, capacity=N, index_encoding=IE.DENSE, value_encoding=VE.FP16,
                      count=torch.tensor([N], dtype=torch.int32), values=mine.clone())
        return LayerPayload("w", torch.Size([N]), [seg])

    def sparse_payload():
        idx = torch.from_numpy(sel.astype(np.int32))
        seg = Segment(numel=N, capacity=K, index_encoding=IE.INT32, value_encoding=VE.FP16,
                      count=torch.tensor([sel.size], dtype=torch.int32),
                      indices=torch.cat([idx, torch.zeros(K - sel.size, dtype=torch.int32)]),
                      values=torch.cat([mine[idx.long()],
                                        torch.zeros(K - sel.size, dtype=torch.float16)]))
        return LayerPayload("w", torch.Size([N]), [seg])
    ref_sparse = torch.zeros(N, dtype=torch.float64)
    ref_sparse[sel] = ref[sel]
    for strategy in ("allgather", "split", "balanced"):
        for form, make, want in (("dense", dense_payload, ref), ("sparse", sparse_payload,
                                                                  ref_sparse)):
            if strategy == "balanced" and form == "sparse":
                continue          # capacity < N: balanced may truncate (its own tests)
            for validate in (True, False):
                flag = None if validate else torch.zeros(1, dtype=torch.int32)
                ctx = ExchangeContext(rank=rank, world_size=size, step=0, validate=validate,
                                      prefix=f"t5.{strategy}.{form}.{int(validate)}",
                                      error_flag=flag)
                pend = exchange.launch(strategy, BucketSpec.build(0, ["w"], [N]), [make()],
                                       ctx)
                got = pend.finish()
                what = f"{strategy} {form} validate={validate} seed {seed}"
                assert torch.isfinite(got).all(), \
                    f"{what}: non-finite sum delivered at {torch.nonzero(~torch.isfinite(got)).reshape(-1)[:6].tolist()}"
                err = (got.double() - want).abs()
                tol = want.abs() * 2.0 ** -10 + 1e-6
                assert (err <= tol).all(), (what, float((err - tol).max()))
                if strategy == "split" and form == "sparse":
                    assert pend.figures["range_modes"]["sparse"] == size, (what, pend.figures)
                if flag is not None:
                    assert int(flag[0]) == 0, what
                allg = hvd.allgather(got.reshape(1, -1).clone(),
                                     name=f"t5.res.{strategy}.{form}.{int(validate)}")
                assert all(torch.equal(allg[0], allg[r]) for r in range(size)), what
    # a corrupt shift (rank 1's phase-2 message claims e = 500) is rejected on the
    # validated path by every rank, naming the field
    for strategy, suffix, coll, at in (("split", ".ranges", "alltoall_async", 12),
                                       ("balanced", ".gather", "allgather_async", 24)):
        orig = getattr(hvd, coll)

        def corrupting(tensor, *a, name=None, _orig=orig, _suffix=suffix, _at=at, **kw):
            if rank == 1 and name is not None and name.endswith(_suffix):
                # split's alltoall carries one copy of the message per receiver
                copies = size if _suffix == ".ranges" else 1
                tensor = tensor.clone().view(copies, -1)
                tensor[:, _at:_at + 4] = torch.tensor([500], dtype=torch.int32).view(torch.uint8)
                tensor = tensor.reshape(-1)
            return _orig(tensor, *a, name=name, **kw)
        setattr(hvd, coll, corrupting)
        try:
            ctx = ExchangeContext(rank=rank, world_size=size, step=0, validate=True,
                                  prefix=f"t6.{strategy}")
            pend = exchange.launch(strategy, BucketSpec.build(0, ["w"], [N]),
                                   [sparse_payload() if strategy == "split"
                                    else dense_payload()], ctx)
            try:
                pend.finish()
            except RuntimeError as e:
                assert "shift" in str(e) and "500" in str(e), (strategy, str(e))
                # the sender is named: split "of rank 1", balanced "owner(s) [1]"
                assert ("rank 1" if strategy == "split" else "owner(s) [1]") in str(e), \
                    (strategy, str(e))
            else:
                raise AssertionError(f"{strategy}: a corrupt value shift was accepted")
        finally:
            setattr(hvd, coll, orig)


def _tiny_payload():
    seg = Segment(numel=7, capacity=7, index_encoding=IE.DENSE, value_encoding=VE.FP32,
                  count=torch.tensor([7], dtype=torch.int32), values=torch.ones(7))
    return LayerPayload("x", torch.Size([7]), [seg])


if __name__ == "__main__":
    sys.exit(main())
