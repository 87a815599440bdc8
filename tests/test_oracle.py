"""The Triton kernels AND the optimised CPU path against the plain oracle
(:mod:`hvdsparse.oracle`), bit for bit, on fresh random inputs.

Kernels run on ``HVDSPARSE_TEST_DEVICE`` (default ``cpu``: Triton's interpreter, set up
by conftest; ``cuda``: compiled kernels on a GPU, what ``scripts/gpu_check.sh`` runs,
with larger sizes). The CPU path and the oracle always run on CPU tensors. Output
buffers are poisoned (NaN / 0xFF) before a kernel writes them. Every test prints its
seed; rerun one case with HVDSPARSE_TEST_SEED=<seed>.
"""
import os
import random

import pytest
import torch

from hvdsparse import cpu, ops, oracle, philox

DEV = torch.device(os.environ.get("HVDSPARSE_TEST_DEVICE", "cpu"))
GPU = DEV.type == "cuda"
if GPU and not torch.cuda.is_available():
    pytest.skip("HVDSPARSE_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)
#: element counts: small under the interpreter (it costs per program), large on a GPU
SIZE = (300_000, 1_200_000) if GPU else (2000, 6000)
#: element counts on a GPU for the tests whose oracle walks the elements in Python
#: (``oracle.clean_grad`` with a scale, ``oracle.binned_pack``: a few microseconds per
#: element, so SIZE would cost minutes of host time per test there); still many
#: programs per launch
SIZE_PYLOOP = (20_000, 60_000)
#: ``HVDSPARSE_TEST_SMOKE=1`` on a GPU (what ``scripts/gpu_check.sh`` sets): the widest
#: parametrised tests run a subset of their grid (every kernel and path still runs, fewer
#: dtype x size combinations), because every combination is one more Triton compile
SMOKE = GPU and os.environ.get("HVDSPARSE_TEST_SMOKE", "0") == "1"


def _grid(full, smoke):
    return smoke if SMOKE else full


@pytest.fixture(scope="module")
def K():
    if not GPU:
        assert os.environ.get("TRITON_INTERPRET") == "1", "conftest must set TRITON_INTERPRET"
    return ops._kernels()


def _n(g, lo=None, hi=None):
    lo, hi = lo or SIZE[0], hi or SIZE[1]
    return int(torch.randint(lo, hi, (1,), generator=g))


def _dev(t):
    """A copy on DEV (``.to(DEV)`` alone would alias CPU inputs that kernels mutate)."""
    return t.to(DEV, copy=True)


def _bits_equal(a, b):
    """Bitwise equality of float tensors (NaN == NaN, -0.0 != +0.0), on the CPU."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        na, nb = a.isnan(), b.isnan()
        if not torch.equal(na, nb):
            return False
        a, b = a.masked_fill(na, 0), b.masked_fill(nb, 0)
        iv = {2: torch.int16, 4: torch.int32}[a.element_size()]
        return torch.equal(a.view(iv), b.view(iv))
    return torch.equal(a, b)


# ------------------------------------------------------------------------------ Philox
def test_philox(K, seed):
    rnd = random.Random(seed)
    key, off, n = rnd.randrange(2**63), rnd.randrange(2**40), rnd.randrange(1000, 3000)
    want = oracle.philox_uniform(key, n, off)
    assert _bits_equal(philox.philox_uniform(key, n, off), want)
    assert _bits_equal(K.philox_uniform(key, n, off, device=DEV), want)
    ctr = torch.tensor([rnd.randrange(2**63) for _ in range(64)], dtype=torch.int64)
    assert torch.equal(philox.philox_uint32(key, ctr), oracle.philox_uint32(key, ctr))


def test_pack_bits(seed):
    g = torch.Generator().manual_seed(seed)
    for bits in (1, 2, 4, 8):
        n = _n(g, 1, 300)
        c = torch.randint(0, 1 << bits, (n,), generator=g)
        p = cpu.pack_bits(c.to(torch.uint8), bits)
        assert torch.equal(p, oracle.pack(c, bits))
        assert torch.equal(cpu.unpack_bits(p, bits, n).long(), oracle.unpack(p, bits, n))
        assert torch.equal(ops.pack_bits(c.to(DEV, torch.uint8), bits).cpu(), p)


# ------------------------------------------------------- 1. residual add + bin max
@pytest.mark.parametrize("dtype", _grid([torch.float32, torch.float16, torch.bfloat16],
                                         [torch.float32, torch.bfloat16]))
@pytest.mark.parametrize("L", _grid([1, 50, 700, 5000, "n"], [1, 50, "n"]))
@pytest.mark.parametrize("scaled", [False, True])
def test_residual_add_binmax(K, seed, dtype, L, scaled):
    g = torch.Generator().manual_seed(seed)
    n = _n(g)
    L = n if L == "n" else L
    grad = (torch.randn(n, generator=g) * 3).to(dtype)
    bad = torch.randperm(n, generator=g)[:9]
    grad[bad[:3]] = float("nan")
    grad[bad[3:6]] = float("inf")
    grad[bad[6:]] = -float("inf")
    res = torch.randn(n, generator=g)
    res[bad[0]] = -0.0
    sc = (torch.rand(1, generator=g) * 4 + 2.0 ** -20) if scaled else None
    want_r, want_bm, want_nf = oracle.residual_add_binmax(grad, res, L, sc)
    assert want_nf == 9
    # CPU path
    r = res.clone()
    nf = torch.full((1,), 4, dtype=torch.int32)
    bm = cpu.residual_add_binmax(grad, r, L, out=torch.full((-(-n // L),), float("nan")),
                                 grad_scale=sc, nonfinite=nf)
    assert _bits_equal(r, want_r) and _bits_equal(bm, want_bm) and int(nf) == 4 + want_nf
    # kernel on DEV (small blocks under the interpreter to exercise the flat layout)
    kw = {} if GPU else dict(block=1024)
    r = _dev(res)
    nf = torch.full((1,), 4, dtype=torch.int32, device=DEV)
    out = torch.full((-(-n // L),), float("nan"), device=DEV)
    bm = K.residual_add_binmax(grad.to(DEV), r, L, out=out,
                               grad_scale=sc.to(DEV) if scaled else None, nonfinite=nf, **kw)
    assert bm is out
    assert _bits_equal(r, want_r), f"seed={seed}"
    assert _bits_equal(bm, want_bm), f"seed={seed}"
    assert int(nf) == 4 + want_nf


def test_residual_binmax_nan_in_residual(K, seed):
    g = torch.Generator().manual_seed(seed)
    n = _n(g)
    for L in (64, 5000):
        res = torch.randn(n, generator=g)
        res[int(torch.randint(0, n, (1,), generator=g))] = float("nan")
        grad = torch.randn(n, generator=g)
        want_r, want_bm, _ = oracle.residual_add_binmax(grad, res, L)
        r = res.clone()
        assert _bits_equal(cpu.residual_add_binmax(grad, r, L), want_bm)
        r = _dev(res)
        bm = K.residual_add_binmax(grad.to(DEV), r, L, **({} if GPU else dict(block=1024)))
        assert _bits_equal(bm, want_bm) and _bits_equal(r, want_r)
        assert int(bm.isnan().sum()) == 1


# ------------------------------------------------------------ 2. select + compact
VE = {"fp32": 0, "fp16": 1, "bf16": 2, "sign1": 6}
VDT = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}


def _select_case(g, n, perbin, with_grad):
    acc = torch.randn(n, generator=g)
    acc[torch.randperm(n, generator=g)[:5]] = float("nan")
    grad = torch.randn(n, generator=g).to(torch.bfloat16) if with_grad else None
    h_scale = 1.75 if with_grad else 1.0
    gs = torch.tensor([0.37]) if with_grad else None
    L = 37 if perbin else 0
    if perbin:
        thr = torch.rand(-(-n // L), generator=g) * 2 + 0.5
    else:
        # a threshold exactly equal to some |h| (two roundings): an FMA in any
        # implementation would move that element across the threshold
        hh = acc if grad is None else acc + (grad.float() * gs) * torch.tensor(h_scale - 1.0)
        finite = hh[hh.isfinite()]
        thr = finite.abs().sort().values[int(finite.numel() * 0.97)].clone()
    return acc, grad, h_scale, gs, thr, L


@pytest.mark.parametrize("ve", list(VE))
@pytest.mark.parametrize("perbin", [False, True])
@pytest.mark.parametrize("with_grad", _grid([False, True], [True]))
def test_select_compact(K, monkeypatch, seed, ve, perbin, with_grad):
    g = torch.Generator().manual_seed(seed)
    n = _n(g)
    acc, grad, h_scale, gs, thr, L = _select_case(g, n, perbin, with_grad)
    code = VE[ve]
    ss = 0.8125
    want = oracle.select_compact(acc, thr, n, bin_size=L, grad=grad, h_scale=h_scale,
                                 value_encoding=code, sign_scale=ss, grad_scale=gs)
    k = want["sent"].numel()
    assert 0 < k < n
    cap = k + 17                       # room for all: outputs comparable exactly
    kw = dict(bin_size=L, grad=grad, h_scale=h_scale, value_encoding=code,
              sign_scale=ss if code == 6 else None, grad_scale=gs)
    for impl in ("cpu", "kernel"):
        a = acc.clone() if impl == "cpu" else _dev(acc)
        kwi = dict(kw)
        if impl == "kernel":
            kwi.update(grad=grad.to(DEV) if grad is not None else None,
                       grad_scale=gs.to(DEV) if gs is not None else None)
            out = (torch.full((cap,), -7, dtype=torch.int32, device=DEV),
                   torch.full(((cap + 7) // 8,), 0xFF, dtype=torch.uint8, device=DEV)
                   if code == 6 else torch.full((cap,), float("nan"), dtype=VDT[code],
                                                device=DEV),
                   torch.full((2,), -5, dtype=torch.int32, device=DEV))
            with monkeypatch.context() as m:      # through ops' validation, kernel path
                m.setenv("HVDSPARSE_FORCE_TRITON", "1")
                idx, vals, cnt = ops.select_compact(a, thr.to(DEV), cap, out=out, **kwi)
            assert idx is out[0] and cnt is out[2]
        else:
            idx, vals, cnt = cpu.select_compact(a, thr, cap, **kwi)
        idx, cnt, a = idx.cpu(), cnt.cpu(), a.cpu()
        assert cnt.tolist() == [k, k], (impl, seed)
        order = idx[:k].long().argsort()
        assert torch.equal(idx[:k].long()[order], want["sent"]), (impl, seed)
        if code == 6:
            neg = cpu.unpack_bits(vals.cpu(), 1, k).bool()[order]
            assert torch.equal(neg, want["values"]), (impl, seed)
        else:
            # bf16 too: the kernel rounds to nearest even with integer ops, so the
            # interpreter gives the GPU's (and torch's) bits (it truncated before)
            assert _bits_equal(vals.cpu()[:k][order], want["values"]), (impl, seed)
        assert _bits_equal(a, want["new_acc"]), (impl, seed)


@pytest.mark.parametrize("ve", ["fp32", "sign1"])
def test_select_compact_overflow(K, seed, ve):
    """More selected than capacity: count = [cap, selected]; the sent set is a subset of
    the oracle's selection with unique indices; exactly the sent elements changed."""
    g = torch.Generator().manual_seed(seed)
    n = _n(g)
    acc = torch.randn(n, generator=g)
    thr = torch.tensor(0.5)
    code = VE[ve]
    want = oracle.select_compact(acc, thr, n, value_encoding=code, sign_scale=1.0)
    sel = want["selected"]
    cap = sel.numel() // 3
    for impl in ("cpu", "kernel"):
        a = acc.clone() if impl == "cpu" else _dev(acc)
        f = cpu.select_compact if impl == "cpu" else K.select_compact
        idx, vals, cnt = f(a, thr.to(a.device), cap, value_encoding=code,
                           sign_scale=torch.tensor(1.0, device=a.device) if code == 6 else None)
        idx, cnt, a = idx.cpu().long(), cnt.cpu(), a.cpu()
        assert cnt.tolist() == [cap, sel.numel()]
        assert idx.unique().numel() == cap and bool(torch.isin(idx, sel).all())
        changed = torch.nonzero(a.view(torch.int32) != acc.view(torch.int32)).reshape(-1)
        assert torch.equal(changed, idx.sort().values)
        full = oracle.select_compact(acc, thr, n, value_encoding=code, sign_scale=1.0)
        assert _bits_equal(a[idx], full["new_acc"][idx])
        if impl == "cpu":
            assert torch.equal(idx, want["sent"][:cap])   # CPU: the first cap, ascending


# ------------------------------------------------------------ 3. quantise / unpack
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("B", _grid([512, 37, 8192], [37, 8192]))
def test_quantize_dequantize(K, seed, bits, B):
    g = torch.Generator().manual_seed(seed)
    n = _n(g) + (0 if GPU else B)
    dtype = [torch.float32, torch.float16, torch.bfloat16][seed % 3]
    v = (torch.randn(n, generator=g) * 10).to(dtype)
    v[: min(B, n)] = 0.0                                  # an all-zero bucket
    if n > 3 * B:
        v[B + 1] = float("nan")                           # a NaN bucket
        v[2 * B + 2] = -float("inf")                      # an Inf bucket
    count = n - int(torch.randint(0, 200, (1,), generator=g))
    for c in (None, count):
        wc, ws = oracle.quantize(v, bits, B, seed, c)
        wcodes = oracle.pack(wc, bits)
        wdeq = oracle.dequantize(wc, ws, bits, B, n)
        # CPU path
        codes, scales = cpu.quantize_pack(v, bits, B, seed, c)
        assert torch.equal(codes, wcodes) and _bits_equal(scales, ws), f"seed={seed}"
        assert _bits_equal(cpu.dequantize_unpack(codes, scales, bits, B, n), wdeq)
        # kernel
        ct = None if c is None else torch.tensor([c], dtype=torch.int32, device=DEV)
        codes, scales = K.quantize_pack(v.to(DEV), bits, B, seed, ct)
        assert torch.equal(codes.cpu(), wcodes) and _bits_equal(scales, ws), f"seed={seed}"
        assert _bits_equal(K.dequantize_unpack(codes, scales, bits, B, n), wdeq)


def test_sign_unpack(K, seed):
    g = torch.Generator().manual_seed(seed)
    n = _n(g)
    b = torch.randint(0, 256, (-(-n // 8),), dtype=torch.uint8, generator=g)
    s = torch.rand(1, generator=g)
    want = torch.where(oracle.unpack(b, 1, n).bool(), -s, s)
    assert _bits_equal(cpu.sign_unpack(b, s, n), want)
    assert _bits_equal(K.sign_unpack(b.to(DEV), s.to(DEV), n), want)


# ------------------------------------------------------------------- 4. decode
@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16", "int8", "int4", "int2", "sign1"])
def test_scatter_add_decode(K, seed, mode):
    g = torch.Generator().manual_seed(seed)
    N = _n(g)
    P, cap = 5, N // 3
    ind = torch.stack([torch.randperm(N, generator=g)[:cap] for _ in range(P)]).to(torch.int32)
    cnt = torch.randint(0, cap + 1, (P, 1), generator=g).to(torch.int32)
    cnt[1, 0] = 0
    cnt[2, 0] = cap
    mag = 2.0 ** (torch.randint(-12, 13, (P, 1), generator=g).float() * 2)
    kw, deq = {}, []
    if mode in ("fp32", "fp16", "bf16"):
        kw["values"] = (torch.randn(P, cap, generator=g) * mag).to(getattr(torch, {
            "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[mode]))
        deq = [kw["values"][p].float() for p in range(P)]
    elif mode == "sign1":
        kw["signs"] = torch.randint(0, 256, (P, -(-cap // 8)), dtype=torch.uint8, generator=g)
        kw["sign_scale"] = torch.rand(P, generator=g) * mag[:, 0]
        deq = [torch.where(oracle.unpack(kw["signs"][p], 1, cap).bool(), -kw["sign_scale"][p],
                           kw["sign_scale"][p]) for p in range(P)]
    else:
        bits, B = int(mode[3:]), 128
        kw.update(codes=torch.randint(0, 256, (P, -(-cap * bits // 8)), dtype=torch.uint8,
                                      generator=g),
                  scales=torch.rand(P, -(-cap // B), generator=g) * mag, bits=bits,
                  bucket_size=B)
        deq = [oracle.dequantize(oracle.unpack(kw["codes"][p], bits, cap), kw["scales"][p],
                                 bits, B, cap) for p in range(P)]
    base = torch.randn(N, generator=g)
    rows = [(ind[p, :int(cnt[p, 0])].long(), deq[p][:int(cnt[p, 0])]) for p in range(P)]
    want = oracle.scatter_add_decode(base, rows)
    d = base.clone()
    cpu.scatter_add_decode(d, ind, cnt, **kw)
    assert _bits_equal(d, want), f"seed={seed}"
    d = _dev(base)
    flag = torch.zeros(1, dtype=torch.int32, device=DEV)
    kwd = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    K.scatter_add_decode(d, ind.to(DEV), cnt.to(DEV), error_flag=flag, **kwd)
    assert int(flag) == 0
    assert _bits_equal(d, want), f"seed={seed}"


def test_scatter_add_decode_errors(K, seed):
    """Out-of-range index / count: the CPU path raises and writes nothing; the kernel
    skips exactly the bad slots (never out of bounds) and sets the flag bits."""
    g = torch.Generator().manual_seed(seed)
    N = _n(g)
    P, cap = 3, 64
    ind = torch.stack([torch.randperm(N, generator=g)[:cap] for _ in range(P)]).to(torch.int32)
    ind[0, 5] = N
    ind[2, 9] = -1
    vals = torch.randn(P, cap, generator=g)
    cnt = torch.tensor([[cap], [cap + 3], [cap]], dtype=torch.int32)
    with pytest.raises((IndexError, ValueError)):
        cpu.scatter_add_decode(torch.zeros(N), ind, cnt, vals)
    base = torch.randn(N, generator=g)
    rows = []
    for p in range(P):
        ok = (ind[p] >= 0) & (ind[p] < N)
        rows.append((ind[p][ok].long(), vals[p][ok]))
    want = oracle.scatter_add_decode(base, rows)
    d = _dev(base)
    flag = torch.zeros(1, dtype=torch.int32, device=DEV)
    K.scatter_add_decode(d, ind.to(DEV), cnt.to(DEV), vals.to(DEV), error_flag=flag)
    assert int(flag) == 3
    assert _bits_equal(d, want)


# ------------------------------------------------------------- DCT-MP row threshold
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_row_threshold(K, seed, dtype):
    from hvdsparse import mp
    g = torch.Generator().manual_seed(seed)
    for B, d in ((5, 7), (4, 100), (3, 300), (2, 1000)):
        # few distinct values: many ties at the threshold; a NaN and an Inf per row
        x = (torch.randint(-6, 7, (B, d), generator=g).float() / 4).to(dtype)
        x[:, 0] = float("nan")
        x[:, d // 2] = -float("inf")
        for k in (1, max(1, d // 3), d):
            want_cols, want_mask = oracle.row_threshold(x, k)
            c, v, m = mp.row_threshold_reference(x, k)
            assert torch.equal(c.long(), want_cols) and torch.equal(m.bool(), want_mask)
            xd = _dev(x)
            cols = torch.full((B, k), -7, dtype=torch.int32, device=DEV)
            vals = torch.full((B, k), float("nan"), dtype=dtype, device=DEV)
            mask = torch.full((B, d), 0xAB, dtype=torch.uint8, device=DEV)
            K.rowthreshold.row_threshold(xd, k, cols, vals, mask)
            assert torch.equal(cols.cpu().long(), want_cols), (B, d, k, seed)
            assert torch.equal(mask.cpu(), want_mask.to(torch.uint8)), (B, d, k, seed)
            assert _bits_equal(vals, torch.gather(x, 1, want_cols)), (B, d, k, seed)


# ------------------------------------------------------- TopK's threshold refinement
def _refine_numpy(acc, v, k, cap, r0, rounds):
    """The rule once more, in numpy float32 scalars and Python integers (independent of
    the oracle's torch code): counts by numpy, rank moves by float32 arithmetic and
    numpy's round-half-even."""
    import numpy as np
    a, vv = np.abs(acc.numpy()), v.numpy()
    f32 = np.float32
    target = f32(0.5 * (k + cap))
    r, t = f32(r0), vv[r0 - 1]
    for _ in range(rounds):
        c = f32(int(np.count_nonzero(a >= t)))
        if f32(k) <= c <= f32(cap):
            continue
        x = f32(f32(r * target) / max(c, f32(1.0)))
        r = f32(min(max(np.rint(x), f32(1.0)), f32(vv.size)))
        t = vv[int(r) - 1]
    return torch.tensor(max(t, np.finfo(np.float32).tiny), dtype=torch.float32)


def test_refine_topk_threshold(K, seed):
    """Kernel (one launch per round + one) == ops' device-op path == oracle == a numpy
    replay, bit for bit, on normal / heavy-tailed / tied data, with first sample ranks
    off on purpose so that the rounds move the threshold (asserted: some cases move,
    some stop early). Poisoned count scratch."""
    g = torch.Generator().manual_seed(seed)
    moved = kept = 0
    for case in range(12):
        n = _n(g, 9000, 40000) if not GPU else _n(g)
        x = torch.randn(n, generator=g)
        if case % 3 == 1:
            x = x / (torch.rand(n, generator=g) + 1e-3)
        elif case % 3 == 2:
            x = torch.randint(-8, 9, (n,), generator=g).float()   # heavy ties
        s = 4096
        k = max(1, int(n * (0.002, 0.01, 0.05, 0.2)[case % 4]))
        cap = min(n, -(-3 * k // 2))
        target = 0.5 * (k + cap)
        r0 = max(1, min(s, round(target * s / n)))
        r0 = max(1, (r0 * (1, 3, 1, 1))[case % 4] // (1, 1, 4, 1)[case % 4])
        m = min(s, 4 * r0 + 16)
        v = torch.topk(x[int(torch.randint(0, n // s, (1,), generator=g))::n // s][:s].abs(),
                       m, sorted=True).values
        for rounds in (0, 1, 2, 3):
            want = oracle.refine_topk_threshold(x, v, k, cap, r0, rounds)
            assert torch.equal(want, _refine_numpy(x, v, k, cap, r0, rounds)), (case, rounds)
            counts = torch.full((4,), -123456, dtype=torch.int32, device=DEV)
            got = K.refine_topk_threshold(_dev(x), _dev(v), k, cap, r0, rounds,
                                          counts=counts)
            assert got.dim() == 0 and _bits_equal(got, want), (case, rounds, got, want, seed)
            dev_ops = ops.refine_topk_threshold(x, v, k, cap, r0, rounds)   # CPU tensors
            assert _bits_equal(dev_ops, want), (case, rounds, dev_ops, want, seed)
            if rounds == 3:
                first = torch.maximum(v[r0 - 1], torch.tensor(torch.finfo(torch.float32).tiny))
                moved += not torch.equal(want, first)
                kept += torch.equal(want, first)
    assert moved >= 3 and kept >= 1, (moved, kept)


def test_refine_topk_threshold_boundaries(K, seed):
    """Hand-made cases at the rule's edges, with the answer worked out by hand: a count
    equal to ``capacity`` or to ``k`` keeps the threshold; a rank move landing exactly
    on ``x.5`` rounds half to even (2.5 -> 2, 3.5 -> 4); a count of 0 divides by 1."""
    g = torch.Generator().manual_seed(seed)
    v = torch.arange(40, 0, -1, dtype=torch.float32)            # v[j] = 40 - j
    k, cap = 10, 15                                             # target 12.5

    def layer(*groups):
        """|acc| < 0.5 noise plus ``cnt`` elements of magnitude ``mag`` (random signs
        and places)."""
        n = 9000 + int(torch.randint(0, 3000, (1,), generator=g))
        x = (torch.rand(n, generator=g) - 0.5) * 0.9
        pos = torch.randperm(n, generator=g)
        at = 0
        for mag, cnt in groups:
            sign = torch.where(torch.rand(cnt, generator=g) < 0.5, -1.0, 1.0)
            x[pos[at:at + cnt]] = sign * mag
            at += cnt
        return x

    cases = [
        # count at t = v[4] = 36 is exactly cap (15) / exactly k (10): kept
        (layer((36.5, 15)), 5, 36.0),
        (layer((36.5, 10)), 5, 36.0),
        # r0 = 5: c = 25 -> 5 * 12.5 / 25 = 2.5 -> r = 2 (half to even), t = v[1] = 39;
        # then c(39) = 0 -> r = round(2 * 12.5 / 1) = 25 -> t = v[24] = 16, c(16) = 25
        # -> 25 * 12.5 / 25 = 12.5 -> 12 -> t = v[11] = 29
        (layer((36.5, 25)), 5, 29.0),
        # r0 = 7: c(34) = 25 -> 7 * 12.5 / 25 = 3.5 -> r = 4 (half to even) -> t = 37;
        # c(37) = 12 (the 37.5s) is in [10, 15]: kept
        (layer((37.5, 12), (34.5, 13)), 7, 37.0),
    ]
    for x, r0, want in cases:
        got_o = oracle.refine_topk_threshold(x, v, k, cap, r0, 3)
        assert float(got_o) == want, (r0, float(got_o), want)
        got = K.refine_topk_threshold(_dev(x), _dev(v), k, cap, r0, 3,
                                      counts=torch.full((3,), 77, dtype=torch.int32,
                                                        device=DEV))
        assert float(got) == want, (r0, float(got), want, seed)
        assert float(ops.refine_topk_threshold(x, v, k, cap, r0, 3)) == want


def test_refine_topk_threshold_errors():
    x, v = torch.randn(5000), torch.rand(40).sort(descending=True).values
    for kw, what in ((dict(r0=0), "r0"), (dict(r0=41), "r0"), (dict(k=10, capacity=5), "k"),
                     (dict(rounds=17), "rounds")):
        args = dict(k=5, capacity=8, r0=3, rounds=2)
        args.update(kw)
        with pytest.raises(ValueError, match=what):
            ops.refine_topk_threshold(x, v, **args)
    with pytest.raises(ValueError, match="acc"):
        ops.refine_topk_threshold(x.double(), v, 5, 8, 3, 2)
    with pytest.raises(ValueError, match="v must"):
        ops.refine_topk_threshold(x, v[:0], 5, 8, 1, 2)


# ------------------------------------------------------------- clean gradient
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scaled", [False, True])
def test_clean_grad(K, seed, dtype, scaled):
    """Kernel (kernels/clean.py) and the CPU path == oracle, bit for bit: NaN / +-Inf /
    values that overflow only after the scale become +0.0 and are counted (added to the
    counter's old value), -0.0 stays -0.0; poisoned output."""
    g = torch.Generator().manual_seed(seed)
    n = _n(g, 1000, 3000) if not GPU else _n(g, *SIZE_PYLOOP)
    x = (torch.randn(n, generator=g) * 3).to(dtype)
    pos = torch.randperm(n, generator=g)[:12]
    x[pos[0]], x[pos[1]], x[pos[2]], x[pos[3]] = float("nan"), float("inf"), \
        -float("inf"), -0.0
    x[pos[4]] = torch.finfo(dtype).max
    s = torch.tensor([2.0 ** 120]) if scaled else None    # finfo.max * s overflows fp32
    want, bad = oracle.clean_grad(x, s)
    for path in ("kernel", "cpu"):
        nf = torch.tensor([5, -1], dtype=torch.int32, device=DEV if path == "kernel" else "cpu")
        if path == "kernel":
            out = torch.full((n,), float("nan"), device=DEV)
            got = K.clean_grad(_dev(x), grad_scale=None if s is None else _dev(s),
                               nonfinite=nf, out=out)
            assert got.data_ptr() == out.data_ptr()
        else:
            got = cpu.clean_grad(x, grad_scale=s, nonfinite=nf)
        assert _bits_equal(got, want), (path, seed)
        assert int(nf[0]) == 5 + bad and int(nf[1]) == -1, (path, nf, bad)
    assert bad >= 3 + (1 if scaled else 0)


# ------------------------------------------------------------- momentum masking
def test_zero_slots(K, seed):
    """Kernel (kernels/masking.py) and the CPU path == oracle, bit for bit: counts 0,
    full, past capacity and random; int32 and int64 positions; slots at or past the
    count (filled with junk positions, in range) leave their elements alone."""
    g = torch.Generator().manual_seed(seed)
    for case in range(8):
        n = _n(g, 500, 4000) if not GPU else _n(g)
        C = int(torch.randint(1, min(n, 2500), (1,), generator=g))
        pos = torch.randperm(n, generator=g)[:C]
        pos = pos.to(torch.int32 if case % 2 else torch.int64)
        count = (0, C, C + 5, int(torch.randint(1, C + 1, (1,), generator=g)))[case % 4]
        flat = torch.randn(n, generator=g) + 10.0            # no zeros before masking
        want = oracle.zero_slots(flat, pos, count)
        cnt = torch.tensor([count], dtype=torch.int32)
        got_k = _dev(flat)
        K.zero_slots(got_k, _dev(pos), _dev(cnt))
        got_c = flat.clone()
        cpu.zero_slots(got_c, pos, cnt)
        assert _bits_equal(got_k, want), (case, n, C, count, seed)
        assert _bits_equal(got_c, want), (case, n, C, count, seed)
        assert int((want == 0).sum()) == min(count, C)
        # the device-op form (taken for dtypes numpy does not hold, and off the CPU)
        half = flat.to(torch.bfloat16)
        cpu.zero_slots(half, pos, cnt)
        assert _bits_equal(half, oracle.zero_slots(flat.to(torch.bfloat16), pos, count))


# ------------------------------------------------------------- AdaComp's pack
@pytest.mark.parametrize("L,c", [(50, 4), (500, 10), (37, 3), (7, 7)])
def test_binned_pack(K, seed, L, c):
    """Kernel (kernels/binned.py) == oracle, bit for bit: slots, sign bits, counts,
    selected and the residue. Crafted: coarse values (ties in |h| inside over-full bins),
    accumulated values that are exactly 0 or -0.0 where the gradient is large (sent
    with a positive sign), NaN / Inf gradient elements, fp16 / bf16 gradients, a loss
    scale, and a partial last bin; cases 4-5 under a layer budget below ``nb * c``
    (AdaComp's ``mean_per_bin``: kernels/bin_quota.py between the two launches) from a
    random first bin. Poisoned: nothing is read back that the kernel did not write
    (unused slots must come back 0)."""
    g = torch.Generator().manual_seed(seed)
    over = cut = 0
    for case in range(6):
        n = _n(g, 300, 1500) if not GPU else _n(g, *SIZE_PYLOOP)
        acc = torch.round(torch.randn(n, generator=g) * 4) / 4
        dt = (torch.float32, torch.float16, torch.bfloat16, torch.float32, torch.float32,
              torch.bfloat16)[case]
        grad = (torch.round(torch.randn(n, generator=g) * 4) / 4).to(dt)
        zpos = torch.randperm(n, generator=g)[:max(2, n // 50)]
        acc[zpos] = 0.0
        acc[zpos[::2]] = -0.0
        grad[zpos] = 8.0
        grad[int(torch.randint(0, n, (1,), generator=g))] = float("nan")
        grad[int(torch.randint(0, n, (1,), generator=g))] = -float("inf")
        gs = torch.tensor([0.5]) if case in (3, 5) else None
        hs = (2.0, 2.0, 3.0, 1.0, 4.0, 2.0)[case]
        nb = -(-n // L)
        budget = rot = None
        if case >= 4:
            budget = int(torch.randint(nb * c // 3, nb * c, (1,), generator=g))
            rot = int(torch.randint(0, nb, (1,), generator=g))
        pad = torch.cat([acc.abs(), acc.new_zeros(nb * L - n)]).view(nb, L)
        thr = pad.amax(1).clamp_min(torch.finfo(torch.float32).tiny)
        scale = thr.mean()
        w_acc, w_rel, w_neg, w_cnt, w_bc, w_sel = oracle.binned_pack(
            acc, grad, hs, thr, L, c, scale, grad_scale=gs, budget=budget, rot=rot or 0)
        a = _dev(acc)
        rel, signs, cnt, bc, sel = K.binned_pack(
            a, _dev(grad), hs, _dev(thr), L, c, _dev(scale),
            grad_scale=None if gs is None else _dev(gs), budget=budget, rot=rot or 0)
        ctx = (L, c, case, seed, budget, rot)
        assert int(cnt[0]) == w_cnt and bc.cpu().tolist() == w_bc, ctx
        assert int(sel[0]) == w_sel, ctx
        got_rel = rel.cpu().to(torch.int64) & 0xFFFF
        assert torch.equal(got_rel, w_rel), ctx
        bits = ops.unpack_bits(signs.cpu(), 1, w_rel.numel()).bool()
        assert torch.equal(bits, w_neg), ctx
        assert _bits_equal(a, w_acc), ctx
        over += w_sel > w_cnt
        cut += budget is not None and w_cnt == budget
    assert over >= 1 or L == c                        # over-full bins were exercised
    assert cut >= 1 or L == c                         # and a budget spent


def test_bin_quota(K, seed):
    """AdaComp's layer budget: the closed form of the CPU path (cpu.bin_quota) and the
    kernel (kernels/bin_quota.py, in place; one layer and rows of a table) against the
    oracle's deal, one slot per bin per round from bin ``rot``. Random demands in
    ``[0, c]``, full and empty bins, budgets from 0 to ``nb * c - 1``, several blocks of
    bins per program; the table's rows are poisoned between them (untouched), and a row
    whose budget covers every bin stays as it is."""
    g = torch.Generator().manual_seed(seed)
    rows, tab, bin0, want = [], [], 0, []
    for case in range(8):
        nb = (1, 2, 255, 256, 257, int(torch.randint(3, 900, (1,), generator=g)),
              600, 40)[case]
        c = int(torch.randint(1, 13, (1,), generator=g))
        cnt = torch.randint(0, c + 1, (nb,), generator=g, dtype=torch.int32)
        if case == 6:
            cnt[: nb // 2] = c                        # a run of full bins
        budget = int(torch.randint(0, nb * c, (1,), generator=g))
        if case == 7:
            budget = nb * c                           # covers every bin
        rot = int(torch.randint(0, nb, (1,), generator=g))
        w = oracle.bin_quota(cnt.tolist(), budget, rot)
        ctx = (case, nb, c, budget, rot, seed)
        assert sum(w) == min(budget, int(cnt.sum())), ctx
        if budget < nb * c:
            assert cpu.bin_quota(cnt, budget, rot, c).tolist() == w, ctx
            one = _dev(cnt)
            K.bin_quota.quota(one, budget, rot, c)
            assert one.cpu().tolist() == w, ctx
        rows.append((cnt, c))
        tab.append([bin0 + 3, nb, budget, rot])
        want.append(w)
        bin0 += nb + 3
    # rows of one table (one C for all: the largest; demands stay within it)
    C = max(c for _, c in rows)
    flat = torch.full((bin0 + 3,), -7, dtype=torch.int32)
    for (cnt, _), t in zip(rows, tab):
        flat[t[0]:t[0] + t[1]] = cnt
    t = torch.tensor(tab, dtype=torch.int64)
    t[:, 2] = torch.minimum(t[:, 2], t[:, 1] * C)
    got = _dev(flat)
    K.bin_quota.quota_rows(_dev(t), got, len(tab), 4, 0, 1, 2, 3, C)
    got = got.cpu()
    for i, (tr, w) in enumerate(zip(tab, want)):
        b0, nb = tr[0], tr[1]
        exp = oracle.bin_quota(rows[i][0].tolist(), int(t[i, 2]), tr[3])
        assert got[b0:b0 + nb].tolist() == exp, (i, seed)
        assert got[b0 - 3:b0].tolist() == [-7, -7, -7], (i, seed)
    assert got[-3:].tolist() == [-7, -7, -7]


# ------------------------------------------------------------- segment means
def test_segment_means(seed, monkeypatch):
    """kernels/segment_mean.py (AdaComp's per-layer scale) and the CPU path
    (``cpu_residual.segment_mean``) against the plain oracle (``oracle.segment_mean``),
    bit for bit: each segment's sum in one defined order, then one correctly rounded
    division. Segments of 1, BLOCK - 1, BLOCK, BLOCK + 1 and odd lengths, integer and
    normal values, a NaN that reaches its own segment only; every segment computed
    among the others (the bucket path) and alone (``ops.segment_mean``: the per-layer
    path). The table is read through a row width and column offsets; the output is
    poisoned first."""
    from hvdsparse import cpu_residual
    BLOCK = ops._kernels().segment_mean.BLOCK
    assert cpu_residual.SEGMENT_MEAN_LANES == BLOCK == oracle.SEGMENT_MEAN_LANES
    g = torch.Generator().manual_seed(seed)
    L = int(torch.randint(2, 9, (1,), generator=g))
    choices = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7]
    lens = [choices[j] if j < len(choices) and j % 2 == 0 else _n(g, 1, 5000)
            for j in range(L)]
    starts = [sum(lens[:j]) + 3 * j for j in range(L)]          # gaps between segments
    total = starts[-1] + lens[-1] + 5
    for kind in ("int", "normal"):
        if kind == "int":
            x = torch.randint(0, 1000, (total,), generator=g).to(torch.float32)
        else:
            x = torch.randn(total, generator=g) * 10
            nan_j = int(torch.randint(0, L, (1,), generator=g))
            x[starts[nan_j] + int(torch.randint(0, lens[nan_j], (1,), generator=g))] = \
                float("nan")
        tab = torch.full((L, 5), -1, dtype=torch.int64)
        tab[:, 3] = torch.tensor(starts)
        tab[:, 1] = torch.tensor(lens)
        out = _dev(torch.full((L + 2,), float("nan")))
        ops._kernels().segment_mean.segment_means(_dev(x), _dev(tab), 5, 3, 1, L, out)
        got = out.cpu()
        assert got[L:].isnan().all(), "wrote past the rows"
        for j in range(L):
            seg = x[starts[j]:starts[j] + lens[j]].clone()
            ctx = (kind, j, lens[j], f"seed={seed}")
            want = oracle.segment_mean(seg)
            assert _bits_equal(got[j], want), ctx
            assert _bits_equal(cpu_residual.segment_mean(seg), want), ctx
            monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
            alone = ops.segment_mean(_dev(seg))
            monkeypatch.delenv("HVDSPARSE_FORCE_TRITON")
            assert _bits_equal(alone, want), ctx
            if kind == "int":      # every partial sum exact: the correctly rounded mean
                exact = torch.tensor(float(seg.double().sum()) / lens[j],
                                     dtype=torch.float64).float()
                assert _bits_equal(want, exact), ctx
            elif j == nan_j:
                assert want.isnan(), ctx
            else:
                ref = float(seg.double().mean())
                assert abs(float(want) - ref) <= 1e-5 * (1 + abs(ref)), ctx


# ------------------------------------------------------------- index narrowing
def test_bucket_narrow(seed):
    """kernels/bucket_narrow.py against a plain oracle, on several members at once: each
    member's bin counts are the histogram of its used indices' bins (``idx // B``), in
    its wire width too; its used slots come out grouped by ascending bin with ``rel =
    idx - bin * B`` and their own values (inside a bin in any order: compared as sets);
    padding slots keep their values with ``rel = 0``; an index outside ``[0, N)`` is
    neither counted nor placed. The counts are read through a stride (the bucket path's
    ``[sent, selected]`` rows). Outputs are poisoned first."""
    import numpy as np
    nar = ops.bucket_kernels("narrow")
    g = torch.Generator().manual_seed(seed)
    L = int(torch.randint(1, 7, (1,), generator=g))
    rows, idx, vals, used = [], [], [], []
    s0 = b0 = 0
    for j in range(L):
        N = _n(g, 1, 300_000) if j % 2 else _n(g, 1, 70_000)
        B = min(N, 65536) if j % 3 else max(1, min(N, int(torch.randint(1, 300, (1,), generator=g))))
        nb = -(-N // B)
        w = 1 if B <= 255 else 2 if B <= 65535 else 4
        cap = int(torch.randint(1, min(N, 3000) + 1, (1,), generator=g))
        c = int(torch.randint(0, cap + 1, (1,), generator=g))
        i = torch.randperm(N, generator=g)[:cap].to(torch.int32)
        if c and j == L - 1:                                 # one bad index
            i[int(torch.randint(0, c, (1,), generator=g))] = N if j % 2 else -1
        rows.append([s0, cap, b0, nb, B, w, N])
        idx.append(i)
        vals.append(torch.randn(cap, generator=g))
        used.append(c)
        s0, b0 = s0 + cap, b0 + nb
    tab = torch.tensor(rows, dtype=torch.int64)
    I, V = torch.cat(idx), torch.cat(vals)
    cnt2 = torch.zeros(L, 2, dtype=torch.int32)
    cnt2[:, 0] = torch.tensor(used, dtype=torch.int32)
    cnt2[:, 1] = -5                                          # the other column: never read
    out = dict(rel=torch.full((s0,), -7, dtype=torch.int16),
               pv=torch.full((s0,), float("nan")),
               c32=torch.full((b0,), -3, dtype=torch.int32),
               c16=torch.full((b0,), -3, dtype=torch.int16),
               c8=torch.full((b0,), 0xEE, dtype=torch.uint8),
               start=torch.full((b0,), -3, dtype=torch.int32))
    d = {k: _dev(v) for k, v in out.items()}
    cd = _dev(cnt2)
    nar.narrow(_dev(tab), _dev(I), _dev(V), cd[:, 0], d["rel"], d["pv"], d["c32"], d["c16"],
               d["c8"], d["start"])
    got = {k: v.cpu() for k, v in d.items()}
    for j, (s, cap, b, nb, B, w, N) in enumerate(rows):
        c = used[j]
        ii = idx[j][:c].to(torch.int64)
        ok = (ii >= 0) & (ii < N)
        hist = torch.bincount(ii[ok] // B, minlength=nb).to(torch.int32)
        assert torch.equal(got["c32"][b:b + nb], hist), (j, seed)
        if w == 2:
            assert torch.equal(got["c16"][b:b + nb], hist.to(torch.int16)), (j, seed)
        if w == 1:
            assert torch.equal(got["c8"][b:b + nb], hist.to(torch.uint8)), (j, seed)
        k = int(ok.sum())
        rel = got["rel"][s:s + k].to(torch.int64) & 0xFFFF
        bins = torch.repeat_interleave(torch.arange(nb), hist.to(torch.int64))
        assert bool((rel < B).all()), (j, seed)
        placed = sorted(zip((bins * B + rel).tolist(),
                            got["pv"][s:s + k].view(torch.int32).tolist()))
        want = sorted(zip(ii[ok].tolist(), vals[j][:c][ok].view(torch.int32).tolist()))
        assert placed == want, (j, seed)
        pad = slice(s + c, s + cap)
        assert torch.equal(got["rel"][pad], torch.zeros(cap - c, dtype=torch.int16)), (j, seed)
        assert torch.equal(got["pv"][pad].view(torch.int32),
                           vals[j][c:].view(torch.int32)), (j, seed)
    assert np.array_equal(cnt2[:, 1].numpy(), np.full(L, -5))
