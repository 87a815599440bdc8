"""Triton kernels (through the interpreter, on CPU tensors) against the torch reference,
and the reference against naive loop / numpy computations written here.

Every test draws a fresh seed from the OS and prints it (pytest shows it on failure);
rerun one case with HVDSPARSE_TEST_SEED=<seed>. Sizes are a few thousand elements,
never multiples of the block or bin, so the masked tails are exercised. Output buffers
handed to the kernels are poisoned (NaN / 0xFF / garbage) first.
"""
import os
import random

import numpy as np
import pytest
import torch

from hvdsparse import ops
from hvdsparse import cpu as R
from hvdsparse import cpu_chunking


@pytest.fixture(scope="module")
def K():
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest must set TRITON_INTERPRET"
    return ops._kernels()


def _gen(seed):
    g = torch.Generator().manual_seed(seed)
    return g


def _randn(n, g, dtype=torch.float32, scale=1.0):
    return (torch.randn(n, generator=g) * scale).to(dtype)


# ---------------------------------------------------------------------------------------
# Philox
# ---------------------------------------------------------------------------------------
_M = 0xFFFFFFFF


def _philox_py(c, k):
    """Textbook Philox 4x32-10 on Python ints (Salmon et al., SC'11)."""
    c, k = list(c), list(k)
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k[0]) & _M, p1 & _M, ((p0 >> 32) ^ c[3] ^ k[1]) & _M, p0 & _M]
        k = [(k[0] + 0x9E3779B9) & _M, (k[1] + 0xBB67AE85) & _M]
    return c


