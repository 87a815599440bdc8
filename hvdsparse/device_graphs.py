"""A bucket group's device launches replayed as one CUDA graph.

A group's compress step (``compressors/bucket.py``, ``compressors/topk_bucket.py``,
``adam_bucket.py``) has three parts:

1. the host fills the group's staged row table (:mod:`hvdsparse.row_tables`): tensor
   addresses, sizes, offsets, seeds, modes -- everything that changes from step to step;
2. the **device segment**: the table's host-to-device copy, the output allocations and
   the group's launches. It is a module-level function of its arguments only
   (``fn(table, *args)``), so everything that shapes its launches is in ``args``;
3. the host builds the payloads: views of the segment's outputs at the offsets it wrote
   into the table.

A bucket's encode (``codec_encode``: its narrowing launches and the ``cat`` into the
message buffer, the payloads in the key) and its decode (``codec_accumulate``: the
zeroing of its sum, the check launch, one scatter launch per rank) are device segments
without a table. The decode reads the gathered messages from a
:meth:`SegmentGraphs.home`, the one launch added per bucket, since the collective's
output moves from step to step.

:func:`run_segment` runs part 2 eagerly, or, where the owner has :class:`SegmentGraphs`
(``enable``; the step engine's ``cuda_graphs`` setting), as a graph:

* **Key.** ``(fn, the staged table's host and device addresses, args)``, each tensor in
  ``args`` by (address, shape, strides, dtype, device), every int / float / bool / str /
  None / dtype / enum by value, a module or function by identity, a tuple, list or
  dataclass instance (a payload) by its items or fields; anything else is
  refused (:class:`TypeError`), so no hidden state can shape a captured launch. The
  table's cells are not in the key: the kernels read them at replay, from the host
  buffer the graph's copy reads.
* **Policy.** A key's first sighting runs eagerly (Triton compiles, the allocator
  settles); the second captures it; later sightings replay the capture. A key seen once
  on a step that never recurs (a refresh, a warm-up) costs nothing but that eager run.
  At most :data:`LIMIT` captures per owner, least recently used dropped.
* **Outputs.** The tensors the capture allocated live in the graph's private memory pool:
  every replay returns the same tensors and overwrites them. Contract: a group's outputs
  of one step are consumed (collective done, feedback applied, statistics folded) before
  the same group's segment runs again. Both front doors wait for every handle before the
  optimizer step, and the statistics fold at the next ``begin_step``, in stream order.
* **Host synchronisation.** A capture synchronises the device once
  (``torch.cuda.graph`` does), on a key's second sighting only. A replay never waits.

The backend does the capturing: :class:`CudaGraphs` on CUDA; any object with
``applies(device)``, ``capture(thunk) -> (handle, outputs)`` (the thunk's work done once,
as an eager run would) and ``replay(handle)`` serves (``scripts/graph_emulator.py``
replays recorded launches under Triton's interpreter, so the suite checks, without a GPU,
that a replay gives an eager step's bits).
"""
from __future__ import annotations

import dataclasses
import enum
import types
from collections import OrderedDict
from typing import Callable, Optional

import torch

__all__ = ["CudaGraphs", "SegmentGraphs", "enable", "graphs_of", "run_bare", "run_segment",
           "segment_key"]

#: captures kept per owner (least recently used dropped beyond)
LIMIT = 64
_SCALARS = (int, float, bool, str, type(None))


def _key(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", x.data_ptr(), tuple(x.shape), tuple(x.stride()), str(x.dtype),
                str(x.device))
    if isinstance(x, _SCALARS):
        return (type(x).__name__, x)
    if isinstance(x, (tuple, list)):
        return ("seq",) + tuple(_key(y) for y in x)
    if isinstance(x, (torch.dtype, torch.device)):
        return ("torch", str(x))
    if isinstance(x, enum.Enum):
        return ("enum", type(x).__qualname__, x.value)
    if isinstance(x, (types.ModuleType, types.FunctionType)):
        return ("object", id(x))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        # a record of the above (a payload): keyed by every field
        return ("record", type(x).__qualname__) + tuple(
            (f.name, _key(getattr(x, f.name))) for f in dataclasses.fields(x))
    raise TypeError(f"device segment argument of type {type(x).__name__}: not keyable "
                    f"(pass tensors, scalars, enums, modules or functions)")


def segment_key(fn: Callable, staged, args) -> tuple:
    """The graph key of running ``fn`` on ``staged``'s table with ``args``."""
    if not isinstance(fn, types.FunctionType) or fn.__closure__:
        raise TypeError(f"device segment {getattr(fn, '__name__', fn)!r}: a module-level "
                        f"function without a closure (its arguments must be all it reads)")
    return (id(fn),) + staged.addresses() + tuple(_key(a) for a in args)


