#!/usr/bin/env python
"""Train a model with Horovod + hvdsparse and report accuracy, step time and wire bytes.

Run it under horovodrun, for example::

    horovodrun -np 4 -H localhost:4 --gloo python scripts/train.py \
        --workload wide --compression topk --ratio 0.01 --exchange auto --epochs 8

Or under torchrun, with DistributedDataParallel and hvdsparse's DDP communication hook
(``hvdsparse.ddp``; ``--compression none`` is DDP's allreduce, ``fp16`` its
``fp16_compress_hook``)::

    torchrun --nproc-per-node 4 scripts/train.py --launcher torchrun \
        --workload wide --compression topk --ratio 0.01 --exchange auto --epochs 8

Workloads (data ships with scikit-learn, nothing is downloaded):

* ``digits``: MLP 64-256-256-10 (~85 K parameters) on scikit-learn's 8x8 digits.
  Compute-light and communication-light: a functional check.
* ``wide``: MLP 64-W-W-10 (W = ``--width``, default 2048: 4.35 M parameters, 17.4 MB
  of fp32 gradient per step) on the same digits. The forward/backward costs ~15 ms on
  one CPU core, while a dense fp32 allreduce of 17.4 MB costs ~0.8 s on a 1 Gbit/s
  link shared by 4 ranks: communication dominates, as it does for large models on a
  cloud network.

The split is fixed (``--seed``): 80% train (sharded across ranks, reshuffled every
epoch), 20% held out; test loss/accuracy is evaluated on every rank's shard of the
held-out split and summed across ranks.

``--compression none`` is Horovod's plain allreduce (``hvd.DistributedOptimizer``),
``fp16`` is Horovod's own ``hvd.Compression.fp16``; every other choice is the user's
line ``hvd.DistributedOptimizer(opt, named_parameters=..., compression=hvdsparse.X(...))``,
which ``import hvdsparse`` routes to ``hvdsparse.DistributedOptimizer``.

Outputs: one line per epoch from rank 0 through :mod:`logging` (loss, accuracy, step
time, wire bytes per rank per step, effective compression rate); a tqdm progress bar
on rank 0 only when stderr is a terminal (never under horovodrun, whose output is a
pipe, so logs stay one readable line per epoch); optional TensorBoard (``--logdir``),
optional JSON with every figure (``--json``), checkpoints (``--checkpoint PATH``: model +
optimizer + metadata in PATH from rank 0, each rank's compressor/optimizer-wrapper state
and RNG in PATH.rank<r>; ``--resume`` continues from it and reproduces the uninterrupted
run).

The training loop is the one to copy: it does not block the host every step. The loss
stays on the device (summed there, read once per epoch), ``torch.cuda.synchronize()``
and ``optimizer.stats()`` are called at epoch ends only, and per-step times are host
timestamps. ``--profile`` asks for the per-step breakdown a benchmark needs (a device
synchronize around forward/backward and ``optimizer.step()``, the optimizer's
per-step bytes and compress / wait / decode times): ``scripts/bench_network.py``
passes it. ``--amp fp16`` shows the mixed-precision loop for both launchers
(``torch.autocast`` + ``torch.amp.GradScaler``, the scaler handed to hvdsparse as
``grad_scaler=``; under Horovod ``synchronize()`` / ``unscale_`` /
``skip_synchronize()``, under torchrun PyTorch's plain ``scaler.step``); ``--amp bf16``
autocasts without a scaler. Under torchrun the hook gets the SGD optimizer
(``optimizer=``), so momentum correction follows the same rule as under Horovod and the
same command gives the same numbers under either launcher (tests/test_ddp.py).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # run from a checkout without `pip install .`
    sys.path.insert(0, str(ROOT))

COMPRESSIONS = ("none", "fp16", "topk", "threshold", "adacomp", "slimdp", "randomk", "qsgd")

# CLI option -> constructor keyword, per compressor. Only options given on the command
# line are passed, so each compressor's own defaults apply otherwise.
COMPRESSOR_ARGS = {
    "topk": ("TopK", {"ratio": "ratio", "values": "values"}),
    "threshold": ("Threshold", {"sparsity": "sparsity", "life_span": "life_span",
                                "values": "values"}),
    "adacomp": ("AdaComp", {"bin_size": "bin_size", "scale": "scale"}),
    "slimdp": ("SlimDP", {"alpha": "alpha", "beta": "beta", "core_period": "core_period",
                          "c": "c"}),
    "randomk": ("RandomK", {"ratio": "ratio", "shared_seed": "shared_seed",
                            "values": "values"}),
    "qsgd": ("QSGD", {"bits": "bits", "bucket_size": "bucket_size"}),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=("digits", "wide"), default="digits")
    g.add_argument("--launcher", choices=("horovod", "torchrun"), default="horovod",
                   help="horovod: run under horovodrun (hvd.DistributedOptimizer); "
                        "torchrun: run under torchrun --nproc-per-node N with "
                        "DistributedDataParallel and hvdsparse's DDP comm hook "
                        "(scripts/torchrun_support.py)")
    g.add_argument("--width", type=int, default=None,
                   help="hidden width (default 256 for digits, 2048 for wide)")
    g.add_argument("--epochs", type=int, default=10)
    g.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many optimizer steps in total (0: no limit)")
    g.add_argument("--batch-size", type=int, default=32, help="per rank")
    g.add_argument("--lr", type=float, default=None,
                   help="SGD learning rate (default 0.1)")
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA (device = hvd.local_rank()) when available, else CPU")
    g.add_argument("--eval-every", type=int, default=0,
                   help="also evaluate every N steps (finer time-to-target); 0: per epoch")
    g.add_argument("--target-acc", type=float, default=None,
                   help="record the training time when test accuracy first reaches this")

    g = p.add_argument_group("compression")
    g.add_argument("--compression", choices=COMPRESSIONS, default="none")
    g.add_argument("--exchange", default="auto",
                   help="hvdsparse exchange strategy: auto | allgather | split | dense")
    g.add_argument("--ratio", type=float, default=None, help="topk / randomk: kept fraction")
    g.add_argument("--values", default=None,
                   help="topk / threshold / randomk value encoding: fp32 fp16 bf16 int8 int4 int2")
    g.add_argument("--sparsity", type=float, default=None, help="threshold: dropped fraction")
    g.add_argument("--life-span", type=int, default=None,
                   help="threshold: steps between threshold re-computations")
    g.add_argument("--bin-size", type=int, default=None, help="adacomp: bin length")
    g.add_argument("--scale", type=float, default=None, help="adacomp: H = G + (scale-1) dW")
    g.add_argument("--alpha", type=float, default=None, help="slimdp: communicated fraction")
    g.add_argument("--beta", type=float, default=None, help="slimdp: core fraction")
    g.add_argument("--core-period", type=int, default=None, help="slimdp: core re-selection period")
    g.add_argument("--c", default=None,
                   help="slimdp: gradient weight in the significance (a number or 'auto')")
    g.add_argument("--shared-seed", action="store_true", default=None,
                   help="randomk: every rank picks the same indices (no index traffic)")
    g.add_argument("--bits", type=int, default=None, help="qsgd: 8, 4 or 2")
    g.add_argument("--bucket-size", type=int, default=None, help="qsgd: quantisation bucket")
    g.add_argument("--warmup", default=None, metavar="exp,T[,S] | rt,T",
                   help="topk / threshold / randomk: density warm-up over T steps "
                        "(ExponentialWarmup(T, stages=S) or RtWarmup(T))")
    g.add_argument("--override", action="append", default=None, metavar="PATTERN:KEY=VALUE",
                   help="per-layer compressor setting (repeatable), e.g. '4.weight:ratio=0.1' "
                        "gives the wide/digits MLP's output layer 10%% (README: the output "
                        "layer); becomes overrides={PATTERN: {KEY: VALUE}}")
    g.add_argument("--backward-passes-per-step", type=int, default=1)
    g.add_argument("--local-gradient", default=None,
                   help="hvdsparse local-gradient mode (sum | partial | error)")
    g.add_argument("--sync-period", type=int, default=None,
                   help="hvdsparse: parameter averaging period with --local-gradient")
    g.add_argument("--momentum-correction", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="hvdsparse: DGC momentum correction (SGD momentum); default: the "
                        "library's rule (hvdsparse.momentum.resolve_momentum_correction)")
    g.add_argument("--momentum-masking", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="hvdsparse: with momentum correction, DGC's momentum-factor "
                        "masking (u[sent] = 0); default: the library's (off)")
    g.add_argument("--clip-grad-norm", type=float, default=None,
                   help="hvdsparse: DGC local gradient clipping threshold")
    g.add_argument("--amp", choices=("off", "fp16", "bf16"), default="off",
                   help="mixed precision: torch.autocast in that dtype; fp16 adds a "
                        "torch.amp.GradScaler handed to hvdsparse (grad_scaler=)")

    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, help="write every metric to this JSON file (rank 0)")
    g.add_argument("--logdir", default=None, help="TensorBoard log directory (rank 0)")
    g.add_argument("--checkpoint", default=None,
                   help="save model/optimizer to PATH (rank 0) and per-rank compressor "
                        "state to PATH.rank<r> after every epoch")
    g.add_argument("--keep-checkpoints", action="store_true",
                   help="also keep a copy of every epoch's checkpoint as PATH.e<epoch>")
    g.add_argument("--resume", nargs="?", const="", default=None, metavar="PATH",
                   help="resume from PATH (default: --checkpoint) if it exists")
    g.add_argument("--measure-lo", action="store_true",
                   help="rank 0 reads the loopback byte counter from /proc/net/dev: the "
                        "real bytes on the wire of all ranks (only meaningful in a private "
                        "network namespace, as bench_network.py --topology shared uses)")
    g.add_argument("--measure-iface", default=None, metavar="IFACE",
                   help="rank 0 reads IFACE's tx/rx byte counters from /proc/net/dev: its "
                        "own link's bytes (bench_network.py --topology per-node, one rank "
                        "per emulated node)")
    g.add_argument("--profile", action="store_true",
                   help="per-step breakdown: synchronize the device around forward/backward "
                        "and optimizer.step() and read optimizer.stats() every step "
                        "(benchmarks; costs a host sync per step on CUDA)")
    g.add_argument("--record-cost-model", action="store_true",
                   help="hvdsparse: record the exchange cost model's per-strategy byte "
                        "prediction of every step (bench_network.py --sweep)")
    g.add_argument("--no-progress", action="store_true",
                   help="no tqdm bar (there is none anyway unless stderr is a terminal)")
    args = p.parse_args(argv)
    if args.width is None:
        args.width = 256 if args.workload == "digits" else 2048
    if args.lr is None:
        args.lr = 0.1
    return args


# ----------------------------------------------------------------------------- data/model

def load_data(seed):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0 - 0.5).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return (torch.from_numpy(xtr), torch.from_numpy(ytr).long(),
            torch.from_numpy(xte), torch.from_numpy(yte).long())


def build_model(width):
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


# ----------------------------------------------------------------------------- optimizer

def parse_overrides(items):
    """``["PATTERN:KEY=VALUE", ...]`` -> ``{PATTERN: {KEY: VALUE}}`` (values read as
    Python literals where they parse: 0.1, True, 'int4')."""
    import ast
    out = {}
    for item in items:
        pat, sep, setting = item.rpartition(":")
        key, eq, value = setting.partition("=")
        if not sep or not pat or not eq or not key:
            raise SystemExit(f"--override {item!r}: expected PATTERN:KEY=VALUE, "
                             f"e.g. '4.weight:ratio=0.1'")
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass
        out.setdefault(pat, {})[key] = value
    return out


def build_compressor(args):
    try:
        import hvdsparse
    except ImportError as exc:
        raise SystemExit(f"--compression {args.compression} needs hvdsparse importable: {exc}")
    cls_name, mapping = COMPRESSOR_ARGS[args.compression]
    cls = getattr(hvdsparse, cls_name, None)
    if cls is None:
        import hvdsparse.compressors as comps
        cls = getattr(comps, cls_name, None)
    if cls is None:
        raise SystemExit(f"hvdsparse has no compressor class {cls_name!r} "
                         f"(needed for --compression {args.compression})")
    kwargs = {kw: getattr(args, opt) for opt, kw in mapping.items()
              if getattr(args, opt) is not None}
    if "c" in kwargs and kwargs["c"] != "auto":
        kwargs["c"] = float(kwargs["c"])
    if args.override:
        kwargs["overrides"] = parse_overrides(args.override)
    if args.warmup:
        if args.compression not in ("topk", "threshold", "randomk"):
            raise SystemExit(f"--warmup applies to topk / threshold / randomk, not "
                             f"--compression {args.compression}")
        kind, *nums = args.warmup.split(",")
        try:
            if kind not in ("exp", "rt") or not 1 <= len(nums) <= (2 if kind == "exp" else 1):
                raise ValueError
            kwargs["warmup"] = (kind, *[int(x) for x in nums])
        except ValueError:
            raise SystemExit(f"--warmup must be exp,T[,S] or rt,T with integers, "
                             f"got {args.warmup!r}")
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise SystemExit(f"hvdsparse.{cls_name}({kwargs}) failed: {exc}")


def build_optimizer(args, model, hvd, grad_scaler=None):
    base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                           weight_decay=args.weight_decay)
    if args.launcher == "torchrun":    # DDP + comm hook: see main() / torchrun_support
        return base, (None if args.compression in ("none", "fp16") else
                      build_compressor(args))
    named = list(model.named_parameters())
    if args.compression in ("none", "fp16"):
        comp = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none
        opt = hvd.DistributedOptimizer(base, named_parameters=named, compression=comp,
                                       backward_passes_per_step=args.backward_passes_per_step)
        return opt, None
    import hvdsparse
    compressor = build_compressor(args)
    kwargs = dict(named_parameters=named, compression=compressor, exchange=args.exchange,
                  backward_passes_per_step=args.backward_passes_per_step)
    if args.local_gradient is not None:
        kwargs["local_gradient"] = args.local_gradient
    if args.sync_period is not None:
        kwargs["sync_period"] = args.sync_period
    if args.momentum_correction is not None:
        kwargs["momentum_correction"] = args.momentum_correction
    if args.momentum_masking is not None:
        kwargs["momentum_masking"] = args.momentum_masking
    if args.clip_grad_norm is not None:
        kwargs["clip_grad_norm"] = args.clip_grad_norm
    if grad_scaler is not None:
        kwargs["grad_scaler"] = grad_scaler     # residuals in unscaled units (README)
    # The user's own line: `import hvdsparse` routes hvd.DistributedOptimizer calls whose
    # compression is an hvdsparse compressor to hvdsparse.DistributedOptimizer.
    opt = hvd.DistributedOptimizer(base, **kwargs)
    assert hasattr(opt, "compression_state_dict"), "hvdsparse routing is not installed"
    return opt, compressor


# ----------------------------------------------------------------------------- statistics

def dense_allreduce_bytes(numel, itemsize, world):
    """Bytes one rank sends per allreduce of ``numel`` elements (ring / halving-doubling:
    2 (P-1)/P of the buffer); 0 on one rank."""
    return 0 if world == 1 else int(2 * (world - 1) / world * numel * itemsize)


def wire_stats(args, opt, numel, world):
    """Per-rank bytes sent / received by the last step, the strategies used and the
    compress / wait / decode times (from ``hvdsparse.DistributedOptimizer.stats()``)."""
    if args.compression in ("none", "fp16"):
        itemsize = 2 if args.compression == "fp16" else 4
        b = dense_allreduce_bytes(numel, itemsize, world)
        return {"bytes_sent": b, "bytes_received": b, "strategy": "allreduce"}
    last = opt.stats()["last"]
    strategies = list(last["strategies"])
    return {"bytes_sent": int(last["bytes_sent_total"]),
            "bytes_received": int(last["bytes_recv_total"]),
            "bytes_by_strategy": {"sent": dict(last["bytes_sent"]),
                                  "received": dict(last["bytes_recv"])},
            "strategy": ", ".join(f"{st} x{strategies.count(st)}"
                                  for st in sorted(set(strategies))),
            "time_compress_s": last["time_compress_s"], "time_wait_s": last["time_wait_s"],
            "time_decode_s": last["time_decode_s"]}


class CostModelRecorder:
    """Records the auto cost model's per-strategy prediction (per-rank link bytes) at
    every bucket launch, by wrapping the scheduler's ``strategy_for(b, payloads)``."""

    def __init__(self, opt):
        from hvdsparse.exchange import cost_model
        sched = opt.scheduler
        alpha = getattr(sched, "alpha_bytes", 0.0)
        self.last = {}
        orig = sched.strategy_for

        def strategy_for(b, payloads):
            try:
                self.last[b] = cost_model.costs(sched.figures(b, payloads), alpha)
            except Exception as exc:  # keep training; say why predictions are missing
                self.last[b] = {"error": repr(exc)}
            return orig(b, payloads)
        sched.strategy_for = strategy_for

    def step_prediction(self):
        """Per strategy: predicted bytes summed over buckets; ``auto``: the sum of each
        bucket's cheapest strategy (what exchange="auto" picks)."""
        tot, auto = {}, 0.0
        for c in self.last.values():
            if "error" in c:
                return {"error": c["error"]}
            for k, v in c.items():
                tot[k] = tot.get(k, 0.0) + v
            auto += min(c.values())
        tot["auto"] = auto
        return tot


