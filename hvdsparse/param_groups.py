"""The current param group of a parameter, looked up at use time.

Why: ``torch.optim.Optimizer.load_state_dict`` replaces every param-group dict with a new
one (and ``add_param_group`` appends some), so a group dict captured when a wrapper was
built goes stale after a resume: changing its ``momentum`` would no longer change what
the optimizer does. The local updates (:mod:`hvdsparse.momentum`,
:mod:`hvdsparse.adam`) read and temporarily change hyper-parameters of the wrapped
optimizer's groups, so they ask this lookup every time instead.
"""
from __future__ import annotations

from typing import Dict, Iterable, List

import torch

__all__ = ["GroupLookup"]


class GroupLookup:
    """``of(p)``: ``p``'s group in ``optimizer.param_groups`` now. Cached by ``id(p)``;
    the cache is rebuilt when the cached dict is no longer one of the optimizer's groups."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._cache: Dict[int, dict] = {}

    def _rebuild(self):
        self._cache = {id(q): h for h in self.optimizer.param_groups for q in h["params"]}

    def of(self, p: torch.Tensor) -> dict:
        g = self._cache.get(id(p))
        if g is None or not any(g is h for h in self.optimizer.param_groups):
            self._rebuild()
            g = self._cache.get(id(p))
            if g is None:
                raise KeyError(f"parameter of shape {tuple(p.shape)} is not in any param "
                               f"group of the wrapped {type(self.optimizer).__name__}")
        return g

    def groups_of(self, params: Iterable[torch.Tensor]) -> List[dict]:
        """The distinct current groups holding ``params`` (in first-seen order)."""
        seen: Dict[int, dict] = {}
        for p in params:
            g = self.of(p)
            seen.setdefault(id(g), g)
        return list(seen.values())
