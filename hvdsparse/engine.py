"""The step engine: what happens to one bucket of gradients in one step, written once for
both front doors (:mod:`hvdsparse.scheduler` under ``horovodrun``, :mod:`hvdsparse.ddp`
under ``torchrun``).

A front door knows *when* gradients are ready and *where* the result goes (Horovod:
accumulate-grad hooks, a bucket plan, ``p.grad``; DDP: ``GradBucket`` s and futures). The
engine knows *what* a step does with a bucket, in this order:

1. **compress** (:meth:`StepEngine.compress_group`): every layer of the bucket becomes a
   :class:`~hvdsparse.payload.LayerPayload`. Layers the bucket path takes
   (``compressors/topk_bucket.py``: a fixed number of launches per bucket) are compressed
   together; the others one by one (:meth:`StepEngine.compress`), with the local update
   (DGC momentum correction / clipping, the Adam recipe) and the loss scale folded in. A
   layer without a gradient contributes an *absent* payload (:meth:`compress_absent`).
2. **choose** (:meth:`StepEngine.strategy`): the exchange, fixed or ``auto`` by the cost
   model from sizes and from the figures of this bucket's exchange two steps back
   (:class:`BucketHistory`: read without stalling, the same on every rank).
3. **launch** (:meth:`StepEngine.launch`) through the door's transport, and **finish**
   (:meth:`StepEngine.finish`): the rank-order sum of every rank's decoded payloads.
4. **feed back** (:meth:`StepEngine.feed_back`): what the exchange sent but did not
   deliver returns to the residuals; DGC's momentum-factor masking.
5. **non-finite policy** (:class:`NonFinite`): one per-layer count table, the same on every
   rank; ``raise`` / ``skip`` / ``propagate``.
6. **commit or roll back** (:meth:`StepEngine.commit` / :meth:`StepEngine.rollback`) the
   compressor's and the local update's step.

and, once, the **first-step agreement** (:meth:`StepEngine.agree`): every rank's settings
fingerprint and parameter sizes compared with rank 0's; a difference raises the same
``ValueError`` on every rank, naming the setting, parameter and ranks.

Host synchronisation: none in steps 1-4 (host integers only; the cost model's figures
are those of two steps back, whose copy completed before the previous step's
collectives could). Device flags the host must act on (the unvalidated decode's error
flag, the non-finite table under ``raise``) are copied to pinned memory and read at the
next step (:meth:`StepEngine.check_deferred`), never waited for in the step that made
them.
"""
from __future__ import annotations

import inspect
from collections import defaultdict, deque
from typing import Dict, List, NamedTuple, Optional, Sequence

import numpy as np
import torch

from . import codec
from .compressors import topk_bucket
from .compressors.base import Compressor, inverse_loss_scale
from .exchange import BucketSpec, ExchangeContext, HostReadout, cost_model
from .exchange import launch as launch_exchange
from .exchange.base import TaggedFigures, bucket_capacity
from .exchange.split import pair_dtype
from .settings import ExchangeSettings, differences

__all__ = ["StepEngine", "BucketHistory", "LayerInput", "plan_buckets", "NonFinite",
           "raise_nonfinite", "bind_compressor",
           "make_local_update"]


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


class _Resolved:
    """Figures restored from a checkpoint: already on the host."""
    __slots__ = ("value",)

    def __init__(self, value: dict):
        self.value = dict(value)

    def get(self) -> dict:
        return dict(self.value)


class BucketHistory:
    """The cost model's figures of a bucket's last two exchanges (``DeferredFigures``
    tagged with the bucket's capacity). ``auto`` at step t reads those of step t-2: their
    copy to the host completed before step t-1's collectives could, so reading never
    stalls, and every rank reads the same values (never "whatever has arrived"), on CPU
    and CUDA alike."""
    __slots__ = ("later",)

    def __init__(self):
        self.later = deque(maxlen=2)

    def figures(self) -> dict:
        return self.later[0].get() if len(self.later) == 2 else {}

    def record(self, figures) -> None:
        self.later.append(figures)

    def state(self) -> list:
        """The figures held, oldest first, as plain dicts (a host read: checkpoints)."""
        return [f.get() for f in self.later]

    def load(self, figures: list) -> None:
        self.later.clear()
        for f in figures:
            self.later.append(_Resolved(f))


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


def bind_compressor(compressor, transport, prefix: str, owner) -> None:
    """Bind ``compressor`` to this rank and to its one owner (a second owner raises:
    residuals are keyed by layer name), with a blocking broadcast from rank 0 through
    ``transport`` (Slim-DP's core) for compressors that take one."""
    params = inspect.signature(compressor.bind).parameters
    kw = {}
    if "broadcast" in params:
        def broadcast(tensor, name):
            return transport.broadcast(tensor, 0, name=f"{prefix}.bcast.{name}")
        kw["broadcast"] = broadcast
    if "owner" in params:
        kw["owner"] = owner
    compressor.bind(transport.rank(), transport.size(), **kw)


