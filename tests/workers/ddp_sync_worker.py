"""The host-sync detector (:mod:`tests.workers.sync_worker`) over whole steps of the DDP
communication hook, under real ``torchrun`` with ``TRITON_INTERPRET=1
HVDSPARSE_FORCE_TRITON=1`` (run by tests/test_host_sync.py with 2 processes).

For every configuration below, a tiny MLP in ``DistributedDataParallel`` with small
buckets (several hook calls per step) trains ``STEPS`` steps with
``hvdsparse.ddp.State(..., validate=False)`` (the trusted decode CUDA uses). The
detector records the backward pass (DDP's reducer calls the hook per bucket; the last
bucket finishes the step: wait, decode, non-finite table, futures) and
``optimizer.step()`` (the momentum-correction / Adam-recipe step hooks) separately.
Output lines as the Horovod worker's: ``SYNC``, ``READOUT``, ``COMBO``, ``FRESH``,
written to ``<argv[1]>/rank<r>.txt`` (torchrun does not prefix or serialise its
children's stdout, so two ranks' lines could interleave).

Limits (as for the Horovod worker): a CPU run takes the CPU branch of code that branches
on the device type -- here the hook's non-finite table and, with ``grad_scaler``, its
commit / rollback decision, which on CUDA go through :class:`HostReadout` one step late
(read through numpy on CPU, so not counted).
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from tests.workers.torchrun_exit import finish
from tests.workers.sync_worker import (HostSyncDetector, ReadoutRecorder,
                                       control_compressor, make_model, tag_new)

STEPS = 3


def configs():
    """name -> (compressor factory, optimizer kind, State keywords)."""
    import hvdsparse as hs
    return {
        "TopK/allgather": (lambda: hs.TopK(0.05), "sgd", dict(exchange="allgather")),
        "TopK/split": (lambda: hs.TopK(0.05), "sgd", dict(exchange="split")),
        "TopK/balanced": (lambda: hs.TopK(0.05), "sgd", dict(exchange="balanced")),
        "Threshold/dense": (lambda: hs.Threshold(0.95, life_span=2), "sgd",
                            dict(exchange="dense")),
        "AdaComp/auto": (lambda: hs.AdaComp(), "sgd", dict(exchange="auto")),
        "SlimDP/allgather": (lambda: hs.SlimDP(alpha=0.2, beta=0.1, core_period=2), "sgd",
                             dict(exchange="allgather")),
        "QSGD/allgather": (lambda: hs.QSGD(4), "sgd", dict(exchange="allgather")),
        "RandomK/allgather": (lambda: hs.RandomK(0.05), "sgd", dict(exchange="allgather")),
        "TopK-int4/allgather": (lambda: hs.TopK(0.05, values="int4"), "sgd",
                                dict(exchange="allgather")),
        "TopK+scaler/allgather": (lambda: hs.TopK(0.05), "sgd+scaler",
                                  dict(exchange="allgather")),
        # warm-up step 0, a compressed step 1, a variance refresh at step 2
        "TopK+adam/allgather": (lambda: hs.TopK(0.05), "adam",
                                dict(exchange="allgather", adam_warmup=1, adam_refresh=2,
                                     adam_refresh_start=1, adam_wire="gradient")),
        # the default (update) wire: one warm-up step, then every rank's own Adam step
        "TopK+adam-update/allgather": (lambda: hs.TopK(0.05), "adam",
                                       dict(exchange="allgather")),
        "TopK+propagate/auto": (lambda: hs.TopK(0.05), "plain",
                                dict(exchange="auto", nonfinite="propagate")),
        # positive control: .item() inside compress, i.e. inside DDP's call of the hook
        "control/allgather": (control_compressor, "sgd", dict(exchange="allgather")),
    }


def main():
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    import hvdsparse.ddp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    assert os.environ.get("HVDSPARSE_FORCE_TRITON") == "1" and \
        os.environ.get("TRITON_INTERPRET") == "1", "run with the forced-Triton interpreter"
    out = open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w")

    def emit(kind, rec):
        out.write(f"{kind} " + json.dumps(rec) + "\n")
    det = HostSyncDetector()
    readouts = ReadoutRecorder(det)
    for combo, (make, kind, kw) in configs().items():
        torch.manual_seed(1234)
        net = make_model()
        model = DDP(net, bucket_cap_mb=0.004)          # ~4 KB: one bucket per layer
        if kind == "adam":
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.05,
                                  momentum=0.0 if kind == "plain" else 0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) \
            if kind == "sgd+scaler" else None
        state = hvdsparse.ddp.State(make(), net.named_parameters(), validate=False,
                                    optimizer=None if kind == "plain" else opt,
                                    grad_scaler=scaler, momentum_masking=True, **kw)
        model.register_comm_hook(state, hvdsparse.ddp.hook)
        g = torch.Generator().manual_seed(100 + rank)
        n_rec, n_ro = len(det.records), len(readouts.records)
        det.hvd_ops.clear()
        t0 = time.time()
        with det:
            for step in range(STEPS):
                x = torch.randn(16, 16, generator=g)
                y = torch.randint(0, 16, (16,), generator=g)
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                det.phase = "backward"
                (scaler.scale(loss) if scaler is not None else loss).backward()
                det.phase = "step"
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                det.phase = None
                n_rec = tag_new(det.records, n_rec, combo=combo, step=step)
                n_ro = tag_new(readouts.records, n_ro, combo=combo, step=step)
        sums = [None] * dist.get_world_size()
        dist.all_gather_object(sums, [float(p.detach().double().sum())
                                      for p in net.parameters()])
        emit("COMBO", (dict(
            rank=rank, combo=combo, replicas_equal=all(s == sums[0] for s in sums),
            hvd_ops=dict(det.hvd_ops), strategies=state.stats()["last"].get("strategies"),
            steps=state.step, momentum=state.local_update is not None,
            seconds=round(time.time() - t0, 2))))
        state.remove_hooks()
    readouts.close()
    for r in det.records:
        emit("SYNC", dict(rank=rank, **r))
    for r in readouts.records:
        emit("READOUT", dict(rank=rank, **r))
    for (phase, site), n in sorted(det.fresh.items()):
        emit("FRESH", dict(rank=rank, phase=phase, site=site, n=n))
    out.close()
    finish(rank)


if __name__ == "__main__":
    sys.exit(main())
