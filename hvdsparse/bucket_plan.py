"""Buckets across steps: the plan that groups layers into buckets (the same on every
rank) and each bucket's history of cost-model figures, which ``auto`` reads two steps
late so that choosing a strategy never waits on the device.
"""
from __future__ import annotations

from collections import deque
from typing import List

__all__ = ["plan_buckets", "BucketHistory", "saved_figures"]


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
