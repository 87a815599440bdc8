"""Digests of the parameters after a few training steps, for every compressor x exchange,
through one front door: the fingerprint a refactor of the step machinery must leave
unchanged (same seeds -> same digests before and after).

Run under either launcher; rank 0 prints one line per configuration, after checking that
every rank holds bitwise the same parameters (an allgather of the digests)::

    horovodrun -np 3 -H localhost:3 --gloo .venv/bin/python scripts/step_digests.py horovod
    torchrun --nproc-per-node 3 scripts/step_digests.py ddp

The model has 1-D layers (dense by policy), a convolution, and linear layers large
enough to be compressed; every rank draws its own data from (seed, step, rank).
"""
import hashlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdsparse

DOOR = sys.argv[1] if len(sys.argv) > 1 else "horovod"
STEPS = 6

if DOOR == "horovod":
    import horovod.torch as hvd
    hvd.init()
    R, P = hvd.rank(), hvd.size()

    def gather_strings(s):
        return hvd.allgather_object(s, name="digest")
else:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import hvdsparse.ddp
    dist.init_process_group("gloo")
    R, P = dist.get_rank(), dist.get_world_size()

    def gather_strings(s):
        out = [None] * P
        dist.all_gather_object(out, s)
        return out
torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 8 * 8, 96)
        self.ln = nn.LayerNorm(96)
        self.fc2 = nn.Linear(96, 10)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        return self.fc2(F.relu(self.ln(self.fc1(x.flatten(1)))))


def compressors():
    return [("topk", lambda: hvdsparse.TopK(0.05)),
            ("threshold", lambda: hvdsparse.Threshold(0.95)),
            ("adacomp", lambda: hvdsparse.AdaComp()),
            ("qsgd4", lambda: hvdsparse.QSGD(bits=4)),
            ("randomk", lambda: hvdsparse.RandomK(0.05)),
            ("slimdp", lambda: hvdsparse.SlimDP(0.2, 0.1, core_period=3))]


def run(comp, exchange, opt_kind):
    torch.manual_seed(1)
    model = Net()
    if opt_kind == "adam":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if DOOR == "horovod":
        dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        compression=comp, exchange=exchange)
        net = model
    else:
        net = DDP(model)
        state = hvdsparse.ddp.State(comp, model.named_parameters(), exchange=exchange,
                                    optimizer=opt)
        net.register_comm_hook(state, hvdsparse.ddp.hook)
        dopt = opt
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + R)
        x = torch.randn(16, 2, 8, 8, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        dopt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        dopt.step()
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


lines = []
for cname, make in compressors():
    for exchange in ("allgather", "split", "dense", "auto"):
        for opt_kind in ("sgd", "adam"):
            d = run(make(), exchange, opt_kind)
            every = gather_strings(d)
            same = "identical" if len(set(every)) == 1 else f"DIFFER {every}"
            lines.append(f"{DOOR} P={P} {cname:9s} {exchange:9s} {opt_kind:4s} {d} {same}")
if R == 0:
    print("\n".join(lines), flush=True)
