"""Threshold's ``tau_follows_rate``: on the Adam recipe's update wire the input is
``x = lr u``, so a reused tau kept at rate ``lr_0`` is used at ``lr`` as ``max(fp32(tau *
fp32(lr / lr_0)), TINY)``; a refresh keeps its tau at its step's rate, the overflow guard
keeps the next tau at the rate it was used at.

Checked against a plain torch oracle of that rule (a capacity that nothing overflows, so
the guard never raises and the used tau is the next kept one) on fresh random gradients and a
random falling / rising rate, through the per-layer path (CPU and the Triton kernels in
the interpreter) and the bucket path (the Triton kernels' ROUTE_GIVEN rows with the factor
in ``C_TGT``, and the compiled CPU loops where they build). And: a constant rate gives
the bits of ``tau_follows_rate=False``; the front door hands the recipe's rate over.
"""
import pytest
import torch

from hvdsparse.codec import payload_to_dense
from hvdsparse.compressors import Threshold
from hvdsparse.compressors import topk_bucket as TB
from hvdsparse.compressors.base import TINY

SHAPE = (50, 60)
STEPS = 7
LIFE = 4          # refreshes at steps 0 and 4


def _oracle(grads, rates, k):
    """(sent, residual, tau used) per step by the rule in the module docstring."""
    r = torch.zeros(grads[0].numel())
    tau = kept = None
    out = []
    for t, (g, lr) in enumerate(zip(grads, rates)):
        acc = r + g.view(-1)
        if t % LIFE == 0:
            tau = max(float(acc.abs().topk(k).values.min()), TINY)
            tau = torch.tensor(tau, dtype=torch.float32)
            used = tau
        else:
            f = torch.tensor(lr / kept, dtype=torch.float32)
            used = torch.clamp_min(tau * f, TINY)
            tau = used
        kept = lr
        on = acc.abs() >= used
        sent = torch.where(on, acc, torch.zeros(()))
        r = acc - sent
        out.append((sent, r.clone(), used))
    return out


def _run(path, grads, rates, follow=True):
    # k = 5% of the layer, capacity 40%: the rates below pass at most ~27% (300 seeds)
    comp = Threshold(0.95, life_span=LIFE, slack=8.0, output_ratio=None, seed=5,
                     tau_follows_rate=follow)
    comp.register_layers([("w", SHAPE)])
    comp.bind(0, 2)
    now = [0]
    comp.layer_rate = lambda name: rates[now[0]]
    out, routes = [], []
    for step, g in enumerate(grads):
        now[0] = step
        comp.begin_step(step)
        plan = None
        if path.startswith("bucket"):
            plan = TB.layer_plan(comp, "w", g, step, None, None)
        if plan is None:
            p = comp.compress("w", g.clone(), step)
            routes.append("layer")
        else:
            nf = torch.zeros(1, dtype=torch.int32)
            item = TB.BucketItem("w", g.clone(), None, nf, None)
            p = TB.compress_bucket(comp, [item], [plan], step)[0]["w"]
            routes.append(plan["exact"])
        comp.commit()
        sent = payload_to_dense(p).view(-1)
        # the kept tau: with nothing over the capacity the guard keeps the used one
        out.append((sent, comp.residual("w").view(-1).clone(),
                    comp.current_threshold("w")))
    return out, routes


def _draw(seed, falling=True):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(SHAPE, generator=gen) * torch.exp(torch.randn(SHAPE, generator=gen))
             for _ in range(STEPS)]
    f = torch.rand(STEPS, generator=gen, dtype=torch.float64)
    f = 0.75 + 0.2 * f if falling else 0.8 + 0.45 * f     # per-step factor
    rates = (3e-3 * torch.cumprod(f, 0)).tolist()
    return grads, rates


