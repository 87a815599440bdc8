#!/usr/bin/env python
"""DDP side by side: the compression a torchrun user reaches for (DDP's fp16 hook,
PyTorch's PowerSGD hook) against hvdsparse's DDP hook, with Horovod dense and hvdsparse
under horovodrun for reference -- the same model, weights, data and steps for all.

Usage (root, ``ip``, ``tc``, ``unshare``, gcc; the script launches everything itself)::

    .venv/bin/python scripts/bench_ddp.py --np 4 --rate 1gbit --width 2048 --steps 150 \
        --out results/bench_ddp_per-node

``--topology per-node`` (default): ``scripts/netemu.py`` emulates ``--np`` nodes with one
full-duplex link each (tbf on both ends of every node's veth, a bridge between them).
The DDP methods run in ONE multi-node torchrun job -- one ``torchrun --nnodes P
--node-rank k`` agent per node namespace (``netemu.run_torchrun``), Gloo over the
shaped ``eth0`` -- and the Horovod references in one unmodified ``horovodrun -np P -H
node1:1,...`` launch each (netemu's ssh shim, the ``sched_yield`` shim on, as
``bench_network.py`` runs them). Time dilation (``--dilation``, default ``dilated``): P ranks
share this machine's C cores, so the link runs at ``rate * C / P`` (1 Gbit/s, 4 ranks, 2
cores -> 500 Mbit/s), which keeps the compute-to-network ratio of P nodes with a CPU
each. Before the methods the emulation is validated (``--validate on``): dense fp32
allreduce of the model's gradient size under torchrun (Gloo) against the ring model
2 (P-1)/P x size / rate. ``--topology localhost``: the old brief run, one torchrun on
the unshaped loopback (and horovodrun -H localhost:P for the references).

Methods (every one trains the MLP 64-W-W-10 on scikit-learn's digits from the same
initial weights, on the same per-rank batches, batch ``--batch`` per rank, SGD momentum
0.9, lr ``--lr``, ``--steps`` steps):

* ``dense``: DDP's default allreduce (fp32);
* ``fp16``: ``default_hooks.fp16_compress_hook``;
* ``powersgd-r1`` / ``powersgd-r4``: ``powerSGD_hook.powerSGD_hook`` with
  ``PowerSGDState(matrix_approximation_rank=r, start_powerSGD_iter=--powersgd-start)``
  (its other defaults: error feedback, warm start, min_compression_rate 2).
  Settings the peer needed here (torch 2.13, Gloo, CPU): one DDP bucket
  (``bucket_cap_mb`` above the model size) -- with DDP's default buckets it aborts with
  a Gloo "Received data size doesn't match expected size" (its allreduces are issued
  from future callbacks, whose order differs across ranks); ``batched_powerSGD_hook``
  fails an assertion in ``_orthogonalize`` (not run); its default warm-up
  (``start_powerSGD_iter=1000`` dense steps) is longer than the run, so
  ``--powersgd-start`` (default 10) is used;
* ``hvdsparse-topk``: ``hvdsparse.TopK(0.01)``; ``hvdsparse-threshold``:
  ``hvdsparse.Threshold(0.99)``; ``hvdsparse-adacomp``: ``hvdsparse.AdaComp()``, all
  through ``hvdsparse.ddp.hook`` with ``exchange="auto"`` and DDP's default buckets;
* ``horovod-dense``: ``hvd.DistributedOptimizer`` (fp32 allreduce) under horovodrun;
  ``horovod-topk``: ``hvdsparse.DistributedOptimizer(TopK(0.01), exchange="auto")``.

Reported per method: median step time (forward + backward + hook + optimizer step, the
slowest rank of each step, steps after ``--warmup``), CPU seconds per step (rank 0's
process CPU time, all its threads: shows whether a rank spins while it waits), bytes
per rank per step on the wire (each rank's own ``eth0`` tx counter over the method's
steps, mean over ranks: the kernel's count of what crossed the link) and by the
method's own accounting (ring model for dense / fp16 / PowerSGD, hvdsparse's
``stats()``), hvdsparse's compress / wait / decode seconds per step, time to target
accuracy (sum of the slowest rank's step times up to the first evaluation at or above
the target; target = ``--target-frac`` x DDP dense's final accuracy unless
``--target-acc`` is given) and final accuracy (last evaluation; also the mean of the
last three). JSON in ``<out>/results.json``, ``<out>/table.md``, ``<out>/step_time.png``,
``<out>/accuracy_vs_time.png``, the launches' logs in ``<out>/logs``.
"""
from __future__ import annotations

