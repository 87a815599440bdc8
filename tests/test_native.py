"""The compiled CPU loops (``hvdsparse/native``): their table layout is the Triton
kernels' one, they build once per source and compiler, and when they cannot be used the
CPU path says why and keeps the per-layer numpy path (same bits: test_bucket_topk.py,
test_paths_agree.py)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _py(code: str, env: dict, cwd=ROOT) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full.pop("HVDSPARSE_FORCE_TRITON", None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=300)


def _native_on_off(code: str, prefix: str):
    """Run ``code`` (argv[1] = a fresh seed) with the compiled loops on and off; returns
    the output lines starting with ``prefix`` of both (skips when unavailable)."""
    seed = str(int.from_bytes(os.urandom(3), "little"))
    runs = [subprocess.run([sys.executable, "-c", code, seed], cwd=ROOT, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "HVDSPARSE_NATIVE": v})
            for v in ("1", "0")]
    on, off = runs
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    if "native True" not in on.stdout:
        pytest.skip(f"compiled CPU loops unavailable: {on.stdout}")
    assert "native False" in off.stdout
    return ([ln for ln in r.stdout.splitlines() if ln.startswith(prefix)] for r in runs)


def test_table_layout_is_the_triton_kernels_layout():
    from hvdsparse import native, ops
    if not native.available():
        pytest.skip(f"compiled CPU loops unavailable: {native.why_unavailable()}")
    nat = native.bucket_topk()
    tri = ops._kernels().bucket_topk
    # ROUTE_FRESH (Threshold's refresh rows, an exact radix select) exists on the Triton
    # path only: the CPU never plans such a row, and its code is no CPU route's
    triton_only = {"ROUTE_FRESH"}
    cols = [c for c in dir(tri) if c.startswith(("C_", "MODE_", "ROUTE_"))
            and c not in triton_only] + ["W"]
    assert len(cols) > 20
    assert {c: getattr(nat, c) for c in cols} == {c: getattr(tri, c) for c in cols}
    cpu_routes = {getattr(nat, c) for c in dir(nat) if c.startswith("ROUTE_")}
    assert all(getattr(tri, c) not in cpu_routes for c in triton_only)


PLAN = textwrap.dedent("""
    import logging, torch
    logging.basicConfig(level=logging.WARNING)
    from hvdsparse import native
    from hvdsparse.compressors import TopK
    from hvdsparse.compressors import topk_bucket as TB
    comp = TopK(0.01, output_ratio=None)
    comp.register_layers([("w", (600, 500))])
    g = torch.randn(600, 500)
    print("available", native.available())
    print("why", native.why_unavailable())
    print("plan", TB.layer_plan(comp, "w", g, 0) is not None)
