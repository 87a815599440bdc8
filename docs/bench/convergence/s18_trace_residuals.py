"""Per-step trace of the digits MLP at P = 2 (BENCHMARKS.md 4b, eighteenth session): loss,
and per weight the residual's norm and max, the DGC velocity's norm, the update's norm
and max, and the weight's norm. ``python s18_trace_residuals.py SEED MODE`` under
``horovodrun -np 2``, MODE = 0 (TopK 1% + momentum correction, not masked: the
default), 1 (masked) or dense (Horovod's allreduce). Writes s18_trace_s{SEED}_m{MODE}.json
next to this file (rank 0)."""
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
import horovod.torch as hvd
import hvdsparse
from workloads import make_workload
torch.set_num_threads(1)
hvd.init()
rank, world = hvd.rank(), hvd.size()
wl = make_workload("digits-mlp", rank, world)
seed, masking = int(sys.argv[1]), sys.argv[2] == "1"
model = wl.model(seed)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
base = wl.optimizer(model, "sgd")
named = list(model.named_parameters())
if sys.argv[2] == "dense":
    comp = None
    opt = hvd.DistributedOptimizer(base, named_parameters=named)
else:
    comp = hvdsparse.TopK(0.01)
    opt = hvdsparse.DistributedOptimizer(base, named_parameters=named, compression=comp,
                                         momentum_correction=True, momentum_masking=masking)
step = 0; rows = []
for epoch in range(15):
    for batch in wl.batches(seed, epoch):
        opt.zero_grad(); loss = wl.loss(model, batch); loss.backward()
        before = {n: p.detach().clone() for n, p in named}
        opt.step(); step += 1
        if rank == 0:
            r = dict(step=step, loss=float(loss))
            for n, p in named:
                if n.endswith("weight"):
                    res = comp.residual(n) if comp else None
                    u = opt._local_update.u.get(n) if comp else None
                    r[n] = dict(res=float(res.norm()) if res is not None else 0.,
                                resmax=float(res.abs().max()) if res is not None else 0.,
                                u=float(u.norm()) if u is not None else 0.,
                                upd=float((p.detach() - before[n]).norm()),
                                updmax=float((p.detach() - before[n]).abs().max()),
                                w=float(p.detach().norm()))
            rows.append(r)
if rank == 0:
    json.dump(rows, open(Path(__file__).with_name(f"s18_trace_s{seed}_m{sys.argv[2]}.json"), "w"))
    model.eval(); print("final", wl.evaluate(model))
print(f"HVDSPARSE-OK rank={rank}")
