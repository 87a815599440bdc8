"""Invariants of every compressor (hvdsparse.compressors), checked against an
independent decoder written here (it shares no code with hvdsparse.codec / ops; the
codec's ``payload_to_dense`` is cross-checked against it).

Fresh random data every run: the seed is printed (``HVDSPARSE_TEST_SEED=<seed>``
reproduces a run).
"""
from __future__ import annotations

import io
import math
import os
import random

import pytest
import torch

from hvdsparse.codec import payload_to_dense
from hvdsparse.compressors import (AdaComp, ExponentialWarmup, NoCompression, QSGD,
                                   RandomK, RtWarmup, SlimDP, Threshold, TopK)
from hvdsparse.compressors.threshold import LADDER
from hvdsparse.payload import IndexEncoding as IE
from hvdsparse.payload import ValueEncoding as VE
from tests.workers.topk_oracle import threshold_ladder, topk_capacity, topk_indices

SEED = int(os.environ.get("HVDSPARSE_TEST_SEED", random.randrange(2 ** 31)))
print(f"\n[test_compressors] HVDSPARSE_TEST_SEED={SEED}")

EPS32 = 2.0 ** -23
TINY = torch.finfo(torch.float32).tiny


def gen(tag: str) -> torch.Generator:
    return torch.Generator().manual_seed((SEED * 1000003 + sum(map(ord, tag)) * 7919) % 2 ** 62)


# ----------------------------------------------------------------------------------
# independent decoder
# ----------------------------------------------------------------------------------
_QBITS = {VE.INT8: 8, VE.INT4: 4, VE.INT2: 2}