import argparse
import copy
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
sys.path.insert(0, str(ROOT / "scripts"))

DDP_METHODS = ("dense", "fp16", "powersgd-r1", "powersgd-r4", "hvdsparse-topk",
               "hvdsparse-threshold", "hvdsparse-adacomp")
HOROVOD_METHODS = ("horovod-dense", "horovod-topk")
LABELS = {
    "dense": "DDP dense allreduce (fp32)", "fp16": "DDP fp16_compress_hook",
    "powersgd-r1": "DDP PowerSGD rank 1", "powersgd-r4": "DDP PowerSGD rank 4",
    "hvdsparse-topk": "hvdsparse DDP hook, TopK 1%",
    "hvdsparse-threshold": "hvdsparse DDP hook, Threshold 99%",
    "hvdsparse-adacomp": "hvdsparse DDP hook, AdaComp",
    "horovod-dense": "Horovod dense allreduce (fp32)",
    "horovod-topk": "hvdsparse TopK 1% under Horovod",
}
CONFIG_ENV = "HVDSPARSE_BENCH_DDP_CONFIG"


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--topology", choices=("per-node", "localhost"), default="per-node")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--rate", default="1gbit", help="per-node link rate before dilation")
    ap.add_argument("--dilation", choices=("raw", "dilated"), default="dilated",
                    help="per-node: the link at --rate (raw) or at rate x cores / np")
    ap.add_argument("--cores", type=int, default=None,
                    help="cores for time dilation (default: the CPUs this process may use)")
    ap.add_argument("--burst", default="256kb")
    ap.add_argument("--latency", default="50ms")
    ap.add_argument("--validate", choices=("on", "off"), default="on")
    ap.add_argument("--yield-shim", choices=("on", "off"), default="on",
                    help="sched_yield -> 50 us sleep for the horovodrun launches")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=10, help="steps left out of the median")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--target-frac", type=float, default=0.98,
                    help="target accuracy = this x DDP dense's final accuracy")
    ap.add_argument("--target-acc", type=float, default=None,
                    help="a fixed target accuracy instead of --target-frac")
    ap.add_argument("--powersgd-start", type=int, default=10,
                    help="PowerSGD's start_powerSGD_iter (its default is 1000, longer "
                         "than the run)")
    ap.add_argument("--methods", default=None,
                    help="comma-separated subset of: " + ", ".join(DDP_METHODS +
                                                                   HOROVOD_METHODS) +
                    " (default: all for per-node, the DDP ones for localhost)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot-only", action="store_true",
                    help="re-draw table and plots from <out>/results.json")
    a = ap.parse_args(argv)
    if a.methods is None:
        a.methods = ",".join(DDP_METHODS + (HOROVOD_METHODS if a.topology == "per-node"
                                            else ()))
    bad = [m for m in a.methods.split(",") if m not in DDP_METHODS + HOROVOD_METHODS]
    if bad:
        ap.error(f"unknown method(s) {bad}; choose from {DDP_METHODS + HOROVOD_METHODS}")
    if a.out is None:
        a.out = str(ROOT / "results" / f"bench_ddp_{a.topology}_np{a.np}")
    return a


# ----------------------------------------------------------------------------- workers

def load_data(seed=0):
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0 - 0.5).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return (torch.from_numpy(xtr), torch.from_numpy(ytr).long(),
            torch.from_numpy(xte), torch.from_numpy(yte).long())


def powersgd_bytes(model, rank, P, compressing):
    """Bytes per rank of one PowerSGD step (ring allreduce model), following
    powerSGD_hook: tensors with ndim > 1 whose ``(n+m)*r*min_compression_rate < n*m``
    (2) send P (n x r) and Q (m x r); the rest are allreduced uncompressed."""
    ring = 2 * (P - 1) / P
    elems = 0
    for p in model.parameters():
        if compressing and p.ndim > 1:
            n, m = p.shape[0], p[0].numel()
            if (n + m) * rank * 2 < n * m:
                elems += (n + m) * min(rank, n, m)
                continue
        elems += p.numel()
    return ring * 4 * elems


