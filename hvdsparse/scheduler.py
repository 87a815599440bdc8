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

Parts: the hooks (:mod:`hvdsparse.grad_hooks`), ready layers to payloads
(:mod:`hvdsparse.layer_intake`), the first step's plan
(:func:`hvdsparse.bucket_plan.agree_plan`), ``p.grad`` and sparse gradients
(:mod:`hvdsparse.grad_writer`); the step itself is the engine's.

``events``: the current step's log (``("ready", name)``, ``("launch", bucket,
strategy)``, ``("backward_done",)``, ``("synchronize",)``, ``("finish", bucket)``, ...);
``last_stats`` / ``totals``: :meth:`StepEngine.step_stats`.
"""
from __future__ import annotations

import time
import warnings
from typing import Dict, List, Optional

import torch

from .bucket_plan import agree_plan, plan_buckets
from .engine import StepEngine
from .grad_hooks import GradHooks
from .grad_writer import GradWriter, empty_sparse_like
from .layer_intake import LayerIntake
from .nonfinite import NonFinite
from .exchange import BucketSpec
from .exchange.base import BufferPool
from .settings import ExchangeSettings
from .stats import add_totals, empty_totals
from .transport import Transport, horovod

__all__ = ["LayerScheduler", "plan_buckets"]

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
        self.engine.reads.hint = (" Use DistributedOptimizer(nonfinite='skip') to skip "
                                  "such steps, or grad_scaler=... with torch.amp.GradScaler "
                                  "(README: mixed precision)")

        self.params: Dict[str, torch.Tensor] = {}
        for name, p in named_params:
            self.params[name] = p
        self._reg_order = list(self.params)
        self.step = 0
        self.plan: Optional[List[List[str]]] = None
        self._specs: List[BucketSpec] = []
        self._bucket_of: Dict[str, int] = {}
        self._dense_order: List[str] = []
        self._buffers = BufferPool()     # exchange buffers reused step to step
        self._nan_index: List[Optional[torch.Tensor]] = []   # per bucket: first elements
        self._delay = {n: self.backward_passes_per_step for n in self.params}
        self._ready_count: List[int] = []
        self._inflight: Dict[int, object] = {}
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
        # hooks on gradient accumulation (as Horovod's), and the end of each backward
        self.hooks = GradHooks(self._on_grad, lambda: self.events.append(("backward_done",)))
        # ready layers -> this step's payloads (at once, or with the rest of their
        # bucket), counting non-finite elements into one row per step
        self.intake = LayerIntake(self.params, self.engine, self.events)
        self._payloads = self.intake.payloads          # the step's payloads by name
        # writes p.grad; the sparse gradients' allreduces
        self.grads = GradWriter(self.params, self.engine, self.transport, settings,
                                prefix=prefix, world_size=self.world_size, local=local)

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
                self.hooks.add(name, p)

    def remove_hooks(self):
        self.hooks.remove()

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
        self.hooks.queue_backward_done()
        # handled already this step: compressed, sent sparse, or waiting for its bucket
        # (the bucket path defers a layer until the bucket's last one arrives)
        if name in self._payloads or name in self.grads.sparse_handles or \
                self._delay[name] <= 0:
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
            self.grads.densify(name, p)
        if self._defers(name, p):
            self.intake.defer(self._bucket_of[name], name)
        else:
            self._compress(name)
        if self.plan is not None:
            b = self._bucket_of[name]
            self._ready_count[b] += 1
            if self._ready_count[b] == len(self._specs[b].names):
                self.intake.compress_bucket(b, self.step)
                self._launch(b)
        for pend in self._inflight.values():
            pend.advance()

    def _compress(self, name: str):
        self.intake.compress(name, self.step)

    def _defers(self, name: str, p) -> bool:
        """Whether layer ``name`` waits for its bucket (the bucket path: planned, on the
        device path or the CPU with the compiled loops; whether it is compressed there is
        decided when the bucket is complete, :meth:`LayerIntake.compress_bucket`)."""
        return self.plan is not None and name in self._bucket_of and \
            self.engine.may_bucket(p.grad)

    def _compress_absent(self, name: str):
        if not self.params[name].requires_grad:
            self.grads.frozen.add(name)        # keeps its p.grad
        self.intake.compress_absent(name, self.step)

    def _launch_sparse(self, name: str, grad: torch.Tensor):
        self.grads.launch_sparse(name, grad, planned_dense=name in self._bucket_of)
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
        device = self._device() or torch.device("cpu")
        row = self.intake.nonfinite_row(spec.names, device)   # rides in the message
        pend = self.engine.launch(strategy, spec, payloads, device, self.step,
                                  self._buffers, nonfinite_row=row)
        self._inflight[b] = pend
        self.events.append(("launch", b, strategy))

    def _build_plan(self):
        """First step: agree with every rank and plan the buckets from rank 0's ready
        order (:func:`hvdsparse.bucket_plan.agree_plan`: settings, parameters, and the
        steady-state payload sizes); a layer sparse on some rank is sparse everywhere."""
        dense_ready = [n for n in self.intake.ready_order if n in self._payloads]
        sparse_now = self.grads.sparse_layers
        agreed = agree_plan(self.engine, self.params, dense_ready, sparse_now,
                            self.fingerprint, self.step, self.fusion_threshold)
        for n in sorted(agreed.sparse - sparse_now):
            self._payloads.pop(n, None)
            self._launch_sparse(n, empty_sparse_like(self.params[n]))
        sparse_now |= agreed.sparse
        self.plan = agreed.plan
        self._specs = [BucketSpec.build(b, names, [agreed.numels[n] for n in names])
                       for b, names in enumerate(self.plan)]
        self._bucket_of = {n: b for b, names in enumerate(self.plan) for n in names}
        self._dense_order = agreed.order
        self.intake.nf = NonFinite(agreed.order)
        dev = self._device()
        self._nan_index = [spec.first_elements(dev) for spec in self._specs]
        self._ready_count = [0] * len(self.plan)

    # ------------------------------------------------------------------ step
    def pending(self) -> bool:
        return self._dirty or bool(self._payloads) or bool(self._inflight) \
            or bool(self.grads.sparse_handles)

    def synchronize(self):
        """Flush, wait, decode, average and write ``p.grad`` for every parameter."""
        if not self.active:
            self.step += 1
            self._await_step = False
            return
        self._open_step()
        self.events.append(("synchronize",))
        self.engine.check_deferred()       # last step's device flags, read now
        for b in list(self.intake.deferred):     # buckets with a layer still to come
            self.intake.compress_bucket(b, self.step)
        if self.plan is not None:
            order = self._dense_order + sorted(self.grads.sparse_layers)
        else:
            order = list(reversed(self._reg_order))
        for name in order:
            if name in self._payloads or name in self.grads.sparse_handles:
                continue
            p = self.params[name]
            if p.requires_grad and name not in self.hooks:
                self.hooks.add(name, p)        # unfrozen after construction
            if p.requires_grad and p.grad is not None:
                if p.grad.is_sparse and self.settings.sparse_as_dense:
                    self.grads.densify(name, p)
                if p.grad.is_sparse:
                    self._launch_sparse(name, p.grad)
                else:
                    self._compress(name)       # hook delay not reached, or set by hand
            elif name in self.grads.sparse_layers:
                self._launch_sparse(name, empty_sparse_like(p))
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
                    self.engine.nonfinite.finish(nf_handle)
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
            self.grads.write(self._specs, totals, self._payloads, self.step)
        self.grads.finish_sparse(write=not skip)
        self.engine.send_reads(self.step)
        self.last_stats = self.engine.step_stats(
            self.step, [(spec, self._inflight[b]) for b, spec in enumerate(self._specs)],
            compress_s=self.intake.t_compress, wait_s=t_wait, decode_s=t_dec, skipped=skip)
        add_totals(self.totals, self.last_stats)
        # reset for the next step
        self.step += 1
        self._await_step = not skip
        self.skip_update = skip
        self._step_open = False
        self.grads.was_sparse.clear()
        self.intake.t_compress = 0.0
        self._clear_step()
        self._clear_events = True

    def _finish_buckets(self, scale, totals):
        """Every bucket in launch order: wait, decode, average, feed back; appends to
        ``totals``, returns (seconds waited, seconds decoding)."""
        t_wait = t_dec = 0.0
        for b, spec in enumerate(self._specs):
            pend = self._inflight[b]
            total = self.engine.finish(pend, self.engine.history(spec.names),
                                       [self._payloads[n] for n in spec.names])
            t0 = time.perf_counter()
            self.events.append(("finish", b))
            if scale != 1.0:
                total.mul_(scale)  # x * 1.0 == x bit for bit: no pass at P = 1 / Sum
            totals.append(total)
            self._feed_back(b, spec, pend.undelivered)
            t_dec += pend.decode_s + time.perf_counter() - t0
            t_wait += pend.wait_s
        return t_wait, t_dec

    def _feed_back(self, b: int, spec: BucketSpec, undelivered: Optional[torch.Tensor]):
        self.engine.feed_back(spec.names, [self._payloads[n] for n in spec.names], spec,
                              undelivered, self.intake.batches.pop(b, ()), self.step)

    def step_applied(self):
        """The optimizer applied the exchanged gradients: commit the compressor's step."""
        if self._await_step:
            self._await_step = False
            self.engine.commit()

    # ------------------------------------------------------------------ non-finite
    def _launch_nonfinite(self):
        """The one small allgather of the counts no bucket message carried (None: every
        bucket carried its own; :meth:`NonFinitePolicy.gather_rest`)."""
        if not self._dense_order:
            return None
        return self.engine.nonfinite.gather_rest(
            [self._inflight[b] for b in range(len(self._specs))])

    def _finish_nonfinite(self, handle):
        """The step's [P, nlayers] table in plan order, the same on every rank."""
        if not self._dense_order:
            return None
        return self.engine.nonfinite.assemble(
            [self._inflight[b] for b in range(len(self._specs))], handle)

    def _apply_nonfinite_policy(self, table, totals) -> bool:
        """Returns True when the step is skipped (``skip``: rolled back on every rank)."""
        if table is None:
            return False
        if self.nonfinite == "skip":
            if not self.engine.nonfinite.skip(table, self._dense_order, self.step):
                return False
            self.skipped_steps += 1
            if self.compressor.transactional:
                self._rollback()
            return True
        # flagged layers: NaN into element 0, on every rank
        self.engine.nonfinite.propagate(table, self._dense_order, self.step,
                                        zip(self._specs, totals, self._nan_index))
        return False

    def plan_order(self) -> List[str]:
        return [n for names in (self.plan or []) for n in names]

    def reset(self):
        """Drop everything in flight-free state (load_state_dict, as Horovod)."""
        if (self._await_step or self._step_open) and self.compressor.transactional:
            self._rollback()          # close the compressor's open step
        self.grads.sparse_handles.clear()
        self._step_open = False
        self._await_step = False
        self._clear_step()

    def _clear_step(self):
        """Forget the step's payloads, waiting layers, launches and hook countdowns."""
        self.intake.clear()
        self.grads.frozen.clear()
        self._inflight.clear()
        self._ready_count = [0] * len(self._specs)
        self._delay = {n: self.backward_passes_per_step for n in self.params}
        self._dirty = False

    def set_backward_passes_per_step(self, passes: int):
        self.settings.backward_passes_per_step = int(passes)
        self._delay = {n: self.backward_passes_per_step for n in self.params}

