"""Launches of the compress stage per step, per-layer path against the bucket path
(``hvdsparse/compressors/bucket.py``), counted without a GPU on a model with
ResNet-50's 161 parameter shapes (channel widths divided by ``--div``; the shape
count, hence the launch structure, does not depend on it).

Runs each compressor's compress stage (``LocalUpdate.corrected`` + ``compress`` per
layer, or ``bucket.plan_layer`` / ``compress_bucket`` with the layers of one bucket
grouped by ``bucket.group_key``, as the step engine does) with
``HVDSPARSE_FORCE_TRITON=1`` under Triton's interpreter, so every dispatch takes the
branch a CUDA tensor takes, and counts in the last of ``--steps`` steps:

* aten ops that launch a GPU kernel (views, metadata, allocations and host reads
  excluded; each counted as one launch, an upper-bound proxy);
* Triton launches.

Not counted: the bucket path's one pinned host-to-device copy of the row table per
group (listed in the ``groups`` column), and the stats fold that both paths share at
``begin_step``. Prints a table and writes JSON (``--out``).

    .venv/bin/python scripts/count_bucket_compress.py --out /tmp/bucket_counts.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["HVDSPARSE_FORCE_TRITON"] = "1"

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from launchcount import LaunchCounter  # noqa: E402  (scripts/, this file's folder)

def resnet50_shapes(div: int):
    """(name, shape) of ResNet-50 (torchvision v1.5) with widths divided by ``div``."""
    def w(c):
        return max(1, c // div)
    out = [("conv1.weight", (w(64), 3, 7, 7)), ("bn1.weight", (w(64),)),
           ("bn1.bias", (w(64),))]
    cin = w(64)
    for li, (mid, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
        for b in range(blocks):
            p = f"layer{li + 1}.{b}."
            m = w(mid)
            for i, (co, ci, k) in enumerate(((m, cin, 1), (m, m, 3), (4 * m, m, 1))):
                out += [(p + f"conv{i + 1}.weight", (co, ci, k, k)),
                        (p + f"bn{i + 1}.weight", (co,)), (p + f"bn{i + 1}.bias", (co,))]
            if b == 0:
                out += [(p + "downsample.0.weight", (4 * m, cin, 1, 1)),
                        (p + "downsample.1.weight", (4 * m,)),
                        (p + "downsample.1.bias", (4 * m,))]
            cin = 4 * m
    out += [("fc.weight", (max(1, 1000 // div), cin)), ("fc.bias", (max(1, 1000 // div),))]
    return out


def make(method, seed):
    import hvdsparse.compressors as C
    if method == "topk1":
        return C.TopK(0.01, seed=seed)
    if method == "threshold99":          # the last step reuses tau (life span 2)
        return C.Threshold(0.99, life_span=2, seed=seed)
    if method == "threshold99-refresh":  # every step refreshes tau
        return C.Threshold(0.99, life_span=1, seed=seed)
    if method == "adacomp":
        return C.AdaComp(seed=seed)
    if method == "qsgd4":
        return C.QSGD(4, seed=seed)
    if method == "none":
        return C.NoCompression()
    raise ValueError(method)


def run(method, mc, path, shapes, steps, cnt, seed=0):
    from hvdsparse.compressors import bucket as BK
    from hvdsparse.momentum import LocalUpdate
    g = torch.Generator().manual_seed(seed)
    params = {n: nn.Parameter(torch.randn(s, generator=g) * 0.1) for n, s in shapes}
    opt = torch.optim.SGD(list(params.values()), lr=0.1, momentum=0.9 if mc else 0.0)
    comp = make(method, seed)
    comp.register_layers([(n, p.shape) for n, p in params.items()])
    lu = LocalUpdate(opt, params, 1, momentum_correction=True, clip_grad_norm=None) \
        if mc else None
    groups = Counter()
    for step in range(steps):
        grads = {n: torch.randn(s, generator=g) for n, s in shapes}
        comp.begin_step(step)
        if lu is not None:
            lu.begin_step()
        last = step == steps - 1
        # the callers' non-finite counters exist before compress (the front doors'
        # per-step table): not counted
        nfs = {n: torch.zeros(1, dtype=torch.int32) for n in params}
        if last:
            cnt.clear()
            cnt.__enter__()
        todo, pays = [], {}
        grouped = {}
        for n, p in params.items():
            pl = BK.plan_layer(comp, lu, n, grads[n], p.detach(), step) \
                if path == "bucket" else None
            if pl is None:
                todo.append(n)
                continue
            it = BK.BucketItem(n, grads[n], p.detach(), nfs[n], pl[0])
            its, pls = grouped.setdefault(BK.group_key(pl[1], it), ([], []))
            its.append(it)
            pls.append(pl[1])
        for n in todo:
            p = params[n]
            if lu is not None and lu.wants(n):
                x, _ = lu.corrected(n, grads[n], p, comp.policy.is_dense(n, p.shape), None,
                                    nonfinite=nfs[n])
                pays[n] = comp.compress(n, x, step, param=p.detach(), nonfinite=nfs[n])
            else:
                pays[n] = comp.compress(n, grads[n], step, param=p.detach(),
                                        nonfinite=nfs[n])
        for key, (its, pls) in grouped.items():
            got, _ = BK.compress_bucket(comp, its, pls, step)
            pays.update(got)
            if last:
                groups[key[0]] += 1
        if last:
            cnt.__exit__(None, None, None)
    return dict(aten=sum(cnt.aten.values()), triton=sum(cnt.triton.values()),
                per_layer_left=len(todo), groups=dict(groups),
                ops=dict(Counter({f"aten:{k}": v for k, v in cnt.aten.items()}) +
                         Counter({f"triton:{k}": v for k, v in cnt.triton.items()})))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--div", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--methods", default="none,qsgd4,adacomp,adacomp+mc,topk1,topk1+mc,"
                                         "threshold99,threshold99-refresh")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    shapes = resnet50_shapes(args.div)
    assert len(shapes) == 161, len(shapes)
    cnt = LaunchCounter()
    res = {}
    print(f"compress-stage launches per step, ResNet-50 shapes (161 tensors, widths / "
          f"{args.div}), one bucket, forced Triton (interpreter), last of {args.steps} "
          f"steps")
    print(f"{'method':<14}{'per layer':>10}{'bucket':>8}{'left per layer':>16}  groups")
    for meth in args.methods.split(","):
        mc = meth.endswith("+mc")
        base = meth[:-3] if mc else meth
        r = {p: run(base, mc, p, shapes, args.steps, cnt) for p in ("layer", "bucket")}
        res[meth] = r
        a, b = r["layer"], r["bucket"]
        print(f"{meth:<14}{a['aten'] + a['triton']:>10}{b['aten'] + b['triton']:>8}"
              f"{b['per_layer_left']:>16}  {b['groups']}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(div=args.div, steps=args.steps,
                                                  results=res), indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
