"""Study of the Adam / AdamW options of the Adam recipe, side by side in one run.

Options, each with ``TopK(0.01)`` and ``AdaComp()`` at their defaults, against dense
Adam (Horovod's own DistributedOptimizer, no compression) in the same launch:

* ``grad``: today's behaviour (``adam_recipe=False``): the gradient is compressed with
  error feedback and Adam is applied to the exchanged average;
* ``Tw=<n>``: the recipe (:mod:`hvdsparse.adam`, 1-bit Adam's frozen variance and
  compressed scaled gradient) after ``n`` dense warm-up steps;
* ``uncompressed/Tw=<n>``: the recipe with ``TopK(1.0)`` (everything sent): what
  freezing the variance alone costs, without compression;
* ``.../raw``: the recipe as 1-bit Adam publishes it (``m_i`` compressed, no floor under
  the frozen ``sqrt(v_hat)``; set on the recipe object after construction) instead of
  hvdsparse's default (``g_i / D`` compressed, momentum applied after the exchange,
  floor 0.1 x the layer mean; the tables in docs/bench/adam/ were measured when the
  default sent ``m_i / D``).

Workloads (offline data, 2 real ranks under horovodrun, Gloo, CPU):

* ``lm``: character LM, embedding V x 32 -> LSTM(32, 128) -> linear 128 -> V, Adam
  lr 3e-3 (betas 0.9 / 0.999), 16 windows of 64 characters per rank and step; the text
  is the docstrings (``inspect.getdoc``) of a fixed, sorted list of numpy and torch
  modules and their public members; the last 10% is held out. Metric: held-out loss
  (nats / character) at the end.
* ``digits``: MLP 64-512-512-10 on scikit-learn's 8x8 digits (fixed 80/20 split), Adam
  lr 1e-3, batch 32 per rank. Metric: held-out accuracy and loss at the end.

Every (workload, seed) is one horovodrun launch that trains every method in turn from
the same initial weights and batch order. Results accumulate in
``<out>/results.json`` (one entry per workload, seed and method, so a study can be run in
chunks); the table over everything accumulated is printed and saved as
``<out>/table.md`` / ``<out>/summary.json``.

    flock -s /work/cpu.lock .venv/bin/python scripts/study_adam.py --workload lm --seeds 0
    flock -s /work/cpu.lock .venv/bin/python scripts/study_adam.py --workload digits \\
        --seeds 0 1 2
    .venv/bin/python scripts/study_adam.py --table-only
"""
from __future__ import annotations

import argparse
import inspect
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: modules whose docstrings make the LM corpus (fixed order)
CORPUS_MODULES = ("numpy", "numpy.linalg", "numpy.fft", "numpy.random", "numpy.ma",
                  "numpy.polynomial", "torch", "torch.nn", "torch.nn.functional",
                  "torch.optim", "torch.autograd", "torch.distributed", "torch.utils.data",
                  "torch.linalg", "torch.fft")
VOCAB = [chr(c) for c in range(32, 127)] + ["\n", "\x00"]


def build_corpus(limit=1_500_000) -> str:
    seen, chunks, size = set(), [], 0
    for modname in CORPUS_MODULES:
        mod = importlib.import_module(modname)
        members = [mod] + [getattr(mod, n, None) for n in sorted(dir(mod))
                           if not n.startswith("_")]
        for obj in members:
            doc = inspect.getdoc(obj) if obj is not None else None
            if not doc or doc in seen:
                continue
            seen.add(doc)
            chunks.append(doc)
            size += len(doc)
            if size > limit:
                break
    text = "\n\n".join(chunks)[:limit]
    keep = set(VOCAB)
    return "".join(c if c in keep else "\x00" for c in text)


