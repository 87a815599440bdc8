"""Split's phase 2 without error feedback: bytes vs accuracy on the digits MLP.

The ``split`` exchange's owners send their reduced ranges either exactly (sparse pairs,
fp32 dense ranges) or rounded: fp16/bf16 pairs when every segment travels in that
dtype (the *sum* is rounded once more), or 8/4/2-bit stochastic codes once a range is
denser than SparCML's switch point (``split_dense_bits``). That rounding is not fed
back into any residual. This script measures what it costs: every configuration trains
the digits MLP of ``scripts/train.py`` (64-256-256-10, SGD lr 0.1 momentum 0.9, batch
32 per rank, same seed and data order) and reports final test accuracy, final training
loss, bytes sent per rank per step (``optimizer.stats()``) and the share of reduced
ranges that travelled quantised.

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python scripts/split_phase2_error.py \
        --epochs 8 --json /tmp/split_p2_np2.json

One launch runs every configuration (rank 0 prints one table row each).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = [
    # (label, compressor factory kwargs, exchange, split_dense_bits)
    ("TopK 10% allgather", ("TopK", dict(ratio=0.1)), "allgather", 0),
    ("TopK 10% split fp32", ("TopK", dict(ratio=0.1)), "split", 0),
    ("TopK 10% split q8", ("TopK", dict(ratio=0.1)), "split", 8),
    ("TopK 10% split q4", ("TopK", dict(ratio=0.1)), "split", 4),
    ("TopK 10% fp16 allgather", ("TopK", dict(ratio=0.1, values="fp16")), "allgather", 0),
    ("TopK 10% fp16 split", ("TopK", dict(ratio=0.1, values="fp16")), "split", 0),
    ("dense (NoCompression) allgather", ("NoCompression", {}), "allgather", 0),
    ("dense (NoCompression) split q8", ("NoCompression", {}), "split", 8),
    ("dense (NoCompression) split q4", ("NoCompression", {}), "split", 4),
]


def run(cfg, args, hvd, data):
    import hvdsparse
    from train import build_model
    label, (cname, ckw), exchange, bits = cfg
    xtr, ytr, xte, yte = data
    torch.manual_seed(args.seed)
    model = build_model(256)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    comp = getattr(hvdsparse, cname)(**ckw)
    opt = hvdsparse.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(), compression=comp, exchange=exchange,
        split_dense_bits=bits)
    P, r = hvd.size(), hvd.rank()
    n = xtr.shape[0] // P
    mine_x, mine_y = xtr[r * n:(r + 1) * n], ytr[r * n:(r + 1) * n]
    g = torch.Generator().manual_seed(args.seed)
    steps, sent, ranges, quant = 0, 0, 0, 0
    t0 = time.time()
    loss = torch.zeros(())
    for epoch in range(args.epochs):
        perm = torch.randperm(n, generator=g)
        for b in range(0, n - args.batch_size + 1, args.batch_size):
            idx = perm[b:b + args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(mine_x[idx]), mine_y[idx])
            loss.backward()
            opt.step()
            last = opt.stats()["last"]
            steps += 1
            sent += int(last["bytes_sent_total"])
            for bk in last["buckets"]:
                rm = bk.get("figures", {}).get("range_modes")
                if rm:
                    ranges += sum(rm.values())
                    quant += rm.get("quantised", 0)
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean())
        full_loss = float(F.cross_entropy(model(xtr), ytr))
    accs = hvd.allgather_object(acc, name=f"acc.{label}")
    opt._hvdsparse.remove_hooks() if hasattr(opt._hvdsparse, "remove_hooks") else None
    return dict(config=label, world_size=P, epochs=args.epochs, steps=steps,
                test_acc=accs[0], replicas_agree=len(set(accs)) == 1,
                train_loss=full_loss, bytes_sent_per_step=sent / max(steps, 1),
                quantised_range_share=(quant / ranges) if ranges else 0.0,
                seconds=time.time() - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated config labels (substring)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import horovod.torch as hvd
    from train import load_data
    hvd.init()
    torch.set_num_threads(1)
    data = load_data(args.seed)
    rows = []
    for cfg in CONFIGS:
        if args.only and not any(s in cfg[0] for s in args.only.split(",")):
            continue
        row = run(cfg, args, hvd, data)
        rows.append(row)
        if hvd.rank() == 0:
            print(f"| {row['config']} | {row['world_size']} | {row['test_acc']:.4f} | "
                  f"{row['train_loss']:.4f} | {row['bytes_sent_per_step']:.0f} | "
                  f"{row['quantised_range_share']:.2f} |", flush=True)
    if hvd.rank() == 0 and args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    hvd.shutdown()


if __name__ == "__main__":
    main()
