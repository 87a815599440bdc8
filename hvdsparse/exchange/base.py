"""What every exchange strategy shares: the bucket description, the launch context and
the in-flight handle.

A *bucket* is an ordered list of layers whose payloads travel in one collective (or,
for ``split``, two alltoalls: pairs to their owners, reduced ranges to everyone; for
``balanced``, an alltoall of pairs and an allgather of the owners' selections). Its layers are laid end to end
in a flat fp32 vector of ``numel`` elements (layer ``j`` at ``offsets[j]``); every
strategy returns the **sum over all ranks** of the ranks' decoded payloads in that
flat layout. Averaging (``op=Average``), ``after_exchange`` and writing ``p.grad``
happen in the scheduler.

Collectives go through ``ctx.comm()`` (:mod:`hvdsparse.transport`: Horovod by default,
``torch.distributed`` for the DDP hook) and are named
``<prefix>.b<bucket>.<strategy>[.<phase>]``: Horovod matches operations by name, so
buckets may complete in any order, and the names are stable from step to step
(Horovod's response cache hits when names and shapes repeat). An ordered transport
matches by issue order instead; the strategies then issue collectives only from
``launch()`` and ``finish()``, which callers reach in bucket order on every rank.

Host synchronisation (CUDA)
---------------------------
With ``validate=False`` (the CUDA default) no strategy reads a device value with a
blocking call (``.item()``, ``.tolist()``, ``nonzero``, a H2D copy of a Python list);
``validate=True`` checks received messages on the host, by design. Figures that the host needs *later* (the
cost model's pair counts) are computed on the device and handed to a
:class:`HostReadout`: one non-blocking copy into pinned host memory plus a CUDA event
(unvalidated, all of a step's at once: :class:`ReadoutBatch`).
The host reads them once the event has completed; :class:`DeferredFigures` wraps this
for the cost model. The exceptions are ``split`` and ``balanced``, whose variable-size alltoalls need
host integers (see :mod:`.split`, :mod:`.balanced`: one read per bucket for balanced): it reads them through the same readouts and waits on
their event only when the next phase cannot start otherwise.

Buffers
-------
Flat bucket vectors, encode buffers and small index tensors are reused from step to
step (:class:`BufferPool`, keyed by optimizer prefix, kind, bucket id, numel, dtype and
device). Consequence for the caller: **the tensor returned by ``Pending.finish()`` is
valid until the next launch of the same bucket** (the scheduler copies it into
``p.grad`` in the same step).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..payload import LayerPayload
from ..row_tables import RowTables


@dataclass
class BucketSpec:
    """Membership and flat layout of one bucket (identical on all ranks)."""

    bucket_id: int
    names: List[str]
    numels: List[int]
    offsets: List[int]
    numel: int

    @classmethod
    def build(cls, bucket_id: int, names: Sequence[str], numels: Sequence[int]):
        offsets, o = [], 0
        for n in numels:
            offsets.append(o)
            o += int(n)
        return cls(int(bucket_id), list(names), [int(n) for n in numels], offsets, o)

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Per-layer 1-D views into a flat bucket vector."""
        return [flat[o:o + n] for o, n in zip(self.offsets, self.numels)]

    def nonempty_layers(self) -> List[int]:
        """Positions (in ``names``) of the layers with at least one element."""
        return [j for j, n in enumerate(self.numels) if n > 0]

    def first_elements(self, device) -> Optional[torch.Tensor]:
        """int64 bucket offsets of the non-empty layers' first elements on ``device``
        (for :meth:`mark_nan`; build once per bucket layout), None if all are empty."""
        keep = self.nonempty_layers()
        if not keep:
            return None
        return torch.tensor([self.offsets[j] for j in keep], dtype=torch.long,
                            device=device)

    def mark_nan(self, flat: torch.Tensor, flags: torch.Tensor,
                 first: Optional[torch.Tensor]) -> None:
        """Element 0 of every layer whose ``flags`` entry (bool, one per layer in
        ``names`` order) is set becomes NaN in the flat bucket vector ``flat``, as a
        dense allreduce of a NaN would make it; empty layers have no element to mark.
        ``first``: :meth:`first_elements` on ``flat``'s device. Device ops only."""
        if first is None:
            return
        keep = self.nonempty_layers()
        f = flags.to(flat.device)
        if len(keep) != len(self.numels):
            f = f[torch.tensor(keep, dtype=torch.long, device=flat.device)]
        flat.index_copy_(0, first, torch.where(
            f, torch.full_like(flat[first], float("nan")), flat[first]))


