"""Deprecated name of :mod:`hvdsparse.cpu` (the optimised CPU path).

The module was split: the CPU path lives in :mod:`hvdsparse.cpu`, the Philox RNG in
:mod:`hvdsparse.philox`, and the plain definitions that tests compare against in
:mod:`hvdsparse.oracle`. ``import hvdsparse.reference`` still works and gives the
``hvdsparse.cpu`` module object itself (so attribute patches reach the real module).
"""
import sys

from . import cpu as _cpu

sys.modules[__name__] = _cpu
