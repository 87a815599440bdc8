"""Bytes per rank per step vs world size: allgather, split, balanced
and auto, measured against the cost model's prediction.

One ``horovodrun -np P`` launch per P (Gloo, localhost). In each launch every exchange
trains the same model for ``--steps`` steps with TopK 1 % (one fresh model, optimizer and
compressor per exchange, same seed and data): the digits MLP of ``scripts/train.py``
(64-W-W-10, W = ``--width``), SGD lr 0.1 momentum 0.9, batch 32 per rank, each rank on
its own shard. Per step and rank the optimizer's own accounting (``opt.stats()["last"]``:
``bytes_sent_total`` / ``bytes_recv_total``, the ring-model link bytes of every
collective) is recorded, plus -- from the figures ``auto`` reads at each bucket launch --
the cost model's prediction of every strategy (``cost_model.costs``; each exchange is
asked for its figures as ``auto`` is, so split's and balanced's predictions use the
previous exchanges' pair counts as auto's would). ``balanced`` also reports its phase-2
truncation (``p2_dropped_energy``: share of the summed gradient's squared norm not
delivered) and the owners' load imbalance (max pairs received / mean).

Bytes do not depend on timing, so this needs no exclusive CPU lock (``flock -s``).
Steps ``--skip`` and later are averaged (the first exchanges have no history, and
``balanced`` starts from equal-width regions and re-balances at its third exchange).

    flock -s /work/cpu.lock .venv/bin/python scripts/bench_scaling.py --nps 2,4,8,16 \\
        --out docs/bench/scaling

writes ``np<P>.json`` per launch, then ``scaling.json`` and ``scaling.md`` (the table);
``--report`` rebuilds the table from existing ``np<P>.json`` files. ``--epochs E``
instead trains E epochs per exchange (allgather, split, balanced, and Horovod's dense
allreduce) and writes ``accuracy_np<P>.json``: the accuracy cost of balanced's
phase-2 truncation next to the exact exchanges.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXCHANGES = ("allgather", "split", "balanced", "auto")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nps", default="2,4,8,16")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--skip", type=int, default=4, help="steps excluded from the means")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "scaling"))
    ap.add_argument("--report", action="store_true", help="only rebuild the table")
    ap.add_argument("--epochs", type=int, default=0,
                    help="accuracy mode: train this many epochs per exchange (no byte "
                         "table), report test accuracy and bytes (accuracy_np<P>.json)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


# ------------------------------------------------------------------------ worker (per rank)
def worker(args):
    import numpy as np
    import torch
    import torch.nn.functional as F
    import horovod.torch as hvd
    sys.path.insert(0, str(ROOT / "scripts"))
    sys.path.insert(0, str(ROOT))
    import hvdsparse
    from hvdsparse.exchange import cost_model
    from train import build_model, load_data

    torch.set_num_threads(1)
    hvd.init()
    P, R = hvd.size(), hvd.rank()
    xtr, ytr, _, _ = load_data(args.seed)
    n = xtr.shape[0] // P
    mx, my = xtr[R * n:(R + 1) * n], ytr[R * n:(R + 1) * n]
    if args.epochs:
        return accuracy_worker(args, hvd, P, R, mx, my, n)
    rows = []
    for exchange in EXCHANGES:
        torch.manual_seed(args.seed)
        model = build_model(args.width)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvdsparse.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            named_parameters=model.named_parameters(),
            compression=hvdsparse.TopK(args.ratio), exchange=exchange)
        sched, eng = opt.scheduler, opt.scheduler.engine
        pred = {}
        orig_for = sched.strategy_for
        eng.record_figures = True          # every exchange reports its figures

        def strategy_for(b, payloads, _o=orig_for):
            spec = sched._specs[b]
            pred[b] = cost_model.costs(eng.figures(eng.history(spec.names), spec.numel,
                                                   payloads), sched.settings.alpha_bytes)
            return _o(b, payloads)
        sched.strategy_for = strategy_for
        g = torch.Generator().manual_seed(args.seed * 7919 + R)
        steps = []
        for step in range(args.steps):
            idx = torch.randint(0, n, (32,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(mx[idx]), my[idx]).backward()
            opt.step()
            last = opt.stats()["last"]
            strat = last["strategies"]
            p = {s: sum(c[s] for c in pred.values()) for s in cost_model.STRATEGIES}
            p["chosen"] = sum(pred[b][s] for b, s in enumerate(strat))
            figs = [bk.get("figures", {}) for bk in last["buckets"]]
            steps.append(dict(
                sent=int(last["bytes_sent_total"]), recv=int(last["bytes_recv_total"]),
                strategies=strat, predicted=p,
                dropped_energy=[f.get("p2_dropped_energy") for f in figs],
                imbalance=[f.get("imbalance") for f in figs],
                bounds_version=[f.get("bounds_version") for f in figs],
                numel=sum(bk["numel"] for bk in last["buckets"]),
                dense=int(last["dense_allreduce_bytes"])))
        sched.remove_hooks()
        everyone = hvd.allgather_object(steps, name=f"bench_scaling.{exchange}")
        if R == 0:
            rows.append(summarise(exchange, P, everyone, args.skip))
            r = rows[-1]
            print(f"[P={P}] {exchange:9s} {r['strategies']}: sent/rank mean "
                  f"{r['sent_mean'] / 1e3:.1f} kB (max rank {r['sent_max'] / 1e3:.1f}), "
                  f"predicted {r['predicted'] / 1e3:.1f} kB", flush=True)
    if R == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(P=P, steps=args.steps, skip=args.skip, width=args.width,
                    ratio=args.ratio, seed=args.seed, numel=rows[0]["numel"],
                    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    load=os.getloadavg(), cores=os.cpu_count(), torch=torch.__version__)
        (out / f"np{P}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    _ = np


def accuracy_worker(args, hvd, P, R, mx, my, n):
    """Train ``--epochs`` epochs per exchange (same seed, data order, model) and report
    the held-out accuracy and final training loss: what balanced's phase-2 truncation
    costs in accuracy next to the exact exchanges."""
    import torch
    import torch.nn.functional as F
    import hvdsparse
    from train import build_model, load_data
    _, _, xte, yte = load_data(args.seed)
    rows = []
    for exchange in ("allgather", "split", "balanced", "dense-baseline"):
        torch.manual_seed(args.seed)
        model = build_model(args.width)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if exchange == "dense-baseline":
            opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        else:
            opt = hvdsparse.DistributedOptimizer(
                base, named_parameters=model.named_parameters(),
                compression=hvdsparse.TopK(args.ratio), exchange=exchange)
        g = torch.Generator().manual_seed(args.seed)
        steps, sent, dropped, loss = 0, 0, [], torch.zeros(())
        for _ in range(args.epochs):
            perm = torch.randperm(n, generator=g)
            for b in range(0, n - 31, 32):
                idx = perm[b:b + 32]
                opt.zero_grad()
                loss = F.cross_entropy(model(mx[idx]), my[idx])
                loss.backward()
                opt.step()
                steps += 1
                if exchange != "dense-baseline":
                    last = opt.stats()["last"]
                    sent += int(last["bytes_sent_total"])
                    dropped += [bk["figures"]["p2_dropped_energy"] for bk in last["buckets"]
                                if "p2_dropped_energy" in bk.get("figures", {})]
        with torch.no_grad():
            acc = float((model(xte).argmax(1) == yte).float().mean())
        if exchange != "dense-baseline":
            opt.scheduler.remove_hooks()
        if R == 0:
            rows.append(dict(exchange=exchange, P=P, epochs=args.epochs, steps=steps,
                             test_acc=acc, final_loss=float(loss),
                             sent_per_step=sent / steps if sent else None,
                             dropped_energy=sum(dropped) / len(dropped) if dropped else None))
            print(f"[P={P}] {exchange:14s} acc {100 * acc:.2f} % loss {float(loss):.4f} "
                  f"sent/step {(sent / steps / 1e3) if sent else float('nan'):.1f} kB",
                  flush=True)
    if R == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(P=P, epochs=args.epochs, width=args.width, ratio=args.ratio,
                    seed=args.seed, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    load=os.getloadavg(), cores=os.cpu_count())
        (out / f"accuracy_np{P}.json").write_text(json.dumps(dict(meta=meta, rows=rows),
                                                              indent=1))


def summarise(exchange, P, everyone, skip):
    """everyone[r][step]: that rank's record. Means over steps >= skip."""
    import statistics as st
    steps = range(skip, len(everyone[0]))
    sent_r = [st.mean(everyone[r][s]["sent"] for s in steps) for r in range(P)]
    recv_r = [st.mean(everyone[r][s]["recv"] for s in steps) for r in range(P)]
    rec0 = [everyone[0][s] for s in steps]
    key = "chosen"
    pred = st.mean(x["predicted"][key] for x in rec0)
    strategies = sorted({s for x in rec0 for s in x["strategies"]})
    de = [d for x in rec0 for d in x["dropped_energy"] if d is not None]
    im = [d for x in rec0 for d in x["imbalance"] if d is not None]
    first = everyone[0][0]
    return dict(exchange=exchange, P=P, strategies=strategies, numel=first["numel"],
                dense=first["dense"],
                sent_mean=st.mean(sent_r), sent_max=max(sent_r), recv_mean=st.mean(recv_r),
                predicted=pred,
                predicted_all={k: st.mean(x["predicted"][k] for x in rec0)
                               for k in rec0[0]["predicted"]},
                dropped_energy=st.mean(de) if de else None, imbalance=st.mean(im) if im else None,
                first_step_sent=st.mean(everyone[r][0]["sent"] for r in range(P)),
                per_step_sent_rank0=[x["sent"] for x in everyone[0]],
                imbalance_per_step=[x["imbalance"] for x in everyone[0]])