@dataclass
class ExchangeContext:
    """Launch-time settings a strategy needs (all identical on every rank except rank)."""

    rank: int
    world_size: int
    prefix: str                      # collective name prefix, e.g. "hvdsparse.o0"
    step: int = 0
    validate: bool = True            # host-validate received messages (CPU default)
    dense_dtype: torch.dtype = torch.float32   # dense strategy's allreduce dtype
    gradient_predivide_factor: float = 1.0
    split_dense_bits: int = 0        # 0 = fp32 dense ranges in split phase 2; 8/4/2
    quant_bucket: int = 512
    want_figures: bool = False       # record counts for the auto cost model
    # With validate=False (CUDA) the decode kernels skip out-of-range writes and set
    # this int32[1] device flag instead of raising; the scheduler checks it one step
    # later, when reading it no longer stalls the stream (see Scheduler.synchronize).
    error_flag: Optional[torch.Tensor] = None
    # Reused buffers; None = the module-level pool (per prefix, see BufferPool.default).
    # A scheduler may pass its own pool to tie the buffers' lifetime to the optimizer.
    buffers: Optional["BufferPool"] = None
    # Who moves the bytes (hvdsparse.transport.Transport); None = Horovod. An *ordered*
    # transport (torch.distributed) matches collectives by issue order, so strategies
    # then issue them only at launch() / finish(), never from a timing-dependent poll.
    transport: Optional[Any] = None
    # The step's device reads for the host (ReadoutBatch), flushed by the caller at the
    # step's end; None = one HostReadout per bucket.
    readouts: Optional["ReadoutBatch"] = None
    # The strategies' captured device segments (hvdsparse.device_graphs.SegmentGraphs,
    # kept by the step engine across steps: encodes, decodes, own_dense, the dense
    # strategy's row copy and reads, the per-owner counts) where the cuda_graphs setting
    # is on and messages are not host-validated; None = eager.
    graphs: Optional[Any] = None

    @classmethod
    def from_settings(cls, settings, *, device, rank: int, world_size: int, prefix: str,
                      step: int, error_flag_for, want_figures: bool, buffers=None,
                      transport=None, readouts=None, graphs=None) -> "ExchangeContext":
        """The context both front doors build from their :class:`ExchangeSettings`:
        ``validate=None`` means host validation on CPU, the device flag on CUDA;
        ``error_flag_for(device)`` supplies that flag when it is needed."""
        validate = settings.validate if settings.validate is not None else \
            device.type == "cpu"
        return cls(rank=rank, world_size=world_size, prefix=prefix, step=step,
                   validate=validate, error_flag=None if validate else error_flag_for(device),
                   dense_dtype=settings.dense_dtype,
                   gradient_predivide_factor=settings.gradient_predivide_factor,
                   split_dense_bits=settings.split_dense_bits,
                   quant_bucket=settings.quant_bucket, want_figures=want_figures,
                   buffers=buffers, transport=transport, readouts=readouts,
                   graphs=None if validate else graphs)

    def name(self, bucket_id: int, strategy: str, phase: str = "") -> str:
        n = f"{self.prefix}.b{bucket_id}.{strategy}"
        return f"{n}.{phase}" if phase else n

    def comm(self):
        """The transport: ``transport`` or the process-wide Horovod one."""
        if self.transport is None:
            from ..transport import horovod
            self.transport = horovod()
        return self.transport

    def pool(self) -> "BufferPool":
        return self.buffers if self.buffers is not None else BufferPool.default(self.prefix)

    def buffer(self, kind: str, bucket_id: int, numel: int, dtype: torch.dtype,
               device) -> torch.Tensor:
        """A reused 1-D buffer (contents unspecified) for ``kind`` of bucket ``bucket_id``."""
        return self.pool().get(kind, bucket_id, numel, dtype, device)


