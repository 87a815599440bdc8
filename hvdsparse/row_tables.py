"""The tables a whole-bucket launch reads, kept at fixed addresses from step to step.

A bucket group's launches (``kernels/bucket_*.py``) read two tables:

* the **row table**, int64 ``tab[L, W]``: one row per layer, its cells the layer's
  tensor addresses, sizes, offsets, seeds and modes (``kernels/table.py``). The host
  fills it every step.
* the **program map**, int32 ``blk[nprograms]``: the row of each program of a streaming
  launch. It depends on the layer sizes only, so it is built once per size list.

A CUDA graph replays the launches it recorded with the addresses it recorded, and the
host-to-device copy of the row table from the host address it recorded. So a group's row
table lives in :class:`RowTables`: one host buffer and one device buffer per group (the
``key``), reused every step.

**Contract of a step's table** (``take(key, rows, width, device)`` -> :class:`StagedTable`):

1. ``host`` is the zeroed ``[rows, width]`` int64 array the caller fills.
2. ``upload()`` queues one copy to the device and returns the device table. On the CPU
   there is no copy: the host buffer is the table.
3. A key names one group of one step. Taking it again rewrites the same buffers.

**Why rewriting is safe on CUDA:**

* The device buffer is rewritten by a copy on the current stream, queued after every
  launch of the previous step that read it (stream order). If the stream differs from
  the last upload's, the group gets a new device buffer.
* The host buffer is rewritten only after the previous copy from it has finished. An
  event recorded after that copy is polled with ``query()``, which never waits. If the
  copy is still in flight, the step takes a new pinned buffer. Its address then differs,
  so that step cannot replay a graph, but nothing is read before it is written.

No step waits on the device. The cost is one pinned buffer per group, allocated once.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import List

import numpy as np
import torch

__all__ = ["RowTables", "StagedTable", "program_map"]

#: groups kept per owner (least recently used dropped beyond)
LIMIT = 256


class StagedTable:
    """One group's row table for one step: fill :attr:`host`, then :meth:`upload`."""

    __slots__ = ("host", "_pinned", "_device", "_event", "_stream", "_target")

    def __init__(self, rows: int, width: int, device: torch.device):
        self._device = None
        self._event = None
        self._stream = None
        self._target = device
        cuda = device.type == "cuda"
        self._pinned = torch.zeros((rows, width), dtype=torch.int64, pin_memory=cuda)
        self.host = self._pinned.numpy()

    def _begin(self) -> "StagedTable":
        """Ready for this step's rows: zeroed host rows that no copy still reads."""
        ev = self._event
        if ev is not None and not ev.query():          # host-side poll, no wait
            # the previous copy still reads the host buffer: a new one for this step
            self._pinned = torch.zeros(self._pinned.shape, dtype=torch.int64,
                                       pin_memory=True)
            self.host = self._pinned.numpy()
        else:
            self.host.fill(0)
        self._event = None
        return self

    @property
    def device(self) -> torch.device:
        return self._target

    def prepare(self) -> None:
        """Make the group's device buffer for the current stream (outside any capture:
        a graph's copy writes into it; it is not the graph's to allocate)."""
        dev = self._target
        if dev.type == "cuda":
            stream = torch.cuda.current_stream(dev)
            if self._device is None or self._stream != stream:
                self._device = torch.empty(self._pinned.shape, dtype=torch.int64,
                                           device=dev)
                self._stream = stream

    def addresses(self) -> tuple:
        """Where this step's table lives: the host buffer (a graph's copy reads it) and
        the device buffer (its launches read it). A graph replays only at the same."""
        d = self._device
        return (self._pinned.data_ptr(), 0 if d is None else d.data_ptr(), str(self._target))

    def copy_in(self) -> torch.Tensor:
        """The device table, :attr:`host`'s rows copied in (queued on the current stream;
        :meth:`prepare` first). On the CPU the host buffer itself."""
        if self._target.type != "cuda":
            return self._pinned
        self._device.copy_(self._pinned, non_blocking=True)
        return self._device

    def table(self) -> torch.Tensor:
        """The table the launches read (after :meth:`upload` or a segment's copy): the
        device buffer on CUDA, the host buffer on the CPU."""
        return self._device if self._target.type == "cuda" else self._pinned

    def copied(self) -> None:
        """The copy from the host buffer is queued (eagerly or in a replayed graph): an
        event after it guards the next rewrite (:meth:`_begin`)."""
        if self._target.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self._target))

    def upload(self) -> torch.Tensor:
        """The device table holding :attr:`host`'s rows: on CUDA one non-blocking copy on
        the current stream into the group's persistent device buffer; on the CPU the host
        buffer itself."""
        self.prepare()
        table = self.copy_in()
        self.copied()
        return table


class RowTables:
    """Per-group staged row tables of one owner (a compressor, the Adam recipe)."""

    def __init__(self, limit: int = LIMIT):
        self._tables: "OrderedDict[tuple, StagedTable]" = OrderedDict()
        self._limit = limit

    def take(self, key: tuple, rows: int, width: int,
             device: torch.device) -> StagedTable:
        """The group ``key``'s table for this step (``[rows, width]``, zeroed)."""
        full = (key, rows, width, str(device))
        t = self._tables.get(full)
        if t is None:
            t = StagedTable(rows, width, device)
            self._tables[full] = t
            if len(self._tables) > self._limit:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(full)
            t._begin()
        return t

    def staged(self):
        """``(key, host rows as a tensor)`` of every group: what a step rewrites (a
        capture check reads them)."""
        return [(k[0], t._pinned) for k, t in self._tables.items()]


_MAPS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()


def program_map(nprog: List[int], device) -> torch.Tensor:
    """int32 ``[sum nprog]``: the row of every program, row ``j`` owning ``nprog[j]``
    consecutive programs. Cached per (sizes, device): layer sizes never change."""
    key = (tuple(nprog), str(device))
    t = _MAPS.get(key)
    if t is None:
        t = torch.from_numpy(np.repeat(np.arange(len(nprog), dtype=np.int32), nprog))
        if torch.device(device).type == "cuda":
            t = t.pin_memory().to(device, non_blocking=True)
        else:
            t = t.to(device)
        _MAPS[key] = t
        if len(_MAPS) > LIMIT:
            _MAPS.popitem(last=False)
    else:
        _MAPS.move_to_end(key)
    return t