# ------------------------------------------------------------------------ driver
def launch(P, args):
    hvdrun = str(Path(sys.executable).parent / "horovodrun")
    cmd = [hvdrun, "-np", str(P), "-H", f"localhost:{P}", "--gloo", sys.executable,
           str(Path(__file__).resolve()), "--worker", "--steps", str(args.steps),
           "--skip", str(args.skip), "--width", str(args.width), "--ratio", str(args.ratio),
           "--seed", str(args.seed), "--out", args.out, "--epochs", str(args.epochs)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HOROVOD_START_TIMEOUT="120",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=str(ROOT), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=900)
    for line in proc.stdout.splitlines():
        if "[P=" in line:
            print(line.split(">:", 1)[-1])
    if proc.returncode != 0:
        print(proc.stdout[-4000:])
        raise SystemExit(f"horovodrun -np {P} failed (rc {proc.returncode})")
    print(f"P={P}: launch {time.time() - t0:.0f} s")


def report(args):
    out = Path(args.out)
    runs = sorted((json.loads(p.read_text()) for p in out.glob("np*.json")),
                  key=lambda d: d["meta"]["P"])
    if not runs:
        raise SystemExit(f"no np*.json in {out}")
    base = {r["exchange"]: r for r in runs[0]["rows"]}
    P0 = runs[0]["meta"]["P"]
    lines = ["| P | exchange | strategy run | sent/rank/step, mean (kB) | max rank (kB) | "
             f"cost model (kB) | measured / model | vs P={P0} | phase-2 dropped energy | "
             "owner imbalance |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        for r in run["rows"]:
            b = base.get(r["exchange"])
            de = "" if r["dropped_energy"] is None else f"{100 * r['dropped_energy']:.1f} %"
            im = "" if r["imbalance"] is None else f"{r['imbalance']:.2f}"
            lines.append(
                f"| {r['P']} | {r['exchange']} | {', '.join(r['strategies'])} | "
                f"{r['sent_mean'] / 1e3:.1f} | {r['sent_max'] / 1e3:.1f} | "
                f"{r['predicted'] / 1e3:.1f} | {r['sent_mean'] / r['predicted']:.3f} | "
                f"{r['sent_mean'] / b['sent_mean']:.2f}x | {de} | {im} |")
    m = runs[0]["meta"]
    head = (f"TopK {100 * m['ratio']:g} %, digits MLP 64-{m['width']}-{m['width']}-10 "
            f"({m['numel']} parameters, one bucket), {m['steps']} steps per exchange, means "
            f"over steps {m['skip']}..{m['steps'] - 1}; dense fp32 allreduce for reference: "
            + ", ".join(f"P={r['meta']['P']} {r['rows'][0]['dense'] / 1e3:.0f} kB"
                        for r in runs))
    table = head + "\n\n" + "\n".join(lines) + "\n"
    (out / "scaling.md").write_text(table)
    (out / "scaling.json").write_text(json.dumps(
        dict(runs=[r["meta"] for r in runs],
             rows=[x for r in runs for x in r["rows"]]), indent=1))
    print(table)


def main(argv=None):
    args = parse(argv)
    if args.worker:
        return worker(args)
    if not args.report:
        for P in [int(x) for x in args.nps.split(",")]:
            launch(P, args)
    if not args.epochs:
        report(args)


if __name__ == "__main__":
    main()
