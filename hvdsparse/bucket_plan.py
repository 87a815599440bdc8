"""Buckets across steps: the plan that groups layers into buckets (the same on every
rank), agreed at the first step (:func:`agree_plan`), and each bucket's history of
cost-model figures, which ``auto`` reads two steps late so that choosing a strategy
never waits on the device.
"""
from __future__ import annotations

from collections import deque
from typing import Dict, List, NamedTuple

from . import codec

__all__ = ["plan_buckets", "agree_plan", "AgreedPlan", "steady_size", "BucketHistory",
           "saved_figures"]


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


class AgreedPlan(NamedTuple):
    """The first step's outcome, the same on every rank: ``sparse``, the layers sparse
    on some rank (sparse everywhere from now on); ``order``, rank 0's ready order of the
    dense layers; ``plan``, the buckets (:func:`plan_buckets` over ``order``);
    ``numels``, rank 0's parameter sizes."""
    sparse: set
    order: List[str]
    plan: List[List[str]]
    numels: Dict[str, int]


def steady_size(engine, name: str, param, step: int) -> int:
    """Encoded bytes of layer ``name``'s payload once warm-up is over (from step
    ``max(compressor.steady_state_step(), step)``: the plan is made for the steady
    state, not for a dense warm-up step), from its absent payload's layout."""
    payload = engine.compress_absent(
        name, param.detach(), max(int(engine.compressor.steady_state_step()), step))
    return codec.encoded_nbytes([payload])


def agree_plan(engine, params, ready: List[str], sparse, fingerprint: dict, step: int,
               fusion_threshold: int) -> AgreedPlan:
    """First step of the Horovod door: every rank's settings ``fingerprint``, parameter
    sizes (``params``: name -> parameter), dense ready order ``ready``, steady-state
    payload sizes (:func:`steady_size`) and ``sparse`` layers are allgathered and
    compared with rank 0's (``engine.agree``: the same ``ValueError`` on every rank);
    the plan is rank 0's order without the layers sparse on any rank, closed greedily at
    ``fusion_threshold`` encoded bytes."""
    mine = dict(order=list(ready), sizes={n: steady_size(engine, n, params[n], step)
                                          for n in ready},
                numels={n: int(params[n].numel()) for n in params},
                sparse=sorted(sparse), fingerprint=fingerprint)

    def sizes_differ(everyone):
        ref, sparse = everyone[0], set().union(*(set(d["sparse"]) for d in everyone))
        return [f"parameter {n!r}: encoded payload is {d['sizes'][n]} bytes on rank "
                f"{r} but {ref['sizes'][n]} on rank 0 (compressor settings differ "
                f"across ranks?)"
                for r, d in enumerate(everyone) if set(d["numels"]) == set(ref["numels"])
                for n in ref["order"]
                if n not in sparse and n in d["sizes"] and d["sizes"][n] != ref["sizes"][n]]
    everyone = engine.agree(mine, "plan", sizes_differ)
    ref = everyone[0]
    union = set().union(*(set(d["sparse"]) for d in everyone))
    order = [n for n in ref["order"] if n not in union]
    sizes = {n: ref["sizes"][n] for n in order}
    return AgreedPlan(union, order, plan_buckets(order, sizes, fusion_threshold),
                      ref["numels"])


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


def saved_figures(saved) -> list:
    """A saved history entry as :meth:`BucketHistory.load` takes it: a list of figure
    dicts (oldest first); an entry that holds one exchange's ``(pairs, reduced[,
    capacity])`` gives that exchange for both slots."""
    if saved is None:
        return []
    if isinstance(saved, (tuple, list)) and saved and not isinstance(saved[0], dict):
        saved = tuple(saved) + (None,) * (3 - len(saved))
        figs = {k: v for k, v in zip(("pairs", "reduced", "capacity"), saved)
                if v is not None}
        return [figs, figs]
    return [dict(f) for f in saved]
