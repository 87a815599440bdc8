"""Layer-by-layer fusion scheduler: compress each layer as soon as its gradient is ready,
fill fixed buckets, launch one named collective per bucket while backward continues.

Per step
--------
1. Backward: a post-accumulate-grad hook per parameter (on the gradient accumulator, as
   Horovod does) counts down ``backward_passes_per_step``; at zero it compresses the
   (locally accumulated) ``p.grad`` into a :class:`LayerPayload` and marks the layer
   ready. When every layer of bucket ``b`` is ready, bucket ``b`` is launched (one named
   async collective, see :mod:`hvdsparse.exchange`). A layer that arrives out of order
   simply waits for the rest of its bucket, so buckets are identical on every rank
   whatever the hook order. A *sparse* gradient (``nn.Embedding(sparse=True)``) is
   already index/value data: it goes through Horovod's sparse allreduce (allgather of
   indices and values, as ``hvd.DistributedOptimizer`` does) and never into a bucket.
2. ``synchronize()``: a layer without a gradient this step (unused on this rank, or
   frozen with ``requires_grad=False``) contributes an *absent* payload -- the wire
   layout of its compressed form with nothing in it -- so its residual is neither
   flushed nor changed (it stays for when the layer trains again); unlaunched buckets
   are launched; every bucket is waited for, decoded and summed **in rank order**
   (bitwise identical on every rank), averaged (``op=Average``: ``G = sum * fp32(1/P)``;
   ``gradient_predivide_factor`` f splits this into ``/f`` before and ``*f/P`` after the
   sum), optionally combined with the local gradient (:mod:`hvdsparse.local`), written
   to ``p.grad`` and passed to ``compressor.after_exchange``. A parameter that is frozen
   on this rank keeps its ``p.grad`` untouched (usually ``None``, so the optimizer does
   not move it); a trainable parameter without a gradient gets the exchanged one (zeros
   when no rank had one), as Horovod zero-fills it.
3. Non-finite gradients: compressors never absorb NaN/Inf into a residual and count
   them per layer (``payload.nonfinite``). Each step one small allgather carries every
   rank's per-layer counts, so every rank sees the same table and applies the policy of
   :mod:`hvdsparse.settings` (``raise`` / ``skip`` / ``propagate``) identically.

First step: the bucket plan
---------------------------
Buckets must be identical on all ranks. At the first ``synchronize()`` every rank
contributes, through one ``hvd.allgather_object``, its settings fingerprint
(:func:`hvdsparse.settings.fingerprint`: compressor type and arguments, per-layer
overrides, fusion threshold, exchange, dense dtype, value encodings, library and wire
versions), the order in which its layers became ready, each layer's numel, its
*steady-state* encoded payload size (after warm-up: :meth:`Compressor.steady_state_step`)
and which layers had sparse gradients. Any difference from rank 0 raises the same
``ValueError`` on every rank naming the setting or layer and the ranks (no hang). The
plan is computed on every rank from rank 0's order and sizes (greedy: append layers in
that order, close a bucket once its encoded size reaches ``fusion_threshold`` bytes).
From the second step on buckets are launched from the hooks.

World size 1
------------
As in Horovod, nothing is exchanged: no hooks, no compression, ``p.grad`` is left as
backward made it, so a step equals the wrapped optimizer's step. The benchmark-only
setting ``compress_at_size_one`` (:mod:`hvdsparse.settings`) runs the whole path anyway,
exchanging through Horovod's size-1 collectives, to measure compression overhead.

Host synchronisation
--------------------
The hooks never read device values (except the split strategy's launch, which needs
its per-range pair counts on the host for the alltoall splits). ``synchronize()`` waits
on the handles, which is where Horovod synchronises too. Device flags that the host
must act on -- the unvalidated decode's error flag and the non-finite table on CUDA --
are copied into pinned memory with a non-blocking copy plus an event and read at the
next step's ``synchronize()``, when they are long done (so the error surfaces one step
late on CUDA, at once on CPU). The ``nonfinite="skip"`` policy reads the table in the
same step (one host read per step on CUDA, as ``torch.amp.GradScaler`` does).

Instrumentation
---------------
``events``: the current step's log -- ``("ready", name)``, ``("launch", bucket,
strategy)``, ``("backward_done",)``, ``("synchronize",)``, ``("finish", bucket)``.
``last_stats`` / ``totals``: bytes sent / received per strategy, strategy per bucket,
time spent compressing, waiting and decoding (host wall time, cheap).
"""
from __future__ import annotations

import inspect
import logging
import time
import warnings
from collections import defaultdict, deque
from typing import Dict, List, Optional

import numpy as np
import torch

from . import codec
from .exchange import ExchangeContext, BucketSpec, launch as launch_exchange
from .exchange import cost_model
from .exchange.base import BufferPool, HostReadout, TaggedFigures, bucket_capacity
from .compressors.base import Compressor, inverse_loss_scale
from .compressors import topk_bucket
from .exchange.split import pair_dtype
from .settings import ExchangeSettings, differences
from .stats import add_totals, empty_totals

log = logging.getLogger("hvdsparse")

_HOROVOD_DELAY_MSG = ("Gradients were computed more than backward_passes_per_step times "
                      "before call to step(). Increase backward_passes_per_step to "
                      "accumulate gradients locally.")



def plan_buckets(order, sizes, fusion_threshold: int) -> List[List[str]]:
    """Greedy bucketing: layers in ``order``; a bucket closes once the sum of its
    encoded sizes reaches ``fusion_threshold`` bytes (so ``fusion_threshold=0`` puts
    every layer in its own bucket)."""
    buckets, cur, cur_bytes = [], [], 0
    for name in order:
        cur.append(name)
        cur_bytes += int(sizes[name])
        if cur_bytes >= fusion_threshold:
            buckets.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        buckets.append(cur)
    return buckets


