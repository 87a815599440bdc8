"""A rank's own payloads expanded into the flat bucket vector (``exchange.base.own_dense``,
what the ``dense``, ``balanced`` and ``split`` strategies send): on the device path
(``validate=False``, Triton forced through the interpreter) the bucket is encoded into
one message and decoded as the only rank's, a fixed number of launches per bucket; it
must give the per-payload expansion's bits (``codec.payload_to_dense``) for every
compressor and value encoding, write every element of a poisoned output, and leave the
device error flag at 0. Fresh random data each run."""
import os
import sys

import pytest
import torch

from hvdsparse import compressors as C
from hvdsparse.exchange.base import BucketSpec, BufferPool, ExchangeContext, own_dense

pytest.importorskip("triton")
DEV = torch.device(os.environ.get("HVDSPARSE_TEST_DEVICE", "cpu"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))
from launchcount import COPIES, NO_LAUNCH, LaunchCounter  # noqa: E402

# (name, numel): the small ones dense by policy (min_numel 1024)
LAYERS = [("a", 3000), ("b", 200), ("c", 4100), ("d", 1500), ("e", 70)]
MAKERS = {
    "topk": lambda s: C.TopK(0.05, seed=s),
    "topk_fp16": lambda s: C.TopK(0.05, values="fp16", seed=s),
    "topk_int4": lambda s: C.TopK(0.05, values="int4", seed=s),
    "threshold": lambda s: C.Threshold(0.97, seed=s),
    "adacomp": lambda s: C.AdaComp(seed=s),
    "adacomp_budget": lambda s: C.AdaComp(mean_per_bin=2, seed=s),
    "qsgd4": lambda s: C.QSGD(4, seed=s),
    "qsgd8_ef": lambda s: C.QSGD(8, error_feedback=True, seed=s),
    "randomk_shared": lambda s: C.RandomK(0.05, shared_seed=True, values="bf16", seed=s),
    "slimdp": lambda s: C.SlimDP(0.3, 0.1, core_period=5, seed=s),
    "slimdp_int8": lambda s: C.SlimDP(0.3, 0.1, core_period=5, values="int8", seed=s),
    "none": lambda s: C.NoCompression(),
}


def _payloads(make, seed):
    g = torch.Generator().manual_seed(seed)
    comp = make(seed % 1000)
    comp.register_layers([(n, (k,)) for n, k in LAYERS])
    out = None
    for step in range(3):              # past Slim-DP's step-0 dense push
        comp.begin_step(step)
        out = []
        for n, k in LAYERS:
            grad = (torch.randn(k, generator=g) * torch.exp(torch.randn(k, generator=g)))
            out.append(comp.compress(n, grad.to(DEV), step))
    return out


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_fused_own_dense_equals_per_payload_expansion(monkeypatch, kind):
    monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    seed = int(torch.randint(0, 2 ** 30, ()).item())
    pays = _payloads(MAKERS[kind], seed)
    spec = BucketSpec.build(0, [n for n, _ in LAYERS], [k for _, k in LAYERS])
    ref = own_dense(spec, pays, DEV)
    flag = torch.zeros(1, dtype=torch.int32, device=DEV)
    ctx = ExchangeContext(rank=0, world_size=2, prefix="t.own", validate=False,
                          error_flag=flag, buffers=BufferPool())
    out = torch.full((spec.numel,), float("nan"), device=DEV)
    cnt = LaunchCounter(skip=NO_LAUNCH | COPIES, patch=monkeypatch.setattr)
    with cnt:
        got = own_dense(spec, pays, DEV, out=out, ctx=ctx)
    assert got is out
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (kind, seed)
    assert int(flag[0]) == 0
    assert ref.abs().sum() > 0
    # a fixed number of launches for the bucket, not a few per segment
    nseg = sum(len(p.segments) for p in pays)
    assert cnt.total() <= 8 < 2 * nseg, (kind, cnt.total(), dict(cnt.aten), dict(cnt.triton))