def decode_segment(seg):
    """-> (idx int64[cnt], val fp32[cnt], err_bound fp32[cnt]) for one segment, with
    err_bound the encoding's bound on |acc - val| (inf for SIGN1)."""
    cap = int(seg.capacity)
    cnt = int(seg.count.reshape(-1)[0])
    assert 0 <= cnt <= cap, (cnt, cap)
    n = int(seg.numel)
    ie, ve = IE(seg.index_encoding), VE(seg.value_encoding)
    if ie == IE.DENSE:
        assert cap == n and cnt == n
        idx = torch.arange(n)
    elif ie == IE.INT32:
        assert seg.indices.dtype == torch.int32 and seg.indices.numel() == cap
        idx = seg.indices[:cnt].long()
    elif ie in (IE.BIN_U8, IE.BIN_U16):
        L = int(seg.bin_size)
        nb = -(-n // L)
        bc = seg.bin_counts.long()
        assert bc.numel() == nb and int(bc.sum()) == cnt and bool((bc >= 0).all())
        if ie == IE.BIN_U8:
            assert seg.indices.dtype == torch.uint8 and L <= 256
            rel = seg.indices[:cnt].long()
        else:
            assert seg.indices.dtype in (torch.int16, torch.uint16)
            rel = seg.indices[:cnt].view(torch.int16).long() & 0xFFFF
        bins = torch.repeat_interleave(torch.arange(nb), bc)
        assert bool((rel < L).all())
        idx = bins * L + rel
    elif ie == IE.IMPLICIT:
        assert seg.implicit_indices is not None and seg.implicit_indices.numel() == cap
        idx = seg.implicit_indices[:cnt].long()
    else:
        raise AssertionError(f"unexpected index encoding {ie}")
    assert bool(((idx >= 0) & (idx < n)).all()), "index out of range"
    assert torch.unique(idx).numel() == idx.numel(), "duplicate index in a segment"
    j = torch.arange(cnt)
    if ve in (VE.FP32, VE.FP16, VE.BF16):
        dt = {VE.FP32: torch.float32, VE.FP16: torch.float16, VE.BF16: torch.bfloat16}[ve]
        assert seg.values.dtype == dt and seg.values.numel() == cap
        val = seg.values[:cnt].float()
        rel_err = {VE.FP32: 0.0, VE.FP16: 2.0 ** -11, VE.BF16: 2.0 ** -8}[ve]
        bound = val.abs() * rel_err * 1.0001 + (2.0 ** -24 if ve == VE.FP16 else 0.0)
    elif ve in _QBITS:
        b = _QBITS[ve]
        qb = int(seg.quant_bucket)
        s = 2 ** (b - 1) - 1
        assert seg.values.dtype == torch.uint8 and seg.values.numel() == -(-cap * b // 8)
        assert seg.scales.numel() == -(-cap // qb)
        byte = seg.values.long()[(j * b) // 8]
        code = (byte >> ((j * b) % 8)) & (2 ** b - 1)
        q = (code - 2 ** (b - 1)).float()
        assert bool((q.abs() <= s).all())
        sc = seg.scales[j // qb]
        val = (q * sc) / s
        bound = sc / s * (1 + 1e-5)
    elif ve == VE.SIGN1:
        assert seg.values.dtype == torch.uint8 and seg.values.numel() == -(-cap // 8)
        scale = seg.scales.reshape(-1)[0]
        bit = (seg.values.long()[j // 8] >> (j % 8)) & 1
        val = torch.where(bit.bool(), -scale, scale).float()
        bound = torch.full((cnt,), math.inf)
    else:
        raise AssertionError(ve)
    return idx, val, bound


def ref_decode(payload):
    n = payload.numel
    out = torch.zeros(n, dtype=torch.float32)
    seen = torch.zeros(n, dtype=torch.bool)
    bound = torch.zeros(n)
    for seg in payload.segments:
        assert int(seg.numel) == n
        idx, val, b = decode_segment(seg)
        assert not bool(seen[idx].any()), "segments overlap"
        seen[idx] = True
        out[idx] = val
        bound[idx] = b
    return out, seen, bound


def layout(payload):
    """Everything that determines the message size (must not depend on data)."""
    sig = []
    for s in payload.segments:
        sig.append((int(s.index_encoding), int(s.value_encoding), int(s.capacity),
                    int(s.numel), int(s.bin_size), int(s.quant_bucket),
                    tuple(s.values.shape), None if s.indices is None else tuple(s.indices.shape),
                    None if s.scales is None else tuple(s.scales.shape),
                    None if s.bin_counts is None else tuple(s.bin_counts.shape)))
    return tuple(sig)


def _no_broadcast(t, name):
    raise AssertionError(f"unexpected broadcast {name!r} (no after_exchange here)")


class BroadcastHub:
    """Blocking-broadcast stand-in for ranks simulated in one process, called rank by
    rank in rank order: rank 0's tensor is kept under its name and handed to the
    others (a copy, as a real broadcast would deliver)."""

    def __init__(self):
        self.sent = {}
        self.calls = []

    def fn(self, rank):
        def broadcast(t, name):
            self.calls.append((rank, name))
            if rank == 0:
                self.sent[name] = t.clone()
                return t
            got = self.sent[name]
            assert got.shape == t.shape and got.dtype == t.dtype, name
            return got.clone()
        return broadcast


# ----------------------------------------------------------------------------------
# compressors under test, each with a checker of its documented count bounds
# ----------------------------------------------------------------------------------
POL = dict(min_numel=0, compress_1d=True)


def chk_topk_exact(comp, p, acc, grad, step, sent_mask):
    n = acc.numel()
    k = max(1, min(n, math.ceil(comp.density(step) * n - 1e-9)))
    nnz = int((acc.abs() >= TINY).sum())
    if p.segments[0].index_encoding == IE.DENSE:
        return
    assert int(sent_mask.sum()) == min(k, nnz)
    if sent_mask.any() and (~sent_mask).any():
        assert acc.abs()[sent_mask].min() >= acc.abs()[~sent_mask].max()


def chk_topk_est(comp, p, acc, grad, step, sent_mask):
    seg = p.segments[0]
    if seg.index_encoding == IE.DENSE:
        return
    st = comp.stats()["layer"]
    sent, sel, thr = st["sent"], st["selected"], st["threshold"]
    assert sent == int(sent_mask.sum()) <= seg.capacity
    passing = acc.abs() >= thr
    assert sel == int(passing.sum())
    assert sent == min(sel, seg.capacity)
    assert bool(passing[sent_mask].all())


def chk_per_bucket(comp, p, acc, grad, step, sent_mask):
    seg = p.segments[0]
    if seg.index_encoding == IE.DENSE:
        return
    B = seg.bin_size
    n = acc.numel()
    kb = seg.capacity // (-(-n // B))
    for b0 in range(0, n, B):
        a = acc.abs()[b0:b0 + B]
        m = sent_mask[b0:b0 + B]
        assert int(m.sum()) == min(kb, int((a >= TINY).sum()))
        if m.any() and (~m).any():
            assert a[m].min() >= a[~m].max()


def ladder_rung(a, tau, cap):
    """Threshold's overflow ladder's rung (``topk_oracle.threshold_ladder``): the lowest
    ``fp32(tau * LADDER[r])`` at which at most ``cap`` elements of ``a`` pass (the top
    rung when none does)."""
    return threshold_ladder(a, tau, cap, LADDER)[0]


def chk_threshold(comp, p, acc, grad, step, sent_mask):
    seg = p.segments[0]
    if seg.index_encoding == IE.DENSE:
        return
    st = comp.stats()["layer"]
    tau = st["threshold"]                             # the (reused or refreshed) tau
    cap = seg.capacity
    passing = acc.abs() >= tau
    assert st["selected"] == int(passing.sum())       # the count at tau
    if int(passing.sum()) <= cap:
        assert torch.equal(sent_mask, passing)
        return
    assert bool(passing[sent_mask].all())
    if st["refreshed"]:                               # no ladder: cut in slot order
        assert int(sent_mask.sum()) == cap
        return
    top = acc.abs() >= ladder_rung(acc.abs(), tau, cap)
    if int(top.sum()) <= cap:
        assert torch.equal(sent_mask, top)
    else:                                             # past the top rung: cut
        assert int(sent_mask.sum()) == cap and bool(top[sent_mask].all())


def chk_adacomp(comp, p, acc, grad, step, sent_mask):
    seg = p.segments[0]
    if seg.index_encoding == IE.DENSE:
        return
    L = seg.bin_size
    n = acc.numel()
    nb = -(-n // L)
    c = comp._layout(p.shape, comp.layer_cfg(p.name))[3]
    assert seg.capacity == (nb * c if comp.mean_per_bin is None else
                            min(nb * c, max(c, math.ceil(comp.mean_per_bin * nb - 1e-9))))
    H = (acc + (comp.scale - 1.0) * grad.float().reshape(-1)).abs()
    gmax = torch.stack([acc[b * L:(b + 1) * L].abs().max() for b in range(nb)])
    assert torch.allclose(seg.scales.reshape(()), gmax.mean(), rtol=1e-6, atol=0)
    want, sent = [], []
    for b in range(nb):
        h = H[b * L:(b + 1) * L]
        m = sent_mask[b * L:(b + 1) * L]
        passing = (h >= max(float(gmax[b]), TINY))
        assert bool(passing[m].all()), "sent an element below its bin maximum"
        want.append(min(c, int(passing.sum())))
        sent.append(int(m.sum()))
        if m.any() and (passing & ~m).any():      # capped bin: the largest |H| went
            assert h[m].min() >= h[passing & ~m].max()
    # the layer budget: all it holds is spent, and a bin that got fewer slots than it
    # wanted has at most one fewer than any other bin (one slot per bin per round)
    assert sum(sent) == min(seg.capacity, sum(want))
    assert all(s <= w for s, w in zip(sent, want))
    short = [s for s, w in zip(sent, want) if s < w]
    assert not short or min(short) >= max(sent) - 1, (sent, want)


def chk_slimdp(comp, p, acc, grad, step, sent_mask):
    n = acc.numel()
    if p.segments[0].index_encoding == IE.DENSE:
        push = comp.core_period > 1 and ((step + 1) % comp.core_period == 0 or step == 0)
        assert push or not comp._sparse_is_worth_it(
            n, sum(comp.sizes(n, comp.alpha, comp.beta)), VE.FP32)
        return
    core, ex = comp.sizes(n, comp.alpha, comp.beta)
    caps = [s.capacity for s in p.segments]
    assert sum(caps) == core + ex and int(sent_mask.sum()) == core + ex


def chk_randomk(comp, p, acc, grad, step, sent_mask):
    seg = p.segments[0]
    if seg.index_encoding == IE.DENSE:
        return
    n = acc.numel()
    k = max(1, min(n, math.ceil(comp.ratio * n - 1e-9)))
    assert int(sent_mask.sum()) == k == seg.capacity


def chk_dense(comp, p, acc, grad, step, sent_mask):
    assert all(s.index_encoding == IE.DENSE for s in p.segments)
    assert bool(sent_mask.all())


SPECS = {
    "topk": (lambda: TopK(0.1, **POL), chk_topk_est),
    "topk_exact": (lambda: TopK(0.1, exact=True, **POL), chk_topk_exact),
    "topk_fp16": (lambda: TopK(0.1, values="fp16", **POL), chk_topk_est),
    "topk_bf16": (lambda: TopK(0.1, values="bf16", **POL), chk_topk_est),
    "topk_int8": (lambda: TopK(0.1, values="int8", **POL), chk_topk_est),
    "topk_int4_exact": (lambda: TopK(0.1, values="int4", exact=True, quant_bucket=16, **POL),
                        chk_topk_exact),
    "topk_int2": (lambda: TopK(0.1, values="int2", **POL), chk_topk_est),
    "topk_bucket64": (lambda: TopK(0.05, per_bucket=64, **POL), chk_per_bucket),
    "topk_bucket512_int4": (lambda: TopK(0.01, per_bucket=512, values="int4", **POL),
                            chk_per_bucket),
    "threshold": (lambda: Threshold(0.9, life_span=2, **POL), chk_threshold),
    "threshold_bf16": (lambda: Threshold(0.8, life_span=3, values="bf16", **POL),
                       chk_threshold),
    "adacomp": (lambda: AdaComp(**POL), chk_adacomp),
    "adacomp_bin7": (lambda: AdaComp(bin_size=7, max_per_bin=2, **POL), chk_adacomp),
    "adacomp_scale3": (lambda: AdaComp(bin_size=300, scale=3.0, **POL), chk_adacomp),
    "adacomp_budget": (lambda: AdaComp(bin_size=20, mean_per_bin=1.5, **POL), chk_adacomp),
    "slimdp": (lambda: SlimDP(0.3, 0.15, core_period=2, **POL), chk_slimdp),
    "slimdp_int8": (lambda: SlimDP(0.2, 0.1, core_period=3, values="int8", **POL),
                    chk_slimdp),
    "randomk": (lambda: RandomK(0.1, **POL), chk_randomk),
    "randomk_shared_fp16": (lambda: RandomK(0.1, shared_seed=True, values="fp16", **POL),
                            chk_randomk),
    "qsgd8_ef": (lambda: QSGD(8, error_feedback=True, **POL), chk_dense),
    "qsgd4_ef": (lambda: QSGD(4, bucket_size=100, error_feedback=True, **POL), chk_dense),
    "qsgd2_ef": (lambda: QSGD(2, error_feedback=True, **POL), chk_dense),
    "none": (lambda: NoCompression(), chk_dense),
}

SHAPES = [(1,), (7,), (50,), (500,), (2, 3, 5, 5), (513,), (64, 67)]
KINDS = ["normal", "ties", "zeros", "huge"]


def make_grad(kind, shape, dtype, g):
    if kind == "normal":
        x = torch.randn(shape, generator=g) * torch.rand((), generator=g) * 10
    elif kind == "ties":
        x = torch.randint(-2, 3, shape, generator=g).float() * 0.5
    elif kind == "zeros":
        x = torch.zeros(shape)
    else:
        x = torch.randn(shape, generator=g) * 1e30
    return x.to(dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", list(SPECS))
def test_error_feedback_invariant_and_counts(spec, kind):
    """sent + new residual == old residual + grad (exact for fp32 values, within one
    fp32 rounding plus the encoding's bound otherwise); counts within documented bounds;
    codec.payload_to_dense agrees with the independent decoder."""
    make, check = SPECS[spec]
    g = gen(spec + kind)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        if kind == "huge" and dtype == torch.float16:
            continue                      # fp16 cannot hold 1e30
        if kind == "huge" and spec in ("topk_fp16", "randomk_shared_fp16"):
            continue                      # fp16 values cannot hold 1e30 (documented)
        for shape in SHAPES:
            comp = make()
            comp.bind(1, 4, broadcast=_no_broadcast)
            for step in range(3):
                grad = make_grad(kind, shape, dtype, g)
                r_old = comp.residual("layer")
                r_old = torch.zeros(grad.numel()) if r_old is None else r_old.clone()
                acc = r_old + grad.float().reshape(-1)
                p = comp.compress("layer", grad, step)
                assert p.name == "layer" and tuple(p.shape) == tuple(shape)
                dec, sent_mask, bound = ref_decode(p)
                assert torch.equal(payload_to_dense(p).reshape(-1), dec), "codec disagrees"
                r_new = comp.residual("layer")
                if r_new is None:                 # no error feedback state
                    r_new = torch.zeros_like(acc)
                ctx = f"{spec} {kind} {dtype} {shape} step {step} seed {SEED}"
                all_fp32 = all(s.value_encoding == VE.FP32 for s in p.segments)
                if all_fp32:
                    assert torch.equal(dec + r_new, acc), ctx
                    assert bool((r_new[sent_mask] == 0).all()), ctx
                else:
                    diff = (dec.double() + r_new.double() - acc.double()).abs()
                    tol = EPS32 * (acc.double().abs() + dec.double().abs()) * 1.01
                    assert bool((diff <= tol).all()), (ctx, float(diff.max()))
                    fin = torch.isfinite(bound) & sent_mask
                    err = (acc - dec).abs()[fin]
                    assert bool((err <= bound[fin] + EPS32 * acc.abs()[fin] * 2).all()), ctx
                assert bool((r_new[~sent_mask] == acc[~sent_mask]).all()), ctx
                if kind == "zeros" and spec not in ("qsgd8_ef", "qsgd4_ef", "qsgd2_ef",
                                                    "none") and not spec.startswith(("slimdp", "randomk")):
                    assert not bool(sent_mask.any()) or p.segments[0].index_encoding == IE.DENSE
                check(comp, p, acc, grad, step, sent_mask)


def test_qsgd_without_error_feedback_is_unbiased_and_bounded():
    g = gen("qsgd")
    x = torch.randn(4099, generator=g)
    for bits in (8, 4, 2):
        comp = QSGD(bits, bucket_size=512, **POL)
        s = 2 ** (bits - 1) - 1
        decs = []
        for step in range(200):
            p = comp.compress("layer", x, step)
            dec, _, bound = ref_decode(p)
            assert bool(((dec - x).abs() <= bound + 1e-6).all())
            decs.append(dec)
        assert comp.residual("layer") is None
        mean = torch.stack(decs).mean(0)
        # std of one element's error <= scale / s / 2; 200 draws -> std/sqrt(200)
        scale = x.abs().max()
        assert float((mean - x).abs().max()) < 5 * float(scale) / s / 2 / math.sqrt(200) + 1e-6


def test_topk_exact_equals_true_topk():
    g = gen("exact")
    for n in (1, 10, 1000, 4096):
        x = torch.randn(n, generator=g)
        comp = TopK(0.05, exact=True, **POL)
        p = comp.compress("layer", x, 0)
        _, sent, _ = ref_decode(p)
        k = max(1, math.ceil(0.05 * n - 1e-9))
        ref = set(topk_indices(x, k).tolist())
        assert set(sent.nonzero().reshape(-1).tolist()) == ref


def test_topk_exact_breaks_ties_to_the_lower_index(seed):
    """Equal |acc| at the k-th value: the lower indices are sent, whatever torch.topk's
    kernel would pick (the rule the replays reproduce)."""
    g = torch.Generator().manual_seed(seed)
    for n, k in ((40, 2), (1000, 50), (4096, 205)):
        x = torch.randn(n, generator=g) * 0.1
        tied = torch.randperm(n, generator=g)[:3 * k]
        big = tied[:k - 1]
        x[big] = 10.0 + torch.rand(k - 1, generator=g)       # k - 1 clear winners
        x[tied[k - 1:]] = torch.where(torch.rand(2 * k + 1, generator=g) < 0.5, 3.0, -3.0)
        comp = TopK(k / n, exact=True, **POL)
        p = comp.compress("layer", x, 0)
        _, sent, _ = ref_decode(p)
        want = set(big.tolist()) | {int(tied[k - 1:].min())}
        assert set(sent.nonzero().reshape(-1).tolist()) == want
        assert want == set(topk_indices(x, k).tolist())


@pytest.mark.parametrize("dist", ["normal", "laplace", "lognormal", "student2"])
def test_topk_sampled_threshold_count_bounds(dist):
    """Documented: sent <= capacity = ceil(1.5 k) always; selected in [0.9 k, capacity]
    for i.i.d. continuous magnitudes (observed [1.0 k, 1.4 k])."""
    g = gen("est" + dist)
    for n, ratio in ((200_000, 0.01), (1_000_003, 0.001), (300_000, 0.1)):
        if dist == "normal":
            x = torch.randn(n, generator=g)
        elif dist == "laplace":
            u = torch.rand(n, generator=g) - 0.5
            x = -torch.sign(u) * torch.log1p(-2 * u.abs())
        elif dist == "lognormal":
            x = torch.randn(n, generator=g).exp() * torch.sign(torch.randn(n, generator=g))
        else:
            a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
            x = a / ((b * b + torch.randn(n, generator=g) ** 2) / 2).sqrt()
        comp = TopK(ratio)
        p = comp.compress("w", x.view(1, n), 0)
        st = comp.stats()["w"]
        k = math.ceil(ratio * n)
        cap = math.ceil(1.5 * k)
        assert p.segments[0].capacity == cap
        assert st["sent"] <= cap
        assert 0.9 * k <= st["selected"] <= cap, (dist, n, ratio, st["selected"], k, SEED)


def test_topk_select_first_equals_count_then_select():
    """CPU path: TopK selects with the first sampled estimate and takes the count from
    that select (undoing it when the count is out of [k, capacity]). It must give the
    same bits as the written algorithm -- count every round, then one select -- which is
    replayed here with ``first_count=None`` on a copy of the accumulator. slack=1.0
    (capacity = k) forces the undo path; the test checks it was taken."""
    from hvdsparse import ops
    from hvdsparse.compressors.base import PURPOSE_SAMPLE, TINY
    from hvdsparse.compressors.topk import estimate_topk_threshold
    g = gen("selfirst")
    undone = 0
    for slack in (1.5, 1.05, 1.0):
        comp = TopK(0.01, slack=slack, **POL)
        n = 160_000 + int(torch.randint(0, 4096, (1,), generator=g)) * 16
        r = torch.zeros(n)
        for step in range(3):
            x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4)
            acc = r + x
            k = math.ceil(0.01 * n)
            cap = min(n, math.ceil(slack * k))
            off = comp._seed("w", step, PURPOSE_SAMPLE)
            t0 = estimate_topk_threshold(acc.clone(), k, cap, offset=off, rounds=0)
            c0 = int((acc.abs() >= t0).sum())
            undone += not (k <= c0 <= cap)
            thr = estimate_topk_threshold(acc.clone(), k, cap, offset=off, rounds=2)
            ref_acc = acc.clone()
            idx, vals, cnt = ops.select_compact(ref_acc, thr.clamp_min(TINY), cap)
            p = comp.compress("w", x.view(-1, 16), step)
            seg = p.segments[0]
            sent = int(cnt[0])
            assert torch.equal(seg.count, cnt[:1]), (slack, step)
            assert torch.equal(seg.indices[:sent], idx[:sent]), (slack, step)
            assert torch.equal(seg.values[:sent], vals[:sent]), (slack, step)
            r = comp.residual("w").reshape(-1)
            assert torch.equal(r, ref_acc), (slack, step)
    assert undone >= 1, "the undo path was never exercised"


@pytest.mark.parametrize("guard", [False, True])
def test_threshold_reuse_and_refresh(guard):
    """DCT-DP: tau recomputed exactly (k-th largest |acc|) on steps t % L == 0, reused
    in between (with the overflow guard: raised by min(2, sqrt(selected/capacity))
    after a step where more than capacity passed); history records the refreshes."""
    g = gen("dct")
    L = 4
    comp = Threshold(0.95, life_span=L, overflow_guard=guard, **POL)
    n = 3000
    k = math.ceil(0.05 * n)
    cap = 2 * k
    taus, overflowed = [], []
    for step in range(10):
        r_old = comp.residual("w")
        r_old = torch.zeros(n) if r_old is None else r_old.clone()
        grad = torch.randn(40, 75, generator=g) * (1 + step) ** 2
        acc = r_old + grad.reshape(-1)
        comp.compress("w", grad, step)
        st = comp.stats()["w"]
        tau = st["threshold"]
        if step % L == 0:
            assert tau == float(torch.topk(acc.abs(), k).values[-1])
        elif guard and overflowed[-1]:
            want = torch.tensor(taus[-1]) * torch.tensor(st_prev["selected"] / cap).double().sqrt().float().clamp_max(2.0)
            assert tau == pytest.approx(float(want), rel=1e-6)
        else:
            assert tau == taus[-1]
        taus.append(tau)
        overflowed.append(st["selected"] > cap)
        st_prev = st
        assert st["refreshed"] == (step % L == 0)
        passing = int((acc.abs() >= tau).sum())
        assert st["selected"] == passing                   # the count at tau
        if guard and step % L and passing > cap:           # the overflow ladder
            assert st["sent"] == min(cap, int((acc.abs() >=
                                               ladder_rung(acc.abs(), tau, cap)).sum()))
            assert st["sent"] < passing
        else:
            assert st["sent"] == min(cap, passing)
    assert any(overflowed)        # the growing gradients did exercise the guard path
    hist = comp.threshold_history("w")
    assert [s for s, _ in hist] == [0, 4, 8]
    assert [t for _, t in hist] == [taus[0], taus[4], taus[8]]


def test_threshold_true_history():
    comp = Threshold(0.9, life_span=100, record_true_threshold=True, **POL)
    g = gen("dcttrue")
    for step in range(5):
        comp.compress("w", torch.randn(2000, generator=g), step)
    assert len(comp.threshold_history("w", true=True)) == 5
    assert len(comp.threshold_history("w")) == 1


def test_adacomp_sends_every_nonzero_bin_maximum_first_step():
    g = gen("adamax")
    for shape, L in (((8, 4, 5, 5), 50), ((37, 41), 500)):
        x = torch.randn(shape, generator=g)
        flat = x.reshape(-1)
        nb = -(-flat.numel() // L)
        # zero some bins and put ties at the maximum in others
        flat[0:L] = 0
        if nb > 2:
            flat[2 * L:2 * L + 3] = flat[2 * L:3 * L].abs().max()
        comp = AdaComp(**POL)
        p = comp.compress("w", x, 0)
        seg = p.segments[0]
        assert seg.bin_size == L
        assert seg.index_encoding == (IE.BIN_U8 if L == 50 else IE.BIN_U16)
        _, sent, _ = ref_decode(p)
        for b in range(nb):
            blk = flat[b * L:(b + 1) * L]
            m = blk.abs().max()
            if m == 0:
                assert not bool(sent[b * L:(b + 1) * L].any())
            else:
                argmaxes = (blk.abs() == m).nonzero().reshape(-1) + b * L
                assert bool(sent[argmaxes].any()), f"bin {b} maximum not sent (seed {SEED})"


def test_adacomp_bin_size_defaults_and_override():
    comp = AdaComp(overrides={"emb*": dict(bin_size=100)})
    g = gen("adadef")
    assert comp.compress("conv", torch.randn(16, 8, 3, 3, generator=g), 0).segments[0].bin_size == 50
    assert comp.compress("fc", torch.randn(30, 70, generator=g), 0).segments[0].bin_size == 500
    assert comp.compress("emb", torch.randn(30, 70, generator=g), 0).segments[0].bin_size == 100
    st = comp.stats()
    assert st["fc"]["effective_rate"] > 1 and st["fc"]["compression_rate"] > 1


def _ranks(make, world=4):
    hub = BroadcastHub()
    return [make().bind(r, world, broadcast=hub.fn(r)) for r in range(world)]


def test_slimdp_core_identical_across_ranks_and_stable():
    """Ranks whose weights differ (as with local_gradient) still hold the same core:
    rank 0's top |w| + c|g| at the end of each re-selection step, broadcast; dense
    pushes at step 0 and before every re-selection; one broadcast per re-selection."""
    q = 5
    hub = BroadcastHub()
    comps = [SlimDP(0.3, 0.15, core_period=q, c=1.5, **POL).bind(r, 4, broadcast=hub.fn(r))
             for r in range(4)]
    g = gen("slim")
    w = torch.randn(30, 40, generator=g)
    n = w.numel()
    core, exs = SlimDP.sizes(n, 0.3, 0.15)
    cores = {}
    expect = None
    for step in range(16):
        ws = [w + 0.05 * r * torch.randn(30, 40, generator=g) for r in range(4)]
        payloads = [c.compress("w", torch.randn(30, 40, generator=g), step, param=ws[r])
                    for r, c in enumerate(comps)]
        if (step + 1) % q == 0 or step == 0:       # dense push before re-selection
            assert all(p.segments[0].index_encoding == IE.DENSE for p in payloads)
        else:
            core0 = payloads[0].segments[0].implicit_indices
            assert payloads[0].segments[0].index_encoding == IE.IMPLICIT
            assert torch.equal(core0, expect)
            for p in payloads[1:]:
                assert torch.equal(p.segments[0].implicit_indices, core0)
            # explorer: outside the core, unique, different per rank
            ex = [p.segments[1].indices.long() for p in payloads]
            for e in ex:
                assert not bool(torch.isin(e, core0).any())
            assert not torch.equal(ex[0], ex[1])
            epoch = step // q
            if epoch in cores:
                assert torch.equal(cores[epoch], core0), "core changed between re-selections"
            cores[epoch] = core0
            # cost: beta n values + (alpha - beta) n pairs = (2 alpha - beta) n words
            assert payloads[0].segments[0].capacity == core
            assert payloads[0].segments[1].capacity == exs
            st = comps[0].stats()["w"]
            # on the wire the explorer's int32 indices go bin-relative: a uint16 each
            # plus one uint16 count for the layer's single bin (1200 elements)
            assert st["payload_bytes"] == 4 * core + 6 * exs + 2 + 8
            assert abs(4 * (core + 2 * exs) - 4 * (2 * 0.3 - 0.15) * n) <= 12
        avg = sum(payload_to_dense(p) for p in payloads) / 4
        ncalls = len(hub.calls)
        for r, c in enumerate(comps):
            c.after_exchange("w", avg, step, param=ws[r])
        if (step + 1) % q == 0 or step == 0:
            assert len(hub.calls) == ncalls + 4
            S = ws[0].reshape(-1).abs() + 1.5 * avg.reshape(-1).abs()
            expect = torch.sort(torch.topk(S, core).indices).values
            # rank 3's own weights would have chosen a different core
            assert not torch.equal(expect, torch.sort(torch.topk(
                ws[3].reshape(-1).abs() + 1.5 * avg.reshape(-1).abs(), core).indices).values)
        else:
            assert len(hub.calls) == ncalls
        w = w - 0.1 * avg
    assert len(cores) >= 3


def test_slimdp_core_is_top_significance():
    comp = SlimDP(0.4, 0.2, core_period=3, c=2.0, **POL)
    g = gen("slimsig")
    w = torch.randn(50, 40, generator=g)
    grad_avg = torch.randn(50, 40, generator=g)
    comp.compress("w", torch.randn(50, 40, generator=g), 0, param=w)
    comp.compress("w", torch.randn(50, 40, generator=g), 1, param=w)
    comp.compress("w", torch.randn(50, 40, generator=g), 2, param=w)     # dense push
    comp.after_exchange("w", grad_avg, 2, param=w)
    p = comp.compress("w", torch.randn(50, 40, generator=g), 3, param=w)
    S = w.abs().reshape(-1) + 2.0 * grad_avg.abs().reshape(-1)
    core = p.segments[0].implicit_indices
    expect = torch.sort(torch.topk(S, core.numel()).indices).values
    assert torch.equal(core, expect)


def test_randomk_draw_is_one_index_per_stratum_with_uniform_marginals():
    """RandomK's stratified draw (randomk.py): k distinct ascending indices, index j in
    stratum [floor(j n / k), floor((j + 1) n / k)); over many steps every element is
    drawn with probability 1 / (its stratum's size), k dividing n or not (the Triton
    path's draw: tests/test_bucket_compress.py)."""
    from hvdsparse.compressors.randomk import stratified_indices, stratum_sizes
    n, k, T = 1000, 30, 3000            # strata of 33 and 34 elements
    rk = RandomK(k / n, seed=int(torch.randint(0, 2 ** 20, ()).item()))
    lo = torch.arange(k + 1, dtype=torch.int64) * n // k
    hits = torch.zeros(n)
    for t in range(T):
        idx = rk.indices("w", n, t)
        assert idx.dtype == torch.int64 and idx.numel() == k
        assert bool((idx >= lo[:-1]).all() and (idx < lo[1:]).all())
        hits[idx] += 1
    p = (1.0 / stratum_sizes(n, k).double()).repeat_interleave(stratum_sizes(n, k))
    freq = hits.double() / T
    assert float(((freq - p).abs() / (p * (1 - p) / T).sqrt()).max()) < 5.5
    # the extremes of the uniforms stay inside their strata (exact integer math)
    u = torch.tensor([0.0, 0.99999994] * (k // 2), dtype=torch.float32)
    idx = stratified_indices(u, n, k)
    assert torch.equal(idx[0::2], lo[:-1][0::2]) and torch.equal(idx[1::2], lo[1:][1::2] - 1)


def test_slimdp_explorer_is_one_index_per_stratum_outside_the_core():
    """Slim-DP's explorer (slimdp.py): the elements outside the core, in index order, cut
    into e strata, one drawn per stratum; against an independent reference (the
    complement listed in Python, RandomK's stratified positions into it), and over many
    steps every element outside the core is drawn with probability 1 / (its stratum's
    size), none inside it (the Triton path's draw: tests/test_bucket_compress.py)."""
    from hvdsparse.compressors.randomk import stratified_indices, stratum_sizes
    from hvdsparse.compressors.slimdp import explorer_indices
    g = gen("slim-explorer")
    for _ in range(50):                 # the mapping, on random cores and sizes
        n = int(torch.randint(1, 400, (), generator=g))
        nc = int(torch.randint(0, n, (), generator=g))
        core = torch.sort(torch.randperm(n, generator=g)[:nc]).values
        e = int(torch.randint(1, n - nc + 1, (), generator=g))
        u = torch.rand(e, generator=g)
        outside = torch.tensor([i for i in range(n) if i not in set(core.tolist())],
                               dtype=torch.int64)
        got = explorer_indices(u, n, core)
        assert torch.equal(got, outside[stratified_indices(u, n - nc, e)]), (n, nc, e)
    with pytest.raises(ValueError, match="outside a core"):
        explorer_indices(torch.rand(5), 10, torch.arange(6))
    s = SlimDP(0.13, 0.1, core_period=10 ** 6, dense_before_reselect=False,
               seed=int(torch.randint(0, 2 ** 20, (), generator=g).item()), **POL)
    n, T = 1000, 3000
    s.compress("w", torch.randn(n, generator=g), 0)
    core = s.core("w")
    nc, e = SlimDP.sizes(n, 0.13, 0.1)       # 100 and 30: strata of 30 and 31
    hits = torch.zeros(n)
    for t in range(1, T + 1):
        p = s.compress("w", torch.randn(n, generator=g), t)
        assert torch.equal(p.segments[0].implicit_indices, core)
        ex = p.segments[1].indices.long()
        assert ex.numel() == e and bool((ex[1:] > ex[:-1]).all())
        hits[ex] += 1
    assert float(hits[core].sum()) == 0
    outside = hits[torch.ones(n, dtype=torch.bool).index_fill_(0, core, False)]
    sz = stratum_sizes(n - nc, e).double()
    pr = (1.0 / sz).repeat_interleave(sz.long())
    freq = outside.double() / T
    assert float(((freq - pr).abs() / (pr * (1 - pr) / T).sqrt()).max()) < 5.5


def test_randomk_shared_seed_identical_across_ranks():
    shared = _ranks(lambda: RandomK(0.05, shared_seed=True, **POL))
    own = _ranks(lambda: RandomK(0.05, **POL))
    g = gen("rk")
    for step in range(3):
        ps = [c.compress("w", torch.randn(3000, generator=g), step) for c in shared]
        assert all(p.segments[0].index_encoding == IE.IMPLICIT for p in ps)
        for p in ps[1:]:
            assert torch.equal(p.segments[0].implicit_indices, ps[0].segments[0].implicit_indices)
        po = [c.compress("w", torch.randn(3000, generator=g), step) for c in own]
        assert po[0].segments[0].index_encoding == IE.INT32
        assert not torch.equal(po[0].segments[0].indices, po[1].segments[0].indices)
    a = ps[0].segments[0].implicit_indices
    assert torch.unique(a).numel() == a.numel() == 150


ALL_FOR_LAYOUT = {
    "topk": lambda: TopK(0.01, warmup=RtWarmup(6)),
    "topk_int4": lambda: TopK(0.02, values="int4", warmup=ExponentialWarmup(6, stages=3)),
    "topk_bucket": lambda: TopK(0.01, per_bucket=512),
    "threshold": lambda: Threshold(0.99, life_span=3, warmup=("rt", 5)),
    "adacomp": lambda: AdaComp(),
    "slimdp": lambda: SlimDP(0.3, 0.15, core_period=4),
    "randomk": lambda: RandomK(0.01),
    "randomk_shared": lambda: RandomK(0.01, shared_seed=True),
    "qsgd": lambda: QSGD(4),
    "none": lambda: NoCompression(),
}


@pytest.mark.parametrize("name", list(ALL_FOR_LAYOUT))
def test_capacities_identical_across_ranks(name):
    comps = _ranks(ALL_FOR_LAYOUT[name])
    g = gen("layout" + name)
    w = torch.randn(64, 200, generator=g)
    for step in range(10):
        outs = []
        for r, c in enumerate(comps):
            kind = ["normal", "ties", "zeros", "huge"][r]
            grads = {"a": make_grad(kind, (64, 200), torch.float32, g),
                     "b": make_grad(kind, (8, 4, 5, 5), torch.float32, g),
                     "bias": make_grad(kind, (200,), torch.float32, g)}
            outs.append([layout(c.compress(k, v, step, param=w)) for k, v in grads.items()])
        for o in outs[1:]:
            assert o == outs[0], f"{name} step {step}: ranks encode different layouts"


CTOR_ERRORS = [
    (lambda: TopK(0), "ratio"), (lambda: TopK(1.5), "ratio"), (lambda: TopK("x"), "ratio"),
    (lambda: TopK(0.1, values="int3"), "values"), (lambda: TopK(0.1, exact=1), "exact"),
    (lambda: TopK(0.1, per_bucket=0), "per_bucket"), (lambda: TopK(0.1, slack=0.5), "slack"),
    (lambda: TopK(0.1, rounds=-1), "rounds"), (lambda: TopK(0.1, quant_bucket=0), "quant_bucket"),
    (lambda: TopK(0.1, warmup=("lin", 3)), "warmup"), (lambda: TopK(0.1, warmup=RtWarmup(0)), "T"),
    (lambda: TopK(0.1, min_numel=-1), "min_numel"), (lambda: TopK(0.1, seed=1.5), "seed"),
    (lambda: TopK(0.1, overrides={"e*": dict(ratio=2.0)}), "ratio"),
    (lambda: TopK(0.1, overrides={"e*": dict(bogus=1)}), "bogus"),
    (lambda: TopK(0.1, overrides=[1]), "overrides"),
    (lambda: Threshold(1.0), "sparsity"), (lambda: Threshold(-0.1), "sparsity"),
    (lambda: Threshold(0.9, life_span=0), "life_span"),
    (lambda: AdaComp(bin_size=0), "bin_size"), (lambda: AdaComp(bin_size=70000), "bin_size"),
    (lambda: AdaComp(scale=0.5), "scale"), (lambda: AdaComp(max_per_bin=0), "max_per_bin"),
    (lambda: AdaComp(mean_per_bin=0), "mean_per_bin"),
    (lambda: AdaComp(mean_per_bin=float("nan")), "mean_per_bin"),
    (lambda: AdaComp(mean_per_bin=True), "mean_per_bin"),
    (lambda: AdaComp(mean_per_bin="2"), "mean_per_bin"),
    (lambda: SlimDP(0, 0), "alpha"), (lambda: SlimDP(0.2, 0.3), "beta"),
    (lambda: SlimDP(0.3, 0.1, core_period=0), "core_period"),
    (lambda: SlimDP(0.3, 0.1, c=-1), "c"), (lambda: SlimDP(0.3, 0.1, error_feedback="y"),
                                            "error_feedback"),
    (lambda: RandomK(0), "ratio"), (lambda: RandomK(0.1, shared_seed=None), "shared_seed"),
    (lambda: QSGD(3), "bits"), (lambda: QSGD(4, bucket_size=0), "bucket_size"),
    (lambda: ExponentialWarmup(10, stages=0), "stages"),
]


@pytest.mark.parametrize("i", range(len(CTOR_ERRORS)))
def test_constructor_errors_name_the_argument(i):
    make, arg = CTOR_ERRORS[i]
    with pytest.raises(ValueError, match=arg):
        make()


def test_bind_and_compress_errors():
    with pytest.raises(ValueError, match="rank"):
        TopK(0.1).bind(4, 4)
    with pytest.raises(ValueError, match="world_size"):
        TopK(0.1).bind(0, 0)
    c = TopK(0.1)
    c.compress("w", torch.randn(40, 40), 0)
    with pytest.raises(ValueError, match="'w'"):
        c.compress("w", torch.randn(41, 40), 1)
    with pytest.raises(TypeError, match="'w'"):
        c.compress("w", torch.zeros(40, 40, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="step"):
        c.compress("w", torch.randn(40, 40), -1)


def test_policy():
    comp = TopK(0.01, overrides={"embed*": dict(ratio=0.05), "*.skip": dict(dense=True),
                                 "tiny": dict(compress=True)})
    g = gen("policy")
    p = comp.compress("small", torch.randn(31, 33, generator=g), 0)          # 1023 < 1024
    assert p.segments[0].index_encoding == IE.DENSE and p.segments[0].value_encoding == VE.FP32
    p = comp.compress("bias", torch.randn(5000, generator=g), 0)             # 1-D
    assert p.segments[0].index_encoding == IE.DENSE
    p = comp.compress("big", torch.randn(100, 100, generator=g), 0)
    # 1% of 10 000: the estimate's exact route (the k-th largest), capacity k
    assert p.segments[0].index_encoding == IE.INT32 and p.segments[0].capacity == 100
    p = comp.compress("embed.w", torch.randn(100, 100, generator=g), 0)
    assert p.segments[0].capacity == 750
    p = comp.compress("x.skip", torch.randn(100, 100, generator=g), 0)
    assert p.segments[0].index_encoding == IE.DENSE
    p = comp.compress("tiny", torch.randn(10, 10, generator=g), 0)
    assert p.segments[0].index_encoding == IE.INT32
    assert TopK(0.01, compress_1d=True).compress("b", torch.randn(5000), 0) \
        .segments[0].index_encoding == IE.INT32
    # sparse bigger than dense -> dense (with error feedback; fp32 flushes the residual)
    c2 = TopK(0.6)
    x = torch.randn(100, 100, generator=g)
    p = c2.compress("w", x, 0)
    assert p.segments[0].index_encoding == IE.DENSE
    assert torch.equal(ref_decode(p)[0], x.reshape(-1))
    assert float(c2.residual("w").abs().max()) == 0.0


def test_warmup_schedules():
    rt = RtWarmup(1000)
    assert rt(0, 0.01) == 1.0
    assert rt(1, 0.01) == pytest.approx(1 - 0.99 ** 1000)
    assert rt(100, 0.01) == pytest.approx(1 - 0.99 ** 10)
    assert rt(500, 0.01) == pytest.approx(1 - 0.99 ** 2)
    assert rt(999, 0.01) == pytest.approx(1 - 0.99 ** (1000 / 999))
    assert rt(1000, 0.01) == 0.01 and rt(5000, 0.01) == 0.01
    ex = ExponentialWarmup(400, stages=4)
    dens = [ex(t, 0.001) for t in (0, 99, 100, 200, 300, 399, 400)]
    assert dens == pytest.approx([0.001 ** 0.2] * 2 + [0.001 ** 0.4, 0.001 ** 0.6,
                                                        0.001 ** 0.8, 0.001 ** 0.8, 0.001])
    # DGC's 25% / 6.25% / 1.5625% / 0.4% up to rounding
    for got, dgc in zip(dens[1:], (0.25, 0.0625, 0.015625, 0.004)):
        assert abs(math.log(got / dgc)) < 0.05
    exc = ExponentialWarmup(100)
    assert exc(0, 0.01) == 1.0 and exc(50, 0.01) == pytest.approx(0.1)
    # TopK capacity follows the schedule: dense while sparse is not smaller
    comp = TopK(0.01, warmup=RtWarmup(100))
    n = 100 * 100
    for t in (0, 1, 10, 30, 50, 99, 100, 150):
        d = RtWarmup(100)(t, 0.01)
        k = max(1, math.ceil(d * n - 1e-9))
        cap = topk_capacity(n, k)
        p = comp.compress("w", torch.randn(100, 100), t)
        if cap * 8 < n * 4:
            assert p.segments[0].capacity == cap == comp.capacity(n, t), t
        else:
            assert p.segments[0].index_encoding == IE.DENSE, t


STATEFUL = {
    "topk": lambda: TopK(0.05, warmup=RtWarmup(4)),
    "topk_int4": lambda: TopK(0.05, values="int4"),
    "topk_bucket_int2": lambda: TopK(0.05, per_bucket=128, values="int2"),
    "threshold": lambda: Threshold(0.95, life_span=3),
    "adacomp": lambda: AdaComp(),
    "slimdp": lambda: SlimDP(0.3, 0.15, core_period=3),
    "slimdp_noef": lambda: SlimDP(0.3, 0.15, core_period=4, error_feedback=False),
    "randomk": lambda: RandomK(0.05),
    "qsgd_ef": lambda: QSGD(2, error_feedback=True),
}


def _payload_tensors(p):
    out = []
    for s in p.segments:
        for t in (s.count, s.values, s.indices, s.scales, s.bin_counts, s.implicit_indices):
            out.append(None if t is None else t.clone())
    return out


@pytest.mark.parametrize("name", list(STATEFUL))
def test_state_dict_resume_is_identical(name):
    make = STATEFUL[name]
    g = gen("resume" + name)
    N, M = 5, 6
    grads = [{"a": torch.randn(40, 60, generator=g), "b": torch.randn(2, 3, 10, 10, generator=g)}
             for _ in range(N + M)]
    ws = [torch.randn(40, 60, generator=g) for _ in range(N + M)]

    def run(comp, steps):
        outs = []
        for t in steps:
            for k, v in grads[t].items():
                p = comp.compress(k, v, t, param=ws[t] if k == "a" else None)
                outs.append(_payload_tensors(p))
                comp.after_exchange(k, payload_to_dense(p), t, param=ws[t] if k == "a" else None)
        return outs

    ident = lambda t, name: t           # rank 0 of 4: its own tensor is the broadcast  # noqa: E731
    a = make().bind(0, 4, broadcast=ident)
    run(a, range(N))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    cont = run(a, range(N, N + M))
    b = make().bind(0, 4, broadcast=ident)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))    # plain data only
    resumed = run(b, range(N, N + M))
    assert len(cont) == len(resumed)
    for x, y in zip(cont, resumed):
        for tx, ty in zip(x, y):
            assert (tx is None) == (ty is None)
            if tx is not None:
                assert torch.equal(tx, ty), name
    for k in ("a", "b"):
        if a.residual(k) is not None:
            assert torch.equal(a.residual(k), b.residual(k))


def test_load_state_dict_rejects_mismatch():
    a = TopK(0.1)
    a.compress("w", torch.randn(50, 50), 0)
    with pytest.raises(ValueError, match="TopK"):
        Threshold(0.9).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="settings"):
        TopK(0.2).load_state_dict(a.state_dict())


def test_stats_fields():
    comp = TopK(0.01)
    g = gen("stats")
    for t in range(3):
        comp.compress("w", torch.randn(100, 100, generator=g), t)
        comp.compress("b", torch.randn(100, generator=g), t)
    st = comp.stats()
    w = st["w"]
    for key in ("sent", "selected", "payload_bytes", "dense_bytes", "compression_rate",
                "effective_rate", "threshold", "steps"):
        assert key in w
    # 100 slots (1% of 10 000: the exact route, capacity k) of a uint16 position (the
    # int32 index narrowed for the wire) + fp32 value, one uint16 count for the single
    # bin of 10000 elements, the count word
    assert w["dense_bytes"] == 40000 and w["payload_bytes"] == 100 * 6 + 2 + 4
    assert w["compression_rate"] == pytest.approx(40000 / 606)
    assert w["steps"] == 3 and w["total_sent"] >= w["sent"]
    assert st["b"]["compression_rate"] < 1.0         # dense 1-D bias
    tot = comp.stats_totals()
    assert tot["dense_bytes"] == 3 * (40000 + 400)


def test_stats_bytes_and_totals_against_payloads():
    """Per-layer stats against the payloads themselves, computed here on the host: the
    latest step's ``sent`` and effective bytes (slot bytes x count + fixed bytes, over
    every segment) and the running totals, through a warm-up that changes the layer's
    encoding (dense steps, then sparse), for a one-segment (TopK) and a binned (AdaComp)
    compressor; a checkpoint of the stats continues with the same totals."""
    from hvdsparse.stats import segment_fixed_bytes, segment_slot_bytes
    g = gen("stats-bytes")
    for make in (lambda: TopK(0.02, warmup=("rt", 6)), lambda: AdaComp()):
        comp, comp2 = make(), None
        want_eff = want_sent = 0
        encs = set()
        for t in range(8):
            if t == 5:                                       # resume from a checkpoint
                comp2 = make()
                comp2.load_state_dict(comp.state_dict())
            c = comp if comp2 is None else comp2
            p = c.compress("w", torch.randn(80, 90, generator=g), t)
            eff = sum(segment_slot_bytes(sg) * int(sg.count.reshape(-1)[0]) +
                      segment_fixed_bytes(sg) for sg in p.segments)
            sent = sum(int(sg.count.reshape(-1)[0]) for sg in p.segments)
            want_eff += eff
            want_sent += sent
            encs.add(tuple(int(sg.index_encoding) for sg in p.segments))
            st = c.stats()["w"]
            assert st["sent"] == sent and st["effective_bytes"] == pytest.approx(eff), t
            assert st["total_sent"] == want_sent, t
            assert st["total_effective_bytes"] == pytest.approx(want_eff), t
            assert st["steps"] == t + 1
            tot = c.stats_totals()
            assert tot["effective_bytes"] == pytest.approx(want_eff), t
        if isinstance(comp, TopK):
            assert len(encs) >= 2, encs                      # dense warm-up, then sparse


def test_stats_deferred_fold_over_many_layers_and_steps():
    """The statistics fold a step's counts into the running sums later (at the next
    ``begin_step``, a layer's next compress, or a read). Read only every few steps, over
    layers that change layout (TopK's dense warm-up, then sparse), a layer that is absent
    in some steps (``compress_absent``: not recorded), with and without
    ``begin_step``, each layer's latest ``sent`` and every total must equal the sums of
    the payloads' own counts, computed here on the host when each payload was made."""
    from hvdsparse.stats import segment_fixed_bytes, segment_slot_bytes
    g = gen("stats-fold")
    shapes = {"a": (60, 70), "b": (300,), "c": (40, 90), "d": (90, 11)}
    for make, use_steps in ((lambda: TopK(0.03, warmup=("rt", 4)), True),
                            (lambda: AdaComp(), False),
                            (lambda: TopK(0.05), False)):
        comp = make()
        want = {n: [0, 0.0, None, 0] for n in shapes}     # total sent, eff, last, steps
        for t in range(9):
            if use_steps:
                comp.begin_step(t)
            names = [n for n in shapes if not (n == "c" and t % 3 == 1)]
            for n in names:
                p = comp.compress(n, torch.randn(*shapes[n], generator=g), t)
                sent = sum(int(sg.count.reshape(-1)[0]) for sg in p.segments)
                eff = sum(segment_slot_bytes(sg) * int(sg.count.reshape(-1)[0]) +
                          segment_fixed_bytes(sg) for sg in p.segments)
                w = want[n]
                w[0] += sent
                w[1] += eff
                w[2] = sent
                w[3] += 1
            if "c" not in names:
                comp.compress_absent("c", torch.zeros(shapes["c"]), t)
            if use_steps:
                comp.commit()
            if t % 4 == 3 or t == 8:
                st = comp.stats()
                for n, (tsent, teff, last, steps) in want.items():
                    assert st[n]["sent"] == last, (t, n)
                    assert st[n]["total_sent"] == tsent, (t, n)
                    assert st[n]["total_effective_bytes"] == pytest.approx(teff), (t, n)
                    assert st[n]["steps"] == steps, (t, n)
                assert comp.stats_totals()["effective_bytes"] == pytest.approx(
                    sum(w[1] for w in want.values()))


def test_no_host_sync_helpers_in_compress(monkeypatch):
    """compress() / after_exchange() must not pull tensor values to the host themselves
    (.item, .tolist, int/float/bool of a tensor, nonzero); the CPU reference ops may.
    (Quick Tensor-method spy; the aten-level check is in test_compressor_trust.py.)"""
    calls = []

    def spy(orig):
        def f(self, *a, **k):
            import traceback
            stack = "".join(traceback.format_stack(limit=6))
            if "compressors" in stack and "reference.py" not in stack and "hvdsparse/cpu" not in stack \
                    and "codec" not in stack:
                calls.append(stack)
            return orig(self, *a, **k)
        return f
    for meth in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__",
                 "nonzero"):
        monkeypatch.setattr(torch.Tensor, meth, spy(getattr(torch.Tensor, meth)))
    g = gen("sync")
    for make in list(ALL_FOR_LAYOUT.values()):
        c = make()
        for t in range(4):
            c.compress("w", torch.randn(64, 200, generator=g), t, param=torch.randn(64, 200))
            c.after_exchange("w", torch.randn(64, 200, generator=g), t, param=torch.randn(64, 200))
    assert not calls, calls[0]


def test_without_error_feedback_nothing_is_remembered():
    g = gen("noef")
    x = torch.randn(60, 70, generator=g)
    n = x.numel()
    # RandomK: unbiased n/k scaling on the chosen indices
    rk = RandomK(0.1, error_feedback=False, **POL)
    dec, sent, _ = ref_decode(rk.compress("w", x, 0))
    k = math.ceil(0.1 * n)
    assert int(sent.sum()) == k and rk.residual("w") is None
    assert torch.allclose(dec[sent], x.reshape(-1)[sent] * (n / k), rtol=1e-6)
    # Slim-DP as in the paper: the communication set travels exactly, the rest is dropped
    sd = SlimDP(0.3, 0.15, core_period=10, error_feedback=False, **POL)
    for t in range(1, 4):                        # step 0 is a dense push
        y = torch.randn(60, 70, generator=g)
        dec, sent, _ = ref_decode(sd.compress("w", y, t, param=x))
        assert sd.residual("w") is None
        assert torch.equal(dec[sent], y.reshape(-1)[sent])
        assert int(sent.sum()) == sum(SlimDP.sizes(n, 0.3, 0.15))
    # TopK without error feedback: plain top-k of the gradient each step
    tk = TopK(0.05, exact=True, error_feedback=False, **POL)
    for t in range(2):
        y = torch.randn(60, 70, generator=g)
        dec, sent, _ = ref_decode(tk.compress("w", y, t))
        assert set(sent.nonzero().reshape(-1).tolist()) == \
            set(topk_indices(y, math.ceil(0.05 * n)).tolist())


def test_topk_output_layer_ratio():
    """``output_ratio``: the last registered layer that is compressed (policy) gets
    ``max(ratio, output_ratio)``; biases / small layers after it are skipped, an override
    that sets its ratio wins, ``None`` turns the rule off, every other layer keeps
    ``ratio``. The selection itself is checked against torch.topk on fresh data."""
    g = gen("outlayer")
    n_hid, n_out = 40_000 + int(torch.randint(0, 999, (1,), generator=g)), 5120
    layers = [("fc1.weight", (n_hid // 40, 40)), ("fc1.bias", (n_hid // 40,)),
              ("fc2.weight", (10, n_out // 10)), ("fc2.bias", (10,))]
    comp = TopK(0.01, exact=True)
    comp.register_layers(layers)
    assert comp.output_layer == "fc2.weight"
    assert comp.capacity(n_out, 0, "fc2.weight") == math.ceil(0.1 * n_out)
    assert comp.capacity(n_hid // 40 * 40, 0, "fc1.weight") == math.ceil(0.01 * (n_hid // 40 * 40))
    for name, shape in (layers[0], layers[2]):
        x = torch.randn(shape, generator=g)
        p = comp.compress(name, x, 0)
        k = math.ceil((0.1 if name == "fc2.weight" else 0.01) * x.numel() - 1e-9)
        _, sent, _ = ref_decode(p)
        assert set(sent.nonzero().reshape(-1).tolist()) == \
            set(torch.topk(x.reshape(-1).abs(), k).indices.tolist()), name
    # a larger ratio is not lowered; an override of the head's ratio wins; None: off
    big = TopK(0.2)
    big.register_layers(layers)
    assert big.capacity(n_out, 0, "fc2.weight") == topk_capacity(n_out, math.ceil(0.2 * n_out))
    ov = TopK(0.01, overrides={"fc2.*": dict(ratio=0.02)})
    ov.register_layers(layers)
    assert ov.output_layer is None
    assert ov.capacity(n_out, 0, "fc2.weight") == topk_capacity(n_out, math.ceil(0.02 * n_out))
    # the head sent dense by an override: no layer gets the rule (not fc1, the one
    # before it); an override that sends the trailing biases dense changes nothing
    dh = TopK(0.01, overrides={"fc2.weight": dict(dense=True)})
    dh.register_layers(layers)
    assert dh.output_layer is None
    assert dh.capacity(n_hid // 40 * 40, 0, "fc1.weight") == \
        topk_capacity(n_hid // 40 * 40, math.ceil(0.01 * (n_hid // 40 * 40)))
    db = TopK(0.01, overrides={"*.bias": dict(dense=True)})
    db.register_layers(layers)
    assert db.output_layer == "fc2.weight"
    off = TopK(0.01, output_ratio=None)
    off.register_layers(layers)
    assert off.output_layer is None
    assert off.capacity(n_out, 0, "fc2.weight") == topk_capacity(n_out, math.ceil(0.01 * n_out))
    assert comp.config()["args"]["output_ratio"] == 0.1 and off.config()["args"]["output_ratio"] is None
    with pytest.raises(ValueError, match="output_ratio"):
        TopK(0.01, output_ratio=1.5)


def test_threshold_output_layer_sparsity():
    """Threshold's output rule: the last compressed layer runs at sparsity
    min(sparsity, 1 - output_ratio); its capacity and its first-step selection (the exact
    k-th largest |acc| as the first threshold) follow; None: off; an override of the
    head's sparsity wins."""
    g = gen("thr_out")
    layers = [("fc1.weight", (64, 80)), ("fc2.weight", (10, 512)), ("fc2.bias", (10,))]
    comp = Threshold(0.99)
    comp.register_layers(layers)
    assert comp.output_layer == "fc2.weight"
    assert comp.capacity(5120, 0, "fc2.weight") == math.ceil(2.0 * math.ceil(0.1 * 5120 - 1e-9))
    assert comp.capacity(5120, 0, "fc1.weight") == math.ceil(2.0 * math.ceil(0.01 * 5120 - 1e-9))
    x = torch.randn(10, 512, generator=g)
    _, sent, _ = ref_decode(comp.compress("fc2.weight", x, 0))
    k = math.ceil(0.1 * 5120 - 1e-9)
    assert set(sent.nonzero().reshape(-1).tolist()) == \
        set(torch.topk(x.reshape(-1).abs(), k).indices.tolist())
    off = Threshold(0.99, output_ratio=None)
    off.register_layers(layers)
    assert off.output_layer is None
    ov = Threshold(0.99, overrides={"fc2.*": dict(sparsity=0.95)})
    ov.register_layers(layers)
    assert ov.output_layer is None
    assert ov.capacity(5120, 0, "fc2.weight") == math.ceil(2.0 * math.ceil(0.05 * 5120 - 1e-9))


def test_warmup_density_while_warming_only():
    """``Compressor.warmup_density`` (read by momentum correction to suspend masking):
    the layer's warm-up density while it is above the layer's own target (overrides and
    the output-layer rule applied), ``None`` without a warm-up, after it, or at the
    target; the same value the compressor sizes its capacity with."""
    T = 6 + int(torch.randint(0, 5, (1,), generator=gen("wdens")))
    layers = [("fc1.weight", (300, 40)), ("fc2.weight", (10, 300))]
    for comp, target in (
            (TopK(0.01, exact=True, warmup=ExponentialWarmup(T, stages=3)),
             {"fc1.weight": 0.01, "fc2.weight": 0.1}),
            (Threshold(0.99, warmup=("exp", T, 3), overrides={"fc1.*": dict(sparsity=0.98)}),
             {"fc1.weight": 0.02, "fc2.weight": 0.1}),
            (RandomK(0.05, warmup=RtWarmup(T)), {"fc1.weight": 0.05, "fc2.weight": 0.05})):
        comp.register_layers(layers)
        for name, r in target.items():
            for step in range(T + 3):
                wd = comp.warmup_density(name, step)
                want = comp.warmup(step, r)
                if step >= T or want <= r:
                    assert wd is None, (type(comp).__name__, name, step, wd)
                else:
                    assert wd == pytest.approx(want, rel=1e-12) and wd > r
        assert comp.warmup_density("fc1.weight", 0) is not None
    plain = TopK(0.01)
    plain.register_layers(layers)
    assert all(plain.warmup_density("fc1.weight", s) is None for s in range(5))
    ada = AdaComp()
    ada.register_layers(layers)
    assert ada.warmup_density("fc1.weight", 0) is None
