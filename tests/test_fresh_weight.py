"""``fresh_weight``: TopK sends the exact k largest of the score ``|acc + w x|`` (their
``acc`` values), Threshold every score at or above its tau (the k-th largest score at a
refresh, reused and raised by the overflow guard in between); the rest stays in the
residual; the default follows the Adam recipe's update wire. Compared with an independent
reference (a stable sort of the score, ties to the lower index; the k-th largest score
and a plain comparison) on fresh random data."""
from __future__ import annotations

import pytest
import torch

import hvdsparse
from hvdsparse.adam_settings import AdamSettings
from hvdsparse.compressors import topk_bucket
from hvdsparse.compressors.encoding import check_values
from hvdsparse.compressors.topk import UPDATE_WIRE_FRESH_WEIGHT, UPDATE_WIRE_VALUES
from hvdsparse.door import make_local_update
from hvdsparse.payload import ValueEncoding

ENCODING = {"fp32": ValueEncoding.FP32, "fp16": ValueEncoding.FP16}


def _reference(acc: torch.Tensor, x: torch.Tensor, w: float, k: int):
    """Indices of the k largest ``|acc + w x|`` (ties to the lower index), as a set."""
    score = (acc + w * x).abs()
    # stable sort of -score: equal scores keep ascending index order
    order = torch.sort(-score, stable=True).indices[:k]
    return set(order.tolist())


@pytest.mark.parametrize("w", [1.0, 0.5, 3.0])
@pytest.mark.parametrize("values", ["fp32", "fp16"])
def test_selects_the_k_largest_scores(w, values):
    torch.manual_seed(int(w * 10) + (values == "fp16"))
    shape, ratio = (40, 75), 0.02
    n = shape[0] * shape[1]
    k = 60
    c = hvdsparse.TopK(ratio, fresh_weight=w, values=values, min_numel=16)
    resid = torch.zeros(n)
    for step in range(4):
        g = torch.randn(shape) * (1 + step)
        if step == 2:
            g.view(-1)[7] = float("nan")        # counted, adds nothing, never chosen
        x = torch.nan_to_num(g.reshape(-1), nan=0.0)
        acc = resid + x
        pay = c.compress("w", g, step)
        seg = pay.segments[0]
        assert seg.capacity == k and seg.value_encoding == ENCODING[values]
        cnt = int(seg.count[0])
        assert cnt == k
        idx = seg.indices[:cnt].long()
        assert set(idx.tolist()) == _reference(acc, x, w, k)
        want = acc[idx].to(seg.values.dtype)
        assert torch.equal(seg.values[:cnt], want)
        sent = torch.zeros(n)
        sent[idx] = want.float()
        resid = acc - sent
        assert torch.equal(c._residuals["w"], resid)
        if step == 2:
            assert int(pay.nonfinite[0]) == 1
        c.commit()


@pytest.mark.parametrize("w", [1.0, 2.5])
def test_threshold_selects_scores_at_or_above_tau(w):
    """Refresh every 3rd step (tau = the k-th largest score); in between the reused tau
    through the overflow ladder (the lowest rung ``fp32(tau * 2^(j/8))`` whose count fits
    the capacity 2k) and the guard's raised tau (from the count at tau)."""
    torch.manual_seed(int(10 * w))
    shape, n, k = (40, 75), 3000, 30
    cap = 2 * k
    rungs = torch.tensor([2.0 ** (j / 8) for j in range(32)], dtype=torch.float32)
    c = hvdsparse.Threshold(0.99, life_span=3, fresh_weight=w, min_numel=16)
    resid = torch.zeros(n)
    tau = None
    overflowed = 0
    for step in range(6):
        g = torch.randn(shape) * (1 + 0.3 * step)
        x = g.reshape(-1).clone()
        acc = resid + x
        score = (acc + w * x).abs()
        refresh = step % 3 == 0
        if refresh:
            tau = torch.sort(score, descending=True).values[k - 1]
            t = tau
        else:
            counts = torch.stack([(score >= tau * f).sum() for f in rungs])
            t = tau * rungs[min(int((counts > cap).sum()), 31)]
        pay = c.compress("w", g, step)
        seg = pay.segments[0]
        assert seg.capacity == cap
        want_idx = torch.nonzero(score >= t).reshape(-1)
        cnt = int(seg.count[0])
        assert 0 < cnt == min(want_idx.numel(), cap), (step, cnt, want_idx.numel())
        idx = seg.indices[:cnt].long()
        assert idx.tolist() == want_idx[:cnt].tolist()      # ascending slots on the CPU
        assert torch.equal(seg.values[:cnt], acc[idx])
        sent = torch.zeros(n)
        sent[idx] = acc[idx]
        resid = acc - sent
        assert torch.equal(c._residuals["w"], resid)
        c.commit()
        at_tau = int((score >= tau).sum())
        if at_tau > cap:         # the guard raises tau for the next steps
            overflowed += 1
            ratio = torch.tensor(at_tau, dtype=torch.float32) / float(cap)
            tau = tau * ratio.double().sqrt().float().clamp_max(2.0)
        assert torch.equal(c.current_threshold("w").reshape(()), tau.reshape(())), step
    assert overflowed > 0       # the case exercises the ladder and the guard