def tx_bytes(iface):
    """tx byte counter of ``iface`` in this process's network namespace (None if absent)."""
    if not iface:
        return None
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                return int(rest.split()[8])
    return None


class TorchComm:
    def __init__(self):
        import torch.distributed as dist
        dist.init_process_group("gloo")
        self.dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def barrier(self):
        self.dist.barrier()

    def reduce(self, t, op):
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX if op == "max" else
                             self.dist.ReduceOp.SUM)
        return t

    def close(self):
        self.dist.destroy_process_group()


class HorovodComm:
    def __init__(self):
        import horovod.torch as hvd
        hvd.init()
        self.hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()
        self._n = 0

    def barrier(self):
        self.hvd.barrier()

    def reduce(self, t, op):
        self._n += 1
        return self.hvd.allreduce(t, op=self.hvd.Max if op == "max" else self.hvd.Sum,
                                  name=f"bench_ddp.reduce{self._n}")

    def close(self):
        pass


def build_method(method, net, comm, cfg):
    """(model to call, optimizer, hvdsparse stats source or None, settings text)."""
    import torch
    N = sum(p.numel() for p in net.parameters())
    opt = torch.optim.SGD(net.parameters(), lr=cfg["lr"], momentum=0.9)
    if method.startswith("horovod"):
        import horovod.torch as hvd
        if method == "horovod-dense":
            return net, hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters()), \
                None, "horovodrun --gloo, fp32 allreduce, Horovod's fusion"
        import hvdsparse
        dopt = hvdsparse.DistributedOptimizer(opt, named_parameters=net.named_parameters(),
                                              compression=hvdsparse.TopK(0.01),
                                              exchange="auto")
        mc = " + momentum correction" if dopt._local_update is not None else ""
        return net, dopt, dopt, f"horovodrun --gloo, TopK(0.01){mc}, exchange=auto"
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp_kw, settings = {}, "default buckets (25 MB)"
    if method.startswith("powersgd"):
        ddp_kw["bucket_cap_mb"] = max(25, 8 * N / 2 ** 20)   # one bucket (see docstring)
        settings = (f"one bucket (bucket_cap_mb={ddp_kw['bucket_cap_mb']:.0f}), "
                    f"start_powerSGD_iter={cfg['powersgd_start']}")
    model = DDP(net, **ddp_kw)
    src = None
    if method == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method.startswith("powersgd"):
        pstate = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(method.rsplit("r", 1)[1]),
            start_powerSGD_iter=cfg["powersgd_start"])
        model.register_comm_hook(pstate, powerSGD_hook.powerSGD_hook)
    elif method.startswith("hvdsparse"):
        import hvdsparse
        import hvdsparse.ddp
        label, comp = {"hvdsparse-topk": ("TopK(0.01)", hvdsparse.TopK(0.01)),
                       "hvdsparse-threshold": ("Threshold(0.99)", hvdsparse.Threshold(0.99)),
                       "hvdsparse-adacomp": ("AdaComp()", hvdsparse.AdaComp())}[method]
        # optimizer=: the hook resolves the optimizer-dependent defaults (momentum
        # correction, the Adam recipe) as the Horovod path does from the optimizer it wraps
        src = hvdsparse.ddp.State(comp, model.named_parameters(), exchange="auto",
                                  optimizer=opt)
        model.register_comm_hook(src, hvdsparse.ddp.hook)
        mc = " + momentum correction" if src.local_update is not None else ""
        settings = f"{label}{mc}, exchange=auto, default buckets"
    return model, opt, src, settings


