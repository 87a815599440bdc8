"""TopK for a whole fusion bucket: the layers of a bucket compressed together in a fixed
number of launches (``kernels/bucket_topk.py`` on the device path, instead of ~25
launches per layer), or of calls into the compiled CPU loops
(``hvdsparse/native/bucket_topk.c``, the same table and bits: one fused pass for the
velocity update and residual add, usually one for the threshold count and selection).

Same math, same bits as :class:`~hvdsparse.compressors.topk.TopK`'s per-layer path
(``TopK._compress`` after ``LocalUpdate.corrected``): error feedback, momentum
correction (plain / Nesterov, dampening, weight decay), AMP's inverse loss scale,
non-finite counting, the sampled threshold estimate with its refinement rounds, the exact
route of small layers, fp32 / fp16 / bf16 values; and :class:`~hvdsparse.compressors.
threshold.Threshold`'s (``Threshold._compress``: between refreshes the reused tau
given to the select, the overflow guard's next tau written by the clamp launch; on
refresh steps, Triton path only, tau = the exact k-th largest ``|acc|`` of every
refreshing row at once, ``kernels/bucket_topk.py``'s radix select). A
layer takes this path when
:func:`layer_plan` says it can; TopK's and Threshold's ``fresh_weight`` rows too when the
layer's input is the Adam recipe's update-wire step made by ``hvdsparse/adam_bucket.py``
(Triton path: they rank the score ``|acc + w x|``, MODE_SCORE; TopK's send the exact k
largest by the radix select, MODE_TIES). Everything
else (quantised values, ``exact``, ``per_bucket``, no error feedback, a layer that goes
dense this step, local clipping, the Adam recipe's warm-up and its gradient / momentum
wires, Threshold's ``record_true_threshold``; on the CPU also Threshold's refresh steps,
fp16 / bf16 gradients or values, and every layer when the compiled loops are
unavailable: :func:`hvdsparse.native.available`) stays per layer.
Both front doors use it: the Horovod scheduler per fusion bucket, the DDP hook per DDP
bucket. tests/test_bucket_topk.py compares the two paths bit for bit on fresh data;
tests/test_paths_agree.py trains through it at P = 2, tests/test_ddp.py under torchrun.

Host work per bucket and step: the segment table (sizes, capacities, sample layout,
tensor addresses; a few host integers per layer, no device read), written into the
group's staged table, and one host-to-device copy of it (pinned, non-blocking on CUDA;
the same buffers every step: :mod:`hvdsparse.row_tables`). No host synchronisation.
"""
from __future__ import annotations

import os
from typing import List, NamedTuple, Optional

import numpy as np
import torch

from .. import ops
from ..device_graphs import run_segment
from ..row_tables import RowTables, program_map
from ..payload import IndexEncoding, LayerPayload, Segment, ValueEncoding
from .base import PURPOSE_SAMPLE, Compressor

__all__ = ["MomentumSpec", "BucketItem", "BucketBatch", "layer_plan", "compress_bucket",
           "mask_bucket", "takes", "enabled", "plan_layer", "block_table", "float_bits"]

#: elements per program of the streaming kernels
BLOCK = 4096
_VE_CODE = {ValueEncoding.FP32: 0, ValueEncoding.FP16: 1, ValueEncoding.BF16: 2}
#: Threshold's refresh rows (``kernels/bucket_topk.py``'s ROUTE_FRESH: the Triton path
#: only, the CPU twin has no such route)
ROUTE_FRESH = 3


class MomentumSpec(NamedTuple):
    """DGC's velocity update folded into the residual add (``LocalUpdate.bucket_spec``):
    ``u = u * m + (1 - dampening) * (g + weight_decay * param)``, the compressor
    receives ``u`` (or ``g + m * u`` with Nesterov)."""
    u: torch.Tensor
    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float


class BucketItem(NamedTuple):
    name: str
    grad: torch.Tensor
    param: torch.Tensor
    nonfinite: torch.Tensor          # int32[1] counter on the gradient's device
    momentum: Optional[MomentumSpec]  # None: plain error feedback of the gradient


