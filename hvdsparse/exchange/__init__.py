"""Exchange strategies: how one bucket of payloads crosses the ranks.

=============  ===================================================================
``allgather``  encoded bucket through ``hvd.allgather``; decode + sum all P messages
``split``      SparCML split allgather: alltoall of index ranges to their owners,
               owner reduces, allgather of the reduced ranges (sparse, or dense /
               quantised once denser than SparCML's delta)
``dense``      allreduce of the flat error-fed selection (fp32 or fp16)
``balanced``   Ok-Topk: split with regions balanced to where the selections fall,
               each owner keeps its share of the global top-k, fixed-size allgather
               (bytes nearly flat in P; phase-2 truncation reported, not fed back)
``auto``       per bucket, the cheapest of the four by :mod:`.cost_model`
=============  ===================================================================

Each strategy module exposes ``launch(spec, payloads, ctx) -> Pending``; ``Pending.finish``
returns the flat fp32 **sum** over ranks (valid until that bucket's next launch: buffers
are reused). Collectives go through ``ctx.comm()`` (:mod:`hvdsparse.transport`; Horovod
by default). No blocking device read on the trusted (``validate=False``) path; the cost
model's figures come back through ``Pending.deferred_figures``. See :mod:`.base`.
"""
from __future__ import annotations

import importlib

from . import cost_model
from .base import (BucketSpec, BufferPool, DeferredFigures, ExchangeContext, HostReadout,
                   Pending, ReadoutBatch)

#: strategy name -> its module (``exchange/<name>.py``); the names and their tie order
#: are :data:`cost_model.STRATEGIES`
STRATEGIES = {name: importlib.import_module(f"{__name__}.{name}")
              for name in cost_model.STRATEGIES}
#: what ``exchange=`` accepts: ``"auto"`` (the cost model chooses per bucket) or a strategy
EXCHANGE_NAMES = ("auto",) + cost_model.STRATEGIES


def check_exchange(name) -> str:
    """Validate an ``exchange=`` argument; returns it."""
    if not isinstance(name, str) or name not in EXCHANGE_NAMES:
        raise ValueError(f"exchange must be one of {', '.join(map(repr, EXCHANGE_NAMES))}, "
                         f"got {name!r}")
    return name


#: the strategies whose message carries the bucket's non-finite counts (one collective
#: for both); the others' buckets leave them to the door's own small allgather
CARRY_NONFINITE = frozenset({"allgather", "dense"})


def launch(strategy: str, spec: BucketSpec, payloads, ctx: ExchangeContext,
           nonfinite_row=None) -> Pending:
    """Start ``strategy`` for the bucket; ``nonfinite_row`` (int32 [1, len(spec.names)],
    this rank's counts) rides in the message where the strategy carries it
    (:data:`CARRY_NONFINITE`: then ``Pending.carries_nonfinite``)."""
    try:
        mod = STRATEGIES[strategy]
    except KeyError:
        raise ValueError(f"unknown exchange strategy {strategy!r}; choose from "
                         f"{', '.join(map(repr, STRATEGIES))}") from None
    if nonfinite_row is not None and nonfinite_row.numel() != len(spec.names):
        raise ValueError(f"bucket {spec.bucket_id}: nonfinite_row has "
                         f"{nonfinite_row.numel()} counts for {len(spec.names)} layers")
    if nonfinite_row is not None and strategy in CARRY_NONFINITE:
        pend = mod.launch(spec, payloads, ctx, nonfinite_row=nonfinite_row)
    else:
        pend = mod.launch(spec, payloads, ctx)
    pend.nonfinite_row = nonfinite_row
    return pend


__all__ = ["STRATEGIES", "EXCHANGE_NAMES", "CARRY_NONFINITE", "check_exchange", "launch", "BucketSpec",
           "ExchangeContext", "Pending", "cost_model", "BufferPool", "DeferredFigures",
           "HostReadout", "ReadoutBatch"]