def train_method(method, comm, cfg, data):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    xtr, ytr, xte, yte = data
    R, P, W = comm.rank, comm.size, cfg["width"]
    torch.manual_seed(0)                      # the same initial weights for every method
    net = nn.Sequential(nn.Linear(64, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(),
                        nn.Linear(W, 10))
    N = sum(p.numel() for p in net.parameters())
    model, opt, src, settings = build_method(method, net, comm, cfg)
    g = torch.Generator().manual_seed(1000 + R)    # the same batches for every method
    steps = cfg["steps"]
    times, cpu, acct, evals = [], [], [], []
    totals0 = copy.deepcopy(src.stats()["totals"]) if src is not None else None
    comm.barrier()
    tx0 = tx_bytes(cfg["iface"])
    for step in range(steps):
        idx = torch.randint(0, xtr.shape[0], (cfg["batch"],), generator=g)
        comm.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        opt.zero_grad()                       # torch >= 2: sets grads to None
        F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if method in ("dense", "horovod-dense"):
            acct.append(2 * (P - 1) / P * 4 * N)
        elif method == "fp16":
            acct.append(2 * (P - 1) / P * 2 * N)
        elif method.startswith("powersgd"):
            acct.append(powersgd_bytes(net, int(method.rsplit("r", 1)[1]), P,
                                       step >= cfg["powersgd_start"]))
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == steps:
            with torch.no_grad():
                evals.append((step + 1, float((net(xte).argmax(1) == yte).float().mean())))
    comm.barrier()
    tx1 = tx_bytes(cfg["iface"])
    prof = {}
    if src is not None:
        t1 = src.stats()["totals"]
        n = max(1, t1["steps"] - totals0["steps"])
        for k in ("bytes_sent_total", "time_compress_s", "time_wait_s", "time_decode_s"):
            prof[k] = (t1[k] - totals0[k]) / n
        prof["strategy_counts"] = {k: v - totals0["strategy_counts"].get(k, 0)
                                   for k, v in t1["strategy_counts"].items()}
    slowest = comm.reduce(torch.tensor(times, dtype=torch.float64), "max").tolist()
    cpu_max = comm.reduce(torch.tensor(cpu, dtype=torch.float64), "max").tolist()
    wire = torch.zeros(P, dtype=torch.float64)
    if tx0 is not None and tx1 is not None:
        wire[R] = (tx1 - tx0) / steps
    wire = comm.reduce(wire, "sum").tolist()
    return dict(method=method, label=LABELS[method], settings=settings, parameters=N,
                step_s_slowest=slowest, cpu_s_rank0=cpu, cpu_s_max=cpu_max,
                wire_bytes_per_step_by_rank=wire if tx0 is not None else None,
                accounted_bytes_per_step=(statistics.mean(acct) if acct else
                                          prof.get("bytes_sent_total")),
                hvdsparse_profile=prof or None, evals=evals)


def worker():
    cfg = json.loads(Path(os.environ[CONFIG_ENV]).read_text())
    import torch
    comm = HorovodComm() if cfg["role"] == "horovod" else TorchComm()
    torch.set_num_threads(1)
    data = load_data(0)
    results = {}
    for method in cfg["methods"]:
        results[method] = train_method(method, comm, cfg, data)
        r = results[method]
        if comm.rank == 0:
            med = statistics.median(r["step_s_slowest"][cfg["warmup"]:])
            print(f"[bench_ddp] {method}: {med * 1e3:.1f} ms/step, acc "
                  f"{100 * r['evals'][-1][1]:.2f}%", flush=True)
        import gc
        gc.collect()
    if comm.rank == 0:
        Path(cfg["result"]).write_text(json.dumps(dict(
            results=results, hostname=os.uname().nodename, loadavg=os.getloadavg(),
            torch=torch.__version__), indent=1))
    comm.close()


# ----------------------------------------------------------------------------- launches

def worker_env(cfg_path, base=None):
    env = dict(os.environ if base is None else base)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)
    env.pop("LD_PRELOAD", None)
    env[CONFIG_ENV] = str(cfg_path)
    return env


def write_config(a, out, name, role, methods, iface):
    cfg = dict(role=role, methods=methods, width=a.width, steps=a.steps, batch=a.batch,
               lr=a.lr, eval_every=a.eval_every, powersgd_start=a.powersgd_start,
               warmup=a.warmup, iface=iface, result=str(out / "runs" / f"{name}.json"))
    path = out / "runs" / f"{name}.config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path, Path(cfg["result"])


