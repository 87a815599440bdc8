"""hvdsparse's compressors as a DDP communication hook (``torchrun`` +
``DistributedDataParallel``)::

    import hvdsparse, hvdsparse.ddp
    model = DDP(net)
    state = hvdsparse.ddp.State(hvdsparse.TopK(0.01), model.named_parameters())
    model.register_comm_hook(state, hvdsparse.ddp.hook)

named next to PyTorch's ``powerSGD_hook.PowerSGDState`` / ``powerSGD_hook``. The same
compressors, codec and exchange strategies as :func:`hvdsparse.DistributedOptimizer`
run here; only the transport differs (:class:`hvdsparse.transport.TorchDistTransport`:
Gloo on CPU, NCCL on GPU).

Per step (one synchronised backward)
------------------------------------
DDP calls :func:`hook` once per gradient bucket, in bucket order on every rank. The flat
bucket ``B`` holds the bucket's parameters' local gradients end to end (in
``bucket.parameters()`` order); the hook compresses each parameter's slice *by name*
(``compress(name, grad, step, param)``), so per-layer policy, overrides, warm-up, error
feedback and seeds are exactly those of the Horovod path, then launches the bucket's
exchange (``allgather``, ``split``, ``dense``, or ``auto`` by the cost model) on the
torch transport. The exchange returns the rank-order sum ``S`` of every rank's decoded
payloads; the hook writes ``S / P`` (``average=True``) into ``B`` itself (one copy per
bucket) and its future yields ``B``: DDP then finds the result already in place
(``gradient_as_bucket_view=True``: ``p.grad`` *is* ``B``'s view) instead of copying it
back parameter by parameter.

Ordering and overlap: ``torch.distributed`` matches collectives by issue order, so every
collective is issued from a hook call (same order on every rank) and none from a
completion callback. Buckets' first collectives run in the background while backward
continues; at the **last** bucket (``bucket.is_last()``) the hook finishes every bucket
of the step in bucket order on the calling thread (wait, decode, split's second phase,
``after_exchange`` -- Slim-DP's core broadcast), checks non-finite gradients across
ranks (one small allgather), completes the futures and advances the step. DDP waits for
the futures only after the last hook, so this costs no extra wait. (This is why
PyTorch's ``powerSGD_hook``, which issues allreduces inside ``then`` callbacks, can
mismatch collectives across ranks with several buckets on Gloo.)

Identical replicas: the allgather strategy decodes the P messages in rank order, split's
owners reduce in rank order and every rank decodes the same bytes, Gloo's / NCCL's
allreduce gives every rank the same bytes -- so ``p.grad`` is bitwise identical on every
rank, as under Horovod.

Which parameters had a gradient: the state hooks every parameter's gradient accumulator
(``register_post_accumulate_grad_hook``) and records which ones received a gradient
since the last synchronised step. A parameter without one on this rank (unused with
``find_unused_parameters=True``, or every parameter of a rank that has joined, see
below) contributes an *absent* payload: its wire layout, nothing in it, its residual
untouched (as the Horovod path does).

DDP features
------------
* ``no_sync()``: DDP does not call the hook; gradients accumulate in ``p.grad`` and the
  accumulated gradient is compressed at the next synchronised step (the step counter
  counts synchronised steps only).
* ``find_unused_parameters=True``: see above; a parameter unused on every rank gets
  ``p.grad`` left alone by DDP, as without a hook.
* ``static_graph=True`` and bucket rebuilding: DDP rebuilds its buckets after the first
  iteration (index and membership change). Per-bucket state (bucket id for the reused
  buffers, the cost model's history) is keyed by the bucket's parameter names, not its
  index, so a new layout simply gets new state; compressor state is keyed by parameter
  name and is unaffected.
* ``Join``: a rank that ran out of inputs shadows the others' backward by calling the
  hook on zero buckets; it has no gradients, so all its parameters are absent (nothing
  of its residuals is flushed) and its step counter advances with the others (warm-up
  capacities stay equal). Its contribution is zero, and the average still divides by
  the full world size P (as DDP's default allreduce does under Join).

First step: every rank allgathers (``all_gather_object``) its settings fingerprint
(:func:`hvdsparse.settings.fingerprint`, the same as the Horovod path's) plus its
parameter names and sizes; any difference from rank 0 raises the same ``ValueError`` on
every rank naming the setting and the ranks.

Checkpoints: :meth:`State.state_dict` holds this rank's compressor state (residuals are
per rank: save one per rank), the step counter and the cost model's history;
:meth:`State.load_state_dict` restores them, so a resumed run continues bitwise
identically.

Non-finite gradients (NaN/Inf, counted per layer while compressing; nothing of them
enters a residual; one small allgather per step gives every rank the same table):
``nonfinite="raise"`` (default): every rank raises ``FloatingPointError`` naming layers
and ranks (on CUDA one step late, read without a stall, with the affected layers'
gradients set to NaN meanwhile, as ``"propagate"`` does). ``"propagate"``: element 0 of
every layer that held one on any rank becomes NaN in the averaged gradient on every
rank, as DDP's dense allreduce of a NaN would, and training goes on (the optimizer
decides). ``"skip"`` is refused: a comm hook cannot cancel the optimizer step; use
``grad_scaler=``, which makes ``scaler.step`` skip it.

Mixed precision (``grad_scaler=`` the ``torch.amp.GradScaler`` of the training loop;
PyTorch's usual ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``
is unchanged): the hook divides the loss scale out before a gradient meets its residual
(residuals and DGC velocities stay in unscaled units whatever the scale does; the scale
is a power of two, so this is exact) and multiplies it back into the averaged bucket,
so ``scaler.unscale_`` sees what it expects. An overflow on any rank is propagated as
above, so ``scaler.step`` skips the step on every rank and ``scaler.update`` backs off
identically; the hook's step is a transaction (``Compressor.transactional``): when the
non-finite table shows an overflow the residuals, thresholds, Slim-DP cores and DGC
velocities go back exactly to their state before the step (at once on CPU; on CUDA when
the next step opens, from the table copied without a stall), so the run continues as if
the overflow step had not happened. Not supported here either (refused with an error):
``backward_passes_per_step`` (use ``no_sync()``), ``local_gradient``, ``fusion_threshold``
(DDP's ``bucket_cap_mb`` forms the buckets), sparse gradients.

DGC momentum correction / masking and local clipping (``momentum_correction=True``,
``clip_grad_norm=``, with ``optimizer=`` the ``torch.optim.SGD`` that steps the model):
the velocity is accumulated and compressed in the hook, exactly as in the Horovod path
(:mod:`hvdsparse.momentum`); the optimizer's momentum and weight decay are 0 during its
``step()`` (step pre/post hooks), layers sent dense get ordinary momentum on the
exchanged average inside the hook.

The Adam recipe (``optimizer=`` a ``torch.optim.Adam`` / ``AdamW``; on by default
then, ``adam_recipe=False`` turns it off): the same :class:`hvdsparse.adam.AdamRecipe`
as the Horovod path -- dense exact warm-up, then each rank's gradient scaled by the
frozen ``1 / D`` compressed in the hook and the frozen-variance update applied around the
optimizer's ``step()``. With ``torch.amp.GradScaler``, pass it (``grad_scaler=``): the
hook must know the loss scale, or scaled gradients would enter the unscaled ``exp_avg``.
A parameter unused on every rank keeps ``p.grad = None`` (DDP), so it is not stepped,
but its zero gradient was still compressed into its residual.

Host synchronisation (CUDA): as in the Horovod path, except the split strategy, whose
variable-size alltoalls need one small size exchange each on torch.distributed
(:mod:`hvdsparse.transport`).
"""
import time
import warnings
from collections import OrderedDict
from typing import Dict, List, Optional