def make_local_update(optimizer, params: Dict[str, torch.Tensor], world_size: int,
                      compressor, *, adam=None, momentum_correction=False,
                      clip_grad_norm=None, masking=False):
    """The local update both doors run between the gradient and the compressor: the Adam
    recipe (``adam``: resolved :class:`hvdsparse.adam.AdamSettings`), or DGC's momentum
    correction / local clipping (:class:`hvdsparse.momentum.LocalUpdate`), or None.
    ``params``: the optimised parameters by name."""
    if adam is not None:
        from .adam import AdamRecipe
        shapes = {n: p.shape for n, p in params.items()}
        pol = compressor.policy
        return AdamRecipe(optimizer, params, world_size,
                          lambda n: not pol.is_dense(n, shapes[n]), warmup=adam.warmup,
                          refresh=adam.refresh, refresh_start=adam.refresh_start,
                          clip_grad_norm=clip_grad_norm, residual=compressor.residual)
    if momentum_correction or clip_grad_norm is not None:
        from .momentum import LocalUpdate
        return LocalUpdate(optimizer, params, world_size,
                           momentum_correction=momentum_correction,
                           clip_grad_norm=clip_grad_norm, masking=masking)
    return None


def raise_nonfinite(table, names: Sequence[str], step: int, hint: str = "") -> None:
    """``table``: host [P][nlayers] counts of non-finite gradient elements; raises
    ``FloatingPointError`` naming the layers and ranks when any is non-zero."""
    hits = [(names[j], r, int(row[j])) for r, row in enumerate(table)
            for j in range(len(names)) if row[j]]
    if hits:
        desc = "; ".join(f"layer {n!r} on rank {r}: {c} element(s)" for n, r, c in hits[:8])
        raise FloatingPointError(
            f"hvdsparse: non-finite gradient (NaN/Inf) at step {step}: {desc}"
            f"{' ...' if len(hits) > 8 else ''}. Nothing of it entered a residual.{hint}")


