"""The bucket path of TopK (``hvdsparse/compressors/topk_bucket.py``,
``kernels/bucket_topk.py``: a bucket's layers in a fixed number of launches) gives the
per-layer device path's bits: payload (sent / selected counts, the (index, value) pairs
of the sent slots), threshold, residual, DGC velocity after masking, non-finite count.

Run through Triton's interpreter (conftest) with ``HVDSPARSE_FORCE_TRITON=1`` on fresh
random data each run: layers on both threshold routes (sampled with refinement, and the
exact route of small layers), momentum correction with plain / Nesterov momentum,
dampening and weight decay in different param groups, a layer without momentum, AMP's
inverse loss scale, fp16 gradients with fp16 values, and non-finite gradient elements.
The per-layer path itself is tested against the plain oracles in test_kernels.py /
test_compressors.py; tests/test_paths_agree.py trains through the bucket path at P = 2.
``HVDSPARSE_TEST_DEVICE=cuda`` (scripts/gpu_check.sh) runs the same comparison with the
kernels compiled for the GPU (slot order then depends on scheduling: pairs are compared
sorted by index).
"""
import os

import pytest
import torch

from hvdsparse import ops
from hvdsparse.compressors import TopK
from hvdsparse.compressors import topk_bucket as TB
from hvdsparse.momentum import LocalUpdate

# (name, shape, group): 3e5 and 7e4 elements take the sampled route at 1%, 2e4 and 5e3
# the exact one
LAYERS = [("a", (600, 500), 0), ("b", (200, 100), 0), ("c", (350, 200), 1),
          ("d", (50, 100), 2), ("e", (40, 50), 3)]
DEV = torch.device(os.environ.get("HVDSPARSE_TEST_DEVICE", "cpu"))
GROUPS = [dict(momentum=0.9, weight_decay=1e-3), dict(momentum=0.9, nesterov=True),
          dict(momentum=0.5, dampening=0.25), dict(momentum=0.0)]


def _setup(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(DEV, dtype))
              for n, s, _ in LAYERS}
    groups = [dict(GROUPS[k], params=[params[n] for n, _, gk in LAYERS if gk == k])
              for k in range(len(GROUPS))]
    opt = torch.optim.SGD(groups, lr=0.1)
    return params, opt


def _grads(dtype, step, seed):
    g = torch.Generator().manual_seed(1000 * seed + step)
    out = {}
    for n, s, _ in LAYERS:
        x = torch.randn(s, generator=g) * torch.exp(torch.randn(s, generator=g))
        out[n] = x.to(DEV, dtype)
    flat = out["c"].view(-1)            # non-finite elements in one layer
    flat[5] = float("nan")
    flat[77] = float("inf")
    return out


def _payload_pairs(p):
    seg = p.segments[0]
    c = int(seg.count[0])
    idx = seg.indices[:c].long()
    order = torch.argsort(idx)
    return c, idx[order], seg.values[:c][order]


def _run(path, dtype, values, scale, mc, seed, steps=2):
    params, opt = _setup(dtype, seed)
    comp = TopK(0.01, values=values, output_ratio=None, seed=7)
    comp.register_layers([(n, params[n].shape) for n, _, _ in LAYERS])
    lu = LocalUpdate(opt, params, 1, momentum_correction=mc, clip_grad_norm=None)
    gs = None if scale is None else torch.tensor([scale], dtype=torch.float32, device=DEV)
    hist = []
    for step in range(steps):
        grads = _grads(dtype, step, seed)
        comp.begin_step(step)
        lu.begin_step()
        nfs = {n: torch.zeros(1, dtype=torch.int32, device=DEV) for n in grads}
        if path == "layer":
            payloads = {}
            for n, _, _ in LAYERS:
                kw = {}
                if lu.wants(n):
                    x, _ = lu.corrected(n, grads[n], params[n], False, gs, nonfinite=nfs[n])
                else:
                    x, kw = grads[n], dict(grad_scale=gs)
                payloads[n] = comp.compress(n, x, step, param=params[n].detach(),
                                            nonfinite=nfs[n], **kw)
            for n, _, _ in LAYERS:
                lu.mask(n, payloads[n])
        else:
            items, plans = [], []
            for n, _, _ in LAYERS:
                ok, spec = lu.bucket_spec(n, grads[n], False)
                assert ok
                item = TB.BucketItem(n, grads[n], params[n].detach(), nfs[n], spec)
                pl = TB.layer_plan(comp, n, grads[n], step, params[n].detach(), spec)
                assert pl is not None, n
                items.append(item)
                plans.append(pl)
            assert {pl["exact"] for pl in plans} == {0, 1}     # both routes covered
            payloads, batch = TB.compress_bucket(comp, items, plans, step, grad_scale=gs)
            TB.mask_bucket(batch)
        hist.append(_snapshot(comp, lu, payloads, nfs,
                              caps={n: payloads[n].segments[0].capacity for n in payloads}))
    return hist