""")


def test_switched_off_the_cpu_path_stays_per_layer():
    r = _py(PLAN, {"HVDSPARSE_NATIVE": "0"})
    assert r.returncode == 0, r.stderr
    assert "available False" in r.stdout and "why HVDSPARSE_NATIVE=0" in r.stdout
    assert "plan False" in r.stdout


def test_failed_build_is_reported_once_and_the_cpu_path_stays_per_layer(tmp_path):
    # a "compiler" that fails with a message: the warning must carry it
    cc = tmp_path / "broken-cc"
    cc.write_text("#!/bin/sh\necho 'broken-cc: no such toolchain' >&2\nexit 3\n")
    cc.chmod(0o755)
    r = _py(PLAN + "\nprint('again', native.available())\n",
            {"CC": str(cc), "HVDSPARSE_NATIVE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    assert "available False" in r.stdout and "plan False" in r.stdout
    assert "again False" in r.stdout
    assert r.stderr.count("compiled CPU loops are unavailable") == 1, r.stderr
    assert "broken-cc: no such toolchain" in r.stderr
    assert not list((tmp_path / "cache").glob("*.so"))     # nothing half-written kept


def test_built_once_per_source_and_reused(tmp_path):
    cache = tmp_path / "cache"
    code = PLAN + "\nimport hvdsparse.native as n; print('lib', n._state['lib']._name)\n"
    r1 = _py(code, {"HVDSPARSE_NATIVE_CACHE": str(cache)})
    assert r1.returncode == 0, r1.stderr
    if "available False" in r1.stdout:
        pytest.skip(f"compiled CPU loops unavailable: {r1.stdout}")
    assert "plan True" in r1.stdout
    libs = list(cache.glob("*.so"))
    assert len(libs) == 1
    stamp = libs[0].stat().st_mtime_ns
    r2 = _py(code, {"HVDSPARSE_NATIVE_CACHE": str(cache)})
    assert r2.returncode == 0, r2.stderr
    assert list(cache.glob("*.so")) == libs and libs[0].stat().st_mtime_ns == stamp
    assert [ln for ln in r1.stdout.splitlines() if ln.startswith("lib")] == \
        [ln for ln in r2.stdout.splitlines() if ln.startswith("lib")]


def test_bad_arguments_are_rejected_by_name():
    import torch
    from hvdsparse import native
    from hvdsparse.compressors.threshold import ladder_factors
    if not native.available():
        pytest.skip(f"compiled CPU loops unavailable: {native.why_unavailable()}")
    K = native.bucket_topk()
    with pytest.raises(ValueError, match="columns"):
        K.accumulate(torch.zeros((2, K.W + 1), dtype=torch.int64), None, None, 0)
    with pytest.raises(ValueError, match="table must be a contiguous CPU"):
        K.accumulate(torch.zeros((2, K.W), dtype=torch.int32), None, None, 0)
    with pytest.raises(ValueError, match="fp32 gradients only"):
        K.accumulate(torch.zeros((2, K.W), dtype=torch.int64), None, None, 1)
    with pytest.raises(ValueError, match="grad_scale"):
        K.accumulate(torch.zeros((1, K.W), dtype=torch.int64), None,
                     torch.ones(1, dtype=torch.float64), 0)
    with pytest.raises(ValueError, match="fp32 values only"):
        K.threshold_and_select(torch.zeros((1, K.W), dtype=torch.int64), None, 1, 8, 4, 2,
                               16, 1, ladder_factors("cpu"))
    with pytest.raises(ValueError, match="ladder"):
        K.threshold_and_select(torch.zeros((1, K.W), dtype=torch.int64), None, 1, 8, 4, 2,
                               16, 0, ladder_factors("cpu").double())


def _rows_in_message(g, P, cap, N):
    """P rows of (int32 index, fp32 value) laid out as strided views into one uint8
    message, as codec.accumulate hands them over; indices ascending per row, rows
    overlapping (the same index in several rows)."""
    import torch
    pool = torch.randperm(N, generator=g)[:max(1, cap * 2)]
    ind = torch.stack([pool[torch.randperm(pool.numel(), generator=g)[:cap]].sort().values
                       for _ in range(P)]).to(torch.int32)
    vals = torch.randn(P, cap, generator=g) * 2.0 ** torch.randint(-20, 20, (P, 1),
                                                                    generator=g).float()
    width = 8 * cap + 24                      # bytes per row: indices, values, a gap
    msg = torch.full((P, width), 0xAB, dtype=torch.uint8)
    msg[:, :4 * cap] = ind.view(torch.uint8).reshape(P, -1)
    msg[:, 4 * cap + 8:8 * cap + 8] = vals.view(torch.uint8).reshape(P, -1)
    return msg[:, :4 * cap].view(torch.int32), msg[:, 4 * cap + 8:8 * cap + 8].view(
        torch.float32)


def test_scatter_add_matches_index_add_row_by_row():
    import torch
    from hvdsparse import native
    if not native.available():
        pytest.skip(f"compiled CPU loops unavailable: {native.why_unavailable()}")
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for _ in range(5):
        N = int(torch.randint(1, 5000, (1,), generator=g))
        P, cap = int(torch.randint(1, 6, (1,), generator=g)), int(
            torch.randint(0, min(N, 700) + 1, (1,), generator=g))
        ind, vals = _rows_in_message(g, P, cap, N)
        assert ind.stride(0) != cap                     # strided views, not copies
        counts = [int(torch.randint(0, cap + 1, (1,), generator=g)) for _ in range(P)]
        base = torch.randn(N, generator=g)
        want = base.clone()
        for p in range(P):                   # the definition: rows in order
            want.index_add_(0, ind[p, :counts[p]].long(), vals[p, :counts[p]])
        got = base.clone()
        assert native.scatter_add_f32(got, ind, counts, vals) is None
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_top_m_gives_torch_topk_values():
    """The radix select that replaced ``torch.topk`` on the bucket path's sample: the
    same values, sorted, on fresh magnitudes, heavy ties, all zeros, -1 padding,
    subnormals with +inf, NaN (sorted first, as torch.topk does) and the boundary bin
    refined down to its last bits."""
    import torch
    from hvdsparse import native
    if not native.available():
        pytest.skip(f"compiled CPU loops unavailable: {native.why_unavailable()}")
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for trial in range(120):
        L = int(torch.randint(1, 4, (1,), generator=g))
        n = int(torch.randint(1, 5000, (1,), generator=g))
        m = int(torch.randint(1, n + 1, (1,), generator=g))
        S = torch.randn(L, n, generator=g).abs()
        kind = trial % 7
        if kind == 1:
            S = torch.randint(0, 4, (L, n), generator=g).float()
        elif kind == 2:
            S[:, int(torch.randint(0, n, (1,), generator=g)):] = -1.0
        elif kind == 3:
            S = torch.zeros(L, n)
        elif kind == 4:
            S = S * 1e-40
            S[0, 0] = float("inf")
        elif kind == 5:
            S[0, ::3] = float("nan")
        elif kind == 6:      # one exponent, neighbouring mantissas: the last bits decide
            S = (1.0 + torch.randint(0, 64, (L, n), generator=g).float() * 2.0 ** -23)
        want = torch.topk(S, m, dim=1, sorted=True).values
        got = native.top_m(S.contiguous(), m)
        assert got.shape == want.shape
        assert torch.equal(got.isnan(), want.isnan()), (trial, kind)
        assert torch.equal(torch.nan_to_num(got, 7.0).view(torch.int32),
                           torch.nan_to_num(want, 7.0).view(torch.int32)), (trial, kind)
    with pytest.raises(ValueError, match="m must be in"):
        native.top_m(torch.rand(2, 5), 6)
    with pytest.raises(ValueError, match="S must be"):
        native.top_m(torch.rand(5), 2)


def test_scatter_add_rejects_a_bad_index_and_writes_nothing():
    import torch
    from hvdsparse import cpu, native
    if not native.available():
        pytest.skip(f"compiled CPU loops unavailable: {native.why_unavailable()}")
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    N, P, cap = 3000, 3, 200
    ind, vals = _rows_in_message(g, P, cap, N)
    for bad_row, bad_slot, value in ((2, 17, N), (1, 0, -1), (0, cap - 1, 2 ** 31 - 1)):
        i2 = ind.clone()
        i2[bad_row, bad_slot] = value
        i2[bad_row, bad_slot + 1:] = N + 5           # later bad slots: the first is named
        base = torch.randn(N, generator=g)
        d = base.clone()
        assert native.scatter_add_f32(d, i2, [cap] * P, vals) == (bad_row, bad_slot)
        assert torch.equal(d, base)
        with pytest.raises(IndexError, match=f"index {value} at row {bad_row}, slot "
                                             f"{bad_slot}"):
            cpu.scatter_add_decode(d, i2, torch.full((P, 1), cap, dtype=torch.int32), vals)
        assert torch.equal(d, base)
    with pytest.raises(ValueError, match="counts"):
        native.scatter_add_f32(torch.zeros(N), ind, [cap + 1] * P, vals)
    with pytest.raises(ValueError, match="indices must be a CPU torch.int32"):
        native.scatter_add_f32(torch.zeros(N), ind.long(), [cap] * P, vals)


def test_decode_switched_off_gives_the_same_bits(tmp_path):
    """codec.accumulate of real TopK messages: compiled decode vs HVDSPARSE_NATIVE=0."""
    code = textwrap.dedent("""
        import sys, torch
        from hvdsparse import codec, native
        from hvdsparse.compressors import TopK
        g = torch.Generator().manual_seed(int(sys.argv[1]))
        shapes = [("a", (300, 64)), ("b", (64, 512)), ("c", (10, 64))]
        msgs = []
        for r in range(3):
            c = TopK(0.02, seed=r)
            c.register_layers(shapes)
            pays = [c.compress(n, torch.randn(s, generator=g), 0) for n, s in shapes]
            msgs.append(codec.encode(pays))
        outs = [torch.zeros(torch.Size(s).numel()) for _, s in shapes]
        codec.accumulate(torch.stack(msgs), pays, outs)
        print("native", native.available())
        import hashlib
        print("sum", [hashlib.sha256(o.numpy().tobytes()).hexdigest() for o in outs],
              [int((o != 0).sum()) for o in outs])
    """)
    s_on, s_off = _native_on_off(code, "sum")
    assert s_on == s_off and s_on


def test_philox_uniform_is_the_numpy_stream():
    """hvdsparse/native/philox.c against philox.py's numpy Philox (itself tested against
    the textbook oracle in test_oracle.py), bit for bit: fresh seeds (high key word
    included), offsets across 2**32 (the counter's high word), odd lengths."""
    import numpy as np
    import torch
    from hvdsparse import native, philox
    if not native.available():
        pytest.skip(f"compiled CPU loops unavailable: {native.why_unavailable()}")
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    scratch = philox.philox_scratch()
    for seed, off in [(int(torch.randint(0, 2 ** 62, (1,), generator=g)) * 2 + 1,
                       2 ** 32 - 1000), (int(torch.randint(0, 2 ** 31, (1,), generator=g)), 0),
                      (2 ** 63 - 1, int(torch.randint(0, 2 ** 40, (1,), generator=g)))]:
        n = int(torch.randint(1, 20000, (1,), generator=g))
        got = np.full(n, np.nan, np.float32)
        native.philox_uniform(seed, off, got)
        want = np.empty(n, np.float32)
        for s in range(0, n, philox.PHILOX_CHUNK):
            e = min(s + philox.PHILOX_CHUNK, n)
            ctr = np.arange(off + s, off + e, dtype=np.uint64)
            w = want[s:e].view(np.uint32)
            philox._philox_np_block(seed, ctr, w, scratch)
            philox._uint32_to_uniform_np(w, want[s:e], np.empty(e - s, np.int32))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (seed, off, n)
        assert float(got.min()) >= 0.0 and float(got.max()) < 1.0


ADACOMP = textwrap.dedent(r"""
    import hashlib, sys, torch
    from hvdsparse import native
    from hvdsparse.compressors import AdaComp
    g = torch.Generator().manual_seed(int(sys.argv[1]))
    shapes = [("fc", (600, 500)), ("conv", (32, 16, 3, 3)), ("vec", (7777,)),
              ("big", (3, 70001))]
    comp = AdaComp(compress_1d=True, seed=1)
    comp.register_layers(shapes)
    h = hashlib.sha256()
    for step in range(4):
        comp.begin_step(step)
        for n, s in shapes:
            x = torch.randn(s, generator=g) * torch.exp(torch.randn(s, generator=g))
            if n == "fc" and step == 1:             # non-finite elements: skipped, counted
                x.view(-1)[7] = float("nan")
                x.view(-1)[900] = float("-inf")
            if n == "vec":                          # whole bins of ties: lower index first
                x.view(-1)[:3000] = 1.0
                if step == 3:        # no gradient: |h| == |G| == the bin max passes (>=)
                    x.view(-1)[:1000] = 0.0
            gs = torch.tensor([0.5]) if step == 2 else None     # AMP's inverse scale
            nf = torch.zeros(1, dtype=torch.int32)
            seg = comp.compress(n, x, step, nonfinite=nf, grad_scale=gs).segments[0]
            for t in (seg.count, seg.values, seg.indices, seg.scales, seg.bin_counts,
                      comp.residual(n), nf):
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
            h.update(str(comp.stats()[n]["selected"]).encode())
        comp.commit()
    print("native", native.available())
    print("digest", h.hexdigest())
""")


def test_adacomp_compiled_loop_gives_the_numpy_bits():
    """AdaComp's CPU compress with the compiled accumulate + selection (adacomp.c)
    against the numpy route (HVDSPARSE_NATIVE=0), on fresh data: payload (counts, sign
    bits, bin-relative indices, scale, bin counts), residual, non-finite count and the
    selected statistic, over steps with NaN / -Inf elements, an AMP scale and bins full of
    ties."""
    d_on, d_off = _native_on_off(ADACOMP, "digest")
    assert d_on == d_off and d_on


def test_adacomp_layer_budget_gives_the_numpy_bits():
    """The same with a layer budget (``mean_per_bin=2.5``: every layer's bins want more
    than it holds): the compiled selection cut to the quota (binned.trim_to_quota) ==
    the numpy selection cut the same way."""
    code = ADACOMP.replace("AdaComp(compress_1d=True, seed=1)",
                           "AdaComp(compress_1d=True, seed=1, mean_per_bin=2.5)")
    assert code != ADACOMP
    d_on, d_off = _native_on_off(code, "digest")
    assert d_on == d_off and d_on


def test_bin_slot_indices_follow_the_codec_rule(monkeypatch):
    """native.bin_slot_indices against codec_slots.slot_indices's torch rule (the compiled
    loops switched off for the reference), on fresh rows: uint8 and uint16 bin-relative
    indices, well-formed bin counts and malformed ones (negative, past the capacity,
    relative indices >= the bin size, indices past the layer)."""
    import types
    import torch
    from hvdsparse import codec, codec_slots, native
    from hvdsparse.payload import IndexEncoding
    if not native.available():
        pytest.skip(f"compiled CPU loops unavailable: {native.why_unavailable()}")
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for B, ienc, dt in ((50, IndexEncoding.BIN_U8, torch.uint8),
                        (500, IndexEncoding.BIN_U16, torch.int16)):
        for malformed in (False, True):
            P, nb, c = 3, int(torch.randint(1, 40, (1,), generator=g)), 4
            N = nb * B - int(torch.randint(0, B, (1,), generator=g))
            C = nb * c
            bc = torch.randint(0, c + 1, (P, nb), generator=g, dtype=torch.int32)
            rel = torch.randint(0, B, (P, C), generator=g, dtype=torch.int64)
            if malformed:
                bc[0, 0] = -3
                bc[1, -1] = C + 5
                bad = min(5, C)        # C = 4 when there is one bin
                rel[2, :bad] = B + torch.arange(bad)
            relw = torch.where(rel >= 32768, rel - 65536, rel).to(dt)
            # strided rows, as views into a message
            wide = torch.zeros((P, C + 8), dtype=dt)
            wide[:, :C] = relw
            sl = types.SimpleNamespace(capacity=C, numel=N, ienc=ienc, bin_size=B, nbins=nb)
            got, _ = codec_slots.slot_indices(sl, wide[:, :C], bc, None, P, torch.device("cpu"))
            with monkeypatch.context() as m:
                m.setattr(codec.native, "available", lambda: False)
                want, _ = codec_slots.slot_indices(sl, wide[:, :C], bc, None, P,
                                                   torch.device("cpu"))
            assert got.dtype == want.dtype == torch.int32
            assert torch.equal(got, want), (B, malformed)


def _quant_cases(g):
    """(n, bucket_size, bits, count) cases: odd sizes, buckets that split a code byte,
    one bucket larger than the layer, a partial count and a zero count."""
    import torch

    def r(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))
    return [(r(100_000, 300_000), 512, 4, None), (r(5_000, 20_000), r(2, 9), 4, None),
            (r(1_000, 5_000), r(3, 40), 2, r(0, 900)), (r(1_000, 9_000), 512, 8, None),
            (r(1, 30), r(1, 5), 2, None), (r(50, 400), 10_000, 4, 0)]


