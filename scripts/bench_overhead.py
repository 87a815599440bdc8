"""Compression overhead at world size 1: what each compressor adds
to a training step when there is no network at all.

Every method trains the same model (``scripts/train.py``'s ``wide`` MLP 64-W-W-10,
``--width``, default 2048: 4.35 M parameters) from the same initial weights on the same
digits batches. ``none`` is the wrapped optimizer alone (``torch.optim.SGD``, what
``hvd.DistributedOptimizer`` reduces to at size 1); every other method is
``hvdsparse.DistributedOptimizer(..., exchange="allgather")`` at world size 1 with the
benchmark-only setting ``HVDSPARSE_COMPRESS_AT_SIZE_ONE=1`` (``hvdsparse.settings``):
the scheduler then runs its whole path -- compress in the backward hooks, encode,
Horovod's size-1 allgather, decode, average, write ``p.grad`` -- instead of skipping
it as Horovod does at size 1. No library internals are patched.

Per method and step (medians over ``--rounds x --steps`` steps after ``--warmup``):

* ``step``: forward + backward (with the compress hooks) + ``synchronize`` + update;
* ``fwd+bwd``, ``sync`` (wait, decode, write ``p.grad``), ``update`` (the SGD step);
* ``compress`` / ``exchange`` / ``decode``: the scheduler's own timers
  (``last_stats``: ``time_compress_s``, ``time_wait_s``, ``time_decode_s``);
* ``aten ops``: ops dispatched in one step (a ``TorchDispatchMode`` counter, as in
  tests/test_host_sync.py; numpy work of the CPU path is not an aten op), total and
  in backward / synchronize; on CUDA also kernel launches per step
  (``torch.profiler``, counted from CUDA kernel events).

Side by side: ``--tree LABEL=PATH`` (repeatable) runs the same measurement with the
hvdsparse package of another checkout (e.g. ``git worktree add /tmp/wt_base REV``),
alternating trees round by round in fresh subprocesses, so before / after share the
machine's load. Timing runs belong under ``flock -x /work/cpu.lock``.

    flock -x /work/cpu.lock .venv/bin/python scripts/bench_overhead.py \\
        --tree after=. --tree before=/tmp/wt_base --out docs/bench/overhead/wide2048
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

METHODS = {
    # label: (description, constructor source evaluated with hvdsparse.compressors.*)
    "none": ("no compression (plain SGD)", None),
    "topk1": ("TopK 1%", "TopK(0.01)"),
    "threshold99": ("Threshold 99%", "Threshold(0.99)"),
    "adacomp": ("AdaComp (defaults)", "AdaComp()"),
    "qsgd4": ("QSGD 4-bit", "QSGD(4)"),
    "slimdp": ("Slim-DP (alpha 0.2, beta 0.1)", "SlimDP(alpha=0.2, beta=0.1)"),
    "randomk1": ("RandomK 1%", "RandomK(0.01)"),
    # DGC momentum correction + masking (hvdsparse.momentum) on top of the compressor
    "topk1+mc": ("TopK 1% + momentum correction", "TopK(0.01)"),
    "threshold99+mc": ("Threshold 99% + momentum correction", "Threshold(0.99)"),
    "adacomp+mc": ("AdaComp + momentum correction", "AdaComp()"),
}
TARGETS = {"topk1": 0.20, "threshold99": 0.20, "adacomp": 0.50, "qsgd4": 0.50,
           "topk1+mc": 0.20, "threshold99+mc": 0.20, "adacomp+mc": 0.50}


# ----------------------------------------------------------------------------- worker

def _worker(args):
    """One tree, one round: every method ``--steps`` timed steps; prints JSON."""
    sys.path.insert(0, str(Path(args.tree_path).resolve()))
    os.environ["HVDSPARSE_COMPRESS_AT_SIZE_ONE"] = "1"
    import torch
    torch.set_num_threads(args.threads)
    import horovod.torch as hvd
    import hvdsparse
    import hvdsparse.compressors as C
    from torch.utils._python_dispatch import TorchDispatchMode
    assert Path(hvdsparse.__file__).resolve().is_relative_to(Path(args.tree_path).resolve()), \
        hvdsparse.__file__
    hvd.init()
    if hvd.size() != 1:
        raise SystemExit("bench_overhead.py measures world size 1; run it without horovodrun")
    sys.path.insert(0, str(ROOT / "scripts"))
    from train import build_model, load_data

    dev = torch.device(args.device)
    xtr, ytr, _, _ = load_data(0)
    xtr, ytr = xtr.float().to(dev), ytr.to(dev)
    g = torch.Generator().manual_seed(1)
    nsteps = args.warmup + args.steps
    batches = [torch.randint(0, xtr.shape[0], (args.batch,), generator=g)
               for _ in range(nsteps + 4)]

    class OpCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.phase, self.ops = None, Counter()
            self.names = Counter()

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            if self.phase is not None:
                self.ops[self.phase] += 1
                self.names[str(func.overloadpacket)] += 1
            return func(*a, **(kw or {}))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    out = {}
    for label in args.methods:
        torch.manual_seed(0)
        model = build_model(args.width).to(dev)
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        src = METHODS[label][1]
        if src is None:
            opt = base
        else:
            comp = eval(src, {k: getattr(C, k) for k in C.__all__})
            opt = hvdsparse.DistributedOptimizer(
                base, named_parameters=model.named_parameters(), compression=comp,
                exchange="allgather", momentum_correction=label.endswith("+mc"))
            assert opt.scheduler.active, "compress_at_size_one not honoured"
        lossf = torch.nn.CrossEntropyLoss()
        rows = []
        counter = None

        def one_step(i, counter=None):
            idx = batches[i]
            sync()
            t0 = time.perf_counter()
            if counter is not None:
                counter.phase = "fwd+bwd"
            opt.zero_grad(set_to_none=False)
            lossf(model(xtr[idx]), ytr[idx]).backward()
            sync()
            t1 = time.perf_counter()
            if counter is not None:
                counter.phase = "sync"
            if src is not None:
                opt.synchronize()
            sync()
            t2 = time.perf_counter()
            if counter is not None:
                counter.phase = "update"
            if src is not None:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            sync()
            t3 = time.perf_counter()
            if counter is not None:
                counter.phase = None
            st = opt.scheduler.last_stats if src is not None else {}
            return dict(step=t3 - t0, fwd_bwd=t1 - t0, sync=t2 - t1, update=t3 - t2,
                        compress=st.get("time_compress_s", 0.0),
                        exchange=st.get("time_wait_s", 0.0),
                        decode=st.get("time_decode_s", 0.0))

        for i in range(nsteps):
            r = one_step(i)
            if i >= args.warmup:
                rows.append(r)
        # op counts: one more step under the dispatch counter (steady state, untimed)
        counter = OpCounter()
        with counter:
            one_step(nsteps, counter)
        launches = None
        if dev.type == "cuda":
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                one_step(nsteps + 1)
            launches = sum(1 for e in prof.events()
                           if e.device_type.name == "CUDA")
        out[label] = dict(rows=rows, ops=dict(counter.ops),
                          top_ops=counter.names.most_common(12), launches=launches)
    print("RESULT " + json.dumps(out))


# ----------------------------------------------------------------------------- driver

def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _run_round(args, label, path):
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree-path", path,
           "--width", str(args.width), "--batch", str(args.batch), "--steps",
           str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--device", args.device, "--methods", ",".join(args.methods)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(ROOT))
    if p.returncode != 0:
        raise SystemExit(f"worker for tree {label} ({path}) failed:\n{p.stderr[-4000:]}")
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2048, help="hidden width of the MLP")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (fresh processes)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (all methods)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--tree", action="append", default=None, metavar="LABEL=PATH",
                    help="checkout whose hvdsparse to measure (repeatable; default .)")
    ap.add_argument("--out", default=None, help="prefix for .json and .md")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree-path", default=".", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    if "none" not in args.methods:
        args.methods.insert(0, "none")
    if args.worker:
        return _worker(args)

    trees = []
    for t in args.tree or ["current=."]:
        label, _, path = t.partition("=")
        if not path or not (Path(path) / "hvdsparse" / "__init__.py").exists():
            raise SystemExit(f"--tree {t!r}: expected LABEL=PATH of a checkout with hvdsparse/")
        trees.append((label, str(Path(path).resolve())))
    t_start = time.time()
    load0 = os.getloadavg()
    merged = {label: {m: dict(rows=[], ops=None, top_ops=None, launches=None)
                      for m in args.methods} for label, _ in trees}
    for r in range(args.rounds):
        order = trees if r % 2 == 0 else list(reversed(trees))
        for label, path in order:
            res = _run_round(args, label, path)
            for m, d in res.items():
                merged[label][m]["rows"] += d["rows"]
                merged[label][m]["ops"] = d["ops"]
                merged[label][m]["top_ops"] = d["top_ops"]
                merged[label][m]["launches"] = d["launches"]
            print(f"round {r + 1}/{args.rounds} tree {label}: done "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    load1 = os.getloadavg()

    summary = {}
    for label, _ in trees:
        base = _median([x["step"] for x in merged[label]["none"]["rows"]])
        base_ops = sum((merged[label]["none"]["ops"] or {}).values())
        summary[label] = {}
        for m in args.methods:
            rows = merged[label][m]["rows"]
            med = {k: _median([x[k] for x in rows]) * 1e3 for k in
                   ("step", "fwd_bwd", "sync", "update", "compress", "exchange", "decode")}
            ops = merged[label][m]["ops"] or {}
            summary[label][m] = dict(
                **{f"{k}_ms": v for k, v in med.items()},
                overhead=med["step"] / (base * 1e3) - 1.0, n_steps=len(rows),
                aten_ops=sum(ops.values()), aten_ops_extra=sum(ops.values()) - base_ops,
                aten_ops_by_phase=ops, top_ops=merged[label][m]["top_ops"],
                kernel_launches=merged[label][m]["launches"])

    lines = [f"# Compression overhead at P = 1 (width {args.width}, batch {args.batch}, "
             f"{args.threads} thread(s), {args.device})", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t_start))}, "
             f"{args.rounds} rounds x {args.steps} steps per method and tree (after "
             f"{args.warmup} warm-up steps per round), load average "
             f"{load0[0]:.1f} -> {load1[0]:.1f}", ""]
    hdr = ("| tree | method | step ms | overhead | target | fwd+bwd ms | sync ms | "
           "update ms | compress ms | exchange ms | decode ms | aten ops/step | "
           "extra ops | launches |")
    lines += [hdr, "|" + "---|" * 2 + "---:|" * 12]
    for m in args.methods:
        for label, _ in trees:
            s = summary[label][m]
            tgt = TARGETS.get(m)
            lines.append(
                f"| {label} | {METHODS[m][0]} | {s['step_ms']:.1f} | "
                f"{100 * s['overhead']:+.0f}% | "
                f"{'' if tgt is None else f'<= {100 * tgt:.0f}%'} | {s['fwd_bwd_ms']:.1f} | "
                f"{s['sync_ms']:.1f} | {s['update_ms']:.1f} | {s['compress_ms']:.1f} | "
                f"{s['exchange_ms']:.1f} | {s['decode_ms']:.1f} | {s['aten_ops']} | "
                f"{s['aten_ops_extra']} | "
                f"{'-' if s['kernel_launches'] is None else s['kernel_launches']} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(command=" ".join([Path(sys.executable).name] + sys.argv), width=args.width,
                    batch=args.batch, steps=args.steps, warmup=args.warmup,
                    rounds=args.rounds, threads=args.threads, device=args.device,
                    trees=dict(trees), load_start=load0, load_end=load1,
                    started_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
                    cores=os.cpu_count())
        out.with_suffix(".json").write_text(json.dumps(
            dict(meta=meta, summary=summary,
                 raw={lab: {m: merged[lab][m]["rows"] for m in args.methods}
                      for lab, _ in trees}), indent=1))
        out.with_suffix(".md").write_text(table + "\n")
        print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
