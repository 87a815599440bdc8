"""The step engine: what happens to one bucket of gradients in one step, written once for
both front doors (:mod:`hvdsparse.scheduler` under ``horovodrun``, :mod:`hvdsparse.ddp`
under ``torchrun``).

A front door knows *when* gradients are ready and *where* the result goes (Horovod:
accumulate-grad hooks, a bucket plan, ``p.grad``; DDP: ``GradBucket`` s and futures). The
engine knows *what* a step does with a bucket, in this order:

1. **compress** (:meth:`StepEngine.compress_group`): every layer of the bucket becomes a
   :class:`~hvdsparse.payload.LayerPayload`. Layers the bucket path takes
   (``compressors/bucket.py``: a fixed number of launches per bucket) are compressed
   together; the others one by one (:meth:`StepEngine.compress`), with the local update
   (DGC momentum correction / clipping, the Adam recipe) and the loss scale folded in.
   The Adam recipe's update-wire steps of a bucket are made together first
   (``hvdsparse/adam_bucket.py``: one launch) and enter the bucket path as the layers'
   input. A layer without a gradient contributes an *absent* payload
   (:meth:`compress_absent`).
2. **choose** (:meth:`StepEngine.strategy`): the exchange, fixed or ``auto`` by the cost
   model from sizes and from the figures of this bucket's exchange two steps back
   (:class:`hvdsparse.bucket_plan.BucketHistory`: read without stalling, the same on
   every rank).
3. **launch** (:meth:`StepEngine.launch`) through the door's transport, and **finish**
   (:meth:`StepEngine.finish`): the rank-order sum of every rank's decoded payloads.
4. **feed back** (:meth:`StepEngine.feed_back`): what the exchange sent but did not
   deliver returns to the residuals; DGC's momentum-factor masking.
5. **non-finite policy** (``StepEngine.nonfinite``, a
   :class:`~hvdsparse.nonfinite.NonFinitePolicy`): one per-layer count table, the same
   on every rank; ``raise`` / ``skip`` / ``propagate``.
6. **commit or roll back** (:meth:`StepEngine.commit` / :meth:`StepEngine.rollback`) the
   compressor's and the local update's step.

and, once, the **first-step agreement** (:meth:`StepEngine.agree`): every rank's settings
fingerprint and parameter sizes compared with rank 0's; a difference raises the same
``ValueError`` on every rank, naming the setting, parameter and ranks.

Host synchronisation: none in steps 1-4 (host integers only; the cost model's figures
are those of two steps back, whose copy completed before the previous step's
collectives could). Device flags the host must act on (the unvalidated decode's error
flag, the non-finite table under ``raise``) are copied to pinned memory and read at the
next step (:class:`DeferredReads`, ``StepEngine.reads``), never waited for in the step
that made them.
"""
from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Dict, List, NamedTuple, Optional, Sequence

import numpy as np
import torch

from . import adam_bucket, codec, device_graphs, ops
from .compressors import bucket
from .compressors.base import Compressor, inverse_loss_scale
from .exchange import BucketSpec, ExchangeContext, cost_model
from .exchange import launch as launch_exchange
from .exchange.base import ReadoutBatch, TaggedFigures, bucket_capacity
from .exchange.split import pair_dtype
from .bucket_plan import BucketHistory, saved_figures
from .nonfinite import NonFinitePolicy, raise_nonfinite
from .settings import ExchangeSettings, differences

__all__ = ["StepEngine", "LayerInput", "DeferredReads"]


class LayerInput(NamedTuple):
    """One layer of a bucket to compress: ``grad`` None means absent this step (no
    gradient on this rank: its wire layout, nothing in it, its residual untouched);
    ``param``: the parameter itself (the local update finds its optimizer state by
    identity; the compressor sees it detached); ``nonfinite``: the int32[1] counter it
    counts into, or None (the callee makes one)."""
    name: str
    grad: Optional[torch.Tensor]
    param: torch.Tensor
    nonfinite: Optional[torch.Tensor] = None