@dataclass
class Pending:
    """One bucket in flight. ``finish()`` waits and returns the flat fp32 sum."""

    spec: BucketSpec
    strategy: str
    payloads: List[LayerPayload]
    ctx: ExchangeContext
    sent_bytes: int = 0              # per-rank link bytes (ring model), see stats
    recv_bytes: int = 0
    figures: Dict[str, float] = field(default_factory=dict)   # for the cost model
    wait_s: float = 0.0
    decode_s: float = 0.0
    result: Optional[torch.Tensor] = None
    #: the device-computed figures (``pairs``, ``reduced``), readable later without a
    #: stall; set by ``finish()`` when ``ctx.want_figures``. On CPU ``figures`` holds
    #: them as well, at once (reading a CPU tensor is no synchronisation).
    deferred_figures: Optional["DeferredFigures"] = None
    #: set by ``finish()`` when the strategy may deliver less than the sum (``balanced``'s
    #: phase-2 truncation): flat fp32[numel], this rank's own sent values at the
    #: coordinates that were not delivered, 0 elsewhere (summed over the ranks: the
    #: dropped part). The front doors add it into the layers' residuals (error feedback
    #: of the truncation). None: everything sent was delivered. Valid as ``result``.
    undelivered: Optional[torch.Tensor] = None
    #: whether this bucket's message carries its layers' non-finite counts (launched
    #: with a ``nonfinite_row``; ``allgather`` and ``dense``). Then ``finish()`` sets
    #: ``nonfinite``: int32 [P, len(spec.names)], every rank's counts in rank order, the
    #: same on every rank, valid as ``result``.
    carries_nonfinite: bool = False
    nonfinite: Optional[torch.Tensor] = None
    #: this rank's counts for the bucket's layers as launched (int32 [1, L]), or None
    nonfinite_row: Optional[torch.Tensor] = None

    def advance(self) -> None:
        """Non-blocking progress (multi-phase strategies start their next phase when
        the previous one completed). Default: nothing to do."""

    def finish(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _book_finish(self, t0: float, booked: float, t0b: float, t1: float) -> None:
        """Time accounting of a multi-phase ``finish()`` that started at ``t0`` (when
        ``wait_s + decode_s`` was ``booked``), ran the earlier phases until ``t0b``
        (each books its own collective wait and decode), waited for the last
        collective until ``t1`` and decoded until now. The earlier phases' time they did
        not book themselves (building and launching their messages) is decode work;
        their waits are in ``wait_s`` already and are not counted twice."""
        earlier = (t0b - t0) - (self.wait_s + self.decode_s - booked)
        self.wait_s += t1 - t0b
        self.decode_s += earlier + time.perf_counter() - t1

    def _defer_figures(self, values: torch.Tensor,
                       convert: Callable[[List[int]], Dict[str, float]]) -> None:
        """Hand device integers ``values`` (1-D) to a :class:`DeferredFigures`; on CPU
        also fill ``self.figures`` (now, or at the step's readout flush). Unvalidated
        (the device path), they join the step's :class:`ReadoutBatch`
        (``ctx.readouts``) when there is one."""
        batch = self.ctx.readouts if not self.ctx.validate else None
        cpu = values.device.type == "cpu"
        if batch is not None:
            d = DeferredFigures(batch.add(values, on_flush=(
                lambda: self.figures.update(d.get())) if cpu else None), convert)
        else:
            d = DeferredFigures(HostReadout(values), convert)
            if cpu:
                self.figures.update(d.get())
        self.deferred_figures = d


class HostReadout:
    """Device values the host needs later, copied without stalling the host.

    CUDA: ``values`` (1-D) is copied with ``non_blocking=True`` into a pinned host
    buffer (PyTorch's caching host allocator reuses those blocks) and a CUDA event is
    recorded on the current stream right after the copy. :meth:`ready` queries the
    event (never blocks); :meth:`get` waits on that event -- not on the device -- and
    reads the pinned buffer through numpy (no tensor op, so nothing else is waited for).
    CPU: the copy completes at once; ``ready()`` is always True.
    """

    __slots__ = ("device", "_host", "_event", "_values")

    def __init__(self, values: torch.Tensor):
        values = values.detach().reshape(-1)
        self.device = values.device
        self._values = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(values.device))
        else:
            self._host = values.clone()
            self._event = None

    def ready(self) -> bool:
        return self._event is None or bool(self._event.query())

    def get(self) -> List:
        """The values as Python numbers (waits on the event if not yet complete)."""
        if self._values is None:
            # a completed event is only polled: cudaEventSynchronize is called (and
            # blocks) only when the copy is still in flight
            if self._event is not None and not self._event.query():
                self._event.synchronize()
            self._values = self._host.numpy().tolist()
        return self._values


