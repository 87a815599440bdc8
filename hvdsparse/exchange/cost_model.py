"""Byte cost model behind ``exchange="auto"``: which collective moves a bucket cheapest.

Every rank evaluates the model for every bucket at launch time and must reach the same
decision without talking to the others, so the model uses only figures that are
identical on all ranks:

* ``P``            -- world size;
* ``N``            -- elements in the bucket (sum of its layers' numel);
* ``wire_nbytes``  -- length of one rank's encoded bucket (:func:`codec.encoded_nbytes`).
  Capacities depend only on layer sizes, compressor settings and the step, so this is
  the same on every rank;
* ``capacity``     -- slots per rank (sum of segment capacities): an upper bound on the
  number of (index, value) pairs one rank contributes;
* ``prev_pairs``   -- average pairs per rank actually sent at an earlier exchange of
  this bucket (the scheduler reads step ``t-2``'s: see :class:`.base.DeferredFigures`),
  when every rank learned it (the allgather strategy decodes every rank's
  ``count`` fields; the split strategy's gathered range headers carry the pairs each
  owner received). ``None`` = unknown, use ``capacity``;
* ``prev_reduced`` -- non-zeros of that earlier step's *summed* bucket, ``K``, when every
  rank learned it (split headers carry each range's nnz; after a dense allreduce every
  rank holds the identical sum; after allgather the sum of the counts, an upper bound of
  the union). ``None`` = unknown, use the SparCML bound ``min(N, P*k)``.
* ``prev_capacity`` -- the bucket's capacity at that earlier exchange: when it differs
  from this one's (a dense step between sparse ones, or the reverse) both ``prev_``
  figures are ignored.

Costs (bytes that cross one rank's link in a bandwidth-optimal ring/pairwise algorithm,
``c`` = 4 index bytes, ``v`` = value bytes of the sparse pairs, ``d`` = dense value bytes):

* ``allgather``: ``(P-1) * wire_nbytes``  (everybody receives every other rank's
  fixed-capacity message; the paper's ``P*k*(c+v)`` with codec overhead included).
* ``dense``:     ``2 (P-1)/P * N * d``  (ring allreduce: reduce-scatter + allgather),
  ``d`` = 4 (fp32) or 2 (fp16).
* ``split``     (SparCML SSAR/DSAR_Split_allgather, section 5.3.2-5.3.3):
  ``(P-1)/P * k (c+v)`` for the split phase (each rank ships the pairs outside its own
  range to their owners) plus ``(P-1)/P * min(K (c+v), N q)`` for the gather of the
  reduced ranges (each owner's message goes to every rank: an alltoall, which moves the
  same link bytes as a ring allgather), which are sent sparse while
  ``K_r < delta_r = N_r q / (c+v)`` and
  dense otherwise (``q`` = 4 for fp32, ``bits/8 + 4/bucket`` when the dense phase is
  quantised). With ``k`` = ``prev_pairs`` or ``capacity`` and ``K`` = ``prev_reduced`` or
  ``min(N, P k)``.

* ``balanced``  (Ok-Topk, :mod:`.balanced`): phase 1 as ``split`` with regions balanced
  to the selected coordinates, ``(P-1)/P * k (c+v)``; phase 2 an allgather of P
  fixed-length messages of ``c = phase2_capacity(P, N, capacity)`` pairs plus a
  ``32 + 4 H``-byte header and histogram: ``(P-1) * (32 + 4H + 4c + pad4(c v))``.
  With ``c = ceil(k/P)`` that is ``~ 2 (P-1)/P k (c+v)``, nearly flat in P -- the
  price is that phase 2 keeps only the global top-k of the sum (see :mod:`.balanced`).
  The model takes ``c`` for the widest region as if regions were ``N/P`` wide.

An optional latency term ``alpha_bytes * messages`` (messages per rank: allgather
``P-1``, dense ``2(P-1)``, split and balanced ``2(P-1)``) charges for per-message overhead; it is 0
by default (pure bytes, as in the paper's bandwidth terms). Ties resolve in the order
allgather, split, dense (fewest collectives first); ``split`` is chosen over ``allgather``
only below ``SPLIT_MARGIN`` (0.75) times allgather's bytes (its passes over the dense
bucket are not priced), and the lossy ``balanced`` only when it costs less than
``LOSSY_MARGIN`` (0.4) times the cheapest exact strategy.

On the device (CUDA / Triton) code path ``auto`` chooses among ``HOST_SIZED``
(allgather, dense) only (:func:`auto_strategies`): split and balanced size their
alltoall from per-owner pair counts that are device values, so each of their buckets
costs one blocking device-to-host read, which stalls the hook until the device has run
everything queued before it (the rest of backward included). Measured on one H200 (DDP,
2 ranks on one GPU over Gloo, GPT-2-small-like LM): Threshold 99% with split in two
thirds of its buckets took 205 ms a step, TopK 1% all-allgather 106 ms. A user who names
``split`` or ``balanced`` still gets it.

Consequences (unit-tested in tests/test_cost_model.py): with fp32 pairs (c+v = 8) and
fp32 dense ranges (q = 4), split costs more than allgather while the union stays
sparse (``P k < N/2``: ``(P-1)/P 8k (P+1) > (P-1) 8k``) and less once
``P > 1 + N q / (k (c+v)) = 1 + N/(2k)`` -- about 51 ranks at ``k/N = 1 %``. An fp32 dense
allreduce (``~8N``) then still loses to split (``~ 8k + 4N``), while an fp16 dense
allreduce (``~4N``) beats it. At ``P = 1`` every cost is 0 and ``allgather`` is chosen
(no data moves).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .wire import balanced_message_nbytes

#: every exchange strategy, in tie order (fewest collectives / exact first): the one list
#: (``exchange/__init__`` maps each name to its module, ``settings`` validates against it)
STRATEGIES = ("allgather", "split", "dense", "balanced")
#: the strategies whose result is the exact sum of what the ranks sent (``balanced``
#: keeps a global top-k of the sum when the union of the selections overflows it)
EXACT_STRATEGIES = ("allgather", "split", "dense")
#: the strategies whose message sizes the host knows without reading the device
HOST_SIZED = ("allgather", "dense")

#: ``balanced`` is chosen only below this fraction of the best exact strategy's bytes:
#: its phase 2 drops the part of the sum beyond the global top-k, and it makes several
#: passes over the dense bucket (reduce at the owner, the region's top-k, the
#: undelivered share) that the byte model does not price, so it is worth it for a
#: clear saving only. With k pairs per rank it moves ~2/P of allgather's bytes, so
#: auto takes it from P = 6 on and exact strategies up to P = 5. Measured on the
#: per-node 500 Mbit/s emulation (P = 4, TopK 1%, 4.35 M elements):
#: at 0.53x allgather's bytes balanced took 1.59x its step time (204.5 vs 128.8 ms)
#: and 1.17x its time to 95% (15.4 vs 13.2 s); with the earlier margin of 0.5 auto
#: chose it there.
LOSSY_MARGIN = 0.4

#: ``split`` is chosen over ``allgather`` only below this fraction of allgather's bytes:
#: split makes two passes over the dense bucket (per-owner counts, the non-zero gather)
#: and a second collective, which the byte model does not price. Measured on the
#: per-node 500 Mbit/s emulation (P = 4, TopK 1%, 4.35 M elements):
#: split moved 0.80x allgather's wire bytes but took 1.39x its step time (218 vs 157 ms).
SPLIT_MARGIN = 0.75

#: bytes of one int32 index in split / SparCML sparse streams
INDEX_BYTES = 4
#: bytes of the per-range header of the split strategy's gathered ranges
SPLIT_HEADER_BYTES = 16


@dataclass(frozen=True)
class BucketFigures:
    """The rank-independent figures the model reads (see the module docstring)."""

    world_size: int
    numel: int
    wire_nbytes: int
    capacity: int
    sparse_value_bytes: int = 4       # v: value bytes of split's (index, value) pairs
    dense_value_bytes: int = 4        # d: 4 fp32 / 2 fp16 dense allreduce
    split_dense_bits: int = 0         # 0 = fp32 dense ranges; 8/4/2 = quantised
    quant_bucket: int = 512
    prev_pairs: Optional[float] = None
    prev_reduced: Optional[int] = None
    #: the bucket's ``capacity`` at the exchange ``prev_*`` come from (None: not known)
    prev_capacity: Optional[int] = None


def split_dense_value_bytes(bits: int, quant_bucket: int) -> float:
    """q: bytes per element of a dense reduced range (fp32, or codes + one fp32 scale
    per ``quant_bucket`` elements)."""
    if not bits:
        return 4.0
    return bits / 8.0 + 4.0 / quant_bucket


def sparcml_delta(numel: int, sparse_pair_bytes: float, dense_value_bytes: float) -> float:
    """SparCML's switch point delta = N * isize / (c + isize): above this many non-zeros a
    dense representation of an N-element range is smaller than (index, value) pairs."""
    return numel * dense_value_bytes / sparse_pair_bytes


def phase2_capacity(world_size: int, numel: int, capacity: int,
                    widest_region: Optional[int] = None) -> int:
    """Pairs each owner keeps in ``balanced``'s phase 2: ``ceil(capacity / P)`` (the
    global budget ``k`` = one rank's slots, shared by the P owners, as Ok-Topk's global
    top-k), at most the widest region; all of the widest region when a rank may send
    every element (``capacity >= numel``: dense payloads stay exact)."""
    P, N = max(1, int(world_size)), int(numel)
    w = N if widest_region is None else int(widest_region)
    if int(capacity) >= N:
        return w
    return min(w, -(-int(capacity) // P))


def balanced_phase2_nbytes(world_size: int, numel: int, capacity: int, value_bytes: int,
                           widest_region: Optional[int] = None) -> int:
    """Length of one owner's phase-2 message in ``balanced`` (see :mod:`.balanced`)."""
    c = phase2_capacity(world_size, numel, capacity, widest_region)
    return balanced_message_nbytes(c, int(value_bytes))