import torch

from .bucket_plan import BucketHistory
from .ddp_setup import check_state_args, ddp_local_update
from .door import bind_compressor, local_fingerprint, resolve_local_update
from .engine import LayerInput, StepEngine
from .nonfinite import NonFinite, flagged_layers
from .exchange import BucketSpec, BufferPool, HostReadout
from .stats import add_totals, empty_totals
from .settings import ExchangeSettings, fingerprint
from .transport import Transport, TorchDistTransport

__all__ = ["State", "hook"]

class _Layout:
    """Per bucket layout (keyed by its parameter names): the spec and the cost model's
    history."""

    __slots__ = ("spec", "history", "_first")

    def __init__(self, spec: BucketSpec, history: BucketHistory):
        self.spec = spec
        self.history = history
        self._first = None             # spec.first_elements(), for NaN marking

    def first(self, device) -> torch.Tensor:
        """``spec.first_elements`` on ``device`` (made once)."""
        if self._first is None or self._first.device != device:
            self._first = self.spec.first_elements(device)
        return self._first


class _InFlight:
    __slots__ = ("layout", "pend", "future", "names", "params", "buffer", "strategy",
                 "payloads", "batches")


class State:
    """State of :func:`hook` (see the module docstring).

    Arguments:
        compression: an hvdsparse compressor instance (``hvdsparse.TopK(0.01)``, ...);
            one instance per State.
        named_parameters: ``model.named_parameters()`` (of the DDP model or the module
            inside it): names the per-layer state, overrides and seeds. Every parameter
            that DDP reduces must be named.
        process_group: the group DDP reduces over (None = the default group).
        exchange, dense_dtype, split_dense_bits, quant_bucket, validate, alpha_bytes,
            average, gradient_predivide_factor, nonfinite, cuda_graphs: as for
            :func:`hvdsparse.DistributedOptimizer` (validated by
            :class:`hvdsparse.settings.ExchangeSettings`); or pass ``settings=``.
        transport: a :class:`hvdsparse.transport.Transport` (default: torch.distributed
            on ``process_group``).
        optimizer, momentum_correction, momentum_masking, clip_grad_norm: DGC's momentum
            correction / masking and local clipping (:mod:`hvdsparse.momentum`), as for
            :func:`hvdsparse.DistributedOptimizer` (``momentum_correction=None``, the
            default, turns it on by the same rule when ``optimizer=`` is given, and
            leaves it off without it); they need the ``torch.optim.SGD``
            that steps the model (``optimizer=``): its momentum and weight decay are
            applied in the hook and set to 0 for the duration of its ``step()``
            (optimizer step pre/post hooks; ``param_groups`` and checkpoints keep the
            user's values).
        adam_recipe, adam_warmup, adam_refresh, adam_refresh_start, adam_wire: the Adam /
            AdamW recipe (:mod:`hvdsparse.adam`), as for
            :func:`hvdsparse.DistributedOptimizer`: on by default when
            ``optimizer=`` is a ``torch.optim.Adam`` / ``AdamW`` (the hook cannot see
            the optimizer otherwise: without ``optimizer=`` it is off); after the
            dense warm-up the wire's quantity (by default every rank's own Adam step)
            is compressed in the hook, and the recipe's update replaces Adam's for
            those parameters around the optimizer's ``step()`` (step pre/post hooks).
        grad_scaler: the ``torch.amp.GradScaler`` of the training loop (see "Mixed
            precision" in the module docstring): residuals in unscaled units, overflow
            steps propagated to every rank (``scaler.step`` skips them) and rolled back.
    """

    def __init__(self, compression, named_parameters, *, process_group=None,
                 settings: Optional[ExchangeSettings] = None,
                 transport: Optional[Transport] = None, optimizer=None, grad_scaler=None,
                 **options):
        compression, settings, named = check_state_args(
            compression, named_parameters, settings, options, grad_scaler)
        self.compressor = compression
        self.settings = settings
        self.process_group = process_group
        self.transport = transport if transport is not None else \
            TorchDistTransport(process_group)
        self.rank, self.world_size = self.transport.rank(), self.transport.size()
        self.params: "OrderedDict[str, torch.Tensor]" = OrderedDict(named)
        self._name_of: Dict[int, str] = {id(p): n for n, p in named}
        self.prefix = f"hvdsparse.ddp{id(self):x}"
        self.fingerprint = fingerprint(settings, compression)
        self.fingerprint["front door"] = "ddp"
        self.step = 0
        self._agreed = False
        self._layouts: Dict[tuple, _Layout] = {}
        self._pool = BufferPool()
        self._inflight: List[_InFlight] = []
        self._used: set = set()
        self._step_open = False
        self.last_stats: dict = {}
        self.totals: dict = empty_totals()
        self._t_compress = 0.0
        self.grad_scaler = grad_scaler
        # overflow steps are expected with a scaler: it sees the NaN and skips the step
        self.nonfinite = "propagate" if grad_scaler is not None else settings.nonfinite
        self._txn_open = False          # a transactional step awaits commit / rollback
        self._txn_readout = None        # CUDA: that step's "any non-finite" flag
        self._last_committed = True
        self.skipped_steps = 0          # overflow steps rolled back (grad_scaler)
        bind_compressor(compression, self.transport, self.prefix, self)
        register = getattr(compression, "register_layers", None)
        if callable(register):
            register([(n, p.shape) for n, p in self.params.items()])
        # the rule without optimizer= resolves to off: it needs an SGD
        momentum_correction, adam = resolve_local_update(optimizer, compression, settings,
                                                         list(self.params))
        self.local_update, self._opt_hooks = ddp_local_update(
            optimizer, self.params, self.world_size, compression, settings,
            momentum_correction=momentum_correction, adam=adam)
        transactional = grad_scaler is not None
        compression.transactional = transactional
        if self.local_update is not None:
            self.local_update.transactional = transactional
        # per-step non-finite counters (re-slotted in the buckets' order after each
        # step, so a bucket's row is a slice of them)
        self._nf = NonFinite(list(self.params))
        self.engine = StepEngine(compression, settings, self.transport, rank=self.rank,
                                 world_size=self.world_size, prefix=self.prefix,
                                 local_update=self.local_update, grad_scaler=grad_scaler,
                                 nonfinite=self.nonfinite)
        self.fingerprint.update(local_fingerprint(momentum_correction, adam, settings))
        self.fingerprint["grad_scaler"] = grad_scaler is not None
        self._hooks = []
        for n, p in self.params.items():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda _p, _n=n: self._used.add(_n)))

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """This rank's compressor state (residuals: per rank), the step counter and the
        cost model's history per bucket layout (including the last exchange's figures,
        which the next step would read: a host read on CUDA). Call between steps."""
        if self._inflight:
            raise RuntimeError("hvdsparse.ddp.State.state_dict() during a step")
        self._settle()                  # a skipped step is not saved (CUDA: reads a flag)
        lu = self.local_update
        extra = {} if lu is None else \
            {getattr(lu, "state_key", "momentum_correction"): lu.state_dict()}
        return dict(compressor=self.compressor.state_dict(), step=self.step, **extra,
                    rank=self.rank, world_size=self.world_size,
                    fingerprint=self.fingerprint,
                    history=self.engine.history_state())

    def load_state_dict(self, sd: dict):
        if not isinstance(sd, dict) or "compressor" not in sd:
            raise ValueError("hvdsparse.ddp.State.load_state_dict: not a State.state_dict()")
        if sd.get("world_size") not in (None, self.world_size):
            warnings.warn(f"hvdsparse.ddp: state saved at world size {sd['world_size']}, "
                          f"loaded at {self.world_size}")
        if self._txn_open:                # the step before the load is forgotten
            self._txn_readout = None
            self._close_txn(commit=False)
        self.compressor.load_state_dict(sd["compressor"])
        key = getattr(self.local_update, "state_key", "momentum_correction")
        if self.local_update is not None and key in sd:
            self.local_update.load_state_dict(sd[key])
        self.step = int(sd["step"])
        self._inflight.clear()
        self._used.clear()
        self._step_open = False
        self.engine.load_history_state(sd.get("history", {}))

    def stats(self) -> dict:
        """As ``hvdsparse.DistributedOptimizer.stats()``: ``last`` (the last step's bytes
        sent / received per strategy -- per-rank ring link bytes --, strategy and bytes
        per bucket, compress / wait / decode seconds), ``totals`` (summed over steps),
        ``compressor`` (the compressor's totals)."""
        comp = getattr(self.compressor, "stats_totals", None)
        return dict(last=dict(self.last_stats), totals=dict(self.totals),
                    compressor=comp() if callable(comp) else None)

    def remove_hooks(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ per bucket
    def _names(self, params) -> List[str]:
        out = []
        for p in params:
            n = self._name_of.get(id(p))
            if n is None:
                raise ValueError(f"hvdsparse.ddp: DDP reduces a parameter of shape "
                                 f"{tuple(p.shape)} that is not in the named_parameters "
                                 f"given to State (pass model.named_parameters())")
            out.append(n)
        return out

    def _layout(self, names, params, grads, buf) -> _Layout:
        key = tuple(names)
        lay = self._layouts.get(key)
        if lay is None:
            numels = [int(p.numel()) for p in params]
            # the flat bucket is the parameters' gradients end to end, in this order:
            # checked once per layout from pointers (no device read)
            es, base, off = buf.element_size(), buf.data_ptr(), 0
            for n, g, k in zip(names, grads, numels):
                if g.numel() != k or (k and g.data_ptr() != base + off * es):
                    raise RuntimeError(f"hvdsparse.ddp: gradient of {n!r} is not at offset "
                                       f"{off} of its DDP bucket; unsupported bucket layout")
                off += k
            if off != buf.numel():
                raise RuntimeError(f"hvdsparse.ddp: bucket of {buf.numel()} elements holds "
                                   f"parameters of {off} elements")
            lay = _Layout(BucketSpec.build(len(self._layouts), names, numels),
                          self.engine.history(names))
            self._layouts[key] = lay
        return lay

    def _agree(self):
        """First hook call: compare settings and parameters with rank 0 (every rank
        raises the same error)."""
        self.engine.agree(dict(fingerprint=self.fingerprint,
                               numels={n: int(p.numel()) for n, p in self.params.items()}),
                          "agree")
        self._agreed = True

    def on_bucket(self, bucket) -> torch.futures.Future:
        """The hook body (see the module docstring)."""
        buf = bucket.buffer()
        params = list(bucket.parameters())
        fut = torch.futures.Future()
        if self.world_size == 1:          # nothing to exchange (as the Horovod path)
            fut.set_result(buf)
            return fut
        if not self._step_open:
            self._step_open = True
            self._settle()
            self.engine.check_deferred()
            if not self._agreed:
                self._agree()
            self.engine.begin_step(self.step)
            self._txn_open = self.grad_scaler is not None
        if buf.is_sparse or any(g.is_sparse for g in bucket.gradients()):
            raise NotImplementedError("hvdsparse.ddp: sparse gradients are not supported")
        names = self._names(params)
        lay = self._layout(names, params, bucket.gradients(), buf)
        spec = lay.spec
        t0 = time.perf_counter()
        layers = []
        for name, p, g in zip(names, params, spec.views(buf)):
            used = name in self._used or self.engine.zero_fills(p)
            grad = (g.view(p.shape) if name in self._used else torch.zeros_like(p)) \
                if used else None      # Adam recipe: an absent layer is a zero gradient
            layers.append(LayerInput(name, grad, p, self._nf.counter(name, buf.device)))
        batches: list = []
        payloads = self.engine.compress_group(layers, self.step, batches)
        self._t_compress += time.perf_counter() - t0
        strategy = self.engine.strategy(lay.history, spec.numel, payloads)
        row = self._nf.row(names, payloads, buf.device)    # rides in the message
        pend = self.engine.launch(strategy, spec, payloads, buf.device, self.step, self._pool,
                                  nonfinite_row=row)
        item = _InFlight()
        item.layout, item.pend, item.future, item.names = lay, pend, fut, names
        item.params, item.buffer, item.strategy, item.payloads = params, buf, strategy, payloads
        item.batches = batches
        self._inflight.append(item)
        if bucket.is_last():
            self._finish_step()
        return fut

    def _finish_step(self):
        """Finish every bucket of the step in bucket order, on the hook's thread."""
        P = self.world_size
        scale = 1.0 / P if self.settings.average else 1.0
        items, self._inflight = self._inflight, []
        results = []
        # the counts of buckets whose message did not carry them: one allgather queued
        # after the buckets' collectives and waited for last, so the buckets' decodes
        # overlap it (the Horovod door's order)
        nf_names, nf_handle = self._launch_nonfinite(items)
        try:
            self._finish_buckets(items, results, scale)
        except BaseException:
            if nf_handle is not None:       # leave no handle behind; the first error wins
                try:
                    self.engine.nonfinite.finish(nf_handle)
                except Exception:
                    pass
            raise
        flagged = self._nonfinite(items, results, nf_names, nf_handle)
        inv = self.engine.grad_scale(items[0].buffer.device) if items else None
        if inv is not None:              # back to the scaled units GradScaler expects
            for total in results:
                total.div_(inv)
        for it, total in zip(items, results):
            # the result goes back in DDP's own bucket buffer: a result that aliases the
            # bucket is not copied again, parameter by parameter, by DDP's reducer (one
            # copy per bucket here instead of one per parameter there)
            it.future.set_result(total if total is it.buffer else it.buffer.copy_(total))
        if not self._txn_open or flagged is None:   # no scaler, or no layer compared
            self._close_txn(commit=True)
        elif flagged.device.type == "cpu":
            self._close_txn(commit=not flagged.numpy().any())   # host memory: no sync
        else:                                     # CUDA: decided when the next step opens
            self._txn_readout = HostReadout(flagged.any().view(1))
        self.engine.send_reads(self.step)
        self.last_stats = self.engine.step_stats(
            self.step, [(it.layout.spec, it.pend) for it in items],
            compress_s=self._t_compress, wait_s=sum(it.pend.wait_s for it in items),
            decode_s=sum(it.pend.decode_s for it in items),
            skipped=None if self._txn_readout is not None else not self._last_committed)
        add_totals(self.totals, self.last_stats)
        self._t_compress = 0.0
        self._used.clear()
        self._step_open = False
        self.step += 1

    def _finish_buckets(self, items, results, scale) -> None:
        """Every bucket in launch order: wait, decode, average, feed back; appends each
        bucket's exchanged gradient to ``results``."""
        for it in items:
            pend = it.pend
            total = self.engine.finish(pend, it.layout.history, it.payloads)
            if total.dtype == it.buffer.dtype:
                # averaged straight into DDP's own bucket buffer (every hook of the step
                # has run: nothing reads the local gradients there any more), one launch
                # for the average and the copy back
                total = torch.mul(total, scale, out=it.buffer)
            else:
                total.mul_(scale)
            self.engine.feed_back(it.names, it.payloads, it.layout.spec, pend.undelivered,
                                  it.batches, self.step)
            gs = [v.view(p.shape) for v, p in zip(it.layout.spec.views(total), it.params)]
            for name, p, g in zip(it.names, it.params, gs):
                self.engine.after_exchange(name, g, p, self.step)
            moms = self.engine.dense_momentum_bucket(it.names, gs, it.params)
            sent_dense = [(g, m) for g, m in zip(gs, moms) if m is not None]   # DGC
            if sent_dense:
                torch._foreach_copy_([g for g, _ in sent_dense], [m for _, m in sent_dense])
            results.append(total)

    def _launch_nonfinite(self, items):
        """The step's layer names in bucket order and the handle of the one small
        allgather of the counts no bucket message carried (None: all carried, or no
        layers; :meth:`NonFinitePolicy.gather_rest`), not waited for."""
        names = [n for it in items for n in it.names]
        handle = self.engine.nonfinite.gather_rest([it.pend for it in items]) \
            if names else None
        self._nf.reset()
        self._nf.follow(names)
        return names, handle

    def _nonfinite(self, items, results, names, handle) -> Optional[torch.Tensor]:
        """The step's non-finite table (:meth:`NonFinitePolicy.assemble`, same on every
        rank) under the policy (:meth:`NonFinitePolicy.propagate`): the flagged layers'
        element 0 becomes NaN in ``results`` on every rank (device ops). Returns the
        per-layer "flagged on some rank" vector (None with no layers)."""
        if not names:
            return None
        table = self.engine.nonfinite.assemble([it.pend for it in items], handle)
        self.engine.nonfinite.propagate(
            table, names, self.step, ((it.layout.spec, total, it.layout.first(total.device))
                                      for it, total in zip(items, results)))
        return flagged_layers(table)

    # ------------------------------------------------------------------ transactions
    def _close_txn(self, commit: bool):
        """Commit (keep) or roll back the compressor's and the local update's step."""
        self._txn_open = False
        self._last_committed = commit
        if commit:
            self.engine.commit()
        else:
            self.skipped_steps += 1
            self.engine.rollback()

    def _settle(self):
        """CUDA with ``grad_scaler``: decide the previous step's transaction from its
        non-finite flag (copied to the host without a stall one step ago)."""
        if self._txn_readout is None:
            return
        reader, self._txn_readout = self._txn_readout, None
        self._close_txn(commit=not int(reader.get()[0]))


def hook(state: State, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``model.register_comm_hook(state, hvdsparse.ddp.hook)``.
    Returns a future holding the averaged bucket (see the module docstring)."""
    return state.on_bucket(bucket)
