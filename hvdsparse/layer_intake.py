"""The Horovod door's intake of ready layers: each becomes this step's payload, at once
(per layer, :meth:`hvdsparse.engine.StepEngine.compress`) or -- the bucket path -- when
the rest of its bucket is ready (:meth:`LayerIntake.compress_bucket`: the bucket's
waiting layers in one :meth:`~hvdsparse.engine.StepEngine.compress_group`, a fixed number
of launches). A layer without a gradient contributes an absent payload (its wire layout,
nothing in it, its residual untouched), or a zero gradient where the local update asks
for one (the Adam recipe, as Horovod's fill).

Once the plan exists every layer counts its non-finite elements into its slice of one
zeroed int32 tensor per step (:class:`hvdsparse.nonfinite.NonFinite`: one allocation per
step instead of one per layer), which is then the row the non-finite allgather sends.

State of one step, cleared by the door (:meth:`LayerIntake.clear`): ``payloads`` (by
name), ``ready_order``, ``deferred`` (bucket -> layers waiting for it), ``batches``
(bucket -> the bucket path's batches, for the feedback's masking); ``t_compress``:
seconds spent compressing. ``events``: the door's step log (``("ready", name)``,
``("absent", name)``, ``("bucket_path", bucket, layers)``).
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

import torch

from .engine import LayerInput
from .nonfinite import NonFinite

__all__ = ["LayerIntake"]


class LayerIntake:
    """See the module docstring. ``params``: the door's parameters by name (the same
    dict); ``engine``: its :class:`~hvdsparse.engine.StepEngine`; ``events``: the door's
    event list (appended to)."""

    def __init__(self, params: Dict[str, torch.Tensor], engine, events: list):
        self.params = params
        self.engine = engine
        self.events = events
        self.payloads: Dict[str, object] = {}
        self.ready_order: List[str] = []
        self.deferred: Dict[int, List[str]] = {}
        self.batches: Dict[int, list] = {}
        self.nf = NonFinite(())        # the plan's layers' counters (set at the plan)
        self.t_compress = 0.0

    def counter(self, name: str, device) -> Optional[torch.Tensor]:
        """Layer ``name``'s counter slice of the step (None before the plan: the callee
        makes its own)."""
        return self.nf.counter(name, device)

    def compress(self, name: str, step: int) -> None:
        """Layer ``name``'s payload from its ``p.grad``, now (per layer)."""
        p = self.params[name]
        t0 = time.perf_counter()
        nonfinite = self.counter(name, p.grad.device)
        payload = self.engine.compress(name, p.grad, p, step, nonfinite)
        self.t_compress += time.perf_counter() - t0
        self.payloads[name] = payload
        self.ready_order.append(name)
        self.events.append(("ready", name))

    def compress_absent(self, name: str, step: int) -> None:
        """Payload of a layer without a gradient this step: its wire layout, contributing
        zero, residual and compressor state untouched (the Adam recipe: a zero
        gradient, compressed)."""
        p = self.params[name]
        if self.engine.zero_fills(p):
            p.grad = torch.zeros_like(p)   # Adam recipe: a zero gradient, as Horovod's fill
            return self.compress(name, step)
        payload = self.engine.compress_absent(name, p, step, self.counter(name, p.device))
        self.payloads[name] = payload
        self.ready_order.append(name)
        self.events.append(("absent", name))

    def defer(self, b: int, name: str) -> None:
        """Layer ``name`` waits for the rest of bucket ``b``."""
        self.deferred.setdefault(b, []).append(name)

    def compress_bucket(self, b: int, step: int) -> None:
        """Compress bucket ``b``'s waiting layers (:meth:`StepEngine.compress_group`:
        those the bucket path takes together, the others one by one)."""
        names = self.deferred.pop(b, None)
        if not names:
            return
        t0 = time.perf_counter()
        layers = [LayerInput(n, self.params[n].grad, self.params[n],
                             self.counter(n, self.params[n].grad.device))
                  for n in names]
        batches = self.batches.setdefault(b, [])
        n_before = len(batches)
        payloads = self.engine.compress_group(layers, step, batches)
        for batch in batches[n_before:]:
            self.events.append(("bucket_path", b, len(batch.names)))
        for name, payload in zip(names, payloads):
            self.payloads[name] = payload
            self.ready_order.append(name)
            self.events.append(("ready", name))
        self.t_compress += time.perf_counter() - t0

    def nonfinite_row(self, names: Sequence[str], device) -> torch.Tensor:
        """This rank's [1, len(names)] non-finite counts of the step (``names``'
        payloads)."""
        return self.nf.row(names, [self.payloads[n] for n in names], device)

    def clear(self) -> None:
        """Forget the step's payloads, waiting layers and counters."""
        self.payloads.clear()
        self.ready_order.clear()
        self.nf.reset()
        self.deferred.clear()
        self.batches.clear()
