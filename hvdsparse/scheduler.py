"""The Horovod door's adapter: *when* a bucket is ready and *where* its result goes; what
a step does with a bucket is :mod:`hvdsparse.engine`'s.

Per step
--------
1. Backward: a post-accumulate-grad hook per parameter (on the gradient accumulator, as
   Horovod does) counts down ``backward_passes_per_step``; at zero the layer is ready:
   compressed at once, or (bucket path) when the rest of its bucket is ready. When every
   layer of bucket ``b`` is ready, bucket ``b`` is launched while backward continues.
   Buckets are identical on every rank whatever the hook order. A *sparse* gradient
   (``nn.Embedding(sparse=True)``) goes through Horovod's sparse allreduce, as with
   ``hvd.DistributedOptimizer``, never into a bucket.
2. ``synchronize()``: a layer without a gradient this step (unused on this rank, or
   frozen) contributes an *absent* payload (its residual untouched); unlaunched buckets
   are launched; every bucket is finished (rank-order sum: bitwise identical on every
   rank), averaged (``op=Average``: ``G = sum * fp32(1/P)``; ``gradient_predivide_factor``
   f splits this into ``/f`` before and ``*f/P`` after the sum), optionally combined with
   the local gradient (:mod:`hvdsparse.local`), written to ``p.grad`` and passed to
   ``compressor.after_exchange``. A frozen parameter keeps its ``p.grad``; a trainable
   one without a gradient gets the exchanged one (zeros when no rank had one), as
   Horovod zero-fills it.
3. Non-finite gradients: one small allgather of per-layer counts, queued behind the
   buckets; ``raise`` / ``skip`` / ``propagate`` applied identically on every rank.

First step: every rank's settings fingerprint, parameter sizes, ready order,
*steady-state* payload sizes (:meth:`Compressor.steady_state_step`) and sparse layers
are compared with rank 0's (:meth:`StepEngine.agree`: the same ``ValueError`` on every
rank, no hang); the bucket plan is rank 0's order, greedily closed at
``fusion_threshold`` encoded bytes. World size 1: as in Horovod, nothing is exchanged
(``compress_at_size_one``, a benchmark setting, runs the whole path anyway).

Host synchronisation: the hooks never read device values (except split's launch, which
needs its pair counts on the host); ``synchronize()`` waits on the handles, where Horovod
synchronises too; device flags are read one step late (:class:`StepEngine`). The
``nonfinite="skip"`` policy reads the table in the same step (one host read per step on
CUDA, as ``torch.amp.GradScaler`` does).

``events``: the current step's log (``("ready", name)``, ``("launch", bucket,
strategy)``, ``("backward_done",)``, ``("synchronize",)``, ``("finish", bucket)``, ...);
``last_stats`` / ``totals``: :meth:`StepEngine.step_stats`.
"""
from __future__ import annotations

import time
import warnings
from typing import Dict, List, Optional

import torch

from . import codec
from .bucket_plan import plan_buckets
from .engine import LayerInput, StepEngine
from .nonfinite import NonFinite
from .exchange import BucketSpec
from .exchange.base import BufferPool
from .settings import ExchangeSettings
from .stats import add_totals, empty_totals
from .transport import Transport, horovod