@pytest.mark.parametrize("falling", [True, False], ids=["falling", "moving"])
@pytest.mark.parametrize("path", ["cpu", "triton", "bucket-triton", "bucket-native"])
def test_reused_tau_follows_the_rate(monkeypatch, path, falling):
    if path in ("triton", "bucket-triton"):
        monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    else:
        monkeypatch.delenv("HVDSPARSE_FORCE_TRITON", raising=False)
    if path == "bucket-native":
        from hvdsparse import native
        if not native.available():
            pytest.skip(f"compiled CPU loops unavailable: {native.why_unavailable()}")
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    grads, rates = _draw(seed, falling)
    n = SHAPE[0] * SHAPE[1]
    want = _oracle(grads, rates, -(-n // 20))
    # the oracle's premise: nothing passes more than the capacity
    assert max(int((w[0] != 0).sum()) for w in want) <= 8 * (n // 20), seed
    got, routes = _run(path, grads, rates)
    if path.startswith("bucket"):       # the reuse steps took the given route
        assert [routes[s] for s in (1, 2, 3, 5, 6)] == [2] * 5, routes   # ROUTE_GIVEN
    for step, ((ws, wr, wt), (gs, gr, gt)) in enumerate(zip(want, got)):
        where = f"{path} seed {seed} step {step}"
        assert float(gt) == float(wt), (where, float(gt), float(wt))
        assert torch.equal(gs, ws), f"{where}: sent differs"
        assert torch.equal(gr, wr), f"{where}: residual differs"
    # the rate moved the threshold: the oracle's used tau is not the kept refresh value
    assert float(want[3][2]) != float(want[1][2]) and float(want[6][2]) != float(want[5][2])


@pytest.mark.parametrize("path", ["cpu", "bucket-triton"])
def test_a_constant_rate_gives_the_bits_of_a_kept_tau(monkeypatch, path):
    """The factor is exactly 1 at a constant rate: the same bits as ``tau_follows_rate=
    False``, overflows (slack 2, a growing gradient: the ladder and the guard) included."""
    if path == "bucket-triton":
        monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    grads, _ = _draw(seed)
    grads = [g * (1 + 2 * s) for s, g in enumerate(grads)]
    rates = [2e-3] * STEPS
    runs = []
    for follow in (True, False):
        comp = Threshold(0.95, life_span=LIFE, output_ratio=None, seed=5,
                         tau_follows_rate=follow)
        comp.register_layers([("w", SHAPE)])
        comp.bind(0, 2)
        comp.layer_rate = lambda name: rates[0]
        hist = []
        for step, g in enumerate(grads):
            comp.begin_step(step)
            plan = TB.layer_plan(comp, "w", g, step, None, None) if path != "cpu" else None
            if plan is None:
                p = comp.compress("w", g.clone(), step)
            else:
                item = TB.BucketItem("w", g.clone(), None, torch.zeros(1, dtype=torch.int32),
                                     None)
                p = TB.compress_bucket(comp, [item], [plan], step)[0]["w"]
            comp.commit()
            hist.append((payload_to_dense(p), comp.residual("w").clone(),
                         float(comp.current_threshold("w"))))
        runs.append(hist)
    for step, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2], \
            f"{path} seed {seed} step {step}"
    raised = any(runs[1][s][2] != runs[1][s - 1][2] for s in (1, 2, 3, 5, 6))
    assert raised, f"seed {seed}: no step exercised the overflow guard"


def test_the_update_wire_hands_the_recipe_rate_to_the_compressor():
    from hvdsparse.adam_settings import adam_setup
    from hvdsparse.door import make_local_update
    w = torch.nn.Parameter(torch.randn(40, 30))
    opt = torch.optim.AdamW([w], lr=2e-3)
    comp = Threshold(0.99)
    comp.register_layers([("w", w.shape)])
    adam = adam_setup(opt, comp, None, None, param_names=["w"])
    assert adam is not None and adam.wire == "update"
    make_local_update(opt, {"w": w}, 2, comp, adam=adam)
    assert comp.layer_rate("w") == 2e-3
    opt.param_groups[0]["lr"] = 5e-4
    assert comp.layer_rate("w") == 5e-4
    opt.param_groups[0]["lr"] = torch.tensor(1e-3)     # a tensor rate is not read
    assert comp.layer_rate("w") is None