def test_zero_weight_is_the_plain_selection():
    torch.manual_seed(3)
    a = hvdsparse.TopK(0.01, min_numel=16)
    b = hvdsparse.TopK(0.01, fresh_weight=0.0, min_numel=16)
    for step in range(3):
        g = torch.randn(64, 200)
        pa, pb = a.compress("w", g, step), b.compress("w", g.clone(), step)
        sa, sb = pa.segments[0], pb.segments[0]
        assert sa.capacity == sb.capacity
        assert torch.equal(sa.count, sb.count)
        n = int(sa.count[0])
        assert torch.equal(sa.indices[:n], sb.indices[:n])
        assert torch.equal(sa.values[:n], sb.values[:n])
        assert torch.equal(a._residuals["w"], b._residuals["w"])
        a.commit()
        b.commit()


def test_checks():
    for bad in (-0.5, 17.0, True, "1", float("nan")):
        with pytest.raises(ValueError, match="fresh_weight"):
            hvdsparse.TopK(0.01, fresh_weight=bad)
    with pytest.raises(ValueError, match="fresh_weight.*per_bucket"):
        hvdsparse.TopK(0.01, fresh_weight=1.0, per_bucket=512)
    with pytest.raises(ValueError, match="head.weight.*fresh_weight"):
        hvdsparse.TopK(0.01, overrides={"head.weight": {"fresh_weight": -1}})


def test_default_follows_the_update_wire():
    model = torch.nn.Linear(64, 64)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    c = hvdsparse.TopK(0.01, overrides={"bias": {"fresh_weight": 0.25}}, compress_1d=True)
    assert c.layer_cfg("weight")["fresh_weight_in_force"] == 0.0
    W = UPDATE_WIRE_FRESH_WEIGHT
    assert W > 0
    for wire, want in (("update", W), ("gradient", 0.0), ("momentum", 0.0), ("update", W)):
        make_local_update(opt, params, 2, c, adam=AdamSettings(1, None, None, wire))
        assert c.adam_update_wire == (wire == "update")
        assert c.layer_cfg("weight")["fresh_weight_in_force"] == want
        assert c.layer_cfg("bias")["fresh_weight_in_force"] == 0.25   # set: kept
    make_local_update(opt, params, 2, c, adam=None)
    assert c.layer_cfg("weight")["fresh_weight_in_force"] == 0.0
    # Threshold (a TopK subclass with its own settings) follows it too
    t = hvdsparse.Threshold(0.99, overrides={"bias": {"fresh_weight": 0}}, compress_1d=True)
    for wire, want in (("update", W), ("gradient", 0.0)):
        make_local_update(opt, params, 2, t, adam=AdamSettings(1, None, None, wire))
        assert t.layer_cfg("weight")["fresh_weight_in_force"] == want
        assert t.layer_cfg("bias")["fresh_weight_in_force"] == 0.0
    with pytest.raises(ValueError, match="fresh_weight"):
        hvdsparse.Threshold(0.99, fresh_weight=-1)


def test_values_default_follows_the_update_wire():
    """TopK's and Threshold's ``values=None``: bf16 on the update wire (not with
    ``per_bucket``), fp32 elsewhere; a value set (argument or override) is kept. A
    checkpoint loads where the encoding it was saved with is the one in force."""
    model = torch.nn.Linear(64, 64)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    want = check_values(UPDATE_WIRE_VALUES)
    assert want != ValueEncoding.FP32
    c = hvdsparse.TopK(0.01, overrides={"bias": {"values": "fp16"}}, compress_1d=True)
    fixed = hvdsparse.TopK(0.01, values="fp32")
    pb = hvdsparse.TopK(0.01, per_bucket=512)
    t = hvdsparse.Threshold(0.99)
    # saved with fp32 values (as the default was before it followed the wire)
    saved_fp32 = hvdsparse.TopK(0.01, values="fp32").state_dict()
    for wire in ("update", "gradient", "update"):
        on = wire == "update"
        for comp in (c, fixed, pb, t):
            make_local_update(opt, params, 2, comp, adam=AdamSettings(1, None, None, wire))
        assert c.layer_cfg("weight")["values"] == (want if on else ValueEncoding.FP32)
        assert c.layer_cfg("bias")["values"] == ValueEncoding.FP16
        assert fixed.layer_cfg("weight")["values"] == ValueEncoding.FP32
        assert pb.layer_cfg("weight")["values"] == ValueEncoding.FP32
        assert t.layer_cfg("weight")["values"] == (want if on else ValueEncoding.FP32)
        fresh = hvdsparse.TopK(0.01)
        fresh.set_adam_update_wire(on)
        if on:
            with pytest.raises(ValueError, match="settings differ"):
                fresh.load_state_dict(saved_fp32)
            fixed.load_state_dict(saved_fp32)
        else:
            fresh.load_state_dict(saved_fp32)


def test_not_on_the_bucket_path():
    g = torch.randn(64, 200)
    if not topk_bucket.takes(g):
        pytest.skip("no compiled CPU loops here: the bucket path takes nothing on the CPU")
    for cls, d in ((hvdsparse.TopK, 0.01), (hvdsparse.Threshold, 0.99)):
        plain, fresh = cls(d), cls(d, fresh_weight=1.0)
        step = 1 if cls is hvdsparse.Threshold else 0      # past the refresh (CPU)
        if step:
            for c in (plain, fresh):
                c.compress("w", g, 0)
                c.commit()
        assert topk_bucket.layer_plan(plain, "w", g, step) is not None
        assert topk_bucket.layer_plan(fresh, "w", g, step) is None
