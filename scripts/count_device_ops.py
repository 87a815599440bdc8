"""Device work per training step on the CUDA code path, counted without a GPU.

What runs: hvdsparse's whole step through either front door at world size 2 (two
processes, Gloo, localhost), with ``HVDSPARSE_FORCE_TRITON=1`` and Triton's interpreter
(``TRITON_INTERPRET=1``), so every dispatch in hvdsparse takes the branch a CUDA tensor
takes, and ``validate=False`` (the CUDA default: no host parse of received messages):

* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (``gradient_as_bucket_view=True``:
  otherwise DDP's reducer adds two copies per parameter and step whatever the hook;
  ``--no-bucket-view`` counts them, in ``model``) + ``hvdsparse.ddp.State`` /
  ``hvdsparse.ddp.hook`` under ``torchrun --nproc-per-node 2`` (Gloo);
* ``horovod``: ``hvdsparse.DistributedOptimizer`` under ``horovodrun -np 2 --gloo``.

The model has ResNet-50's topology and its 161 parameter tensors (bottlenecks
[3, 4, 6, 3], 1x1 / 3x3 / 1x1 convolutions, batch norm, downsample branches, fc) with
every channel width divided by ``--div`` (default 8), fed ``--image`` x ``--image``
inputs. Sizes that decide the launch structure are scaled with the widths so the
layer classification and the bucket count resemble the full model: the compressors'
``min_numel`` (1024, dense-by-policy below it) and the bucket sizes (DDP's
``bucket_cap_mb`` 25 and first bucket 1 MiB; Horovod's ``fusion_threshold`` 1 MiB) are
divided by ``div**2``, the factor by which the element counts shrink.

Counted, over ``--steps`` steady-state steps after ``--warmup`` steps, from the start of
backward to the end of the optimizer step (the forward is not counted):

* device ops: aten ops dispatched (a ``TorchDispatchMode``) that would be a CUDA kernel
  launch -- everything but views, metadata, allocations and host scalar reads, and not
  the ops Triton's interpreter issues while emulating a kernel;
* Triton launches (one GPU launch each);
* Horovod's collectives (C++ calls that bypass torch's dispatcher), one launch each;
  ``torch.distributed``'s are aten ops already.

Triton's interpreter runs with two repeated costs of its own bookkeeping cut
(:func:`_lighter_interpreter`; the kernels, their launches and values are unchanged).

Each aten op counts as one launch (on CUDA most are exactly one kernel, a few one to
three): an upper-bound proxy for ``cudaLaunchKernel`` calls. ``scripts/gpu_check.sh``
counts real launches with ``torch.profiler`` where a GPU is lent.

Phases (the issuing Python stack decides; first rule that applies):
``nonfinite`` (a function named ``*nonfinite*`` / ``*finite*`` on the stack),
``feedback`` (``*feed_back*`` / ``*feedback*``, or codec's own-payload decode used by
the residual update and masking), then the innermost hvdsparse frame: ``exchange``
(transport.py: the collectives), ``encode`` (codec's encoder, a strategy's ``launch``),
``decode`` (codec's decoder, a strategy's ``finish``), ``compress`` (compressors,
momentum, the Adam recipe and its bucket steps, the kernels' wrappers), ``other`` (the
rest of hvdsparse: the front door's plumbing), ``model`` (no hvdsparse frame, or issued by ``torch.optim``
code called from hvdsparse's wrapper: autograd, DDP's reducer, the optimizer).

The optimizer: ``SGD(momentum=0.9, foreach=True)`` (``--optimizer sgd``, the default; the
DDP hook without ``optimizer=``) or ``AdamW(lr=1e-3, weight_decay=0.01, foreach=True)``
(``--optimizer adamw``; the DDP hook with ``optimizer=``: the Adam recipe, its update
wire, the counted step past its one-step warm-up); a method label ``topk+adamw`` counts
that method under AdamW whatever ``--optimizer`` says; a ``+graphs`` part
(``topk+graphs``, ``topk+adamw+graphs``) counts it with ``cuda_graphs=True``, the CUDA
graphs emulated (``scripts/graph_emulator.py``): each replay one launch, in the phase
that issued it (``--warmup 6`` reaches the replays of every segment: the non-finite
counts alternate between two tensors, so a bucket's encode has two keys); a ``+via-X``
part (``topk+via-dense+graphs``) makes every bucket take exchange ``X`` (``exchange=``:
``allgather``, ``split``, ``dense``, ``balanced``) instead of the cost model's choice.

``added`` = total - the same count of a plain local step (no DDP, no hvdsparse: the
model's own backward + the same optimizer's step, counted the same way); the framework's dense
exchange without hvdsparse (DDP's allreduce, ``hvd.DistributedOptimizer``) is counted
too, for reference. Buckets: exchange launches
per step. The bound checked by ``scripts/launch_bound_check.py``: ``added <= 20 *
buckets + 10`` per step.

    .venv/bin/python scripts/count_device_ops.py --out docs/bench/device_ops/resnet50_div8
    .venv/bin/python scripts/count_device_ops.py --doors ddp --methods topk --where
    .venv/bin/python scripts/count_device_ops.py --methods topk,topk+adamw
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from launchcount import LaunchCounter  # noqa: E402

#: label -> (description, constructor expression; ``MIN`` is the scaled min_numel)
METHODS = {
    "topk": ("TopK 1%", "TopK(0.01, min_numel=MIN)"),
    "threshold": ("Threshold 99%", "Threshold(0.99, min_numel=MIN)"),
    "adacomp": ("AdaComp", "AdaComp(min_numel=MIN)"),
    "qsgd4": ("QSGD 4-bit", "QSGD(4, min_numel=MIN)"),
    "randomk": ("RandomK 1%", "RandomK(0.01, min_numel=MIN)"),
    "slimdp": ("Slim-DP (0.2, 0.1)", "SlimDP(alpha=0.2, beta=0.1, min_numel=MIN)"),
}
DOORS = ("ddp", "horovod")
PHASES = ("compress", "encode", "exchange", "decode", "feedback", "nonfinite", "other",
          "model")
#: aten ops that launch nothing on a GPU (views, metadata, allocation, host reads)
NO_LAUNCH = {"view", "detach", "slice", "t", "expand", "as_strided", "_unsafe_view",
             "alias", "unsqueeze", "squeeze", "reshape", "select", "permute", "transpose",
             "split", "chunk", "unbind", "empty", "new_empty", "empty_strided",
             "empty_like", "lift_fresh", "_reshape_alias", "narrow", "set_",
             "resolve_conj", "resolve_neg", "view_as", "_record_function_enter_new",
             "_record_function_exit", "is_nonzero", "_local_scalar_dense", "unfold",
             "split_with_sizes", "expand_as", "movedim", "flatten", "unflatten",
             "is_same_size", "_to_copy_meta", "record_stream", "size", "stride",
             "dim", "numel", "is_contiguous", "sym_size", "sym_stride", "sym_numel",
             "sym_storage_offset", "storage_offset", "_has_compatible_shallow_copy_type",
             "_is_any_true", "item", "view_as_real", "view_as_complex"}
_ENCODE_FUNCS = {"encode", "new_message", "_narrow_message", "_joined", "run",
                 "segment_pieces", "count_bytes", "_as_bytes", "_narrow_bin_counts",
                 "_narrow_all_bin_counts", "_sections"}
_FEEDBACK_CODEC = {"payload_to_dense", "sent_positions", "_own_segments"}


# ------------------------------------------------------------------------------ model

def resnet50(div: int = 8, num_classes: int = 1000):
    """ResNet-50 (torchvision's v1.5 topology: stride on the 3x3 conv) with every
    channel width divided by ``div``: 161 parameter tensors at any ``div``."""
    import torch.nn as nn

    def w(c):
        return max(1, c // div)

    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, stride):
            super().__init__()
            out = mid * 4
            self.conv1 = nn.Conv2d(cin, mid, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(mid)
            self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(mid)
            self.conv3 = nn.Conv2d(mid, out, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(out)
            self.relu = nn.ReLU()
            self.downsample = None
            if stride != 1 or cin != out:
                self.downsample = nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False),
                                                nn.BatchNorm2d(out))

        def forward(self, x):
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.relu(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            return self.relu(y + (x if self.downsample is None else self.downsample(x)))

    layers = [nn.Conv2d(3, w(64), 7, 2, 3, bias=False), nn.BatchNorm2d(w(64)), nn.ReLU(),
              nn.MaxPool2d(3, 2, 1)]
    cin = w(64)
    for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(Bottleneck(cin, w(mid), stride if b == 0 else 1))
            cin = w(mid) * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, max(1, num_classes // div))]
    return nn.Sequential(*layers)


# ------------------------------------------------------------------------- counting

def _phase(frame) -> str:
    """The phase of the op issued with ``frame`` innermost (see the module doc)."""
    hv = []                                   # hvdsparse frames, innermost first
    f = frame
    while f is not None:
        fn = f.f_code.co_filename
        if "/hvdsparse/" in fn or "/kernels/" in fn:
            hv.append((fn, f.f_code.co_name))
        elif "/torch/optim/" in fn and not hv:
            return "model"                    # the wrapped optimizer's own step
        f = f.f_back
    if not hv:
        return "model"
    for fn, name in hv:
        low = name.lower()
        if "nonfinite" in low or "finite" in low:
            return "nonfinite"
    for fn, name in hv:
        low = name.lower()
        if "feed_back" in low or "feedback" in low or (
                "/hvdsparse/codec" in fn and name in _FEEDBACK_CODEC):
            return "feedback"
    for fn, name in hv:
        if "/kernels/" in fn or fn.endswith("/ops.py"):
            continue                      # kernel wrappers: the caller decides
        if fn.endswith("transport.py"):
            return "exchange"
        if "/hvdsparse/codec" in fn:
            return "encode" if name in _ENCODE_FUNCS else "decode"
        if "/exchange/" in fn:
            if name == "launch":
                return "encode"
            if name.startswith("finish") or name.startswith("_finish") or \
                    "phase2" in name or "decode" in name:
                return "decode"
        if "/compressors/" in fn or fn.endswith(("momentum.py", "adam.py", "adam_bucket.py")):
            return "compress"
    if all("/kernels/" in fn or fn.endswith("/ops.py") for fn, _ in hv):
        return "compress"
    return "other"


class Counting(LaunchCounter):
    """Installs the dispatch mode and the Triton launch counter (once per process);
    counts by phase (:meth:`record`)."""

    def __init__(self, where: bool = False):
        import torch

        super().__init__(skip=NO_LAUNCH)
        self.where = where
        self.reset()
        self._torch = torch

    def reset(self):
        self.aten = Counter()         # phase -> ops
        self.triton = Counter()       # phase -> launches
        self.names = Counter()        # (kind, name) -> n
        self.sites = Counter()
        self.buckets = 0
        self.strategies = Counter()

    def record(self, kind, name, frame):
        ph = _phase(frame)
        (self.triton if kind == "triton" else self.aten)[ph] += 1
        self.names[f"{kind}:{name}"] += 1
        if self.where:
            site = "torch / model"
            f = frame
            while f is not None:
                fn = f.f_code.co_filename
                if "/hvdsparse/" in fn or "/kernels/" in fn:
                    site = f"{Path(fn).name}:{f.f_lineno} {f.f_code.co_name}"
                    break
                f = f.f_back
            self.sites[f"{kind}:{name} @ {site} [{ph}]"] += 1

    def result(self, steps: int) -> dict:
        per = {}
        for ph in PHASES:
            a, t = self.aten.get(ph, 0), self.triton.get(ph, 0)
            if a or t:
                per[ph] = dict(aten=a / steps, triton=t / steps, total=(a + t) / steps)
        total = (sum(self.aten.values()) + sum(self.triton.values())) / steps
        out = dict(total=total, phases=per, buckets=self.buckets / steps,
                   strategies={k: v / steps for k, v in self.strategies.items()},
                   top=[(k, v / steps) for k, v in self.names.most_common(25)])
        if self.where:
            out["sites"] = [(k, v / steps) for k, v in self.sites.most_common()]
        return out


#: Horovod's collectives (C++ calls outside torch's dispatcher): one launch each
HVD_COLLECTIVES = ("allgather_async", "alltoall_async", "allreduce_async_", "allreduce_async",
                   "grouped_allreduce_async_", "grouped_allreduce_async",
                   "broadcast_async_", "broadcast_async", "sparse_allreduce_async")


def _patch_horovod_counter(cnt: Counting):
    """Count Horovod's collective calls as launches (``hvd`` kind), wherever the module
    that calls them imported them from."""
    import horovod.torch as hvd_mod
    import horovod.torch.mpi_ops as mpi_ops
    mods = [hvd_mod, mpi_ops]
    try:
        import horovod.torch.optimizer as hopt
        mods.append(hopt)
    except ImportError:
        pass
    for name in HVD_COLLECTIVES:
        orig = getattr(mpi_ops, name, None)
        if orig is None:
            continue

        def wrapped(*a, _orig=orig, _name=name, **k):
            if cnt.active and not cnt.inside:
                cnt.record("hvd", _name, sys._getframe(1))
            return _orig(*a, **k)
        for mod in mods:
            if getattr(mod, name, None) is orig:
                setattr(mod, name, wrapped)


def _patch_bucket_counter(cnt: Counting):
    """Count exchange launches (one per bucket and step) and their strategies."""
    import hvdsparse.exchange as ex
    for name, mod in ex.STRATEGIES.items():
        orig = mod.launch

        def launch(spec, payloads, ctx, _orig=orig, _name=name, **kw):
            if cnt.active:
                cnt.buckets += 1
                cnt.strategies[_name] += 1
            return _orig(spec, payloads, ctx, **kw)
        mod.launch = launch


# -------------------------------------------------------------------------- workers

def _lighter_interpreter():
    """Cut two repeated costs out of Triton's interpreter (``TRITON_INTERPRET=1``), which
    runs every kernel here and takes most of a counted job's time; interpreter
    bookkeeping only: the kernels run the same interpreted builtins on the same values,
    no launch, aten op or value changes.

    * ``triton.language`` patched once per kernel launch instead of again on every call
      of a ``@triton.jit`` helper (``tl.sum``, ``tl.max``, ``tl.cumsum``, the kernels'
      own helpers) inside the running kernel. Unpatched, each launch patches the modules
      its kernel sees (``tl``) and restores them when it ends, and each helper call
      patches the modules the helper sees (``tl``, or ``tl.core`` for
      ``triton.language.standard``'s) and never restores them: an ``inspect.getmembers``
      over ``tl`` / ``tl.core``, ``tl.tensor`` and ``tl.math`` per call, a fifth of a
      step's time. Here each launch patches both ``tl`` and ``tl.core`` (the only
      modules the interpreter patches) and restores both when it ends; a helper call
      finds them patched and patches nothing.
    * the numpy dtype of a Triton dtype (``_get_np_dtype``, called for every value the
      interpreter makes) remembered per dtype name instead of rebuilding Triton's
      16-entry table on every call, a tenth of a step's time. Triton looks scalar dtypes
      up by name (``dtype.__eq__``), a block by its element dtype, and maps every pointer
      to ``uint64`` before the table; the memo keeps that order.
    """
    import types

    import triton.language as tl
    import triton.runtime.interpreter as ti
    needed = ("_patch_lang", "_LangPatchScope", "GridExecutor", "_get_np_dtype")
    if not all(hasattr(ti, n) for n in needed) or \
            getattr(ti._patch_lang, "_once_per_launch", False):
        return                          # another interpreter layout: run it as it is
    patch_lang, run_grid, np_dtype = ti._patch_lang, ti.GridExecutor.__call__, ti._get_np_dtype
    both = types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core})
    launches = []                       # per launch in progress: patched yet?

    def _patch_lang(fn):
        if not launches:                # outside a launch: as Triton does it
            return patch_lang(fn)
        if not launches[-1]:            # the launch's own patch: both modules
            launches[-1] = True
            return patch_lang(both)
        return ti._LangPatchScope()     # a helper call: patched already, nothing to undo

    def grid_call(self, *a, **k):
        launches.append(False)
        try:
            return run_grid(self, *a, **k)
        finally:
            launches.pop()

    memo = {}

    def _get_np_dtype(tt):
        if isinstance(tt, tl.block_type):
            tt = tt.element_ty
        if isinstance(tt, tl.pointer_type):
            return np_dtype(tt)         # Triton's first check: no table built
        name = getattr(tt, "name", None)
        out = memo.get(name)
        if out is None:
            out = np_dtype(tt)
            if name is not None:
                memo[name] = out
        return out

    _patch_lang._once_per_launch = True
    ti._patch_lang = _patch_lang
    ti.GridExecutor.__call__ = grid_call
    ti._get_np_dtype = _get_np_dtype


def _worker(args):
    os.environ.update(HVDSPARSE_FORCE_TRITON="1", TRITON_INTERPRET="1")
    sys.path.insert(0, args.tree_path)
    import torch
    torch.set_num_threads(1)
    _lighter_interpreter()
    import hvdsparse
    import hvdsparse.compressors as C
    if not Path(hvdsparse.__file__).resolve().is_relative_to(Path(args.tree_path)):
        raise SystemExit(f"hvdsparse imported from {hvdsparse.__file__}, not from "
                         f"{args.tree_path}")

    door = args.door
    if door == "horovod":
        import horovod.torch as hvd
        hvd.init()
        rank, world = hvd.rank(), hvd.size()
    else:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        if hasattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES"):
            dist._DEFAULT_FIRST_BUCKET_BYTES = max(1, (1 << 20) // args.div ** 2)
        import hvdsparse.ddp
    cnt = Counting(where=args.where)
    _patch_bucket_counter(cnt)
    if any(with_graphs(m) for m in args.methods):
        _install_graphs(cnt)
    if door == "horovod":
        _patch_horovod_counter(cnt)
    scale = args.div ** 2
    min_numel = max(1, 1024 // scale)
    out = {}
    # a method label ``m+adamw`` counts ``m`` under AdamW whatever ``--optimizer`` says,
    # against the plain local step under AdamW (``none+adamw``)
    extra = ["none+adamw"] if any(split_label(m, args.optimizer)[1] == "adamw" and
                                  args.optimizer != "adamw" for m in args.methods) else []
    for label in ["none", "dense"] + extra + args.methods:
        torch.manual_seed(0)
        model = resnet50(args.div)
        params = list(model.parameters())
        assert len(params) == 161, len(params)
        method, optimizer = split_label(label, args.optimizer)
        if optimizer == "adamw":    # the Adam recipe (its update wire by default)
            base = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01,
                                     foreach=True)
        else:
            base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9,
                                  foreach=True)      # the CUDA default: multi-tensor ops
        opt, net = base, model
        if label == "dense":             # the framework's own dense allreduce, no hvdsparse
            if door == "ddp":
                from torch.nn.parallel import DistributedDataParallel as DDP
                net = DDP(model, bucket_cap_mb=25.0 / scale,
                          gradient_as_bucket_view=args.bucket_view)
            else:
                opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        elif method != "none":
            comp = eval(METHODS[method][1].replace("MIN", str(min_numel)),
                        {k: getattr(C, k) for k in C.__all__})
            if door == "ddp":
                from torch.nn.parallel import DistributedDataParallel as DDP
                net = DDP(model, bucket_cap_mb=25.0 / scale,
                          gradient_as_bucket_view=args.bucket_view)
                # the Adam recipe needs the optimizer (SGD: counted without it, no
                # momentum correction in the hook)
                state = hvdsparse.ddp.State(
                    comp, model.named_parameters(), validate=False,
                    optimizer=base if optimizer == "adamw" else None,
                    cuda_graphs=with_graphs(label), exchange=exchange_of(label))
                net.register_comm_hook(state, hvdsparse.ddp.hook)
            else:
                opt = hvdsparse.DistributedOptimizer(
                    base, named_parameters=model.named_parameters(), compression=comp,
                    validate=False, fusion_threshold=max(1, (1 << 20) // scale),
                    cuda_graphs=with_graphs(label), exchange=exchange_of(label))
        g = torch.Generator().manual_seed(1 + rank)

        def step(count):
            x = torch.randn(args.batch, 3, args.image, args.image, generator=g)
            y = torch.randint(0, max(1, 1000 // args.div), (args.batch,), generator=g)
            model.zero_grad(set_to_none=False)
            loss = torch.nn.functional.cross_entropy(net(x), y)
            if count:
                cnt.__enter__()
            try:
                loss.backward()
                opt.step()
            finally:
                if count:
                    cnt.__exit__(None, None, None)

        for _ in range(args.warmup):
            step(False)
        cnt.reset()
        for _ in range(args.steps):
            step(True)
        out[label] = cnt.result(args.steps)
        if door == "ddp" and label != "none":
            del net
    if rank == 0:
        for label in args.methods:
            base = "none+adamw" if split_label(label, args.optimizer)[1] == "adamw" and \
                args.optimizer != "adamw" else "none"
            out[label]["added"] = out[label]["total"] - out[base]["total"]
        print("RESULT " + json.dumps(dict(door=door, world=world, results=out)), flush=True)
    if door == "ddp":
        import torch.distributed as dist
        dist.destroy_process_group()
    print(f"HVDSPARSE-OK rank={rank}", flush=True)


def split_label(label: str, default_optimizer: str):
    """``(method, optimizer)`` of a method label: ``"topk"`` -> (topk, the default),
    ``"topk+adamw"`` -> (topk, adamw); ``+graphs`` (:func:`with_graphs`) and ``+via-X``
    (:func:`exchange_of`) parts aside."""
    parts = [x for x in label.split("+")[1:] if x != "graphs" and not x.startswith("via-")]
    return label.split("+")[0], (parts[0] if parts else default_optimizer)


def with_graphs(label: str) -> bool:
    """Whether a method label counts the step with ``cuda_graphs=True`` (``+graphs``)."""
    return "graphs" in label.split("+")[1:]


def exchange_of(label: str) -> str:
    """The ``exchange=`` a method label asks for: ``X`` of a ``+via-X`` part, else
    ``"auto"``."""
    via = [x[4:] for x in label.split("+")[1:] if x.startswith("via-")]
    return via[0] if via else "auto"


def _install_graphs(cnt: Counting):
    """``cuda_graphs=True`` on the forced-Triton CPU path: the step engine's CUDA graph
    backend replaced by ``graph_emulator.EmulatedGraphs``; a replay counts as one launch
    (a graph launch, in the phase that issued it) and the launches it re-issues are not
    counted. A capture's work counts as an eager run's (it happens in the warm-up)."""
    from graph_emulator import EmulatedGraphs
    from hvdsparse import device_graphs
    emu = EmulatedGraphs()
    replay = emu.replay

    def counted_replay(rec):
        if cnt.active and not cnt.inside:
            cnt.record("graph", "replay", sys._getframe(1))
        was, cnt.active = cnt.active, False
        try:
            replay(rec)
        finally:
            cnt.active = was
    emu.replay = counted_replay
    device_graphs.CudaGraphs = lambda: emu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_door(door: str, methods, *, np: int = 2, div: int = 8, image: int = 32,
             batch: int = 2, warmup: int = 3, steps: int = 1, where: bool = False,
             timeout: float = 1800, tree=None, bucket_view: bool = True,
             optimizer: str = "sgd") -> dict:
    """Launch the counting worker for one front door at world size ``np``; returns
    rank 0's result dict (``door``, ``world``, ``results``: label -> counts).
    ``tree``: the checkout whose hvdsparse is counted (default: this one);
    ``optimizer``: ``"sgd"`` (momentum 0.9) or ``"adamw"`` (the Adam recipe)."""
    tree = str(Path(tree or ROOT).resolve())
    bindir = Path(sys.executable).parent
    wargs = ["--worker", "--door", door, "--methods", ",".join(methods), "--div", str(div),
             "--image", str(image), "--batch", str(batch), "--warmup", str(warmup),
             "--steps", str(steps), "--tree-path", tree, "--optimizer", optimizer] + \
        (["--where"] if where else []) + ([] if bucket_view else ["--no-bucket-view"])
    if door == "ddp":
        launcher = bindir / "torchrun"
        cmd = [str(launcher if launcher.exists() else "torchrun"), "--nproc-per-node",
               str(np), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               __file__, *wargs]
    else:
        launcher = bindir / "horovodrun"
        cmd = [str(launcher if launcher.exists() else "horovodrun"), "-np", str(np),
               "--gloo", sys.executable, __file__, *wargs]
    env = dict(os.environ, OMP_NUM_THREADS="1", HVDSPARSE_FORCE_TRITON="1",
               TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=env, timeout=timeout, cwd=tree)
    line = [x for x in p.stdout.splitlines() if "RESULT " in x]
    if p.returncode != 0 or not line:
        raise RuntimeError(f"{door} counting job failed (rc {p.returncode}): "
                           f"{' '.join(cmd)}\n{p.stdout[-6000:]}")
    return json.loads(line[0].split("RESULT ", 1)[1])


def bound(buckets: float) -> float:
    """The launch budget of one step beyond the model's own: 20 per bucket + 10."""
    return 20 * buckets + 10


def table(results: dict, methods) -> str:
    head = ["door", "method", "buckets", "total", "added", "added/bucket", "bound",
            "compress", "encode", "exchange", "decode", "feedback", "nonfinite", "other",
            "model", "triton"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for door, res in results.items():
        for base, what in (("none", ""), ("none+adamw", ", adamw")):
            r0 = res["results"].get(base)
            if r0 is not None:
                rows.append(f"| {door} | plain local step (model's own{what}) | - | "
                            f"{r0['total']:.0f} | 0 | - | - |" + " - |" * 7 +
                            f" {r0['total']:.0f} | 0 |")
        rd = res["results"].get("dense")
        if rd is not None:
            rows.append(f"| {door} | dense ({'DDP allreduce' if door == 'ddp' else 'Horovod'}"
                        f", no hvdsparse) | - | {rd['total']:.0f} | "
                        f"{rd['total'] - res['results']['none']['total']:.0f} | - | - |"
                        + " - |" * 8 + " 0 |")
        for m in methods:
            r = res["results"][m]
            ph = r["phases"]
            nb = r["buckets"]
            meth, opt = split_label(m, "")
            cells = [door, METHODS[meth][0] + (f", {opt}" if opt else "") +
                     (f", via {exchange_of(m)}" if exchange_of(m) != "auto" else "") +
                     (", cuda_graphs" if with_graphs(m) else ""), f"{nb:g}",
                     f"{r['total']:.0f}", f"{r['added']:.0f}",
                     f"{r['added'] / nb:.1f}" if nb else "-", f"{bound(nb):.0f}"]
            cells += [f"{ph.get(p, {}).get('total', 0):.0f}" for p in PHASES]
            cells.append(f"{sum(v['triton'] for v in ph.values()):.0f}")
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--doors", default=",".join(DOORS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--div", type=int, default=8, help="channel widths / div")
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"),
                    help="SGD(momentum=0.9) (momentum correction under SGD), or AdamW("
                         "lr=1e-3, weight_decay=0.01) (the Adam recipe: its update wire)")
    ap.add_argument("--out", default=None, help="path stem for .json / .md")
    ap.add_argument("--no-bucket-view", dest="bucket_view", action="store_false",
                    help="DDP with gradient_as_bucket_view=False (DDP's default: two "
                         "copies per parameter and step, counted in 'model')")
    ap.add_argument("--where", action="store_true",
                    help="also list where (hvdsparse file:line) every counted op is issued")
    ap.add_argument("--tree", default=None,
                    help="count the hvdsparse of another checkout (e.g. `git archive REV | "
                         "tar -x -C DIR`; default: this one)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree-path", default=str(ROOT), help=argparse.SUPPRESS)
    ap.add_argument("--door", default="ddp", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.methods = args.methods.split(",") if isinstance(args.methods, str) else args.methods
    for m in args.methods:
        m, opt = split_label(m, args.optimizer)
        if m not in METHODS or opt not in ("sgd", "adamw"):
            raise SystemExit(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    if args.worker:
        return _worker(args)
    doors = args.doors.split(",")
    results = {}
    for door in doors:
        if door not in DOORS:
            raise SystemExit(f"unknown door {door!r}; choose from {', '.join(DOORS)}")
        t0 = time.time()
        results[door] = run_door(door, args.methods, np=args.np, div=args.div,
                                 image=args.image, batch=args.batch, warmup=args.warmup,
                                 steps=args.steps, where=args.where, tree=args.tree,
                                 bucket_view=args.bucket_view, optimizer=args.optimizer)
        print(f"[{door}: {time.time() - t0:.0f} s]", flush=True)
        print(table({door: results[door]}, args.methods), flush=True)
        if args.out:                  # each door as soon as it is counted
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(f"{args.out}.{door}.json").write_text(json.dumps(results[door]))
    tab = table(results, args.methods)
    if args.where:
        for door, res in results.items():
            for m in args.methods:
                print(f"\n{door} / {m}: ops per step by issuing site")
                for site, n in res["results"][m].get("sites", []):
                    print(f"  {n:7.1f}  {site}")
    print(f"device ops + Triton launches per step (aten ops as launches), ResNet-50 "
          f"topology (161 tensors) widths / {args.div}, {args.image}x{args.image} inputs, "
          f"{args.optimizer}, "
          f"world size {args.np}, validate=False, forced Triton (interpreter)")
    print(tab)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".json").write_text(json.dumps(dict(
            tree=str(Path(args.tree or ROOT).resolve()), div=args.div, image=args.image,
            batch=args.batch, np=args.np, bucket_view=args.bucket_view,
            optimizer=args.optimizer,
            warmup=args.warmup, steps=args.steps, results=results), indent=1))
        Path(args.out + ".md").write_text(tab + "\n")
    return results


if __name__ == "__main__":
    main()
