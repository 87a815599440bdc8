"""DDP side by side: the compression a torchrun user reaches for (DDP's fp16 hook,
PyTorch's PowerSGD hook) against hvdsparse's DDP hook, in one torchrun launch.

Usage (the script launches torchrun itself unless it is already running under it)::

    .venv/bin/python scripts/bench_ddp.py --np 2 --width 512 --steps 60 \
        --out results/bench_ddp

Methods (every one trains the same MLP 64-W-W-10 on scikit-learn's digits from the same
initial weights, batch ``--batch`` per rank, SGD momentum 0.9):

* ``dense``: DDP's default allreduce (fp32);
* ``fp16``: ``default_hooks.fp16_compress_hook``;
* ``powersgd-r1`` / ``powersgd-r4``: ``powerSGD_hook.powerSGD_hook`` with
  ``PowerSGDState(matrix_approximation_rank=r, start_powerSGD_iter=--powersgd-start)``.
  Settings the peer needed here (torch 2.13, Gloo, CPU): one DDP bucket
  (``bucket_cap_mb`` above the model size) -- with DDP's default buckets it aborts with
  a Gloo "Received data size doesn't match expected size" (its allreduces are issued
  from future callbacks, whose order differs across ranks); ``batched_powerSGD_hook``
  fails an assertion in ``_orthogonalize`` (not run);
* ``hvdsparse-topk``: ``hvdsparse.TopK(0.01)``; ``hvdsparse-threshold``:
  ``hvdsparse.Threshold(0.99)``; ``hvdsparse-adacomp``: ``hvdsparse.AdaComp()``, all
  through ``hvdsparse.ddp.hook`` with ``exchange="auto"`` and DDP's default buckets.

Reported per method: median step time (forward + backward + hook + optimizer step, rank
0, after ``--warmup`` steps), bytes sent per rank per step (ring model: dense
``2 (P-1)/P * 4N``, fp16 half of it, PowerSGD the P and Q allreduces plus its
uncompressed tensors -- dense during its warm-up steps --, hvdsparse from its own
per-step accounting, ``State.stats()``), steps and seconds to ``--target-acc`` and final
test accuracy (held-out 20 %). JSON in ``<out>/results.json`` and a markdown table on
stdout / ``<out>/table.md``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("dense", "fp16", "powersgd-r1", "powersgd-r4", "hvdsparse-topk",
           "hvdsparse-threshold", "hvdsparse-adacomp")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--target-acc", type=float, default=0.9)
    ap.add_argument("--powersgd-start", type=int, default=10,
                    help="PowerSGD's start_powerSGD_iter (its default is 1000, longer "
                         "than a short run)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default="results/bench_ddp")
    ap.add_argument("--master-port", type=int, default=0)
    return ap.parse_args(argv)


def launch(args):
    import socket
    port = args.master_port
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("TRITON_INTERPRET", None)
    # the options travel in the environment: torchrun's own parser would claim
    # abbreviations of its options (--np, --master-port) after the script name
    env["HVDSPARSE_BENCH_DDP_ARGS"] = json.dumps(sys.argv[1:])
    cmd = [str(torchrun), "--nproc-per-node", str(args.np), "--master-addr", "127.0.0.1",
           "--master-port", str(port), __file__]
    return subprocess.call(cmd, env=env)


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


def worker(args):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hvdsparse
    import hvdsparse.ddp

    dist.init_process_group("gloo")
    R, P = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    xtr, ytr, xte, yte = load_data(0)
    W = args.width

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, W), nn.ReLU(), nn.Linear(W, W), nn.ReLU(),
                             nn.Linear(W, 10))

    results = {}
    for method in args.methods.split(","):
        net = build()
        N = sum(p.numel() for p in net.parameters())
        ddp_kw, state, settings = {}, None, ""
        if method.startswith("powersgd"):
            ddp_kw["bucket_cap_mb"] = max(25, 8 * N / 2 ** 20)   # one bucket (see docstring)
            settings = f"one bucket (bucket_cap_mb={ddp_kw['bucket_cap_mb']:.0f}), " \
                       f"start_powerSGD_iter={args.powersgd_start}"
        model = DDP(net, **ddp_kw)
        if method == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif method.startswith("powersgd"):
            rank = int(method.rsplit("r", 1)[1])
            pstate = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=rank,
                start_powerSGD_iter=args.powersgd_start)
            model.register_comm_hook(pstate, powerSGD_hook.powerSGD_hook)
        elif method.startswith("hvdsparse"):
            label, mk = {"hvdsparse-topk": ("TopK(0.01)", lambda: hvdsparse.TopK(0.01)),
                         "hvdsparse-threshold": ("Threshold(0.99)",
                                                 lambda: hvdsparse.Threshold(0.99)),
                         "hvdsparse-adacomp": ("AdaComp()", lambda: hvdsparse.AdaComp())}[method]
            comp = mk()
            state = hvdsparse.ddp.State(comp, model.named_parameters())
            model.register_comm_hook(state, hvdsparse.ddp.hook)
            settings = f"{label}, exchange=auto, default buckets"
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        g = torch.Generator().manual_seed(1000 + R)
        times, sent, evals = [], [], []
        t_train = 0.0
        for step in range(args.steps):
            idx = torch.randint(0, xtr.shape[0], (args.batch,), generator=g)
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
            dt = time.perf_counter() - t0
            times.append(dt)
            t_train += dt
            if method == "dense":
                sent.append(2 * (P - 1) / P * 4 * N)
            elif method == "fp16":
                sent.append(2 * (P - 1) / P * 2 * N)
            elif method.startswith("powersgd"):
                sent.append(powersgd_bytes(net, pstate.matrix_approximation_rank, P,
                                           step >= args.powersgd_start))
            else:
                sent.append(state.last_stats["bytes_sent_total"])
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                with torch.no_grad():
                    acc = float((net(xte).argmax(1) == yte).float().mean())
                evals.append((step + 1, t_train, acc))
        t_med = torch.tensor(times[args.warmup:] or times)
        dist.all_reduce(t_med, op=dist.ReduceOp.MAX)
        hit = next(((s, t) for s, t, a in evals if a >= args.target_acc), (None, None))
        results[method] = dict(
            median_step_ms=1e3 * statistics.median(t_med.tolist()),
            bytes_per_rank_per_step=statistics.mean(sent), final_acc=evals[-1][2],
            steps_to_target=hit[0], seconds_to_target=hit[1], settings=settings,
            evals=evals, parameters=N)
        if R == 0:
            print(f"{method}: {results[method]['median_step_ms']:.1f} ms/step, "
                  f"{results[method]['bytes_per_rank_per_step'] / 1e6:.3f} MB/rank/step, "
                  f"acc {100 * evals[-1][2]:.2f}%", flush=True)
        del model
    if R == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(nproc=P, width=W, steps=args.steps, batch=args.batch, lr=args.lr,
                    target_acc=args.target_acc, powersgd_start=args.powersgd_start,
                    torch=torch.__version__, load=os.getloadavg(), network="unshaped localhost")
        (out / "results.json").write_text(json.dumps(dict(meta=meta, results=results),
                                                     indent=1))
        dense = results.get("dense")
        lines = ["| method | median step (ms) | vs dense | MB sent/rank/step | compression "
                 "vs dense | steps to target | s to target | final acc (%) | peer settings |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for m, r in results.items():
            sp = f"{dense['median_step_ms'] / r['median_step_ms']:.2f}x" if dense else ""
            cr = (f"{dense['bytes_per_rank_per_step'] / r['bytes_per_rank_per_step']:.1f}x"
                  if dense and r["bytes_per_rank_per_step"] else "")
            st = "-" if r["steps_to_target"] is None else str(r["steps_to_target"])
            ss = "-" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.1f}"
            lines.append(f"| {m} | {r['median_step_ms']:.1f} | {sp} | "
                         f"{r['bytes_per_rank_per_step'] / 1e6:.3f} | {cr} | {st} | {ss} | "
                         f"{100 * r['final_acc']:.2f} | {r['settings']} |")
        table = "\n".join(lines)
        (out / "table.md").write_text(table + "\n")
        print(table, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:
        worker(parse(json.loads(os.environ.get("HVDSPARSE_BENCH_DDP_ARGS", "[]"))))
    else:
        sys.exit(launch(parse()))
