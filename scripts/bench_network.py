#!/usr/bin/env python
"""Shaped-network benchmark: dense allreduce vs Horovod fp16 vs hvdsparse compressors.

Every method runs ``scripts/train.py`` under ``horovodrun`` on an emulated network, back
to back, so their figures are side by side. Two topologies:

``--topology per-node`` (default, the headline tables): ``scripts/netemu.py`` gives every
emulated node its own network namespace and its own full-duplex link (tbf ``--rate`` on
both ends of its veth), joined by a bridge; the job is launched with an unmodified
``horovodrun -np P -H node1:s,...`` whose ``ssh`` is a shim running each command in
that node's namespace under the node's hostname. This is a cluster of P hosts with one
``--rate`` NIC each. Before the methods, the benchmark validates the emulation: a
point-to-point transfer (one way, then both ways at once) and a dense Horovod allreduce
against the ring model 2 (P-1)/P x size / rate, with and without the ``sched_yield``
shim (see below).

``--topology shared``: all ranks on localhost in one namespace whose loopback is shaped
(``tc qdisc add dev lo root tbf rate RATE ...``): the rate is the *aggregate* bandwidth
of the whole job (N hosts behind one uplink). Kept for comparison with older results;
it favours compression by up to a factor P.

Time dilation (``--dilation``): P ranks share this machine's C cores, so with P > C
every CPU-side cost (compute, compression, decoding) is P/C times slower than on P
nodes with a CPU each. Running the link at ``rate * C / P`` keeps the compute-to-network
ratio of the real cluster. ``both`` (the default for per-node) runs every method at the
raw and at the dilated rate; the headline is the dilated one.

``sched_yield`` shim (``--yield-shim``, default on): Horovod's torch binding waits for a
collective by spinning on ``sched_yield``; on an oversubscribed CPU the waiting ranks
take CPU from the ranks still computing. The shim (an ``LD_PRELOAD`` library built with
gcc at start) turns the spin into 50 us sleeps. The validation measures the dense
allreduce with and without it.

Wire bytes come from two sources: the optimizer's own accounting (train.py's
``bytes_sent_per_rank_step``) and a kernel byte counter: rank 0's own ``eth0`` tx bytes
(per-node) or the shaped loopback's tx bytes / ranks (shared), per step.

Needs root plus ``ip``, ``tc``, ``unshare`` (and gcc for the shim); ``--no-shape`` runs
the same measurements on the host's unshaped loopback.

Examples::

    python scripts/bench_network.py --np 4 --rate 1gbit --methods dense,topk1,threshold99
    python scripts/bench_network.py --np 4 --validate-only          # emulation check only
    python scripts/bench_network.py --topology shared --np 4        # one shared loopback
    python scripts/bench_network.py --np 4 --methods dense,topk1 --no-shape
    python scripts/bench_network.py --sweep --sweep-np 2,4,8       # exchange sweep

Outputs in ``--out`` (default results/bench_<topology>_<rate>_np<N>): ``results.json``
(every figure, every run's full train.py JSON, the validation), ``table.md``,
``step_time.png``, ``accuracy_vs_time.png``, ``logs/<rate>/<method>.log``; with
``--sweep`` also ``sweep.json``, ``sweep.md``, ``sweep.png``.
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
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "scripts" / "train.py"
sys.path.insert(0, str(ROOT / "scripts"))
import netemu  # noqa: E402  (scripts/netemu.py: per-node emulation)

# name -> (label, train.py arguments)
METHODS = {
    "dense": ("dense allreduce (fp32)", ["--compression", "none"]),
    "fp16": ("Horovod fp16 allreduce", ["--compression", "fp16"]),
    "topk1": ("TopK 1%", ["--compression", "topk", "--ratio", "0.01"]),
    # the output layer (4.weight, 20 K of 4.35 M elements) at 10%
    "topk1_head": ("TopK 1%, output layer 10%", ["--compression", "topk", "--ratio", "0.01",
                                                 "--override", "4.weight:ratio=0.1"]),
    # DGC's 4-stage exponential density warm-up over the first 20 steps
    "topk1_warmup": ("TopK 1%, warm-up exp(20, 4 stages)", ["--compression", "topk",
                                                            "--ratio", "0.01",
                                                            "--warmup", "exp,20,4"]),
    # DGC's momentum-factor masking on / off explicitly
    "topk1_mask": ("TopK 1%, momentum masking on", ["--compression", "topk", "--ratio",
                                                     "0.01", "--momentum-masking"]),
    "topk1_nomask": ("TopK 1%, momentum masking off", ["--compression", "topk", "--ratio",
                                                        "0.01", "--no-momentum-masking"]),
    "threshold99": ("Threshold 99%", ["--compression", "threshold", "--sparsity", "0.99"]),
    "adacomp": ("AdaComp", ["--compression", "adacomp"]),
    "slimdp": ("Slim-DP (alpha 0.2, beta 0.1)", ["--compression", "slimdp", "--alpha", "0.2",
                                                "--beta", "0.1"]),
    "qsgd4": ("QSGD 4-bit", ["--compression", "qsgd", "--bits", "4"]),
    "topk1_int4": ("TopK 1% + int4", ["--compression", "topk", "--ratio", "0.01",
                                      "--values", "int4"]),
    # TopK 1% with bf16 values (the rounding error stays in the residual)
    "topk1_bf16": ("TopK 1% + bf16 values", ["--compression", "topk", "--ratio", "0.01",
                                             "--values", "bf16"]),
    # not in the default list: denser TopK, fewer steps to the target
    "topk5": ("TopK 5%", ["--compression", "topk", "--ratio", "0.05"]),
    "topk5_int4": ("TopK 5% + int4", ["--compression", "topk", "--ratio", "0.05",
                                      "--values", "int4"]),
}
# the same method on another code path of the same tree (environment for every rank)
METHODS["topk1_numpy"] = ("TopK 1%, per-layer numpy path (HVDSPARSE_NATIVE=0)",
                          METHODS["topk1"][1])
METHODS["threshold99_numpy"] = ("Threshold 99%, per-layer numpy path (HVDSPARSE_NATIVE=0)",
                                METHODS["threshold99"][1])
METHODS["adacomp_numpy"] = ("AdaComp, numpy CPU path (HVDSPARSE_NATIVE=0)",
                             METHODS["adacomp"][1])
METHOD_ENV = {m: {"HVDSPARSE_NATIVE": "0"} for m in METHODS if m.endswith("_numpy")}
# the wire before index narrowing: int32 absolute indices (hvdsparse.payload.NARROW_INDICES)
for _m in ("topk1", "threshold99"):
    METHODS[_m + "_int32idx"] = (METHODS[_m][0] + ", int32 indices on the wire",
                                 METHODS[_m][1])
    METHOD_ENV[_m + "_int32idx"] = {"HVDSPARSE_NARROW_INDICES": "0"}
# the same method with one exchange forced (instead of --exchange): what `auto` chose
# against the alternative, side by side in one launch
METHOD_EXCHANGE = {}
for _m in ("topk1", "threshold99"):
    for _ex in ("allgather", "split"):
        METHODS[f"{_m}_{_ex}"] = (f"{METHODS[_m][0]}, exchange={_ex}", METHODS[_m][1])
        METHOD_EXCHANGE[f"{_m}_{_ex}"] = _ex
DEFAULT_METHODS = [m for m in METHODS if not m.startswith("topk5") and m != "topk1_warmup"
                   and m not in METHOD_ENV and m not in METHOD_EXCHANGE
                   and m not in ("topk1_mask", "topk1_nomask",
                                                         "topk1_bf16")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rate", default="1gbit", help="tbf rate: 1gbit, 10gbit, 100mbit, ...")
    p.add_argument("--burst", default="256kb")
    p.add_argument("--latency", default="50ms")
    p.add_argument("--np", type=int, default=4, help="ranks")
    p.add_argument("--topology", choices=("per-node", "shared"), default="per-node",
                   help="per-node: a namespace and a --rate link per emulated node; shared: "
                        "all ranks behind one shaped loopback")
    p.add_argument("--slots", type=int, default=1,
                   help="per-node: ranks per emulated node (nodes = np / slots)")
    p.add_argument("--dilation", choices=("raw", "dilated", "both"), default=None,
                   help="link rate as given (raw), scaled by cores/np (dilated), or both; "
                        "default both for per-node, raw for shared")
    p.add_argument("--cores", type=int, default=None,
                   help="cores for time dilation (default: the CPUs this process may use)")
    p.add_argument("--yield-shim", choices=("on", "off", "both"), default="on",
                   help="LD_PRELOAD sched_yield -> 50 us nanosleep for every rank; both: "
                        "every method with and without it, side by side")
    p.add_argument("--validate", choices=("on", "off"), default="on",
                   help="per-node: point-to-point and dense allreduce vs the ring model first")
    p.add_argument("--validate-only", action="store_true",
                   help="per-node: only the validation, no training runs")
    p.add_argument("--ar-mb", type=float, default=17.4,
                   help="validation allreduce size in MB (17.4 = the wide MLP's gradient)")
    p.add_argument("--p2p-mb", type=float, default=25.0)
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
    if a.dilation is None:
        a.dilation = "both" if a.topology == "per-node" and not a.no_shape else "raw"
    if a.cores is None:
        a.cores = netemu.usable_cores()
    if a.np % a.slots:
        p.error(f"--np {a.np} is not a multiple of --slots {a.slots}")
    if a.out is None:
        tag = "unshaped" if a.no_shape else f"{a.topology}_{a.rate}"
        a.out = str(ROOT / "results" / (f"sweep_{tag}" if a.sweep else f"bench_{tag}_np{a.np}"))
    return a


def rates_for(a, ranks):
    """[(tag, tc rate)] to run: the raw rate and/or the time-dilated one."""
    out = []
    if a.dilation in ("raw", "both"):
        out.append(("raw", a.rate))
    if a.dilation in ("dilated", "both"):
        out.append(("dilated", netemu.dilated_rate(a.rate, ranks, a.cores)))
    return out


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


def run_train(a, ns, np_, name, extra, json_path, log_path, shim=None, env_extra=None):
    """One train.py launch. ``ns``: a shared-loopback :class:`Namespace`, a
    :class:`netemu.PerNodeNetwork`, or None (host loopback)."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    per_node = isinstance(ns, netemu.PerNodeNetwork)
    hosts = ns.hosts_arg(a.slots) if per_node else f"localhost:{np_}"
    if per_node and np_ != a.slots * ns.nodes:
        hosts = ",".join(f"{h}:{a.slots}" for h in ns.hostnames[:np_ // a.slots])
    train = [horovodrun(), "-np", str(np_), "-H", hosts, "--gloo",
             sys.executable, str(TRAIN), "--workload", a.workload, "--seed", str(a.seed),
             "--no-progress", "--profile", "--json", str(json_path)] + extra + a.train_args.split()
    if per_node:
        cmd = ns.launcher_cmd(train + ["--measure-iface", netemu.IFACE])
        env = ns.env()
    else:
        cmd = (ns.prefix() if ns else []) + train + (["--measure-lo"] if ns else [])
        env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if shim:
        env["LD_PRELOAD"] = shim
    env["OMP_NUM_THREADS"] = str(a.omp_threads)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)
    env.update(env_extra or {})
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
    if rc != 0 and per_node:
        ns.kill_all()               # workers left behind in the node namespaces
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


def wire_of(summary):
    """Kernel-counted link bytes per rank per step (train.py's per-node eth0 tx or
    shared loopback tx / ranks; older results only have the loopback figure)."""
    v = summary.get("wire_bytes_per_rank_step")
    return v if v is not None else summary.get("lo_bytes_per_rank_step")


def make_table(results, base="dense"):
    s_base = results.get(base, {}).get("summary") if base in results else None
    rows = ["| method | median step (ms) | speed-up/step vs dense | MB sent/rank/step (optimizer) "
            "| MB/rank/step on the wire (kernel counter) | compression vs dense | time to target (s) "
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
        lo = wire_of(s)
        sent = s.get("bytes_sent_per_rank_step")
        comp = (wire_of(s_base) / lo) if (s_base and lo and wire_of(s_base)) \
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


def sweep(a, ns, out, shim=None):
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
                            out / "runs" / f"{name}.json", out / "logs" / f"{name}.log",
                            shim=shim)
            row = {"np": np_, "exchange": ex}
            if "error" in res:
                row["error"] = res["error"]
            else:
                s = res["summary"]
                row.update(bytes_received=s.get("bytes_received_per_rank_step"),
                           bytes_sent=s.get("bytes_sent_per_rank_step"),
                           lo_bytes=wire_of(s),
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
          "| MB/rank/step on the wire (kernel counter) | median step (ms) |", "|---:|---|---|---:|---:|---:|---:|"]
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

def run_methods(a, net, methods, out, tag, shim):
    """Every method back to back on one network; returns {method: train.py result}."""
    results = {}
    for m in methods:
        label, margs = METHODS[m]
        print(f"[bench] {tag}: {label} ...", flush=True)
        extra = margs + ["--exchange", METHOD_EXCHANGE.get(m, a.exchange), "--epochs", str(a.epochs),
                         "--target-acc", str(a.target_acc), "--eval-every", str(a.eval_every)]
        if a.max_steps:
            extra += ["--max-steps", str(a.max_steps)]
        res = run_train(a, net, a.np, m, extra, out / "runs" / tag / f"{m}.json",
                        out / "logs" / tag / f"{m}.log", shim=shim,
                        env_extra=METHOD_ENV.get(m))
        results[m] = res
        if "error" not in res:
            s = res["summary"]
            w = wire_of(s)
            print(f"  step {s['median_step_s_slowest_rank'] * 1e3:.1f} ms, "
                  f"final acc {s['final_test_acc'] * 100:.2f}%, time to "
                  f"{a.target_acc * 100:.0f}%: {fmt(s['time_to_target_s'], '.1f', 'not reached')} s"
                  f", wire {fmt(w and w / 1e6, '.3f')} MB/rank/step", flush=True)
    return results


def uptime():
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return None


def write_results(out, meta, validation, by_rate):
    headline = "dilated" if "dilated" in by_rate else next(iter(by_rate), None)
    with open(out / "results.json", "w") as f:
        json.dump({"meta": meta, "validation": validation, "runs_by_rate": by_rate,
                   "headline": headline, "runs": by_rate.get(headline, {})}, f, default=str)
    return headline


def main(argv=None):
    a = parse_args(argv)
    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    per_node = a.topology == "per-node" and not a.no_shape
    where = ("unshaped loopback" if a.no_shape else
             f"per-node links ({a.np // a.slots} nodes x {a.slots} rank(s))" if per_node else
             "one shared shaped loopback")
    title = f"{a.workload}, {a.np} ranks, {where}"

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

    if not a.no_shape:
        problems = (netemu.check_environment(need_gcc=a.yield_shim != "off") if per_node
                    else Namespace.check())
        if problems:
            raise SystemExit("cannot shape the network: " + "; ".join(problems) +
                             ".\nRe-run as root with iproute2 installed, or pass --no-shape to "
                             "measure on the unshaped loopback (step-time ratios then reflect "
                             "loopback bandwidth, not a slow network).")

    # networks go away on SIGTERM / SIGHUP too (KeyboardInterrupt unwinds the with blocks)
    def _term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGHUP, _term)

    ranks = max(int(x) for x in a.sweep_np.split(",")) if a.sweep else a.np
    rates = [("unshaped", None)] if a.no_shape else rates_for(a, ranks)
    meta = {"args": vars(a), "title": title, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cpu_count": os.cpu_count(), "cores_for_dilation": a.cores,
            "rates": dict(rates), "loadavg_start": uptime(),
            "yield_shim": a.yield_shim, "topology": "unshaped" if a.no_shape else a.topology}
    validation, by_rate = [], {}
    if per_node:
        netemu.cleanup_stale()
    with tempfile.TemporaryDirectory(prefix="hvdbench") as td:
        shim = netemu.build_yield_shim(td) if (a.yield_shim != "off" or (per_node and a.validate == "on")) \
            and shutil.which("gcc") else None
        if a.yield_shim != "off" and shim is None:
            raise SystemExit(f"--yield-shim {a.yield_shim} needs gcc (or pass --yield-shim off)")
        run_shim = shim if a.yield_shim != "off" else None
        for tag, rate in rates:
            if per_node:
                ctx = netemu.PerNodeNetwork(ranks // a.slots, rate, a.burst, a.latency)
            elif rate is not None:
                ctx = Namespace(rate, a.burst, a.latency)
            else:
                ctx = _Null()
            with ctx as net:
                if per_node:
                    print(f"[bench] {tag} ({rate}): {net.describe()}", flush=True)
                elif net is not None:
                    print(f"[bench] {tag}: namespace {net.name}: lo shaped with tbf rate {rate} "
                          f"burst {a.burst} latency {a.latency}", flush=True)
                if per_node and (a.validate == "on" or a.validate_only):
                    shims = [None] + ([shim] if shim else [])
                    rows = netemu.validate(net, ranks // a.slots if a.slots > 1 else ranks,
                                           p2p_mb=a.p2p_mb, ar_mb=a.ar_mb, shims=shims,
                                           logdir=out / "logs")
                    for r in rows:
                        r["tag"] = tag
                    validation += rows
                    print(netemu.validation_table(rows), flush=True)
                    write_results(out, meta, validation, by_rate)
                if a.validate_only:
                    continue
                if a.sweep:
                    sub = out / tag if len(rates) > 1 else out
                    (sub / "runs").mkdir(parents=True, exist_ok=True)
                    (sub / "logs").mkdir(parents=True, exist_ok=True)
                    rows = sweep(a, net, sub, shim=run_shim)
                    md = sweep_table(rows)
                    (sub / "sweep.md").write_text(md + "\n")
                    sweep_plot(rows, sub)
                    print(md)
                    continue
                by_rate[tag] = run_methods(a, net, methods, out, tag, run_shim)
                if a.yield_shim == "both":
                    by_rate[tag + "-noshim"] = run_methods(a, net, methods, out,
                                                           tag + "-noshim", None)
                if per_node:
                    meta.setdefault("qdisc_after", {})[tag] = net.qdisc_stats()
                elif net is not None:
                    meta.setdefault("qdisc_after", {})[tag] = net.qdisc()
                write_results(out, meta, validation, by_rate)
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    meta["loadavg_end"] = uptime()
    headline = write_results(out, meta, validation, by_rate)
    parts = [title, f"load average at start {meta['loadavg_start']}, at end {meta['loadavg_end']}"]
    if validation:
        parts += ["Emulation check (measured vs model)", netemu.validation_table(validation)]
    for tag, results in by_rate.items():
        base_tag, noshim = tag.split("-noshim")[0], tag.endswith("-noshim")
        rate = dict(rates)[base_tag]
        shim_note = (", without the sched_yield shim" if noshim else
                     ", with the sched_yield shim" if run_shim else "")
        parts += [f"{base_tag} link rate ({rate}){shim_note}" +
                  (" -- headline" if tag == headline and len(by_rate) > 1 else ""),
                  make_table(results), "Per-step profile (rank 0 medians)",
                  make_profile_table(results)]
    (out / "table.md").write_text("\n\n".join(parts) + "\n")
    files = []
    if headline:
        files = plots(by_rate[headline], out, f"{title}, {headline} {dict(rates)[headline]}")
    print("\n\n".join(parts[1:]))
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
