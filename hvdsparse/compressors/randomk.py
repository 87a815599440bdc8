"""Random-k sparsification with error feedback.

Per layer and step ``k = ceil(d_t n)`` indices, one in each of ``k`` strata: stratum ``j``
is ``[lo_j, lo_{j+1})`` with ``lo_j = floor(j n / k)`` (sizes ``floor(n/k)`` or
``ceil(n/k)``), and its index is

    m_j = int(u_j * 2**31)                 (u = ops.philox_uniform(seed, k): fp32 in
                                            [0, 1), the same bits on every device; the
                                            scaling by 2**31 is exact)
    i_j = lo_j + ((m_j * size_j) >> 31)    (int64: exact, i_j < lo_{j+1})

so the indices are distinct and ascending, every element is sent with probability
``1 / size_j`` (= ``k / n`` when ``k`` divides ``n``), and the whole draw costs ``k``
random numbers and a few integer operations per slot, with no sort: the bucket path
(``kernels/bucket_randomk.py``) draws every layer of a bucket in one launch, the same
bits. The draw does not depend on the device, so ranks on CPUs and GPUs agree.
(Stratified rather than a uniform ``k``-subset of the layer: two sent elements never
share a stratum; the marginals, and so error feedback's and the unbiased estimate's
guarantees, are the same.)

``acc = residual + grad`` is sent on those indices and the residual keeps the rest
(``error_feedback=True``, default). Without error feedback each value is scaled by its
stratum's size, ``E[sent] = grad`` (the classic unbiased random-k sparsifier), and
nothing is remembered.

``shared_seed=False``: the seed mixes in the rank -> every rank picks its own indices,
sent as INT32. ``shared_seed=True``: the seed is ``(seed, step, name)`` only -> every rank
picks the same indices, which therefore need not travel: an IMPLICIT segment (values
in ascending index order, ``implicit_indices`` for the local decoder).

Capacity ``k`` (exactly ``k`` sent every step); warm-up as in :mod:`.topk`.
"""
from __future__ import annotations

import torch

from .. import ops
from ..payload import IndexEncoding, LayerPayload, Segment
from .base import PURPOSE_INDICES, PURPOSE_QUANT, Compressor, check_values, k_of
from .checks import check_bool, check_density, check_quant_bucket, prefixed
from .warmup import make_warmup

__all__ = ["RandomK", "stratified_indices"]


def _strata(n: int, k: int, device=None):
    """``(lo, size)``: int64[k] start and size of each of the ``k`` strata of ``n``
    elements, ``lo_j = floor(j n / k)``."""
    j = torch.arange(k + 1, dtype=torch.int64, device=device)
    bounds = torch.div(j * n, k, rounding_mode="floor")
    return bounds[:-1], bounds[1:] - bounds[:-1]


def stratified_indices(u: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """int64[k]: index ``lo_j + ((int(u_j * 2**31) * size_j) >> 31)`` of stratum ``j``
    for the fp32 uniforms ``u[k]`` (see the module docstring); ascending, distinct."""
    lo, size = _strata(n, k, u.device)
    m = (u * 2147483648.0).to(torch.int64)
    return lo + torch.bitwise_right_shift(m * size, 31)


def stratum_sizes(n: int, k: int, device=None) -> torch.Tensor:
    """int64[k]: the size of each of the ``k`` strata of a layer of ``n`` elements."""
    return _strata(n, k, device)[1]


class RandomK(Compressor):
    """``RandomK(ratio, shared_seed=False, values="fp32", quant_bucket=512, warmup=None,
    error_feedback=True, **policy)``; see the module docstring."""

    _settings = ("ratio", "shared_seed", "values", "quant_bucket", "error_feedback")

    def __init__(self, ratio: float, shared_seed: bool = False, values="fp32",
                 quant_bucket: int = 512, warmup=None, error_feedback: bool = True, **kw):
        super().__init__(**kw)
        cfg = self._validate_cfg(dict(ratio=ratio, shared_seed=shared_seed, values=values,
                                      quant_bucket=quant_bucket,
                                      error_feedback=error_feedback))
        for key, v in cfg.items():
            setattr(self, key, v)
        self.warmup = make_warmup(warmup)
        self._validate_overrides()

    def _validate_cfg(self, cfg, where=""):
        cfg = dict(cfg)
        cfg["ratio"] = check_density(cfg["ratio"], where + "ratio")
        check_bool(cfg["shared_seed"], "shared_seed", where)
        cfg["values"] = prefixed(check_values, cfg["values"], where)
        check_quant_bucket(cfg["quant_bucket"], where)
        check_bool(cfg["error_feedback"], "error_feedback", where)
        return cfg

    def _target_density(self, name: str) -> float:
        return self.layer_cfg(name)["ratio"]

    def density(self, step: int, ratio=None) -> float:
        ratio = self.ratio if ratio is None else ratio
        return self.warmup(step, ratio) if self.warmup is not None else ratio

    def indices(self, name: str, n: int, step: int, device=None) -> torch.Tensor:
        """The int64 indices (ascending) this rank selects for layer ``name`` at ``step``."""
        cfg = self.layer_cfg(name)
        k = k_of(self.density(step, cfg["ratio"]), n)
        seed = self._seed(name, step, PURPOSE_INDICES, shared=cfg["shared_seed"])
        return stratified_indices(ops.philox_uniform(seed, k, device=device), n, k)

    def _compress(self, name, flat, shape, step, cfg, param):
        n = flat.numel()
        enc = cfg["values"]
        ef = cfg["error_feedback"]
        qb = cfg["quant_bucket"]
        d = self.density(step, cfg["ratio"])
        k = k_of(d, n)
        qseed = self._seed(name, step, PURPOSE_QUANT)
        shared = cfg["shared_seed"]
        ib = 0.0 if shared else 4.0
        if not self._sparse_is_worth_it(n, k, enc, ib):
            return self._send_all(name, flat, shape, enc, qseed, qb, ef), dict(density=d)
        acc, _ = self._acc(name, flat, None, ef)
        idx = self.indices(name, n, step, device=acc.device)
        if not ef:
            # unbiased: each sent value times 1 / its probability of being sent
            acc[idx] = acc[idx] * stratum_sizes(n, k, acc.device).to(torch.float32)
        values, scales = self._take(acc, idx, None, None, enc, qseed, qb, ef)
        count = self._count(k, acc.device)
        if shared:
            seg = Segment(numel=n, capacity=k, index_encoding=IndexEncoding.IMPLICIT,
                          value_encoding=enc, count=count, values=values, scales=scales,
                          quant_bucket=qb, implicit_indices=idx)
        else:
            seg = Segment(numel=n, capacity=k, index_encoding=IndexEncoding.INT32,
                          value_encoding=enc, count=count, values=values,
                          indices=idx.to(torch.int32), scales=scales, quant_bucket=qb,
                          narrow_indices=True)
        return LayerPayload(name, shape, [seg]), dict(density=d)
