#!/usr/bin/env python
"""DDP at world size 2 on a GPU: hvdsparse's DDP hook side by side with DDP's dense
allreduce and PyTorch's PowerSGD hook, on ResNet-50 and a GPT-2-small-like LM.

Usage::

    python scripts/bench_ddp_gpu.py --out OUTDIR            # CUDA (scripts/gpu_check.sh)
    python scripts/bench_ddp_gpu.py --device cpu --tiny --out OUTDIR   # plumbing on CPU

Launches (each one launch of 2 rank processes running every mode of one model in turn,
so the modes are compared on the same machine, transport and weights):

* ``gloo-1gpu``: both ranks on ``cuda:0`` (NCCL refuses two ranks on one device), Gloo
  carrying the CUDA tensors; always run on CUDA.
* ``nccl``: one rank per GPU, NCCL; run when 2 or more GPUs are visible.
* on ``--device cpu``: Gloo with CPU tensors.

Models: ``resnet50`` = torchvision's ResNet-50 (batch 32 x 3 x 224 x 224, 1000 classes;
without torchvision, or with ``--tiny``, a small local ResNet-like model, said in the
output and the JSON); ``lm`` = a GPT-2-small-like causal LM written in plain torch
(12 pre-norm blocks of width 768, 12 heads, MLP 4x, GELU, learned positions, vocabulary
16384, tied head; batch 8 x 256 tokens). Data are synthetic (fixed per rank, different
across ranks), weights identical across ranks and modes (one seed), fp32; ResNet-50 trains
with SGD lr 0.01 momentum 0.9, the LM with AdamW(lr=3e-4, weight_decay=0.01) (``--lm-optimizer
sgd``: SGD as ResNet-50), handed to the hvdsparse hook (``optimizer=``: the Adam recipe,
its update wire after one dense warm-up step).

Modes, run in this order of importance (a mode that does not fit the time budget is
skipped and listed as such): ``dense`` (DDP, no hook), ``powersgd-r1`` (PyTorch's
``powerSGD_hook``, rank 1, ``start_powerSGD_iter=2``, so every measured step is
compressed), ``topk`` (``hvdsparse.TopK(0.01)``), ``local`` (forward + backward + step
without DDP or any communication), ``powersgd-r4``, ``threshold``
(``hvdsparse.Threshold(0.99)``), ``adacomp`` (``hvdsparse.AdaComp()``), ``qsgd``
(``hvdsparse.QSGD(bits=4)``), ``randomk`` (``hvdsparse.RandomK(0.01)``), and on CUDA
``topk-graphs`` and ``adacomp-graphs`` (the same with ``cuda_graphs=True``: each bucket
group's compress launches replayed as a CUDA graph, ``hvdsparse/device_graphs.py``).
hvdsparse modes use ``hvdsparse.ddp.State`` + ``hvdsparse.ddp.hook`` with their defaults
and DDP's default buckets. PowerSGD on Gloo
runs with one DDP bucket (``bucket_cap_mb`` above the model size): with several, its
allreduces issued from future callbacks can pair up differently on the two ranks.

Per mode:

* warm-up steps (``--warmup``; their wall time, Triton compiles included, is reported;
  the last one, timed alone between synchronisations, is the step estimate for the budget);
* ``--steps`` measured steps: each rank times every step on the host
  (``time.perf_counter``), with ``torch.cuda.synchronize()`` only before the first and
  after the last; reported: the median over steps of the slower rank's step time, and the
  window's mean (synchronised window / steps);
* ``--profile-steps`` steps under ``torch.profiler`` on rank 0 (CPU + CUDA activities):
  CUDA launches per step (events whose name contains ``LaunchKernel``: ``cudaLaunchKernel``,
  ``cuLaunchKernel``, ``cudaLaunchKernelExC``...), kernels per step (device-side kernel
  events), host syncs per step in the profiler (``cudaStreamSynchronize``,
  ``cudaEventSynchronize``, ``cudaDeviceSynchronize``, the blocking ``cudaMemcpy`` and their
  driver-API twins), and in the same steps ``torch.cuda.set_sync_debug_mode("warn")``'s
  warnings per step (a synchronising call made by torch: ``.item()``, ``.cpu()``,
  ``nonzero``...; recorded through ``warnings.catch_warnings(record=True)``, top call
  sites listed; only calls from Python reach it -- a sync inside C++ worker threads,
  e.g. Gloo's copies of CUDA tensors, is printed to the rank's log and counted only in
  the profiler column). Launches and host syncs count when they start inside a
  profiled step. On CPU the profiler counts top-level ``aten::`` ops instead (a proxy,
  not launches) and host syncs are not counted;
* replicas: SHA-256 of every parameter's bytes on each rank after the last step,
  allgathered; ``identical`` is whether the two digests agree (``local`` trains each rank
  on its own data without communication: not applicable).

Time budget: ``--budget`` seconds, default ``HVDSPARSE_STAGE_BUDGET_S`` (what
``scripts/gpu_check.sh`` exports), else 600. The launches share it (ResNet-50 first, then
the LM, then NCCL); each launch gets a hard deadline, after which its ranks are killed
and the mode in flight is reported as killed. Inside a launch, rank 0 decides before
each mode whether it fits (from the steps timed so far) and after the warm-up how many
measured steps fit, and tells rank 1 (the decision is broadcast, so the ranks never
disagree). A mode that raises is reported with its error; the launch is restarted with
the modes left if time allows. A baseline mode (torch's own: ``local``, ``dense``,
PowerSGD) in which a rank's process died by a signal (a native crash such as torch's heap
abort under the CPU profiler, not a Python error) is run once more in the restarted
launch, and its record says so (``retried_after``); a second crash is its error. An
hvdsparse mode's crash is always its error.

``--tiny``: ResNet-like model of 3 stages (widths 16/32/64) on batch 4 x 3 x 16 x 16,
LM of 2 layers x 64 (vocabulary 512, batch 4 x 32); 2 warm-up, 3 measured, 1 profiled
step. Without CUDA and without ``--device`` the script runs ``--device cpu --tiny``.

Output: a table per launch on stdout (``x dense``: median step over dense DDP's),
``OUTDIR/bench_ddp_gpu.json`` (every row, the environment, skipped / failed modes) and
``OUTDIR/bench_ddp_gpu.md``; each rank's log in
``OUTDIR/bench_ddp_gpu_logs/``. Exit status 0 when every mode that ran finished with
identical replicas (modes skipped for the budget do not fail the run), 1 otherwise.

Ranks are separate processes of this script (``--_worker``), each in its own process
group so that a stuck launch is killed as a whole; the rendezvous port is a free one.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections import Counter
from datetime import timedelta
from pathlib import Path

T_START = time.time()      # the budget counts from here (before torch is imported)
ROOT = Path(__file__).resolve().parents[1]

MODES = ("dense", "powersgd-r1", "topk", "local", "powersgd-r4", "threshold", "adacomp",
         "qsgd", "randomk")
#: hvdsparse modes with ``cuda_graphs=True`` (hvdsparse/device_graphs.py): run by default
#: on CUDA only (elsewhere the setting changes nothing)
GRAPH_MODES = ("topk-graphs", "adacomp-graphs")
TABLE_ORDER = ("local", "dense", "powersgd-r1", "powersgd-r4", "topk", "topk-graphs",
               "threshold", "adacomp", "adacomp-graphs", "qsgd", "randomk")
HVDSPARSE_MODES = ("topk", "threshold", "adacomp", "qsgd", "randomk") + GRAPH_MODES
MODELS = ("resnet50", "lm")
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
               "cudaMemcpy", "cuStreamSynchronize", "cuEventSynchronize",
               "cuCtxSynchronize", "cuMemcpyDtoH", "cuMemcpyHtoD", "cuMemcpy")
DEFAULT_BUDGET = 600.0
SHUTDOWN_S = 20.0          # a launch's grace between its deadline and the kill


# ============================================================================ models
def _local_resnet(tiny: bool):
    """A small ResNet-like model (conv-BN-ReLU stem, residual blocks with BN, global
    pooling, FC) for machines without torchvision and for --tiny."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.b1 = nn.BatchNorm2d(cout)
            self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.b2 = nn.BatchNorm2d(cout)
            self.short = None
            if stride != 1 or cin != cout:
                self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                           nn.BatchNorm2d(cout))

        def forward(self, x):
            y = self.b2(self.c2(self.b1(self.c1(x)).relu()))
            return (y + (x if self.short is None else self.short(x))).relu()

    widths = (16, 32, 64) if tiny else (64, 128, 256, 512)
    layers = [nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
              nn.ReLU()]
    cin = widths[0]
    for i, w in enumerate(widths):
        layers += [Block(cin, w, 1 if i == 0 else 2), Block(w, w, 1)]
        cin = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10 if tiny else 1000)]
    return nn.Sequential(*layers)


