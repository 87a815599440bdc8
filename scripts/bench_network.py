#!/usr/bin/env python
"""Shaped-network benchmark: dense allreduce vs Horovod fp16 vs hvdsparse compressors.

Every method runs ``scripts/train.py`` under ``horovodrun -np N -H localhost:N --gloo``
inside a fresh network namespace whose only interface, the loopback, is rate-limited
with ``tc qdisc add dev lo root tbf rate <RATE> burst 256kb latency 50ms``. All ranks'
traffic crosses that one shaped loopback, so the rate is the *aggregate* bandwidth of
the whole job (like N hosts behind one 1 Gbit/s uplink), not a per-host link: a per-host
1 Gbit/s network would move up to N times more in total. The namespace is deleted at
the end, also on errors and Ctrl-C.

Methods run back to back in the same namespace, so their figures are side by side.
Wire bytes come from two sources: the optimizer's own accounting (train.py's
``bytes_sent_per_rank_step``) and the loopback interface's byte counter
(``/proc/net/dev`` in the namespace: everything that really crossed the link, including
Horovod's control traffic and the evaluation collectives, divided by steps and ranks).

Needs root plus ``ip`` and ``tc`` (iproute2) for shaping; ``--no-shape`` runs the same
measurements on the host's unshaped loopback (then the loopback counter also sees other
processes' traffic and is not reported).

Examples::

    sudo python scripts/bench_network.py --np 4 --rate 1gbit            # full table
    python scripts/bench_network.py --np 4 --methods dense,topk1 --no-shape
    sudo python scripts/bench_network.py --sweep --sweep-np 2,4,8       # exchange sweep

Outputs in ``--out`` (default results/bench_<rate>_np<N>): ``results.json`` (every
figure, every run's full train.py JSON), ``table.md``, ``step_time.png``,
``accuracy_vs_time.png``, ``logs/<method>.log``; with ``--sweep`` also ``sweep.json``,
``sweep.md``, ``sweep.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train.py"

# name -> (label, train.py arguments)
METHODS = {
    "dense": ("dense allreduce (fp32)", ["--compression", "none"]),
    "fp16": ("Horovod fp16 allreduce", ["--compression", "fp16"]),
    "topk1": ("TopK 1%", ["--compression", "topk", "--ratio", "0.01"]),
    "threshold99": ("Threshold 99%", ["--compression", "threshold", "--sparsity", "0.99"]),
    "adacomp": ("AdaComp", ["--compression", "adacomp"]),
    "slimdp": ("Slim-DP (alpha 0.2, beta 0.1)", ["--compression", "slimdp", "--alpha", "0.2",
                                                "--beta", "0.1"]),
    "qsgd4": ("QSGD 4-bit", ["--compression", "qsgd", "--bits", "4"]),
    "topk1_int4": ("TopK 1% + int4", ["--compression", "topk", "--ratio", "0.01",
                                      "--values", "int4"]),
    # not in the default list: denser TopK, fewer steps to the target
    "topk5": ("TopK 5%", ["--compression", "topk", "--ratio", "0.05"]),
    "topk5_int4": ("TopK 5% + int4", ["--compression", "topk", "--ratio", "0.05",
                                      "--values", "int4"]),
}
DEFAULT_METHODS = [m for m in METHODS if not m.startswith("topk5")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rate", default="1gbit", help="tbf rate: 1gbit, 10gbit, 100mbit, ...")
    p.add_argument("--burst", default="256kb")
    p.add_argument("--latency", default="50ms")
    p.add_argument("--np", type=int, default=4, help="ranks (all on localhost)")
    p.add_argument("--no-shape", action="store_true",
                   help="run on the host's unshaped loopback (no root / tc needed)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma-separated subset of: " + ", ".join(METHODS))
    p.add_argument("--exchange", default="auto", help="hvdsparse exchange for every method")
    p.add_argument("--workload", default="wide", choices=("digits", "wide"))
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--target-acc", type=float, default=0.95)
    p.add_argument("--eval-every", type=int, default=5, help="steps between evaluations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-args", default="",
                   help="extra train.py arguments for every run, e.g. '--width 3072 --lr 0.05'")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--omp-threads", type=int, default=1,
                   help="OMP_NUM_THREADS per rank (ranks oversubscribe a small CPU)")
    p.add_argument("--out", default=None)
    p.add_argument("--sweep", action="store_true",
                   help="world-size sweep of bytes per exchange strategy instead of the table")
    p.add_argument("--sweep-np", default="2,4,8")
    p.add_argument("--sweep-exchanges", default="allgather,split,dense,auto")
    p.add_argument("--sweep-steps", type=int, default=6)
    p.add_argument("--sweep-method", default="topk1", choices=list(METHODS))
    p.add_argument("--plot-only", action="store_true",
                   help="re-draw table and plots from an existing results.json in --out")
    a = p.parse_args(argv)
    if a.out is None:
        tag = "unshaped" if a.no_shape else a.rate
        a.out = str(ROOT / "results" / (f"sweep_{tag}" if a.sweep else f"bench_{tag}_np{a.np}"))
    return a


# ----------------------------------------------------------------------------- namespace

class Namespace:
    """A fresh network namespace with a tbf-shaped loopback; deleted on exit."""

    def __init__(self, rate, burst, latency):
        self.name = f"hvdbench{os.getpid()}"
        self.rate, self.burst, self.latency = rate, burst, latency
        self.created = False

    @staticmethod
    def check():
        problems = []
        if os.geteuid() != 0:
            problems.append("not running as root (network namespaces and tc need root)")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                problems.append(f"'{tool}' not found (install iproute2)")
        return problems

    def _run(self, *cmd):
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed (rc={r.returncode}): {r.stdout.strip()}")
        return r.stdout

    def __enter__(self):
        try:
            self._run("ip", "netns", "add", self.name)
            self.created = True
            self._run("ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up")
            self._run("ip", "netns", "exec", self.name, "tc", "qdisc", "add", "dev", "lo",
                      "root", "tbf", "rate", self.rate, "burst", self.burst,
                      "latency", self.latency)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def qdisc(self):
        return self._run("ip", "netns", "exec", self.name, "tc", "-s", "qdisc", "show",
                         "dev", "lo").strip()

    def prefix(self):
        return ["ip", "netns", "exec", self.name]

    def __exit__(self, *exc):
        if self.created:
            subprocess.run(["ip", "netns", "del", self.name], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            self.created = False
        return False


# ----------------------------------------------------------------------------- runs

def horovodrun():
    exe = Path(sys.executable).with_name("horovodrun")
    if exe.exists():
        return str(exe)
    found = shutil.which("horovodrun")
    if not found:
        raise SystemExit("horovodrun not found next to this python nor on PATH "
                         "(run scripts/setup_env.sh)")
    return found


def run_train(a, ns, np_, name, extra, json_path, log_path):
    cmd = (ns.prefix() if ns else []) + [
        horovodrun(), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
        sys.executable, str(TRAIN), "--workload", a.workload, "--seed", str(a.seed),
        "--no-progress", "--json", str(json_path)] + extra + a.train_args.split()
    if ns:
        cmd.append("--measure-lo")
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(a.omp_threads)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        try:
            r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                               cwd=str(ROOT), timeout=a.timeout)
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.time() - t0
    if rc != 0 or not json_path.exists():
        tail = Path(log_path).read_text()[-2500:]
        print(f"  !! {name} failed (rc={rc}); log tail:\n{tail}", file=sys.stderr, flush=True)
        return {"error": f"rc={rc}", "log": str(log_path), "launch_wall_s": wall}
    with open(json_path) as f:
        res = json.load(f)
    res["launch_wall_s"] = wall
    res["command"] = " ".join(cmd)
    return res


def profile_of(res):
    """Median per-step breakdown from train.py's history (rank 0)."""
    h = res.get("history", {})
    out = {}
    for key, lab in (("fwd_bwd_times", "fwd_bwd_s"), ("opt_step_times", "opt_step_s")):
        v = h.get(key) or []
        if v:
            out[lab] = statistics.median(v)
    for key in ("time_compress_s", "time_wait_s", "time_decode_s"):
        v = h.get(key) or []
        if v:
            out[key[5:]] = statistics.median(v)      # compress_s, wait_s, decode_s
    return out