class ReadoutBatch:
    """Device integers the host needs later, gathered over one step and copied to the
    host together: :meth:`add` registers a tensor and returns its :class:`BatchedRead`;
    :meth:`flush` (once per step, at its end) concatenates every registered tensor on
    the device and hands the result to one :class:`HostReadout` -- two device ops per
    step (the concatenation, the copy) instead of one copy per bucket and flag. The
    values are cast to int64 when the registered dtypes differ.

    Callbacks given to :meth:`add` run right after the flush when the data lives in
    host memory (the copy has completed then), so CPU callers can fill their figures in
    the same step."""

    __slots__ = ("_items",)

    def __init__(self):
        self._items: list = []

    def add(self, values: torch.Tensor, on_flush: Optional[Callable[[], None]] = None
            ) -> "BatchedRead":
        r = BatchedRead(self)
        self._items.append((values.detach().reshape(-1), r, on_flush))
        return r

    def flush(self) -> None:
        items, self._items = self._items, []
        if not items:
            return
        vals = [v for v, _, _ in items]
        if len({v.dtype for v in vals}) > 1:
            vals = [v.to(torch.int64) for v in vals]
        readout = HostReadout(vals[0] if len(vals) == 1 else torch.cat(vals))
        off = 0
        for v, r, _ in items:
            r._bind(readout, off, v.numel())
            off += v.numel()
        if readout.device.type == "cpu":
            for _, _, cb in items:
                if cb is not None:
                    cb()


class BatchedRead:
    """One registered tensor of a :class:`ReadoutBatch`: ``ready()`` / ``get()`` as
    :class:`HostReadout`, for its slice of the batch's copy. Read before its batch was
    flushed (a step that ended early, by an exception), it flushes the batch itself."""

    __slots__ = ("_batch", "_readout", "_off", "_n")

    def __init__(self, batch: ReadoutBatch):
        self._batch, self._readout, self._off, self._n = batch, None, 0, 0

    def _bind(self, readout: HostReadout, off: int, n: int) -> None:
        self._readout, self._off, self._n = readout, off, n

    def ready(self) -> bool:
        return self._readout is not None and self._readout.ready()

    def get(self) -> List:
        if self._readout is None:
            self._batch.flush()
        return self._readout.get()[self._off:self._off + self._n]


def host_list(t: torch.Tensor) -> List[int]:
    """Integers of a tensor that lives in host memory by contract (Horovod's alltoall
    returns its received splits as a CPU tensor, whatever the data's device). Read
    through numpy: no tensor op, and never a device synchronisation."""
    if t.device.type != "cpu":
        raise RuntimeError(f"hvdsparse: expected a host tensor, got one on {t.device}")
    return [int(x) for x in t.numpy().tolist()]


class DeferredFigures:
    """Cost-model figures of one bucket exchange, computed on the device.

    ``get()`` returns the same dict as ``Pending.figures`` (``pairs``: mean pairs sent
    per rank, ``reduced``: non-zeros of the summed bucket or an upper bound). The
    values come from bytes every rank received identically, so they are equal on all
    ranks; *when* they become readable is not. A consumer that must decide identically
    on every rank therefore reads a fixed older exchange (the scheduler: the figures of
    step ``t-2`` at step ``t``, whose event completed before step ``t-1``'s collectives
    could), never "whatever has arrived".
    """

    __slots__ = ("readout", "_convert", "_value")

    def __init__(self, readout: HostReadout, convert: Callable[[List[int]], Dict[str, float]]):
        self.readout, self._convert, self._value = readout, convert, None

    def ready(self) -> bool:
        return self._value is not None or self.readout.ready()

    def get(self) -> Dict[str, float]:
        if self._value is None:
            self._value = self._convert(self.readout.get())
        return dict(self._value)


class TaggedFigures:
    """An exchange's figures (a ``DeferredFigures`` or anything with ``get()``) with the
    bucket's capacity at that exchange added as ``"capacity"`` (the cost model uses
    earlier figures only for a bucket of the same capacity)."""

    __slots__ = ("figures", "capacity")

    def __init__(self, figures, capacity: int):
        self.figures, self.capacity = figures, int(capacity)

    def get(self) -> Dict[str, float]:
        out = self.figures.get()
        out["capacity"] = self.capacity
        return out


def bucket_capacity(payloads) -> int:
    """Slots per rank of a bucket's payloads (the sum of their segments' capacities):
    the same on every rank."""
    return sum(int(s.capacity) for p in payloads for s in p.segments)