_HOROVOD_DELAY_MSG = ("Gradients were computed more than backward_passes_per_step times "
                      "before call to step(). Increase backward_passes_per_step to "
                      "accumulate gradients locally.")



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
                 transport: Optional[Transport] = None, **legacy):
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
        self.local_update = local_update        # hvdsparse.momentum.LocalUpdate or None
        self.nonfinite = settings.nonfinite
        if grad_scaler is not None and settings.nonfinite == "raise":
            # overflow steps are expected with a scaler: it sees the NaN and skips
            self.nonfinite = "propagate"
        transactional = self.nonfinite == "skip" or grad_scaler is not None
        compressor.transactional = transactional
        if local_update is not None:
            local_update.transactional = transactional
        self.transport = transport if transport is not None else horovod()
        self.engine = StepEngine(compressor, settings, self.transport, rank=self.rank,
                                 world_size=self.world_size, prefix=prefix,
                                 local_update=local_update, grad_scaler=grad_scaler,
                                 nonfinite=self.nonfinite)
        self.engine.hint = (" Use DistributedOptimizer(nonfinite='skip') to skip such "
                            "steps, or grad_scaler=... with torch.amp.GradScaler (README: "
                            "mixed precision)")

        self.params: Dict[str, torch.Tensor] = {}
        for name, p in named_params:
            self.params[name] = p
        self._reg_order = list(self.params)
        self.step = 0
        self.plan: Optional[List[List[str]]] = None
        self.sparse_layers: set = set()
        self._specs: List[BucketSpec] = []
        self._bucket_of: Dict[str, int] = {}
        self._dense_order: List[str] = []
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
        self._dirty = False
        self._clear_events = False
        self.events: List[tuple] = []
        self.last_stats: dict = {}
        self.totals: dict = empty_totals()
        self._t_compress = 0.0
        self._hook_handles: Dict[str, object] = {}
        # The average's 1/P is applied where the gradient is written into p.grad
        # (torch.mul(g, 1/P, out=p.grad): one pass over the bucket instead of an
        # in-place scale and then a copy; the same product, so the same bits) unless
        # something reads the averaged bucket first: GradScaler's unscale, the
        # local-gradient combination, a compressor's after_exchange
        self._scale_at_write = grad_scaler is None and local is None and \
            not self.engine.reads_exchanged
        # Non-finite counters: once the plan exists, every layer of the step counts into
        # its slice of one zeroed int32[len(_dense_order)] tensor made at the step's first
        # compress (one allocation per step instead of one per layer), which is then
        # also the row the non-finite allgather sends (no stack): _launch_nonfinite.
        self._nf = NonFinite(())           # the plan's layers' counters (engine.NonFinite)
        # The bucket path (engine.compress_group): a layer's compression waits for the
        # rest of its bucket, then the bucket is compressed in a fixed number of launches
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
        self.engine.begin_step(self.step)

    def _rollback(self):
        self.engine.rollback()

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
        return self.engine.grad_scale(device)

    def _compress(self, name: str):
        p = self.params[name]
        t0 = time.perf_counter()
        # this step's counter slice (None before the plan: the callee makes its own)
        nonfinite = self._nonfinite_counter(name, p.grad.device)
        payload = self.engine.compress(name, p.grad, p, self.step, nonfinite)
        self._t_compress += time.perf_counter() - t0
        self._payloads[name] = payload
        self._ready_order.append(name)
        self.events.append(("ready", name))

    def _defers(self, name: str, p) -> bool:
        """Whether layer ``name`` waits for its bucket (the bucket path: planned, on the
        device path or the CPU with the compiled loops; whether it is compressed there is
        decided when the bucket is complete, :meth:`_compress_bucket`)."""
        return self.plan is not None and name in self._bucket_of and \
            self.engine.may_bucket(p.grad)

    def _compress_bucket(self, b: int):
        """Compress bucket ``b``'s waiting layers (:meth:`StepEngine.compress_group`:
        those the bucket path takes together, the others one by one)."""
        names = self._deferred.pop(b, None)
        if not names:
            return
        t0 = time.perf_counter()
        layers = [LayerInput(n, self.params[n].grad, self.params[n],
                             self._nonfinite_counter(n, self.params[n].grad.device))
                  for n in names]
        batches = self._batches.setdefault(b, [])
        n_before = len(batches)
        payloads = self.engine.compress_group(layers, self.step, batches)
        for batch in batches[n_before:]:
            self.events.append(("bucket_path", b, len(batch.names)))
        for name, payload in zip(names, payloads):
            self._payloads[name] = payload
            self._ready_order.append(name)
            self.events.append(("ready", name))
        self._t_compress += time.perf_counter() - t0

    def _nonfinite_counter(self, name: str, device) -> Optional[torch.Tensor]:
        """Layer ``name``'s counter slice of the step (None before the plan)."""
        return self._nf.counter(name, device)

    def _densify(self, name: str, p):
        """``sparse_as_dense``: the sparse gradient becomes dense and is compressed like any
        other layer; the exchanged gradient goes back to sparse (as Horovod does)."""
        p.grad = p.grad.to_dense()
        self._was_sparse.add(name)

    def _compress_absent(self, name: str):
        """Payload of a layer without a gradient this step: its wire layout, contributing
        zero, residual and compressor state untouched."""
        p = self.params[name]
        if self.engine.zero_fills(p):
            p.grad = torch.zeros_like(p)   # Adam recipe: a zero gradient, as Horovod's fill
            return self._compress(name)
        if not p.requires_grad:
            self._frozen.add(name)
        payload = self.engine.compress_absent(name, p, self.step,
                                              self._nonfinite_counter(name, p.device))
        self._payloads[name] = payload
        self._ready_order.append(name)
        self.events.append(("absent", name))

    def _launch_sparse(self, name: str, grad: torch.Tensor):
        if name in self._bucket_of:
            raise RuntimeError(f"hvdsparse: parameter {name!r} produced a sparse gradient, "
                               f"but it was planned as a dense layer at the first step; a "
                               f"layer's gradients must be always sparse or always dense")
        self.sparse_layers.add(name)
        self._sparse_handles[name] = self.transport.sparse_allreduce_async(
            grad.coalesce(), name=f"{self.prefix}.sparse.{name}", average=self.average)
        self.events.append(("sparse", name))

    # ------------------------------------------------------------------ buckets
    def _device(self):
        return next(iter(self.params.values())).device if self.params else None

    def strategy_for(self, b: int, payloads) -> str:
        spec = self._specs[b]
        return self.engine.strategy(self.engine.history(spec.names), spec.numel, payloads)

    def _launch(self, b: int):
        spec = self._specs[b]
        payloads = [self._payloads[n] for n in spec.names]
        strategy = self.strategy_for(b, payloads)
        pend = self.engine.launch(strategy, spec, payloads,
                                  self._device() or torch.device("cpu"), self.step,
                                  self._buffers)
        self._inflight[b] = pend
        self.events.append(("launch", b, strategy))

    def _steady_size(self, name: str) -> int:
        """Encoded bytes of a layer's payload once warm-up is over (the plan is made for
        the steady state, not for a dense warm-up step)."""
        p = self.params[name]
        payload = self.engine.compress_absent(
            name, p.detach(), max(int(self.compressor.steady_state_step()), self.step))
        return codec.encoded_nbytes([payload])

    def _build_plan(self):
        """First step: agree with every rank (:meth:`StepEngine.agree`: settings,
        parameters, and here also the steady-state payload sizes), then plan the buckets
        from rank 0's ready order."""
        dense_ready = [n for n in self._ready_order if n in self._payloads]
        mine = dict(order=dense_ready,
                    sizes={n: self._steady_size(n) for n in dense_ready},
                    numels={n: int(self.params[n].numel()) for n in self.params},
                    sparse=sorted(self.sparse_layers), fingerprint=self.fingerprint)

        def sizes_differ(everyone):
            ref, sparse = everyone[0], set().union(*(set(d["sparse"]) for d in everyone))
            return [f"parameter {n!r}: encoded payload is {d['sizes'][n]} bytes on rank "
                    f"{r} but {ref['sizes'][n]} on rank 0 (compressor settings differ "
                    f"across ranks?)"
                    for r, d in enumerate(everyone) if set(d["numels"]) == set(ref["numels"])
                    for n in ref["order"]
                    if n not in sparse and n in d["sizes"] and d["sizes"][n] != ref["sizes"][n]]
        everyone = self.engine.agree(mine, "plan", sizes_differ)
        ref = everyone[0]
        sparse = set().union(*(set(d["sparse"]) for d in everyone))
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
        self._nf = NonFinite(order)
        dev = self._device()
        self._nan_index = [spec.first_elements(dev) for spec in self._specs]
        self._ready_count = [0] * len(self.plan)

    # ------------------------------------------------------------------ step
    def pending(self) -> bool:
        return self._dirty or bool(self._payloads) or bool(self._inflight) \
            or bool(self._sparse_handles)

    def _check_deferred(self):
        """Act on last step's device flags (CUDA: read now, without stalling)."""
        self.engine.check_deferred()

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
        totals = []
        try:
            t_wait, t_dec = self._finish_buckets(scale, totals)
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
                if self.local is not None:   # combines each layer with its own gradient
                    for name, view in zip(spec.names, spec.views(total)):
                        self._apply(name, view, inv, pending)
                else:
                    self._apply_bucket(spec, total, inv, pending)
        self._finish_sparse(write=not skip)
        self.engine.send_reads(self.step)
        self.last_stats = self.engine.step_stats(
            self.step, [(spec, self._inflight[b]) for b, spec in enumerate(self._specs)],
            compress_s=self._t_compress, wait_s=t_wait, decode_s=t_dec, skipped=skip)
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
        self._nf.reset()
        self._deferred.clear()
        self._batches.clear()
        self._dirty = False
        self._clear_events = True

    def _finish_buckets(self, scale, totals):
        """Every bucket in launch order: wait, decode, average (unless at write),
        feed back; appends to ``totals``, returns (seconds waited, seconds decoding)."""
        t_wait = t_dec = 0.0
        for b, spec in enumerate(self._specs):
            pend = self._inflight[b]
            total = self.engine.finish(pend, self.engine.history(spec.names),
                                       [self._payloads[n] for n in spec.names])
            t0 = time.perf_counter()
            self.events.append(("finish", b))
            if scale != 1.0 and not self._scale_at_write:
                total.mul_(scale)  # x * 1.0 == x bit for bit: no pass at P = 1 / Sum
            totals.append(total)
            self._feed_back(b, spec, pend.undelivered)
            t_dec += pend.decode_s + time.perf_counter() - t0
            t_wait += pend.wait_s
        return t_wait, t_dec

    def _feed_back(self, b: int, spec: BucketSpec, undelivered: Optional[torch.Tensor]):
        self.engine.feed_back(spec.names, [self._payloads[n] for n in spec.names], spec,
                              undelivered, self._batches.pop(b, ()), self.step)

    def step_applied(self):
        """The optimizer applied the exchanged gradients: commit the compressor's step."""
        if self._await_step:
            self._await_step = False
            self.engine.commit()

    # ------------------------------------------------------------------ non-finite
    def _launch_nonfinite(self):
        """One small allgather of this rank's per-layer non-finite counts."""
        if not self._dense_order:
            return None
        mine = self._nf.row(self._dense_order,
                            [self._payloads[n] for n in self._dense_order], self._device())
        return self.engine.gather_nonfinite(mine, wait=False)

    def _finish_nonfinite(self, handle):
        return self.engine.finish_nonfinite(handle)    # [P, nlayers], same on all ranks

    def _apply_nonfinite_policy(self, table, totals) -> bool:
        """Returns True when the step is skipped (``skip``: rolled back on every rank)."""
        if table is None:
            return False
        if self.nonfinite == "skip":
            if not self.engine.nonfinite_skip(table, self._dense_order, self.step):
                return False
            self.skipped_steps += 1
            if self.compressor.transactional:
                self._rollback()
            return True
        flagged = self.engine.nonfinite_flags(table, self._dense_order, self.step)
        if flagged is not None:
            self._mark_nan(totals, flagged)
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
        for name, handle in list(self._sparse_handles.items()):
            out = self.transport.synchronize(handle) if not callable(handle) else handle()
            p = self.params[name]
            if write and p.requires_grad:
                p.grad = out.coalesce()
        self._sparse_handles.clear()

    def _apply_bucket(self, spec: BucketSpec, total: torch.Tensor,
                      inv: Optional[torch.Tensor], scale: Optional[float]):
        """:meth:`_apply` for a whole bucket without the local-gradient combination, in a
        fixed number of device ops per bucket: the average's pending ``1/P`` on the flat
        sum, ``after_exchange`` (reads the average), DGC's dense-layer momentum
        (:meth:`StepEngine.dense_momentum_bucket`), then one multi-tensor copy into the
        ``p.grad`` s (cast to their dtype). The same bits as :meth:`_apply`."""
        if scale is not None:
            total.mul_(scale)
        names = spec.names
        params = [self.params[n] for n in names]
        views = [v.view(p.shape) for v, p in zip(spec.views(total), params)]
        if self.engine.reads_exchanged:
            for n, g, p in zip(names, views, params):
                self.engine.after_exchange(n, g if inv is None else g * inv, p, self.step)
        live = [i for i, n in enumerate(names) if n not in self._frozen]
        moms = self.engine.dense_momentum_bucket(
            [names[i] for i in live], [views[i] for i in live], [params[i] for i in live], inv)
        dst, src = [], []
        with torch.no_grad():
            for i, m in zip(live, moms):
                p, g, grad = params[i], views[i] if m is None else m, params[i].grad
                if names[i] in self._was_sparse:
                    p.grad = g.to(p.dtype).to_sparse()
                elif grad is not None and grad.shape == p.shape and not grad.is_sparse:
                    dst.append(grad)
                    src.append(g)
                else:
                    p.grad = g.to(p.dtype).clone()
            if dst:
                torch._foreach_copy_(dst, src)

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
            m = self.engine.dense_momentum(name, c, p, inv)    # sent dense (DGC)
            c = c if m is None else m
            with torch.no_grad():
                if name in self._was_sparse:
                    p.grad = c.to(p.dtype).to_sparse()
                elif p.grad is not None and p.grad.shape == p.shape and not p.grad.is_sparse:
                    p.grad.copy_(c)
                else:
                    p.grad = c.to(p.dtype).clone()
        if inv is not None and self.engine.reads_exchanged:
            g = g * inv                               # unscaled (Slim-DP: |w| + c |g|)
        self.engine.after_exchange(name, g, p, self.step)

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
        self._nf.reset()
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