# ----------------------------------------------------------------------------- reporting

def fmt(v, spec, none="-"):
    return none if v is None else format(v, spec)


def make_table(results, base="dense"):
    s_base = results.get(base, {}).get("summary") if base in results else None
    rows = ["| method | median step (ms) | speed-up/step vs dense | MB sent/rank/step (optimizer) "
            "| MB/rank/step on the wire (lo) | compression vs dense | time to target (s) "
            "| speed-up to target | steps to target | final acc (%) | acc diff vs dense (pp) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, res in results.items():
        label = METHODS.get(name, (name,))[0]
        if "error" in res:
            rows.append(f"| {label} | failed ({res['error']}, see {res['log']}) |" + " |" * 9)
            continue
        s = res["summary"]
        step = s["median_step_s_slowest_rank"]
        sp = (s_base["median_step_s_slowest_rank"] / step) if s_base else None
        ttt = s["time_to_target_s"]
        spt = (s_base["time_to_target_s"] / ttt) if (s_base and ttt and s_base["time_to_target_s"]) else None
        lo = s.get("lo_bytes_per_rank_step")
        sent = s.get("bytes_sent_per_rank_step")
        comp = (s_base["lo_bytes_per_rank_step"] / lo) if (s_base and lo and s_base.get("lo_bytes_per_rank_step")) \
            else s.get("effective_compression")
        dacc = ((s["final_test_acc"] - s_base["final_test_acc"]) * 100) if s_base else None
        rows.append(
            f"| {label} | {step * 1e3:.1f} | {fmt(sp, '.2f')}x | {fmt(sent and sent / 1e6, '.3f')} "
            f"| {fmt(lo and lo / 1e6, '.3f')} | {fmt(comp, '.1f')}x | {fmt(ttt, '.1f', 'not reached')} "
            f"| {fmt(spt, '.2f')}{'x' if spt else ''} | {fmt(s.get('target_step'), 'd', '-')} "
            f"| {s['final_test_acc'] * 100:.2f} | {fmt(dacc, '+.2f')} |")
    return "\n".join(rows)


def make_profile_table(results):
    rows = ["| method | fwd+bwd (+compress in hooks) ms | optimizer.step ms | of which: compress ms "
            "| exchange wait ms | decode ms |",
            "|---|---:|---:|---:|---:|---:|"]
    for name, res in results.items():
        if "error" in res:
            continue
        p = profile_of(res)
        ms = {k: (None if p.get(k) is None else p[k] * 1e3)
              for k in ("fwd_bwd_s", "opt_step_s", "compress_s", "wait_s", "decode_s")}
        rows.append(f"| {METHODS.get(name, (name,))[0]} | {fmt(ms['fwd_bwd_s'], '.1f')} "
                    f"| {fmt(ms['opt_step_s'], '.1f')} | {fmt(ms['compress_s'], '.1f')} "
                    f"| {fmt(ms['wait_s'], '.1f')} | {fmt(ms['decode_s'], '.1f')} |")
    return "\n".join(rows)


def plots(results, out, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots", file=sys.stderr)
        return []
    ok = {n: r for n, r in results.items() if "error" not in r}
    if not ok:
        return []
    files = []
    names = list(ok)
    labels = [METHODS.get(n, (n,))[0] for n in names]
    fb = [profile_of(ok[n]).get("fwd_bwd_s", 0) * 1e3 for n in names]
    st = [profile_of(ok[n]).get("opt_step_s", 0) * 1e3 for n in names]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.barh(labels, fb, label="forward + backward (+ compression in hooks)")
    ax.barh(labels, st, left=fb, label="optimizer.step (exchange wait + decode + update)")
    for i, n in enumerate(names):
        tot = ok[n]["summary"]["median_step_s_slowest_rank"] * 1e3
        ax.text(tot, i, f" {tot:.0f} ms", va="center", fontsize=8)
    ax.set_xlim(right=max(ok[n]["summary"]["median_step_s_slowest_rank"] for n in names) * 1e3 * 1.15)
    ax.invert_yaxis()
    ax.set_xlabel("median step time (ms)")
    ax.set_title(f"Step time per method - {title}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    f = Path(out) / "step_time.png"
    fig.savefig(f, dpi=110)
    plt.close(fig)
    files.append(f)

    fig, ax = plt.subplots(figsize=(9, 5))
    for n in names:
        ev = ok[n]["history"]["evals"]
        ax.plot([e["train_time"] for e in ev], [e["test_acc"] * 100 for e in ev],
                marker=".", label=METHODS.get(n, (n,))[0])
    tgt = next((r["summary"]["target_acc"] for r in ok.values() if r["summary"].get("target_acc")), None)
    if tgt:
        ax.axhline(tgt * 100, color="gray", ls="--", lw=1, label=f"target {tgt * 100:.0f}%")
    ax.set_xlabel("training wall-clock time (s, evaluation excluded)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_ylim(bottom=max(0, min(60, ax.get_ylim()[0])))
    ax.set_title(f"Accuracy vs wall-clock - {title}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    f = Path(out) / "accuracy_vs_time.png"
    fig.savefig(f, dpi=110)
    plt.close(fig)
    files.append(f)
    return files


# ----------------------------------------------------------------------------- sweep

def predicted_costs(res, world):
    """Cost model prediction per strategy, summed over buckets, as recorded by
    ``train.py --record-cost-model`` in its summary (``cost_model_prediction``)."""
    return (res.get("summary") or {}).get("cost_model_prediction")


def sweep(a, ns, out):
    nps = [int(x) for x in a.sweep_np.split(",")]
    exchanges = a.sweep_exchanges.split(",")
    label, margs = METHODS[a.sweep_method]
    rows = []
    for np_ in nps:
        for ex in exchanges:
            name = f"np{np_}_{ex}"
            print(f"[sweep] P={np_} exchange={ex} ({label})", flush=True)
            res = run_train(a, ns, np_, name, margs + ["--exchange", ex, "--epochs", "1",
                                                       "--max-steps", str(a.sweep_steps),
                                                       "--eval-every", "0",
                                                       "--record-cost-model"],
                            out / "runs" / f"{name}.json", out / "logs" / f"{name}.log")
            row = {"np": np_, "exchange": ex}
            if "error" in res:
                row["error"] = res["error"]
            else:
                s = res["summary"]
                row.update(bytes_received=s.get("bytes_received_per_rank_step"),
                           bytes_sent=s.get("bytes_sent_per_rank_step"),
                           lo_bytes=s.get("lo_bytes_per_rank_step"),
                           median_step_s=s["median_step_s_slowest_rank"],
                           strategy=s.get("strategy"), params=s["params"],
                           predicted=predicted_costs(res, np_),
                           bytes_by_strategy=s.get("bytes_by_strategy"))
            rows.append(row)
            with open(out / "sweep.json", "w") as f:
                json.dump({"args": vars(a), "rows": rows}, f, indent=1, default=str)
    return rows


def sweep_table(rows):
    md = ["| P | exchange | chosen strategy | MB received/rank/step (optimizer) | cost-model prediction (MB) "
          "| MB/rank/step on the wire (lo) | median step (ms) |", "|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            md.append(f"| {r['np']} | {r['exchange']} | failed ({r['error']}) | | | | |")
            continue
        pred = r.get("predicted") or {}
        pv = pred.get(r["exchange"]) if "error" not in pred else None
        md.append(f"| {r['np']} | {r['exchange']} | {r.get('strategy') or '-'} "
                  f"| {fmt(r['bytes_received'] and r['bytes_received'] / 1e6, '.3f')} "
                  f"| {fmt(pv and pv / 1e6, '.3f')} | {fmt(r['lo_bytes'] and r['lo_bytes'] / 1e6, '.3f')} "
                  f"| {r['median_step_s'] * 1e3:.0f} |")
    return "\n".join(md)


def sweep_plot(rows, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for ex in sorted({r["exchange"] for r in rows}):
        pts = [(r["np"], (r.get("lo_bytes") or r.get("bytes_received") or 0) / 1e6)
               for r in rows if r["exchange"] == ex and "error" not in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{ex} (measured)")
    ax.set_xlabel("ranks P")
    ax.set_ylabel("MB per rank per step")
    ax.set_yscale("log")
    ax.set_title("Bytes per rank per step by exchange strategy")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main

def main(argv=None):
    a = parse_args(argv)
    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    title = f"{a.workload}, {a.np} ranks, " + ("unshaped loopback" if a.no_shape else f"loopback shaped to {a.rate}")

    if a.plot_only:
        with open(out / "results.json") as f:
            results = json.load(f)["runs"]
        (out / "table.md").write_text(make_table(results) + "\n\n" + make_profile_table(results) + "\n")
        plots(results, out, title)
        print((out / "table.md").read_text())
        return 0

    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise SystemExit(f"unknown method(s) {bad}; choose from {list(METHODS)}")

    ns = None
    if not a.no_shape:
        problems = Namespace.check()
        if problems:
            raise SystemExit("cannot shape the network: " + "; ".join(problems) +
                             ".\nRe-run as root with iproute2 installed, or pass --no-shape to "
                             "measure on the unshaped loopback (step-time ratios then reflect "
                             "loopback bandwidth, not a slow network).")
        ns = Namespace(a.rate, a.burst, a.latency)

    # make sure the namespace goes away on SIGTERM too
    def _term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, _term)

    ctx = ns if ns is not None else _Null()
    with ctx:
        if ns is not None:
            print(f"namespace {ns.name}: lo shaped with tbf rate {a.rate} burst {a.burst} "
                  f"latency {a.latency}", flush=True)
        if a.sweep:
            rows = sweep(a, ns, out)
            md = sweep_table(rows)
            (out / "sweep.md").write_text(md + "\n")
            sweep_plot(rows, out)
            print(md)
            return 0
        results = {}
        meta = {"args": vars(a), "title": title, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "cpu_count": os.cpu_count()}
        for m in methods:
            label, margs = METHODS[m]
            print(f"[bench] {label} ...", flush=True)
            extra = margs + ["--exchange", a.exchange, "--epochs", str(a.epochs),
                             "--target-acc", str(a.target_acc), "--eval-every", str(a.eval_every)]
            if a.max_steps:
                extra += ["--max-steps", str(a.max_steps)]
            res = run_train(a, ns, a.np, m, extra, out / "runs" / f"{m}.json",
                            out / "logs" / f"{m}.log")
            results[m] = res
            if "error" not in res:
                s = res["summary"]
                print(f"  step {s['median_step_s_slowest_rank'] * 1e3:.1f} ms, "
                      f"final acc {s['final_test_acc'] * 100:.2f}%, time to "
                      f"{a.target_acc * 100:.0f}%: {fmt(s['time_to_target_s'], '.1f', 'not reached')} s"
                      f", lo {fmt(s.get('lo_bytes_per_rank_step') and s['lo_bytes_per_rank_step'] / 1e6, '.3f')} MB/rank/step",
                      flush=True)
            with open(out / "results.json", "w") as f:
                json.dump({"meta": meta, "runs": results}, f, default=str)
        if ns is not None:
            meta["qdisc_after"] = ns.qdisc()
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    with open(out / "results.json", "w") as f:
        json.dump({"meta": meta, "runs": results}, f, default=str)
    table = make_table(results)
    prof = make_profile_table(results)
    (out / "table.md").write_text(f"{title}\n\n{table}\n\nPer-step profile (rank 0 medians)\n\n{prof}\n")
    files = plots(results, out, title)
    print(table)
    print()
    print(prof)
    print(f"\nwrote {out / 'results.json'}, {out / 'table.md'}" +
          "".join(f", {f}" for f in files))
    return 0


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    sys.exit(main())
