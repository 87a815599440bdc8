"""The transport seam: the few collectives the exchange strategies need, behind one small
interface, with a Horovod and a ``torch.distributed`` implementation.

The strategies (:mod:`hvdsparse.exchange`) and the codec are shared by both front doors
(:func:`hvdsparse.DistributedOptimizer` under ``horovodrun``, :mod:`hvdsparse.ddp` under
``torchrun``); only this module knows which library moves the bytes. A strategy reaches
it through ``ExchangeContext.transport`` (default: :func:`horovod`).

Operations (``name`` identifies the collective; Horovod matches operations by name, so
they may be issued in any order; ``torch.distributed`` ignores it and matches them by
issue order, see "Ordering" below):

====================================  ==============================================
``allgather_async(t, name)``          every rank's ``t`` (equal shape on every rank),
                                      concatenated along dim 0 -> ``[P * t.shape[0], ...]``
``alltoall_async(t, splits, name)``   rows ``splits[r]`` of ``t`` (along dim 0) go to rank
                                      ``r``; result ``(received rows, recv_splits)``, the
                                      received rows in rank order, ``recv_splits`` a host
                                      int32 tensor (Horovod's contract)
``allreduce_async_(t, name, *,        in place ``t <- post * sum_r(pre * t_r)``
prescale_factor, postscale_factor)``
``poll(h)`` / ``synchronize(h)``      never blocks / waits and returns the result
``broadcast(t, root_rank, name)``     rank ``root_rank``'s ``t`` on every rank (blocking)
``allgather_object(obj, name)``       list of every rank's picklable ``obj`` (blocking)
``sparse_allreduce_async(t, name)``   a sparse COO tensor summed / averaged (Horovod only:
                                      the Horovod door's sparse gradients)
``grouped_allreduce_(ts, name)``      in place, blocking (Horovod only: parameter
                                      averaging of the local-gradient modes)
``future(h)``                         a ``torch.futures.Future`` completed with
                                      ``synchronize(h)``'s result (torch only)
====================================  ==============================================

Ordering (torch.distributed)
----------------------------
``torch.distributed`` collectives carry no name: every rank must issue them in the same
order on a process group. A caller that uses :class:`TorchDistTransport` must therefore
issue collectives only from program points that every rank reaches in the same order
(the DDP hook issues them from the hook calls, which DDP makes in bucket order on every
rank, and never from a completion callback or from a "has it finished yet" poll).

Variable-size alltoall (torch.distributed)
------------------------------------------
``all_to_all_single`` needs the receive sizes before it starts; Horovod exchanges them
inside its alltoall. :meth:`TorchDistTransport.alltoall_async` does the same explicitly:
one ``all_to_all_single`` of P int64 split sizes, waited for, then the data alltoall
(asynchronous). That small exchange is a blocking round trip (on CUDA also one
device-to-host read of P integers) -- the only one in this module; fixed-size
collectives (allgather, allreduce) never need it. Padding every message to a size all
ranks can compute would avoid it but costs what sparsity saves (split's phase 1 padded
to its capacity per owner is allgather's volume; phase 2 padded is dense), so the
split strategy under torch.distributed pays the round trip instead.

Gloo (CPU) supports every operation used here in torch 2.x: ``all_gather_into_tensor``
(``all_gather_single`` where it exists), ``all_to_all_single`` with split sizes on any
dtype (uint8 rows included), ``all_reduce`` with ``async_op=True``. NCCL (GPU) too.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

__all__ = ["Transport", "HorovodTransport", "TorchDistTransport", "horovod"]


class Transport:
    """Interface (see the module docstring). ``ordered``: True when collectives are
    matched by issue order (callers must not issue them from timing-dependent places)."""

    kind = "abstract"
    ordered = False

    def rank(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def size(self) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def allgather_async(self, tensor: torch.Tensor, name: Optional[str] = None):
        raise NotImplementedError

    def alltoall_async(self, tensor: torch.Tensor, splits, name: Optional[str] = None):
        raise NotImplementedError

    def allreduce_async_(self, tensor: torch.Tensor, name: Optional[str] = None, *,
                         prescale_factor: float = 1.0, postscale_factor: float = 1.0):
        raise NotImplementedError

    def poll(self, handle) -> bool:
        raise NotImplementedError

    def synchronize(self, handle):
        raise NotImplementedError

    def broadcast(self, tensor: torch.Tensor, root_rank: int, name: Optional[str] = None):
        raise NotImplementedError

    def allgather_object(self, obj: Any, name: Optional[str] = None) -> List[Any]:
        raise NotImplementedError

    def future(self, handle) -> torch.futures.Future:
        raise NotImplementedError(f"{type(self).__name__} has no futures")


class HorovodTransport(Transport):
    """Horovod's collectives, exactly as the strategies called them before the seam
    (same functions, arguments and names: the Horovod path is unchanged)."""

    kind = "horovod"
    ordered = False

    def __init__(self):
        import horovod.torch as hvd
        self._hvd = hvd

    def rank(self) -> int:
        return self._hvd.rank()

    def size(self) -> int:
        return self._hvd.size()

    def allgather_async(self, tensor, name=None):
        return self._hvd.allgather_async(tensor, name=name)

    def alltoall_async(self, tensor, splits, name=None):
        if not isinstance(splits, torch.Tensor):
            splits = torch.tensor(list(splits), dtype=torch.int32)
        return self._hvd.alltoall_async(tensor, splits=splits, name=name)

    def allreduce_async_(self, tensor, name=None, *, prescale_factor=1.0,
                         postscale_factor=1.0):
        hvd = self._hvd
        return hvd.allreduce_async_(tensor, name=name, op=hvd.Sum,
                                    prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor)

    def poll(self, handle) -> bool:
        return self._hvd.poll(handle)

    def synchronize(self, handle):
        return self._hvd.synchronize(handle)

    def broadcast(self, tensor, root_rank, name=None):
        return self._hvd.broadcast(tensor, root_rank=root_rank, name=name)

    def allgather_object(self, obj, name=None):
        return self._hvd.allgather_object(obj, name=name)

    def sparse_allreduce_async(self, tensor, name=None, *, average: bool = True):
        """A sparse COO gradient summed (or averaged) over ranks the way
        ``hvd.DistributedOptimizer`` does it: an allgather of indices and values."""
        from horovod.torch.mpi_ops import sparse_allreduce_async
        hvd = self._hvd
        return sparse_allreduce_async(tensor, name=name,
                                      op=hvd.Average if average else hvd.Sum)

    def grouped_allreduce_(self, tensors, name=None, *, average: bool = True):
        """In place, blocking: every tensor of ``tensors`` summed (or averaged) over
        ranks in one grouped collective."""
        hvd = self._hvd
        hvd.grouped_allreduce_(tensors, name=name, op=hvd.Average if average else hvd.Sum)


_HOROVOD: Optional[HorovodTransport] = None


def horovod() -> HorovodTransport:
    """The process-wide Horovod transport (created on first use; imports Horovod then)."""
    global _HOROVOD
    if _HOROVOD is None:
        _HOROVOD = HorovodTransport()
    return _HOROVOD


class _TorchHandle:
    """One in-flight ``torch.distributed`` collective: its ``Work`` plus what turns the
    finished buffers into the result (run once, on the caller's thread)."""

    __slots__ = ("work", "_finish", "_value", "_done")

    def __init__(self, work, finish: Callable[[], Any]):
        self.work, self._finish, self._value, self._done = work, finish, None, False

    def value(self, wait: bool = True):
        if not self._done:
            if wait and self.work is not None:
                self.work.wait()
            self._value = self._finish()
            self._done = True
        return self._value


class TorchDistTransport(Transport):
    """``torch.distributed`` collectives on ``group`` (None = the default group): NCCL on
    GPU, Gloo on CPU. Collectives are matched by issue order (``ordered = True``).
    Ranks are ranks *within* ``group``."""

    kind = "torch.distributed"
    ordered = True

    def __init__(self, group=None):
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("hvdsparse: torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group() first (torchrun "
                               "sets the environment for it)")
        self._dist = dist
        self.group = group
        gather = getattr(dist, "all_gather_single", None)   # torch >= 2.13 name
        self._gather = gather if gather is not None else dist.all_gather_into_tensor

    def rank(self) -> int:
        return self._dist.get_rank(self.group)

    def size(self) -> int:
        return self._dist.get_world_size(self.group)

    def _global(self, rank: int) -> int:
        if self.group is None:
            return int(rank)
        return self._dist.get_global_rank(self.group, int(rank))

    def allgather_async(self, tensor, name=None):
        t = tensor.contiguous()
        P = self.size()
        out = torch.empty((P * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype,
                          device=t.device)
        work = self._gather(out, t, group=self.group, async_op=True)
        return _TorchHandle(work, lambda: out)

    def alltoall_async(self, tensor, splits, name=None):
        dist = self._dist
        t = tensor.contiguous()
        if isinstance(splits, torch.Tensor):
            if splits.device.type != "cpu":
                raise ValueError(f"hvdsparse alltoall {name!r}: splits must be host "
                                 f"integers (a CPU tensor or a list), got a tensor on "
                                 f"{splits.device}")
            splits = splits.numpy().tolist()       # host memory: no device sync
        send = [int(s) for s in splits]
        P = self.size()
        if len(send) != P:
            raise ValueError(f"hvdsparse alltoall {name!r}: {len(send)} splits for "
                             f"{P} ranks")
        if sum(send) != t.shape[0]:
            raise ValueError(f"hvdsparse alltoall {name!r}: splits sum to {sum(send)} but "
                             f"the tensor has {t.shape[0]} rows")
        # the receive sizes: one small blocking alltoall (see the module docstring)
        sizes_out = torch.empty(P, dtype=torch.int64, device=t.device)
        dist.all_to_all_single(sizes_out, torch.tensor(send, dtype=torch.int64,
                                                       device=t.device), group=self.group)
        recv_host = sizes_out.cpu() if sizes_out.device.type != "cpu" else sizes_out
        recv = [int(x) for x in recv_host.numpy().tolist()]
        out = torch.empty((sum(recv),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        work = dist.all_to_all_single(out, t, output_split_sizes=recv,
                                      input_split_sizes=send, group=self.group,
                                      async_op=True)
        recv_splits = torch.tensor(recv, dtype=torch.int32)
        return _TorchHandle(work, lambda: (out, recv_splits))

    def allreduce_async_(self, tensor, name=None, *, prescale_factor=1.0,
                         postscale_factor=1.0):
        if prescale_factor != 1.0:
            tensor.mul_(prescale_factor)
        work = self._dist.all_reduce(tensor, group=self.group, async_op=True)

        def finish():
            if postscale_factor != 1.0:
                tensor.mul_(postscale_factor)
            return tensor
        return _TorchHandle(work, finish)

    def poll(self, handle) -> bool:
        return handle.work is None or handle.work.is_completed()

    def synchronize(self, handle):
        return handle.value()

    def broadcast(self, tensor, root_rank, name=None):
        self._dist.broadcast(tensor, src=self._global(root_rank), group=self.group)
        return tensor

    def allgather_object(self, obj, name=None):
        out: List[Any] = [None] * self.size()
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def future(self, handle) -> torch.futures.Future:
        """Completed with the handle's result once its collective completes. The
        finishing step (post-scale, tuple of received splits) runs in the callback,
        which issues no collective."""
        if handle.work is None:
            fut = torch.futures.Future()
            fut.set_result(handle.value())
            return fut
        # no work.wait() inside the callback: the work may not count as finished until
        # its future's callbacks have run (Gloo), so waiting there would deadlock
        return handle.work.get_future().then(lambda _f: handle.value(wait=False))


def check_transport(t) -> Transport:
    if not isinstance(t, Transport):
        raise TypeError(f"transport must be an hvdsparse.transport.Transport, got "
                        f"{type(t).__name__}")
    return t