def launch_ddp(a, out, net, methods):
    import netemu
    cfg, res = write_config(a, out, "ddp", "ddp", methods, "eth0" if net else None)
    env = worker_env(cfg)
    log = out / "logs" / "ddp.log"
    t0 = time.time()
    if net is not None:
        rc = netemu.run_torchrun(net, [__file__], env=env, timeout=a.timeout, log=log)
    else:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [netemu.torchrun_exe(), "--nproc-per-node", str(a.np), "--master-addr",
               "127.0.0.1", "--master-port", str(port), __file__]
        with open(log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            try:
                rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=a.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = 124
    return _collect(rc, res, log, time.time() - t0)


def launch_horovod(a, out, net, method, shim):
    import netemu
    cfg, res = write_config(a, out, method, "horovod", [method], "eth0" if net else None)
    hosts = net.hosts_arg(1) if net is not None else f"localhost:{a.np}"
    cmd = [netemu.horovodrun_exe(), "-np", str(a.np), "-H", hosts, "--gloo",
           sys.executable, __file__]
    env = worker_env(cfg, net.env() if net is not None else None)
    if shim:
        env["LD_PRELOAD"] = shim
    if net is not None:
        cmd = net.launcher_cmd(cmd)
    log = out / "logs" / f"{method}.log"
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                cwd=str(ROOT), timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    if rc != 0 and net is not None:
        net.kill_all()
    return _collect(rc, res, log, time.time() - t0)


def _collect(rc, res, log, wall):
    if rc != 0 or not res.exists():
        tail = Path(log).read_text()[-2500:]
        print(f"  !! launch failed (rc={rc}); log tail:\n{tail}", file=sys.stderr, flush=True)
        return {"error": f"rc={rc}", "log": str(log), "launch_wall_s": wall}
    d = json.loads(res.read_text())
    d["launch_wall_s"] = wall
    return d


# ----------------------------------------------------------------------------- report

def summarize(results, a):
    """Per-method figures and the target (fraction of DDP dense's final accuracy)."""
    base = results.get("dense") or results.get("horovod-dense")
    target = a.target_acc
    if target is None and base:
        target = a.target_frac * base["evals"][-1][1]
    rows = {}
    for m, r in results.items():
        if "error" in r:
            rows[m] = r
            continue
        st = r["step_s_slowest"]
        cum, t = [], 0.0
        for s in st:
            t += s
            cum.append(t)
        hit = next(((s, cum[s - 1]) for s, acc in r["evals"] if target and acc >= target),
                   (None, None))
        wire = r.get("wire_bytes_per_step_by_rank")
        prof = r.get("hvdsparse_profile") or {}
        rows[m] = dict(
            label=r["label"], settings=r["settings"],
            median_step_s=statistics.median(st[a.warmup:] or st),
            cpu_s_per_step=statistics.median(r["cpu_s_rank0"][a.warmup:] or r["cpu_s_rank0"]),
            wire_bytes=statistics.mean(wire) if wire else None,
            accounted_bytes=r["accounted_bytes_per_step"],
            steps_to_target=hit[0], seconds_to_target=hit[1],
            final_acc=r["evals"][-1][1],
            final_acc_mean3=statistics.mean(acc for _, acc in r["evals"][-3:]),
            best_acc=max(acc for _, acc in r["evals"]),
            compress_s=prof.get("time_compress_s"), wait_s=prof.get("time_wait_s"),
            decode_s=prof.get("time_decode_s"), strategies=prof.get("strategy_counts"))
    return rows, target


def fmt(v, spec, none="-"):
    return none if v is None else format(v, spec)


def make_table(rows, target):
    base = rows.get("dense") if "error" not in rows.get("dense", {"error": 1}) else None
    md = ["| method | median step (ms) | vs DDP dense | CPU s/step (rank 0) "
          "| MB/rank/step on the wire | MB/rank/step (accounting) | compression vs dense "
          f"| steps to {fmt(target and 100 * target, '.1f')}% | s to target | vs DDP dense "
          "to target | final acc (%) | mean of last 3 (%) | vs dense (pp, last 3) "
          "| settings the method needed |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for m, r in rows.items():
        if "error" in r:
            md.append(f"| {LABELS[m]} | failed ({r['error']}, see {r['log']}) |" + " |" * 12)
            continue
        sp = base and base["median_step_s"] / r["median_step_s"]
        key = "wire_bytes" if base and base["wire_bytes"] else "accounted_bytes"
        cr = base and r[key] and base[key] and base[key] / r[key]   # wire count if there
        tt = base and base["seconds_to_target"] and r["seconds_to_target"] and \
            base["seconds_to_target"] / r["seconds_to_target"]
        dacc = base and 100 * (r["final_acc_mean3"] - base["final_acc_mean3"])
        md.append(
            f"| {r['label']} | {1e3 * r['median_step_s']:.1f} | {fmt(sp, '.2f')}x "
            f"| {r['cpu_s_per_step']:.3f} | {fmt(r['wire_bytes'] and r['wire_bytes'] / 1e6, '.3f')} "
            f"| {fmt(r['accounted_bytes'] and r['accounted_bytes'] / 1e6, '.3f')} "
            f"| {fmt(cr, '.1f')}x | {fmt(r['steps_to_target'], 'd')} "
            f"| {fmt(r['seconds_to_target'], '.1f', 'not reached')} | {fmt(tt, '.2f')}x "
            f"| {100 * r['final_acc']:.2f} | {100 * r['final_acc_mean3']:.2f} "
            f"| {fmt(dacc, '+.2f')} | {r['settings']} |")
    prof = ["| method | compress ms/step | exchange wait ms/step | decode ms/step "
            "| strategies (bucket-steps) |", "|---|---:|---:|---:|---|"]
    for m, r in rows.items():
        if "error" in r or r.get("compress_s") is None:
            continue
        prof.append(f"| {r['label']} | {1e3 * r['compress_s']:.1f} | {1e3 * r['wait_s']:.1f} "
                    f"| {1e3 * r['decode_s']:.1f} | {r['strategies']} |")
    return "\n".join(md), "\n".join(prof)


def plots(rows, results, target, out, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plots", file=sys.stderr)
        return []
    ok = [m for m, r in rows.items() if "error" not in r]
    if not ok:
        return []
    labels = [rows[m]["label"] for m in ok]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    step = [1e3 * rows[m]["median_step_s"] for m in ok]
    cpu = [1e3 * rows[m]["cpu_s_per_step"] for m in ok]
    y = range(len(ok))
    ax.barh([i - 0.2 for i in y], step, height=0.4, label="median step (slowest rank)")
    ax.barh([i + 0.2 for i in y], cpu, height=0.4, label="CPU time per step (rank 0)")
    for i, v in enumerate(step):
        ax.text(v, i - 0.2, f" {v:.0f} ms", va="center", fontsize=8)
    ax.set_yticks(list(y))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(f"Step time - {title}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    files = [out / "step_time.png"]
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 5))
    for m in ok:
        st = results[m]["step_s_slowest"]
        cum = [sum(st[:s]) for s, _ in results[m]["evals"]]
        ax.plot(cum, [100 * acc for _, acc in results[m]["evals"]], marker=".",
                label=rows[m]["label"], ls="--" if m.startswith("horovod") else "-")
    if target:
        ax.axhline(100 * target, color="gray", lw=1, ls=":",
                   label=f"target {100 * target:.1f}%")
    ax.set_xlabel("training time (s, sum of the slowest rank's steps; evaluation excluded)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_ylim(bottom=60)
    ax.set_title(f"Accuracy vs time - {title}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    files.append(out / "accuracy_vs_time.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files


def report(a, out, meta, validation, results):
    import netemu
    rows, target = summarize(results, a)
    table, prof = make_table(rows, target)
    parts = [meta["title"],
             f"load average at start {meta.get('loadavg_start')}, at end "
             f"{meta.get('loadavg_end')}; target accuracy "
             f"{fmt(target and 100 * target, '.2f')}% "
             + (f"({a.target_frac} x DDP dense's final accuracy)" if a.target_acc is None
                else "(fixed)")]
    if validation:
        parts += ["Emulation check (measured vs model)", netemu.validation_table(validation)]
    parts += [table, "hvdsparse per-step profile (rank 0, mean over the steps)", prof]
    (out / "table.md").write_text("\n\n".join(parts) + "\n")
    (out / "results.json").write_text(json.dumps(dict(
        meta=meta, validation=validation, target_acc=target, summary=rows, runs=results),
        default=str))
    files = plots(rows, results, target, out, meta["title"])
    print("\n\n".join(parts))
    print(f"\nwrote {out / 'results.json'}, {out / 'table.md'}" +
          "".join(f", {f}" for f in files), flush=True)


def loadavg():
    return list(os.getloadavg())


def main(argv=None):
    import netemu
    a = parse(argv)
    out = Path(a.out)
    if a.plot_only:
        d = json.loads((out / "results.json").read_text())
        return report(a, out, d["meta"], d["validation"], d["runs"])
    for sub in ("runs", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    methods = a.methods.split(",")
    ddp = [m for m in methods if m in DDP_METHODS]
    hvd_methods = [m for m in methods if m in HOROVOD_METHODS]
    per_node = a.topology == "per-node"
    cores = a.cores or netemu.usable_cores()
    rate = (netemu.dilated_rate(a.rate, a.np, cores) if a.dilation == "dilated" else a.rate) \
        if per_node else None
    where = (f"per-node links, {a.np} nodes x 1 rank, {rate} each "
             f"({a.dilation}{f': {a.rate} x {cores} cores / {a.np} ranks' if a.dilation == 'dilated' else ''})"
             if per_node else "unshaped localhost")
    title = f"MLP 64-{a.width}-{a.width}-10, P={a.np}, {where}"
    meta = dict(args=vars(a), title=title, started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                cores_for_dilation=cores, rate=rate, loadavg_start=loadavg(),
                cpu_count=os.cpu_count())
    print(f"[bench_ddp] {title}", flush=True)
    validation, results = [], {}

    def _term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGHUP, _term)
    if per_node:
        problems = netemu.check_environment(need_gcc=a.yield_shim == "on" and bool(hvd_methods))
        if problems:
            raise SystemExit("cannot emulate the network: " + "; ".join(problems) +
                             " (or pass --topology localhost)")
        netemu.cleanup_stale()
    with tempfile.TemporaryDirectory(prefix="bench_ddp") as td:
        shim = None
        if hvd_methods and a.yield_shim == "on":
            if shutil.which("gcc") is None:
                raise SystemExit("--yield-shim on needs gcc (or pass --yield-shim off)")
            shim = netemu.build_yield_shim(td)
        ctx = netemu.PerNodeNetwork(a.np, rate, a.burst, a.latency) if per_node else None
        with (ctx or _Null()) as net:
            if net is not None:
                print(f"[bench_ddp] {net.describe()}", flush=True)
                if a.validate == "on":
                    grad_mb = 4 * (a.width * a.width + 76 * a.width + 10) / 1e6
                    validation = netemu.validate(net, a.np, ar_mb=grad_mb, shims=(shim,),
                                                 logdir=out / "logs", torchrun=True)
                    print(netemu.validation_table(validation), flush=True)
            if ddp:
                print(f"[bench_ddp] torchrun: {', '.join(ddp)} ...", flush=True)
                d = launch_ddp(a, out, net, ddp)
                meta["ddp_launch"] = {k: v for k, v in d.items() if k != "results"}
                for m in ddp:
                    results[m] = d["results"][m] if "results" in d else d
            for m in hvd_methods:
                print(f"[bench_ddp] horovodrun: {m} ...", flush=True)
                d = launch_horovod(a, out, net, m, shim)
                meta[f"{m}_launch"] = {k: v for k, v in d.items() if k != "results"}
                results[m] = d["results"][m] if "results" in d else d
            if net is not None:
                meta["qdisc_after"] = net.qdisc_stats()
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    meta["loadavg_end"] = loadavg()
    meta["yield_shim"] = "horovodrun launches only" if shim else "off"
    report(a, out, meta, validation, results)
    return 0


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    if CONFIG_ENV in os.environ and ("LOCAL_RANK" in os.environ or
                                     "HOROVOD_RANK" in os.environ):
        worker()
    else:
        sys.exit(main())
