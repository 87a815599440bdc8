"""Density warm-up schedules: start dense, reach the target density over ``T`` steps.

A schedule maps ``(step, target_density) -> density`` with ``density(step) == 1`` at
``step == 0`` and ``density(step) == target`` for ``step >= T``. It depends on nothing
but the step, so every rank computes the same density and hence the same capacity.

Two forms from the seeds / peer systems:

* :class:`RtWarmup` (local-gradients-with-sparse-global.txt, Sec. 5.1): the *drop*
  ratio is ``R_t = R^max(1, T/t)`` with ``R = 1 - target`` (the paper: ``R = 0.99``,
  ``R_t = 0.99^max(1, T/t)``); density ``= 1 - R_t``. ``t`` is the 0-based step
  passed to ``compress``; ``t = 0`` means ``T/t = inf`` so ``R_0 = 0`` (dense).
  Example, target 0.01, T = 1000: t=1 -> R = 0.99^1000 = 4.3e-5 (density 0.99996),
  t=100 -> 0.99^10 = 0.904 (density 0.0956), t=500 -> 0.99^2 (density 0.0199),
  t >= 1000 -> density 0.01.
* :class:`ExponentialWarmup` (DGC's exponential ratio warm-up): the density falls
  geometrically from 1 to the target, ``density = target^(t/T)`` (continuous form), or
  in ``stages`` equal steps ``density = target^((s+1)/(stages+1))`` for stage
  ``s = floor(t * stages / T)``. With ``stages=4`` and target 0.001 this gives
  0.251, 0.063, 0.0158, 0.0040 and then 0.001, i.e. DGC's 25% / 6.25% / 1.5625% / 0.4%
  / 0.1% warm-up (Lin et al.), reproduced up to rounding.
"""
from __future__ import annotations

__all__ = ["WarmupSchedule", "RtWarmup", "ExponentialWarmup", "make_warmup"]


class WarmupSchedule:
    """Base class. ``T`` is the warm-up length in steps (``T >= 1``)."""

    def __init__(self, T: int):
        if not isinstance(T, int) or isinstance(T, bool) or T < 1:
            raise ValueError(f"warm-up length T must be an int >= 1, got {T!r}")
        self.T = T

    def density(self, step: int, target: float) -> float:
        raise NotImplementedError

    def __call__(self, step: int, target: float) -> float:
        if step >= self.T:
            return float(target)
        d = self.density(max(int(step), 0), float(target))
        return float(min(1.0, max(float(target), d)))

    def config(self) -> dict:
        return dict(kind=type(self).__name__, T=self.T)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "kind")
        return f"{type(self).__name__}({args})"


class RtWarmup(WarmupSchedule):
    """``density(t) = 1 - (1 - target)^max(1, T/t)``, ``density(0) = 1``.

    The local-gradients paper's drop-ratio warm-up ``R_t = 0.99^max(1, T/t)``,
    generalised from a 0.99 drop ratio to ``1 - target``.
    """

    def density(self, step, target):
        if step == 0:
            return 1.0
        R = 1.0 - target
        return 1.0 - R ** max(1.0, self.T / step)


class ExponentialWarmup(WarmupSchedule):
    """DGC-style exponential density warm-up (see module docstring).

    ``stages=None``: ``density(t) = target^(t/T)``;
    ``stages=S``: ``density(t) = target^((s+1)/(S+1))``, ``s = floor(t*S/T)``.
    """

    def __init__(self, T: int, stages=None):
        super().__init__(T)
        if stages is not None and (not isinstance(stages, int) or isinstance(stages, bool)
                                   or stages < 1):
            raise ValueError(f"stages must be None or an int >= 1, got {stages!r}")
        self.stages = stages

    def density(self, step, target):
        if self.stages is None:
            return target ** (step / self.T)
        s = (step * self.stages) // self.T
        return target ** ((s + 1) / (self.stages + 1))

    def config(self) -> dict:
        return dict(kind=type(self).__name__, T=self.T, stages=self.stages)


def make_warmup(spec):
    """``None`` | a :class:`WarmupSchedule` | ``("rt", T)`` | ``("exp", T[, stages])``
    | a config dict from :meth:`WarmupSchedule.config`."""
    if spec is None or isinstance(spec, WarmupSchedule):
        return spec
    if isinstance(spec, dict):
        kw = dict(spec)
        kind = kw.pop("kind")
        cls = {"RtWarmup": RtWarmup, "ExponentialWarmup": ExponentialWarmup}.get(kind)
        if cls is None:
            raise ValueError(f"warmup: unknown schedule kind {kind!r}")
        return cls(**kw)
    if isinstance(spec, (tuple, list)) and spec and spec[0] in ("rt", "exp"):
        if spec[0] == "rt":
            return RtWarmup(*spec[1:])
        return ExponentialWarmup(*spec[1:])
    raise ValueError(f"warmup must be None, a WarmupSchedule, ('rt', T) or "
                     f"('exp', T[, stages]); got {spec!r}")


