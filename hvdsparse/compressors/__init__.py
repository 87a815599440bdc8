"""Compressors: what each rank sends per layer and step (see docs/design.md).

Every compressor has the interface the optimizer calls (details and guarantees in
:class:`~hvdsparse.compressors.base.Compressor`):

* once: ``bind(rank, world_size, *, broadcast=None, owner=None)`` (a second owner
  raises), ``check_names(names)`` (override patterns must match), ``config()`` (every
  argument; compare across ranks), ``steady_state_step()`` (plan buckets with
  ``compress_absent`` at that step);
* per step: ``begin_step(step)``; per layer ``compress(name, grad, step, param=None,
  grad_scale=None) -> LayerPayload`` (error feedback, warm-up, per-layer policy inside;
  NaN/Inf masked and counted into ``payload.nonfinite``; ``grad_scale`` = 1 / loss
  scale) or ``compress_absent(name, like, step, param=None)`` (no gradient: same
  layout, zero contribution, no state change); ``after_exchange(name, averaged_grad,
  step, param=None)`` per exchanged layer, same order on every rank (Slim-DP chooses
  and broadcasts its core there); then ``commit()`` or ``rollback()`` (with
  ``transactional=True`` the skipped step's residual/state changes are undone);
* ``state_dict()`` / ``load_state_dict(sd)``; ``stats()``.

Classes: :class:`TopK` (also SparCML's per-bucket top-k and quantised top-k),
:class:`Threshold` (DCT-DP), :class:`AdaComp`, :class:`SlimDP`, :class:`RandomK`,
:class:`QSGD`, :class:`NoCompression`; warm-up schedules :class:`RtWarmup`,
:class:`ExponentialWarmup`; :class:`LayerPolicy`.
"""
from .adacomp import AdaComp
from .base import Compressor
from .none import NoCompression
from .policy import LayerPolicy
from .qsgd import QSGD
from .randomk import RandomK
from .slimdp import SlimDP
from .threshold import Threshold
from .topk import TopK, estimate_topk_threshold
from .warmup import ExponentialWarmup, RtWarmup, WarmupSchedule

__all__ = ["Compressor", "TopK", "Threshold", "AdaComp", "SlimDP", "RandomK", "QSGD",
           "NoCompression", "LayerPolicy", "WarmupSchedule", "RtWarmup",
           "ExponentialWarmup", "estimate_topk_threshold"]
