"""Compressors: what each rank sends per layer and step (see docs/design.md).

Every compressor has the interface the optimizer calls:

* ``compress(name, grad, step, param=None) -> LayerPayload`` (error feedback, warm-up,
  per-layer policy applied inside);
* ``after_exchange(name, averaged_grad, step, param=None)`` (Slim-DP's core input);
* ``bind(rank, world_size)``; ``state_dict()`` / ``load_state_dict(sd)``; ``stats()``.

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