class BufferPool:
    """Reused per-bucket buffers: ``(kind, bucket_id, numel, dtype, device) -> tensor``.

    A buffer handed out for a key is handed out again for the same key at the next
    step, so a caller must be done with it before it launches that bucket again (see
    the module docstring). Different kinds never alias.
    """

    _DEFAULT: "OrderedDict[str, BufferPool]" = OrderedDict()
    _MAX_PREFIXES = 8    # optimizers whose buffers the module-level pool keeps

    def __init__(self):
        self._bufs: Dict[Tuple, torch.Tensor] = {}
        self._consts: Dict[Tuple, torch.Tensor] = {}
        self._states: Dict[Tuple, Tuple[Any, Any]] = {}
        self._tables = RowTables()

    @classmethod
    def default(cls, prefix: str) -> "BufferPool":
        pool = cls._DEFAULT.get(prefix)
        if pool is None:
            pool = cls._DEFAULT[prefix] = cls()
            while len(cls._DEFAULT) > cls._MAX_PREFIXES:
                cls._DEFAULT.popitem(last=False)
        else:
            cls._DEFAULT.move_to_end(prefix)
        return pool

    def get(self, kind: str, bucket_id: int, numel: int, dtype: torch.dtype,
            device) -> torch.Tensor:
        key = (kind, int(bucket_id), int(numel), dtype, str(device))
        buf = self._bufs.get(key)
        if buf is None:
            # drop a stale buffer of the same kind and bucket (numel changed: re-plan)
            for k in [k for k in self._bufs if k[:2] == key[:2]]:
                del self._bufs[k]
            buf = self._bufs[key] = torch.empty(int(numel), dtype=dtype, device=device)
        return buf

    def tables(self):
        """The pool's staged host-to-device tables (:class:`hvdsparse.row_tables.RowTables`:
        one pinned host and one device buffer per key, reused step to step)."""
        return self._tables

    def state(self, kind: str, bucket_id: int, key, factory: Callable[[], Any]):
        """A per-bucket object that lives from step to step (e.g. the ``balanced``
        strategy's boundaries): ``factory()`` builds it on first use and again whenever
        ``key`` (numel, world size, device ...) changes, i.e. after a re-plan."""
        k = (kind, int(bucket_id))
        held = self._states.get(k)
        if held is None or held[0] != key:
            held = self._states[k] = (key, factory())
        return held[1]

    def const_index(self, values: Sequence[int], device) -> torch.Tensor:
        """An int64 device tensor holding ``values``, built once (the H2D copy of a
        Python list happens on first use only)."""
        key = (tuple(int(v) for v in values), str(device))
        t = self._consts.get(key)
        if t is None:
            t = self._consts[key] = torch.tensor(key[0], dtype=torch.int64, device=device)
        return t


def bucket_device(payloads: Sequence[LayerPayload]) -> torch.device:
    for p in payloads:
        for s in p.segments:
            return s.count.device
    return torch.device("cpu")


def own_dense(spec: BucketSpec, payloads: Sequence[LayerPayload],
              device: torch.device, out: Optional[torch.Tensor] = None,
              ctx: Optional["ExchangeContext"] = None) -> torch.Tensor:
    """This rank's payloads expanded into the flat fp32 bucket vector (written into
    ``out``, fp32 with at least ``spec.numel`` elements, when given: its first
    ``spec.numel``, and zeros after them), the sum of each payload's segments.

    With ``ctx`` and ``ctx.validate`` False (the CUDA default: the device check flag)
    the whole bucket takes a fixed number of launches: its payloads are encoded into one
    message (``codec.encode``, into a reused buffer) and that message is decoded as the
    only rank's (``codec.accumulate`` into the zeroed vector: the bucket decode's check
    launch, setting ``ctx.error_flag`` as any decode does, and one scatter launch): the
    values ``0 + v`` the allgather strategy's decode adds, i.e. ``payload_to_dense``'s.
    With ``ctx.graphs`` (the step engine's ``cuda_graphs``) the encode and the decode
    replay as captured graphs, the decode reading the reused message in place.
    Otherwise each payload is expanded on its own (``payload_to_dense`` overwrites each
    view: a few launches per segment)."""
    from .. import codec
    if out is None:
        flat = torch.zeros(spec.numel, dtype=torch.float32, device=device)
    else:
        flat = out
    if ctx is not None and not ctx.validate and any(p.segments for p in payloads):
        nbytes = codec.encoded_nbytes(payloads)
        msg = codec.encode(payloads, out=ctx.buffer("own.msg", spec.bucket_id, nbytes,
                                                    torch.uint8, device), graphs=ctx.graphs)
        if flat.numel() > spec.numel:
            flat[spec.numel:].zero_()
        codec.accumulate(msg.view(1, nbytes), payloads, spec.views(flat), validate=False,
                         error_flag=ctx.error_flag, zero=True, graphs=ctx.graphs,
                         rows_kept=True)
        return flat
    for view, p in zip(spec.views(flat), payloads):
        codec.payload_to_dense(p, out=view)
    if flat.numel() > spec.numel:
        flat[spec.numel:].zero_()
    return flat