class BucketBatch(NamedTuple):
    """What the masking after the exchange needs (:func:`mask_bucket`)."""
    names: List[str]
    table: torch.Tensor      # int64 [L, W] on the device
    indices: torch.Tensor    # int32, every segment's slots
    counts: torch.Tensor     # int32 [L, 2]: [sent, selected]
    capmax: int
    momentum_names: List[str]  # the segments with a velocity (masked after the exchange)
    kernels: object          # kernels/bucket_topk.py or its CPU twin (native.bucket_topk())


def takes(grad: torch.Tensor) -> bool:
    """Whether the bucket path can run on ``grad``'s device at all: the Triton path, or
    the CPU with the compiled loops (the per-layer conditions are :func:`layer_plan`'s)."""
    return ops.use_triton(grad) or (ops.has_cpu_path(grad) and ops.compiled_cpu_available())


def enabled(comp, local_update) -> bool:
    """Whether a front door (Horovod scheduler, DDP hook) uses the bucket path at all for
    ``comp``: the compressor offers it, the local update (if any) can fold into it, and
    ``HVDSPARSE_BUCKET_PATH=0`` does not turn it off."""
    return os.environ.get("HVDSPARSE_BUCKET_PATH", "1") != "0" and \
        getattr(comp, "bucket_path", False) and \
        (local_update is None or hasattr(local_update, "bucket_spec"))


def plan_layer(comp, local_update, name: str, grad: torch.Tensor, param: torch.Tensor,
               step: int, clean_input: bool = False):
    """``(momentum spec, plan)`` when layer ``name`` takes the bucket path at ``step``
    (its momentum correction, if any, folded in: ``LocalUpdate.bucket_spec``), else None
    (the caller compresses it per layer, as the front doors do otherwise).
    ``clean_input``: ``grad`` is the compressor's whole input, fp32, already scaled (the
    Adam recipe's update-wire step, ``hvdsparse/adam_bucket.py``): the rows that read it
    a second time (``fresh_weight``'s score) may take the path."""
    if not takes(grad):
        return None
    spec = None
    if local_update is not None and local_update.wants(name):
        ok, spec = local_update.bucket_spec(name, grad, comp.policy.is_dense(name, grad.shape))
        if not ok:
            return None
    plan = layer_plan(comp, name, grad, step, param, spec, clean_input)
    return None if plan is None else (spec, plan)


def float_bits(x: float) -> int:
    """The int32 bit pattern of ``fp32(x)`` (how the segment table carries a float)."""
    return int(np.array([x], dtype=np.float32).view(np.int32)[0])


def momentum_cells(row, K, ms: MomentumSpec, param: torch.Tensor) -> int:
    """Writes DGC's velocity cells of one segment-table row (the columns ``C_U``,
    ``C_M``, ``C_C`` and, with weight decay, ``C_WD`` / ``C_P`` of the kernel module
    ``K``: velocity address, ``m``, ``1 - dampening``, ``wd``, parameter address; floats
    as their fp32 bits) and returns the row's mode bits ``MODE_MOMENTUM`` [|
    ``MODE_NESTEROV``] [| ``MODE_WD``] in ``K``'s numbering."""
    mode = K.MODE_MOMENTUM
    row[K.C_U] = ms.u.data_ptr()
    row[K.C_M] = float_bits(ms.momentum)
    row[K.C_C] = float_bits(1.0 - ms.dampening)
    if ms.nesterov:
        mode |= K.MODE_NESTEROV
    if ms.weight_decay:
        mode |= K.MODE_WD
        row[K.C_WD] = float_bits(ms.weight_decay)
        row[K.C_P] = param.data_ptr()
    return mode