def _snapshot(comp, lu, payloads, nfs, **extra):
    """One step's results: sent pairs, statistics, residuals, velocities, non-finite
    counts (and ``extra``)."""
    st = comp.stats()
    return dict(
        pairs={n: _payload_pairs(payloads[n]) for n in payloads},
        stats={n: (st[n]["selected"], st[n]["threshold"], st[n]["nonfinite"],
                   st[n]["total_sent"], st[n]["steps"]) for n in payloads},
        res={n: comp.residual(n).clone() for n in payloads},
        u={n: lu.u[n].clone() for n in lu.u},
        nf={n: int(nfs[n]) for n in nfs}, **extra)


@pytest.mark.parametrize("dtype,values,scale,mc", [
    (torch.float32, "fp32", None, True),
    (torch.float32, "fp32", 0.5, False),
    (torch.float16, "fp16", 0.25, True),
])
def test_bucket_path_matches_per_layer_path(monkeypatch, dtype, values, scale, mc):
    if DEV.type == "cpu":
        monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    ref = _run("layer", dtype, values, scale, mc, seed)
    got = _run("bucket", dtype, values, scale, mc, seed)
    for step, (a, b) in enumerate(zip(ref, got)):
        for n in a["pairs"]:
            ca, ia, va = a["pairs"][n]
            cb, ib, vb = b["pairs"][n]
            where = f"seed {seed} step {step} layer {n}"
            assert ca == cb and ca > 0, where
            assert ca <= a["caps"][n] == b["caps"][n], where
            assert torch.equal(ia, ib), where
            assert torch.equal(va.view(torch.int8 if va.element_size() == 1 else
                                       {2: torch.int16, 4: torch.int32}[va.element_size()]),
                               vb.view({2: torch.int16, 4: torch.int32}[vb.element_size()])), where
            assert torch.equal(a["res"][n].view(torch.int32), b["res"][n].view(torch.int32)), where
        assert a["nf"] == b["nf"] and a["nf"]["c"] == 2, (seed, step)
        assert a["stats"] == b["stats"], (seed, step)
        assert a["u"].keys() == b["u"].keys() and (len(a["u"]) == 4) == mc
        for n in a["u"]:
            assert torch.equal(a["u"][n].view(torch.int32), b["u"][n].view(torch.int32)), \
                (seed, step, n)


# ------------------------------------------------------------------ the CPU twin
# hvdsparse/native/bucket_topk.c: the same table, the per-layer numpy path's bits and
# slot order (ascending). Only fp32 gradients and values take it.

def _native_or_skip():
    from hvdsparse import native
    if not native.available():
        pytest.skip(f"compiled CPU loops unavailable: {native.why_unavailable()}")
    return native