def methods(warmups):
    """name -> None (dense Adam) or (compressor, recipe on, warm-up). ``uncompressed``:
    the recipe with TopK(1.0) (everything sent): what freezing the variance alone costs."""
    out = {"dense": None}
    for comp in ("topk", "adacomp"):
        out[f"{comp}/grad"] = (comp, False, None)
        for w in warmups:
            out[f"{comp}/Tw={w}"] = (comp, True, w)
            out[f"{comp}/Tw={w}/raw"] = (comp, "raw", w)
    for w in warmups:
        out[f"uncompressed/Tw={w}"] = ("all", True, w)
        out[f"uncompressed/Tw={w}/raw"] = ("all", "raw", w)
    return out


# ----------------------------------------------------------------------------- worker
def worker(args):
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import horovod.torch as hvd
    import hvdsparse

    hvd.init()
    R, P = hvd.rank(), hvd.size()
    torch.set_num_threads(1)

    if args.workload == "lm":
        text = Path(args.corpus).read_text()
        idx = {c: i for i, c in enumerate(VOCAB)}
        data = torch.tensor([idx[c] for c in text], dtype=torch.long)
        cut = int(len(data) * 0.9)
        train, held = data[:cut], data[cut:]
        V, T, B = len(VOCAB), 64, 16

        class LM(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(V, 32)
                self.rnn = nn.LSTM(32, 128, batch_first=True)
                self.head = nn.Linear(128, V)

            def forward(self, x):
                return self.head(self.rnn(self.emb(x))[0])

        def make_model():
            return LM()

        def batches(seed):
            g = torch.Generator().manual_seed(seed * 7919 + R)
            while True:
                starts = torch.randint(0, len(train) - T - 1, (B,), generator=g)
                w = torch.stack([train[s:s + T + 1] for s in starts.tolist()])
                yield w[:, :-1], w[:, 1:]

        def loss_fn(model, b):
            x, y = b
            return F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))

        g = torch.Generator().manual_seed(12345)
        hs = torch.randint(0, len(held) - T - 1, (128,), generator=g)
        held_b = torch.stack([held[s:s + T + 1] for s in hs.tolist()])

        def evaluate(model):
            with torch.no_grad():
                return dict(loss=float(loss_fn(model, (held_b[:, :-1], held_b[:, 1:]))))
        lr, steps = 3e-3, args.steps
    else:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
        x, y = load_digits(return_X_y=True)
        x = (x / 16.0 - 0.5).astype(np.float32)
        xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0,
                                              stratify=y)
        xtr, ytr = torch.from_numpy(xtr), torch.from_numpy(ytr).long()
        xte, yte = torch.from_numpy(xte), torch.from_numpy(yte).long()
        mine = torch.arange(R, len(xtr), P)

        def make_model():
            return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512),
                                 nn.ReLU(), nn.Linear(512, 10))

        def batches(seed):
            g = torch.Generator().manual_seed(seed * 7919 + R)
            while True:
                perm = mine[torch.randperm(len(mine), generator=g)]
                for i in range(0, len(perm) - 31, 32):
                    j = perm[i:i + 32]
                    yield xtr[j], ytr[j]

        def loss_fn(model, b):
            return F.cross_entropy(model(b[0]), b[1])

        def evaluate(model):
            with torch.no_grad():
                out = model(xte)
                return dict(loss=float(F.cross_entropy(out, yte)),
                            acc=float((out.argmax(1) == yte).float().mean()))
        lr, steps = 1e-3, args.steps

    results = {}
    for name, spec in methods(args.warmups).items():
        if args.methods and name not in args.methods:
            continue
        torch.manual_seed(args.seed)
        model = make_model()
        base = torch.optim.Adam(model.parameters(), lr=lr)
        if spec is None:
            opt = hvdsparse.horovod_original()(base, named_parameters=model.named_parameters())
        else:
            comp_name, recipe, warm = spec
            comp = {"topk": lambda: hvdsparse.TopK(0.01), "adacomp": hvdsparse.AdaComp,
                    "all": lambda: hvdsparse.TopK(1.0)}[comp_name]()
            kw = dict(adam_warmup=warm, adam_wire="gradient") if recipe else \
                dict(adam_recipe=False)
            opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                           compression=comp, **kw)
            if recipe == "raw":     # 1-bit Adam as published: m_i compressed, no floor
                opt._local_update.wire = "momentum"
                opt._local_update.precondition = False
                opt._local_update.floor = 0.0
        it = batches(args.seed)
        curve, t0, diverged = [], time.perf_counter(), None
        for step in range(steps):
            b = next(it)
            opt.zero_grad()
            loss = loss_fn(model, b)
            loss.backward()
            try:
                opt.step()
            except FloatingPointError:      # every rank raises at the same step
                diverged = step
                break
            if (step + 1) % args.eval_every == 0 or step + 1 == steps:
                curve.append(dict(step=step + 1, train_loss=float(loss), **evaluate(model)))
        wall = time.perf_counter() - t0
        final = evaluate(model) if diverged is None else dict(loss=float("nan"),
                                                              acc=float("nan"))
        entry = dict(final=final, curve=curve, wall_s=wall, diverged_at=diverged)
        if spec is not None:
            tot, last = opt.stats()["totals"], opt.stats()["last"]
            entry["bytes_vs_dense"] = tot["dense_allreduce_bytes"] / max(1, tot["bytes_sent_total"])
            entry["bytes_vs_dense_last_step"] = (last["dense_allreduce_bytes"] /
                                                 max(1, last["bytes_sent_total"]))
            opt.scheduler.remove_hooks()
        results[name] = entry
        if R == 0:
            print(f"{args.workload} seed {args.seed} {name:18s} final {final} "
                  f"({wall:.1f} s){'' if diverged is None else f' DIVERGED at {diverged}'}",
                  flush=True)
    if R == 0:
        Path(args.json).write_text(json.dumps(results))


