#!/usr/bin/env python
"""Two-stage model-parallel pipeline with DCT-MP at the split (optionally hybrid DP).

    python scripts/pipeline_mp.py --sparsity 0.9 --steps 200
    python scripts/pipeline_mp.py --sparsity 0.9,0 --steps 200          # + baseline
    python scripts/pipeline_mp.py --sparsity 0.9 --replicas 2 --dp-sparsity 0.9

Model (DLRM-style bottom MLP on the dense features, split after its second layer):

    stage 0:  x[64] -> FC 512 -> ReLU -> FC 256 -> ReLU -> [DCT-MP threshold] --+
    stage 1:  <--------------------------------------------------------------- +
              -> FC 64 -> ReLU -> FC 16 -> ReLU -> FC 10 -> cross-entropy

Data: scikit-learn's bundled ``load_digits`` (1797 8x8 images, 64 dense features
scaled to [0, 1], 10 classes); shuffled with ``--seed``; the first 1500 train, the rest
are the test set. Every process loads the same data and draws the same batches.

Transport: ``torch.distributed`` point-to-point ``send``/``recv`` on the Gloo backend.
Horovod only offers collectives (allreduce / allgather / broadcast / alltoall over
all ranks of a process set), no point-to-point messages, so the split crossing uses
torch.distributed directly. One message per direction and step: with ``--sparsity > 0``
the codec message of :class:`hvdsparse.mp.SplitSender` (forward) /
:class:`SplitReceiver` (backward, values only); with ``--sparsity 0`` the raw fp32
activation / gradient (the uncompressed baseline). Message lengths are fixed by the
shapes and settings, so both sides post receives of the right size without a length
message. Bytes are counted per direction (everything that is sent).

Hybrid (``--replicas R``): ``2R`` processes, rank ``2r + s`` is stage ``s`` of replica
``r``; each replica trains on its own slice of every batch (the global batch is split
R ways). Weight gradients are averaged within each stage's data-parallel group
(``torch.distributed.new_group``): dense ``all_reduce`` with ``--dp-sparsity 0``,
otherwise DCT-DP: ``hvdsparse.compressors.Threshold(dp_sparsity, life_span)`` (error
feedback, threshold refreshed every ``--dp-life-span`` steps), payloads encoded with
``hvdsparse.codec`` and exchanged with ``all_gather`` over the group, summed by
``codec.accumulate``. We use
torch.distributed groups rather than ``horovodrun`` because the point-to-point part
needs torch.distributed anyway and one launcher keeps the example self-contained.

Launch: spawns its own processes (``torch.multiprocessing``), or, when ``RANK`` and
``WORLD_SIZE`` are set (torchrun), runs as that rank. Output: one line per logged
step, a JSON summary line ``RESULT {...}`` per sparsity on rank 0 (``--json PATH``
also writes the list of summaries).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

D_IN, D_SPLIT, N_CLASSES = 64, 256, 10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sparsity", default="0.9",
                   help="DCT-MP sparsity at the split, or a comma list run one after the "
                        "other in the same processes (0 = uncompressed baseline)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=64, help="global batch size")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--values", default="fp32", choices=["fp32", "fp16", "bf16"],
                   help="value encoding on the wire")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--dp-sparsity", type=float, default=0.0,
                   help="DCT-DP sparsity of the weight gradients (replicas > 1)")
    p.add_argument("--dp-life-span", type=int, default=50,
                   help="DCT-DP threshold refresh interval (steps)")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of step timing")
    p.add_argument("--json", default=None, help="write the summaries to this file")
    p.add_argument("--quiet", action="store_true", help="only the RESULT lines")
    a = p.parse_args(argv)
    try:
        a.sparsities = [float(s) for s in str(a.sparsity).split(",")]
    except ValueError:
        p.error(f"--sparsity: expected numbers separated by commas, got {a.sparsity!r}")
    for s in a.sparsities:
        if not 0.0 <= s < 1.0:
            p.error(f"--sparsity: each value must be in [0, 1), got {s}")
    if not 0.0 <= a.dp_sparsity < 1.0:
        p.error(f"--dp-sparsity must be in [0, 1), got {a.dp_sparsity}")
    if a.replicas < 1:
        p.error(f"--replicas must be >= 1, got {a.replicas}")
    if a.batch % a.replicas:
        p.error(f"--batch {a.batch} must be divisible by --replicas {a.replicas}")
    if a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    return a


# ------------------------------------------------------------------------- data / model
def load_data(seed: int):
    from sklearn.datasets import load_digits
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=g)
    X, y = X[perm], y[perm]
    return (X[:1500], y[:1500]), (X[1500:], y[1500:])


def batches(n: int, batch: int, seed: int):
    """Endless stream of index batches (reshuffled each epoch, same on every rank)."""
    g = torch.Generator().manual_seed(seed + 1)
    while True:
        perm = torch.randperm(n, generator=g)
        for i in range(0, n - batch + 1, batch):
            yield perm[i:i + batch]


def build_stage(stage: int, seed: int) -> nn.Module:
    torch.manual_seed(seed * 100 + stage)   # same init for every replica and sparsity
    if stage == 0:
        return nn.Sequential(nn.Linear(D_IN, 512), nn.ReLU(), nn.Linear(512, D_SPLIT),
                             nn.ReLU())
    return nn.Sequential(nn.Linear(D_SPLIT, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU(),
                         nn.Linear(16, N_CLASSES))


# ---------------------------------------------------------------------- point-to-point
class Link:
    """Messages to one peer with byte counters. Both sides know every message length
    in advance (fixed-capacity codec layouts, see ``SplitReceiver.message_nbytes`` /
    ``SplitSender.grad_message_nbytes``), so no length message is exchanged."""

    def __init__(self, peer: int):
        self.peer = peer
        self.sent = 0
        self.received = 0

    def send(self, t: torch.Tensor):
        t = t.detach().contiguous()
        dist.send(t, self.peer)
        self.sent += t.numel() * t.element_size()

    def recv(self, numel: int, dtype=torch.uint8) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        dist.recv(t, self.peer)
        self.received += t.numel() * t.element_size()
        return t


# ------------------------------------------------------------------------ data parallel
class DPAverager:
    """Average weight gradients over one stage's data-parallel group.

    ``dp_sparsity = 0``: dense fp32 ``all_reduce``. Otherwise DCT-DP with the project's
    compressor, ``hvdsparse.compressors.Threshold(dp_sparsity, life_span)`` (error
    feedback; threshold refreshed every ``life_span`` steps; fixed capacities, so every
    rank's message has the same length): each rank encodes its payloads with
    ``hvdsparse.codec.encode``, the messages are ``all_gather``-ed over the group and
    ``codec.accumulate`` sums them; the average replaces ``p.grad``.
    ``bytes_sent`` counts this rank's message (dense: the fp32 gradient bytes).
    """

    def __init__(self, named_params, group, ranks, dp_sparsity, life_span, rank):
        self.named = [(n, p) for n, p in named_params]
        self.group = group
        self.world = len(ranks)
        self.bytes_sent = 0
        self.step = 0
        self.compressor = None
        if dp_sparsity > 0 and self.world > 1:
            from hvdsparse.compressors import Threshold
            self.compressor = Threshold(dp_sparsity, life_span=life_span)
            self.compressor.bind(ranks.index(rank), self.world)

    def average(self):
        if self.world == 1:
            return
        params = [p for _, p in self.named]
        if self.compressor is None:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=self.group)
            flat /= self.world
            o = 0
            for p in params:
                p.grad.copy_(flat[o:o + p.numel()].view_as(p))
                o += p.numel()
            self.bytes_sent += flat.numel() * 4
        else:
            from hvdsparse import codec
            payloads = [self.compressor.compress(n, p.grad, self.step, param=p)
                        for n, p in self.named]
            buf = codec.encode(payloads)
            bufs = [torch.empty_like(buf) for _ in range(self.world)]
            dist.all_gather(bufs, buf, group=self.group)
            self.bytes_sent += buf.numel()
            outs = [torch.zeros(p.numel(), dtype=torch.float32) for p in params]
            codec.accumulate(bufs, payloads, outs, validate=True)
            for p, o in zip(params, outs):
                p.grad.copy_((o / self.world).view_as(p))
        self.step += 1


# --------------------------------------------------------------------------- training
def run_one(args, sparsity, rank, world, links_dp):
    from hvdsparse.mp import SplitReceiver, SplitSender
    replica, stage = divmod(rank, 2)
    peer = rank + 1 if stage == 0 else rank - 1
    link = Link(peer)
    (Xtr, ytr), (Xte, yte) = load_data(args.seed)
    model = build_stage(stage, args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    group, ranks = links_dp[stage]
    dp = DPAverager(model.named_parameters(), group, ranks, args.dp_sparsity,
                    args.dp_life_span, rank)
    local = args.batch // args.replicas
    sender = SplitSender(sparsity, args.values) if sparsity > 0 else None
    receiver = SplitReceiver(sparsity, (D_SPLIT,), args.values) if sparsity > 0 else None
    it = batches(len(ytr), args.batch, args.seed)
    losses, times, fwd_bytes, bwd_bytes = [], [], [], []
    for step in range(args.steps):
        idx = next(it)[replica * local:(replica + 1) * local]
        t0 = time.perf_counter()
        s0, r0 = link.sent, link.received
        opt.zero_grad(set_to_none=False)
        if stage == 0:
            act = model(Xtr[idx])
            link.send(sender.pack(act) if sender else act)
            if sender:
                g = sender.unpack_grad(link.recv(sender.grad_message_nbytes()))
            else:
                g = link.recv(act.numel(), torch.float32).view_as(act)
            act.backward(g)
            fwd_bytes.append(link.sent - s0)
            bwd_bytes.append(link.received - r0)
            loss_val = float("nan")
        else:
            if receiver:
                x = receiver.unpack(link.recv(receiver.message_nbytes(len(idx))), len(idx))
            else:
                x = link.recv(len(idx) * D_SPLIT, torch.float32).view(len(idx), D_SPLIT)
            x.requires_grad_(True)
            loss = nn.functional.cross_entropy(model(x), ytr[idx])
            loss.backward()
            link.send(receiver.pack_grad(x.grad) if receiver else x.grad)
            fwd_bytes.append(link.received - r0)
            bwd_bytes.append(link.sent - s0)
            loss_val = loss.item()
        dp.average()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss_val)
        if stage == 1 and not args.quiet and (step % args.log_every == 0
                                              or step == args.steps - 1):
            print(f"[replica {replica}] sparsity={sparsity} step {step:4d} loss {loss_val:.4f}"
                  f" fwd_bytes {fwd_bytes[-1]} bwd_bytes {bwd_bytes[-1]}"
                  f" dense_bytes {local * D_SPLIT * 4} step_ms {times[-1] * 1e3:.2f}",
                  flush=True)
    # evaluation through the (thresholded) pipeline, replica 0 only, forward only
    acc = float("nan")
    test_loss = float("nan")
    if replica == 0:
        with torch.no_grad():
            if stage == 0:
                act = model(Xte)
                link.send(sender.pack(act) if sender else act)
            else:
                if receiver:
                    x = receiver.unpack(link.recv(receiver.message_nbytes(len(yte))),
                                        len(yte))
                else:
                    x = link.recv(len(yte) * D_SPLIT, torch.float32).view(len(yte), D_SPLIT)
                out = model(x)
                test_loss = nn.functional.cross_entropy(out, yte).item()
                acc = (out.argmax(1) == yte).float().mean().item()
    w = args.warmup if args.steps > args.warmup + 1 else 0
    tail = max(1, min(10, args.steps))
    summary = {
        "sparsity": sparsity, "values": args.values, "steps": args.steps,
        "batch": args.batch, "replicas": args.replicas, "dp_sparsity": args.dp_sparsity,
        "seed": args.seed,
        "fwd_bytes_per_step": statistics.mean(fwd_bytes),
        "bwd_bytes_per_step": statistics.mean(bwd_bytes),
        "dense_bytes_per_step": local * D_SPLIT * 4,
        "step_ms_median": statistics.median(times[w:]) * 1e3,
        "dp_bytes_per_step": dp.bytes_sent / args.steps,
        "final_loss": losses[-1], "loss_last10": statistics.mean(losses[-tail:]),
        "first_loss": losses[0], "test_loss": test_loss, "test_acc": acc,
    }
    return stage, replica, summary


def worker(rank, world, args, port):
    torch.set_num_threads(1)
    if port is not None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo")
    groups = {}
    for stage in (0, 1):
        ranks = [2 * r + stage for r in range(args.replicas)]
        groups[stage] = (dist.new_group(ranks) if args.replicas > 1 else None, ranks)
    results = []
    for sparsity in args.sparsities:
        dist.barrier()
        stage, replica, summ = run_one(args, sparsity, rank, world, groups)
        # stage 1 of replica 0 has the loss, stage 0 the timing: merge on rank 0
        gathered = [None] * world
        dist.all_gather_object(gathered, (stage, replica, summ))
        if rank == 0:
            s0 = next(s for st, r, s in gathered if st == 0 and r == 0)
            s1 = next(s for st, r, s in gathered if st == 1 and r == 0)
            merged = dict(s0)
            for key in ("final_loss", "loss_last10", "first_loss", "test_loss", "test_acc"):
                merged[key] = s1[key]
            merged["replica_losses"] = [s["final_loss"] for st, r, s in gathered if st == 1]
            merged["dp_bytes_per_step_stage1"] = s1["dp_bytes_per_step"]
            print("RESULT " + json.dumps(merged), flush=True)
            results.append(merged)
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    # leave without interpreter finalization: Gloo's threads can otherwise abort the
    # process ("terminate called without an active exception", seen in CI once the work
    # was done and written; tests/workers/torchrun_exit.py has the same ending)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    args = parse_args(argv)
    world = 2 * args.replicas
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != world:
            raise SystemExit(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but --replicas "
                             f"{args.replicas} needs {world} processes")
        worker(int(os.environ["RANK"]), world, args, None)
        return
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(world, args, _free_port()), nprocs=world, join=True)


if __name__ == "__main__":
    main()
