"""A compressor's configuration and checkpoint: :class:`CompressorState` gives
``config()`` (everything that determines what the compressor sends, as plain data
ranks can compare and ``torch.load(weights_only=True)`` can read), ``state_dict()`` and
``load_state_dict()`` (residuals, per-layer algorithm state, statistics: enough to
continue identically). Tensors are cloned both ways, so a state dict never aliases live
state.

:class:`CompressorState` is a mixin of :class:`~hvdsparse.compressors.base.Compressor`
and reads its attributes: ``_base_cfg()``, ``policy``, ``seed``, ``warmup`` (if any),
``_extra_args``, ``rank``, ``world_size``, ``_residuals``, ``_layers``, ``_stats`` and
``_txn`` (an open step stays open, with nothing snapshotted, across a load).
"""
from __future__ import annotations

import torch

from ..payload import ValueEncoding
from .encoding import value_name


def deep_clone(x):
    """Copy of a nest of dicts / lists / tuples whose tensors are detached clones, so a
    state dict never aliases live compressor state (and vice versa)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: deep_clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [deep_clone(v) for v in x]
    if isinstance(x, tuple):
        return tuple(deep_clone(v) for v in x)
    return x


def plain_data(x):
    """Plain data for configs: value encodings by name ("int4"), containers rebuilt, so
    a config compares across ranks and loads with ``torch.load(weights_only=True)``."""
    if isinstance(x, ValueEncoding):
        return value_name(x)
    if isinstance(x, dict):
        return {k: plain_data(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(plain_data(v) for v in x)
    return x


class CompressorState:
    """``config`` / ``state_dict`` / ``load_state_dict`` (see the module docstring)."""

    def config(self) -> dict:
        """Everything that determines what this compressor sends: type, every
        constructor argument (per-layer settings, policy with its overrides, warm-up,
        seed, other behaviour switches). Ranks must agree on it."""
        w = getattr(self, "warmup", None)
        return plain_data(dict(type=type(self).__name__, settings=self._base_cfg(),
                           policy=self.policy.config(), seed=self.seed,
                           warmup=None if w is None else w.config(),
                           args={k: getattr(self, k) for k in self._extra_args}))

    def comparable_settings(self, settings: dict) -> dict:
        """``settings`` as :meth:`load_state_dict` compares them (a default that follows
        the front door compared as the value in force)."""
        return settings

    def state_dict(self) -> dict:
        """Everything needed to continue identically: residuals, per-layer algorithm
        state (thresholds, cores, step counters), seed, statistics. Tensors are cloned."""
        return dict(type=type(self).__name__, version=1, config=self.config(),
                    rank=self.rank, world_size=self.world_size,
                    residuals={k: deep_clone(v) for k, v in self._residuals.items()},
                    layers=deep_clone(self._layers), stats=deep_clone(self._stats.state_dict()))

    def load_state_dict(self, sd: dict):
        if not isinstance(sd, dict) or "type" not in sd:
            raise ValueError("state_dict: not a compressor state dict")
        if sd["type"] != type(self).__name__:
            raise ValueError(f"state_dict: saved by {sd['type']}, cannot load into "
                             f"{type(self).__name__}")
        mine = self.config()
        saved = plain_data(sd["config"])
        if self.comparable_settings(saved["settings"]) != \
                self.comparable_settings(mine["settings"]) or saved["seed"] != mine["seed"]:
            raise ValueError(f"state_dict: settings differ (saved {sd['config']}, "
                             f"this compressor {mine})")

        self._residuals = {k: deep_clone(v).float() for k, v in sd["residuals"].items()}
        self._layers = deep_clone(sd["layers"])
        self._stats.load_state_dict(deep_clone(sd.get("stats", {})))
        self._txn = {} if self._txn is not None else None