def iface_bytes(iface):
    """(rx, tx) byte counters of ``iface`` from /proc/net/dev (this network namespace),
    or None when the interface does not exist."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    return None


def lo_bytes():
    """tx bytes of the loopback interface (all ranks' traffic in a private namespace)."""
    c = iface_bytes("lo")
    return None if c is None else c[1]


def epoch_wire_stats(args, opt, numel, world, before, steps):
    """Mean per-rank bytes sent / received per step over the ``steps`` steps since the
    ``before`` snapshot of ``optimizer.stats()["totals"]`` (one stats() call per epoch
    instead of one per step), plus the mean compress / wait / decode seconds."""
    if args.compression in ("none", "fp16"):
        itemsize = 2 if args.compression == "fp16" else 4
        b = dense_allreduce_bytes(numel, itemsize, world)
        return {"bytes_sent": b, "bytes_received": b, "strategy": "allreduce"}, None
    st = opt.stats()
    tot, last = st["totals"], st["last"]
    n = tot["steps"] - (before["steps"] if before else 0)
    if n <= 0 or steps <= 0:
        return {}, tot

    def d(key):
        return (tot[key] - (before[key] if before else 0)) / n
    strategies = list(last.get("strategies", []))
    return {"bytes_sent": d("bytes_sent_total"), "bytes_received": d("bytes_recv_total"),
            "bytes_by_strategy": {"sent": dict(last["bytes_sent"]),
                                  "received": dict(last["bytes_recv"])},
            "strategy": ", ".join(f"{s} x{strategies.count(s)}" for s in sorted(set(strategies))),
            "time_compress_s": d("time_compress_s"), "time_wait_s": d("time_wait_s"),
            "time_decode_s": d("time_decode_s")}, tot


# ----------------------------------------------------------------------------- checkpoint

def rank_file(path, rank):
    return f"{path}.rank{rank}"


def save_checkpoint(path, hvd, model, opt, compressor, meta, keep_epoch=None):
    rank = hvd.rank()
    per_rank = {"rng_torch": torch.get_rng_state(), "world_size": hvd.size(), "meta": meta}
    if compressor is not None:
        per_rank["compressor"] = opt.compression_state_dict()
    targets = [path] + ([f"{path}.e{keep_epoch}"] if keep_epoch is not None else [])
    for tgt in targets:
        Path(tgt).parent.mkdir(parents=True, exist_ok=True)
        tmp = rank_file(tgt, rank) + ".tmp"
        torch.save(per_rank, tmp)
        os.replace(tmp, rank_file(tgt, rank))
        if rank == 0:
            full = {"model": model.state_dict(), "optimizer": opt.state_dict(), "meta": meta}
            torch.save(full, tgt + ".tmp")
            os.replace(tgt + ".tmp", tgt)
    hvd.allreduce(torch.zeros(1), name="ckpt.barrier")  # every rank's file is written


def load_checkpoint(path, hvd, model, opt, compressor, log):
    """Load PATH on rank 0 (broadcast later by the caller) and PATH.rank<r> on every rank.
    Returns the metadata dict."""
    rank = hvd.rank()
    meta = None
    if rank == 0:
        full = torch.load(path, map_location="cpu", weights_only=False)
        model.load_state_dict(full["model"])
        opt.load_state_dict(full["optimizer"])
        meta = full["meta"]
    meta = hvd.broadcast_object(meta, root_rank=0, name="ckpt.meta")
    rf = rank_file(path, rank)
    if not os.path.exists(rf):
        log(f"WARNING: {rf} missing: rank {rank} restarts its compressor residuals at zero",
            all_ranks=True)
        return meta
    per_rank = torch.load(rf, map_location="cpu", weights_only=False)
    if per_rank.get("world_size") != hvd.size():
        log(f"WARNING: checkpoint was written by {per_rank.get('world_size')} ranks, "
            f"this run has {hvd.size()}: compressor residuals restart at zero", all_ranks=True)
        return meta
    torch.set_rng_state(per_rank["rng_torch"])
    if compressor is not None and "compressor" in per_rank:
        opt.load_compression_state_dict(per_rank["compressor"])
    return meta


# ----------------------------------------------------------------------------- main

def setup_logging(rank):
    """Rank 0 logs INFO (one line per epoch), every other rank WARNING and above only,
    so a P-rank job prints one readable stream; each line names its rank."""
    logger = logging.getLogger("hvdsparse.train")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return logger


def _compiled_loops():
    """Whether hvdsparse's compiled CPU loops were usable in this run (else why not)."""
    from hvdsparse import native
    return True if native.available() else native.why_unavailable()


def main(argv=None):
    args = parse_args(argv)
    if args.launcher == "torchrun":
        from torchrun_support import TorchrunHvd, check_args
        check_args(args)
        hvd = TorchrunHvd(args.device)
    else:
        import horovod.torch as hvd
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    logger = setup_logging(rank)

    def log(msg, all_ranks=False):
        """all_ranks: a warning every rank prints; otherwise rank 0's INFO line."""
        if all_ranks:
            logger.warning(msg)
        else:
            logger.info(msg)

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but torch.cuda.is_available() is False")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, hvd.local_size())))

    writer = None
    if args.logdir and rank == 0:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise SystemExit(f"--logdir needs TensorBoard (pip install tensorboard): {exc}")
        writer = SummaryWriter(args.logdir)
    elif args.logdir:
        try:
            import tensorboard  # noqa: F401  (fail on every rank, not only rank 0)
        except ImportError as exc:
            raise SystemExit(f"--logdir needs TensorBoard (pip install tensorboard): {exc}")

    torch.manual_seed(args.seed)
    xtr, ytr, xte, yte = load_data(args.seed)
    model = build_model(args.width).to(device)
    numel = sum(p.numel() for p in model.parameters())
    # mixed precision: autocast in --amp's dtype; fp16 also needs a loss scaler, which
    # hvdsparse must know (grad_scaler=) so residuals stay in unscaled units
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
    scaler = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    opt, compressor = build_optimizer(args, model, hvd, scaler)
    if args.launcher == "torchrun":
        from torchrun_support import adapt_optimizer, wrap_model
        model, ddp_state = wrap_model(args, model, compressor, device, optimizer=opt,
                                      grad_scaler=scaler)
        opt = adapt_optimizer(opt, ddp_state)

    steps_per_epoch = len(xtr) // (world * args.batch_size)
    if steps_per_epoch == 0:
        raise SystemExit(f"--batch-size {args.batch_size} x {world} ranks exceeds the "
                         f"{len(xtr)} training samples")

    history = {"epochs": [], "evals": [], "step_times": [], "fwd_bwd_times": [],
               "opt_step_times": [], "bytes_sent": [], "bytes_received": []}
    start_epoch, global_step, train_time = 0, 0, 0.0
    time_to_target = None
    recorder = CostModelRecorder(opt) if (args.record_cost_model and compressor is not None) else None

    resume_path = None
    if args.resume is not None:
        resume_path = args.resume or args.checkpoint
        if not resume_path:
            raise SystemExit("--resume needs a PATH or --checkpoint")
    if resume_path and os.path.exists(resume_path):
        meta = load_checkpoint(resume_path, hvd, model, opt, compressor, log)
        if scaler is not None and meta.get("grad_scaler") is not None:
            scaler.load_state_dict(meta["grad_scaler"])
        start_epoch, global_step = meta["epoch"], meta["global_step"]
        train_time, time_to_target = meta["train_time"], meta["time_to_target"]
        history = meta["history"]
        log(f"resumed from {resume_path} at epoch {start_epoch}, step {global_step}")
    elif resume_path:
        log(f"no checkpoint at {resume_path}: starting from scratch")

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    if rank == 0:
        log(f"workload={args.workload} width={args.width} params={numel:,} "
            f"({numel * 4 / 1e6:.1f} MB fp32) world={world} device={device} "
            f"compression={args.compression} exchange={args.exchange} "
            f"steps/epoch={steps_per_epoch}")
        out = getattr(compressor, "output_layer", None)
        if out is not None:       # TopK / Threshold: README, "The output layer"
            log(f"output layer {out!r} sent at density >= {compressor.output_ratio} "
                f"(output_ratio=None turns this off)")

    xte_local, yte_local = xte[rank::world].to(device), yte[rank::world].to(device)

    def evaluate():
        model.eval()
        with torch.no_grad():
            out = model(xte_local)
            loss = F.cross_entropy(out, yte_local, reduction="sum")
            correct = (out.argmax(1) == yte_local).sum()
        model.train()
        t = torch.stack([loss.float().cpu(), correct.float().cpu(),
                         torch.tensor(float(len(yte_local)))])
        t = hvd.allreduce(t, op=hvd.Sum, name="eval.sum")
        return float(t[0] / t[2]), float(t[1] / t[2])

    def record_eval(epoch):
        nonlocal time_to_target
        loss, acc = evaluate()
        history["evals"].append({"step": global_step, "epoch": epoch,
                                 "train_time": train_time, "test_loss": loss, "test_acc": acc})
        if (args.target_acc is not None and time_to_target is None
                and acc >= args.target_acc):
            time_to_target = train_time
            history["target_step"] = global_step
        if writer is not None:
            writer.add_scalar("test/accuracy", acc, global_step)
            writer.add_scalar("test/loss", loss, global_step)
        return loss, acc

    lo_start = lo_bytes() if (args.measure_lo and rank == 0) else None
    iface_start = None
    if args.measure_iface and rank == 0:
        iface_start = iface_bytes(args.measure_iface)
        if iface_start is None:
            raise SystemExit(f"--measure-iface {args.measure_iface}: no such interface in "
                             f"/proc/net/dev of rank 0's network namespace")
    lo_steps = 0
    if not history["evals"]:
        record_eval(0)

    stop = False
    # Per-step device synchronisation only when asked (--profile): a host sync per step
    # would serialise the CPU with the GPU, which is exactly what the library avoids.
    device_sync = torch.cuda.synchronize if use_cuda else (lambda: None)
    step_sync = device_sync if args.profile else (lambda: None)
    show_bar = rank == 0 and not args.no_progress and sys.stderr.isatty()
    run_totals = opt.stats()["totals"] if compressor is not None else None
    ep_totals = run_totals
    for epoch in range(start_epoch, args.epochs):
        perm = np.random.RandomState(args.seed * 1000 + epoch).permutation(len(xtr))
        perm = perm[rank::world][:steps_per_epoch * args.batch_size]
        bar = range(steps_per_epoch)
        if show_bar:
            from tqdm import tqdm
            bar = tqdm(bar, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False,
                       dynamic_ncols=True, file=sys.stderr)
        step_losses, ep_times, ep_first_step = [], [], global_step
        for i in bar:
            idx = torch.from_numpy(perm[i * args.batch_size:(i + 1) * args.batch_size])
            xb, yb = xtr[idx].to(device), ytr[idx].to(device)
            step_sync()
            t0 = time.perf_counter()
            opt.zero_grad()
            with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                loss = F.cross_entropy(model(xb), yb)
            if scaler is None:
                loss.backward()
                step_sync()
                t1 = time.perf_counter()
                opt.step()
            else:                    # PyTorch's GradScaler loop, as in the README
                scaler.scale(loss).backward()
                step_sync()
                t1 = time.perf_counter()
                if args.launcher == "torchrun":
                    scaler.step(opt)             # the hook already averaged
                else:
                    opt.synchronize()            # Horovod: exchange, then unscale
                    scaler.unscale_(opt)
                    with opt.skip_synchronize():
                        scaler.step(opt)
                scaler.update()
            step_sync()
            t2 = time.perf_counter()
            step_losses.append(loss.detach())      # read once per epoch, not per step
            train_time += t2 - t0
            global_step += 1
            lo_steps += 1
            history["step_times"].append(t2 - t0)
            ep_times.append(t2 - t0)
            if args.profile:
                ws = wire_stats(args, opt, numel, world)
                history["fwd_bwd_times"].append(t1 - t0)
                history["opt_step_times"].append(t2 - t1)
                history["bytes_sent"].append(ws.get("bytes_sent"))
                history["bytes_received"].append(ws.get("bytes_received"))
                for key in ("time_compress_s", "time_wait_s", "time_decode_s"):
                    if key in ws:
                        history.setdefault(key, []).append(ws[key])
            if recorder is not None:
                history["cost_model_prediction"] = recorder.step_prediction()
            if show_bar:
                bar.set_postfix(step_s=f"{t2 - t0:.3f}")
            if args.eval_every and global_step % args.eval_every == 0 and i + 1 < steps_per_epoch:
                record_eval(epoch + 1)
            if args.max_steps and global_step >= args.max_steps:
                stop = True
                break
        # epoch end: the one place the host waits for the device and reads the stats
        t_sync = time.perf_counter()
        device_sync()
        train_time += time.perf_counter() - t_sync
        losses = torch.stack(step_losses).float().cpu().tolist() if step_losses else []
        ws, ep_totals = epoch_wire_stats(args, opt, numel, world, ep_totals, len(losses))
        for key in ("strategy", "bytes_by_strategy"):
            if key in ws:
                history[key] = ws[key]
        test_loss, test_acc = record_eval(epoch + 1)
        dense = dense_allreduce_bytes(numel, 4, world) or numel * 4
        sent = ws.get("bytes_sent")
        ep = {"epoch": epoch + 1, "steps": global_step,
              "train_loss": sum(losses) / max(1, len(losses)),
              "test_loss": test_loss, "test_acc": test_acc, "train_time": train_time,
              "median_step_s": statistics.median(ep_times) if ep_times else None,
              "bytes_sent_per_rank_step": sent,
              "bytes_received_per_rank_step": ws.get("bytes_received"),
              "effective_compression": (dense / sent) if sent else None}
        for key in ("time_compress_s", "time_wait_s", "time_decode_s"):
            if key in ws:
                ep["mean_" + key] = ws[key]
        history["epochs"].append(ep)
        comp = (f" | {sent / 1e6:.3f} MB sent/rank/step, {dense / sent:.1f}x vs dense fp32 allreduce"
                if sent else "")
        step_ms = f"{ep['median_step_s'] * 1e3:.1f} ms" if ep_times else "-"
        log(f"epoch {epoch + 1:3d} | train loss {ep['train_loss']:.4f} | test loss "
            f"{test_loss:.4f} acc {test_acc * 100:.2f}% | step {step_ms}"
            f" | train time {train_time:.1f} s{comp}")
        if writer is not None:
            for j, lval in enumerate(losses):
                writer.add_scalar("train/loss", lval, ep_first_step + j + 1)
            for j, st in enumerate(ep_times):
                writer.add_scalar("train/step_time_s", st, ep_first_step + j + 1)
            writer.add_scalar("epoch/test_accuracy", test_acc, epoch + 1)
            if sent:
                writer.add_scalar("wire/bytes_sent_per_rank_step", sent, epoch + 1)
                writer.add_scalar("epoch/effective_compression", dense / sent, epoch + 1)
        if args.checkpoint:
            meta = {"epoch": epoch + 1, "global_step": global_step, "train_time": train_time,
                    "time_to_target": time_to_target, "history": history, "args": vars(args),
                    "grad_scaler": scaler.state_dict() if scaler is not None else None}
            save_checkpoint(args.checkpoint, hvd, model, opt, compressor, meta,
                            keep_epoch=(epoch + 1) if args.keep_checkpoints else None)
        if stop:
            break

    lo_total = None
    if lo_start is not None:
        lo_total = lo_bytes() - lo_start
    iface_delta = None
    if iface_start is not None:
        end = iface_bytes(args.measure_iface)
        iface_delta = (end[0] - iface_start[0], end[1] - iface_start[1])
    run_ws, _ = epoch_wire_stats(args, opt, numel, world, run_totals, lo_steps)

    # step time: the slowest rank's median (all ranks wait for each other every step)
    med = statistics.median(history["step_times"][-lo_steps:]) if lo_steps else float("nan")
    med_all = hvd.allreduce(torch.tensor([med]), op=hvd.Max, name="final.med")
    if rank == 0:
        st = history["step_times"]
        # per-step lists with --profile; otherwise this run's mean from the stats totals
        sent = [b for b in history["bytes_sent"] if b is not None] or \
            ([run_ws["bytes_sent"]] if run_ws.get("bytes_sent") is not None else [])
        recv = [b for b in history["bytes_received"] if b is not None] or \
            ([run_ws["bytes_received"]] if run_ws.get("bytes_received") is not None else [])
        final = history["evals"][-1]
        wire = None
        if lo_total is not None and lo_steps:
            wire = lo_total / lo_steps / world
        elif iface_delta is not None and lo_steps:
            wire = iface_delta[1] / lo_steps
        summary = {
            "workload": args.workload, "width": args.width, "params": numel,
            "dense_bytes": numel * 4, "world_size": world, "device": str(device),
            "compression": args.compression, "exchange": args.exchange,
            "steps": global_step, "train_time_s": train_time,
            "median_step_s": statistics.median(st) if st else None,
            "median_step_s_slowest_rank": float(med_all[0]),
            "median_fwd_bwd_s": (statistics.median(history["fwd_bwd_times"])
                                 if history["fwd_bwd_times"] else None),
            "median_opt_step_s": (statistics.median(history["opt_step_times"])
                                  if history["opt_step_times"] else None),
            "profiled_steps": bool(args.profile),
            "bytes_sent_per_rank_step": statistics.mean(sent) if sent else None,
            "bytes_received_per_rank_step": statistics.mean(recv) if recv else None,
            # bytes a dense fp32 allreduce sends per rank / bytes this method sends per rank
            "effective_compression": ((dense_allreduce_bytes(numel, 4, world) or numel * 4)
                                      / statistics.mean(sent)) if sent and statistics.mean(sent) else None,
            "lo_bytes_per_rank_step": (lo_total / lo_steps / world) if lo_total is not None and lo_steps else None,
            "lo_steps": lo_steps,
            # real link bytes per rank per step: loopback tx / ranks (shared medium) or
            # rank 0's own interface tx (one rank per emulated node)
            "wire_bytes_per_rank_step": wire,
            "iface": args.measure_iface,
            "iface_rx_bytes_per_step": (iface_delta[0] / lo_steps) if iface_delta and lo_steps else None,
            "iface_tx_bytes_per_step": (iface_delta[1] / lo_steps) if iface_delta and lo_steps else None,
            "final_test_acc": final["test_acc"], "final_test_loss": final["test_loss"],
            "best_test_acc": max(e["test_acc"] for e in history["evals"]),
            "target_acc": args.target_acc, "time_to_target_s": time_to_target,
            "target_step": history.get("target_step"),
            "strategy": history.get("strategy"),
            "bytes_by_strategy": history.get("bytes_by_strategy"),
            "cost_model_prediction": history.get("cost_model_prediction"),
            # TopK's bucket path on the CPU (hvdsparse/native): which code path ran
            "cpu_compiled_loops": _compiled_loops(),
        }
        for key in ("time_compress_s", "time_wait_s", "time_decode_s"):
            if history.get(key):
                summary["median_" + key] = statistics.median(history[key])
            elif key in run_ws:
                summary["mean_" + key] = run_ws[key]
        log("summary: " + json.dumps({k: v for k, v in summary.items()}, default=str))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"summary": summary, "args": vars(args), "history": history}, f,
                          default=str)
        if writer is not None:
            writer.close()
    # torchrun: destroy the process group (see TorchrunHvd.shutdown); Horovod: stop its
    # background thread, as horovod.torch's own examples end.
    hvd.shutdown()
    print(f"HVDSPARSE-OK rank={rank}", flush=True)


if __name__ == "__main__":
    main()
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        # under torchrun, leave without interpreter finalization: Gloo's threads can still
        # abort a finished process there ("terminate called without an active exception",
        # pytorch#190489; seen in CI after HVDSPARSE-OK even with the group destroyed)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
