"""What every exchange strategy shares: the bucket description, the launch context and
the in-flight handle.

A *bucket* is an ordered list of layers whose payloads travel in one collective (or,
for ``split``, one alltoall followed by one allgather). Its layers are laid end to end
in a flat fp32 vector of ``numel`` elements (layer ``j`` at ``offsets[j]``); every
strategy returns the **sum over all ranks** of the ranks' decoded payloads in that
flat layout. Averaging (``op=Average``), ``after_exchange`` and writing ``p.grad``
happen in the scheduler.

Collectives are named ``<prefix>.b<bucket>.<strategy>[.<phase>]``: Horovod matches
operations by name, so buckets may complete in any order, and the names are stable
from step to step (Horovod's response cache hits when names and shapes repeat).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from ..payload import LayerPayload


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

    def name(self, bucket_id: int, strategy: str, phase: str = "") -> str:
        n = f"{self.prefix}.b{bucket_id}.{strategy}"
        return f"{n}.{phase}" if phase else n


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

    def advance(self) -> None:
        """Non-blocking progress (multi-phase strategies start their next phase when
        the previous one completed). Default: nothing to do."""

    def finish(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


def bucket_device(payloads: Sequence[LayerPayload]) -> torch.device:
    for p in payloads:
        for s in p.segments:
            return s.count.device
    return torch.device("cpu")


def own_dense(spec: BucketSpec, payloads: Sequence[LayerPayload],
              device: torch.device) -> torch.Tensor:
    """This rank's payloads expanded into the flat fp32 bucket vector."""
    from .. import codec
    flat = torch.zeros(spec.numel, dtype=torch.float32, device=device)
    for view, p in zip(spec.views(flat), payloads):
        codec.payload_to_dense(p, out=view)
    return flat
