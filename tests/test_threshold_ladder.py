"""Threshold's overflow ladder (``hvdsparse/compressors/threshold.py``): between refreshes,
when more than ``capacity`` elements pass the reused ``tau``, the selection uses the
lowest rung ``t_r = tau * LADDER[r]`` whose count fits, so the LARGEST elements go out
and the rest wait in the residual (before: the lowest slots, whatever their size, which
made the digits CNN diverge). ``selected`` still reports the count at ``tau``, which the
overflow guard uses to raise ``tau`` for the next step.

Checked against a plain oracle (one counting pass per rung, written from the docstring)
on fresh random data with planted overflows, on the CPU per-layer path and the Triton
per-layer path (interpreter; ``HVDSPARSE_FORCE_TRITON``); the bucket paths (compiled
CPU loops and Triton) are compared with the per-layer path bit for bit in
tests/test_bucket_topk.py. Plus: no host synchronisation (dispatch-mode detector).
"""
import os

import pytest
import torch

from hvdsparse import Threshold
from hvdsparse.codec import payload_to_dense
from hvdsparse.compressors.threshold import LADDER, ladder_threshold
from tests.workers.topk_oracle import threshold_ladder


def fresh_seed():
    return int(os.environ.get("HVDSPARSE_TEST_SEED") or torch.randint(0, 2 ** 31, ()).item())


def oracle(a, tau, cap):
    """(t*, c_0) by the written rule (``tests/workers/topk_oracle.threshold_ladder``)."""
    return threshold_ladder(a, tau, cap, LADDER)


def test_ladder_factors_are_eighth_octaves():
    assert len(LADDER) == 32 and LADDER[0] == 1.0 and LADDER[8] == 2.0
    assert LADDER[16] == 4.0 and LADDER[24] == 8.0
    assert all(b > a for a, b in zip(LADDER, LADDER[1:]))


@pytest.mark.parametrize("case", ["random", "ties_on_rungs", "past_the_top", "fits"])
def test_ladder_threshold_matches_oracle(case):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(200, 5000, (1,), generator=g))
    a = torch.rand(n, generator=g) ** 3 * 10.0
    tau = torch.tensor(float(torch.rand((), generator=g)) * 0.5 + 0.01)
    if case == "ties_on_rungs":          # elements exactly on rung thresholds
        rungs = tau * torch.tensor(LADDER)
        a[: 2 * len(LADDER)] = rungs.repeat(2)
    cap = {"random": int(torch.randint(1, n, (1,), generator=g)),
           "ties_on_rungs": int((a >= tau).sum()) // 3 + 1,
           "past_the_top": 0 + 1,
           "fits": n}[case]
    if case == "past_the_top":           # even rung 15 lets more than cap through
        a[:50] = float(tau) * 1000.0
    got_t, got_c0 = ladder_threshold(a, tau, cap)
    want_t, want_c0 = oracle(a, tau, cap)
    where = f"seed {seed} case {case} n {n} cap {cap}"
    assert float(got_t) == want_t and int(got_c0) == want_c0, where
    assert got_c0.dtype == torch.int32 and got_c0.shape == (1,), where
    if case == "fits":
        assert float(got_t) == float(tau), where
    if case == "past_the_top":
        assert float(got_t) == float(tau * LADDER[-1]), where


def _planted(seed, n=6000):
    """A gradient whose stale tau lets far more than the capacity through: big elements
    at high indices (what the old slot-order cut starved), small ones at low indices."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.01
    x[: n // 3] += torch.sign(torch.randn(n // 3, generator=g)) * 0.08     # passes tau
    hi = torch.randperm(n - n // 3, generator=g)[:40] + n // 3
    x[hi] = torch.sign(torch.randn(40, generator=g)) * (3.0 + torch.rand(40, generator=g))
    return x.view(60, n // 60), hi


@pytest.mark.parametrize("triton", [False, True])
def test_overflowing_step_sends_the_largest(monkeypatch, triton):
    if triton:
        pytest.importorskip("triton")
        monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    seed = fresh_seed()
    comp = Threshold(0.99, life_span=1000, output_ratio=None, seed=1).bind(0, 1)
    comp.bucket_path = False                 # the per-layer path (bucket: test_bucket_topk)
    g0 = torch.randn(60, 100, generator=torch.Generator().manual_seed(seed + 1)) * 0.01
    comp.compress("w", g0, 0)                # step 0: the refresh sets tau from small grads
    comp.commit()
    tau = comp.current_threshold("w").clone()
    acc = comp.residual("w").clone().view(-1)
    grad, hi = _planted(seed)
    acc += grad.view(-1)
    cap = comp.capacity(6000, 1, "w")
    t_want, c0_want = oracle(acc.abs(), tau, cap)
    assert c0_want > 10 * cap                # a real overflow, which a middle rung fits
    assert float(tau) < t_want < float(tau) * LADDER[-1]
    pl = comp.compress("w", grad, 1)
    comp.commit()
    sent = payload_to_dense(pl).view(-1)
    res = comp.residual("w").view(-1)
    where = f"seed {seed} triton={triton}"
    # the oracle's set exactly: every element at or above t*, nothing else
    want = acc.abs() >= t_want
    assert int(want.sum()) <= cap, where
    assert torch.equal(sent != 0, want), where
    assert torch.equal(sent + res, acc), where          # nothing lost
    assert (sent[hi] != 0).all(), f"{where}: a planted large element was not sent"
    st = comp.stats()["w"]
    assert int(st["selected"]) == c0_want, where         # the count at tau
    # the guard raised tau from the count at tau
    ratio = torch.tensor(c0_want, dtype=torch.float32) / float(cap)
    up = ratio.double().sqrt().float().clamp_max(2.0)
    assert torch.equal(comp.current_threshold("w"), tau * up), where


def test_without_the_guard_an_overflow_is_cut_in_slot_order():
    """overflow_guard=False keeps the paper's rule with a fixed capacity: the selection
    at tau, cut to the capacity in slot order (ascending index on the CPU)."""
    seed = fresh_seed()
    comp = Threshold(0.99, output_ratio=None, overflow_guard=False, seed=1).bind(0, 1)
    comp.bucket_path = False
    g0 = torch.randn(60, 100, generator=torch.Generator().manual_seed(seed + 1)) * 0.01
    comp.compress("w", g0, 0)
    comp.commit()
    tau = comp.current_threshold("w").clone()
    grad, _ = _planted(seed)
    acc = comp.residual("w").view(-1) + grad.view(-1)
    pl = comp.compress("w", grad, 1)
    sent = payload_to_dense(pl).view(-1)
    cap = comp.capacity(6000, 1, "w")
    first = torch.nonzero(acc.abs() >= tau).view(-1)[:cap]
    assert torch.equal(torch.nonzero(sent).view(-1), first), seed
    assert torch.equal(comp.current_threshold("w"), tau), seed


def test_ladder_never_syncs(monkeypatch):
    pytest.importorskip("triton")
    from tests.workers.sync_worker import HostSyncDetector
    monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    seed = fresh_seed()
    comp = Threshold(0.99, output_ratio=None, seed=1).bind(0, 1)
    comp.bucket_path = False
    comp.compress("w", torch.randn(60, 100) * 0.01, 0)
    comp.commit()
    grad, _ = _planted(seed)
    det = HostSyncDetector()
    with det:
        det.phase = "compress"
        comp.compress("w", grad, 1)
        det.phase = None
    assert not det.records, [(r["phase"], r["reason"], r["site"]) for r in det.records]