def layer_plan(comp, name: str, grad: torch.Tensor, step: int, param=None,
               momentum: Optional[MomentumSpec] = None,
               clean_input: bool = False) -> Optional[dict]:
    """Host integers of layer ``name`` at ``step`` when the bucket path can compress it
    with exactly the per-layer result, else None (the caller compresses it per layer).
    ``fresh_weight`` rows (the score ``|acc + w x|``, MODE_SCORE: TopK's on ROUTE_FRESH,
    Threshold's on its own routes; the Triton path only) need ``clean_input``
    (:func:`plan_layer`), an fp32 input and no velocity."""
    from .threshold import Threshold
    from .topk import TopK, sample_layout
    if type(comp).compress is not Compressor.compress:
        return None          # a subclass with its own compress(): never bypass it
    given = isinstance(comp, Threshold) and type(comp)._compress is Threshold._compress
    if not given and (not isinstance(comp, TopK) or type(comp)._compress is not TopK._compress):
        return None
    if grad.is_sparse or not grad.is_contiguous() or not takes(grad):
        return None
    on_cpu = not ops.use_triton(grad)
    if on_cpu and grad.dtype != torch.float32:
        return None             # the compiled CPU loops read fp32 only
    n = grad.numel()
    if n == 0 or n >= 2 ** 31 or grad.dtype not in (torch.float32, torch.float16,
                                                     torch.bfloat16):
        return None
    if comp.policy.is_dense(name, grad.shape) or comp.policy.is_whole(name, grad.shape):
        return None
    cfg = comp.layer_cfg(name)
    enc = cfg["values"]
    if not cfg["error_feedback"] or enc not in _VE_CODE or \
            (on_cpu and enc != ValueEncoding.FP32):
        return None
    w = cfg.get("fresh_weight_in_force", 0.0)
    if not given and (cfg["exact"] or cfg["per_bucket"]):
        return None
    if w and (not clean_input or on_cpu or momentum is not None or
              grad.dtype != torch.float32):
        return None
    if momentum is not None and momentum.weight_decay and \
            (param is None or param.dtype != grad.dtype or not param.is_contiguous()
             or param.device != grad.device):
        return None
    if given:
        return _given_plan(comp, name, grad, step, cfg, n, enc, w)
    d = comp.density(step, cfg["ratio"])
    k, cap = comp._k_and_capacity(n, d, cfg)
    if not comp._sparse_is_worth_it(n, cap, enc):
        return None
    common = dict(n=n, k=k, cap=cap, d=d, enc=enc, rounds=cfg["rounds"],
                  target=0.5 * (k + cap), qb=cfg["quant_bucket"])
    if w:               # the exact k largest scores (capacity k): the radix select
        return dict(common, exact=ROUTE_FRESH, s=1, stride=1, off=0, r0=1, m=1, rk=k,
                    rcap=2 ** 31 - 1, fresh=True, score=w, ties=True)
    lay = sample_layout(n, k, cap, comp._seed(name, step, PURPOSE_SAMPLE))
    if lay is None:     # the exact route: the whole layer, t = the k-th largest |acc|
        return dict(common, exact=1, s=n, stride=1, off=0, r0=k, m=k, rk=0,
                    rcap=2 ** 31 - 1)
    s, stride, off, r0, m = lay
    return dict(common, exact=0, s=s, stride=stride, off=off, r0=r0, m=m, rk=k, rcap=cap)


def _given_plan(comp, name, grad, step, cfg, n, enc, w) -> Optional[dict]:
    """Threshold (DCT-DP) between refreshes: the layer's reused ``tau`` is the row's given
    threshold (``ROUTE_GIVEN``: no sample, no counting round) and, with the overflow
    guard, the clamp launch writes the next step's ``tau`` into a new tensor. Refresh
    steps on the Triton path: ``ROUTE_FRESH``, the radix select writes ``tau = max(k-th
    largest |acc|, TINY)`` (``topk(|acc|, k).values.min().clamp_min(TINY)``'s value)
    before the select reads it. Refresh steps on the CPU, ``record_true_threshold`` and
    a ``tau`` on another device stay per layer (``Threshold._compress``). ``w``: the
    ``fresh_weight`` score rows rank ``|acc + w x|`` (MODE_SCORE) in all of this."""
    if comp.record_true_threshold:
        return None
    d = comp.density(step, cfg["sparsity"])
    k, cap = comp._k_and_capacity(n, d, cfg)
    if not comp._sparse_is_worth_it(n, cap, enc):
        return None
    st = comp._layers.get(name)
    if comp._refresh_due(st, step, cfg, k):
        # a refresh step: tau = the exact k-th largest |acc| (the radix select; the
        # Triton path only)
        if not ops.use_triton(grad):
            return None
        return dict(n=n, k=k, cap=cap, d=d, enc=enc, rounds=0, target=0.0,
                    qb=cfg["quant_bucket"], exact=3, s=1, stride=1, off=0, r0=1, m=1, rk=k,
                    rcap=2 ** 31 - 1, guard=comp.overflow_guard, fresh=True, score=w,
                    given=True)
    tau = st["tau"]
    if not isinstance(tau, torch.Tensor) or tau.dtype != torch.float32 or \
            tau.numel() != 1 or tau.device != grad.device or not tau.is_contiguous():
        return None
    # the reused tau is used at tau * f (C_TGT, the target cell of sampled rows);
    # a guarded row's next tau is kept at this step's rate
    f, rate = comp.rate_factor(name, st)
    return dict(n=n, k=k, cap=cap, d=d, enc=enc, rounds=0, target=f,
                qb=cfg["quant_bucket"], exact=2, s=1, stride=1, off=0, r0=1, m=1, rk=0,
                rcap=2 ** 31 - 1, tau=tau, guard=comp.overflow_guard, score=w, given=True,
                rate=rate)


