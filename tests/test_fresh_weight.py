"""TopK's ``fresh_weight``: the exact k largest of the score ``|acc + w x|`` are sent (their
``acc`` values), the rest stays in the residual; the default follows the Adam recipe's
update wire. Compared with an independent reference (a stable sort of the score, ties to
the lower index) on fresh random data."""
from __future__ import annotations

import pytest
import torch

import hvdsparse
from hvdsparse.adam_settings import AdamSettings
from hvdsparse.compressors import topk_bucket
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
    for wire, want in (("update", 1.0), ("gradient", 0.0), ("momentum", 0.0),
                       ("update", 1.0)):
        make_local_update(opt, params, 2, c, adam=AdamSettings(1, None, None, wire))
        assert c.adam_update_wire == (wire == "update")
        assert c.layer_cfg("weight")["fresh_weight_in_force"] == want
        assert c.layer_cfg("bias")["fresh_weight_in_force"] == 0.25   # set: kept
    make_local_update(opt, params, 2, c, adam=None)
    assert c.layer_cfg("weight")["fresh_weight_in_force"] == 0.0
    # Threshold (a TopK subclass with its own settings) has no such setting
    t = hvdsparse.Threshold(0.99)
    make_local_update(opt, params, 2, t, adam=AdamSettings(1, None, None, "update"))
    assert "fresh_weight_in_force" not in t.layer_cfg("weight")


def test_not_on_the_bucket_path():
    g = torch.randn(64, 200)
    plain = hvdsparse.TopK(0.01)
    fresh = hvdsparse.TopK(0.01, fresh_weight=1.0)
    if not topk_bucket.takes(g):
        pytest.skip("no compiled CPU loops here: the bucket path takes nothing on the CPU")
    assert topk_bucket.layer_plan(plain, "w", g, 0) is not None
    assert topk_bucket.layer_plan(fresh, "w", g, 0) is None
