"""Device work per training step on the Triton (GPU) path, counted without a GPU (issue
13, item 2: launches per step should follow buckets, not layers x ops).

Runs hvdsparse's whole step -- compress in the backward hooks, encode, Horovod's size-1
allgather, decode, write ``p.grad``, the optimizer step -- at world size 1
(``HVDSPARSE_COMPRESS_AT_SIZE_ONE=1``) with ``HVDSPARSE_FORCE_TRITON=1`` and Triton's
interpreter, on an MLP of ``--layers`` square ``--width`` Linear layers (weights
compressed, biases dense by policy), and counts in one steady-state step:

* ``triton``: Triton kernel launches (each is one GPU launch);
* ``aten``: aten ops dispatched outside the kernels that would launch a GPU kernel:
  everything except views, metadata and allocations (``empty``), and except the ops
  Triton's interpreter itself issues while emulating a kernel;
* split by phase: ``backward`` (model backward + compress hooks), ``synchronize``
  (wait, decode, write ``p.grad``, masking), ``step``.

Each aten op is counted as one launch: on CUDA most are exactly one kernel, a few
(``topk``, ``cat``) one to three. The numbers are an upper-bound proxy for
``cudaLaunchKernel`` calls, measured here because no GPU is lent to these sessions;
``scripts/gpu_check.sh`` counts real launches with ``torch.profiler`` where a GPU is.

Side by side: ``--tree LABEL=PATH`` (repeatable) counts with the hvdsparse package of
another checkout (``git worktree add /tmp/wt_base REV``) in a fresh subprocess.

    .venv/bin/python scripts/count_device_ops.py --tree after=. \\
        --tree before=/tmp/wt_base --out docs/bench/device_ops/mlp8
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

METHODS = {
    "none": "plain SGD (no hvdsparse)",
    "topk1": "TopK(0.01)",
    "topk1+mc": "TopK(0.01)",
    "threshold99+mc": "Threshold(0.99)",
    "adacomp+mc": "AdaComp()",
    "qsgd4": "QSGD(4)",
}
#: aten ops that launch nothing on a GPU (views, metadata, allocation)
NO_LAUNCH = {"view", "detach", "slice", "t", "expand", "as_strided", "_unsafe_view",
             "alias", "unsqueeze", "squeeze", "reshape", "select", "permute", "transpose",
             "split", "chunk", "unbind", "empty", "new_empty", "empty_strided",
             "lift_fresh", "_reshape_alias", "narrow", "set_", "resolve_conj",
             "resolve_neg", "view_as", "_record_function_enter_new",
             "_record_function_exit", "is_nonzero", "_local_scalar_dense"}


def _worker(args):
    sys.path.insert(0, str(Path(args.tree_path).resolve()))
    os.environ.update(HVDSPARSE_COMPRESS_AT_SIZE_ONE="1", HVDSPARSE_FORCE_TRITON="1",
                      TRITON_INTERPRET="1")
    import torch
    torch.set_num_threads(1)
    import horovod.torch as hvd
    import triton.runtime.interpreter as ti
    from torch.utils._python_dispatch import TorchDispatchMode

    import hvdsparse
    import hvdsparse.compressors as C
    assert Path(hvdsparse.__file__).resolve().is_relative_to(Path(args.tree_path).resolve())
    hvd.init()

    class Count(TorchDispatchMode):
        inside = 0

        def __init__(self):
            super().__init__()
            self.phase = None
            self.aten = Counter()
            self.names = Counter()
            self.sites = Counter()

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            name = func.overloadpacket.__name__
            if self.phase and not Count.inside and name not in NO_LAUNCH:
                self.aten[self.phase] += 1
                self.names[name] += 1
                if args.where:                  # innermost hvdsparse frame issuing it
                    site = "torch / model"
                    for fr in reversed(traceback.extract_stack()[:-1]):
                        if "/hvdsparse/" in fr.filename:
                            site = (f"{Path(fr.filename).name}:{fr.lineno} "
                                    f"{fr.name}")
                            break
                    self.sites[f"{name} @ {site}"] += 1
            return func(*a, **(kw or {}))

    launches = Counter()
    current = [None]
    orig = ti.InterpretedFunction.run

    def run(self, *a, **k):
        if current[0] is not None:
            launches[current[0]] += 1
        Count.inside += 1
        try:
            return orig(self, *a, **k)
        finally:
            Count.inside -= 1
    ti.InterpretedFunction.run = run

    out = {}
    for label in args.methods:
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers)
        base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if label == "none":
            opt = base
        else:
            comp = eval(METHODS[label], {k: getattr(C, k) for k in C.__all__})
            opt = hvdsparse.DistributedOptimizer(
                base, named_parameters=model.named_parameters(), compression=comp,
                exchange="allgather", momentum_correction=label.endswith("+mc"))
        g = torch.Generator().manual_seed(1)

        def step(cnt=None):
            x = torch.randn(16, args.width, generator=g)
            opt.zero_grad(set_to_none=False)
            if cnt is not None:
                cnt.phase = current[0] = "backward"
            model(x).square().mean().backward()
            if cnt is not None:
                cnt.phase = current[0] = "synchronize"
            if label != "none":
                opt.synchronize()
            if cnt is not None:
                cnt.phase = current[0] = "step"
            if label != "none":
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            if cnt is not None:
                cnt.phase = current[0] = None

        for _ in range(3):
            step()
        launches.clear()
        cnt = Count()
        with cnt:
            step(cnt)
        out[label] = dict(aten=dict(cnt.aten), triton=dict(launches),
                          top_aten=cnt.names.most_common(15))
        if args.where:
            out[label]["sites"] = cnt.sites.most_common()
    print("RESULT " + json.dumps(out))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", default=[],
                    help="LABEL=PATH of a checkout (default: this one, as 'here')")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--out", default=None, help="path stem for .json / .md")
    ap.add_argument("--where", action="store_true",
                    help="also list where (hvdsparse file:line) every counted op is issued")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree-path", default=str(ROOT), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.methods = args.methods.split(",") if isinstance(args.methods, str) else args.methods
    if args.worker:
        return _worker(args)
    trees = [t.split("=", 1) for t in args.tree] or [("here", str(ROOT))]
    results = {}
    for label, path in trees:
        cmd = [sys.executable, __file__, "--worker", "--tree-path", path, "--layers",
               str(args.layers), "--width", str(args.width), "--methods",
               ",".join(args.methods)] + (["--where"] if args.where else [])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([path, os.environ.get(
            "PYTHONPATH", "")]))
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode != 0 or not line:
            raise SystemExit(f"tree {label} ({path}) failed:\n{p.stdout[-3000:]}\n"
                             f"{p.stderr[-3000:]}")
        results[label] = json.loads(line[0][7:])
    head = ["method"] + [f"{t}: {c}" for t, _ in trees
                         for c in ("backward", "synchronize", "step", "triton", "total")]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in args.methods:
        cells = [METHODS[m] + (" + mc" if m.endswith("+mc") else "")]
        for t, _ in trees:
            r = results[t][m]
            a, tr = r["aten"], sum(r["triton"].values())
            cells += [str(a.get("backward", 0)), str(a.get("synchronize", 0)),
                      str(a.get("step", 0)), str(tr), str(sum(a.values()) + tr)]
        rows.append("| " + " | ".join(cells) + " |")
    table = "\n".join(rows)
    if args.where:                   # where the ops come from, per tree and method
        for t, _ in trees:
            for m in args.methods:
                print(f"\n{t} / {m}: aten ops per step by issuing site")
                for site, n in results[t][m].get("sites", []):
                    print(f"  {n:5d}  {site}")
    print(f"device ops + Triton launches per step, {args.layers} Linear({args.width}, "
          f"{args.width}) layers ({args.layers} compressed weights, {args.layers} dense "
          f"biases), world size 1, forced Triton (interpreter)")
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(dict(
            layers=args.layers, width=args.width, trees=dict(trees), results=results),
            indent=1))
        Path(args.out + ".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