def group_key(plan: dict, item: BucketItem):
    """Layers compressed in one launch sequence share these."""
    return (item.grad.dtype, item.grad.device, plan["enc"], plan["rounds"])


def row_tables(owner) -> RowTables:
    """``owner``'s staged row tables (made on first use): one persistent table per bucket
    group, so a group's launches read the same addresses every step
    (:mod:`hvdsparse.row_tables`)."""
    t = getattr(owner, "row_tables", None)
    if t is None:
        t = owner.row_tables = RowTables()
    return t


def block_table(ns: List[int], device) -> torch.Tensor:
    """int32 [sum ceil(n_j / BLOCK)]: the segment of every program (cached: layer sizes
    never change)."""
    return program_map([-(-n // BLOCK) for n in ns], device)


def compress_bucket(comp, items: List[BucketItem], plans: List[dict], step: int,
                    grad_scale: Optional[torch.Tensor] = None):
    """Compress ``items`` (one group: same gradient dtype, device, value encoding and
    rounds; ``plans`` from :func:`layer_plan`) at ``step``. Returns ``(payloads by name,
    BucketBatch)``; records each layer's statistics as ``compress`` does."""
    K = ops.bucket_topk_kernels(items[0].grad)
    L = len(items)
    dev = items[0].grad.device
    staged = row_tables(comp).take(("topk", tuple(it.name for it in items)), L, K.W, dev)
    tab = staged.host
    # Threshold's refresh rows: their fresh tau (the radix select writes it), one fp32
    # buffer; each row's view becomes the layer's tau tensor
    fresh = any(pl.get("fresh") for pl in plans)
    tau_new = torch.empty(L, dtype=torch.float32, device=dev) if fresh else None
    out = 0
    blk0 = 0
    mom = []
    for j, (it, pl) in enumerate(zip(items, plans)):
        name = it.name
        comp._open_layer(name)
        r = comp._residual_for(name, it.grad.reshape(-1))
        row = tab[j]
        row[K.C_G] = it.grad.data_ptr()
        row[K.C_R] = r.data_ptr()
        row[K.C_N] = pl["n"]
        row[K.C_NF] = it.nonfinite.data_ptr()
        ms = it.momentum
        if ms is not None:
            mom.append(name)
            row[K.C_MODE] = momentum_cells(row, K, ms, it.param)
        row[K.C_RK], row[K.C_RCAP], row[K.C_CAP] = pl["rk"], pl["rcap"], pl["cap"]
        row[K.C_STRIDE], row[K.C_OFF], row[K.C_S] = pl["stride"], pl["off"], pl["s"]
        row[K.C_R0], row[K.C_MLEN], row[K.C_EXACT] = pl["r0"], pl["m"], pl["exact"]
        row[K.C_TGT] = float_bits(pl["target"])
        if pl.get("score"):
            row[K.C_MODE] = row[K.C_MODE] | K.MODE_SCORE | (K.MODE_TIES if pl.get("ties")
                                                            else 0)
            row[K.C_W] = float_bits(pl["score"])
        if pl["exact"] in (K.ROUTE_GIVEN, ROUTE_FRESH):
            row[K.C_TIN] = pl["tau"].data_ptr() if pl["exact"] == K.ROUTE_GIVEN else \
                tau_new[j].data_ptr()
            if pl.get("guard"):
                # the next step's tau: a new tensor (layer state is replaced, never
                # modified in place: rollback snapshots and the history share tensors)
                pl["tau_out"] = torch.empty((), dtype=torch.float32, device=dev)
                row[K.C_TOUT] = pl["tau_out"].data_ptr()
                row[K.C_MODE] = row[K.C_MODE] | K.MODE_GUARD
        row[K.C_OUT] = out
        row[K.C_BLK0] = blk0
        out += pl["cap"]
        blk0 += -(-pl["n"] // BLOCK)
    # the programs' segments (Triton only: the CPU loops walk the rows)
    triton = ops.use_triton(items[0].grad)
    blk = block_table([pl["n"] for pl in plans], dev) if triton else None
    # Threshold's guard rows between refreshes also select through the overflow ladder
    # (threshold.py)
    ladder = None
    if any(pl.get("guard") and pl["exact"] == K.ROUTE_GIVEN for pl in plans):
        from .threshold import ladder_factors
        ladder = ladder_factors(dev, comp.ladder)
    sampled = any(pl["exact"] in (K.ROUTE_SAMPLED, K.ROUTE_EXACT) for pl in plans)
    enc = plans[0]["enc"]
    idx, vals, cnt, tau = run_segment(
        comp, _launches, staged, K, blk, grad_scale, K.GDT_CODE[items[0].grad.dtype], L,
        fresh, sampled, max(pl["s"] for pl in plans), max(pl["m"] for pl in plans),
        plans[0]["rounds"], out, _VE_CODE[enc], ladder, capturable=triton)
    table = staged.table()
    payloads = {}
    for j, (it, pl) in enumerate(zip(items, plans)):
        o, cap = int(tab[j, K.C_OUT]), pl["cap"]
        seg = Segment(numel=pl["n"], capacity=cap, index_encoding=IndexEncoding.INT32,
                      value_encoding=enc, count=cnt[j, 0:1], values=vals[o:o + cap],
                      indices=idx[o:o + cap], scales=None, quant_bucket=pl["qb"],
                      narrow_indices=True)
        payload = LayerPayload(it.name, it.grad.shape, [seg])
        payload.nonfinite = it.nonfinite
        extra = dict(nonfinite=it.nonfinite)
        threshold_row = pl.get("given", False)
        if threshold_row and pl["exact"] == ROUTE_FRESH:   # Threshold._compress's refresh
            comp.record_refresh(it.name, step, tau_new[j], pl["k"])
        if threshold_row:
            # as Threshold._compress records it
            extra["refreshed"] = pl["exact"] == ROUTE_FRESH
            st = comp._layers[it.name]
            if pl["guard"]:
                st["tau"] = pl["tau_out"]
            if pl["exact"] == K.ROUTE_GIVEN:
                comp.keep_rate(st, pl["rate"], pl["guard"])
        comp._stats.record(it.name, step, payload, extra=extra,
                           selected=cnt[j, 1:2], threshold=tau[j], density=pl["d"])
        payloads[it.name] = payload
    batch = BucketBatch([it.name for it in items], table, idx, cnt,
                        max(pl["cap"] for pl in plans), mom, K)
    return payloads, batch


def _launches(table, K, blk, grad_scale, gdt, L, fresh, sampled, smax, mmax, rounds, out,
              ve, ladder):
    """A group's device segment (:mod:`hvdsparse.device_graphs`): the accumulate launch,
    the refresh rows' radix select, the threshold-and-select launches. ``blk`` None: the
    compiled CPU loops (no sample, sort or counting launch without a sampled row on the
    Triton path: the accumulate zeroes the payload counts; the CPU twin has neither)."""
    kw, acc_kw = {}, {}
    if fresh:
        kw["radix"] = acc_kw["radix"] = K.radix_scratch(L, table.device)
    if blk is not None:
        kw["sampled"] = sampled
        if not sampled:
            kw["counts"] = acc_kw["counts"] = torch.empty((L, 2), dtype=torch.int32,
                                                          device=table.device)
    K.accumulate(table, blk, grad_scale, gdt, block=BLOCK, **acc_kw)
    if fresh:
        K.radix_select(table, blk, kw["radix"], block=BLOCK)
    return K.threshold_and_select(table, blk, L, smax, mmax, rounds, out, ve, ladder,
                                  block=BLOCK, **kw)


def mask_bucket(batch: BucketBatch) -> None:
    """DGC's momentum-factor masking for every momentum segment of ``batch``: ``u[sent]
    = 0`` (one launch, or one call on the CPU)."""
    if batch.momentum_names:
        batch.kernels.mask(batch.table, batch.indices, batch.counts, len(batch.names),
                           batch.capmax)
