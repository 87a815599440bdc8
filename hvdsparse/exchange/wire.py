"""Message-length arithmetic of the two-phase strategies, written once: ``split.py`` and
``balanced.py`` lay out their messages by it and ``cost_model.py`` prices them by it, so
the model and the wire cannot drift apart. Host integers only; imports nothing.

``balanced``'s phase-2 message (one per owner, the same length on every rank):
``L = 32 + 4 H + 4 c + pad4(c v)`` bytes for ``H`` histogram bins, ``c`` slots and
``v``-byte values; its layout is in :mod:`.balanced`'s docstring.
"""
from __future__ import annotations

__all__ = ["pad4", "BALANCED_HEADER_BYTES", "HIST_BINS", "balanced_message_nbytes"]

#: header of one ``balanced`` phase-2 message, bytes
BALANCED_HEADER_BYTES = 32
#: sub-bins per owner region in the phase-2 histogram (the rebalancing resolution)
HIST_BINS = 32


def pad4(n: int) -> int:
    """``n`` rounded up to a multiple of 4 (every message section starts 4-aligned)."""
    return (n + 3) & ~3


def balanced_message_nbytes(c: int, vb: int, hist_bins: int = HIST_BINS) -> int:
    """Length of one owner's ``balanced`` phase-2 message (module docstring)."""
    return BALANCED_HEADER_BYTES + 4 * hist_bins + 4 * c + pad4(c * vb)