class _BucketHistory:
    """The cost model's figures of a bucket's last two exchanges (``DeferredFigures``).
    ``auto`` at step t reads those of step t-2: their copy to the host completed before
    step t-1's collectives could, so reading never stalls and every rank reads the same
    values (never "whatever has arrived"), on CPU and CUDA alike."""
    __slots__ = ("later",)

    def __init__(self):
        self.later = deque(maxlen=2)

    def figures(self) -> dict:
        return self.later[0].get() if len(self.later) == 2 else {}

    def state(self) -> list:
        """The figures held, oldest first, as plain dicts (a host read: checkpoints)."""
        return [f.get() for f in self.later]

    def load(self, figures: list):
        self.later.clear()
        for f in figures:
            self.later.append(_Resolved(f))


class _Resolved:
    """Figures restored from a checkpoint: already on the host."""
    __slots__ = ("value",)

    def __init__(self, value: dict):
        self.value = dict(value)

    def get(self) -> dict:
        return dict(self.value)


class LayerScheduler:
    """See the module docstring. Owned by :class:`hvdsparse.DistributedOptimizer`.

    ``named_params``: the optimised parameters in the optimizer's order (every one is
    part of the plan, trainable or not); ``settings``: :class:`ExchangeSettings`;
    ``fingerprint``: plain data compared across ranks at step 1; ``grad_scaler``: a
    ``torch.amp.GradScaler`` whose scale is divided out before gradients meet the
    residuals (residuals stay in unscaled units) and multiplied back into ``p.grad``.
    """

    def __init__(self, named_params, compressor, settings: Optional[ExchangeSettings] = None,
                 *, rank: int, world_size: int, prefix: str, local=None,
                 fingerprint: Optional[dict] = None, grad_scaler=None, local_update=None,
                 **legacy):
        if settings is None:
            settings = ExchangeSettings.from_args(**legacy)
        elif legacy:
            raise TypeError(f"pass settings or keyword settings, not both: {sorted(legacy)}")
        self.settings = settings
        self.compressor = compressor
        self.rank, self.world_size = int(rank), int(world_size)
        # world size 1: nothing to exchange (as Horovod), unless a benchmark asks
        self.active = self.world_size > 1 or settings.compress_at_size_one
        self.prefix = prefix
        self.local = local
        self.fingerprint = fingerprint if fingerprint is not None else {}
        self.grad_scaler = grad_scaler
        self._inv: Optional[torch.Tensor] = None   # this step's 1 / loss scale
        self.local_update = local_update        # hvdsparse.momentum.LocalUpdate or None
        self.nonfinite = settings.nonfinite
        if grad_scaler is not None and settings.nonfinite == "raise":
            # overflow steps are expected with a scaler: it sees the NaN and skips
            self.nonfinite = "propagate"
        transactional = self.nonfinite == "skip" or grad_scaler is not None
        compressor.transactional = transactional
        if local_update is not None:
            local_update.transactional = transactional

        self.params: Dict[str, torch.Tensor] = {}
        for name, p in named_params:
            self.params[name] = p
        self._reg_order = list(self.params)
        self.step = 0
        self.plan: Optional[List[List[str]]] = None
        self._saved_history: Optional[dict] = None   # cost figures from a checkpoint
        self.sparse_layers: set = set()
        self._specs: List[BucketSpec] = []
        self._bucket_of: Dict[str, int] = {}
        self._dense_order: List[str] = []
        self._history: List[_BucketHistory] = []
        self._buffers = BufferPool()     # exchange buffers reused step to step
        self._nan_index: List[Optional[torch.Tensor]] = []   # per bucket: first elements
        self._delay = {n: self.backward_passes_per_step for n in self.params}
        self._payloads: Dict[str, object] = {}
        self._sparse_handles: Dict[str, object] = {}
        self._frozen: set = set()
        self._was_sparse: set = set()
        self._ready_order: List[str] = []
        self._ready_count: List[int] = []
        self._inflight: Dict[int, object] = {}
        self._cb_queued = False
        self._step_open = False
        self._await_step = False        # synchronized, optimizer step not applied yet
        self._warned_lost_step = False
        self.pending_warning: Optional[str] = None   # said when the next step opens
        self.skip_update = False        # the last synchronize decided to skip the step
        self.skipped_steps = 0
        # Unvalidated (CUDA) decode: the kernels flag bad messages in a device int32[1]
        # instead of raising; the flag (and, on CUDA, the non-finite table) is read at
        # the next synchronize() through a HostReadout, when reading it no longer
        # stalls the stream.
        self._error_flag: Optional[torch.Tensor] = None
        self._pending_reads: List[tuple] = []
        self._dirty = False
        self._clear_events = False
        self.events: List[tuple] = []
        self.last_stats: dict = {}
        self.totals: dict = empty_totals()
        self._t_compress = 0.0
        self._hook_handles: Dict[str, object] = {}
        try:
            sig = inspect.signature(compressor.after_exchange).parameters
            self._after_takes_param = "param" in sig
        except (TypeError, ValueError):
            self._after_takes_param = False
        # only a compressor that overrides after_exchange needs the unscaled gradient
        self._has_after = getattr(type(compressor), "after_exchange", None) is not \
            Compressor.after_exchange
        # The average's 1/P is applied where the gradient is written into p.grad
        # (torch.mul(g, 1/P, out=p.grad): one pass over the bucket instead of an
        # in-place scale and then a copy; the same product, so the same bits) unless
        # something reads the averaged bucket first: GradScaler's unscale, the
        # local-gradient combination, a compressor's after_exchange
        self._scale_at_write = grad_scaler is None and local is None and \
            not self._has_after
        # Non-finite counters: once the plan exists, every layer of the step counts into
        # its slice of one zeroed int32[len(_dense_order)] tensor made at the step's first
        # compress (one allocation per step instead of one per layer), which is then
        # also the row the non-finite allgather sends (no stack): _launch_nonfinite.
        self._nf_slot: Dict[str, int] = {}          # layer -> index in _dense_order
        self._nf_step: Optional[torch.Tensor] = None
        self._nf_given: Dict[str, torch.Tensor] = {}  # layer -> slice handed out this step
        # The bucket path (TopK; Threshold between its refreshes; on the device path or
        # the CPU with the compiled loops): a layer's compression waits for the rest of
        # its bucket, then the bucket is compressed in a fixed number of launches
        # (compressors/topk_bucket.py; same bits as per layer). HVDSPARSE_BUCKET_PATH=0
        # turns it off (benchmarks compare the two).
        self._bucket_path = topk_bucket.enabled(compressor, local_update)
        self._deferred: Dict[int, List[str]] = {}    # bucket -> layers waiting for it
        self._batches: Dict[int, list] = {}           # bucket -> BucketBatch (masking)

    # settings read in the hot path
    @property
    def backward_passes_per_step(self) -> int:
        return self.settings.backward_passes_per_step

    @property
    def average(self) -> bool:
        return self.settings.average

    @property
    def exchange(self) -> str:
        return self.settings.exchange

    @property
    def fusion_threshold(self) -> int:
        return self.settings.fusion_threshold

    @property
    def validate(self):
        return self.settings.validate

    # ------------------------------------------------------------------ hooks
    def register_hooks(self):
        """Hook every trainable parameter (none at world size 1: nothing to exchange).
        A parameter frozen now is hooked when it first trains (see synchronize)."""
        if not self.active:
            return
        for name, p in self.params.items():
            if p.requires_grad:
                self._hook(name, p)

    def _hook(self, name, p):
        if name in self._hook_handles:
            return
        if hasattr(p, "register_post_accumulate_grad_hook"):
            h = p.register_post_accumulate_grad_hook(lambda _p, _n=name: self._on_grad(_n))
        else:  # older torch: Horovod's way, a hook on the AccumulateGrad node
            grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
            h = grad_acc.register_hook(lambda *a, _n=name: self._on_grad(_n))
            self._grad_accs = getattr(self, "_grad_accs", []) + [grad_acc]
        self._hook_handles[name] = h

    def remove_hooks(self):
        for h in self._hook_handles.values():
            h.remove()
        self._hook_handles = {}

    def _backward_done(self):
        self._cb_queued = False
        self.events.append(("backward_done",))

    def _open_step(self):
        """First hook (or synchronize) of a step: roll back a step that was exchanged
        but never applied (GradScaler skipped it), then open the compressor's
        transaction for this step."""
        if self._step_open:
            return
        self._step_open = True
        if self.pending_warning:
            warnings.warn(self.pending_warning)
            self.pending_warning = None
        if self._clear_events:
            self.events.clear()
            self._clear_events = False
        if self._await_step:
            self._await_step = False
            if self.compressor.transactional:
                self._rollback()
                self.events.append(("rollback", self.step - 1))
            elif not self._warned_lost_step:
                self._warned_lost_step = True
                warnings.warn("hvdsparse: optimizer.synchronize() was not followed by "
                              "optimizer.step(); the residuals already gave up what that "
                              "step sent. Pass grad_scaler=... (or nonfinite='skip') to "
                              "DistributedOptimizer so skipped steps are rolled back.")
        self.compressor.begin_step(self.step)
        if self.local_update is not None:
            self.local_update.begin_step()

    def _rollback(self):
        self.compressor.rollback()
        if self.local_update is not None:
            self.local_update.rollback()

    def _on_grad(self, name: str):
        self._open_step()
        if not self._cb_queued:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
                self._cb_queued = True
            except RuntimeError:
                pass
        # handled already this step: compressed, sent sparse, or waiting for its bucket
        # (the bucket path defers a layer until the bucket's last one arrives)
        if name in self._payloads or name in self._sparse_handles or self._delay[name] <= 0:
            raise AssertionError(_HOROVOD_DELAY_MSG + f" (parameter {name!r})")
        p = self.params[name]
        if p.grad is None or p.grad.requires_grad:
            raise AssertionError(f"hvdsparse: parameter {name!r} has no plain gradient in "
                                 f"its accumulate-grad hook")
        self._dirty = True
        self._delay[name] -= 1
        if self._delay[name] > 0:
            return
        if p.grad.is_sparse:
            if not self.settings.sparse_as_dense:
                self._launch_sparse(name, p.grad)
                return
            self._densify(name, p)
        if self._defers(name, p):
            self._deferred.setdefault(self._bucket_of[name], []).append(name)
        else:
            self._compress(name)
        if self.plan is not None:
            b = self._bucket_of[name]
            self._ready_count[b] += 1
            if self._ready_count[b] == len(self._specs[b].names):
                self._compress_bucket(b)
                self._launch(b)
        for pend in self._inflight.values():
            pend.advance()

    def _grad_scale(self, device) -> Optional[torch.Tensor]:
        """1 / loss scale on ``device`` (``inverse_loss_scale``), or None; computed once
        per step (the scale changes only in ``scaler.update()``, after the step)."""
        if self.grad_scaler is None:
            return None
        inv = self._inv
        if inv is None or inv.device != device:
            inv = self._inv = inverse_loss_scale(self.grad_scaler, device)
        return inv

    def _compress(self, name: str):
        p = self.params[name]
        t0 = time.perf_counter()
        kw = {}
        inv = self._grad_scale(p.grad.device)
        grad, lu = p.grad, self.local_update
        # this step's counter slice (None before the plan: the callee makes its own)
        nonfinite = self._nonfinite_counter(name, grad.device)
        with torch.no_grad():
            if lu is not None and lu.wants(name):
                # the compressor may fold the velocity update into its own pass
                # (AdaComp's compiled CPU route), the same bits as corrected()
                spec = lu.fused_spec(self.compressor, name, grad, p.detach()) \
                    if hasattr(lu, "fused_spec") else None
                if spec is not None:
                    kw["momentum"] = spec
                    if inv is not None:
                        kw["grad_scale"] = inv
                else:
                    # DGC: clip, fold in weight decay, accumulate the velocity locally
                    dense = self.compressor.policy.is_dense(name, p.shape)
                    grad, nonfinite = lu.corrected(name, p.grad, p, dense, inv,
                                                   nonfinite=nonfinite)
            elif inv is not None:
                kw["grad_scale"] = inv
            if lu is not None and lu.sends_dense(name):   # Adam recipe warm-up: exact
                payload = lu.dense_payload(name, grad)
                payload.nonfinite = nonfinite
            else:
                # the local update's counter, if any, collects the compressor's count too
                payload = self.compressor.compress(name, grad, self.step, param=p.detach(),
                                                   nonfinite=nonfinite, **kw)
        self._t_compress += time.perf_counter() - t0
        self._payloads[name] = payload
        self._ready_order.append(name)
        self.events.append(("ready", name))

    def _defers(self, name: str, p) -> bool:
        """Whether layer ``name`` waits for its bucket (the bucket path: planned, on the
        device path or the CPU with the compiled loops; whether it is compressed there is
        decided when the bucket is complete, :meth:`_compress_bucket`)."""
        return self._bucket_path and self.plan is not None and name in self._bucket_of \
            and topk_bucket.takes(p.grad)

    def _compress_bucket(self, b: int):
        """Compress bucket ``b``'s waiting layers: those the bucket path takes
        (``topk_bucket.layer_plan``) together, grouped by gradient dtype, value encoding
        and rounds; the others one by one as :meth:`_compress` does."""
        names = self._deferred.pop(b, None)
        if not names:
            return
        t0 = time.perf_counter()
        lu, comp = self.local_update, self.compressor
        groups: Dict[tuple, tuple] = {}
        alone = []
        with torch.no_grad():
            for name in names:
                p = self.params[name]
                grad = p.grad
                planned = topk_bucket.plan_layer(comp, lu, name, grad, p.detach(), self.step)
                nf = self._nonfinite_counter(name, grad.device) if planned is not None \
                    else None
                if nf is None:
                    alone.append(name)
                    continue
                spec, plan = planned
                item = topk_bucket.BucketItem(name, grad, p.detach(), nf, spec)
                items, plans = groups.setdefault(topk_bucket.group_key(plan, item), ([], []))
                items.append(item)
                plans.append(plan)
            batches = self._batches.setdefault(b, [])
            for items, plans in groups.values():
                payloads, batch = topk_bucket.compress_bucket(
                    comp, items, plans, self.step, grad_scale=self._grad_scale(
                        items[0].grad.device))
                batches.append(batch)
                for it in items:
                    self._payloads[it.name] = payloads[it.name]
                    self._ready_order.append(it.name)
                    self.events.append(("ready", it.name))
                self.events.append(("bucket_path", b, len(items)))
        self._t_compress += time.perf_counter() - t0
        for name in alone:
            self._compress(name)

    def _nonfinite_counter(self, name: str, device) -> Optional[torch.Tensor]:
        """Layer ``name``'s int32[1] non-finite counter for this step: its slice of the
        step's zeroed counter tensor (made here at the step's first call), or None
        (no plan yet, a layer outside the plan, another device): then the callee makes
        its own and ``_launch_nonfinite`` stacks as before."""
        j = self._nf_slot.get(name)
        if j is None or name in self._nf_given:
            return None
        buf = self._nf_step
        if buf is None:
            buf = self._nf_step = torch.zeros(len(self._dense_order), dtype=torch.int32,
                                              device=self._device())
        if buf.device != device:
            return None
        view = self._nf_given[name] = buf[j:j + 1]
        return view

    def _densify(self, name: str, p):
        """``sparse_as_dense``: the sparse gradient becomes dense and is compressed like any
        other layer; the exchanged gradient goes back to sparse (as Horovod does)."""
        p.grad = p.grad.to_dense()
        self._was_sparse.add(name)

    def _compress_absent(self, name: str):
        """Payload of a layer without a gradient this step: its wire layout, contributing
        zero, residual and compressor state untouched."""
        p = self.params[name]
        if p.requires_grad and self.local_update is not None and \
                self.local_update.zero_fills_absent:
            p.grad = torch.zeros_like(p)   # Adam recipe: a zero gradient, as Horovod's fill
            return self._compress(name)
        if not p.requires_grad:
            self._frozen.add(name)
        with torch.no_grad():
            payload = self.compressor.compress_absent(name, p.detach(), self.step,
                                                      param=p.detach())
            # its count is 0 like the (untouched) slot of the step's counter tensor:
            # keep the non-finite row unstacked (_launch_nonfinite)
            zero = self._nonfinite_counter(name, payload.nonfinite.device) \
                if payload.nonfinite is not None else None
            if zero is not None:
                payload.nonfinite = zero
        self._payloads[name] = payload
        self._ready_order.append(name)
        self.events.append(("absent", name))

    def _launch_sparse(self, name: str, grad: torch.Tensor):
        import horovod.torch as hvd
        from horovod.torch.mpi_ops import sparse_allreduce_async
        if name in self._bucket_of:
            raise RuntimeError(f"hvdsparse: parameter {name!r} produced a sparse gradient, "
                               f"but it was planned as a dense layer at the first step; a "
                               f"layer's gradients must be always sparse or always dense")
        self.sparse_layers.add(name)
        op = hvd.Average if self.average else hvd.Sum
        self._sparse_handles[name] = sparse_allreduce_async(
            grad.coalesce(), name=f"{self.prefix}.sparse.{name}", op=op)
        self.events.append(("sparse", name))

    # ------------------------------------------------------------------ buckets
    def _flag_for(self, device) -> torch.Tensor:
        if self._error_flag is None:
            self._error_flag = torch.zeros(1, dtype=torch.int32, device=device)
        return self._error_flag

    def _ctx(self, want_figures: bool) -> ExchangeContext:
        dev = self._device() or torch.device("cpu")
        return ExchangeContext.from_settings(
            self.settings, device=dev, rank=self.rank, world_size=self.world_size,
            prefix=self.prefix, step=self.step, error_flag_for=self._flag_for,
            want_figures=want_figures, buffers=self._buffers)

    def _device(self):
        return next(iter(self.params.values())).device if self.params else None

    def figures(self, b: int, payloads) -> cost_model.BucketFigures:
        """The rank-independent figures the auto cost model reads for bucket ``b``."""
        spec, prev = self._specs[b], self._history[b].figures()
        cap = bucket_capacity(payloads)
        st = self.settings
        return cost_model.BucketFigures(
            world_size=self.world_size, numel=spec.numel,
            wire_nbytes=codec.encoded_nbytes(payloads), capacity=cap,
            sparse_value_bytes=torch.finfo(pair_dtype(payloads)).bits // 8,
            dense_value_bytes=torch.finfo(st.dense_dtype).bits // 8,
            split_dense_bits=st.split_dense_bits, quant_bucket=st.quant_bucket,
            prev_pairs=prev.get("pairs"), prev_reduced=prev.get("reduced"),
            prev_capacity=prev.get("capacity"))

    def strategy_for(self, b: int, payloads) -> str:
        if self.exchange != "auto":
            return self.exchange
        return cost_model.choose(self.figures(b, payloads), alpha_bytes=self.settings.alpha_bytes)

    def _launch(self, b: int):
        spec = self._specs[b]
        payloads = [self._payloads[n] for n in spec.names]
        strategy = self.strategy_for(b, payloads)
        pend = launch_exchange(strategy, spec, payloads, self._ctx(self.exchange == "auto"))
        self._inflight[b] = pend
        self.events.append(("launch", b, strategy))

    def _steady_size(self, name: str) -> int:
        """Encoded bytes of a layer's payload once warm-up is over (the plan is made for
        the steady state, not for a dense warm-up step)."""
        p = self.params[name]
        with torch.no_grad():
            payload = self.compressor.compress_absent(
                name, p.detach(), max(int(self.compressor.steady_state_step()), self.step),
                param=p.detach())
        return codec.encoded_nbytes([payload])

    def _build_plan(self):
        import horovod.torch as hvd
        dense_ready = [n for n in self._ready_order if n in self._payloads]
        mine = dict(order=dense_ready,
                    sizes={n: self._steady_size(n) for n in dense_ready},
                    numels={n: int(self.params[n].numel()) for n in self.params},
                    sparse=sorted(self.sparse_layers), fingerprint=self.fingerprint)
        everyone = hvd.allgather_object(mine, name=f"{self.prefix}.plan")
        ref = everyone[0]
        problems = []
        diff_ranks = defaultdict(list)
        for r, d in enumerate(everyone):
            for key, a, b in differences(d["fingerprint"], ref["fingerprint"]):
                diff_ranks[(key, repr(a), repr(b))].append(r)
        for (key, a, b), ranks in sorted(diff_ranks.items()):
            problems.append(f"setting {key!r} is {a} on rank(s) {ranks} but {b} on rank 0")
        sparse = set().union(*(set(d["sparse"]) for d in everyone))
        for r, d in enumerate(everyone):
            names_r, names_0 = set(d["numels"]), set(ref["numels"])
            if names_r != names_0:
                problems.append(f"rank {r} has parameters {sorted(names_r - names_0)} that "
                                f"rank 0 lacks and lacks {sorted(names_0 - names_r)}")
                continue
            for n in ref["numels"]:
                if d["numels"][n] != ref["numels"][n]:
                    problems.append(f"parameter {n!r} has {d['numels'][n]} elements on rank "
                                    f"{r} but {ref['numels'][n]} on rank 0")
            for n in ref["order"]:
                if n in sparse or n not in d["sizes"]:
                    continue
                if d["sizes"][n] != ref["sizes"][n]:
                    problems.append(f"parameter {n!r}: encoded payload is {d['sizes'][n]} "
                                    f"bytes on rank {r} but {ref['sizes'][n]} on rank 0 "
                                    f"(compressor settings differ across ranks?)")
        if problems:
            raise ValueError("hvdsparse: ranks disagree at the first step: " +
                             "; ".join(problems))
        # a layer that was sparse on some rank is sparse everywhere
        for n in sorted(sparse - self.sparse_layers):
            self._payloads.pop(n, None)
            self._launch_sparse(n, _empty_sparse_like(self.params[n]))
        self.sparse_layers |= sparse
        order = [n for n in ref["order"] if n not in sparse]
        sizes = {n: ref["sizes"][n] for n in order}
        self.plan = plan_buckets(order, sizes, self.fusion_threshold)
        self._specs = [BucketSpec.build(b, names, [ref["numels"][n] for n in names])
                       for b, names in enumerate(self.plan)]
        self._bucket_of = {n: b for b, names in enumerate(self.plan) for n in names}
        self._dense_order = order
        self._nf_slot = {n: j for j, n in enumerate(order)}
        self._nf_step = None
        self._nf_given.clear()
        self._history = [_BucketHistory() for _ in self.plan]
        self._restore_history()
        dev = self._device()
        self._nan_index = [spec.first_elements(dev) for spec in self._specs]
        self._ready_count = [0] * len(self.plan)

    # ------------------------------------------------------------------ step
    def pending(self) -> bool:
        return self._dirty or bool(self._payloads) or bool(self._inflight) \
            or bool(self._sparse_handles)

    def _check_deferred(self):
        """Act on last step's device flags (CUDA: read now, without stalling)."""
        reads, self._pending_reads = self._pending_reads, []
        for kind, step, shape, reader in reads:
            values = np.asarray(reader.get(), dtype=np.int64).reshape(shape)
            if kind == "error":
                code = int(values[0])
                if code:
                    what = codec.describe_error(code)
                    raise RuntimeError(
                        f"hvdsparse: a message received at step {step} carried {what}; "
                        f"those entries were skipped. The ranks disagree on the bucket "
                        f"layout or a message was corrupted (rerun with validate=True to "
                        f"find the rank and segment)")
            elif kind == "nonfinite":
                self._raise_nonfinite(values, step)

    def _retire_error_flag(self):
        """This step's decode flag is read at the next synchronize()."""
        if self._error_flag is not None:
            self._pending_reads.append(("error", self.step, (1,), HostReadout(self._error_flag)))
            self._error_flag = None

    def _raise_nonfinite(self, table, step: int):
        """``table``: host [P, nlayers] counts of non-finite gradient elements."""
        hits = [(self._dense_order[j], r, int(table[r, j]))
                for r in range(table.shape[0]) for j in range(table.shape[1])
                if table[r, j]]
        if hits:
            desc = "; ".join(f"layer {n!r} on rank {r}: {c} element(s)" for n, r, c in hits[:8])
            raise FloatingPointError(
                f"hvdsparse: non-finite gradient (NaN/Inf) at step {step}: {desc}"
                f"{' ...' if len(hits) > 8 else ''}. Nothing of it entered a residual. Use "
                f"DistributedOptimizer(nonfinite='skip') to skip such steps, or "
                f"grad_scaler=... with torch.amp.GradScaler (README: mixed precision)")

    def synchronize(self):
        """Flush, wait, decode, average and write ``p.grad`` for every parameter."""
        if not self.active:
            self.step += 1
            self._await_step = False
            return
        self._open_step()
        self.events.append(("synchronize",))
        self._check_deferred()
        for b in list(self._deferred):     # buckets with a layer still to come
            self._compress_bucket(b)
        if self.plan is not None:
            order = self._dense_order + sorted(self.sparse_layers)
        else:
            order = list(reversed(self._reg_order))
        for name in order:
            if name in self._payloads or name in self._sparse_handles:
                continue
            p = self.params[name]
            if p.requires_grad and name not in self._hook_handles:
                self._hook(name, p)            # unfrozen after construction
            if p.requires_grad and p.grad is not None:
                if p.grad.is_sparse and self.settings.sparse_as_dense:
                    self._densify(name, p)
                if p.grad.is_sparse:
                    self._launch_sparse(name, p.grad)
                else:
                    self._compress(name)       # hook delay not reached, or set by hand
            elif name in self.sparse_layers:
                self._launch_sparse(name, _empty_sparse_like(p))
            else:
                self._compress_absent(name)
        if self.plan is None:
            self._build_plan()
        for b in range(len(self._specs)):
            if b not in self._inflight:
                self._launch(b)
        nf_handle = self._launch_nonfinite()

        P = self.world_size
        scale = 1.0 / P if self.average else 1.0
        buckets, sent, recv = [], defaultdict(int), defaultdict(int)
        totals = []
        try:
            t_wait, t_dec = self._finish_buckets(scale, totals, buckets, sent, recv)
        except BaseException:
            if nf_handle is not None:       # leave no handle behind; the first error wins
                try:
                    self._finish_nonfinite(nf_handle)
                except Exception:
                    pass
            raise
        # the counts' allgather was queued after the buckets' collectives: waited for
        # last, so each bucket's wait is its own and its decode overlaps the later ones
        t0 = time.perf_counter()
        table = self._finish_nonfinite(nf_handle)
        t_wait += time.perf_counter() - t0
        skip = self._apply_nonfinite_policy(table, totals)
        if not skip:
            for spec, total in zip(self._specs, totals):
                inv = self._grad_scale(total.device)
                if inv is not None:   # back to the scaled units GradScaler expects
                    total.div_(inv)
                pending = scale if scale != 1.0 and self._scale_at_write else None
                for name, view in zip(spec.names, spec.views(total)):
                    self._apply(name, view, inv, pending)
        self._finish_sparse(write=not skip)
        self._retire_error_flag()
        n_total = sum(s.numel for s in self._specs)
        self.last_stats = dict(
            step=self.step, world_size=P, buckets=buckets,
            strategies=[bk["strategy"] for bk in buckets],
            bytes_sent=dict(sent), bytes_recv=dict(recv),
            bytes_sent_total=int(sum(sent.values())), bytes_recv_total=int(sum(recv.values())),
            dense_allreduce_bytes=int(cost_model.dense_allreduce_bytes(P, n_total)),
            time_compress_s=self._t_compress, time_wait_s=t_wait, time_decode_s=t_dec,
            skipped=skip)
        add_totals(self.totals, self.last_stats)
        # reset for the next step
        self.step += 1
        self._await_step = not skip
        self.skip_update = skip
        self._step_open = False
        self._payloads.clear()
        self._frozen.clear()
        self._was_sparse.clear()
        self._ready_order.clear()
        self._inflight.clear()
        self._ready_count = [0] * len(self._specs)
        self._delay = {n: self.backward_passes_per_step for n in self.params}
        self._t_compress = 0.0
        self._inv = None
        self._nf_step = None        # the next step counts into a new tensor
        self._nf_given.clear()
        self._deferred.clear()
        self._batches.clear()
        self._dirty = False
        self._clear_events = True

    def _finish_buckets(self, scale, totals, buckets, sent, recv):
        """Every bucket in launch order: wait, decode, average (unless at write),
        feed back; fills the step's lists, returns (seconds waited, seconds decoding)."""
        t_wait = t_dec = 0.0
        for b, spec in enumerate(self._specs):
            pend = self._inflight[b]
            total = pend.finish()
            t0 = time.perf_counter()
            self.events.append(("finish", b))
            if scale != 1.0 and not self._scale_at_write:
                total.mul_(scale)  # x * 1.0 == x bit for bit: no pass at P = 1 / Sum
            totals.append(total)
            self._feed_back(b, spec, pend.undelivered)
            t_dec += pend.decode_s + time.perf_counter() - t0
            t_wait += pend.wait_s
            if pend.deferred_figures is not None:
                self._history[b].later.append(TaggedFigures(
                    pend.deferred_figures,
                    bucket_capacity([self._payloads[n] for n in spec.names])))
            sent[pend.strategy] += pend.sent_bytes
            recv[pend.strategy] += pend.recv_bytes
            buckets.append(dict(id=b, layers=list(spec.names), numel=spec.numel,
                                strategy=pend.strategy, sent_bytes=pend.sent_bytes,
                                recv_bytes=pend.recv_bytes, figures=dict(pend.figures)))
        return t_wait, t_dec

    def _feed_back(self, b: int, spec: BucketSpec, undelivered: Optional[torch.Tensor]):
        """What the exchange sent but did not deliver (``Pending.undelivered``:
        ``balanced``'s phase-2 truncation) goes back into each layer's residual, device
        ops only; then DGC's momentum-factor masking ``u[sent and delivered] = 0``. Runs
        before the non-finite policy, so a skipped step's rollback undoes it with the
        rest of the step. Only a layer with ``error_feedback=False`` cannot take its
        share back (``Compressor.take_back``): it stays lost (``p2_dropped_energy``)."""
        lu = self.local_update
        views = spec.views(undelivered) if undelivered is not None else \
            [None] * len(spec.names)
        masked = set()
        with torch.no_grad():
            # the bucket path's layers: one launch per batch (unless a layer keeps its
            # velocity at this step, or the exchange gave something back)
            for batch in self._batches.pop(b, ()):
                if lu is not None and undelivered is None and all(
                        lu.masks_now(n, self.compressor.warmup_density(n, self.step))
                        for n in batch.momentum_names):
                    topk_bucket.mask_bucket(batch)
                    masked.update(batch.momentum_names)
            for name, back in zip(spec.names, views):
                if back is not None:
                    self.compressor.take_back(name, back)
                if lu is not None and name in lu.u and name not in masked:
                    lu.mask(name, self._payloads[name], back,
                            self.compressor.warmup_density(name, self.step))

    def step_applied(self):
        """The optimizer applied the exchanged gradients: commit the compressor's step."""
        if self._await_step:
            self._await_step = False
            self.compressor.commit()
            if self.local_update is not None:
                self.local_update.commit()

    # ------------------------------------------------------------------ non-finite
    def _launch_nonfinite(self):
        """One small allgather of this rank's per-layer non-finite counts."""
        import horovod.torch as hvd
        if not self._dense_order:
            return None
        buf, given = self._nf_step, self._nf_given
        if buf is not None and all(
                self._payloads[n].nonfinite is given.get(n) for n in self._dense_order):
            # every layer counted into its slice of the step's tensor (a layer whose
            # payload has no counter was handed none: its slot stayed 0): send it as is
            mine = buf.view(1, -1)
        else:
            dev = self._device()
            zero = torch.zeros((), dtype=torch.int32, device=dev)
            counts = [self._payloads[n].nonfinite if self._payloads[n].nonfinite is not None
                      else zero for n in self._dense_order]
            mine = torch.stack([c.reshape(()).to(torch.int32) for c in counts]).view(1, -1)
        return hvd.allgather_async(mine, name=f"{self.prefix}.nonfinite")

    def _finish_nonfinite(self, handle):
        import horovod.torch as hvd
        if handle is None:
            return None
        return hvd.synchronize(handle)          # [P, nlayers] int32, identical on all ranks

    def _apply_nonfinite_policy(self, table, totals) -> bool:
        """Returns True when the step is skipped."""
        if table is None:
            return False
        if table.device.type == "cpu" or self.nonfinite == "skip":
            host = table.numpy() if table.device.type == "cpu" else table.cpu().numpy()
            if not host.any():
                return False
            if self.nonfinite == "raise":
                self._raise_nonfinite(host, self.step)
            if self.nonfinite == "skip":
                self.skipped_steps += 1
                if self.compressor.transactional:
                    self._rollback()
                log.warning("hvdsparse: step %d skipped: non-finite gradient in %s",
                            self.step, sorted({self._dense_order[j] for j in
                                               range(host.shape[1]) if host[:, j].any()}))
                return True
            self._mark_nan(totals, torch.as_tensor(host).sum(0) > 0)
            return False
        # CUDA, raise / propagate: mark on the device, decide next step (raise)
        self._mark_nan(totals, table.sum(0) > 0)
        if self.nonfinite == "raise":
            self._pending_reads.append(("nonfinite", self.step, tuple(table.shape),
                                        HostReadout(table)))
        return False

    def _mark_nan(self, totals, flagged: torch.Tensor):
        """Put a NaN into element 0 of every flagged layer's exchanged gradient (on every
        rank, as a dense allreduce of a NaN would), device-side."""
        j = 0
        for spec, total, idx in zip(self._specs, totals, self._nan_index):
            spec.mark_nan(total, flagged[j:j + len(spec.names)], idx)
            j += len(spec.names)

    # ------------------------------------------------------------------ writing p.grad
    def _finish_sparse(self, write: bool = True):
        import horovod.torch as hvd
        for name, handle in list(self._sparse_handles.items()):
            out = hvd.synchronize(handle) if not callable(handle) else handle()
            p = self.params[name]
            if write and p.requires_grad:
                p.grad = out.coalesce()
        self._sparse_handles.clear()

    def _apply(self, name: str, g_flat: torch.Tensor, inv: Optional[torch.Tensor] = None,
               scale: Optional[float] = None):
        """Write the exchanged gradient ``g_flat`` (in GradScaler's scaled units when
        ``inv`` = 1 / scale is given) into ``p.grad``. The local-gradient combination,
        dense-layer momentum (DGC) and ``after_exchange`` (Slim-DP's core choice) work
        in unscaled units, like the residuals and payloads: ``x * inv`` and ``x / inv``
        are exact (a power of two). ``scale``: the average's 1/P when the bucket is
        still the sum (``_scale_at_write``), applied here."""
        p = self.params[name]
        g = g_flat.view(p.shape)
        payload = self._payloads[name]
        written = False
        if scale is not None:
            grad = p.grad
            lu = self.local_update
            if name not in self._frozen and name not in self._was_sparse and \
                    grad is not None and not grad.is_sparse and grad.shape == p.shape and \
                    grad.dtype == torch.float32 and not (
                        lu is not None and lu.momentum_correction and
                        self.compressor.policy.is_dense(name, p.shape)):
                with torch.no_grad():
                    torch.mul(g, scale, out=grad)       # average and write in one pass
                g, written = grad, True
            else:
                g = g * scale
        if name not in self._frozen and not written:
            if self.local is not None and p.grad is not None:
                s = 1.0 / self.world_size if self.average else 1.0
                if inv is None:
                    c = self.local.combine(name, g, p.grad, payload, self.compressor, s)
                else:
                    # the own payload ("partial") and the residual ("error") are in
                    # unscaled units: combine there, back to the scaled units after
                    c = self.local.combine(name, g * inv, p.grad * inv, payload,
                                           self.compressor, s) / inv
            else:
                c = g
            lu = self.local_update
            if lu is not None and lu.momentum_correction and \
                    self.compressor.policy.is_dense(name, p.shape):
                # sent dense: ordinary momentum, its buffer in unscaled units (a buffer
                # in scaled units would mix scales when the loss scale changes, and
                # weight decay would be divided by the scale)
                if inv is None:
                    c = lu.dense_momentum(name, c, p)
                else:
                    c = lu.dense_momentum(name, c * inv, p) / inv
            with torch.no_grad():
                if name in self._was_sparse:
                    p.grad = c.to(p.dtype).to_sparse()
                elif p.grad is not None and p.grad.shape == p.shape and not p.grad.is_sparse:
                    p.grad.copy_(c)
                else:
                    p.grad = c.to(p.dtype).clone()
        if inv is not None and self._has_after:
            g = g * inv                               # unscaled (Slim-DP: |w| + c |g|)
        if self._after_takes_param:
            self.compressor.after_exchange(name, g, self.step, param=p.detach())
        else:
            self.compressor.after_exchange(name, g, self.step)

    def history_state(self) -> dict:
        """The auto cost model's figures per bucket (keyed by the bucket's layer names):
        part of the compression state, so that a resumed run picks the strategies the
        uninterrupted run would have picked (they sum in different orders)."""
        return {"\x1f".join(names): h.state()
                for names, h in zip(self.plan or [], self._history)}

    def load_history_state(self, saved: dict):
        """Restore :meth:`history_state` now, or when the plan is built (first step)."""
        self._saved_history = dict(saved)
        if self.plan is not None:
            self._restore_history()

    def _restore_history(self):
        saved = self._saved_history or {}
        for names, h in zip(self.plan, self._history):
            figures = saved.get("\x1f".join(names))
            if figures is not None:
                h.load(figures)
        self._saved_history = None

    def plan_order(self) -> List[str]:
        return [n for names in (self.plan or []) for n in names]

    def reset(self):
        """Drop everything in flight-free state (load_state_dict, as Horovod)."""
        if (self._await_step or self._step_open) and self.compressor.transactional:
            self._rollback()          # close the compressor's open step
        self._payloads.clear()
        self._sparse_handles.clear()
        self._frozen.clear()
        self._ready_order.clear()
        self._inflight.clear()
        self._nf_step = None
        self._nf_given.clear()
        self._deferred.clear()
        self._batches.clear()
        self._dirty = False
        self._step_open = False
        self._await_step = False
        self._ready_count = [0] * len(self._specs)
        self._delay = {n: self.backward_passes_per_step for n in self.params}

    def set_backward_passes_per_step(self, passes: int):
        self.settings.backward_passes_per_step = int(passes)
        self._delay = {n: self.backward_passes_per_step for n in self.params}


def _empty_sparse_like(p: torch.Tensor) -> torch.Tensor:
    """A sparse COO gradient of ``p``'s shape with no entries (embedding layout:
    one sparse dimension, dense rows), for a rank without a sparse gradient."""
    dense_dims = tuple(p.shape[1:])
    return torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long, device=p.device),
                                   torch.zeros((0,) + dense_dims, dtype=p.dtype,
                                               device=p.device),
                                   tuple(p.shape))
