"""The host's own time per bucket on the CUDA code path, measured without a GPU.

On a GPU a step's device work is queued by the host, and the host is what bounds a step
of a model with many small tensors (ResNet-50: 161). Its time has two parts: issuing the
launches (Triton's launcher, the CUDA API) and everything else it does per layer and
bucket (plans, the row table, payloads, statistics, the codec's layout). This script
measures the second part, which a CUDA graph replay would not remove.

One bucket of ResNet-50 layer-3 shapes (``check_capture.SHAPES``, 14 tensors) goes
through ``check_capture.BucketRegion`` (the step engine's ``compress_group``,
``codec.encode``, ``codec.accumulate`` of two ranks' messages with ``validate=False``)
on CPU tensors with ``HVDSPARSE_FORCE_TRITON=1``: every dispatch takes the branch a CUDA
tensor takes. The first ``--warmup`` steps run the kernels (Triton's interpreter), to
reach steady state. Then Triton launches are replaced by a no-op, and ``--steps`` steps
are timed, ``--rounds`` times; the median round is reported. Aten ops still run on the
CPU. At these sizes each costs a few microseconds, as its CUDA launch would, except
TopK's ``torch.topk`` of its sample (a sort here, one kernel on a GPU), which the TopK
row includes.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_host.py --out docs/bench/device_ops/host.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["HVDSPARSE_FORCE_TRITON"] = "1"

import torch  # noqa: E402

import check_capture  # noqa: E402
from launchcount import LaunchCounter  # noqa: E402


def measure(name, make, warmup: int, steps: int, rounds: int) -> dict:
    import triton.runtime.interpreter as ti
    region = check_capture.BucketRegion(make)
    for s in range(warmup):
        region.step(s)
    counter = LaunchCounter()
    region.quiet.append(counter)          # the copies standing in for the collective
    with counter:
        region.step(warmup)
    orig = ti.InterpretedFunction.run
    ti.InterpretedFunction.run = lambda self, *a, **k: None
    try:
        s = warmup + 1
        per_round = []
        for _ in range(rounds):
            for k in region.phases:
                region.phases[k] = 0.0
            t0 = time.perf_counter()
            for _ in range(steps):
                region.step(s)
                s += 1
            total = (time.perf_counter() - t0) / steps
            per_round.append(dict(step=total, **{k: v / steps
                                                 for k, v in region.phases.items()}))
    finally:
        ti.InterpretedFunction.run = orig
    med = sorted(per_round, key=lambda r: r["step"])[len(per_round) // 2]
    return dict(method=name, layers=len(check_capture.SHAPES),
                ms={k: 1e3 * v for k, v in med.items()},
                rounds_ms=[1e3 * r["step"] for r in per_round],
                launches=dict(triton=sum(counter.triton.values()),
                              aten=sum(counter.aten.values())))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", default="topk,threshold,adacomp,qsgd,randomk,slimdp")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    print("| compressor | launches (Triton + aten) | host ms / bucket step | compress | "
          "encode | decode | us / layer | rounds, ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for m in args.methods.split(","):
        r = measure(m, check_capture.MAKERS[m], args.warmup, args.steps, args.rounds)
        rows.append(r)
        ms = r["ms"]
        print(f"| {m} | {r['launches']['triton']} + {r['launches']['aten']} | "
              f"{ms['step']:.3f} | {ms['compress']:.3f} | {ms['encode']:.3f} | "
              f"{ms['decode']:.3f} | {1e3 * ms['step'] / r['layers']:.0f} | "
              f"{', '.join(f'{x:.3f}' for x in r['rounds_ms'])} |", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(
            shapes=check_capture.SHAPES, warmup=args.warmup, steps=args.steps,
            rounds=args.rounds, torch=torch.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