class NonFinite:
    """The non-finite policy's table: every rank's per-layer counts of non-finite gradient
    elements (``payload.nonfinite``), gathered in one small collective, so that every rank
    sees the same [P, nlayers] table and acts identically."""

    @staticmethod
    def row(payloads, device) -> torch.Tensor:
        """This rank's [1, nlayers] int32 counts (a layer without a counter counts 0)."""
        zero = torch.zeros((), dtype=torch.int32, device=device)
        return torch.stack([(p.nonfinite if p.nonfinite is not None else zero)
                            .reshape(()).to(torch.int32) for p in payloads]).view(1, -1)


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
        self.nonfinite = nonfinite
        self.bucket_path = topk_bucket.enabled(compressor, local_update)
        self._inv: Optional[torch.Tensor] = None
        self._error_flag: Optional[torch.Tensor] = None
        self._pending_reads: List[tuple] = []
        self.hint = ""                   # appended to the non-finite error (door's advice)

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

    def compress_absent(self, name: str, param: torch.Tensor, step: int):
        """Payload of a layer without a gradient this step: its wire layout,
        contributing zero, residual and compressor state untouched."""
        param = param.detach()
        with torch.no_grad():
            return self.compressor.compress_absent(name, param, step, param=param)

    def zero_fills(self, param: torch.Tensor) -> bool:
        """Whether an absent trainable layer is compressed as a zero gradient instead
        (the Adam recipe: a zero gradient, as Horovod's fill)."""
        lu = self.local_update
        return lu is not None and lu.zero_fills_absent and param.requires_grad

    def may_bucket(self, grad: torch.Tensor) -> bool:
        """Whether a layer with this gradient may take the bucket path (so its door lets
        it wait for the rest of its bucket; :meth:`compress_group` decides per layer)."""
        return self.bucket_path and topk_bucket.takes(grad)

    def compress_group(self, layers: Sequence[LayerInput], step: int,
                       batches: Optional[list] = None) -> list:
        """Payloads of ``layers`` (in their order): the layers the bucket path takes
        (grouped by gradient dtype, value encoding and rounds) in a fixed number of
        launches per group, the others one by one (:meth:`compress`), absent ones by
        :meth:`compress_absent`. ``batches`` collects the bucket path's
        :class:`~topk_bucket.BucketBatch` es for :meth:`feed_back`'s masking."""
        out: list = [None] * len(layers)
        groups: Dict[tuple, tuple] = {}
        lu, comp = self.local_update, self.compressor
        with torch.no_grad():
            for i, lay in enumerate(layers):
                if lay.grad is None:
                    out[i] = self.compress_absent(lay.name, lay.param, step)
                    continue
                planned = topk_bucket.plan_layer(comp, lu, lay.name, lay.grad,
                                                 lay.param.detach(), step) \
                    if self.bucket_path else None
                if planned is None:
                    out[i] = self.compress(lay.name, lay.grad, lay.param, step,
                                           lay.nonfinite)
                    continue
                mspec, plan = planned
                nf = lay.nonfinite if lay.nonfinite is not None else \
                    torch.zeros(1, dtype=torch.int32, device=lay.grad.device)
                item = topk_bucket.BucketItem(lay.name, lay.grad, lay.param.detach(), nf,
                                              mspec)
                items, plans, slots = groups.setdefault(topk_bucket.group_key(plan, item),
                                                        ([], [], []))
                items.append(item)
                plans.append(plan)
                slots.append(i)
            for items, plans, slots in groups.values():
                pays, batch = topk_bucket.compress_bucket(
                    comp, items, plans, step, grad_scale=self.grad_scale(items[0].grad.device))
                if batches is not None:
                    batches.append(batch)
                for it, i in zip(items, slots):
                    out[i] = pays[it.name]
        return out

    # ------------------------------------------------------------------ exchange
    def strategy(self, history: BucketHistory, numel: int, payloads) -> str:
        """The exchange for a bucket of ``numel`` elements carrying ``payloads``: the
        fixed one, or ``auto``'s choice from rank-independent figures (sizes, and the
        bucket's figures from two steps back)."""
        st = self.settings
        if st.exchange != "auto":
            return st.exchange
        prev = history.figures()
        figs = cost_model.BucketFigures(
            world_size=self.world_size, numel=numel,
            wire_nbytes=codec.encoded_nbytes(payloads), capacity=bucket_capacity(payloads),
            sparse_value_bytes=torch.finfo(pair_dtype(payloads)).bits // 8,
            dense_value_bytes=torch.finfo(st.dense_dtype).bits // 8,
            split_dense_bits=st.split_dense_bits, quant_bucket=st.quant_bucket,
            prev_pairs=prev.get("pairs"), prev_reduced=prev.get("reduced"),
            prev_capacity=prev.get("capacity"))
        return cost_model.choose(figs, alpha_bytes=st.alpha_bytes)

    def _flag_for(self, device) -> torch.Tensor:
        if self._error_flag is None:
            self._error_flag = torch.zeros(1, dtype=torch.int32, device=device)
        return self._error_flag

    def context(self, device, step: int, buffers) -> ExchangeContext:
        return ExchangeContext.from_settings(
            self.settings, device=device, rank=self.rank, world_size=self.world_size,
            prefix=self.prefix, step=step, error_flag_for=self._flag_for,
            want_figures=self.settings.exchange == "auto", buffers=buffers,
            transport=self.transport)

    def launch(self, strategy: str, spec: BucketSpec, payloads, device, step: int,
               buffers):
        """Start the bucket's exchange (``Pending``; its first collectives run while the
        caller goes on)."""
        return launch_exchange(strategy, spec, payloads, self.context(device, step, buffers))

    @staticmethod
    def finish(pend, history: BucketHistory, payloads) -> torch.Tensor:
        """Wait for the bucket's exchange; returns the rank-order sum (the buffer is
        reused at the bucket's next launch) and records the exchange's figures."""
        total = pend.finish()
        if pend.deferred_figures is not None:
            history.record(TaggedFigures(pend.deferred_figures, bucket_capacity(payloads)))
        return total

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
                    topk_bucket.mask_bucket(batch)
                    masked.update(batch.momentum_names)
            for name, payload, back in zip(names, payloads, views):
                if back is not None:
                    comp.take_back(name, back)
                if lu is not None and name in lu.u and name not in masked:
                    lu.mask(name, payload, back, comp.warmup_density(name, step))

    # ------------------------------------------------------------------ non-finite
    def gather_nonfinite(self, row: torch.Tensor, *, wait: bool = True):
        """Every rank's [1, nlayers] row -> the [P, nlayers] table (rank order); with
        ``wait=False`` the handle (:meth:`finish_nonfinite`)."""
        h = self.transport.allgather_async(row, name=f"{self.prefix}.nonfinite")
        return self.transport.synchronize(h) if wait else h

    def finish_nonfinite(self, handle):
        return None if handle is None else self.transport.synchronize(handle)

    def nonfinite_flags(self, table: torch.Tensor, names: Sequence[str], step: int,
                        ) -> Optional[torch.Tensor]:
        """Apply ``raise`` / ``propagate`` to the [P, nlayers] ``table``. CPU: ``raise``
        raises now; CUDA: the table is read at the next step without a stall, and
        meanwhile (as under ``propagate``) the flagged layers are marked. Returns the
        per-layer "non-finite on some rank" vector the caller marks NaN into its buckets,
        or None when nothing is to be marked."""
        if self.nonfinite == "raise":
            if table.device.type == "cpu":
                raise_nonfinite(table.numpy().tolist(), names, step, self.hint)
            else:
                self.defer_read("nonfinite", step, table, list(names))
        if self.nonfinite == "propagate" or table.device.type != "cpu":
            return table.sum(0) > 0
        return None

    # ------------------------------------------------------------------ deferred reads
    def defer_read(self, kind: str, step: int, values: torch.Tensor, names=None) -> None:
        """Copy device ``values`` to pinned host memory now; act on them at the next
        :meth:`check_deferred` (when reading no longer stalls the stream)."""
        self._pending_reads.append((kind, step, tuple(values.shape), HostReadout(values),
                                    names))

    def retire_error_flag(self, step: int) -> None:
        """This step's decode flag (unvalidated path) is read at the next step."""
        if self._error_flag is not None:
            self.defer_read("error", step, self._error_flag)
            self._error_flag = None

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
