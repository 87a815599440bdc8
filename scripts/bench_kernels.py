#!/usr/bin/env python
"""Benchmark of kernel operations (1) residual_add_binmax + (2) select_compact.

CPU (always): on an n-element fp32 gradient and residual (default 25M), time

* ``torch.add(grad, residual)``           -- the memory floor,
* ``(1) + (2)`` through ``hvdsparse.ops`` (the CPU path, ``hvdsparse.cpu``) at ~1% density
  (a scalar threshold from a sample quantile; also per-bin thresholds, bin 500),
* ``torch.topk(acc.abs(), k)`` with ``k = density * n``,

all in the same run, median of ``--reps`` (>= 5). The residual is restored (untimed)
before every timed repetition so each one sees the same data and density.

CUDA (when a GPU is present): the Triton kernels through ``hvdsparse.ops`` timed with
``triton.testing.do_bench`` against a device-to-device copy of the gradient's bytes and
``torch.add``. do_bench repeats the function back to back, so the timed function
restores the residual with one device copy first; the table gives that total and the
net time (total minus the measured copy).

Prints a markdown table and writes JSON (``--out``, default results/bench_kernels.json).
Run: ``PYTHONPATH=. .venv/bin/python scripts/bench_kernels.py [--threads 1]``.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hvdsparse import ops  # noqa: E402


def median_ms(fn, reps, setup=None):
    ts = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, [t * 1e3 for t in ts]


def bench_cpu(n, density, bin_size, reps, topk_reps, seed):
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=gen)
    res0 = torch.randn(n, generator=gen) * 0.5
    acc = grad + res0
    k = max(1, int(density * n))
    sample = acc[:: max(1, n // 1_000_000)].abs()
    thr = torch.quantile(sample, 1.0 - density).reshape(())
    nbins = -(-n // bin_size)
    thr_bins = thr.expand(nbins).contiguous()
    capacity = int(k * 1.25)  # fixed capacity with slack, as a compressor would size it
    residual = torch.empty_like(res0)

    def restore():
        residual.copy_(res0)

    out = {}
    out["torch.add"] = median_ms(lambda: torch.add(grad, residual), reps, restore)
    buf = torch.empty_like(grad)  # same add without allocating (no page faults)
    out["torch.add(out=preallocated)"] = median_ms(lambda: torch.add(grad, residual, out=buf),
                                                   reps, restore)

    def step(thr_):
        def f():
            ops.residual_add_binmax(grad, residual, bin_size)
            idx, val, cnt = ops.select_compact(residual, thr_, capacity,
                                               bin_size=bin_size if thr_.dim() else 0)
            f.count = cnt
        return f

    f = step(thr)
    out["(1) residual_add_binmax"] = median_ms(
        lambda: ops.residual_add_binmax(grad, residual, bin_size), reps, restore)
    sel_setup = lambda: (restore(), residual.add_(grad))  # noqa: E731
    out["(2) select_compact, scalar thr"] = median_ms(
        lambda: ops.select_compact(residual, thr, capacity), reps, sel_setup)
    out["(1)+(2), scalar thr"] = median_ms(f, reps, restore)
    sent, selected = f.count.tolist()
    fb = step(thr_bins)
    out["(1)+(2), per-bin thr"] = median_ms(fb, reps, restore)
    out[f"torch.topk(abs(acc), k={k})"] = median_ms(lambda: torch.topk(acc.abs(), k),
                                                    topk_reps)
    return out, {"k": k, "capacity": capacity, "selected": selected, "sent": sent,
                 "density": selected / n, "threshold": float(thr)}


def bench_cuda(n, density, bin_size, seed):
    import triton.testing as tt
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    grad = torch.randn(n, generator=gen, device=dev)
    res0 = torch.randn(n, generator=gen, device=dev) * 0.5
    acc = grad + res0
    thr = torch.quantile(acc[:: max(1, n // 1_000_000)].abs(), 1.0 - density).reshape(())
    capacity = int(density * n * 1.25)
    residual = res0.clone()
    dst = torch.empty_like(grad)
    out = {}
    out["d2d copy (n fp32)"] = tt.do_bench(lambda: dst.copy_(grad))
    out["torch.add"] = tt.do_bench(lambda: torch.add(grad, residual, out=dst))

    def f12():
        residual.copy_(res0)
        ops.residual_add_binmax(grad, residual, bin_size)
        ops.select_compact(residual, thr, capacity)

    def f1():
        residual.copy_(res0)
        ops.residual_add_binmax(grad, residual, bin_size)

    out["restore + (1)"] = tt.do_bench(f1)
    out["restore + (1)+(2), scalar thr"] = tt.do_bench(f12)
    out["(1)+(2) net of restore"] = out["restore + (1)+(2), scalar thr"] - out["d2d copy (n fp32)"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=25_000_000)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--bin-size", type=int, default=500)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--topk-reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/bench_kernels.json")
    args = ap.parse_args()
    if args.reps < 5 or args.topk_reps < 5:
        ap.error("--reps and --topk-reps must be >= 5 (medians of at least 5)")
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu, info = bench_cpu(args.n, args.density, args.bin_size, args.reps, args.topk_reps,
                          args.seed)
    add = cpu["torch.add"][0]
    topk = [v for kk, v in cpu.items() if kk.startswith("torch.topk")][0][0]
    print(f"\nCPU, n={args.n}, density target {args.density} (selected {info['selected']}, "
          f"{100 * info['density']:.3f}%), capacity {info['capacity']}, bin {args.bin_size}, "
          f"torch threads {torch.get_num_threads()}, median of {args.reps} "
          f"(topk {args.topk_reps})\n")
    print("| operation | median ms | x torch.add | topk / this |")
    print("|---|---:|---:|---:|")
    for name, (med, _) in cpu.items():
        print(f"| {name} | {med:.1f} | {med / add:.2f} | {topk / med:.1f} |")
    both = cpu["(1)+(2), scalar thr"][0]
    ok_add, ok_topk = both <= 2 * add, topk >= 10 * both
    print(f"\ntarget (1)+(2) <= 2x torch.add: {'MET' if ok_add else 'NOT MET'} "
          f"({both / add:.2f}x); >= 10x faster than topk: {'MET' if ok_topk else 'NOT MET'} "
          f"({topk / both:.1f}x)")
    result = {"n": args.n, "density_target": args.density, "bin_size": args.bin_size,
              "threads": torch.get_num_threads(), "reps": args.reps, **info,
              "cpu_ms": {k: {"median": v[0], "all": v[1]} for k, v in cpu.items()},
              "target_2x_add_met": ok_add, "target_10x_topk_met": ok_topk,
              "torch": torch.__version__, "python": platform.python_version(),
              "machine": platform.processor() or platform.machine(),
              "cpu_count": os.cpu_count()}
    if torch.cuda.is_available():
        cu = bench_cuda(args.n, args.density, args.bin_size, args.seed)
        print(f"\nCUDA ({torch.cuda.get_device_name()}), triton.testing.do_bench\n")
        print("| operation | ms |")
        print("|---|---:|")
        for name, ms in cu.items():
            print(f"| {name} | {ms:.3f} |")
        result["cuda_ms"] = cu
        result["cuda_device"] = torch.cuda.get_device_name()
    d = os.path.dirname(args.out)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