class StepEngine:
    """The per-bucket step both front doors run (see the module docstring).

    ``compressor``: the hvdsparse compressor; ``settings``: :class:`ExchangeSettings`;
    ``transport``: the door's :class:`hvdsparse.transport.Transport`; ``local_update``:
    :class:`hvdsparse.momentum.LocalUpdate` / :class:`hvdsparse.adam.AdamRecipe` or None;
    ``grad_scaler``: a ``torch.amp.GradScaler`` whose scale is divided out before
    gradients meet the residuals; ``nonfinite``: the policy in force."""

    def __init__(self, compressor: Compressor, settings: ExchangeSettings, transport, *,
                 rank: int, world_size: int, prefix: str, local_update=None,
                 grad_scaler=None, nonfinite: str = "raise"):
        self.compressor = compressor
        self.settings = settings
        self.transport = transport
        self.rank, self.world_size = int(rank), int(world_size)
        self.prefix = prefix
        self.local_update = local_update
        self.grad_scaler = grad_scaler
        #: device values read one step late; ``reads.hint``: the door's advice appended
        #: to the non-finite error
        self.reads = DeferredReads()
        #: the non-finite policy in force (:class:`hvdsparse.nonfinite.NonFinitePolicy`)
        self.nonfinite = NonFinitePolicy(nonfinite, transport, prefix, self.reads)
        #: whether exchanges record their figures for the cost model (``auto`` reads
        #: them; a benchmark may ask for them under a fixed exchange)
        self.record_figures = settings.exchange == "auto"
        self.bucket_path = bucket.enabled(compressor, local_update)
        if settings.cuda_graphs:
            # the bucket groups' launches replayed as CUDA graphs (CUDA tensors only); the
            # engine's own graphs hold the exchanges' encodes and decodes
            for owner in (compressor, local_update, self):
                if owner is not None and device_graphs.graphs_of(owner) is None:
                    device_graphs.enable(owner)
        try:
            self._after_takes_param = "param" in inspect.signature(
                compressor.after_exchange).parameters
        except (TypeError, ValueError):
            self._after_takes_param = False
        #: whether the compressor reads the exchanged gradient (overrides after_exchange)
        self.reads_exchanged = getattr(type(compressor), "after_exchange", None) is not \
            Compressor.after_exchange
        self._inv: Optional[torch.Tensor] = None
        self._inv_kept: Dict[torch.device, torch.Tensor] = {}
        self._histories: Dict[tuple, BucketHistory] = {}
        self._saved_histories: Dict[tuple, list] = {}

    # ------------------------------------------------------------------ per step
    def begin_step(self, step: int) -> None:
        """Open the compressor's (and the local update's) step; forget last step's loss
        scale (it changes in ``scaler.update()``, after the step)."""
        self._inv = None
        self.compressor.begin_step(step)
        if self.local_update is not None:
            self.local_update.begin_step()

    def grad_scale(self, device) -> Optional[torch.Tensor]:
        """1 / loss scale on ``device`` (``inverse_loss_scale``), or None; computed once
        per step."""
        if self.grad_scaler is None:
            return None
        inv = self._inv
        if inv is None or inv.device != device:
            inv = self._inv = inverse_loss_scale(self.grad_scaler, device)
            if self.settings.cuda_graphs:
                # one tensor per device for every step: a replayed graph reads its address
                kept = self._inv_kept.get(device)
                if kept is None:
                    kept = self._inv_kept[device] = torch.empty_like(inv)
                kept.copy_(inv)
                inv = self._inv = kept
        return inv

    def commit(self) -> None:
        self.compressor.commit()
        if self.local_update is not None:
            self.local_update.commit()

    def rollback(self) -> None:
        self.compressor.rollback()
        if self.local_update is not None:
            self.local_update.rollback()

    # ------------------------------------------------------------------ agreement
    def agree(self, mine: dict, what: str, more=None) -> List[dict]:
        """First step: allgather ``mine`` (holding ``fingerprint`` and ``numels``, plus
        whatever the door compares itself: ``more(everyone)`` returns its problems) from
        every rank; raise the same ``ValueError`` on every rank when a fingerprint, a
        parameter size or one of ``more``'s items differs from rank 0's. Returns every
        rank's dict (rank order)."""
        everyone = self.transport.allgather_object(mine, name=f"{self.prefix}.{what}")
        ref = everyone[0]
        problems = []
        diff_ranks = defaultdict(list)
        for r, d in enumerate(everyone):
            for key, a, b in differences(d["fingerprint"], ref["fingerprint"]):
                diff_ranks[(key, repr(a), repr(b))].append(r)
        for (key, a, b), ranks in sorted(diff_ranks.items()):
            problems.append(f"setting {key!r} is {a} on rank(s) {ranks} but {b} on rank 0")
        for r, d in enumerate(everyone):
            n_r, n_0 = set(d["numels"]), set(ref["numels"])
            if n_r != n_0:
                problems.append(f"rank {r} has parameters {sorted(n_r - n_0)} that rank 0 "
                                f"lacks and lacks {sorted(n_0 - n_r)}")
                continue
            for n in ref["numels"]:
                if d["numels"][n] != ref["numels"][n]:
                    problems.append(f"parameter {n!r} has {d['numels'][n]} elements on "
                                    f"rank {r} but {ref['numels'][n]} on rank 0")
        if more is not None:
            problems += more(everyone)
        self.raise_disagreement(problems)
        return everyone

    @staticmethod
    def raise_disagreement(problems: List[str]) -> None:
        if problems:
            raise ValueError("hvdsparse: ranks disagree at the first step: " +
                             "; ".join(problems))

    # ------------------------------------------------------------------ compress
    def compress(self, name: str, grad: torch.Tensor, param: torch.Tensor, step: int,
                 nonfinite: Optional[torch.Tensor] = None):
        """Layer ``name``'s payload from its gradient (per layer): the local update
        (momentum correction, clipping, the Adam recipe) and the inverse loss scale
        folded in."""
        kw = {}
        inv = self.grad_scale(grad.device)
        lu, comp = self.local_update, self.compressor
        with torch.no_grad():
            if lu is not None and lu.wants(name):
                # the compressor may fold the velocity update into its own pass
                # (AdaComp's compiled CPU route), the same bits as corrected()
                spec = lu.fused_spec(comp, name, grad, param.detach()) \
                    if hasattr(lu, "fused_spec") else None
                if spec is not None:
                    kw["momentum"] = spec
                    if inv is not None:
                        kw["grad_scale"] = inv
                else:
                    # DGC: clip, fold in weight decay, accumulate the velocity locally;
                    # Adam recipe: the local momentum (dense gradient in its warm-up)
                    dense = comp.policy.is_dense(name, param.shape)
                    grad, nonfinite = lu.corrected(name, grad, param, dense, inv,
                                                   nonfinite=nonfinite)
            elif inv is not None:
                kw["grad_scale"] = inv
            if lu is not None and lu.sends_dense(name):      # Adam recipe warm-up: exact
                payload = lu.dense_payload(name, grad)
                payload.nonfinite = nonfinite
                return payload
            # the local update's counter, if any, collects the compressor's count too
            return comp.compress(name, grad, step, param=param.detach(), nonfinite=nonfinite,
                                 **kw)

    def compress_absent(self, name: str, param: torch.Tensor, step: int,
                        nonfinite: Optional[torch.Tensor] = None):
        """Payload of a layer without a gradient this step: its wire layout,
        contributing zero, residual and compressor state untouched. Its count is 0, like
        the untouched ``nonfinite`` counter, which it carries when given (so the step's
        row stays one tensor: ``NonFinite.row``)."""
        param = param.detach()
        with torch.no_grad():
            payload = self.compressor.compress_absent(name, param, step, param=param)
        if nonfinite is not None:
            payload.nonfinite = nonfinite
        return payload

    def zero_fills(self, param: torch.Tensor) -> bool:
        """Whether an absent trainable layer is compressed as a zero gradient instead
        (the Adam recipe: a zero gradient, as Horovod's fill)."""
        lu = self.local_update
        return lu is not None and lu.zero_fills_absent and param.requires_grad

    def may_bucket(self, grad: torch.Tensor) -> bool:
        """Whether a layer with this gradient may take the bucket path (so its door lets
        it wait for the rest of its bucket; :meth:`compress_group` decides per layer)."""
        return self.bucket_path and bucket.takes(grad, self.compressor)

    def compress_group(self, layers: Sequence[LayerInput], step: int,
                       batches: Optional[list] = None) -> list:
        """Payloads of ``layers`` (in their order): the layers the bucket path takes
        (grouped by gradient dtype, value encoding and rounds) in a fixed number of
        launches per group, the others one by one (:meth:`compress`), absent ones by
        :meth:`compress_absent`. ``batches`` collects the bucket path's
        :class:`~hvdsparse.compressors.bucket.BucketBatch` es for :meth:`feed_back`'s
        masking."""
        out: list = [None] * len(layers)
        groups: Dict[tuple, tuple] = {}
        lu, comp = self.local_update, self.compressor
        with torch.no_grad():
            made, nfs = self._own_steps(layers) if self.bucket_path else ({}, {})
            for i, lay in enumerate(layers):
                if lay.grad is None:
                    out[i] = self.compress_absent(lay.name, lay.param, step, lay.nonfinite)
                    continue
                x = made.get(lay.name)
                if x is not None:
                    # the Adam recipe's update-wire step, already made: the compressor's
                    # whole input (the per-layer path after AdamRecipe.corrected)
                    nf = nfs[lay.name]
                    planned = bucket.plan_layer(comp, None, lay.name, x, lay.param.detach(),
                                                step, clean_input=True)
                    if planned is None:
                        out[i] = comp.compress(lay.name, x, step, param=lay.param.detach(),
                                               nonfinite=nf)
                        continue
                    grad = x
                else:
                    planned = bucket.plan_layer(comp, lu, lay.name, lay.grad,
                                                lay.param.detach(), step) \
                        if self.bucket_path else None
                    if planned is None:
                        out[i] = self.compress(lay.name, lay.grad, lay.param, step,
                                               lay.nonfinite)
                        continue
                    nf = lay.nonfinite if lay.nonfinite is not None else \
                        torch.zeros(1, dtype=torch.int32, device=lay.grad.device)
                    grad = lay.grad
                mspec, plan = planned
                item = bucket.BucketItem(lay.name, grad, lay.param.detach(), nf, mspec)
                # made inputs are scaled already: their own groups, no loss scale
                key = (x is not None,) + tuple(bucket.group_key(plan, item))
                items, plans, slots = groups.setdefault(key, ([], [], []))
                items.append(item)
                plans.append(plan)
                slots.append(i)
            for key, (items, plans, slots) in groups.items():
                gs = None if key[0] else self.grad_scale(items[0].grad.device)
                pays, batch = bucket.compress_bucket(comp, items, plans, step, grad_scale=gs)
                if batches is not None:
                    batches.append(batch)
                for it, i in zip(items, slots):
                    out[i] = pays[it.name]
        return out

    def _own_steps(self, layers: Sequence[LayerInput]):
        """The Adam recipe's update-wire steps of ``layers`` that the bucket path can make
        (:meth:`AdamRecipe.bucket_own_step`), made together (``hvdsparse/adam_bucket.py``):
        ``(name -> x, name -> non-finite counter)``; empty for any other local update."""
        lu = self.local_update
        if lu is None or not hasattr(lu, "bucket_own_step"):
            return {}, {}
        rows = []
        for lay in layers:
            if lay.grad is None:
                continue
            got = lu.bucket_own_step(lay.name, lay.grad, lay.param.detach())
            if got is None:
                continue
            nf = lay.nonfinite if lay.nonfinite is not None else \
                torch.zeros(1, dtype=torch.int32, device=lay.grad.device)
            rows.append(adam_bucket.OwnStepRow(lay.name, lay.grad, lay.param.detach(), nf,
                                               got))
        if not rows:
            return {}, {}
        xs = adam_bucket.own_steps(lu, rows, self.grad_scale(rows[0].grad.device))
        return xs, {r.name: r.nonfinite for r in rows}

    # ------------------------------------------------------------------ exchange
    def history(self, names: Sequence[str]) -> BucketHistory:
        """The cost model's history of the bucket holding layers ``names`` (keyed by the
        names, so a new bucket layout starts its own), restored from a checkpoint when
        one was loaded for it."""
        key = tuple(names)
        h = self._histories.get(key)
        if h is None:
            h = self._histories[key] = BucketHistory()
            h.load(saved_figures(self._saved_histories.pop(key, None)))
        return h

    def history_state(self) -> dict:
        """Every bucket's history as plain data (a host read: checkpoints), keyed by its
        layer names joined by ``"\\x1f"``; loaded ones not yet used included."""
        out = {"\x1f".join(k): v for k, v in self._saved_histories.items()}
        out.update({"\x1f".join(k): h.state() for k, h in self._histories.items()
                    if h.later})
        return out

    def load_history_state(self, saved: dict) -> None:
        """Replace every bucket's history by ``saved`` (:meth:`history_state`'s form);
        a bucket ``saved`` does not hold starts without figures."""
        self._saved_histories = {tuple(k.split("\x1f")): v for k, v in saved.items()}
        for key, h in self._histories.items():
            h.load(saved_figures(self._saved_histories.pop(key, None)))

    def strategy(self, history: BucketHistory, numel: int, payloads) -> str:
        """The exchange for a bucket of ``numel`` elements carrying ``payloads``: the
        fixed one, or ``auto``'s choice from rank-independent figures (sizes, and the
        bucket's figures from two steps back); on the device (CUDA / Triton) code path
        only among the strategies the host can size without reading the device
        (``cost_model.auto_strategies``)."""
        st = self.settings
        if st.exchange != "auto":
            return st.exchange
        count = next((s.count for p in payloads for s in p.segments), None)
        allowed = cost_model.auto_strategies(count is not None and ops.use_triton(count))
        return cost_model.choose(self.figures(history, numel, payloads), allowed=allowed,
                                 alpha_bytes=st.alpha_bytes)

    def figures(self, history: BucketHistory, numel: int, payloads
                ) -> "cost_model.BucketFigures":
        """What ``auto`` decides from: the bucket's sizes and its figures from two steps
        back (``cost_model.costs`` of it: every strategy's predicted bytes)."""
        st = self.settings
        prev = history.figures()
        return cost_model.BucketFigures(
            world_size=self.world_size, numel=numel,
            wire_nbytes=codec.encoded_nbytes(payloads), capacity=bucket_capacity(payloads),
            sparse_value_bytes=torch.finfo(pair_dtype(payloads)).bits // 8,
            dense_value_bytes=torch.finfo(st.dense_dtype).bits // 8,
            split_dense_bits=st.split_dense_bits, quant_bucket=st.quant_bucket,
            prev_pairs=prev.get("pairs"), prev_reduced=prev.get("reduced"),
            prev_capacity=prev.get("capacity"))

    def context(self, device, step: int, buffers) -> ExchangeContext:
        return ExchangeContext.from_settings(
            self.settings, device=device, rank=self.rank, world_size=self.world_size,
            prefix=self.prefix, step=step, error_flag_for=self.reads.flag_for,
            want_figures=self.record_figures, buffers=buffers,
            transport=self.transport, readouts=self.reads.readouts,
            graphs=device_graphs.graphs_of(self))

    def launch(self, strategy: str, spec: BucketSpec, payloads, device, step: int,
               buffers, nonfinite_row=None):
        """Start the bucket's exchange (``Pending``; its first collectives run while the
        caller goes on); ``nonfinite_row``: this rank's counts for the bucket's layers,
        carried in the message where the strategy can (``Pending.carries_nonfinite``;
        the rest go through :meth:`NonFinitePolicy.gather_rest`)."""
        return launch_exchange(strategy, spec, payloads, self.context(device, step, buffers),
                               nonfinite_row)

    @staticmethod
    def finish(pend, history: BucketHistory, payloads) -> torch.Tensor:
        """Wait for the bucket's exchange; returns the rank-order sum (the buffer is
        reused at the bucket's next launch) and records the exchange's figures."""
        total = pend.finish()
        if pend.deferred_figures is not None:
            history.record(TaggedFigures(pend.deferred_figures, bucket_capacity(payloads)))
        return total

    def step_stats(self, step: int, finished, *, compress_s: float, wait_s: float,
                   decode_s: float, skipped) -> dict:
        """The step's statistics (``stats()["last"]``) from ``finished``: the step's
        ``(BucketSpec, Pending)`` pairs in launch order. Bytes are per-rank link bytes by
        strategy; ``dense_allreduce_bytes`` is what a ring allreduce of the same elements
        would move."""
        sent, recv, buckets = defaultdict(int), defaultdict(int), []
        for b, (spec, pend) in enumerate(finished):
            sent[pend.strategy] += pend.sent_bytes
            recv[pend.strategy] += pend.recv_bytes
            buckets.append(dict(id=b, layers=list(spec.names), numel=spec.numel,
                                strategy=pend.strategy, sent_bytes=pend.sent_bytes,
                                recv_bytes=pend.recv_bytes, figures=dict(pend.figures)))
        n_total = sum(spec.numel for spec, _ in finished)
        return dict(step=step, world_size=self.world_size, buckets=buckets,
                    strategies=[bk["strategy"] for bk in buckets],
                    bytes_sent=dict(sent), bytes_recv=dict(recv),
                    bytes_sent_total=int(sum(sent.values())),
                    bytes_recv_total=int(sum(recv.values())),
                    dense_allreduce_bytes=int(cost_model.dense_allreduce_bytes(
                        self.world_size, n_total)),
                    time_compress_s=compress_s, time_wait_s=wait_s, time_decode_s=decode_s,
                    skipped=skipped)

    def feed_back(self, names: Sequence[str], payloads, spec: BucketSpec,
                  undelivered: Optional[torch.Tensor], batches: Sequence, step: int) -> None:
        """What the exchange sent but did not deliver (``Pending.undelivered``:
        ``balanced``'s phase-2 truncation) goes back into each layer's residual, device
        ops only; then DGC's momentum-factor masking ``u[sent and delivered] = 0``. Runs
        before the non-finite policy, so a skipped step's rollback undoes it with the
        rest of the step. Only a layer with ``error_feedback=False`` cannot take its
        share back (``Compressor.take_back``): it stays lost (``p2_dropped_energy``)."""
        lu, comp = self.local_update, self.compressor
        views = spec.views(undelivered) if undelivered is not None else [None] * len(names)
        masked = set()
        with torch.no_grad():
            # the bucket path's layers: one launch per batch (unless a layer keeps its
            # velocity at this step, or the exchange gave something back)
            for batch in batches:
                if lu is not None and undelivered is None and all(
                        lu.masks_now(n, comp.warmup_density(n, step))
                        for n in batch.momentum_names):
                    bucket.mask_bucket(batch)
                    masked.update(batch.momentum_names)
            if undelivered is not None:
                comp.take_back_many(names, views)
            for name, payload, back in zip(names, payloads, views):
                if lu is not None and name in lu.u and name not in masked:
                    lu.mask(name, payload, back, comp.warmup_density(name, step))

    # ------------------------------------------------------------------ after the exchange
    def after_exchange(self, name: str, g: torch.Tensor, param: torch.Tensor,
                       step: int) -> None:
        """Hand the exchanged average ``g`` (unscaled units) of layer ``name`` to the
        compressor (Slim-DP's core choice reads it)."""
        if self._after_takes_param:
            self.compressor.after_exchange(name, g, step, param=param.detach())
        else:
            self.compressor.after_exchange(name, g, step)

    def dense_momentum_bucket(self, names: Sequence[str], gs: Sequence[torch.Tensor],
                              params: Sequence[torch.Tensor],
                              inv: Optional[torch.Tensor] = None) -> list:
        """DGC momentum correction for the layers sent dense by policy: ordinary momentum
        on the exchanged average. ``out[i]`` is layer ``names[i]``'s corrected gradient
        (in ``gs[i]``'s units; read it, never write into it: it may be the velocity
        itself), None for a layer without such momentum. ``gs``: the exchanged averages
        (left as they are), in GradScaler's scaled units when ``inv`` = 1 / scale is
        given; the velocity buffers stay in unscaled units (a buffer in scaled units
        would mix scales when the scale changes, and weight decay would be divided by
        it). A few multi-tensor ops per call (:meth:`LocalUpdate.dense_momentum_many`)."""
        out: list = [None] * len(names)
        lu = self.local_update
        if lu is None or not lu.momentum_correction:
            return out
        pol = self.compressor.policy
        sel = [i for i, (n, p) in enumerate(zip(names, params)) if pol.is_dense(n, p.shape)]
        if not sel:
            return out
        views = [gs[i] for i in sel]
        if inv is not None:              # the buffers are in unscaled units
            views = torch._foreach_mul(views, inv)
        res = lu.dense_momentum_many([names[i] for i in sel], views, [params[i] for i in sel])
        if inv is not None:
            res = [None if r is None else r / inv for r in res]
        for i, r in zip(sel, res):
            out[i] = r
        return out

    # ------------------------------------------------------------------ deferred reads
    def send_reads(self, step: int) -> None:
        """End of the step's device work: :meth:`DeferredReads.send_reads`."""
        self.reads.send_reads(step)

    def check_deferred(self) -> None:
        """Act on earlier steps' device flags: :meth:`DeferredReads.check_deferred`."""
        self.reads.check_deferred()


