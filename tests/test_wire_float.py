"""Narrow float values on the wire (``values="fp16"`` / ``"bf16"``) saturate instead of
overflowing: a finite accumulated gradient above fp16's 65504 (or bf16's largest finite
value) travels as +-that maximum, and the excess stays in the residual, so
``sent + residual == acc`` holds exactly and nothing non-finite reaches any rank.

Before the fix an fp16 cast sent ``inf`` for |acc| > 65504 (and left ``-inf`` in the
residual): every rank's parameter became inf with no report.

Checked on the CPU path and on the Triton kernels (interpreter; ``HVDSPARSE_FORCE_TRITON``)
for TopK (sampled and exact selection, and the GPU bucket path), Threshold and RandomK,
on fresh random data with planted huge elements, against a plain oracle of the rule.
"""
import pytest
import torch

from hvdsparse import TopK, Threshold, RandomK
from hvdsparse.codec import payload_to_dense
from hvdsparse.compressors import topk_bucket as TB
from hvdsparse.momentum import LocalUpdate
from hvdsparse.payload import FLOAT_DTYPES, FLOAT_MAX, ValueEncoding

SHAPE = (120, 100)
HUGE = {"fp16": (7.0e4, 3.0e6), "bf16": (3.39e38, 3.4e38)}
ENC = {"fp16": ValueEncoding.FP16, "bf16": ValueEncoding.BF16}


def _grad(values, gen, used=None):
    """Fresh N(0, 1) gradient with 6 planted huge elements. ``used`` (bool, flat) marks
    positions planted on earlier steps: planting there again could overflow the fp32
    accumulation itself (an unsent residual near bf16's maximum plus another), which is
    outside this test's premise of a finite accumulated gradient."""
    g = torch.randn(SHAPE, generator=gen)
    flat = g.view(-1)
    pos = torch.randperm(flat.numel(), generator=gen)
    if used is not None:
        pos = pos[~used[pos]]
        used[pos[:6]] = True
    pos = pos[:6]
    lo, hi = HUGE[values]
    mag = lo + (hi - lo) * torch.rand(6, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(6, generator=gen) < 0.5, -1.0, 1.0).double()
    flat[pos] = (mag * sign).float()
    assert torch.isfinite(flat).all()
    return g, pos


def _oracle(acc, values):
    """What the wire carries for an element of ``acc`` that is sent (fp32 result)."""
    m = FLOAT_MAX[ENC[values]]
    return acc.double().clamp(-m, m).float().to(FLOAT_DTYPES[ENC[values]]).float()


MAKERS = {
    "topk": lambda v: TopK(0.02, values=v, output_ratio=None, seed=3),
    "topk_exact": lambda v: TopK(0.02, values=v, exact=True, output_ratio=None, seed=3),
    "threshold": lambda v: Threshold(0.98, values=v, output_ratio=None, seed=3),
    "randomk": lambda v: RandomK(0.5, values=v, seed=3),
}


def _check(values, acc, sent, residual, where):
    assert torch.isfinite(sent).all(), f"{where}: non-finite value sent"
    assert torch.isfinite(residual).all(), f"{where}: non-finite residual"
    on = sent != 0
    want = _oracle(acc[on], values)
    assert torch.equal(sent[on], want), f"{where}: sent values differ from the saturating cast"
    # exact: saturation and rounding errors are both representable (Sterbenz)
    assert torch.equal(sent + residual, acc), f"{where}: sent + residual != acc"
    return on


@pytest.mark.parametrize("triton", [False, True], ids=["cpu", "triton"])
@pytest.mark.parametrize("values", ["fp16", "bf16"])
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_narrow_values_saturate_and_keep_the_excess(monkeypatch, triton, values, kind):
    if triton:
        monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    else:
        monkeypatch.delenv("HVDSPARSE_FORCE_TRITON", raising=False)
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    gen = torch.Generator().manual_seed(seed)
    comp = MAKERS[kind](values)
    comp.register_layers([("w", SHAPE)])
    comp.bind(0, 2)
    acc = torch.zeros(SHAPE).view(-1)
    used = torch.zeros(acc.numel(), dtype=torch.bool)
    for step in range(3):
        g, planted = _grad(values, gen, used)
        assert torch.isfinite(acc + g.view(-1)).all()
        acc = acc + g.view(-1)
        p = comp.compress("w", g.clone(), step)
        sent = payload_to_dense(p).view(-1)
        res = comp.residual("w").view(-1)
        where = f"{kind} {values} seed {seed} step {step}"
        on = _check(values, acc, sent, res, where)
        # the planted elements are the largest: a top-k always chooses them; Threshold
        # (a reused tau, capacity cut in ascending order) surely only at step 0
        if kind.startswith("topk") or (kind == "threshold" and step == 0):
            assert on[planted].all(), f"{where}: a planted element was not sent"
            m = FLOAT_MAX[ENC[values]]
            assert (sent[planted].abs() == m).any(), f"{where}: nothing saturated"
        acc = res.clone()