def test_quantize_compiled_loop_gives_the_numpy_bits():
    """native.quantize_pack / dequantize (quantize.c) against cpu.py's numpy blocks, bit
    for bit, on fresh heavy-tailed data with NaN / Inf / -0.0 elements, over the aligned
    thread ranges the CPU path hands out; outputs poisoned before the loops write."""
    import numpy as np
    import torch
    from hvdsparse import cpu_quantize as cpu, native   # its numpy blocks
    if not native.available():
        pytest.skip(f"compiled CPU loops unavailable: {native.why_unavailable()}")
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for n, B, bits, count in _quant_cases(g):
        v = (torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))).numpy()
        if n > 40:
            v[int(torch.randint(0, n, (1,), generator=g))] = np.nan
            v[int(torch.randint(0, n, (1,), generator=g))] = -np.inf
            v[int(torch.randint(0, n, (1,), generator=g))] = -0.0
        c = n if count is None else min(count, n)
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=g))
        nbytes, nb = -(-n * bits // 8), -(-n // B)
        want_c, want_s = np.empty(nbytes, np.uint8), np.empty(nb, np.float32)
        cpu._quantize_pack_np(v, c, bits, B, seed, want_c, want_s)
        got_c, got_s = np.full(nbytes, 0xA5, np.uint8), np.full(nb, 7.0, np.float32)
        L = cpu._q_block_len(B, bits)
        cuts = sorted({0, n, *[min(n, L * k) for k in (1, 3)]})      # uneven thread ranges
        for s0, e0 in zip(cuts[:-1], cuts[1:]):
            native.quantize_pack(v, c, bits, B, seed, got_c, got_s, s0, e0)
        assert np.array_equal(got_c, want_c), (n, B, bits, count)
        assert np.array_equal(got_s.view(np.uint32), want_s.view(np.uint32)), (n, B, bits)
        want_d = np.empty(n, np.float32)
        cpu._dequantize_unpack_np(want_c, want_s, bits, B, n, want_d)
        got_d = np.full(n, 3.0, np.float32)
        for s0, e0 in zip(cuts[:-1], cuts[1:]):
            native.dequantize(got_c, got_s, bits, B, s0, e0, got_d[s0:e0])
        assert np.array_equal(got_d.view(np.uint32), want_d.view(np.uint32)), (n, B, bits)


def test_dense_add_decode_is_the_arange_scatter():
    """cpu.dense_add_decode (DENSE segments through quantize.c: no index array) against
    scatter_add_decode with indices arange and the compiled loops off, rows in order, for
    fp32 and 2/4/8-bit rows with partial counts; a count outside [0, cap] raises and
    writes nothing."""
    import torch
    from hvdsparse import cpu, native
    if not native.available():
        pytest.skip(f"compiled CPU loops unavailable: {native.why_unavailable()}")
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for n, B, bits, _ in _quant_cases(g):
        P = int(torch.randint(1, 6, (1,), generator=g))
        counts = torch.randint(0, n + 1, (P, 1), generator=g, dtype=torch.int32)
        counts[0, 0] = n
        base = torch.randn(n, generator=g)
        rows = [cpu.quantize_pack(torch.randn(n, generator=g) * 3, bits, B, 11 + p)
                for p in range(P)]
        pad = int(torch.randint(0, 9, (1,), generator=g))          # codec sections pad
        codes = torch.stack([torch.cat([c, torch.zeros(pad, dtype=torch.uint8)])
                             for c, _ in rows])
        scales = torch.stack([s for _, s in rows])
        vals = torch.randn(P, n + pad, generator=g)
        idx = torch.arange(n, dtype=torch.int32).expand(P, n)
        saved = native.available
        for kind in ("codes", "fp32"):
            kw = dict(codes=codes, scales=scales, bits=bits, bucket_size=B) \
                if kind == "codes" else dict(values=vals)
            got = base.clone()
            cpu.dense_add_decode(got, counts, n, **kw)
            want = base.clone()
            native.available = lambda: False
            try:
                if kind == "fp32":
                    cpu.scatter_add_decode(want, idx, counts, vals[:, :n])
                else:
                    cpu.scatter_add_decode(want, idx, counts, codes=codes, scales=scales,
                                           bits=bits, bucket_size=B)
            finally:
                native.available = saved
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (kind, n, B)
        bad = counts.clone()
        bad[-1, 0] = n + 1
        got = base.clone()
        with pytest.raises(ValueError, match=rf"count\[{P - 1}\]"):
            cpu.dense_add_decode(got, bad, n, codes=codes, scales=scales, bits=bits,
                                 bucket_size=B)
        assert torch.equal(got, base)


QSGD_DECODE = textwrap.dedent("""
    import hashlib, sys, torch
    from hvdsparse import codec, native
    from hvdsparse.compressors import QSGD
    g = torch.Generator().manual_seed(int(sys.argv[1]))
    shapes = [("a", (300, 64)), ("b", (1001,)), ("c", (10, 7))]
    h = hashlib.sha256()
    for bits in (2, 4, 8):
        msgs = []
        for r in range(3):
            c = QSGD(bits, bucket_size=100, error_feedback=True, compress_1d=True, seed=r)
            c.register_layers(shapes)
            pays = [c.compress(n, torch.randn(s, generator=g), 0) for n, s in shapes]
            msgs.append(codec.encode(pays))
            for n, _ in shapes:
                res = c.residual(n)                 # None for the policy-dense layer
                h.update(b"-" if res is None else res.numpy().tobytes())
        outs = [torch.zeros(torch.Size(s).numel()) for _, s in shapes]
        codec.accumulate(torch.stack(msgs), pays, outs)
        for o in outs:
            h.update(o.numpy().tobytes())
        h.update(codec.payload_to_dense(pays[0]).numpy().tobytes())
    print("native", native.available())
    print("digest", h.hexdigest())
""")


def test_qsgd_compiled_quantise_and_decode_give_the_numpy_bits():
    """QSGD with error feedback end to end (quantise, residual ``v - deq``, encode, the
    DENSE decode of three ranks' messages, a policy-dense fp32 layer among them) with
    the compiled loops on and off (HVDSPARSE_NATIVE=0): the same residuals and sums."""
    d_on, d_off = _native_on_off(QSGD_DECODE, "digest")
    assert d_on == d_off and d_on


ADACOMP_MC = textwrap.dedent(r"""
    import hashlib, sys, torch
    from hvdsparse import native
    from hvdsparse.compressors import AdaComp
    from hvdsparse.momentum import LocalUpdate
    g = torch.Generator().manual_seed(int(sys.argv[1]))
    shapes = [("fc", (600, 500)), ("conv", (32, 16, 3, 3)), ("vec", (7777,)), ("tiny", (30,))]
    params = {n: torch.nn.Parameter(torch.randn(s, generator=g)) for n, s in shapes}
    opt = torch.optim.SGD([
        dict(params=[params["fc"]], momentum=0.9, weight_decay=1e-3, nesterov=True),
        dict(params=[params["conv"]], momentum=0.8, dampening=0.25),
        dict(params=[params["vec"], params["tiny"]], momentum=0.9)], lr=0.1)
    lu = LocalUpdate(opt, params, 4, momentum_correction=True, clip_grad_norm=None)
    comp = AdaComp(compress_1d=True, seed=1)
    comp.register_layers(shapes)
    h = hashlib.sha256()
    fused = 0
    for step in range(4):
        comp.begin_step(step)
        lu.begin_step()
        for n, s in shapes:
            p = params[n]
            x = torch.randn(s, generator=g) * torch.exp(torch.randn(s, generator=g))
            if n == "fc" and step == 1:
                x.view(-1)[7] = float("nan")
                x.view(-1)[900] = float("-inf")
            gs = torch.tensor([0.5]) if step == 2 else None
            nf = torch.zeros(1, dtype=torch.int32)
            spec = lu.fused_spec(comp, n, x, p.detach())
            if spec is not None:
                fused += 1
                pay = comp.compress(n, x, step, param=p.detach(), nonfinite=nf,
                                    grad_scale=gs, momentum=spec)
            else:
                y, nf = lu.corrected(n, x, p, comp.policy.is_dense(n, s), gs, nonfinite=nf)
                pay = comp.compress(n, y, step, param=p.detach(), nonfinite=nf)
            seg = pay.segments[0]
            for t in (seg.count, seg.values, seg.indices, seg.scales, seg.bin_counts,
                      comp.residual(n), lu.u.get(n), nf):
                h.update(b"-" if t is None else t.contiguous().view(torch.uint8).numpy().tobytes())
            lu.mask(n, pay)
        comp.commit()
        lu.commit()
    print("native", native.available())
    print("digest", fused, h.hexdigest())
""")


def test_adacomp_folds_the_velocity_update_with_the_corrected_bits():
    """AdaComp with DGC momentum correction: the velocity update folded into the compiled
    pass (``LocalUpdate.fused_spec`` -> ``compress(momentum=...)``) against
    ``LocalUpdate.corrected`` + ``compress`` (the compiled loops off), on fresh data over
    four steps with masking in between: Nesterov with weight decay, dampening, plain,
    NaN / -Inf gradient elements and an AMP scale; payload, residual, velocity and
    non-finite count, bit for bit. The compiled run must fuse every compressed layer
    (three of four: the 30-element one is sent dense), the other none."""
    (on,), (off,) = _native_on_off(ADACOMP_MC, "digest")
    _, n_on, h_on = on.split()
    _, n_off, h_off = off.split()
    assert (n_on, n_off) == ("12", "0")
    assert h_on == h_off