class DeferredReads:
    """Device values the host must act on, read one step late so that reading never
    stalls the stream: the unvalidated decode's error flag (:meth:`flag_for`) and the
    non-finite table under ``raise``. They join the step's
    :class:`~hvdsparse.exchange.base.ReadoutBatch` (with every bucket's cost-model
    figures), which leaves for pinned host memory in one copy at the step's end
    (:meth:`send_reads`); :meth:`check_deferred` reads them at the next step.

    ``hint``: the door's advice, appended to the non-finite error."""

    def __init__(self):
        self.readouts = ReadoutBatch()   # the step's device reads, one copy per step
        self.hint = ""
        self._error_flag: Optional[torch.Tensor] = None
        self._kept_flags: Dict[torch.device, torch.Tensor] = {}
        self._pending_reads: List[tuple] = []

    def flag_for(self, device) -> torch.Tensor:
        """The step's decode error flag (int32[1] on ``device``, zeroed on first use).
        One tensor per device for every step: :meth:`send_reads` queues its copy to the
        host before the next step zeroes it (stream order), and a captured decode
        (:mod:`hvdsparse.device_graphs`) finds it at the same address."""
        if self._error_flag is None:
            dev = torch.device(device)
            kept = self._kept_flags.get(dev)
            if kept is None:
                kept = self._kept_flags[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
            else:
                kept.zero_()
            self._error_flag = kept
        return self._error_flag

    def defer_read(self, kind: str, step: int, values: torch.Tensor, names=None) -> None:
        """Copy device ``values`` to pinned host memory now; act on them at the next
        :meth:`check_deferred` (when reading no longer stalls the stream)."""
        self._pending_reads.append((kind, step, tuple(values.shape),
                                    self.readouts.add(values), names))

    def send_reads(self, step: int) -> None:
        """End of the step's device work: the decode flag (unvalidated path) joins the
        step's reads, and all of them -- the flag, the non-finite table, every bucket's
        cost-model figures -- leave for pinned host memory in one copy
        (:class:`~hvdsparse.exchange.base.ReadoutBatch`), read at the next step or
        later."""
        if self._error_flag is not None:
            self.defer_read("error", step, self._error_flag)
            self._error_flag = None
        self.readouts.flush()

    def check_deferred(self) -> None:
        """Act on earlier steps' device flags: a decode error raises ``RuntimeError``,
        a non-finite table under ``raise`` ``FloatingPointError``."""
        reads, self._pending_reads = self._pending_reads, []
        for kind, step, shape, reader, names in reads:
            values = np.asarray(reader.get(), dtype=np.int64).reshape(shape)
            if kind == "error":
                code = int(values[0])
                if code:
                    raise RuntimeError(
                        f"hvdsparse: a message received at step {step} carried "
                        f"{codec.describe_error(code)}; those entries were skipped. The "
                        f"ranks disagree on the bucket layout or a message was corrupted "
                        f"(rerun with validate=True to find the rank and segment)")
            elif kind == "nonfinite":
                raise_nonfinite(values.tolist(), names, step, self.hint)
