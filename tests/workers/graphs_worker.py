"""Worker of tests/test_graphs_hvd.py, under ``horovodrun`` (the Horovod door,
``hvdsparse.DistributedOptimizer``) or with the argument ``ddp`` under ``torchrun`` (the
DDP communication hook), run with ``TRITON_INTERPRET=1 HVDSPARSE_FORCE_TRITON=1``: whole
training steps with ``cuda_graphs=True`` against the same steps eager.

The step engine's CUDA graph backend is replaced by ``scripts/graph_emulator.py``'s
``EmulatedGraphs`` (a capture records a segment's launches through Triton's interpreter,
a replay re-issues them with the recorded arguments, reading the tensors' current
contents, as a CUDA graph does). For every (compressor, exchange) of :data:`RUNS` a small
MLP trains :data:`STEPS` steps through the door with ``validate=False`` twice from the
same seed and data: eager, then with ``cuda_graphs``.
One ``RUN {json}`` line per run and rank: whether the parameters equal the eager run's
bit for bit, how many launches replays re-issued, and a hash of the parameters (the
test compares it across ranks).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

#: steps per run: a segment runs eagerly at its first sighting, is captured at its
#: second and replayed after; the non-finite counts alternate between two tensors, so a
#: bucket's encode repeats every other step (steps 4 and 5 replay both of its keys)
STEPS = 6
#: (compressor, exchange, optimizer): every exchange, and the Adam recipe's update wire
#: (every kind of row is replayed against eager in tests/test_device_graphs.py)
RUNS = [("TopK", "allgather", "sgd"), ("QSGD", "dense", "sgd"), ("TopK", "split", "sgd"),
        ("RandomK", "balanced", "sgd"), ("TopK", "allgather", "adamw")]


def make(name):
    import hvdsparse as hs
    return {"TopK": lambda: hs.TopK(0.05), "QSGD": lambda: hs.QSGD(4),
            "RandomK": lambda: hs.RandomK(0.05)}[name]()


def train(door, cname, ex, optname, graphs, rank):
    import torch.nn as nn
    import torch.nn.functional as F
    import hvdsparse
    torch.manual_seed(1234)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 16))
    base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01) \
        if optname == "adamw" else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if door == "ddp":
        import hvdsparse.ddp
        from torch.nn.parallel import DistributedDataParallel as DDP
        net, opt = DDP(model, bucket_cap_mb=0.02), base       # several buckets
        state = hvdsparse.ddp.State(make(cname), model.named_parameters(), exchange=ex,
                                    validate=False, cuda_graphs=graphs,
                                    optimizer=base if optname == "adamw" else None)
        net.register_comm_hook(state, hvdsparse.ddp.hook)
    else:
        door.broadcast_parameters(model.state_dict(), root_rank=0)
        net, opt = model, hvdsparse.DistributedOptimizer(
            base, named_parameters=model.named_parameters(), compression=make(cname),
            exchange=ex, validate=False, fusion_threshold=4096, cuda_graphs=graphs)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        x = torch.randn(16, 16, generator=g)
        y = torch.randint(0, 16, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    if hasattr(opt, "_hvdsparse"):
        opt._hvdsparse.remove_hooks()
    return flat


def main():
    from graph_emulator import EmulatedGraphs
    from hvdsparse import device_graphs

    ddp = sys.argv[1:] == ["ddp"]
    if ddp:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        door, rank = "ddp", dist.get_rank()
    else:
        import horovod.torch as hvd
        hvd.init()
        door, rank = hvd, hvd.rank()
    torch.set_num_threads(1)
    assert os.environ.get("HVDSPARSE_FORCE_TRITON") == "1" and \
        os.environ.get("TRITON_INTERPRET") == "1", "run with the forced-Triton interpreter"
    emu = EmulatedGraphs()
    device_graphs.CudaGraphs = lambda: emu
    for cname, ex, optname in RUNS:
        t0 = time.time()
        eager = train(door, cname, ex, optname, False, rank)
        before = emu.reissued
        got = train(door, cname, ex, optname, True, rank)
        print("RUN " + json.dumps(dict(
            rank=rank, run=f"{cname}/{ex}/{optname}",
            equal=bool(torch.equal(eager.view(torch.int32), got.view(torch.int32))),
            reissued=emu.reissued - before,
            hash=hashlib.sha256(got.numpy().tobytes()).hexdigest()[:16],
            seconds=round(time.time() - t0, 1))), flush=True)
    if ddp:
        sys.path.insert(0, str(ROOT))
        from tests.workers.torchrun_exit import finish
        finish(rank)
    door.shutdown()
    print(f"HVDSPARSE-OK rank={rank}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
