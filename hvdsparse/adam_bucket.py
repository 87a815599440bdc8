"""The Adam recipe's update wire on the bucket path: every rank's own Adam step of all
the recipe layers of a bucket made in one launch per gradient dtype
(``kernels/bucket_adam.py``), instead of ~10 launches per layer (``AdamRecipe._own_step``,
which gives the same bits).

The step engine (:meth:`hvdsparse.engine.StepEngine.compress_group`) asks the recipe
which layers qualify (:meth:`AdamRecipe.bucket_own_step`), calls :func:`own_steps`, and
hands each layer's ``x`` to the compressor's bucket path as its whole input (already
scaled and cleaned: ``clean_input``), as the per-layer path hands ``x`` to
``compress()`` after ``AdamRecipe.corrected``. Per group, written here: ``x``, the new
moments ``m'``, ``v'`` (one fp32 buffer each; each layer's slice is its tensor; ``(m',
v')`` wait in the recipe's ``_moments`` for ``step()`` to commit, as per layer) and the
layers' non-finite counts. Host work: a few host numbers per layer and one
host-to-device copy of the group's staged table (pinned, non-blocking on CUDA:
:mod:`hvdsparse.row_tables`); no host sync.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

import torch

from . import ops
from .compressors.topk_bucket import BLOCK, block_table, float_bits, row_tables
from .device_graphs import run_segment

__all__ = ["OwnStepRow", "own_steps"]


class OwnStepRow(NamedTuple):
    name: str
    grad: torch.Tensor
    param: torch.Tensor
    nonfinite: torch.Tensor      # int32[1] counter on the gradient's device
    made: tuple                  # AdamRecipe.bucket_own_step's (state, group, constants)


def own_steps(recipe, rows: List[OwnStepRow],
              grad_scale: Optional[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``x`` of every row (name -> fp32 tensor of the gradient's shape), one launch per
    (device, gradient dtype); each layer's ``(m', v')`` left in ``recipe._moments``."""
    K = ops.bucket_kernels("adam")
    groups: Dict[tuple, List[OwnStepRow]] = {}
    for r in rows:
        groups.setdefault((r.grad.device, r.grad.dtype), []).append(r)
    out = {}
    for (dev, dtype), group in groups.items():
        ns = [r.grad.numel() for r in group]
        total = sum(ns)
        buf = torch.empty(3 * total, dtype=torch.float32, device=dev)
        xs, ms, vs = buf[:total], buf[total:2 * total], buf[2 * total:]
        staged = row_tables(recipe).take(("adam", tuple(r.name for r in group)),
                                         len(group), K.W, dev)
        tab = staged.host
        o = blk0 = 0
        for j, (r, n) in enumerate(zip(group, ns)):
            st, pg, (b1, c1, b2, c2, ib2, eps, ib1) = r.made
            row = tab[j]
            row[K.C_G] = r.grad.data_ptr()
            row[K.C_N] = n
            row[K.C_BLK0] = blk0
            row[K.C_NF] = r.nonfinite.data_ptr()
            row[K.C_M] = st["exp_avg"].data_ptr()
            row[K.C_V] = st["exp_avg_sq"].data_ptr()
            row[K.C_X] = xs[o].data_ptr()
            row[K.C_MO] = ms[o].data_ptr()
            row[K.C_VO] = vs[o].data_ptr()
            for col, val in ((K.C_B1, b1), (K.C_C1, c1), (K.C_B2, b2), (K.C_C2, c2),
                             (K.C_IB2, ib2), (K.C_EPS, eps), (K.C_IB1, ib1),
                             (K.C_LR, pg["lr"])):
                row[col] = float_bits(val)
            mode = 0
            wd = pg.get("weight_decay", 0.0)
            if wd and not pg.get("decoupled_weight_decay", False):
                mode |= K.MODE_L2
                row[K.C_WD] = float_bits(wd)
                row[K.C_P] = r.param.data_ptr()
            if pg.get("maximize", False):
                mode |= K.MODE_MAXIMIZE
            row[K.C_MODE] = mode
            shape = r.grad.shape
            out[r.name] = xs[o:o + n].view(shape)
            recipe._moments[r.name] = (ms[o:o + n].view(shape), vs[o:o + n].view(shape))
            o += n
            blk0 += -(-n // BLOCK)
        gs = grad_scale
        if gs is not None and gs.device != dev:
            gs = gs.to(dev)
        run_segment(recipe, _launch, staged, K, block_table(ns, dev), gs,
                    K.GDT_CODE[dtype], capturable=ops.use_triton(group[0].grad))
    return out


def _launch(table, K, blk, grad_scale, gdt):
    """The group's device segment (:mod:`hvdsparse.device_graphs`): one launch writing
    ``x``, ``m'`` and ``v'`` where the table's rows point (this step's buffer)."""
    K.own_step(table, blk, grad_scale, gdt, block=BLOCK)