@pytest.mark.parametrize("values", ["fp16", "bf16"])
def test_gpu_bucket_path_saturates_too(monkeypatch, values):
    monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.zeros(SHAPE))
    opt = torch.optim.SGD([w], lr=0.1)
    comp = TopK(0.02, values=values, output_ratio=None, seed=3)
    comp.register_layers([("w", SHAPE)])
    comp.bind(0, 2)
    lu = LocalUpdate(opt, {"w": w}, 1, momentum_correction=False, clip_grad_norm=None)
    g, planted = _grad(values, gen)
    comp.begin_step(0)
    lu.begin_step()
    nf = torch.zeros(1, dtype=torch.int32)
    ok, spec = lu.bucket_spec("w", g, False)
    item = TB.BucketItem("w", g.clone(), w.detach(), nf, spec if ok else None)
    plan = TB.layer_plan(comp, "w", g, 0, w.detach(), spec if ok else None)
    assert plan is not None
    payloads, _ = TB.compress_bucket(comp, [item], [plan], 0)
    sent = payload_to_dense(payloads["w"]).view(-1)
    res = comp.residual("w").view(-1)
    on = _check(values, g.view(-1), sent, res, f"bucket {values} seed {seed}")
    assert on[planted].all()


def test_split_value_shift_fits_fp16_and_round_trips():
    """The split / balanced phase-2 shift (``exchange.split.wire_exponent``): e = 0 while
    the largest magnitude fits fp16 (and for non-fp16 pairs or a non-finite maximum);
    otherwise the smallest e with max * 2^-e < 2^15. Shifted values round-trip within
    fp16's rounding and stay finite; fresh random magnitudes around and far above
    65504. (Under horovodrun: tests/test_allgather_hvd.py.)"""
    from hvdsparse.exchange.split import (FP16_MAX, from_wire_values, to_wire_values,
                                          wire_exponent)
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    gen = torch.Generator().manual_seed(seed)
    for top in (1.0, 6.0e4, 65504.0, 65505.0, 7.0e4, 1.3e5, 3.0e9, 1.0e38):
        v = torch.randn(257, generator=gen) * (top / 4)
        v[int(torch.randint(0, 257, (1,), generator=gen))] = -top
        m = float(v.abs().max())
        e = int(wire_exponent(v, torch.float16))
        where = f"seed {seed}, max {m}"
        if m <= FP16_MAX:
            assert e == 0, where
        else:
            assert m * 2.0 ** -e < 2.0 ** 15 <= m * 2.0 ** -(e - 1), (where, e)
        wire = to_wire_values(v, torch.float16, torch.tensor([e], dtype=torch.int32))
        assert wire.dtype == torch.float16 and torch.isfinite(wire).all(), where
        back = from_wire_values(wire, torch.tensor([e], dtype=torch.int32))
        assert torch.isfinite(back).all(), where
        # fp16 rounding of the shifted value, shifted back exactly (values the shift moves
        # below fp16's normal range keep fewer bits: an absolute bound there)
        tol = v.abs() * 2.0 ** -11 + 2.0 ** e * 2.0 ** -24
        assert ((back - v).abs() <= tol).all(), where
        # not fp16: no shift, the plain cast
        for dt in (torch.float32, torch.bfloat16):
            assert int(wire_exponent(v, dt)) == 0
            assert torch.equal(to_wire_values(v, dt, torch.zeros(1, dtype=torch.int32)),
                               v.to(dt))
    for bad in (float("inf"), float("nan")):
        v = torch.tensor([1.0, bad, 7.0e4])
        assert int(wire_exponent(v, torch.float16)) == 0      # travels as before
    assert int(wire_exponent(torch.empty(0), torch.float16)) == 0
