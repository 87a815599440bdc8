"""The bucket path for every compressor: the layers of a fusion bucket compressed
together, each layer a row of one device table, a fixed number of launches per group
of rows instead of a launch sequence per layer. The interface of
:mod:`.topk_bucket` (``enabled``, ``takes``, ``plan_layer``, ``group_key``,
``compress_bucket``, ``mask_bucket``, ``BucketItem``, ``BucketBatch``), extended to
more kinds of row; a front door (the step engine) calls it without knowing the
compressor. Each plan carries its ``kind``:

* ``topk``: TopK, and Threshold (:mod:`.topk_bucket`, ``kernels/bucket_topk.py``, or
  the compiled CPU loops; Threshold's refresh steps, the exact k-th largest ``|acc|``
  of every refreshing layer by one radix select per group, on the Triton path only);
* ``dense``: a layer that goes dense by policy, for every compressor
  (``Compressor._policy_dense``: fp32 values ``clean(grad) + pending residual``, the
  residual dropped), and every layer of ``NoCompression``: one launch per group
  (``kernels/bucket_dense.py``'s ``dense_copy``), the DENSE segments views of one
  fp32 buffer;
* ``whole``: a layer the compressor sends whole (``policy.is_whole``, TopK's biases and
  norms on the Adam recipe's update wire: ``Compressor._whole``, every element in fp32 /
  fp16 / bf16, the rounding kept in the residual): one launch per group (one value
  encoding; ``kernels/bucket_dense.py``'s ``whole_cast``);
* ``qsgd``: QSGD's layers (``QSGD._compress``: residual add, per-bucket max,
  Philox stochastic rounding with the layer's own host seed, packing, the residual's
  ``acc - deq``): one launch per group (``kernels/bucket_dense.py``'s ``qsgd_pack``);
* ``adacomp``: AdaComp's bins (``AdaComp._compress``'s Triton route: residual add and
  bin maxima, the layer scale, the per-bin compare / cap / pick, bin-relative packing,
  sign bits, residue): per group (one bin size, ``max_per_bin``, ``scale``) one zero
  fill, four launches (accumulate, every layer's scale, count, pack), one more when a
  layer budget (``mean_per_bin``) cuts a row (its quota, ``kernels/bin_quota.py``) and
  one ``cumsum`` (``kernels/bucket_binned.py``); DGC's velocity update folds into the
  accumulate launch.
* ``randomk``: RandomK's layers with error feedback and fp32 / fp16 / bf16 values
  (``RandomK._compress``: the stratified draw, the pick, the residual's cast error):
  ``kernels/bucket_topk.py``'s table and accumulate launch (DGC's velocity folded in,
  its mask launch after the exchange) and one draw-and-pick launch
  (``kernels/bucket_randomk.py``) per group;
* ``slimdp``: Slim-DP's layers with error feedback and fp32 / fp16 / bf16 values on their
  core + explorer steps (``SlimDP._compress``: the core's values in core order, the
  stratified explorer outside it, the residual's cast error): the same table and
  accumulate launch (DGC's velocity folded in, its mask launch after the exchange) and
  one gather-and-draw launch (``kernels/bucket_slimdp.py``) per group. A layer without
  a core yet gets its random core once, per layer (``SlimDP._random_core``).

Same bits as the per-layer path (payload, residual, non-finite count, statistics):
tests/test_bucket_compress.py compares them on fresh random data through Triton's
interpreter. The ``dense``, ``qsgd``, ``adacomp``, ``randomk`` and ``slimdp`` rows run on
the Triton path only (``ops.use_triton``); on the CPU those layers stay per layer. Still
per layer: RandomK and Slim-DP with quantised values or without error feedback, layers a
compressor sends dense by size (``_send_all``: TopK's warm-up, AdaComp's
not-smaller layouts, Slim-DP's dense pushes, ...), AdaComp bins wider than
``ops.binned_max_bin()``.

A layer with a local update (DGC momentum correction, local clipping) takes a
``dense`` / ``qsgd`` row only when :meth:`LocalUpdate.bucket_spec` says it is
fusable with no velocity to fold in (the per-layer path then hands the compressor the
cleaned gradient, ``MODE_PRE``); a QSGD layer with momentum correction stays per layer,
an AdaComp layer folds the velocity in (its masking stays per layer: ``LocalUpdate.mask``
on its ordinary payload, as the step engine does for every layer no batch masked).

The Adam recipe (:class:`hvdsparse.adam.AdamRecipe`): its policy-dense layers take
``dense`` rows (``bucket_spec``: the cleaned gradient, as with a local update); its
update-wire steps are made for the whole bucket first (``hvdsparse/adam_bucket.py``) and
enter here as the layers' whole, already scaled input (``clean_input``): every kind of
row takes them, TopK's ``fresh_weight`` score rows included.

Host work per group and step: a few host integers per layer (sizes, offsets, the seed
from the host's step counter) written into the group's staged table, and one
host-to-device copy of it (pinned, non-blocking on CUDA; the same buffers every step:
:mod:`hvdsparse.row_tables`). No host synchronisation, no ``.item()``, no boolean
indexing.
"""
from __future__ import annotations

