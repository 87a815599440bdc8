"""The Triton (GPU) path and the CPU path train to the same bits (run by
tests/test_paths_agree.py under ``horovodrun -np 2``, ``TRITON_INTERPRET=1``).

``hvdsparse.ops`` reads ``HVDSPARSE_FORCE_TRITON`` at every call, so one process can
train the same model twice from the same weights on the same batches: once on the CPU
path (numpy kernels, validated decode) and once with every kernel forced through
Triton's interpreter (the code a GPU runs: residual add, TopK's refinement, select,
AdaComp's binned pack, clean gradient, momentum masking, quantisers, scatter decode,
``validate=False``). Triton's interpreter runs a launch's programs one after another, so
atomics reserve slots in ascending order, as the CPU path does; the two runs must then
agree bit for bit on every parameter after every step, and across ranks. A difference
is a kernel that does not compute what the CPU path computes.

Two cases train under AdamW (the Adam recipe's update wire): on the Triton path every
rank's own Adam step is made per bucket and TopK ranks by its score on the bucket path.

Layers are large enough for TopK's sampled estimate (65,536-element weights, so the
refinement kernel runs) and AdaComp's 500-element bins; SGD with momentum 0.9 and
weight decay, so momentum correction (the default) runs, and its masking (asked for:
``momentum_masking=True``, off by default, so both kernels are compared). TopK's forced
run goes through the bucket path (every layer of a bucket in one launch sequence,
``compressors/topk_bucket.py``; Threshold's too, after its step-0 refresh), so this also
checks that path against the CPU path; the CPU run of TopK / Threshold with fp32 values takes the bucket path too, through the compiled
CPU loops (``hvdsparse/native``), and a third run with ``HVDSPARSE_BUCKET_PATH=0``
(every layer on its own, numpy) must give the same bits.
Prints ``HVDSPARSE-OK rank=<r>``.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import horovod.torch as hvd
import hvdsparse
from hvdsparse import native

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
hvd.init()
R, P = hvd.rank(), hvd.size()
torch.set_num_threads(1)
STEPS = 4


def check(cond, msg):
    if not cond:
        raise AssertionError(f"rank {R}: {msg}")


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def train(make_comp, forced: bool, exchange: str, nan_at=None, bucket_path=True,
          adamw=False):
    if forced:
        os.environ["HVDSPARSE_FORCE_TRITON"] = "1"
    else:
        os.environ.pop("HVDSPARSE_FORCE_TRITON", None)
    os.environ["HVDSPARSE_BUCKET_PATH"] = "1" if bucket_path else "0"
    try:
        net = build()
        if adamw:       # the Adam recipe's update wire (one dense warm-up step)
            base, kw = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-2), {}
        else:
            base = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9,
                                   weight_decay=1e-3)
            kw = dict(momentum_masking=True)
        opt = hvdsparse.DistributedOptimizer(
            base, named_parameters=net.named_parameters(), compression=make_comp(),
            exchange=exchange, validate=not forced,
            nonfinite="raise" if nan_at is None else "skip", **kw)
        g = torch.Generator().manual_seed(100 + R)
        snaps = []
        for step in range(STEPS):
            x = torch.randn(32, 64, generator=g)
            y = torch.randint(0, 10, (32,), generator=g)
            opt.zero_grad()
            if step == nan_at and R == P - 1:    # one rank's gradient: the step is skipped
                x[0, 0] = float("nan")
            F.cross_entropy(net(x), y).backward()
            opt.step()
            snaps.append([p.detach().clone() for p in net.parameters()])
        return snaps, opt
    finally:
        os.environ.pop("HVDSPARSE_FORCE_TRITON", None)
        os.environ.pop("HVDSPARSE_BUCKET_PATH", None)


CASES = [
    ("TopK(0.01) + mc", lambda: hvdsparse.TopK(0.01), "allgather"),
    # a NaN on the last rank at step 2: nonfinite="skip" rolls residuals and velocities
    # back on every rank (the bucket path's state too)
    ("TopK(0.01) + mc, step 2 skipped", lambda: hvdsparse.TopK(0.01), "allgather", 2),
    ("TopK(0.01, values=fp16) + mc, split", lambda: hvdsparse.TopK(0.01, values="fp16"),
     "split"),
    ("Threshold(0.99) + mc", lambda: hvdsparse.Threshold(0.99), "allgather"),
    ("AdaComp() + mc", lambda: hvdsparse.AdaComp(), "allgather"),
    # layer budgets of 3 slots per bin on average (99 of 330, 396 of 1320 slots)
    ("AdaComp(mean_per_bin=3) + mc", lambda: hvdsparse.AdaComp(mean_per_bin=3), "allgather"),
    ("QSGD(4)", lambda: hvdsparse.QSGD(4), "allgather"),
    ("RandomK(0.01)", lambda: hvdsparse.RandomK(0.01), "allgather"),
    # dense pushes at steps 0 and 2, core + explorer at 1 and 3 (a re-selected core);
    # the dense exchange: each rank's own payloads expanded (the fused own_dense)
    ("SlimDP(0.3, 0.1, core_period=3), dense",
     lambda: hvdsparse.SlimDP(0.3, 0.1, core_period=3), "dense"),
    # AdamW: every rank's own Adam step made per bucket on the Triton path
    # (hvdsparse/adam_bucket.py), TopK's score rows (the radix select of |acc + x|),
    # Threshold's refresh (step 1) and reuse rows; per layer on the CPU
    ("TopK(0.01), AdamW", lambda: hvdsparse.TopK(0.01), "allgather", None, True),
    ("Threshold(0.99), AdamW", lambda: hvdsparse.Threshold(0.99), "allgather", None, True),
]

NATIVE = native.available()
check(NATIVE or os.environ.get("HVDSPARSE_NATIVE") == "0",
      f"the compiled CPU loops are unavailable: {native.why_unavailable()}")

for label, make, exchange, *more in CASES:
    nan = [n for n in more[:1] if n is not None]
    adamw = bool(more[1:2] and more[1])
    cpu, opt_c = train(make, False, exchange, *nan, adamw=adamw)
    tri, opt_t = train(make, True, exchange, *nan, adamw=adamw)
    runs = [("the CPU path", cpu, opt_c), ("the Triton path", tri, opt_t)]
    # TopK, and Threshold between its refreshes, take the bucket path
    topk = label.startswith(("TopK", "Threshold"))
    if topk:        # and the CPU path with every layer compressed on its own
        runs.append(("the CPU per-layer path", *train(make, False, exchange, *nan,
                                                      bucket_path=False, adamw=adamw)))
    check([o.scheduler.skipped_steps for _, _, o in runs] == [len(nan)] * len(runs),
          f"{label}: skipped steps {[o.scheduler.skipped_steps for _, _, o in runs]}")
    check(opt_c.scheduler.local_update is not None or
          label.startswith(("QSGD", "RandomK", "SlimDP")),
          f"{label}: momentum correction is not on")
    # TopK's / Threshold's device path compresses whole buckets (compressors/
    # topk_bucket.py); so does
    # the CPU path with the compiled loops (hvdsparse/native), for fp32 values only
    def bucketed(o):
        return [e for e in o.scheduler.events if e[0] == "bucket_path"]
    # on the Triton path every compressor here has bucket rows (TopK / Threshold,
    # AdaComp's bins, QSGD's buckets, the dense-by-policy biases)
    check(bool(bucketed(opt_t)), f"{label}: Triton bucket path {bucketed(opt_t)}")
    # (the Adam recipe's layers: per layer on the CPU)
    check(bool(bucketed(opt_c)) == (topk and NATIVE and "fp16" not in label and not adamw),
          f"{label}: CPU bucket path {bucketed(opt_c)}")
    if topk:
        check(not bucketed(runs[2][2]), f"{label}: HVDSPARSE_BUCKET_PATH=0 not honoured")
    for other, snaps, _ in runs[1:]:
        for step, (a, b) in enumerate(zip(cpu, snaps)):
            for i, (pa, pb) in enumerate(zip(a, b)):
                check(torch.equal(pa.view(torch.int32), pb.view(torch.int32)),
                      f"{label}: parameter {i} differs between the CPU path and {other} "
                      f"after step {step} (max |diff| {float((pa - pb).abs().max()):.3g})")
    # the same bits on every rank
    flat = torch.cat([p.reshape(-1) for p in tri[-1]])
    ref = hvd.broadcast(flat, root_rank=0, name=f"paths.{label}")
    check(torch.equal(ref, flat), f"{label}: replicas differ")
    moved = float((torch.cat([p.reshape(-1) for p in tri[-1]]) -
                   torch.cat([p.reshape(-1) for p in build().parameters()])).abs().max())
    check(moved > 0, f"{label}: the parameters did not move")
    if R == 0:
        print(f"paths agree: {label} ({exchange}), {STEPS} steps", flush=True)

print(f"HVDSPARSE-OK rank={R}", flush=True)
hvd.shutdown()
