#!/usr/bin/env python
"""Draw the plots of BENCHMARKS.md from the JSON kept under ``docs/bench/``.

Only the JSON behind the tables is committed; every plot is derived from it here, with
the benchmark scripts' own plotting code where they have one:

* ``network``     ``docs/bench/network/*.json`` (``bench_network.py``): per run, the
  median step split into forward + backward (compression in the hooks included) and
  ``optimizer.step``, and held-out accuracy against training wall-clock time.
* ``ddp``         ``docs/bench/ddp/*.json`` (``bench_ddp.py``): median step and CPU time
  per method, accuracy against training time.
* ``convergence`` ``docs/bench/convergence/*.json`` (``bench_convergence.py``): held-out
  accuracy or loss against the optimizer step, mean over seeds, one line per method.
* ``overhead``    ``docs/bench/overhead/p1_*.json`` (``bench_overhead.py``): the step at
  world size 1 split into forward + backward, sync (exchange, decode, ``p.grad``) and
  update, per method and tree; ``kernels.json`` (``bench_kernels.py``): each CPU kernel's
  repetitions against ``torch.add``.
* ``scaling``     ``docs/bench/scaling/scaling.json`` (``bench_scaling.py``): bytes sent
  per rank and step against the world size, per exchange strategy, measured (solid) and
  predicted by the cost model (dashed).

Usage::

    .venv/bin/python scripts/plot_benchmarks.py [--src docs/bench] [--out results/plots]
        [--only network ddp convergence overhead scaling]

Writes ``<out>/<group>/<json stem>[_<what>].png`` and prints every file written. A file
the group's reader cannot use is an error that names it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

GROUPS = ("network", "ddp", "convergence", "overhead", "scaling")


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _load(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: not readable as JSON ({e})")


def _need(path, data, keys):
    missing = [k for k in keys if k not in data]
    if missing:
        raise SystemExit(f"{path}: no {', '.join(missing)} (not this group's benchmark JSON?)")


def _renamed(files, dest):
    """Move the fixed-name plots a benchmark's plotting function wrote into ``dest``'s
    folder as ``<dest stem>_<name>``; returns the new paths."""
    out = []
    for f in files:
        f = Path(f)
        target = dest.parent / f"{dest.name}_{f.name}"
        f.replace(target)
        out.append(target)
    return out


def plot_network(src, out):
    import bench_network
    files = []
    for path in sorted((src / "network").glob("*.json")):
        d = _load(path)
        _need(path, d, ("meta", "runs"))
        tmp = out / f".{path.stem}"
        tmp.mkdir(parents=True, exist_ok=True)
        written = bench_network.plots(d["runs"], tmp, d["meta"].get("title", path.stem))
        files += _renamed(written, out / path.stem)
        tmp.rmdir()
    return files


def plot_ddp(src, out):
    import bench_ddp
    files = []
    for path in sorted((src / "ddp").glob("*.json")):
        d = _load(path)
        _need(path, d, ("meta", "summary", "runs", "target_acc"))
        tmp = out / f".{path.stem}"
        tmp.mkdir(parents=True, exist_ok=True)
        written = bench_ddp.plots(d["summary"], d["runs"], d["target_acc"], tmp,
                                  d["meta"].get("title", path.stem))
        files += _renamed(written, out / path.stem)
        tmp.rmdir()
    return files


def plot_convergence(src, out):
    import bench_convergence
    files = []
    for path in sorted((src / "convergence").glob("*.json")):
        d = _load(path)
        _need(path, d, ("workload", "np", "quality", "runs"))
        f = out / f"{path.stem}.png"
        bench_convergence.plot(d, f)
        files.append(f)
    return files


_PHASES = (("fwd_bwd_ms", "forward + backward (compress in the hooks)"),
           ("sync_ms", "sync (exchange wait, decode, p.grad)"),
           ("update_ms", "update"))


def plot_overhead(src, out):
    plt = _plt()
    files = []
    for path in sorted((src / "overhead").glob("p1_*.json")):
        d = _load(path)
        _need(path, d, ("meta", "summary"))
        labels, parts = [], {k: [] for k, _ in _PHASES}
        for tree, methods in d["summary"].items():
            for m, s in methods.items():
                labels.append(f"{m} ({tree})")
                for k, _ in _PHASES:
                    parts[k].append(s[k])
        fig, ax = plt.subplots(figsize=(9, 0.35 * len(labels) + 2.0))
        left = [0.0] * len(labels)
        for k, name in _PHASES:
            ax.barh(labels, parts[k], left=left, label=name)
            left = [a + b for a, b in zip(left, parts[k])]
        ax.invert_yaxis()
        ax.set_xlabel("median step (ms), world size 1")
        ax.set_title(f"Overhead at P = 1 - {d['meta'].get('started_utc', '')}", fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
        fig.tight_layout()
        f = out / f"{path.stem}.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(f)
    kern = src / "overhead" / "kernels.json"
    if kern.exists():
        d = _load(kern)
        _need(kern, d, ("cpu_ms", "n"))
        ops = list(d["cpu_ms"])
        base = d["cpu_ms"]["torch.add"]["median"]
        fig, ax = plt.subplots(figsize=(9, 4))
        for i, op in enumerate(ops):
            reps = [v / base for v in d["cpu_ms"][op]["all"]]
            ax.scatter(reps, [i] * len(reps), s=12, alpha=0.6)
            ax.scatter([d["cpu_ms"][op]["median"] / base], [i], marker="|", s=300, color="k")
        ax.set_yticks(range(len(ops)))
        ax.set_yticklabels(ops, fontsize=8)
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_xlabel("time / median torch.add (log; bar = median)")
        ax.set_title(f"CPU kernels, n = {d['n']:,}, {d.get('threads')} thread(s)", fontsize=9)
        fig.tight_layout()
        f = out / "kernels.png"
        fig.savefig(f, dpi=110)
        plt.close(fig)
        files.append(f)
    return files


def plot_scaling(src, out):
    plt = _plt()
    path = src / "scaling" / "scaling.json"
    if not path.exists():
        return []
    d = _load(path)
    _need(path, d, ("rows",))
    by = {}
    for r in d["rows"]:
        by.setdefault(r["exchange"], []).append(r)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for ex, rows in by.items():
        rows.sort(key=lambda r: r["P"])
        ps = [r["P"] for r in rows]
        line, = ax.plot(ps, [r["sent_mean"] / 1e3 for r in rows], marker="o", label=ex)
        ax.plot(ps, [r["predicted"] / 1e3 for r in rows], ls="--", color=line.get_color(),
                lw=1)
    dense = {r["P"]: r["dense"] for rows in by.values() for r in rows}
    ps = sorted(dense)
    ax.plot(ps, [dense[p] / 1e3 for p in ps], color="black", lw=2, label="dense allreduce")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ps)
    ax.set_xticklabels([str(p) for p in ps])
    ax.set_xlabel("world size P")
    ax.set_ylabel("kB sent per rank and step (dashed: cost model)")
    ax.set_title("TopK 1%: bytes per rank vs P, per exchange strategy", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    f = out / "scaling.png"
    fig.savefig(f, dpi=110)
    plt.close(fig)
    return [f]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=str(ROOT / "docs" / "bench"),
                    help="folder holding the benchmark JSON (default docs/bench)")
    ap.add_argument("--out", default=str(ROOT / "results" / "plots"))
    ap.add_argument("--only", nargs="+", choices=GROUPS, default=list(GROUPS))
    a = ap.parse_args(argv)
    src, out = Path(a.src), Path(a.out)
    if not src.is_dir():
        raise SystemExit(f"--src {src}: no such folder")
    draw = {"network": plot_network, "ddp": plot_ddp, "convergence": plot_convergence,
            "overhead": plot_overhead, "scaling": plot_scaling}
    total = 0
    for g in a.only:
        (out / g).mkdir(parents=True, exist_ok=True)
        for f in draw[g](src, out / g):
            print(f)
            total += 1
    print(f"{total} plots in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
