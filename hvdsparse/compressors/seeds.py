"""Deterministic seeds and uniforms of the compressors.

Every random draw of a compressor is keyed by an integer seed computed on the host from
``(seed, step, crc32(name), purpose)`` -- plus the rank for per-rank randomness -- by
:func:`mix_seed` (a splitmix64 chain: stable across processes and platforms, unlike
Python's ``hash``). The ``PURPOSE_*`` codes keep the streams of one layer and step
apart. :func:`uniform` turns a seed into fp32 uniforms on the layer's device.
"""
from __future__ import annotations

import zlib

import torch

from .. import ops


_MASK64 = (1 << 64) - 1

#: purpose codes mixed into seeds
PURPOSE_QUANT = 1
PURPOSE_SAMPLE = 2
PURPOSE_INDICES = 3
PURPOSE_EXPLORE = 4
PURPOSE_CORE = 5


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_seed(*parts: int) -> int:
    """Hash integers into a 31-bit non-negative seed (splitmix64 chain); stable across
    processes and platforms (unlike Python's ``hash``)."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h & 0x7FFFFFFF


def uniform(seed: int, n: int, device) -> torch.Tensor:
    """fp32[n] uniforms in [0, 1) determined by ``seed``: on CUDA
    ``ops.philox_uniform`` (one Triton Philox kernel, no host sync); on CPU torch's own
    generator seeded with ``seed`` (``ops``' bit-exact torch Philox reference costs
    ~10x more). Ranks that must agree (shared seeds) therefore need the same device
    type, which data-parallel ranks have."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cpu":
        g = torch.Generator()
        g.manual_seed(seed)
        return torch.rand(n, generator=g, dtype=torch.float32)
    return ops.philox_uniform(seed, n, device=device)


def name_hash(name: str) -> int:
    return zlib.crc32(name.encode("utf-8"))