@pytest.mark.skipif(DEV.type != "cpu", reason="the CPU twin")
@pytest.mark.parametrize("scale,mc", [(None, True), (0.5, False), (0.25, True)])
def test_native_bucket_path_matches_cpu_per_layer_path(monkeypatch, scale, mc):
    _native_or_skip()
    monkeypatch.delenv("HVDSPARSE_FORCE_TRITON", raising=False)
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    ref = _run("layer", torch.float32, "fp32", scale, mc, seed, steps=3)
    got = _run("bucket", torch.float32, "fp32", scale, mc, seed, steps=3)
    _assert_fp32_steps_equal(ref, got, seed)
    for a, b in zip(ref, got):
        assert a["u"].keys() == b["u"].keys() and (len(a["u"]) == 4) == mc


def _assert_fp32_steps_equal(ref, got, seed, keys=("res",)):
    """Per step and layer (fp32 values): the same sent pairs, the same bits of every
    per-layer tensor in ``keys`` and of the velocities, non-finite counts and stats."""
    for step, (a, b) in enumerate(zip(ref, got)):
        for n in a["pairs"]:
            ca, ia, va = a["pairs"][n]
            cb, ib, vb = b["pairs"][n]
            where = f"seed {seed} step {step} layer {n}"
            assert ca == cb and ca > 0, where
            assert torch.equal(ia, ib), where
            assert torch.equal(va.view(torch.int32), vb.view(torch.int32)), where
            for k in keys:
                assert torch.equal(a[k][n].view(torch.int32), b[k][n].view(torch.int32)), \
                    (where, k)
        assert a["nf"] == b["nf"] and a["nf"]["c"] == 2, (seed, step)
        assert a["stats"] == b["stats"], (seed, step)
        for n in a["u"]:
            assert torch.equal(a["u"][n].view(torch.int32), b["u"][n].view(torch.int32)), \
                (seed, step, n)


