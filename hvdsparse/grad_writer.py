"""The Horovod door's writing of exchanged gradients into ``p.grad``, and its sparse
gradients.

Contract of :meth:`GradWriter.write` (one call per step, after the non-finite policy let
the step through): bucket ``b``'s flat exchanged gradient ``total`` (the rank-order sum,
already averaged) goes, layer by layer in the bucket's order, into ``p.grad``:

* in GradScaler's scaled units: ``total / inv`` with ``inv`` = 1 / loss scale (exact, a
  power of two); the local-gradient combination, DGC's dense-layer momentum and
  ``after_exchange`` work in unscaled units, like the residuals;
* a frozen parameter (``requires_grad=False``) keeps its ``p.grad``; a layer densified
  by ``sparse_as_dense`` gets a sparse ``p.grad`` back; a ``p.grad`` of the right shape
  is written in place (one multi-tensor copy per bucket without the local-gradient
  combination), any other is replaced.

Sparse gradients (``nn.Embedding(sparse=True)``, ``sparse_as_dense=False``) never enter
a bucket: :meth:`GradWriter.launch_sparse` starts the transport's sparse allreduce (as
``hvd.DistributedOptimizer`` does) and :meth:`GradWriter.finish_sparse` writes its
coalesced result. A layer is always sparse or always dense.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .exchange import BucketSpec

__all__ = ["GradWriter", "empty_sparse_like"]


class GradWriter:
    """See the module docstring. ``params``: the door's parameters by name (the same
    dict); ``engine``: its :class:`hvdsparse.engine.StepEngine`; ``settings``: its
    :class:`ExchangeSettings` (``average`` read when used); ``local``: the
    local-gradient combination (:mod:`hvdsparse.local`) or None.

    Per-step state, cleared by the door: ``frozen`` (layers without a gradient that do
    not train: ``p.grad`` kept), ``was_sparse`` (densified layers),
    ``sparse_handles``; across steps: ``sparse_layers``."""

    def __init__(self, params: Dict[str, torch.Tensor], engine, transport, settings, *,
                 prefix: str, world_size: int, local=None):
        self.params = params
        self.engine = engine
        self.transport = transport
        self.settings = settings
        self.prefix = prefix
        self.world_size = world_size
        self.local = local
        self.frozen: set = set()
        self.was_sparse: set = set()
        self.sparse_layers: set = set()
        self.sparse_handles: Dict[str, object] = {}

    # ------------------------------------------------------------------ sparse
    def densify(self, name: str, p) -> None:
        """``sparse_as_dense``: the sparse gradient becomes dense and is compressed like any
        other layer; the exchanged gradient goes back to sparse (as Horovod does)."""
        p.grad = p.grad.to_dense()
        self.was_sparse.add(name)

    def launch_sparse(self, name: str, grad: torch.Tensor, planned_dense: bool) -> None:
        """Start layer ``name``'s sparse allreduce (``planned_dense``: the first step's
        plan made it a dense layer, an error)."""
        if planned_dense:
            raise RuntimeError(f"hvdsparse: parameter {name!r} produced a sparse gradient, "
                               f"but it was planned as a dense layer at the first step; a "
                               f"layer's gradients must be always sparse or always dense")
        self.sparse_layers.add(name)
        self.sparse_handles[name] = self.transport.sparse_allreduce_async(
            grad.coalesce(), name=f"{self.prefix}.sparse.{name}",
            average=self.settings.average)

    def finish_sparse(self, write: bool = True) -> None:
        """Wait for every sparse allreduce; ``write``: the result into ``p.grad``
        (trainable parameters)."""
        for name, handle in list(self.sparse_handles.items()):
            out = self.transport.synchronize(handle) if not callable(handle) else handle()
            p = self.params[name]
            if write and p.requires_grad:
                p.grad = out.coalesce()
        self.sparse_handles.clear()

    # ------------------------------------------------------------------ dense buckets
    def write(self, specs, totals, payloads, step: int) -> None:
        """Every bucket's ``total`` into its layers' ``p.grad`` (the module docstring);
        ``payloads``: this step's payloads by name."""
        for spec, total in zip(specs, totals):
            inv = self.engine.grad_scale(total.device)
            if inv is not None:   # back to the scaled units GradScaler expects
                total.div_(inv)
            if self.local is not None:   # combines each layer with its own gradient
                for name, view in zip(spec.names, spec.views(total)):
                    self.apply(name, view, payloads[name], step, inv)
            else:
                self.apply_bucket(spec, total, step, inv)

    def apply_bucket(self, spec: BucketSpec, total: torch.Tensor, step: int,
                     inv: Optional[torch.Tensor]) -> None:
        """:meth:`apply` for a whole bucket without the local-gradient combination, in a
        fixed number of device ops per bucket: ``after_exchange`` (reads the average),
        DGC's dense-layer momentum (:meth:`StepEngine.dense_momentum_bucket`), then one
        multi-tensor copy into the ``p.grad`` s (cast to their dtype). The same bits as
        :meth:`apply`."""
        names = spec.names
        params = [self.params[n] for n in names]
        views = [v.view(p.shape) for v, p in zip(spec.views(total), params)]
        if self.engine.reads_exchanged:
            for n, g, p in zip(names, views, params):
                self.engine.after_exchange(n, g if inv is None else g * inv, p, step)
        live = [i for i, n in enumerate(names) if n not in self.frozen]
        moms = self.engine.dense_momentum_bucket(
            [names[i] for i in live], [views[i] for i in live], [params[i] for i in live], inv)
        dst, src = [], []
        with torch.no_grad():
            for i, m in zip(live, moms):
                p, g, grad = params[i], views[i] if m is None else m, params[i].grad
                if names[i] in self.was_sparse:
                    p.grad = g.to(p.dtype).to_sparse()
                elif grad is not None and grad.shape == p.shape and not grad.is_sparse:
                    dst.append(grad)
                    src.append(g)
                else:
                    p.grad = g.to(p.dtype).clone()
            if dst:
                torch._foreach_copy_(dst, src)

    def apply(self, name: str, g_flat: torch.Tensor, payload, step: int,
              inv: Optional[torch.Tensor] = None) -> None:
        """Write the exchanged gradient ``g_flat`` (in GradScaler's scaled units when
        ``inv`` = 1 / scale is given) into ``p.grad``. The local-gradient combination
        (with the layer's own ``payload``), dense-layer momentum (DGC) and
        ``after_exchange`` (Slim-DP's core choice) work in unscaled units, like the
        residuals and payloads: ``x * inv`` and ``x / inv`` are exact (a power of two)."""
        p = self.params[name]
        g = g_flat.view(p.shape)
        engine = self.engine
        if name not in self.frozen:
            if self.local is not None and p.grad is not None:
                s = 1.0 / self.world_size if self.settings.average else 1.0
                if inv is None:
                    c = self.local.combine(name, g, p.grad, payload, engine.compressor, s)
                else:
                    # the own payload ("partial") and the residual ("error") are in
                    # unscaled units: combine there, back to the scaled units after
                    c = self.local.combine(name, g * inv, p.grad * inv, payload,
                                           engine.compressor, s) / inv
            else:
                c = g
            m = engine.dense_momentum_bucket([name], [c], [p], inv)[0]  # sent dense (DGC)
            c = c if m is None else m
            with torch.no_grad():
                if name in self.was_sparse:
                    p.grad = c.to(p.dtype).to_sparse()
                elif p.grad is not None and p.grad.shape == p.shape and not p.grad.is_sparse:
                    p.grad.copy_(c)
                else:
                    p.grad = c.to(p.dtype).clone()
        if inv is not None and engine.reads_exchanged:
            g = g * inv                               # unscaled (Slim-DP: |w| + c |g|)
        engine.after_exchange(name, g, p, step)


def empty_sparse_like(p: torch.Tensor) -> torch.Tensor:
    """A sparse COO gradient of ``p``'s shape with no entries (embedding layout:
    one sparse dimension, dense rows), for a rank without a sparse gradient."""
    dense_dims = tuple(p.shape[1:])
    return torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long, device=p.device),
                                   torch.zeros((0,) + dense_dims, dtype=p.dtype,
                                               device=p.device),
                                   tuple(p.shape))
