"""Argument checks shared by the compressors' constructors and per-layer options: each
returns the validated value or raises ``ValueError`` naming the argument (``where``
prefixes the message with the caller's context, e.g. the layer pattern of a
``LayerPolicy`` override)."""
from __future__ import annotations

import math

__all__ = ["check_bool", "check_density", "check_fresh_weight", "check_quant_bucket",
           "prefixed"]


def check_bool(x, arg, where=""):
    """``x`` when it is a bool (not merely truthy)."""
    if not isinstance(x, bool):
        raise ValueError(f"{where}{arg} must be a bool, got {x!r}")
    return x


def check_quant_bucket(x, where=""):
    """``x`` when it is an int >= 1 (elements per quantisation scale)."""
    if not isinstance(x, int) or isinstance(x, bool) or x < 1:
        raise ValueError(f"{where}quant_bucket must be an int >= 1, got {x!r}")
    return x


def check_fresh_weight(w, where=""):
    """``None`` or ``float(w)`` for a number in [0, 16] (the weight of the newest input
    in a ``|acc + w x|`` ranking)."""
    if w is None:
        return None
    if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0.0 <= w <= 16.0:
        raise ValueError(f"{where}fresh_weight must be None or a number in [0, 16], "
                         f"got {w!r}")
    return float(w)


def check_density(x, argname):
    """``float(x)`` when ``x`` is a finite number in (0, 1]."""
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) \
            or not 0.0 < x <= 1.0:
        raise ValueError(f"{argname} must be a number in (0, 1], got {x!r}")
    return float(x)


def prefixed(fn, x, where):
    """``fn(x)``, its ``ValueError`` re-raised with ``where`` in front of the message."""
    try:
        return fn(x)
    except ValueError as e:
        raise ValueError(f"{where}{e}") from None
