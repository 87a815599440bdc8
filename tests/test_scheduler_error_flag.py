"""The unvalidated (CUDA-style) decode path: a bad index in a received message is
skipped by the Triton scatter kernel, flagged on the device, and raised by the
scheduler at the next step's exchange -- never silently ignored.

Runs the real Triton kernel through the interpreter (TRITON_INTERPRET=1 from conftest,
HVDSPARSE_FORCE_TRITON=1 here); no Horovod launch is needed for this plumbing.
"""
import random

import pytest
import torch

from hvdsparse import codec
from hvdsparse.payload import IndexEncoding, LayerPayload, Segment, ValueEncoding
from hvdsparse.scheduler import LayerScheduler
from hvdsparse.compressors import NoCompression


def _payload(numel, idx, vals):
    cap = len(idx)
    seg = Segment(numel=numel, capacity=cap, index_encoding=IndexEncoding.INT32,
                  value_encoding=ValueEncoding.FP32,
                  count=torch.tensor([cap], dtype=torch.int32),
                  values=torch.tensor(vals, dtype=torch.float32),
                  indices=torch.tensor(idx, dtype=torch.int32))
    return LayerPayload(name="w", shape=torch.Size([numel]), segments=[seg])


@pytest.mark.parametrize("bad", [False, True])
def test_bad_index_is_flagged_and_raised_next_step(monkeypatch, bad):
    pytest.importorskip("triton")
    monkeypatch.setenv("HVDSPARSE_FORCE_TRITON", "1")
    seed = random.SystemRandom().randrange(1 << 30)
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    numel = 37
    w = torch.nn.Parameter(torch.zeros(numel))
    sched = LayerScheduler([("w", w)], NoCompression(), rank=0, world_size=2,
                           prefix="t", validate=False)
    ctx = sched.engine.context(torch.device("cpu"), sched.step, None)
    assert ctx.error_flag is not None and not ctx.validate

    idx = torch.randperm(numel, generator=g)[:5].tolist()
    vals = torch.randn(5, generator=g).tolist()
    good = _payload(numel, idx, vals)
    bad_idx = list(idx)
    bad_idx[2] = numel if bad else bad_idx[2]
    other = _payload(numel, bad_idx, vals)
    rows = torch.stack([codec.encode([good]), codec.encode([other])])
    out = torch.full((numel,), 0.0)
    codec.accumulate(rows, [good], [out], validate=False, error_flag=ctx.error_flag)

    expect = torch.zeros(numel)
    for j, (i, v) in enumerate(zip(idx, vals)):
        expect[i] += v
        if not (bad and j == 2):
            expect[bad_idx[j]] += v
    torch.testing.assert_close(out, expect)   # the bad entry was skipped, nothing else

    # end of step 0: the flag is handed to a DeferredRead (pinned copy + event on
    # CUDA) and read at the next step's synchronize() without stalling the stream
    sched.engine.send_reads(sched.step)
    sched.step += 1
    if bad:
        with pytest.raises(RuntimeError, match="step 0 carried an index outside its layer"):
            sched.engine.check_deferred()
    else:
        sched.engine.check_deferred()
        assert sched.engine.context(torch.device("cpu"), sched.step, None).error_flag \
            is not None