def test_philox_known_answers_and_reference(seed):
    # Random123 known-answer vectors
    assert _philox_py([0] * 4, [0, 0]) == [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
    assert _philox_py([_M] * 4, [_M, _M]) == [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
    rnd = random.Random(seed)
    key = rnd.randrange(2**63)
    ctrs = [rnd.randrange(2**63) for _ in range(50)] + list(range(20))
    got = R.philox_uint32(key, torch.tensor(ctrs, dtype=torch.int64)).tolist()
    want = [_philox_py([c & _M, c >> 32, 0, 0], [key & _M, key >> 32])[0] for c in ctrs]
    assert got == want
    # uint32 -> float map of triton.language.random.uint_to_uniform_float
    u = R.philox_uniform(key, 20, offset=0).tolist()
    for x, w in zip(u, want[50:]):
        i = w - (1 << 32) if w >= (1 << 31) else w
        i = -i - 1 if i < 0 else i
        assert x == float(np.float32(np.float32(i) * np.float32(4.6566127342e-10)))
        assert 0.0 <= x < 1.0


@pytest.mark.parametrize("big", [False, True])
def test_philox_uniform_kernel_bit_exact(K, seed, big):
    rnd = random.Random(seed)
    key = rnd.randrange(2**63) if big else rnd.randrange(2**31)
    off = rnd.randrange(2**40) if big else rnd.randrange(1000)
    n = rnd.randrange(1000, 5000)
    got = K.philox_uniform(key, n, off, device="cpu")
    assert torch.equal(got, R.philox_uniform(key, n, off)), f"seed={seed}"


# ---------------------------------------------------------------------------------------
# 1. residual add + bin max
# ---------------------------------------------------------------------------------------


def _naive_binmax(acc, L):
    a = acc.double().numpy()
    return np.array([np.abs(a[b:b + L]).max() for b in range(0, len(a), L)], dtype=np.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("L,max_chunk", [(1, 1024), (50, 1024), (500, 1024), (700, 256)])
def test_residual_add_binmax(K, seed, dtype, L, max_chunk):
    g = _gen(seed)
    n = int(torch.randint(2000, 6000, (1,), generator=g))
    if n % L == 0:
        n += 1
    grad = _randn(n, g, dtype)
    res = _randn(n, g)
    acc = res + grad.float()
    # reference vs naive
    r1 = res.clone()
    bm1 = R.residual_add_binmax(grad, r1, L)
    assert torch.equal(r1, acc)
    np.testing.assert_array_equal(bm1.numpy(), _naive_binmax(acc, L))
    # kernel vs reference, poisoned output
    r2 = res.clone()
    out = torch.full((-(-n // L),), float("nan"))
    bm2 = K.residual_add_binmax(grad, r2, L, out=out, block=2048, max_chunk=max_chunk)
    assert bm2 is out
    assert torch.equal(r2, acc), f"seed={seed}"
    assert torch.equal(bm2, bm1), f"seed={seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("L,kw", [(1, {}), (50, {}), (700, dict(max_chunk=256)),
                                  (3000, {}), (5000, dict(block=1024)),
                                  (1 << 40, dict(block=512))])
@pytest.mark.parametrize("scaled", [False, True])
def test_residual_add_binmax_nonfinite_and_scale(K, seed, dtype, L, kw, scaled):
    """Non-finite addends are skipped and counted; ``d = fp32(g) * s`` and ``r + d`` are
    two separate roundings; large bins (flat layout, atomic max) agree with small ones."""
    g = _gen(seed)
    n = int(torch.randint(3000, 6000, (1,), generator=g))
    grad = _randn(n, g, dtype, 3.0)
    bad = torch.randperm(n, generator=g)[:7]
    grad[bad[:3]] = float("nan")
    grad[bad[3:5]] = float("inf")
    grad[bad[5:]] = -float("inf")
    res = _randn(n, g)
    res[bad[0]] = -0.0
    sc = torch.rand(1, generator=g) * 4 if scaled else None
    d = grad.float() * sc if scaled else grad.float()
    fin = torch.isfinite(d)
    want = torch.where(fin, res + d, res)      # independent: plain torch, two roundings
    nbins = -(-n // L)
    want_bm = torch.stack([want[b * L:(b + 1) * L].abs().amax() for b in range(nbins)])
    for impl in ("ref", "kernel"):
        r = res.clone()
        nf = torch.full((1,), 5, dtype=torch.int32)
        out = torch.full((nbins,), float("nan"))
        if impl == "ref":
            bm = R.residual_add_binmax(grad, r, L, out=out, grad_scale=sc, nonfinite=nf)
        else:
            bm = K.residual_add_binmax(grad, r, L, out=out, grad_scale=sc, nonfinite=nf, **kw)
        assert torch.equal(r.view(torch.int32), want.view(torch.int32)), (impl, seed)
        assert torch.equal(bm, want_bm), (impl, seed)
        assert int(nf[0]) == 5 + 7, (impl, seed)


@pytest.mark.parametrize("scaled", [False, True])
def test_residual_add_without_binmax(seed, scaled):
    """``cpu.residual_add`` (callers that ignore the bin maxima): the same residual bits
    and non-finite count as plain torch, over several chunks and threaded ranges."""
    g = _gen(seed)
    n = (1 << 19) + int(torch.randint(1, 300_000, (1,), generator=g))
    grad = _randn(n, g, torch.float32, 3.0)
    bad = torch.randperm(n, generator=g)[:5]
    grad[bad[:2]] = float("nan")
    grad[bad[2:]] = float("inf")
    res = _randn(n, g)
    sc = torch.rand(1, generator=g) * 4 if scaled else None
    d = grad * sc if scaled else grad
    want = torch.where(torch.isfinite(d), res + d, res)
    nf = torch.full((1,), 2, dtype=torch.int32)
    R.residual_add(grad, res, grad_scale=sc, nonfinite=nf)
    assert torch.equal(res.view(torch.int32), want.view(torch.int32)), seed
    assert int(nf[0]) == 2 + 5, seed


def test_residual_add_binmax_nan_residual_propagates(K, seed):
    """A NaN already in the residual makes its bin's max NaN (torch.amax rule) on every
    path; compiled tl.maximum would drop it, the kernels take an integer max instead."""
    g = _gen(seed)
    for L, kw in [(64, {}), (5000, dict(block=1024))]:
        res = _randn(3000, g)
        res[int(torch.randint(0, 3000, (1,), generator=g))] = float("nan")
        grad = _randn(3000, g)
        r1, r2 = res.clone(), res.clone()
        b1 = R.residual_add_binmax(grad, r1, L)
        b2 = K.residual_add_binmax(grad, r2, L, **kw)
        assert torch.equal(r1.isnan(), r2.isnan())
        assert torch.equal(b1.isnan(), b2.isnan()) and int(b2.isnan().sum()) == 1
        assert torch.equal(b1.nan_to_num(0.0), b2.nan_to_num(0.0))


def test_residual_add_binmax_via_ops_forced(monkeypatch, seed):
    monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    g = _gen(seed)
    grad, res = _randn(3001, g), _randn(3001, g)
    acc = res + grad
    bm = ops.residual_add_binmax(grad, res, 512)
    assert torch.equal(res, acc)
    np.testing.assert_array_equal(bm.numpy(), _naive_binmax(acc, 512))


# ---------------------------------------------------------------------------------------
# 2. select + compact
# ---------------------------------------------------------------------------------------
VE = {"fp32": R.VE_FP32, "fp16": R.VE_FP16, "bf16": R.VE_BF16, "sign1": R.VE_SIGN1}
VDT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _naive_select(acc, thr, L, grad, h, ve, sign_scale, capacity):
    """Python loop over elements: returns (indices, deq values, new residual, selected)."""
    a = acc.tolist()
    gr = grad.float().tolist() if grad is not None else None
    t = thr.reshape(-1).tolist()
    idx, deq, res = [], [], list(a)
    selected = 0
    for i, x in enumerate(a):
        crit = np.float32(x) + np.float32(np.float32(gr[i]) * np.float32(h - 1.0)) if gr else x
        ti = t[i // L] if L else t[0]
        if abs(float(np.float32(crit))) >= ti:
            selected += 1
            if len(idx) < capacity:
                idx.append(i)
                if ve == "sign1":
                    d = -sign_scale if x < 0 else sign_scale
                elif ve == "fp32":
                    d = x
                else:
                    d = float(torch.tensor(x).to(VDT[ve]).float())
                deq.append(d)
                res[i] = float(np.float32(np.float32(x) - np.float32(d)))
    return idx, deq, res, selected


def _deq_values(values, sent, ve, sign_scale):
    if ve == "sign1":
        bits = np.unpackbits(values.numpy(), bitorder="little")[:sent]
        return [(-sign_scale if b else sign_scale) for b in bits]
    return values[:sent].float().tolist()


def _case(seed, n_lo=2000, n_hi=5000):
    g = _gen(seed)
    n = int(torch.randint(n_lo, n_hi, (1,), generator=g))
    if n % 1024 == 0:
        n += 1
    return g, n


@pytest.mark.parametrize("ve", ["fp32", "fp16", "bf16", "sign1"])
@pytest.mark.parametrize("mode", ["scalar", "perbin_h"])
def test_select_compact_no_overflow(K, seed, ve, mode):
    g, n = _case(seed)
    acc = _randn(n, g, scale=3.0)
    if mode == "scalar":
        L, grad, h = 0, None, 1.0
        thr = acc[n // 3].abs().clone()  # ties: that element must be selected (>=)
    else:
        L = 50
        grad = _randn(n, g, torch.float16)
        h = 2.0
        thr = torch.rand(-(-n // L), generator=g) * 4 + 1
        hcrit = (acc + grad.float() * (h - 1.0)).abs()
        thr[::3] = hcrit[::3 * L][: thr[::3].numel()]  # exact ties in every third bin
    ss = torch.tensor(1.25)
    cap = n  # everything fits
    # reference vs naive
    a1 = acc.clone()
    i1, v1, c1 = R.select_compact(a1, thr, cap, bin_size=L, grad=grad, h_scale=h,
                                  value_encoding=VE[ve], sign_scale=ss)
    nidx, ndeq, nres, nsel = _naive_select(acc, thr, L, grad, h, ve, 1.25, cap)
    assert c1.tolist() == [len(nidx), nsel]
    assert i1[:len(nidx)].tolist() == nidx
    assert _deq_values(v1, len(nidx), ve, 1.25) == ndeq
    assert a1.tolist() == nres
    assert nsel > 0
    # kernel vs reference, poisoned outputs
    a2 = acc.clone()
    pi = torch.full((cap,), -7, dtype=torch.int32)
    pv = (torch.full((-(-cap // 8),), 0xFF, dtype=torch.uint8) if ve == "sign1"
          else torch.full((cap,), float("nan"), dtype=VDT[ve]))
    pc = torch.full((2,), 0x7FFFFFFF, dtype=torch.int32)
    i2, v2, c2 = K.select_compact(a2, thr, cap, bin_size=L, grad=grad, h_scale=h,
                                  value_encoding=VE[ve], sign_scale=ss, out=(pi, pv, pc),
                                  block=1024)
    assert c2.tolist() == c1.tolist(), f"seed={seed}"
    sent = int(c2[0])
    order = torch.argsort(i2[:sent].long())
    assert torch.equal(i2[:sent][order], i1[:sent]), f"seed={seed}"
    d2 = torch.tensor(_deq_values(v2, sent, ve, 1.25))[order]
    d1 = torch.tensor(_deq_values(v1, sent, ve, 1.25))
    # bf16 too: the kernel rounds with integer ops, so the interpreter gives the bits
    # of compiled code and of the reference (its plain cast truncated: 1 ulp off)
    assert torch.equal(d2, d1), f"seed={seed}"
    assert torch.equal(a2, a1), f"seed={seed}"
    if ve == "bf16":      # error feedback stays exact: residual + sent value == acc
        rec = a2.clone()
        rec[i2[:sent].long()] += v2[:sent].float()
        assert torch.equal(rec, acc)


@pytest.mark.parametrize("ve", ["fp32", "sign1", "bf16"])
def test_select_compact_overflow_invariants(K, seed, ve):
    g, n = _case(seed)
    acc = _randn(n, g)
    thr = torch.tensor(1.0)
    selected = int((acc.abs() >= 1.0).sum())
    cap = max(1, selected // 3)
    ss = 0.75
    sdt = torch.tensor(ss)
    for impl in ("ref", "kernel"):
        a = acc.clone()
        fn = R.select_compact if impl == "ref" else K.select_compact
        i, v, c = fn(a, thr, cap, value_encoding=VE[ve], sign_scale=sdt)
        assert c.tolist() == [cap, selected], f"{impl} seed={seed}"
        idx = i[:cap].long()
        assert len(set(idx.tolist())) == cap
        assert bool((acc[idx].abs() >= 1.0).all()), "sent element not selected"
        # unsent elements untouched; residual + dequantised sent == acc
        deq = torch.tensor(_deq_values(v, cap, ve, ss), dtype=torch.float32)
        rec = a.clone()
        rec[idx] += deq
        assert torch.equal(rec, acc) if ve != "bf16" else torch.allclose(rec, acc, atol=1e-6, rtol=0)
        untouched = torch.ones(n, dtype=torch.bool)
        untouched[idx] = False
        assert torch.equal(a[untouched], acc[untouched])
        if impl == "ref":  # ascending order, first `cap` selected
            first = torch.nonzero(acc.abs() >= 1.0).view(-1)[:cap]
            assert torch.equal(idx, first)


@pytest.mark.parametrize("perbin", [False, True])
def test_select_compact_torch_path_matches_numpy_path(monkeypatch, seed, perbin):
    g, n = _case(seed)
    acc = _randn(n, g, scale=2.0)
    grad = _randn(n, g, torch.bfloat16)
    L = 37 if perbin else 0
    thr = torch.rand(-(-n // 37), generator=g) * 3 if perbin else torch.tensor(1.7)
    monkeypatch.setattr(cpu_chunking, "CHUNK", 1000)  # several chunks
    outs = []
    for use_np in (True, False):
        monkeypatch.setattr(cpu_chunking, "USE_NUMPY", use_np)
        a = acc.clone()
        i, v, c = R.select_compact(a, thr, n // 50, bin_size=L, grad=grad, h_scale=2.0)
        outs.append((a, i, v, c))
    for x, y in zip(outs[0], outs[1]):
        assert torch.equal(x, y), f"seed={seed}"


def test_select_compact_via_ops_and_errors(monkeypatch, seed):
    g, n = _case(seed)
    acc = _randn(n, g)
    with pytest.raises(ValueError, match="sign_scale"):
        ops.select_compact(acc.clone(), torch.tensor(1.0), 10, value_encoding=R.VE_SIGN1)
    with pytest.raises(ValueError, match="threshold"):
        ops.select_compact(acc.clone(), torch.ones(3), 10, bin_size=7)
    with pytest.raises(TypeError, match="acc"):
        ops.select_compact(acc.double(), torch.tensor(1.0), 10)
    monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    a = acc.clone()
    i, v, c = ops.select_compact(a, 1.5, 64)
    assert int(c[0]) == min(64, int(c[1])) and int(c[1]) == int((acc.abs() >= 1.5).sum())


# ---------------------------------------------------------------------------------------
# 3. quantise / pack / unpack (kernel == reference bit-exactly)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("B", [512, 37, 6])
def test_quantize_pack_kernel_bit_exact(K, seed, bits, B):
    g, n = _case(seed, 1000, 3000)
    dtype = [torch.float32, torch.float16, torch.bfloat16][seed % 3]
    v = _randn(n, g, dtype)
    v[: min(B, n)] = 0.0  # an all-zero bucket
    cnt = torch.tensor([n - int(torch.randint(0, 200, (1,), generator=g))], dtype=torch.int32)
    for count in (None, cnt):
        c1, s1 = R.quantize_pack(v, bits, B, seed, count)
        c2, s2 = K.quantize_pack(v, bits, B, seed, count)
        assert torch.equal(s2, s1), f"seed={seed}"
        assert torch.equal(c2, c1), f"seed={seed}"
        d1 = R.dequantize_unpack(c1, s1, bits, B, n)
        d2 = K.dequantize_unpack(c2, s2, bits, B, n)
        assert torch.equal(d2, d1), f"seed={seed}"


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantize_nonfinite_buckets_and_big_buckets(K, seed, bits):
    """A bucket holding NaN gets scale NaN, one holding Inf scale Inf, and all their codes
    are q = 0 (decode: NaN); an 8192-element bucket (phase B loops, no spill) and
    max_phase_b smaller than a bucket still match the CPU path bit for bit."""
    g, n = _case(seed, 2500, 3000)
    v = _randn(n, g)
    B = 100
    v[3] = float("nan")
    v[B + 7] = float("inf")
    v[2 * B + 1] = -float("inf")
    c1, s1 = R.quantize_pack(v, bits, B, seed)
    c2, s2 = K.quantize_pack(v, bits, B, seed)
    assert torch.isnan(s1[0]) and torch.isnan(s2[0])
    assert s1[1] == s2[1] == s1[2] == s2[2] == float("inf")
    assert torch.equal(s1[3:], s2[3:]) and torch.equal(c1, c2), f"seed={seed}"
    half = 1 << (bits - 1)
    codes = R._unpack_bits(c1, bits, n)
    assert bool((codes[: 3 * B] == half).all())
    d = R.dequantize_unpack(c1, s1, bits, B, n)
    assert bool(d[: 3 * B].isnan().all()) and bool(d[3 * B:].isfinite().all())
    for B2, kw in ((8192, {}), (700, dict(max_phase_b=256))):
        w = _randn(9000, g)
        c1, s1 = R.quantize_pack(w, bits, B2, seed)
        c2, s2 = K.quantize_pack(w, bits, B2, seed, **kw)
        assert torch.equal(s1, s2) and torch.equal(c1, c2), f"seed={seed} B={B2}"


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_dequantize_kernel_random_codes(K, seed, bits):
    g, n = _case(seed, 1000, 3000)
    B = 100
    codes = torch.randint(0, 256, (-(-n * bits // 8),), dtype=torch.uint8, generator=g)
    scales = torch.rand(-(-n // B), generator=g) * 5
    got = K.dequantize_unpack(codes, scales, bits, B, n)
    # naive numpy decode
    allbits = np.unpackbits(codes.numpy(), bitorder="little")
    s = (1 << (bits - 1)) - 1
    want = np.empty(n, dtype=np.float32)
    for j in range(n):
        code = sum(int(allbits[j * bits + t]) << t for t in range(bits))
        q = np.float32(code - (1 << (bits - 1)))
        want[j] = np.float32(q * scales[j // B].numpy()) / np.float32(s)
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(R.dequantize_unpack(codes, scales, bits, B, n).numpy(), want)


def test_sign_unpack_kernel(K, seed):
    g, n = _case(seed, 1000, 3000)
    b = torch.randint(0, 256, (-(-n // 8),), dtype=torch.uint8, generator=g)
    want = np.where(np.unpackbits(b.numpy(), bitorder="little")[:n] == 1, -0.5, 0.5)
    np.testing.assert_array_equal(R.sign_unpack(b, 0.5, n).numpy(), want.astype(np.float32))
    np.testing.assert_array_equal(K.sign_unpack(b, torch.tensor(0.5), n).numpy(),
                                  want.astype(np.float32))


# ---------------------------------------------------------------------------------------
# 4. scatter-add decode
# ---------------------------------------------------------------------------------------


def _naive_scatter(N, ind, cnt, deq_rows):
    out = np.zeros(N, dtype=np.float64)
    for p in range(ind.shape[0]):
        for j in range(int(cnt[p])):
            out[int(ind[p, j])] += float(deq_rows[p][j])
    return out


@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16", "int4", "int2", "int8", "sign1"])
def test_scatter_add_decode(K, seed, mode):
    g = _gen(seed)
    N = int(torch.randint(1500, 4000, (1,), generator=g))
    P, cap = 3, int(torch.randint(300, 900, (1,), generator=g))
    ind = torch.randint(0, N, (P, cap), dtype=torch.int32, generator=g)  # repeats included
    cnt = torch.stack([torch.tensor([cap]), torch.tensor([0]),
                       torch.randint(1, cap, (1,), generator=g)]).to(torch.int32)
    kw, deq = {}, []
    if mode in VDT:
        vals = _randn(P * cap, g, VDT[mode]).view(P, cap)
        kw["values"] = vals
        deq = [vals[p].float().tolist() for p in range(P)]
    elif mode == "sign1":
        signs = torch.randint(0, 256, (P, -(-cap // 8)), dtype=torch.uint8, generator=g)
        ssc = torch.rand(P, generator=g) + 0.1
        kw.update(signs=signs, sign_scale=ssc)
        deq = [R.sign_unpack(signs[p].contiguous(), ssc[p], cap).tolist() for p in range(P)]
    else:
        bits = {"int8": 8, "int4": 4, "int2": 2}[mode]
        B = 128
        codes = torch.randint(0, 256, (P, -(-cap * bits // 8)), dtype=torch.uint8, generator=g)
        scales = torch.rand(P, -(-cap // B), generator=g)
        kw.update(codes=codes, scales=scales, bits=bits, bucket_size=B)
        deq = [R.dequantize_unpack(codes[p].contiguous(), scales[p].contiguous(), bits, B,
                                   cap).tolist() for p in range(P)]
    want = _naive_scatter(N, ind.numpy(), cnt[:, 0].numpy(), deq)
    base = _randn(N, g)
    d_ref = base.clone()
    R.scatter_add_decode(d_ref, ind, cnt, **kw)
    np.testing.assert_allclose(d_ref.numpy(), base.double().numpy() + want, rtol=1e-5, atol=1e-5)
    d_k = base.clone()
    flag = torch.zeros(1, dtype=torch.int32)
    K.scatter_add_decode(d_k, ind, cnt, error_flag=flag, block=512, **kw)
    assert int(flag) == 0
    torch.testing.assert_close(d_k, d_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "int4", "sign1"])
def test_scatter_add_decode_rank_order_bitwise(K, seed, mode):
    """Rows are added in row (rank) order, bit for bit: each row has unique indices,
    rows overlap heavily, magnitudes differ by 2**20 so any other order changes bits."""
    g = _gen(seed)
    N = int(torch.randint(500, 900, (1,), generator=g))
    P, cap = 5, 400
    ind = torch.stack([torch.randperm(N, generator=g)[:cap] for _ in range(P)]).to(torch.int32)
    cnt = torch.randint(cap // 2, cap + 1, (P, 1), generator=g).to(torch.int32)
    kw = {}
    if mode in VDT:
        mag = 2.0 ** (torch.randint(-10, 11, (P, 1), generator=g).float() * 2)
        kw["values"] = (_randn(P * cap, g).view(P, cap) * mag).to(VDT[mode])
        deq = kw["values"].float()
    elif mode == "sign1":
        kw["signs"] = torch.randint(0, 256, (P, cap // 8), dtype=torch.uint8, generator=g)
        kw["sign_scale"] = torch.rand(P, generator=g) * 2.0 ** torch.randint(-20, 20, (P,), generator=g)
        deq = torch.stack([R.sign_unpack(kw["signs"][p].contiguous(), kw["sign_scale"][p], cap)
                           for p in range(P)])
    else:
        kw.update(codes=torch.randint(0, 256, (P, cap // 2), dtype=torch.uint8, generator=g),
                  scales=torch.rand(P, -(-cap // 64), generator=g) * 1e3 ** torch.randint(-3, 3, (P, 1), generator=g),
                  bits=4, bucket_size=64)
        deq = torch.stack([R.dequantize_unpack(kw["codes"][p].contiguous(),
                                               kw["scales"][p].contiguous(), 4, 64, cap)
                           for p in range(P)])
    base = _randn(N, g)
    want = base.clone()
    for p in range(P):                       # plain fp32, rank order, one add per element
        c = int(cnt[p, 0])
        want[ind[p, :c].long()] = want[ind[p, :c].long()] + deq[p, :c]
    for impl in ("ref", "kernel"):
        d = base.clone()
        if impl == "ref":
            R.scatter_add_decode(d, ind, cnt, **kw)
        else:
            flag = torch.zeros(1, dtype=torch.int32)
            K.scatter_add_decode(d, ind, cnt, error_flag=flag, block=128, **kw)
            assert int(flag) == 0
        assert torch.equal(d.view(torch.int32), want.view(torch.int32)), (impl, seed)


def test_scatter_add_decode_out_of_range(K, monkeypatch, seed):
    g = _gen(seed)
    N, P, cap = 1000, 2, 300
    ind = torch.randint(0, N, (P, cap), dtype=torch.int32, generator=g)
    cnt = torch.tensor([[cap], [200]], dtype=torch.int32)
    vals = torch.ones(P, cap)
    bad_j = int(torch.randint(0, 200, (1,), generator=g))
    ind[1, bad_j] = N + 5
    ind[0, bad_j] = N  # one past the end
    ind[1, 250] = -3  # beyond count: ignored
    with pytest.raises(IndexError, match=rf"index {N} at row 0, slot {bad_j}"):
        R.scatter_add_decode(torch.zeros(N), ind, cnt, vals)
    ind0 = ind.clone()
    ind0[0, bad_j] = 0
    with pytest.raises(IndexError, match=rf"index {N + 5} at row 1, slot {bad_j}"):
        R.scatter_add_decode(torch.zeros(N), ind0, cnt, vals)
    monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    dense = torch.zeros(N)
    flag = ops.scatter_add_decode(dense, ind, cnt, vals)
    assert flag.dtype == torch.int32 and int(flag[0]) == 1
    # every in-range slot was still added, the bad one skipped
    ok = torch.ones(P, cap, dtype=torch.bool)
    ok[1, 200:] = False
    ok[1, bad_j] = False
    ok[0, bad_j] = False
    want = torch.zeros(N).index_add_(0, ind[ok].long(), torch.ones(int(ok.sum())))
    assert torch.equal(dense, want)
    # only the one-past-the-end index bad: still flagged, nothing written for it
    ind_n = ind0.clone()
    ind_n[1, bad_j] = 0
    ind_n[0, bad_j] = N
    flag = ops.scatter_add_decode(torch.zeros(N + 64)[:N], ind_n, cnt, vals)
    assert int(flag[0]) == 1
    # count beyond capacity: flag 2, clamped
    cnt2 = torch.tensor([[cap + 1], [0]], dtype=torch.int32)
    ind = ind_n.clone()
    ind[0, bad_j] = 0
    flag = ops.scatter_add_decode(torch.zeros(N), ind, cnt2, vals)
    assert int(flag[0]) == 2
    monkeypatch.delenv("HVDSPARSE_FORCE_TRITON")
    with pytest.raises(ValueError, match=r"count\[0\]"):
        ops.scatter_add_decode(torch.zeros(N), ind, cnt2, vals)


def test_scatter_1d_and_negative(seed):
    g = _gen(seed)
    dense = torch.zeros(50)
    ind = torch.randint(0, 50, (20,), dtype=torch.int32, generator=g)
    ind[7] = -1
    with pytest.raises(IndexError, match=r"index -1 at row 0, slot 7"):
        ops.scatter_add_decode(dense, ind, torch.tensor([20], dtype=torch.int32), torch.ones(20))
    assert torch.equal(dense, torch.zeros(50))  # nothing written on error


# ---------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------


def test_dispatch_cpu_uses_reference(monkeypatch):
    monkeypatch.delenv("HVDSPARSE_FORCE_TRITON", raising=False)

    def boom():
        raise AssertionError("kernels used for CPU tensors")

    monkeypatch.setattr(ops, "_kernels", boom)
    assert not ops.use_triton(torch.zeros(3))
    r = torch.zeros(10)
    ops.residual_add_binmax(torch.ones(10), r, 4)
    ops.select_compact(r, 0.5, 4)
    ops.quantize_pack(torch.ones(10), 4, 4, 1)
    ops.philox_uniform(1, 10)


def test_value_encoding_codes_match_payload():
    from hvdsparse.payload import ValueEncoding
    assert (R.VE_FP32, R.VE_FP16, R.VE_BF16, R.VE_SIGN1) == (
        ValueEncoding.FP32, ValueEncoding.FP16, ValueEncoding.BF16, ValueEncoding.SIGN1)


@pytest.mark.parametrize("ve", ["fp32", "fp16", "sign1"])
@pytest.mark.parametrize("cap_frac", [1.0, 0.3, 0.7])
def test_reference_threaded_ranges_match_naive(monkeypatch, seed, ve, cap_frac):
    """The CPU path splits large inputs into per-thread ranges of whole chunks; force
    that on a small input (tiny chunks and range minimum) and check (1) and (2) against
    the element-by-element loops, with the capacity cut falling inside either range."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPUs for more than one range")
    monkeypatch.setattr(cpu_chunking, "CHUNK", 256)
    monkeypatch.setattr(cpu_chunking, "CHUNK_PAR_MIN", 512)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g, n = _case(seed)
        grad = _randn(n, g)
        res = _randn(n, g)
        acc = res + grad
        r = res.clone()
        L = 50
        bm = R.residual_add_binmax(grad, r, L)
        assert torch.equal(r, acc)
        np.testing.assert_array_equal(bm.numpy(), _naive_binmax(acc, L))
        thr = torch.tensor(1.0)
        nsel_all = int((acc.abs() >= thr).sum())
        cap = max(1, int(nsel_all * cap_frac))
        a1 = acc.clone()
        i1, v1, c1 = R.select_compact(a1, thr, cap, value_encoding=VE[ve],
                                      sign_scale=torch.tensor(0.5))
        nidx, ndeq, nres, nsel = _naive_select(acc, thr, 0, None, 1.0, ve, 0.5, cap)
        assert c1.tolist() == [len(nidx), nsel]
        assert i1[:len(nidx)].tolist() == nidx
        assert _deq_values(v1, len(nidx), ve, 0.5) == ndeq
        assert a1.tolist() == nres
    finally:
        torch.set_num_threads(threads)


def test_cuda_without_triton_raises_instead_of_falling_back(monkeypatch):
    """ops never silently runs the CPU path for CUDA tensors: a failing ``import triton``
    raises ImportError with an install hint (checked through the helper that
    ``use_triton`` calls for every CUDA tensor; no GPU needed)."""
    import sys
    monkeypatch.setattr(ops, "_TRITON_OK", False)
    monkeypatch.setitem(sys.modules, "triton", None)      # makes `import triton` fail
    with pytest.raises(ImportError, match="Triton kernels"):
        ops._triton_or_raise()
    monkeypatch.delenv("HVDSPARSE_FORCE_TRITON", raising=False)
    assert ops.use_triton(torch.zeros(1)) is False        # CPU tensors: CPU path, no import


@pytest.mark.parametrize("forced", [False, True])
def test_residual_argument_errors_name_the_argument(monkeypatch, forced):
    if forced:
        monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    else:
        monkeypatch.delenv("HVDSPARSE_FORCE_TRITON", raising=False)
    g, r = torch.zeros(10), torch.zeros(10)
    with pytest.raises(TypeError, match="grad_scale"):
        ops.residual_add_binmax(g, r, 4, grad_scale=0.5)
    with pytest.raises(TypeError, match="grad_scale"):
        ops.residual_add_binmax(g, r, 4, grad_scale=torch.ones(2))
    with pytest.raises(TypeError, match="nonfinite"):
        ops.residual_add_binmax(g, r, 4, nonfinite=torch.zeros(1))
    with pytest.raises(ValueError, match="out"):
        ops.residual_add_binmax(g, r, 4, out=torch.zeros(2))
    with pytest.raises(TypeError, match="grad_scale"):
        ops.select_compact(r, 0.5, 4, grad=g, h_scale=2.0, grad_scale=torch.ones(1, 1).double())
    with pytest.raises(ValueError, match="acc"):
        ops.select_compact(torch.empty((1 << 31) + 1, device="meta"), 0.5, 4)


def test_gpu_check_skips_cleanly_without_cuda(tmp_path):
    """scripts/gpu_check.sh on a machine without a CUDA device: says so, exits 0."""
    import subprocess
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: gpu_check.sh would run for real")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run(["bash", os.path.join(root, "scripts", "gpu_check.sh"),
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "no CUDA device: skipped" in p.stdout