def costs(f: BucketFigures, alpha_bytes: float = 0.0) -> Dict[str, float]:
    """Per-rank link bytes of each strategy for one bucket (see the module docstring)."""
    P, N = int(f.world_size), int(f.numel)
    if P < 1 or N < 0:
        raise ValueError(f"cost model: world_size must be >= 1 and numel >= 0, got "
                         f"P={P}, N={N}")
    frac = (P - 1) / P
    pair = INDEX_BYTES + f.sparse_value_bytes
    # an earlier exchange predicts this one only if it had the same layout: after a
    # step that sent the bucket at another capacity (a dense step: the Adam recipe's
    # variance refresh, Slim-DP's push, a compressor's warm-up) its counts say nothing
    # (a sparse history would price a dense step's split at the sparse step's bytes)
    same = f.prev_capacity is None or int(f.prev_capacity) == int(f.capacity)
    prev_pairs = f.prev_pairs if same else None
    prev_reduced = f.prev_reduced if same else None
    k = f.capacity if prev_pairs is None else min(float(prev_pairs), float(f.capacity))
    K = min(N, P * k) if prev_reduced is None else min(N, int(prev_reduced))
    q = split_dense_value_bytes(f.split_dense_bits, f.quant_bucket)
    out = {
        "allgather": (P - 1) * float(f.wire_nbytes) + alpha_bytes * (P - 1),
        "split": frac * (k * pair) + frac * (min(K * pair, N * q) + P * SPLIT_HEADER_BYTES)
        + alpha_bytes * 2 * (P - 1),
        "dense": 2.0 * frac * N * f.dense_value_bytes + alpha_bytes * 2 * (P - 1),
        "balanced": frac * (k * pair) + (P - 1) * float(balanced_phase2_nbytes(
            P, N, f.capacity, f.sparse_value_bytes, -(-N // P)))
        + alpha_bytes * 2 * (P - 1),
    }
    if P == 1:
        out = {s: 0.0 for s in STRATEGIES}
    return out


def auto_strategies(device_path: bool) -> Tuple[str, ...]:
    """What ``auto`` chooses among for a bucket: ``HOST_SIZED`` when its tensors take the
    device (CUDA / Triton) code path (see the module docstring; the forced-Triton CPU
    path emulates it), every strategy on the CPU path."""
    return HOST_SIZED if device_path else STRATEGIES


def choose(f: BucketFigures, allowed: Tuple[str, ...] = STRATEGIES,
           alpha_bytes: float = 0.0) -> str:
    """The cheapest allowed strategy (ties: allgather, split, dense, balanced). ``split``
    must beat an allowed ``allgather`` by the factor ``SPLIT_MARGIN``; the lossy
    ``balanced`` must beat the cheapest allowed exact strategy by the factor
    ``LOSSY_MARGIN``: a truncating exchange is worth it only for a clear saving (at
    P = 2 it moves about what allgather moves, and drops part of the sum; at P = 3 two
    thirds; at P = 4 half, which measured slower than allgather on the CPU path)."""
    c = costs(f, alpha_bytes)
    eff = dict(c)
    if "allgather" in allowed and c["split"] >= SPLIT_MARGIN * c["allgather"]:
        eff["split"] = float("inf")          # not a clear enough saving: see SPLIT_MARGIN
    best = None
    for s in EXACT_STRATEGIES:
        if s in allowed and (best is None or eff[s] < eff[best]):
            best = s
    # balanced is measured against the cheapest exact strategy by bytes alone (split
    # included even where SPLIT_MARGIN passes it over): it must save clearly on both
    exact = [c[s] for s in EXACT_STRATEGIES if s in allowed]
    if "balanced" in allowed and (not exact or c["balanced"] < LOSSY_MARGIN * min(exact)):
        best = "balanced"
    if best is None:
        raise ValueError(f"cost model: no allowed strategy among {allowed!r}; "
                         f"choose from {STRATEGIES}")
    return best


def dense_allreduce_bytes(world_size: int, numel: int, value_bytes: int = 4) -> float:
    """What a plain fp32 ring allreduce of ``numel`` elements moves per rank (the
    baseline that stats() compares against)."""
    P = int(world_size)
    return 0.0 if P <= 1 else 2.0 * (P - 1) / P * numel * value_bytes


__all__ = ["STRATEGIES", "EXACT_STRATEGIES", "SPLIT_MARGIN", "LOSSY_MARGIN", "phase2_capacity",
           "balanced_phase2_nbytes", "BucketFigures", "costs", "choose", "sparcml_delta",
           "split_dense_value_bytes", "dense_allreduce_bytes", "INDEX_BYTES",
           "HOST_SIZED", "auto_strategies"]