def _adversarial_grads(comp, step, seed):
    """Layers whose sampled threshold estimate is off, so the refinement rounds move it:
    'tie' (5% of the elements share the largest magnitude: every round counts more than
    the capacity, the selection is capped), 'hidden' (the large elements sit exactly on
    the sampled positions, so the estimate counts far fewer than k), 'twice' (the sample
    sees the large elements at twice their density: the first round counts ~k/2, the
    second lands in range), 'plain'."""
    from hvdsparse.compressors.base import PURPOSE_SAMPLE
    from hvdsparse.compressors.topk import sample_layout
    g = torch.Generator().manual_seed(seed * 7 + step)
    out = {}
    n = 300_000
    x = torch.randn(n, generator=g) * 0.01
    x[torch.randperm(n, generator=g)[: n // 20]] = 1.0
    out["tie"] = x
    k, cap = comp._k_and_capacity(n, 0.01, comp.layer_cfg("hidden"))
    s, stride, off, _, _ = sample_layout(n, k, cap, comp._seed("hidden", step, PURPOSE_SAMPLE))
    x = torch.randn(n, generator=g) * 0.01
    x[off:off + stride * s:stride] = 1.0 + torch.rand(s, generator=g)
    out["hidden"] = x
    x = torch.randn(n, generator=g) * 0.01
    s, stride, off, _, _ = sample_layout(n, k, cap, comp._seed("twice", step, PURPOSE_SAMPLE))
    on = torch.arange(off, off + stride * s, stride)
    off_sample = torch.ones(n, dtype=torch.bool)
    off_sample[on] = False
    big = 0.5 * (k + cap)                  # TopK's target count
    n_on = int(2 * big * s / n)            # twice the density the sample should see
    x[on[torch.randperm(s, generator=g)[:n_on]]] = 1.0 + torch.rand(n_on, generator=g)
    rest = torch.nonzero(off_sample).view(-1)
    n_off = int(big) - n_on
    x[rest[torch.randperm(rest.numel(), generator=g)[:n_off]]] = 1.0 + torch.rand(n_off, generator=g)
    out["twice"] = x
    out["plain"] = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    return {k: v.view(600, 500) for k, v in out.items()}


@pytest.mark.skipif(DEV.type != "cpu", reason="the CPU twin")
def test_native_bucket_path_refinement_and_capacity(monkeypatch):
    _native_or_skip()
    monkeypatch.delenv("HVDSPARSE_FORCE_TRITON", raising=False)
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    names = ["tie", "hidden", "twice", "plain"]
    res = {}
    for path in ("layer", "bucket"):
        comp = TopK(0.01, output_ratio=None, seed=11, rounds=3)
        comp.register_layers([(n, (600, 500)) for n in names])
        hist = []
        for step in range(2):
            grads = _adversarial_grads(comp, step, seed)
            comp.begin_step(step)
            nfs = {n: torch.zeros(1, dtype=torch.int32) for n in names}
            if path == "layer":
                pays = {n: comp.compress(n, grads[n], step, nonfinite=nfs[n]) for n in names}
            else:
                items = [TB.BucketItem(n, grads[n], grads[n], nfs[n], None) for n in names]
                plans = [TB.layer_plan(comp, n, grads[n], step) for n in names]
                assert all(pl is not None and pl["exact"] == 0 for pl in plans)
                pays, _ = TB.compress_bucket(comp, items, plans, step)
            st = comp.stats()
            hist.append({n: (pays[n].segments[0].count.clone(),
                             pays[n].segments[0].indices[:int(pays[n].segments[0].count[0])].clone(),
                             pays[n].segments[0].values[:int(pays[n].segments[0].count[0])].clone(),
                             comp.residual(n).clone(), st[n]["selected"], st[n]["threshold"])
                         for n in names})
        res[path] = hist
    for step in range(2):
        for n in names:
            a, b = res["layer"][step][n], res["bucket"][step][n]
            where = f"seed {seed} step {step} layer {n}"
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), where
            assert torch.equal(a[2].view(torch.int32), b[2].view(torch.int32)), where
            assert torch.equal(a[3].view(torch.int32), b[3].view(torch.int32)), where
            assert a[4] == b[4] and a[5] == b[5], where
    tie = res["layer"][0]["tie"]
    assert tie[4] > int(tie[0][0]), "the tie layer must overflow its capacity"


# ------------------------------------------------------------------ Threshold (DCT-DP)
# Between refreshes a Threshold layer rides the bucket path on ROUTE_GIVEN: its reused
# tau is read from the layer's tensor, and the clamp launch (the C select on the CPU)
# writes the overflow guard's next tau into a new tensor. Refresh steps stay per layer.

def _run_threshold(path, mc, seed, steps=5, life_span=3, rate=False):
    from hvdsparse.compressors import Threshold
    params, opt = _setup(torch.float32, seed)
    comp = Threshold(0.99, life_span=life_span, output_ratio=None, seed=7,
                     tau_follows_rate=rate)
    now = [0]
    if rate:    # a falling rate: every reused tau used at lr / lr_kept (C_TGT)
        comp.layer_rate = lambda name: 1e-3 * 0.7 ** now[0]
    comp.register_layers([(n, params[n].shape) for n, _, _ in LAYERS])
    lu = LocalUpdate(opt, params, 1, momentum_correction=mc, clip_grad_norm=None)
    hist, routes = [], []
    for step in range(steps):
        now[0] = step
        grads = {n: g * (1 + step) for n, g in _grads(torch.float32, step, seed).items()}
        comp.begin_step(step)
        lu.begin_step()
        nfs = {n: torch.zeros(1, dtype=torch.int32, device=DEV) for n in grads}
        payloads, items, plans = {}, [], []
        for n, _, _ in LAYERS:
            pl = None
            if path == "bucket":
                ok, spec = lu.bucket_spec(n, grads[n], False)
                assert ok
                pl = TB.layer_plan(comp, n, grads[n], step, params[n].detach(), spec)
            if pl is None:                 # refresh step (or the per-layer reference)
                kw = {}
                if lu.wants(n):
                    x, _ = lu.corrected(n, grads[n], params[n], False, None, nonfinite=nfs[n])
                else:
                    x = grads[n]
                payloads[n] = comp.compress(n, x, step, param=params[n].detach(),
                                            nonfinite=nfs[n], **kw)
            else:
                items.append(TB.BucketItem(n, grads[n], params[n].detach(), nfs[n], spec))
                plans.append(pl)
        routes.append(sorted({pl["exact"] for pl in plans}))
        if items:
            pays, batch = TB.compress_bucket(comp, items, plans, step)
            payloads.update(pays)
        for n, _, _ in LAYERS:
            if n not in {it.name for it in items}:
                lu.mask(n, payloads[n])
        if items:
            TB.mask_bucket(batch)
        comp.commit()
        hist.append(_snapshot(comp, lu, payloads, nfs,
                              tau={n: comp.current_threshold(n).clone() for n in payloads},
                              caps={n: payloads[n].segments[0].capacity for n in payloads}))
    return hist, routes


# native-hitsK: the compiled loops keep the hits at tau of an overflow up to K x a row's
# capacity (native.LADDER_HITS) and find the ladder's rung among them; larger overflows
# read the layer again. The overflows here are 1-4x the capacity: K = 8 (the default)
# takes every one from the hits, K = 2 some from the hits and some from the layer, K = 1
# none from the hits. "-rate": tau_follows_rate under a falling rate.
@pytest.mark.parametrize("backend", ["triton", "native", "native-hits2", "native-hits1",
                                     "triton-rate", "native-rate"])
def test_threshold_bucket_path_matches_per_layer_path(monkeypatch, backend):
    rate = backend.endswith("-rate")
    backend = backend.replace("-rate", "")
    if backend == "triton":
        if DEV.type == "cpu":
            monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    else:
        if DEV.type != "cpu":
            pytest.skip("the CPU twin")
        _native_or_skip()
        monkeypatch.delenv("HVDSPARSE_FORCE_TRITON", raising=False)
        if backend != "native":
            from hvdsparse import native
            monkeypatch.setattr(native, "LADDER_HITS", int(backend[-1]))
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    ref, _ = _run_threshold("layer", True, seed, rate=rate)
    got, routes = _run_threshold("bucket", True, seed, rate=rate)
    # refreshes (steps 0 and 3): the radix select's fresh route on the Triton path, per
    # layer on the CPU twin; the others on the given route
    fresh = [3] if backend == "triton" else []
    assert routes == [fresh, [2], [2], fresh, [2]], routes
    _assert_fp32_steps_equal(ref, got, seed, keys=("res", "tau"))
    raised = sum(not torch.equal(ref[step]["tau"][n], ref[step - 1]["tau"][n])
                 for step in (1, 4) for n in ref[step]["tau"])   # the guard moved tau
    assert raised > 0, "no step exercised the overflow guard"
    # the overflow ladder chose a rung above tau somewhere: fewer sent than passed tau
    # (stats' selected = the count at tau) although the capacity had room
    laddered = sum(got[step]["pairs"][n][0] < min(int(got[step]["stats"][n][0]),
                                                  got[step]["caps"][n])
                   for step in (1, 2, 4) for n in got[step]["pairs"])
    assert laddered > 0, "no step exercised the overflow ladder"
    if backend == "native-hits2":      # both ways to the rung were taken
        ratios = [int(got[step]["stats"][n][0]) / got[step]["caps"][n]
                  for step in (1, 2, 4) for n in got[step]["pairs"]]
        assert any(1 < r <= 2 for r in ratios) and any(r > 2 for r in ratios), ratios


def test_a_subclass_with_its_own_compress_is_never_bypassed(monkeypatch):
    """The bucket path calls no compress(): a subclass that overrides compress() (to log,
    to add work) must stay on the per-layer path on every device."""
    if DEV.type == "cpu":
        monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")

    class Logged(TopK):
        def compress(self, name, grad, step, **kw):
            return super().compress(name, grad, step, **kw)
    g = torch.randn(600, 500, device=DEV)
    for comp, want in ((TopK(0.01, output_ratio=None), True),
                       (Logged(0.01, output_ratio=None), False)):
        comp.register_layers([("w", (600, 500))])
        assert (TB.layer_plan(comp, "w", g, 0) is not None) == want, type(comp).__name__
