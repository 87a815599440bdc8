"""The Adam recipe's checkpoint (:class:`RecipeCheckpoint`, a mixin of
:class:`hvdsparse.adam.AdamRecipe`): ``state_dict()`` holds the recipe's settings
(``T_w``, ``R``, ``S``, the wire, the refresh's source) and this rank's local-refresh
statistics per layer (the window's ``A``, ``B`` and the carried gradient, copies);
``load_state_dict()`` continues with the saved refresh schedule (the frozen variance's
bias correction counts its refreshes), warns when the other settings differ, checks
every saved tensor against its parameter, and makes the recipe re-read every layer's
phase. Adam's own ``m``, ``v`` and ``step`` are in ``optimizer.state_dict()``.

Contract with :class:`~hvdsparse.adam.AdamRecipe`: it reads and sets ``warmup``,
``refresh``, ``refresh_start``, ``wire``, ``refresh_from``, ``params``, the statistics
dicts ``_acc``, ``_gsum``, ``_carry``, ``_pend`` and calls ``forget()``.
"""
from __future__ import annotations

import torch


class RecipeCheckpoint:
    """``state_dict`` / ``load_state_dict`` of the recipe (see the module docstring)."""

    def _local_state(self):
        """The per-rank local-refresh dicts a checkpoint holds, by their saved key."""
        return (("acc", self._acc), ("gsum", self._gsum), ("carry", self._carry))

    def state_dict(self) -> dict:
        """Settings, plus this rank's local refresh statistics (``refresh_from="local"``:
        per layer the window's ``A``, ``B`` and the carried gradient, copies)."""
        local = {}
        for key, d in self._local_state():
            for name, t in d.items():
                local.setdefault(name, {})[key] = t.detach().clone()
        return dict(warmup=self.warmup, refresh=self.refresh, wire=self.wire,
                    refresh_from=self.refresh_from, refresh_start=self.refresh_start,
                    local=local)

    def load_state_dict(self, sd: dict):
        import warnings
        saved = sd.get("warmup")
        if saved is not None and int(saved) != self.warmup:
            warnings.warn(f"hvdsparse: the compression state was saved with adam_warmup="
                          f"{saved}; this run uses {self.warmup} (parameters whose step is "
                          f"past {self.warmup} use the frozen variance)")
        # the refresh schedule is part of what v means (its bias correction counts the
        # refreshes done): a run continues with the schedule it was saved with (a
        # checkpoint without the keys predates them: v frozen / windows from T_w)
        saved_sched = (sd.get("refresh"), sd.get("refresh_start"))
        if saved_sched != (self.refresh, self.refresh_start):
            warnings.warn(f"hvdsparse: the compression state was saved with adam_refresh="
                          f"{saved_sched[0]}, adam_refresh_start={saved_sched[1]}; this "
                          f"run was set up with {self.refresh}, {self.refresh_start} and "
                          f"continues with the saved schedule (the frozen variance's "
                          f"bias correction counts its refreshes)")
            self.refresh, self.refresh_start = saved_sched
        if "wire" in sd and sd["wire"] != self.wire:
            warnings.warn(f"hvdsparse: the compression state was saved with the Adam "
                          f"recipe's wire={sd['wire']!r}; this run uses {self.wire!r} (the "
                          f"residuals hold the other quantity)")
        if sd.get("refresh_from", "sample") != self.refresh_from:
            warnings.warn(f"hvdsparse: the compression state was saved with the Adam "
                          f"recipe's refresh_from={sd.get('refresh_from', 'sample')!r}; "
                          f"this run uses {self.refresh_from!r}")
        self._acc, self._gsum, self._carry, self._pend = {}, {}, {}, {}
        for name, entry in sd.get("local", {}).items():
            if name not in self.params:
                raise ValueError(f"hvdsparse: the Adam recipe's saved state names layer "
                                 f"{name!r}, which this optimizer does not have")
            p = self.params[name]
            for key, d in self._local_state():
                if key in entry:
                    t = entry[key]
                    if tuple(t.shape) != tuple(p.shape):
                        raise ValueError(f"hvdsparse: the Adam recipe's saved {key} of "
                                         f"layer {name!r} has shape {tuple(t.shape)}, the "
                                         f"parameter {tuple(p.shape)}")
                    d[name] = t.detach().to(device=p.device, dtype=torch.float32).clone()
        self.forget()