def _gpt(vocab, d, layers, heads, seq):
    """GPT-2-style causal LM: token + learned position embedding, ``layers`` pre-norm
    blocks ``x + attn(LN(x))``, ``x + MLP(LN(x))`` (causal softmax attention, MLP
    d -> 4d -> d with GELU, biases), final LayerNorm, head tied to the token embedding."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, heads, d // heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(B, T, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(d)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for b in self.blocks:
                x = b(x)
            return self.ln(x) @ self.tok.weight.t()

    return GPT()


def build(model_name: str, tiny: bool, device, rank: int):
    """(model, batch inputs, targets, loss function, description, parameter count). Same
    weights on every rank (seed 0; DDP also broadcasts rank 0's), data seeded by rank."""
    import torch

    torch.manual_seed(0)
    with torch.device(device):      # initialised on the device: fast for the big models
        return _build(model_name, tiny, device, rank)


def _build(model_name, tiny, device, rank):
    import torch
    import torch.nn.functional as F

    if model_name == "resnet50":
        try:
            import torchvision
        except ImportError:
            torchvision = None
        if tiny or torchvision is None:
            model = _local_resnet(tiny)
            why = "--tiny" if tiny else "torchvision not installed"
            desc = f"local ResNet-like model ({why}; NOT ResNet-50)"
            B, HW, C = (4, 16, 10) if tiny else (32, 224, 1000)
        else:
            model = torchvision.models.resnet50(weights=None)
            desc = f"torchvision {torchvision.__version__} ResNet-50"
            B, HW, C = 32, 224, 1000
        model = model.to(device)
        g = torch.Generator(device="cpu").manual_seed(1000 + rank)
        x = torch.randn(B, 3, HW, HW, generator=g, device="cpu").to(device)
        y = torch.randint(0, C, (B,), generator=g, device="cpu").to(device)
        loss_fn = F.cross_entropy
        desc += f", batch {B} x 3 x {HW} x {HW}"
    elif model_name == "lm":
        vocab, d, layers, heads, seq, B = ((512, 64, 2, 4, 32, 4) if tiny else
                                           (16384, 768, 12, 12, 256, 8))
        model = _gpt(vocab, d, layers, heads, seq).to(device)
        g = torch.Generator(device="cpu").manual_seed(2000 + rank)
        tok = torch.randint(0, vocab, (B, seq + 1), generator=g, device="cpu").to(device)
        x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()

        def loss_fn(logits, target):
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        desc = (f"GPT-2-small-like LM (plain torch): {layers} layers x {d}, {heads} heads, "
                f"vocab {vocab}, tied head, batch {B} x {seq} tokens")
    else:
        raise ValueError(f"unknown model {model_name!r}; expected one of {MODELS}")
    n = sum(p.numel() for p in model.parameters())
    nt = sum(1 for _ in model.parameters())
    desc += f" ({n / 1e6:.2f} M parameters, {nt} tensors)"
    return model, x, y, loss_fn, desc, n


# ============================================================================ worker
class Worker:
    def __init__(self, a):
        import torch
        import torch.distributed as dist
        self.torch, self.dist, self.a = torch, dist, a
        self.rank, self.world = a.rank, a.world
        self.cuda = a.device == "cuda"
        if self.cuda:
            gpu = self.rank if a.transport == "nccl" else 0
            torch.cuda.set_device(gpu)
            self.device = torch.device("cuda", gpu)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(1)   # 2 ranks share the cores: no oversubscription
        backend = "nccl" if a.transport == "nccl" else "gloo"
        kw = {"device_id": self.device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{a.port}",
                                rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=a.pg_timeout), **kw)
        # control messages (go / skip, step counts, digests) on a CPU Gloo group
        self.ctl = dist.new_group(backend="gloo") if backend != "gloo" else None
        self.events = open(a.events, "a", buffering=1)
        self.mode_times = {}           # mode -> wall seconds it took
        self.step_est = None           # seconds per measured step, the slowest mode so far
        self.hvd_est = None            # the same over hvdsparse's modes

    def emit(self, **rec):
        rec["rank"] = self.rank
        self.events.write(json.dumps(rec) + "\n")

    def bcast(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.ctl)
        return box[0]

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    # -------------------------------------------------------------- one mode
    def optimizer(self, model_name, model):
        """The model's optimizer: AdamW for the LM (``--lm-optimizer adamw``), else SGD."""
        if model_name == "lm" and self.a.lm_optimizer == "adamw":
            return self.torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
        return self.torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def make(self, mode, model, opt=None):
        """(module that trains, hvdsparse state or None, note). ``opt``: the optimizer
        over ``model``'s parameters, handed to the hvdsparse hook when it is an Adam."""
        from torch.nn.parallel import DistributedDataParallel as DDP
        dev_ids = [self.device.index] if self.cuda else None
        if mode == "local":
            return model, None, "no DDP, no communication"
        if mode == "dense":
            return DDP(model, device_ids=dev_ids), None, "DDP default allreduce, default buckets"
        if mode.startswith("powersgd"):
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
            r = int(mode.split("-r")[1])
            one_bucket = self.a.transport != "nccl"
            cap = {"bucket_cap_mb": 1e5} if one_bucket else {}
            m = DDP(model, device_ids=dev_ids, **cap)
            st = ps.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                  start_powerSGD_iter=2)
            m.register_comm_hook(st, ps.powerSGD_hook)
            return m, None, (f"powerSGD_hook rank {r}, start_powerSGD_iter=2, "
                             + ("one DDP bucket" if one_bucket else "default buckets"))
        import hvdsparse
        import hvdsparse.ddp
        base = mode[:-len("-graphs")] if mode in GRAPH_MODES else mode
        comp = {"topk": lambda: hvdsparse.TopK(0.01),
                "threshold": lambda: hvdsparse.Threshold(0.99),
                "adacomp": lambda: hvdsparse.AdaComp(),
                "qsgd": lambda: hvdsparse.QSGD(bits=4),
                "randomk": lambda: hvdsparse.RandomK(0.01)}[base]()
        m = DDP(model, device_ids=dev_ids)
        adam = isinstance(opt, (self.torch.optim.Adam, self.torch.optim.AdamW))
        graphs = mode in GRAPH_MODES
        st = hvdsparse.ddp.State(comp, m.named_parameters(), optimizer=opt if adam else None,
                                 cuda_graphs=graphs)
        m.register_comm_hook(st, hvdsparse.ddp.hook)
        return m, st, (f"hvdsparse.ddp hook, {comp!r}, default buckets"
                       + (", the Adam recipe" if adam else "")
                       + (", cuda_graphs=True" if graphs else ""))

    def run_mode(self, mode, model_name):
        torch, a = self.torch, self.a
        t_mode = time.time()
        model, x, y, loss_fn, desc, nparam = build(model_name, a.tiny, self.device, self.rank)
        opt = self.optimizer(model_name, model)
        net, state, note = self.make(mode, model, opt)
        note += f"; {type(opt).__name__}"

        def step():
            opt.zero_grad(set_to_none=True)
            loss_fn(net(x), y).backward()
            opt.step()

        # warm-up
        self.sync()
        t0 = time.perf_counter()
        for _ in range(a.warmup - 1):
            step()
        self.sync()
        t1 = time.perf_counter()
        step()                      # the last warm-up step alone: the step time estimate
        self.sync()
        per = time.perf_counter() - t1
        warm_s = time.perf_counter() - t0
        # how many measured steps fit (rank 0 decides, both ranks follow)
        if self.rank == 0:
            left = a.deadline - time.time() - 2.0 - (a.profile_steps + 2) * per
            n = int(min(a.steps, max(0, left // max(per, 1e-6))))
        else:
            n = None
        n = self.bcast(n)
        if n < min(3, a.steps):
            self.emit(event="skip", mode=mode, reason=f"budget: only {n} measured steps fit "
                      f"after a {warm_s:.1f} s warm-up")
            return self.cleanup(state), None
        # measured steps
        times = []
        self.sync()
        w0 = time.perf_counter()
        for _ in range(n):
            s0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - s0)
        self.sync()
        window = time.perf_counter() - w0
        # profiled steps (rank 0 counts; rank 1 runs the same steps)
        prof = self.profile(step) if self.rank == 0 else self.plain(step)
        # replicas
        digest = hashlib.sha256()
        for p in net.parameters():
            digest.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
        mine = {"digest": digest.hexdigest(), "times": times, "window": window}
        every = [None] * self.world
        self.dist.all_gather_object(every, mine, group=self.ctl)
        stats = state.stats().get("totals") if state is not None else None
        self.cleanup(state)
        slow = [max(r["times"][i] for r in every) for i in range(n)]
        rec = dict(event="result", mode=mode, model=model_name, model_desc=desc,
                   params=nparam, note=note, steps=n, warmup_steps=a.warmup,
                   warmup_s=warm_s,
                   median_step_ms=1e3 * statistics.median(slow),
                   rank_median_step_ms=[1e3 * statistics.median(r["times"]) for r in every],
                   mean_step_ms=1e3 * max(r["window"] for r in every) / n,
                   identical=(None if mode == "local"
                              else len({r["digest"] for r in every}) == 1),
                   digests=[r["digest"][:16] for r in every],
                   mode_wall_s=time.time() - t_mode, **prof)
        if stats is not None:
            rec["hvdsparse_totals"] = _jsonable(stats)   # all steps of the mode
        return rec, window / n

    def cleanup(self, state):
        if state is not None and hasattr(state, "remove_hooks"):
            state.remove_hooks()
        import gc
        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.empty_cache()
        self.dist.barrier(group=self.ctl)

    def plain(self, step):
        for _ in range(self.a.profile_steps):
            step()
        self.sync()
        return {}

    def profile(self, step):
        """Counts over --profile-steps steps on this rank (see the module docstring).
        Host-side events (launches, syncs) count when they start inside a step (each step
        is a ``record_function`` range), so the closing synchronize is not counted;
        device-side kernels count over the whole window (the steps' kernels may finish
        after their step's host range)."""
        torch = self.torch
        from torch.profiler import ProfilerActivity, profile, record_function
        K = self.a.profile_steps
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.sync()
        with profile(activities=acts) as prof:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if self.cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    for _ in range(K):
                        with record_function("bench_ddp_gpu_step"):
                            step()
                finally:
                    if self.cuda:
                        torch.cuda.set_sync_debug_mode(0)
            self.sync()
        out = {"profile_steps": K}
        if self.cuda:
            evs = _flat_events(prof)      # (name, on the device, start)
            ranges = [(t0, t1) for name, _, t0, t1 in evs if name == "bench_ddp_gpu_step"]

            def in_step(t):
                return any(lo <= t <= hi for lo, hi in ranges)

            # API calls are told apart by name (their device tag differs across versions)
            launches = sum(1 for name, _, t, _ in evs if "LaunchKernel" in name and in_step(t))
            kernels = sum(1 for name, dev, _, _ in evs if dev and _is_kernel(name))
            syncs = Counter(name for name, _, t, _ in evs
                            if name in SYNC_EVENTS and in_step(t))
            sync_warn = [w for w in caught if "synchroniz" in str(w.message).lower()]
            sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in sync_warn)
            out.update(launches_per_step=launches / K, kernels_per_step=kernels / K,
                       profiler_syncs_per_step=sum(syncs.values()) / K,
                       profiler_syncs=dict(syncs),
                       sync_warnings_per_step=len(sync_warn) / K,
                       sync_warning_sites=dict(sites.most_common(8)))
        else:
            evs = list(prof.events())
            ranges = [(e.time_range.start, e.time_range.end) for e in evs
                      if e.name == "bench_ddp_gpu_step"]
            top = sum(1 for e in evs if e.name.startswith("aten::")
                      and not _has_aten_parent(e)
                      and any(lo <= e.time_range.start <= hi for lo, hi in ranges))
            out.update(aten_ops_per_step=top / K,
                       note_counts="CPU: top-level aten ops (a proxy, not CUDA launches); "
                                   "host syncs not counted")
        return out

    # -------------------------------------------------------------- the launch
    def run(self):
        a = self.a
        for mode in a.modes.split(","):
            if self.rank == 0:
                left = a.deadline - time.time()
                hvd = mode in HVDSPARSE_MODES
                if self.step_est is None:
                    need = 5.0
                else:   # an hvdsparse step before one was measured: 3x the slowest so far
                    est = (self.hvd_est if hvd and self.hvd_est else
                           self.step_est * (3.0 if hvd else 1.0))
                    need = (a.warmup + min(a.steps, 3) + a.profile_steps + 3) * est * 1.2 + 3.0
                go = left > need
                why = None if go else (f"budget: {left:.0f} s left in this launch, about "
                                       f"{need:.0f} s needed")
            else:
                go, why = None, None
            go, why = self.bcast((go, why))
            if not go:
                self.emit(event="skip", mode=mode, reason=why)
                continue
            self.emit(event="start", mode=mode)
            try:
                rec, per = self.run_mode(mode, a.model)
            except Exception as e:                     # reported; the launch ends
                self.emit(event="error", mode=mode,
                          error=f"{type(e).__name__}: {e}"[:2000])
                traceback.print_exc()
                sys.stdout.flush()
                os._exit(3)
            if rec is not None:
                self.emit(**rec)
            if per is not None:
                self.step_est = per if self.step_est is None else max(self.step_est, per)
                if mode in HVDSPARSE_MODES:
                    self.hvd_est = max(self.hvd_est or 0.0, per)
        self.dist.barrier(group=self.ctl)
        self.dist.destroy_process_group()
        self.emit(event="done")


def _flat_events(prof):
    """[(name, is a device-side event, start, end)] of a finished profile: from the raw
    Kineto events when this torch exposes them (parsing them into FunctionEvents costs
    about 0.2 ms per event: seconds for a ResNet-50 step), else from ``prof.events()``."""
    try:
        raw = prof.profiler.kineto_results.events()
        return [(e.name(), "CUDA" in str(e.device_type()), e.start_ns(), e.end_ns())
                for e in raw]
    except AttributeError:
        return [(e.name, "CUDA" in str(e.device_type), e.time_range.start,
                 e.time_range.end) for e in prof.events()]


def _is_kernel(name):
    """A device-side event that is not a copy, a memset or a synchronisation record
    (runtime / driver API calls are host-side events and never reach here)."""
    return not (name.startswith("Memcpy") or name.startswith("Memset") or "Sync" in name
                or re.match(r"cu(da)?[A-Z]", name))


def _has_aten_parent(e):
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return True
        p = p.cpu_parent
    return False


def _jsonable(x):
    try:
        json.dumps(x)
        return x
    except TypeError:
        if isinstance(x, dict):
            return {str(k): _jsonable(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [_jsonable(v) for v in x]
        return repr(x)


# ============================================================================ parent
LIVE = []      # rank processes of the launch in flight (killed if this process is stopped)


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        if p in LIVE:
            LIVE.remove(p)


def _on_signal(signum, frame):
    """SIGTERM / SIGINT (e.g. an outer ``timeout``): the ranks run in their own sessions,
    so they are killed here before exiting."""
    _kill(list(LIVE))
    sys.exit(128 + signum)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_events(paths):
    ev = []
    for p in paths:
        if p.exists():
            for line in p.read_text().splitlines():
                try:
                    ev.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return ev


def run_launch(args, model, transport, modes, deadline, logdir, tag):
    """Runs ``modes`` of ``model`` in one 2-rank launch (restarted with the modes left
    after a rank's error while time allows). Returns {mode: record}."""
    results = {}
    retried = {}              # mode -> why it runs again (a rank died by a signal in it)
    attempt = 0
    todo = list(modes)
    while todo:
        attempt += 1
        if deadline - time.time() < 10:
            for m in todo:
                results[m] = {"mode": m, "status": "skipped",
                              "reason": "budget: no time left for this launch"}
            break
        port = free_port()
        evpaths, procs, logs = [], [], []
        for r in range(args.world):
            evp = logdir / f"{tag}_try{attempt}_rank{r}.jsonl"
            evpaths.append(evp)
            log = open(logdir / f"{tag}_try{attempt}_rank{r}.log", "w")
            logs.append(log)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker",
                   "--rank", str(r), "--world", str(args.world), "--port", str(port),
                   "--device", args.device, "--transport", transport, "--model", model,
                   "--modes", ",".join(todo), "--events", str(evp),
                   "--lm-optimizer", args.lm_optimizer,
                   "--deadline", repr(deadline), "--warmup", str(args.warmup),
                   "--steps", str(args.steps), "--profile-steps", str(args.profile_steps),
                   "--pg-timeout", str(args.pg_timeout)] + (["--tiny"] if args.tiny else [])
            env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep
                       + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True))
            LIVE.append(procs[-1])
        hard = deadline + SHUTDOWN_S
        killed = False
        failed_rank = None
        while any(p.poll() is None for p in procs):
            if time.time() > hard:
                killed = True
                break
            bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:       # one rank died: give the other a moment, then stop it
                failed_rank = bad[0]
                t_end = time.time() + 10
                while time.time() < t_end and any(p.poll() is None for p in procs):
                    time.sleep(0.2)
                killed = any(p.poll() is None for p in procs)
                break
            time.sleep(0.2)
        _kill(procs)
        for log in logs:
            log.close()
        ev = read_events(evpaths)
        started = None
        for e in ev:
            m = e.get("mode")
            if e["event"] == "start" and e["rank"] == 0:
                started = m
            elif e["event"] == "result" and e["rank"] == 0:
                e = dict(e, status="ok", transport=transport)
                results[m] = e
            elif e["event"] == "skip" and e["rank"] == 0:
                results[m] = {"mode": m, "status": "skipped", "reason": e["reason"]}
            elif e["event"] == "error":
                why = f"rank {e['rank']}: {e['error']}"
                if results.get(m, {}).get("status") == "error":
                    why = results[m]["reason"] + "; " + why
                results[m] = {"mode": m, "status": "error", "reason": why}
        rcs = [p.returncode for p in procs]
        if started is not None and started not in results:
            if killed and failed_rank is None:
                why = f"killed: launch past its deadline (+{SHUTDOWN_S:.0f} s) in this mode"
            else:
                why = (f"rank failed (exit codes {rcs}) without a report; see "
                       f"{logdir.name}/{tag}_try{attempt}_rank*.log")
            results[started] = {"mode": started, "status": "error" if not killed or
                                failed_rank is not None else "killed", "reason": why}
        elif started is None and any(rc != 0 for rc in rcs):
            # died before its first mode (init / rendezvous): report it on every mode
            for m in todo:
                results[m] = {"mode": m, "status": "error",
                              "reason": f"launch failed before its first mode (exit codes "
                                        f"{rcs}); see {logdir.name}/{tag}_try{attempt}_rank0.log"}
        # the rank that died on its own (not one stopped here after it): the first seen,
        # or, when all exited between two polls, the first with a signal's exit code
        dead = failed_rank if failed_rank is not None else None if killed else \
            next((r for r, rc in enumerate(rcs) if rc is not None and rc < 0), None)
        baseline = started in ("local", "dense") or str(started).startswith("powersgd")
        if baseline and started not in retried and dead is not None \
                and rcs[dead] is not None and rcs[dead] < 0:
            retried[started] = (f"rank {dead} died by signal {-rcs[dead]} in try "
                                f"{attempt}; see {logdir.name}/{tag}_try{attempt}_rank"
                                f"{dead}.log")
            print(f"[{tag}] {started}: {retried[started]}; running it again", flush=True)
            results.pop(started, None)
        todo = [m for m in todo if m not in results]
        if killed and failed_rank is None:
            for m in todo:
                results[m] = {"mode": m, "status": "skipped",
                              "reason": "budget: the launch was killed at its deadline"}
            todo = []
    for m, r in results.items():
        r.setdefault("transport", transport)
        r.setdefault("model", model)
        if m in retried:
            r["retried_after"] = retried[m]
    return results


