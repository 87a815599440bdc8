"""hvdsparse: sparse / quantised gradient exchange for Horovod + PyTorch.

Public names: the compressors (``TopK``, ``Threshold``, ``AdaComp``, ``SlimDP``,
``RandomK``, ``QSGD``, ``NoCompression``, warm-up schedules), :func:`DistributedOptimizer`
the routing hook, :class:`ExchangeSettings` (the options both front doors take),
:mod:`hvdsparse.ddp` (the same compressors as a DDP communication
hook for torchrun users) and :mod:`hvdsparse.mp` (DCT-MP thresholding at model-parallel
splits).

Importing this package installs the routing hook (:func:`install_routing`): the
attribute ``horovod.torch.DistributedOptimizer`` is replaced at runtime by a wrapper
that sends calls whose ``compression`` is an hvdsparse compressor to
:func:`hvdsparse.DistributedOptimizer` and passes every other call to Horovod's original
function unchanged. Horovod's installed files are never edited;
:func:`uninstall_routing` restores the original attribute.
"""
from . import adam, compressors, ddp, mp
from .compressors import (AdaComp, Compressor, ExponentialWarmup, LayerPolicy, NoCompression,
                          QSGD, RandomK, RtWarmup, SlimDP, Threshold, TopK, WarmupSchedule)
from .optimizer import (DistributedOptimizer, horovod_original, install_routing,
                        routed_distributed_optimizer, uninstall_routing)
from .settings import ExchangeSettings
from .version import __version__

install_routing()

__all__ = ["__version__", "ExchangeSettings", "adam", "compressors", "ddp", "mp", "Compressor", "TopK", "Threshold", "AdaComp", "SlimDP", "RandomK",
           "QSGD", "NoCompression", "LayerPolicy", "WarmupSchedule", "RtWarmup",
           "ExponentialWarmup", "DistributedOptimizer", "install_routing",
           "uninstall_routing", "routed_distributed_optimizer", "horovod_original"]