class _NoTable:
    """The staged-table protocol of a segment that reads no row table
    (``SegmentGraphs.run(fn, None, *args)`` runs ``fn(*args)``)."""

    def prepare(self):
        pass

    def addresses(self):
        return ()

    def upload(self):
        return None

    copy_in = upload

    def copied(self):
        pass


class CudaGraphs:
    """``torch.cuda.CUDAGraph`` capture and replay, for CUDA tensors."""

    @staticmethod
    def applies(device: torch.device) -> bool:
        return device.type == "cuda"

    @staticmethod
    def capture(thunk):
        g = torch.cuda.CUDAGraph()
        # thread-local: another thread's allocations (a collective's) may go on
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            outs = thunk()
        g.replay()                # a capture records; this step's work runs now
        return g, outs

    @staticmethod
    def replay(g) -> None:
        g.replay()


class SegmentGraphs:
    """One owner's captured device segments (the module docstring's policy).
    ``captures`` / ``replays`` / ``eager`` / ``homes``: how often each happened."""

    def __init__(self, backend, limit: int = LIMIT):
        self.backend = backend
        self.limit = limit
        self._graphs: "OrderedDict[tuple, tuple]" = OrderedDict()
        self._seen: "OrderedDict[tuple, int]" = OrderedDict()
        self.captures = self.replays = self.eager = 0
        self._homes: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
        self.homes = 0

    def home(self, like: torch.Tensor) -> torch.Tensor:
        """``like`` copied into a tensor this owner keeps, one per (shape, dtype,
        device): the fixed address from which a captured segment reads an input whose own
        address changes every step (a collective's output). The copy is queued on the
        current stream, so segments that share a home read it in stream order."""
        key = (tuple(like.shape), like.dtype, str(like.device))
        h = self._homes.get(key)
        if h is None:
            h = self._homes[key] = torch.empty(like.shape, dtype=like.dtype,
                                               device=like.device)
            if len(self._homes) > 4 * self.limit:
                self._homes.popitem(last=False)
        else:
            self._homes.move_to_end(key)
        self.homes += 1
        return h.copy_(like)

    def run(self, fn: Callable, staged, *args):
        """``fn(table, *args)`` with ``staged``'s table, or ``fn(*args)`` for a segment
        without one (``staged=None``: everything it reads is in ``args``)."""
        bare = staged is None
        if bare:
            staged = _NoTable()

        def call(table):
            return fn(*args) if bare else fn(table, *args)
        staged.prepare()
        key = segment_key(fn, staged, args)
        got = self._graphs.get(key)
        if got is not None:
            self._graphs.move_to_end(key)
            self.backend.replay(got[0])
            staged.copied()
            self.replays += 1
            return got[1]
        if key not in self._seen:
            self._seen[key] = 1
            if len(self._seen) > 4 * self.limit:
                self._seen.popitem(last=False)
            self.eager += 1
            return call(staged.upload())
        del self._seen[key]
        handle, outs = self.backend.capture(lambda: call(staged.copy_in()))
        staged.copied()
        self._graphs[key] = (handle, outs)
        if len(self._graphs) > self.limit:
            self._graphs.popitem(last=False)
        self.captures += 1
        return outs


def enable(owner, backend=None) -> SegmentGraphs:
    """Give ``owner`` (a compressor, the Adam recipe) :class:`SegmentGraphs` with
    ``backend`` (default :class:`CudaGraphs`); returns them."""
    g = owner.segment_graphs = SegmentGraphs(backend or CudaGraphs())
    return g


def graphs_of(owner) -> Optional[SegmentGraphs]:
    return getattr(owner, "segment_graphs", None)


def run_segment(owner, fn: Callable, staged, *args, capturable: bool = True):
    """``fn(table, *args)`` for ``staged``'s group: replayed from a capture where
    ``owner`` has graphs whose backend applies to the table's device and the caller says
    the segment is ``capturable`` (its launches are device launches: not the compiled CPU
    loops), else eagerly on the uploaded table."""
    g = graphs_of(owner)
    if g is None or not capturable or not g.backend.applies(staged.device):
        return fn(staged.upload(), *args)
    return g.run(fn, staged, *args)


def run_bare(graphs: Optional[SegmentGraphs], device, fn: Callable, *args):
    """``fn(*args)``, a segment without a row table: replayed through ``graphs`` where
    they are given and their backend applies to ``device``, else run eagerly."""
    if graphs is not None and graphs.backend.applies(device):
        return graphs.run(fn, None, *args)
    return fn(*args)