def fmt(v, spec="{:.1f}"):
    return "-" if v is None else spec.format(v)


def table(rows, cuda):
    dense = next((r for r in rows if r["mode"] == "dense" and r["status"] == "ok"), None)
    cols = (["mode", "median step ms", "mean ms", "x dense"] +
            (["launches/step", "kernels/step", "sync warnings/step", "profiler syncs/step"]
             if cuda else ["aten ops/step"]) +
            ["replicas identical", "warm-up s", "steps"])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    order = {m: i for i, m in enumerate(TABLE_ORDER)}
    for r in sorted(rows, key=lambda r: order.get(r["mode"], 99)):
        if r["status"] != "ok":
            lines.append(f"| {r['mode']} | {r['status'].upper()}: {r['reason']} |")
            continue
        ratio = (r["median_step_ms"] / dense["median_step_ms"]) if dense else None
        ident = {None: "n/a", True: "yes", False: "**NO**"}[r["identical"]]
        cells = [r["mode"], fmt(r["median_step_ms"]), fmt(r["mean_step_ms"]),
                 fmt(ratio, "{:.2f}")]
        if cuda:
            cells += [fmt(r.get("launches_per_step"), "{:.0f}"),
                      fmt(r.get("kernels_per_step"), "{:.0f}"),
                      fmt(r.get("sync_warnings_per_step")),
                      fmt(r.get("profiler_syncs_per_step"))]
        else:
            cells += [fmt(r.get("aten_ops_per_step"), "{:.0f}")]
        cells += [ident, fmt(r["warmup_s"]), str(r["steps"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_outputs(out, env, launches, results, t_start, cuda):
    """JSON + markdown of the launches so far (rewritten after every launch, so a run cut
    short by an outer timeout keeps what finished)."""
    skipped = [f"{r['model']}/{r['transport']}/{r['mode']}" for r in results
               if r["status"] == "skipped"]
    bad = [r for r in results if r["status"] in ("error", "killed")
           or (r["status"] == "ok" and r["identical"] is False)]
    summary = {"env": env, "rows": results, "skipped": skipped,
               "failed": [f"{r['model']}/{r['transport']}/{r['mode']}" for r in bad],
               "wall_s": time.time() - t_start}
    (out / "bench_ddp_gpu.json").write_text(json.dumps(summary, indent=1))
    md = [f"# bench_ddp_gpu ({env['device']}, torch {env['torch']}, triton {env['triton']})"]
    for transport, model in launches:
        rows = [r for r in results if r["model"] == model and r["transport"] == transport]
        desc = next((r["model_desc"] for r in rows if "model_desc" in r), model)
        md += ["", f"## {model} over {transport}: {desc}", "", table(rows, cuda)]
    (out / "bench_ddp_gpu.md").write_text("\n".join(md) + "\n")
    return summary, skipped, bad


def main_parent(args):
    import torch
    t_start = T_START
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device visible", file=sys.stderr)
        return 2
    budget = args.budget
    if budget is None:
        budget = float(os.environ.get("HVDSPARSE_STAGE_BUDGET_S", DEFAULT_BUDGET))
    end = t_start + budget - 10.0         # margin: tables, JSON, interpreter exit
    out = Path(args.out)
    logdir = out / "bench_ddp_gpu_logs"
    logdir.mkdir(parents=True, exist_ok=True)
    if args.modes is None:
        args.modes = ",".join(MODES + (GRAPH_MODES if args.device == "cuda" else ()))
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES + GRAPH_MODES:
            raise SystemExit(f"--modes: unknown mode {m!r}; expected some of "
                             f"{MODES + GRAPH_MODES}")
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"--models: unknown model {m!r}; expected some of {MODELS}")
    if args.device == "cuda":
        transports = ["gloo-1gpu"] + (["nccl"] if torch.cuda.device_count() >= max(2, args.world)
                                      else [])
    else:
        transports = ["gloo-cpu"]
    launches = [(t, m) for t in transports for m in models]
    weights = [1.0 if t != "nccl" else 0.8 for t, _ in launches]
    try:
        import torchvision
        tv = torchvision.__version__
    except ImportError:
        tv = None
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    env = {"python": sys.version.split()[0], "torch": torch.__version__,
           "cuda": torch.version.cuda, "triton": triton_version, "torchvision": tv,
           "device": (torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"),
           "gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
           "budget_s": budget, "tiny": args.tiny, "world": args.world,
           "warmup": args.warmup, "steps": args.steps, "profile_steps": args.profile_steps}
    print(f"bench_ddp_gpu: {env}")
    if args.device == "cuda" and "nccl" not in transports:
        print(f"{torch.cuda.device_count()} GPU(s) visible: the NCCL launch (one rank per "
              "GPU) is not run")
    if tv is None and "resnet50" in models:
        print("torchvision not installed: 'resnet50' is a small local ResNet-like model, "
              "NOT ResNet-50")
    results = []
    summary, skipped, bad = write_outputs(out, env, [], results, t_start,
                                          args.device == "cuda")
    for i, (transport, model) in enumerate(launches):
        now = time.time()
        share = weights[i] / sum(weights[i:])
        deadline = now + max(0.0, end - now - SHUTDOWN_S) * share
        print(f"\n=== {model} over {transport}: launch deadline in {deadline - now:.0f} s "
              f"({end - now:.0f} s of the budget left)", flush=True)
        tag = f"{model}_{transport}"
        res = run_launch(args, model, transport, modes, deadline, logdir, tag)
        rows = [res[m] for m in modes if m in res]
        desc = next((r["model_desc"] for r in rows if "model_desc" in r), model)
        print(f"--- {desc}; {transport}; {time.time() - now:.0f} s")
        print(table(rows, args.device == "cuda"), flush=True)
        results += rows
        summary, skipped, bad = write_outputs(out, env, launches[:i + 1], results, t_start,
                                              args.device == "cuda")
    print()
    if skipped:
        print(f"SKIPPED for the time budget ({budget:.0f} s): {', '.join(skipped)}")
    else:
        print("every mode ran within the time budget")
    if bad:
        print(f"FAILED: {', '.join(summary['failed'])}")
    print(f"wrote {out / 'bench_ddp_gpu.json'} and {out / 'bench_ddp_gpu.md'} "
          f"({summary['wall_s']:.0f} s)")
    return 1 if bad else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_ddp_gpu_out")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda when available, else cpu")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny models and few steps (plumbing checks, CPU tests)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--modes", default=None,
                    help="run in this order (most important first); default: "
                         f"{','.join(MODES)}, and on CUDA {','.join(GRAPH_MODES)}")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds; default $HVDSPARSE_STAGE_BUDGET_S, else {DEFAULT_BUDGET:.0f}")
    ap.add_argument("--warmup", type=int, default=None, help="default 3 (--tiny: 2)")
    ap.add_argument("--steps", type=int, default=None, help="default 10 (--tiny: 3)")
    ap.add_argument("--profile-steps", type=int, default=None, help="default 2 (--tiny: 1)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--lm-optimizer", choices=("adamw", "sgd"), default="adamw",
                    help="the LM's optimizer (ResNet-50: SGD)")
    ap.add_argument("--pg-timeout", type=float, default=120.0,
                    help="torch.distributed timeout (s): a collective waiting longer raises")
    # worker-only
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--transport", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--events", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.device is None and not a._worker:
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
        if a.device == "cpu" and not a.tiny:
            print("no CUDA device and no --device: running --device cpu --tiny "
                  "(a check of the plumbing, not a benchmark)")
            a.tiny = True
    if a.warmup is None:
        a.warmup = 2 if a.tiny else 3
    if a.steps is None:
        a.steps = 3 if a.tiny else 10
    if a.profile_steps is None:
        a.profile_steps = 1 if a.tiny else 2
    for k in ("steps", "profile_steps"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    if a.warmup < 2:
        ap.error("--warmup must be >= 2 (PowerSGD compresses from the third step on)")
    if a.world != 2 and not a._worker:
        print(f"note: --world {a.world} (the benchmark's setting is 2)")
    if a._worker:
        # a rank outliving its launch's hard deadline (its parent gone) ends itself
        def watchdog():
            time.sleep(max(0.0, a.deadline + SHUTDOWN_S + 5.0 - time.time()))
            print("bench_ddp_gpu worker: past the launch's deadline, exiting", flush=True)
            os._exit(4)
        threading.Thread(target=watchdog, daemon=True).start()
        Worker(a).run()
        return 0
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return main_parent(a)


if __name__ == "__main__":
    sys.exit(main())
