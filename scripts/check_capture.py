"""Is one bucket's compress + encode + decode the same launch sequence at every
steady-state step? The precondition for capturing it as a CUDA graph, checked without a
GPU.

A CUDA graph replays the launches it recorded with the arguments it recorded: the same
kernels, the same scalars, the same device addresses, and host-to-device copies from the
same host addresses. So a bucket's device work can be replayed at step t+1 from a capture
at step t only where the step issues the same launches with the same arguments, and
anything that differs must reach the kernels through memory the graph reads at replay.

This script runs the step engine's ``compress_group`` + ``codec.encode`` (into a message
buffer kept per layout, as the exchanges keep theirs) + ``codec.accumulate`` (two ranks'
copies of the message, ``validate=False``: the CUDA decode) for one bucket of
ResNet-50-like layers under Triton's interpreter with ``HVDSPARSE_FORCE_TRITON=1``
(every dispatch takes the CUDA branch), and records every launch of two consecutive
steady-state steps: aten ops that launch on CUDA (allocations listed too: they fix the graph pool's layout) and
Triton launches, with their arguments. A tensor argument is named by where it lives:
``int`` for storage allocated inside the region (the graph's pool: a replay reuses the
capture's layout, so only offset, shape and dtype must match), else its address
(``ext``). Small int64 host-built tables are also named by a hash of their contents:
the kernels read them, so a graph must copy them from a host buffer it recorded. The
staged row tables (``hvdsparse.row_tables``) are that buffer: the host rewrites them
before each step and a graph's copy reads them at replay, so their addresses must match
and their contents may differ; the cells that differ are listed by name. Prints, per
compressor, the launches that differ between the two steps and why, and writes JSON
(``--out``).

    .venv/bin/python scripts/check_capture.py --out docs/bench/device_ops/capture.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
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

from launchcount import NO_LAUNCH, LaunchCounter  # noqa: E402

#: allocations: no launch, but they lay out the graph's memory pool
ALLOCS = frozenset({"empty", "empty_strided", "empty_like", "new_empty"})
#: one bucket of ResNet-50 layer-3 shapes, channel widths / 4 (weights and their BN)
SHAPES = [(256, 64, 1, 1), (256,), (64, 256, 1, 1), (64,), (64, 64, 3, 3), (64,),
          (128, 256, 1, 1), (128,), (128, 128, 3, 3), (128,), (512, 128, 1, 1), (512,),
          (512, 256, 1, 1), (512,)]


class Recorder(LaunchCounter):
    """Launch events of a region (:meth:`run`): :class:`LaunchCounter`'s hooks, with
    allocations counted too and every launch kept with its arguments."""

    def __init__(self, staged=(), patch=setattr):
        super().__init__(skip=NO_LAUNCH - ALLOCS, patch=patch)
        self.events, self.internal, self.external = [], set(), set()
        #: storage of the staged row tables (hvdsparse.row_tables): rewritten by the host
        #: before every step, read by a graph's copy at replay, so their contents may
        #: differ; their addresses may not
        self.staged = set(staged)

    def observe(self, kind, name, args, kwargs, out):
        self.events.append((kind, name, self.norm(list(args)), self.norm(dict(kwargs))))
        if kind == "aten":
            self.note(out)     # storage a launch or an allocation made (views: skipped)

    def norm(self, x):
        if isinstance(x, torch.Tensor):
            p = x.untyped_storage().data_ptr()
            if p in self.internal:
                # the graph's pool: a replay reuses the capture's layout, whatever
                # addresses an eager step's allocator hands out
                return ("tensor", "int", x.storage_offset(), tuple(x.shape), str(x.dtype))
            self.external.add(p)
            out = ("tensor", f"ext {p:#x}", x.storage_offset(), tuple(x.shape), str(x.dtype))
            if p in self.staged:
                return out + ("staged",)
            if x.dtype == torch.int64 and x.numel() <= 1 << 16 and x.device.type == "cpu":
                h = hashlib.sha1(x.contiguous().numpy().tobytes()).hexdigest()[:10]
                out += (f"contents {h}",)
            return out
        if isinstance(x, (list, tuple)):
            return tuple(self.norm(y) for y in x)
        if isinstance(x, dict):
            return tuple(sorted((k, self.norm(v)) for k, v in x.items()))
        if isinstance(x, (int, float, bool, str, type(None))):
            return x
        if isinstance(x, (torch.dtype, torch.device)):
            return str(x)
        return type(x).__name__

    def note(self, out):
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor):
                p = t.untyped_storage().data_ptr()
                if p and p not in self.internal and p not in self.external:
                    self.internal.add(p)

    def run(self, fn):
        self.events, self.internal, self.external = [], set(), set()
        with self:
            fn()
        return self.events


def why(a, b) -> list:
    """What differs between two launch events (same position in their steps)."""
    out = []
    if a[:2] != b[:2]:
        return [f"another launch: {a[1]} then {b[1]}"]
    for what, x, y in (("arg", a[2], b[2]), ("kwarg", a[3], b[3])):
        for j, (u, v) in enumerate(zip(x, y)):
            if u == v:
                continue
            if isinstance(u, tuple) and u and u[0] == "tensor" and isinstance(v, tuple) \
                    and v and v[0] == "tensor":
                if u[1] != v[1]:
                    out.append(f"{what} {j}: a tensor at another address ({u[1]} / {v[1]})")
                elif u[2:5] != v[2:5]:
                    out.append(f"{what} {j}: another offset / shape / dtype")
                else:
                    out.append(f"{what} {j}: a host table with other contents")
            else:
                out.append(f"{what} {j}: {str(u)[:60]} / {str(v)[:60]}")
        if len(x) != len(y):
            out.append(f"{what}s: {len(x)} / {len(y)}")
    return out


#: ranks whose messages the decode reads
WORLD = 2

#: the kernels modules naming the columns of each kind of staged table (later ones win:
#: RandomK's and Slim-DP's rows name TopK's C_OFF cell C_SEED)
TABLE_MODULES = dict(topk=("bucket_topk",), picking=("bucket_topk", "bucket_randomk"),
                     adacomp=("bucket_binned",), qsgd=("bucket_dense",),
                     dense=("bucket_dense",), adam=("bucket_adam",))


def column_names(kind: str) -> dict:
    import importlib
    names = {}
    for m in TABLE_MODULES[kind]:
        mod = importlib.import_module("kernels." + m)
        names.update({v: k for k, v in vars(mod).items()
                      if k.startswith("C_") and isinstance(v, int)})
    return names


class BucketRegion:
    """One bucket of ``shapes`` through the step engine as a step runs it on CUDA:
    ``compress_group``, ``codec.encode`` into a message buffer kept per size and, with
    ``decode``, ``codec.accumulate`` of :data:`WORLD` ranks' copies of the message
    (``validate=False``) into a flat vector kept across steps. ``phases`` accumulates
    each phase's host seconds. ``quiet``: recorders paused while the copies that stand
    in for the collective run."""

    def __init__(self, make, shapes=SHAPES, decode: bool = True):
        from hvdsparse.engine import StepEngine
        from hvdsparse.settings import ExchangeSettings
        self.comp = make()
        self.eng = StepEngine(self.comp, ExchangeSettings(), None, rank=0, world_size=1,
                              prefix="cap")
        g = torch.Generator().manual_seed(0)
        self.params = [torch.randn(s, generator=g) for s in shapes]
        self.grads = [torch.randn(s, generator=g) for s in shapes]
        self.counters = [torch.zeros(1, dtype=torch.int32) for _ in shapes]
        self.decode = decode
        self.messages, self.gathered = {}, {}
        numels = [math.prod(s) for s in shapes]
        self.flat = torch.empty(sum(numels), dtype=torch.float32)
        self.views = list(torch.split(self.flat, numels))
        self.flag = torch.zeros(1, dtype=torch.int32)
        #: the encode's and decode's SegmentGraphs (``ExchangeContext.graphs``) or None
        self.graphs = None
        self.quiet = []
        self.phases = dict(compress=0.0, encode=0.0, decode=0.0)

    def __call__(self, step):
        from hvdsparse import codec
        from hvdsparse.engine import LayerInput
        t0 = time.perf_counter()
        pays = self.eng.compress_group(
            [LayerInput(f"l{i}", gr, p, self.counters[i])
             for i, (gr, p) in enumerate(zip(self.grads, self.params))], step)
        t1 = time.perf_counter()
        n = codec.encoded_nbytes(pays)
        buf = self.messages.setdefault(n, codec.new_message(pays))
        codec.encode(pays, out=buf, graphs=self.graphs)
        t2 = time.perf_counter()
        if self.decode:
            # two ranks' rows, as an allgather leaves them in its reused buffer (the
            # copies stand in for the collective: not recorded), decoded as the exchange
            # does on CUDA
            rows = self.gathered.setdefault(n, torch.empty(WORLD, n, dtype=torch.uint8))
            for rec in self.quiet:
                rec.active = False
            for r in range(WORLD):
                rows[r].copy_(buf)
            for rec in self.quiet:
                rec.active = True
            t2 = time.perf_counter()
            codec.accumulate(rows, pays, self.views, validate=False, error_flag=self.flag,
                             zero=True, graphs=self.graphs)
        t3 = time.perf_counter()
        for k, dt in (("compress", t1 - t0), ("encode", t2 - t1), ("decode", t3 - t2)):
            self.phases[k] += dt

    def step(self, s):
        self.eng.begin_step(s)
        self(s)
        self.eng.commit()


def check(name, make, steps: int, shapes=SHAPES, decode: bool = True, patch=setattr):
    """Steps ``steps`` and ``steps + 1`` of one bucket of ``shapes`` compressed by
    ``make()`` and encoded (and, with ``decode``, decoded from :data:`WORLD` ranks' copies
    of the message): the launches, those that differ (and why), and the cells of the
    staged row tables the host rewrote between the two. ``patch`` installs the Triton
    launch hook (:class:`LaunchCounter`)."""
    region = BucketRegion(make, shapes, decode)
    comp, eng, flag = region.comp, region.eng, region.flag
    for s in range(steps):
        region.step(s)
    tables = getattr(comp, "row_tables", None)
    staged = tables.staged() if tables is not None else []
    rec = Recorder((t.untyped_storage().data_ptr() for _, t in staged), patch)
    region.quiet.append(rec)
    traces, snaps = [], []
    for s in (steps, steps + 1):
        eng.begin_step(s)          # outside the region: the stats fold of the last step
        traces.append(rec.run(lambda: region(s)))
        snaps.append([t.clone() for _, t in staged])
        eng.commit()
    a, b = traces
    diffs = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            diffs.append(dict(event=i, launch=x[1], why=why(x, y)))
    if len(a) != len(b):
        diffs.append(dict(event=min(len(a), len(b)), launch="(count)",
                          why=[f"{len(a)} events at step {steps}, {len(b)} at step "
                               f"{steps + 1}"]))
    rewritten = {}
    for (key, _), u, v in zip(staged, *snaps):
        cols = sorted(set(torch.nonzero(u != v)[:, 1].tolist()))
        if cols:
            names = column_names(key[0])
            rewritten.setdefault(key[0], sorted(set(rewritten.get(key[0], [])) |
                                                {names.get(c, str(c)) for c in cols}))
    launches = sum(1 for e in b if e[0] == "triton" or
                   e[1].split(".")[1] not in ALLOCS)
    return dict(compressor=name, events=len(b), launches=launches, differences=diffs,
                staged_tables=len(staged), rewritten=rewritten,
                error_flag=int(flag[0]) if decode else None)


def with_graphs(make, steps: int, shapes=SHAPES) -> dict:
    """The same bucket with its compress, encode and decode segments replayed
    (``hvdsparse.device_graphs`` through ``graph_emulator.EmulatedGraphs``): per
    steady-state step, the segments replayed, the launches they hold and the copies of
    the gathered rows to their home (the decode's input), so that a step issues
    ``launches - folded + segments + homes`` launches on CUDA (one graph launch per
    segment)."""
    from graph_emulator import EmulatedGraphs
    from hvdsparse import device_graphs
    region = BucketRegion(make, shapes, decode=True)
    emu = EmulatedGraphs()
    g = device_graphs.enable(region.comp, emu)
    region.graphs = d = device_graphs.SegmentGraphs(emu)
    for s in range(steps):
        region.step(s)
    r0, c0, h0 = g.replays + d.replays, emu.reissued, d.homes
    region.step(steps)
    return dict(segments=g.replays + d.replays - r0, folded=emu.reissued - c0,
                homes=d.homes - h0, captures=g.captures + d.captures)


def _maker(name, *args):
    def make():
        import hvdsparse
        return getattr(hvdsparse, name)(*args)
    return make


#: the compressors the checks run, at their usual settings
MAKERS = dict(topk=_maker("TopK", 0.01), threshold=_maker("Threshold", 0.99),
              adacomp=_maker("AdaComp"), qsgd=_maker("QSGD", 4),
              randomk=_maker("RandomK", 0.01), slimdp=_maker("SlimDP", 0.2, 0.1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12,
                    help="steps before the two compared ones (past any warm-up)")
    ap.add_argument("--methods", default="topk,threshold,adacomp,qsgd,randomk,slimdp")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for m in args.methods.split(","):
        row = check(m, MAKERS[m], args.steps)
        row["graphs"] = gr = with_graphs(MAKERS[m], args.steps)
        row["graph_launches"] = row["launches"] - gr["folded"] + gr["segments"] + \
            gr["homes"]
        rows.append(row)
        print(f"{m}: {row['launches']} launches ({row['events']} events with allocations), "
              f"{len(row['differences'])} differ between steps {args.steps} and "
              f"{args.steps + 1}; {row['staged_tables']} staged row tables, cells "
              f"rewritten: {row['rewritten'] or 'none'}; with cuda_graphs: "
              f"{row['graph_launches']} launches ({gr['segments']} segments replayed, "
              f"holding {gr['folded']} launches; {gr['homes']} copies home)", flush=True)
        for d in row["differences"]:
            print(f"  event {d['event']} {d['launch']}: {'; '.join(d['why'])}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(shapes=SHAPES, steps=args.steps,
                                                  rows=rows), indent=1))


if __name__ == "__main__":
    main()