# ----------------------------------------------------------------------------- launcher
def launch(workload, seed, args):
    with tempfile.TemporaryDirectory() as d:
        js = Path(d) / "out.json"
        cmd = [str(Path(sys.executable).with_name("horovodrun")), "-np", str(args.np), "-H",
               f"localhost:{args.np}", "--gloo", sys.executable, str(Path(__file__).resolve()),
               "--worker", "--workload", workload, "--seed", str(seed), "--json", str(js),
               "--steps", str(args.steps[workload]), "--eval-every", str(args.eval_every),
               "--corpus", str(args.corpus), "--warmups", *map(str, args.warmups[workload])]
        if args.methods:
            cmd += ["--methods", *args.methods]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env, cwd=str(ROOT))
        lines = []
        for line in p.stdout:                   # progress as it comes
            lines.append(line)
            if "final" in line and "<stdout>" in line:
                print(line.rstrip().split("<stdout>:", 1)[-1], flush=True)
        p.wait()
        if p.returncode != 0 or not js.exists():
            raise SystemExit(f"{workload} seed {seed} failed:\n{''.join(lines)[-4000:]}")
        return json.loads(js.read_text())


def table(store: dict) -> tuple:
    rows, lines = [], []
    lines.append("| workload | method | seeds | final held-out loss (mean +- sd) | "
                 "vs dense (paired seeds) | accuracy | bytes vs dense (run / steady) |")
    lines.append("|---|---|---|---|---|---|---|")
    for wl, by_seed in sorted(store.items()):
        seeds = sorted(by_seed)
        names = []
        for s in seeds:
            names += [n for n in by_seed[s] if n not in names]
        for n in names:
            rs_all = [by_seed[s][n] for s in seeds if n in by_seed[s]]
            rs = [r for r in rs_all if r.get("diverged_at") is None]
            div = [r["diverged_at"] for r in rs_all if r.get("diverged_at") is not None]
            if not rs:
                lines.append(f"| {wl} | {n} | {len(rs_all)} | diverged (NaN) at steps {div} "
                             f"| | | |")
                rows.append(dict(workload=wl, method=n, seeds=len(rs_all), diverged=div))
                continue
            loss = [r["final"]["loss"] for r in rs]
            acc = [r["final"].get("acc") for r in rs if r["final"].get("acc") is not None]
            sd = statistics.stdev(loss) if len(loss) > 1 else 0.0
            # vs dense: paired by seed (the same initial weights and batches)
            paired = [by_seed[s][n]["final"]["loss"] / by_seed[s]["dense"]["final"]["loss"]
                      - 1.0 for s in seeds if n in by_seed[s] and "dense" in by_seed[s]
                      and by_seed[s][n].get("diverged_at") is None]
            row = dict(workload=wl, method=n, seeds=len(rs), diverged=div,
                       loss=statistics.mean(loss), loss_sd=sd,
                       loss_vs_dense=statistics.mean(paired) if paired else float("nan"),
                       paired_seeds=len(paired),
                       acc=statistics.mean(acc) if acc else None,
                       acc_sd=statistics.stdev(acc) if len(acc) > 1 else None,
                       bytes_run=statistics.mean([r["bytes_vs_dense"] for r in rs])
                       if "bytes_vs_dense" in rs[0] else None,
                       bytes_steady=statistics.mean([r["bytes_vs_dense_last_step"]
                                                     for r in rs])
                       if "bytes_vs_dense_last_step" in rs[0] else None)
            rows.append(row)
            acc_s = "" if row["acc"] is None else \
                f"{100 * row['acc']:.2f}% +- {100 * (row['acc_sd'] or 0):.2f}"
            by = "1x" if row["bytes_run"] is None else \
                f"{row['bytes_run']:.1f}x / {row['bytes_steady']:.1f}x"
            lines.append(f"| {wl} | {n} | {row['seeds']}"
                         f"{f' (+{len(div)} diverged at {div})' if div else ''} | "
                         f"{row['loss']:.4f} +- {sd:.4f} | "
                         f"{100 * row['loss_vs_dense']:+.1f}% ({row['paired_seeds']}) | {acc_s} | {by} |")
    return rows, "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--workload", choices=("lm", "digits"), default="lm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None,
                    help="default: lm 300, digits 330 (15 epochs of 22 steps)")
    ap.add_argument("--warmups", type=int, nargs="+", default=None,
                    help="recipe warm-up lengths (default: 5%%, 15%%, 30%% of the run)")
    ap.add_argument("--eval-every", type=int, default=30)
    ap.add_argument("--methods", nargs="*", default=None)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "adam"))
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store_path = out / "results.json"
    store = json.loads(store_path.read_text()) if store_path.exists() else {}
    if not args.table_only:
        steps = args.steps or {"lm": 300, "digits": 330}[args.workload]
        args.steps = {args.workload: steps}
        args.warmups = {args.workload: args.warmups or
                        [max(1, round(steps * f)) for f in (0.05, 0.15, 0.30)]}
        if args.corpus is None:
            args.corpus = Path(tempfile.gettempdir()) / "hvdsparse_adam_corpus.txt"
            if not Path(args.corpus).exists():
                Path(args.corpus).write_text(build_corpus())
        for seed in args.seeds:
            res = launch(args.workload, seed, args)
            # re-read before writing: another chunk may have added results meanwhile
            store = json.loads(store_path.read_text()) if store_path.exists() else {}
            store.setdefault(args.workload, {}).setdefault(str(seed), {}).update(res)
            store_path.write_text(json.dumps(store, indent=1))
    rows, md = table(store)
    print(md)
    (out / "table.md").write_text(md + "\n")
    (out / "summary.json").write_text(json.dumps(dict(
        rows=rows, conditions=dict(np=args.np, date=time.strftime("%Y-%m-%d"),
                                   host_cores=os.cpu_count(),
                                   command=" ".join(sys.argv))), indent=1))


if __name__ == "__main__":
    main()