import os
from typing import List, Optional

import torch

from .. import ops
from ..device_graphs import run_segment
from ..row_tables import program_map
from ..payload import FLOAT_DTYPES, IndexEncoding, LayerPayload, Segment, ValueEncoding
from . import topk_bucket
from .base import PURPOSE_QUANT, Compressor
from .topk_bucket import BucketBatch, BucketItem, MomentumSpec

__all__ = ["MomentumSpec", "BucketItem", "BucketBatch", "KINDS", "enabled", "takes",
           "plan_layer", "group_key", "compress_bucket", "mask_bucket", "kind_of"]

KIND_TOPK, KIND_DENSE, KIND_QSGD, KIND_ADACOMP = "topk", "dense", "qsgd", "adacomp"
KIND_RANDOMK, KIND_SLIMDP, KIND_WHOLE = "randomk", "slimdp", "whole"
KINDS = (KIND_TOPK, KIND_DENSE, KIND_QSGD, KIND_ADACOMP, KIND_RANDOMK, KIND_SLIMDP)
#: elements per program of the policy-dense copy
DENSE_BLOCK = 4096
_GDT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: value encodings of the ``randomk`` and ``slimdp`` rows (``kernels/select.py``'s codes)
_RK_VE = {ValueEncoding.FP32: 0, ValueEncoding.FP16: 1, ValueEncoding.BF16: 2}


def _base_compress(comp) -> bool:
    """The compressor runs the base class's per-layer machinery (no subclass ``compress``
    or ``_compress_layer`` of its own that the bucket path would bypass)."""
    t = type(comp)
    return isinstance(comp, Compressor) and t.compress is Compressor.compress and \
        t._compress_layer is Compressor._compress_layer and \
        t._policy_dense is Compressor._policy_dense


def enabled(comp, local_update) -> bool:
    """Whether a front door uses the bucket path at all for ``comp``: TopK's rule
    (:func:`.topk_bucket.enabled`), or any compressor on the base class's per-layer
    machinery (its policy-dense layers, QSGD's layers), with a local update (if any)
    that can fold into it; ``HVDSPARSE_BUCKET_PATH=0`` turns it off."""
    if os.environ.get("HVDSPARSE_BUCKET_PATH", "1") == "0":
        return False
    if topk_bucket.enabled(comp, local_update):
        return True
    return _base_compress(comp) and \
        (local_update is None or hasattr(local_update, "bucket_spec"))


def takes(grad: torch.Tensor, comp=None) -> bool:
    """Whether the bucket path can run on ``grad``'s device at all (so a front door lets
    the layer wait for the rest of its bucket): the Triton path, or the CPU with the
    compiled loops for a compressor with a CPU bucket route (TopK / Threshold:
    ``comp.bucket_path``; ``comp`` None: any). Per-layer conditions: :func:`plan_layer`."""
    if ops.use_triton(grad):
        return True
    return topk_bucket.takes(grad) and (comp is None or getattr(comp, "bucket_path", False))


def kind_of(plan: dict) -> str:
    return plan.get("kind", KIND_TOPK)


def _dense_kind(comp, name, grad) -> bool:
    from .none import NoCompression
    return comp.policy.is_dense(name, grad.shape) or \
        (isinstance(comp, NoCompression) and type(comp)._compress is NoCompression._compress)


def plan_layer(comp, local_update, name: str, grad: torch.Tensor, param: torch.Tensor,
               step: int, clean_input: bool = False):
    """``(momentum spec, plan)`` when layer ``name`` takes the bucket path at ``step``,
    else None (the caller compresses it per layer). ``plan["kind"]`` says which rows.
    ``clean_input``: ``grad`` is the compressor's whole input, already scaled
    (:func:`.topk_bucket.plan_layer`)."""
    if getattr(comp, "bucket_path", False):
        got = topk_bucket.plan_layer(comp, local_update, name, grad, param, step,
                                     clean_input)
        if got is not None:
            got[1]["kind"] = KIND_TOPK
            return got
    if not _base_compress(comp) or not isinstance(grad, torch.Tensor) or \
            not ops.use_triton(grad):
        return None
    if grad.is_sparse or not grad.is_contiguous() or grad.dtype not in _GDT:
        return None
    n = grad.numel()
    if n == 0 or n >= 2 ** 31:
        return None
    from .adacomp import AdaComp
    from .qsgd import QSGD
    from .randomk import RandomK
    from .slimdp import SlimDP
    dense = _dense_kind(comp, name, grad)
    ada = rk = None
    if dense:
        kind = KIND_DENSE
    elif comp.policy.is_whole(name, grad.shape):
        kind = KIND_WHOLE
    elif isinstance(comp, QSGD) and type(comp)._compress is QSGD._compress:
        kind = KIND_QSGD
    elif isinstance(comp, AdaComp) and type(comp)._compress is AdaComp._compress:
        kind = KIND_ADACOMP
        ada = comp._layout(grad.shape, comp.layer_cfg(name))
        if ada[6] or ada[1] > ops.binned_max_bin():
            return None       # sent dense (not smaller), or bins wider than the tile
    elif isinstance(comp, RandomK) and type(comp)._compress is RandomK._compress:
        kind = KIND_RANDOMK
        rk = _randomk_plan(comp, name, n, step)
        if rk is None:
            return None       # quantised values, no error feedback, or sent dense
    elif isinstance(comp, SlimDP) and type(comp)._compress is SlimDP._compress:
        kind = KIND_SLIMDP
        rk = _slimdp_plan(comp, name, n, step)
        if rk is None:
            return None       # quantised values, no error feedback, or sent dense
    else:
        return None
    pre, spec = False, None
    if local_update is not None and local_update.wants(name):
        ok, spec = local_update.bucket_spec(name, grad, comp.policy.is_dense(name,
                                                                            grad.shape))
        if not ok:
            return None       # local clipping reads the layer's norm first
        if spec is not None and (kind not in (KIND_ADACOMP, KIND_RANDOMK, KIND_SLIMDP) or (
                spec.weight_decay and (
                    param is None or param.dtype != grad.dtype or
                    not param.is_contiguous() or param.device != grad.device))):
            return None       # a velocity these rows cannot fold in
        pre = spec is None    # the per-layer path hands over the cleaned gradient
    plan = dict(kind=kind, n=n, pre=pre)
    if kind in (KIND_RANDOMK, KIND_SLIMDP):
        plan.update(rk)
    if kind == KIND_ADACOMP:
        _, L, nb, c, cap, ienc, _ = ada
        plan.update(L=L, nb=nb, c=c, cap=cap, ienc=ienc,
                    hm1=float(comp.layer_cfg(name)["scale"]) - 1.0)
    if kind == KIND_WHOLE:
        cfg = comp.layer_cfg(name)
        if cfg["values"] not in _RK_VE:
            return None       # quantised values: per layer
        plan.update(enc=cfg["values"], ef=bool(cfg["error_feedback"]),
                    qb=cfg["quant_bucket"])
    if kind == KIND_QSGD:
        from .qsgd import ENCODING_OF_BITS
        cfg = comp.layer_cfg(name)
        plan.update(bits=int(cfg["bits"]), enc=ENCODING_OF_BITS[cfg["bits"]],
                    qb=int(cfg["bucket_size"]), ef=bool(cfg["error_feedback"]),
                    seed=comp._seed(name, step, PURPOSE_QUANT))
    return spec, plan


def _randomk_plan(comp, name: str, n: int, step: int) -> Optional[dict]:
    """A RandomK layer's row (``RandomK._compress``'s sizes and seeds), or None when
    it stays per layer."""
    from .base import PURPOSE_INDICES, k_of
    cfg = comp.layer_cfg(name)
    enc = cfg["values"]
    if not cfg["error_feedback"] or enc not in _RK_VE:
        return None
    d = comp.density(step, cfg["ratio"])
    k = k_of(d, n)
    if not comp._sparse_is_worth_it(n, k, enc, 0.0 if cfg["shared_seed"] else 4.0):
        return None
    return dict(k=k, d=d, enc=enc, shared=bool(cfg["shared_seed"]),
                qb=cfg["quant_bucket"],
                seed=comp._seed(name, step, PURPOSE_INDICES, shared=cfg["shared_seed"]))


def _slimdp_plan(comp, name: str, n: int, step: int) -> Optional[dict]:
    """A Slim-DP layer's row on a core + explorer step (``SlimDP._compress``'s sizes and
    seeds), or None when it stays per layer (a dense push, not smaller than dense,
    quantised values, no error feedback)."""
    from .base import PURPOSE_EXPLORE
    cfg = comp.layer_cfg(name)
    enc = cfg["values"]
    if not cfg["error_feedback"] or enc not in _RK_VE or comp._push_step(step, cfg) or \
            not comp._worth(n, cfg):
        return None
    nc, ne = comp.sizes(n, cfg["alpha"], cfg["beta"])
    return dict(nc=nc, ne=ne, enc=enc, qb=cfg["quant_bucket"],
                seed=comp._seed(name, step, PURPOSE_EXPLORE))


def group_key(plan: dict, item: BucketItem):
    """Layers compressed in one launch sequence share these."""
    kind = kind_of(plan)
    if kind == KIND_TOPK:
        return (KIND_TOPK,) + tuple(topk_bucket.group_key(plan, item))
    if kind == KIND_DENSE:
        return (KIND_DENSE, item.grad.dtype, item.grad.device)
    if kind == KIND_WHOLE:
        return (KIND_WHOLE, item.grad.dtype, item.grad.device, plan["enc"])
    if kind == KIND_ADACOMP:
        return (KIND_ADACOMP, item.grad.dtype, item.grad.device, plan["L"], plan["c"],
                plan["hm1"])
    if kind in (KIND_RANDOMK, KIND_SLIMDP):
        return (kind, item.grad.dtype, item.grad.device, plan["enc"])
    return (KIND_QSGD, item.grad.dtype, item.grad.device, plan["bits"], plan["qb"])


def compress_bucket(comp, items: List[BucketItem], plans: List[dict], step: int,
                    grad_scale: Optional[torch.Tensor] = None):
    """Compress one group (``items`` and ``plans`` of equal :func:`group_key`) at
    ``step``. Returns ``(payloads by name, BucketBatch)``; records each layer's
    statistics as ``compress`` does."""
    kind = kind_of(plans[0])
    if any(kind_of(pl) != kind for pl in plans):
        raise ValueError(f"bucket.compress_bucket: one group holds rows of kinds "
                         f"{sorted({kind_of(pl) for pl in plans})}; group by group_key")
    if kind == KIND_TOPK:
        return topk_bucket.compress_bucket(comp, items, plans, step, grad_scale=grad_scale)
    if kind == KIND_DENSE:
        return _dense_bucket(comp, items, plans, step, grad_scale)
    if kind == KIND_WHOLE:
        return _whole_bucket(comp, items, plans, step, grad_scale)
    if kind == KIND_ADACOMP:
        return _adacomp_bucket(comp, items, plans, step, grad_scale)
    if kind == KIND_RANDOMK:
        return _randomk_bucket(comp, items, plans, step, grad_scale)
    if kind == KIND_SLIMDP:
        return _slimdp_bucket(comp, items, plans, step, grad_scale)
    return _qsgd_bucket(comp, items, plans, step, grad_scale)


def mask_bucket(batch: BucketBatch) -> None:
    """DGC's momentum-factor masking of ``batch``'s momentum rows (``topk``,
    ``randomk`` and ``slimdp`` rows have them: the same table and mask launch)."""
    topk_bucket.mask_bucket(batch)


# ------------------------------------------------------------------ shared helpers
def _staged(comp, kind: str, items, width: int):
    """This step's staged row table of the group ``items`` (:func:`topk_bucket.row_tables`)."""
    return topk_bucket.row_tables(comp).take((kind, tuple(it.name for it in items)),
                                             len(items), width, items[0].grad.device)


def _empty(n: int, dtype, device) -> torch.Tensor:
    """An output buffer every element of which the launch writes (tests poison it)."""
    return torch.empty(n, dtype=dtype, device=device)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _layer_cells(comp, row, K, it) -> None:
    """The cells every accumulating row has: the layer opened on ``comp``, its gradient,
    residual (made on first use), size and non-finite counter."""
    comp._open_layer(it.name)
    r = comp._residual_for(it.name, it.grad.reshape(-1))
    row[K.C_G] = it.grad.data_ptr()
    row[K.C_R] = r.data_ptr()
    row[K.C_N] = it.grad.numel()
    row[K.C_NF] = it.nonfinite.data_ptr()


def _finish(comp, items, step, payloads, info):
    for it in items:
        p = payloads[it.name]
        p.nonfinite = it.nonfinite
        comp._stats.record(it.name, step, p, extra=dict(nonfinite=it.nonfinite), **info)


# ------------------------------------------------------------------ policy-dense rows
def _streamed_rows(comp, K, tab, items, plans, cells):
    """The cells of a group whose programs stream each layer in ``DENSE_BLOCK`` tiles into
    its own range of one output buffer (the ``dense`` and ``whole`` rows): ``cells(row,
    item, plan)`` writes the row's residual and mode; returns ``(elements, programs per
    row)``."""
    out = blk0 = 0
    nprog = []
    for j, (it, pl) in enumerate(zip(items, plans)):
        comp._open_layer(it.name)
        row = tab[j]
        cells(row, it, pl)
        row[K.C_G] = it.grad.data_ptr()
        row[K.C_N] = pl["n"]
        row[K.C_NF] = it.nonfinite.data_ptr()
        row[K.C_OUT] = out
        row[K.C_BLK0] = blk0
        out += pl["n"]
        nprog.append(_cdiv(pl["n"], DENSE_BLOCK))
        blk0 += nprog[-1]
    return out, nprog


def _ef_cells(comp, K, row, it, pl) -> None:
    """A ``whole`` or ``qsgd`` row's residual and mode: with error feedback the residual
    (made on first use) and ``MODE_EF`` (``| MODE_PRE``: a gradient cleaned before)."""
    mode = 0
    if pl["ef"]:
        r = comp._residual_for(it.name, it.grad.reshape(-1))
        row[K.C_R] = r.data_ptr()
        mode = K.MODE_EF | (K.MODE_PRE if pl["pre"] else 0)
    row[K.C_MODE] = mode


def _streamed_payloads(comp, items, plans, step, tab, K, vals, cnt, enc):
    """Every layer of a streamed group as one DENSE segment, a view of ``vals`` (with the
    plan's ``qb`` as its ``quant_bucket`` where it has one, as the per-layer path)."""
    payloads = {}
    for j, (it, pl) in enumerate(zip(items, plans)):
        o, n = int(tab[j, K.C_OUT]), pl["n"]
        qb = {"quant_bucket": pl["qb"]} if "qb" in pl else {}
        seg = Segment(numel=n, capacity=n, index_encoding=IndexEncoding.DENSE,
                      value_encoding=enc, count=cnt[j:j + 1], values=vals[o:o + n], **qb)
        payloads[it.name] = LayerPayload(it.name, it.grad.shape, [seg])
    _finish(comp, items, step, payloads, dict(density=1.0))
    return payloads


def _dense_bucket(comp, items, plans, step, grad_scale):
    K = ops.bucket_kernels("dense")
    dev = items[0].grad.device
    staged = _staged(comp, "dense", items, K.W)
    keep = []                 # flushed residuals: alive until the launch is queued

    def cells(row, it, pl):
        r = comp._residuals.pop(it.name, None)
        if r is not None:
            r = r.to(dev)
            keep.append(r)
            row[K.C_R] = r.data_ptr()
            row[K.C_MODE] = K.MODE_RES
    out, nprog = _streamed_rows(comp, K, staged.host, items, plans, cells)
    vals, cnt = run_segment(comp, _dense_launches, staged, K, program_map(nprog, dev),
                            grad_scale, _GDT[items[0].grad.dtype], len(items), out)
    table = staged.table()
    payloads = _streamed_payloads(comp, items, plans, step, staged.host, K, vals, cnt,
                                  ValueEncoding.FP32)
    return payloads, BucketBatch([it.name for it in items], table, None, cnt, 0, [], K)


def _dense_launches(table, K, blk, grad_scale, gdt, L, out):
    """The policy-dense group's device segment (:mod:`hvdsparse.device_graphs`)."""
    vals = _empty(out, torch.float32, table.device)
    cnt = _empty(L, torch.int32, table.device)
    K.dense_copy(table, blk, grad_scale, vals, cnt, gdt, block=DENSE_BLOCK)
    return vals, cnt


# ------------------------------------------------------------------ whole rows
def _whole_bucket(comp, items, plans, step, grad_scale):
    """``Compressor._whole`` for a group (one gradient dtype and value encoding): one
    ``whole_cast`` launch; the DENSE segments are views of one buffer."""
    K = ops.bucket_kernels("dense")
    dev = items[0].grad.device
    enc = plans[0]["enc"]
    staged = _staged(comp, "whole", items, K.W)

    out, nprog = _streamed_rows(comp, K, staged.host, items, plans,
                                lambda row, it, pl: _ef_cells(comp, K, row, it, pl))
    vals, cnt = run_segment(comp, _whole_launches, staged, K, program_map(nprog, dev),
                            grad_scale, _GDT[items[0].grad.dtype], len(items), out,
                            FLOAT_DTYPES[enc], _RK_VE[enc])
    table = staged.table()
    payloads = _streamed_payloads(comp, items, plans, step, staged.host, K, vals, cnt, enc)
    return payloads, BucketBatch([it.name for it in items], table, None, cnt, 0, [], K)


def _whole_launches(table, K, blk, grad_scale, gdt, L, out, vdtype, ve):
    """The whole group's device segment (:mod:`hvdsparse.device_graphs`)."""
    vals = _empty(out, vdtype, table.device)
    cnt = _empty(L, torch.int32, table.device)
    K.whole_cast(table, blk, grad_scale, vals, cnt, gdt, ve, block=DENSE_BLOCK)
    return vals, cnt


# ------------------------------------------------------------------ QSGD rows
def _qsgd_bucket(comp, items, plans, step, grad_scale):
    K = ops.bucket_kernels("dense")
    L = len(items)
    dev = items[0].grad.device
    bits, B = plans[0]["bits"], plans[0]["qb"]
    rows = K.qsgd_rows(B, bits)
    staged = _staged(comp, "qsgd", items, K.W)
    tab = staged.host
    coff = soff = blk0 = 0
    nprog = []
    for j, (it, pl) in enumerate(zip(items, plans)):
        comp._open_layer(it.name)
        row = tab[j]
        n = pl["n"]
        _ef_cells(comp, K, row, it, pl)
        row[K.C_G] = it.grad.data_ptr()
        row[K.C_N] = n
        row[K.C_NF] = it.nonfinite.data_ptr()
        row[K.C_OUT] = coff
        row[K.C_SOFF] = soff
        row[K.C_SEED] = pl["seed"]
        row[K.C_BLK0] = blk0
        nb = _cdiv(n, B)
        coff += _cdiv(n * bits, 8)
        soff += nb
        nprog.append(_cdiv(nb, rows))
        blk0 += nprog[-1]
    codes, scales, cnt = run_segment(comp, _qsgd_launches, staged, K,
                                     program_map(nprog, dev), grad_scale,
                                     _GDT[items[0].grad.dtype], L, coff, soff, bits, B, rows)
    table = staged.table()
    payloads = {}
    for j, (it, pl) in enumerate(zip(items, plans)):
        n = pl["n"]
        c0, s0 = int(tab[j, K.C_OUT]), int(tab[j, K.C_SOFF])
        seg = Segment(numel=n, capacity=n, index_encoding=IndexEncoding.DENSE,
                      value_encoding=pl["enc"], count=cnt[j:j + 1],
                      values=codes[c0:c0 + _cdiv(n * bits, 8)],
                      scales=scales[s0:s0 + _cdiv(n, B)], quant_bucket=B)
        payloads[it.name] = LayerPayload(it.name, it.grad.shape, [seg])
    _finish(comp, items, step, payloads, {})
    return payloads, BucketBatch([it.name for it in items], table, None, cnt, 0, [], K)


def _qsgd_launches(table, K, blk, grad_scale, gdt, L, coff, soff, bits, B, rows):
    """The QSGD group's device segment (:mod:`hvdsparse.device_graphs`)."""
    dev = table.device
    codes = _empty(coff, torch.uint8, dev)
    scales = _empty(soff, torch.float32, dev)
    cnt = _empty(L, torch.int32, dev)
    K.qsgd_pack(table, blk, grad_scale, codes, scales, cnt, gdt, bits, B, rows)
    return codes, scales, cnt


# ------------------------------------------------------------------ AdaComp rows
def _adacomp_bucket(comp, items, plans, step, grad_scale):
    """``AdaComp._compress``'s Triton route for a group (one bin size, ``max_per_bin``
    and ``scale``): ``kernels/bucket_binned.py``, one ``ops.segment_means`` launch (every
    layer's scale, the per-layer path's bits) and one ``cumsum`` per group. DGC's velocity
    update folds into the accumulate launch; masking stays per layer (``LocalUpdate.
    mask`` on the ordinary payloads: the batch lists no momentum rows)."""
    from .topk_bucket import momentum_cells
    K = ops.bucket_kernels("binned")
    Lr = len(items)
    dev = items[0].grad.device
    Lb, c, hm1 = plans[0]["L"], plans[0]["c"], plans[0]["hm1"]
    rows = K.tile_rows(Lb)
    staged = _staged(comp, "adacomp", items, K.W)
    tab = staged.host
    bin0 = slot0 = word0 = blk0 = 0
    nprog = []
    cut = False
    for j, (it, pl) in enumerate(zip(items, plans)):
        row = tab[j]
        _layer_cells(comp, row, K, it)
        mode = K.MODE_PRE if pl["pre"] else 0
        ms = it.momentum
        if ms is not None:
            mode = momentum_cells(row, K, ms, it.param)
        row[K.C_MODE] = mode
        row[K.C_NB] = pl["nb"]
        row[K.C_BIN0], row[K.C_SLOT0], row[K.C_WORD0] = bin0, slot0, word0
        row[K.C_BLK0] = blk0
        row[K.C_BUDGET] = pl["cap"]                 # nb * c when there is no budget
        row[K.C_ROT] = comp.rotation(step, pl["nb"])
        cut = cut or pl["cap"] < pl["nb"] * c
        bin0 += pl["nb"]
        slot0 += pl["cap"]
        word0 += max(1, _cdiv(pl["cap"], 32))
        nprog.append(_cdiv(pl["nb"], rows))
        blk0 += nprog[-1]
    rel, words, selected, cnt, scales, counts = run_segment(
        comp, _adacomp_launches, staged, K, program_map(nprog, dev), grad_scale,
        _GDT[items[0].grad.dtype], Lr, Lb, hm1, c, rows, bin0, slot0, word0, cut)
    table = staged.table()
    wbytes = words.view(torch.uint8)
    payloads = {}
    for j, (it, pl) in enumerate(zip(items, plans)):
        b0, s0, w0 = (int(tab[j, K.C_BIN0]), int(tab[j, K.C_SLOT0]),
                      int(tab[j, K.C_WORD0]))
        cap = pl["cap"]
        seg = Segment(numel=pl["n"], capacity=cap, index_encoding=pl["ienc"],
                      value_encoding=ValueEncoding.SIGN1, count=counts[j:j + 1],
                      values=wbytes[4 * w0:4 * w0 + _cdiv(cap, 8)],
                      indices=rel[s0:s0 + cap], scales=scales[j:j + 1],
                      bin_counts=cnt[b0:b0 + pl["nb"]], bin_size=Lb)
        payloads[it.name] = LayerPayload(it.name, it.grad.shape, [seg])
        p = payloads[it.name]
        p.nonfinite = it.nonfinite
        comp._stats.record(it.name, step, p, extra=dict(nonfinite=it.nonfinite),
                           selected=selected[j:j + 1], threshold=scales[j])
    return payloads, BucketBatch([it.name for it in items], table, None, counts, 0, [], K)


def _adacomp_launches(table, K, blk, grad_scale, gdt, Lr, Lb, hm1, c, rows, bin0, slot0,
                      word0, cut):
    """The AdaComp group's device segment (:mod:`hvdsparse.device_graphs`): ``(rel,
    words, selected, bin counts, scales, counts)``."""
    dev = table.device
    wide = Lb > 256
    relw = _cdiv(slot0 * (2 if wide else 1), 4)
    # one buffer the accumulate launch zeroes: slots (unused ones stay 0), sign words,
    # selected counters
    zero = _empty(relw + word0 + Lr, torch.int32, dev)
    rel = zero[:relw].view(torch.int16 if wide else torch.uint8)[:slot0]
    words = zero[relw:relw + word0]
    selected = zero[relw + word0:]
    gmax = _empty(bin0, torch.float32, dev)
    cnt = _empty(bin0, torch.int32, dev)
    scales = _empty(Lr, torch.float32, dev)
    counts = _empty(Lr, torch.int32, dev)
    K.accumulate(table, blk, grad_scale, gmax, zero, gdt, Lb, rows)
    # one scale per layer, the mean of its bin maxima: every row in one launch, each
    # with the per-layer path's bits (ops.segment_mean)
    ops.segment_means(gmax, table, K.W, K.C_BIN0, K.C_NB, Lr, scales)
    K.count(table, blk, grad_scale, gmax, cnt, selected, gdt, Lb, hm1, c, rows)
    if cut:                   # a layer budget below its bins' slots: cnt -> quota
        K.quota(table, cnt, Lr, c)
    cum = torch.cumsum(cnt, 0, dtype=torch.int32)
    K.pack(table, blk, grad_scale, gmax, cnt, cum, scales, rel, words, counts, gdt, Lb,
           hm1, c, rows)
    return rel, words, selected, cnt, scales, counts


# ------------------------------------------------------------------ picking rows
def _picking_rows(comp, items, plans, cells):
    """The table of a group whose rows send slots picked by index after
    ``kernels/bucket_topk.py``'s accumulate launch (RandomK's and Slim-DP's rows): each
    row's accumulating cells (:func:`_layer_cells`, DGC's velocity), its output offset
    and first program; ``cells(row, item, plan)`` writes the row's own cells and returns
    its slot count (``C_CAP``). Returns ``(K, staged table, program map, slots,
    momentum row names)``; the group's device segment (:func:`_randomk_launches`,
    :func:`_slimdp_launches`) starts with :func:`_picking_accumulate`."""
    from .topk_bucket import BLOCK, momentum_cells
    K = ops.bucket_kernels("topk")
    dev = items[0].grad.device
    staged = _staged(comp, "picking", items, K.W)
    tab = staged.host
    out = blk0 = 0
    mom, nprog = [], []
    for j, (it, pl) in enumerate(zip(items, plans)):
        row = tab[j]
        _layer_cells(comp, row, K, it)
        if it.momentum is not None:
            mom.append(it.name)
            row[K.C_MODE] = momentum_cells(row, K, it.momentum, it.param)
        slots = cells(row, it, pl)
        row[K.C_CAP] = slots
        row[K.C_OUT] = out
        row[K.C_BLK0] = blk0
        out += slots
        nprog.append(_cdiv(pl["n"], BLOCK))
        blk0 += nprog[-1]
    return K, staged, program_map(nprog, dev), out, mom


# ------------------------------------------------------------------ RandomK rows
def _randomk_bucket(comp, items, plans, step, grad_scale):
    """``RandomK._compress`` for a group (one gradient dtype and value encoding):
    ``kernels/bucket_topk.py``'s accumulate launch (error feedback, DGC's velocity),
    then ``kernels/bucket_randomk.py``'s draw-and-pick launch. Shared-seed layers get
    IMPLICIT segments (``implicit_indices``: the drawn indices, int64, written by the
    same launch)."""
    RK = ops.bucket_kernels("randomk")
    L = len(items)

    def cells(row, it, pl):
        row[RK.C_SEED] = pl["seed"]
        return pl["k"]
    K, staged, blk, out, mom = _picking_rows(comp, items, plans, cells)
    tab, enc = staged.host, plans[0]["enc"]
    kmax = max(pl["k"] for pl in plans)
    idx, vals, cnt, wide = run_segment(
        comp, _randomk_launches, staged, K, RK, blk, grad_scale,
        K.GDT_CODE[items[0].grad.dtype], FLOAT_DTYPES[enc], L, out, kmax, _RK_VE[enc],
        any(pl["shared"] for pl in plans))
    table = staged.table()
    payloads = {}
    for j, (it, pl) in enumerate(zip(items, plans)):
        o, k = int(tab[j, K.C_OUT]), pl["k"]
        if pl["shared"]:
            seg = Segment(numel=pl["n"], capacity=k, index_encoding=IndexEncoding.IMPLICIT,
                          value_encoding=enc, count=cnt[j, 0:1], values=vals[o:o + k],
                          scales=None, quant_bucket=pl["qb"],
                          implicit_indices=wide[o:o + k])
        else:
            seg = Segment(numel=pl["n"], capacity=k, index_encoding=IndexEncoding.INT32,
                          value_encoding=enc, count=cnt[j, 0:1], values=vals[o:o + k],
                          indices=idx[o:o + k], scales=None, quant_bucket=pl["qb"],
                          narrow_indices=True)
        p = payloads[it.name] = LayerPayload(it.name, it.grad.shape, [seg])
        p.nonfinite = it.nonfinite
        comp._stats.record(it.name, step, p, extra=dict(nonfinite=it.nonfinite),
                           density=pl["d"])
    return payloads, BucketBatch([it.name for it in items], table, idx, cnt, kmax, mom, K)


def _picking_accumulate(table, K, blk, grad_scale, gdt, vdtype, out):
    """The start of a picking group's device segment: ``kernels/bucket_topk.py``'s
    accumulate launch (error feedback, DGC's velocity) and the ``out`` slots' buffers
    ``(idx int32, vals in vdtype)``."""
    K.accumulate(table, blk, grad_scale, gdt, block=topk_bucket.BLOCK)
    return _empty(out, torch.int32, table.device), _empty(out, vdtype, table.device)


def _randomk_launches(table, K, RK, blk, grad_scale, gdt, vdtype, L, out, kmax, ve, shared):
    """The RandomK group's device segment (:mod:`hvdsparse.device_graphs`): ``(idx,
    vals, counts [L, 2], drawn int64 indices or None)``."""
    dev = table.device
    idx, vals = _picking_accumulate(table, K, blk, grad_scale, gdt, vdtype, out)
    cnt = _empty(2 * L, torch.int32, dev).view(L, 2)
    wide = _empty(out, torch.int64, dev) if shared else None
    RK.pick(table, idx, vals, cnt, L, kmax, ve, wide, W=K.W)
    return idx, vals, cnt, wide


# ------------------------------------------------------------------ Slim-DP rows
def _slimdp_bucket(comp, items, plans, step, grad_scale):
    """``SlimDP._compress`` on its core + explorer steps for a group (one gradient dtype
    and value encoding): ``kernels/bucket_topk.py``'s accumulate launch (error feedback,
    DGC's velocity), then ``kernels/bucket_slimdp.py``'s gather-and-draw launch. Each
    layer's core (int64, on the device, rank 0's choice broadcast at its last
    re-selection) is read where it lies; its values travel as an IMPLICIT segment, the
    explorer as an INT32 one, both views of the group's buffers."""
    SK = ops.bucket_kernels("slimdp")
    L = len(items)
    dev = items[0].grad.device
    cores = []

    def cells(row, it, pl):
        core = comp._layer_core(it.name, pl["n"], pl["nc"], dev) if pl["nc"] else None
        cores.append(core)
        row[SK.C_NCORE] = pl["nc"]
        row[SK.C_NEX] = pl["ne"]
        row[SK.C_CORE] = 0 if core is None else core.data_ptr()
        row[SK.C_SEED] = pl["seed"]
        return pl["nc"] + pl["ne"]
    K, staged, blk, out, mom = _picking_rows(comp, items, plans, cells)
    tab, enc = staged.host, plans[0]["enc"]
    totmax = max(pl["nc"] + pl["ne"] for pl in plans)
    idx, vals, cnt, parts = run_segment(
        comp, _slimdp_launches, staged, K, SK, blk, grad_scale,
        K.GDT_CODE[items[0].grad.dtype], FLOAT_DTYPES[enc], L, out, totmax,
        max(pl["nc"] for pl in plans), _RK_VE[enc])
    table = staged.table()
    payloads = {}
    for j, (it, pl, core) in enumerate(zip(items, plans, cores)):
        o, nc, ne, n = int(tab[j, K.C_OUT]), pl["nc"], pl["ne"], pl["n"]
        segs = []
        if nc:
            segs.append(Segment(numel=n, capacity=nc, index_encoding=IndexEncoding.IMPLICIT,
                                value_encoding=enc, count=parts[j, 0:1],
                                values=vals[o:o + nc], scales=None, quant_bucket=pl["qb"],
                                implicit_indices=core))
        if ne:
            segs.append(Segment(numel=n, capacity=ne, index_encoding=IndexEncoding.INT32,
                                value_encoding=enc, count=parts[j, 1:2],
                                values=vals[o + nc:o + nc + ne],
                                indices=idx[o + nc:o + nc + ne], scales=None,
                                quant_bucket=pl["qb"], narrow_indices=True))
        p = payloads[it.name] = LayerPayload(it.name, it.grad.shape, segs)
        p.nonfinite = it.nonfinite
        comp._stats.record(it.name, step, p,
                           extra=dict(dense_push=False, nonfinite=it.nonfinite))
    return payloads, BucketBatch([it.name for it in items], table, idx, cnt, totmax, mom, K)


def _slimdp_launches(table, K, SK, blk, grad_scale, gdt, vdtype, L, out, totmax, ncmax, ve):
    """The Slim-DP group's device segment (:mod:`hvdsparse.device_graphs`): ``(idx,
    vals, counts [L, 2], core / explorer counts [L, 2])``."""
    dev = table.device
    idx, vals = _picking_accumulate(table, K, blk, grad_scale, gdt, vdtype, out)
    cnt4 = _empty(4 * L, torch.int32, dev)
    cnt, parts = cnt4[:2 * L].view(L, 2), cnt4[2 * L:].view(L, 2)
    SK.gather(table, idx, vals, cnt, parts, L, totmax, ncmax, ve, W=K.W)
    return idx, vals, cnt, parts
