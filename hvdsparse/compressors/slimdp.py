"""Slim-DP: explore-exploit communication sets (slim-dp-explore-exploit.txt).

Per layer of ``n`` elements, each step sends the *communication set* ``T_C`` =

* **core** ``T_S``: the ``ceil(beta n)`` most significant elements,
  ``S_i = |w_i| + c |g_i|`` (Sec. 3.2, Eq. 1), re-selected every ``core_period`` (the
  paper's ``q``; default 100, see "Default q" below) steps. It is kept sorted by index and its values travel *in core order
  with no indices* (an IMPLICIT segment: the paper's key-caching filter), so every rank
  must hold the same core -- guaranteed by construction, not by equal inputs:

  - **re-selection** happens in :meth:`SlimDP.after_exchange` at the end of step ``t``
    with ``(t + 1) % q == 0`` (and at the end of step 0), the core serving steps
    ``t + 1 ...``. Rank 0 computes ``S`` from the averaged gradient ``g`` of that step
    (identical on all ranks) and its own weights ``w`` (the ``param`` passed to
    ``after_exchange``, before the step's update; the paper uses the server's weights
    after it), takes the top ``ceil(beta n)`` and **broadcasts** the indices with the
    ``broadcast`` callable given to ``bind`` -- so ranks whose weights differ
    (``local_gradient``, or replicas that drifted in the last bit) still agree. Cost:
    one blocking broadcast of ``ceil(beta n)`` int64 per layer and re-selection, i.e.
    one host synchronisation every ``q`` steps (every step with ``q = 1``);
  - a layer with no core yet (a run resumed without compressor state, or
    ``dense_before_reselect=False``'s step 0) uses a random core from a shared seed
    that does not depend on the step (identical on every rank, and in
    ``compress_absent``) until its first re-selection;

* **explorer** ``T_R^k``: ``e = min(n - |core|, ceil((alpha - beta) n))`` indices from
  outside the core, fresh every step and different on every rank, sent as index/value
  pairs (an INT32 segment). The ``m = n - |core|`` elements outside the core, in index
  order, are cut into ``e`` strata and one is drawn per stratum by RandomK's exact
  integer rule (:func:`.randomk.stratified_indices`, ``u = ops.philox_uniform(seed,
  e)`` from a per-rank seed): complement positions ``p_t``, ascending and distinct; the
  ``p``-th element outside the sorted core ``c`` is index ``p + #{j : c_j - j <= p}``
  (``c_j - j`` is non-decreasing: one binary search per slot). Every element outside
  the core is sent with probability ``1 / (its stratum's size)`` (``e / m`` when ``e``
  divides ``m``: the paper's uniform draw's marginals), with ``e`` random numbers and no
  sort: the bucket path (``kernels/bucket_slimdp.py``) draws and gathers every layer of
  a bucket in one launch, the same bits, and ranks on CPUs and GPUs draw alike.

Before every re-selection (``(t + 1) % q == 0``) the whole layer is pushed dense, as in
Algorithm 1 ("if (t+1)%q == 0: Push(delta)"), so the averaged gradient that feeds the
significance is complete; step 0 is pushed dense as well, so the first core comes from
real data (the paper leaves the initial core open). With ``dense_before_reselect=False``
or ``core_period=1`` (where it would make every step dense) there are no dense pushes
and cores come from the sparse average. Which steps are dense depends on the step only,
so all ranks encode equal layouts.

Wire cost (fp32 values, int32 indices): core ``beta n`` values + explorer
``(alpha - beta) n`` (index, value) pairs = ``beta n + 2 (alpha - beta) n =
(2 alpha - beta) n`` words per step -- the paper's figure exactly -- plus one 4-byte
count per segment, plus one dense push (``n`` words) every ``q`` steps. With
``values="fp16"`` etc. the value words shrink accordingly. If ``(2 alpha - beta) n``
words would not be smaller than the dense layer, the layer goes dense.

Default q (measured): the paper's q = 20k-50k mini-batches
belongs to runs of a few hundred thousand steps (q ~ 5-10 % of the run). A default of
1000 never re-selects in a run of a few hundred steps, and the core stays the one chosen
from step 0's gradient and the initial weights: on the digits MLP (330 steps, 2 ranks,
3 seeds) that cost -3.7 pp against dense, q = 100 -0.4 pp, q = 25 +0.1 pp. The default
is ``core_period=100``: each period costs one dense push (+1 % of a dense step's bytes
per step, ~+1.2 % over Slim-DP's own) and one broadcast of the core indices.

Deviations:

* **Error feedback on by default** (``error_feedback=True``): what is not in the
  communication set is kept in a residual and added to the next step's gradient; the
  paper drops it (``error_feedback=False`` reproduces that).
* **Parameter server -> all-to-all.** The paper pushes updates to a parameter server and
  pulls the communication set's weights; here all ranks decode all payloads and apply
  the same averaged update, so nothing is pulled; the server's core decision is rank
  0's, broadcast.
* ``c="auto"`` (default): ``c = mean|w| / mean|g|`` (on rank 0), putting both terms "to
  the same scale" as the paper intends; a number sets ``c`` directly. Without ``param``
  the significance is ``|g|`` alone.
"""
from __future__ import annotations

import math

import torch

from .. import ops
from ..payload import FLOAT_BYTES, QUANT_BITS, IndexEncoding, LayerPayload, Segment
from .base import (uniform, PURPOSE_CORE, PURPOSE_EXPLORE, PURPOSE_QUANT, TINY, Compressor,
                   check_values)
from .checks import check_bool, check_quant_bucket, prefixed
from .randomk import stratified_indices

__all__ = ["SlimDP", "explorer_indices"]


class SlimDP(Compressor):
    """``SlimDP(alpha, beta, core_period=100, c="auto", error_feedback=True,
    values="fp32", quant_bucket=512, dense_before_reselect=True, **policy)``.

    ``alpha`` in (0, 1]: communication-set fraction; ``beta`` in [0, alpha]: core
    fraction; ``core_period`` (q) >= 1 steps between core re-selections; ``c`` > 0 or
    ``"auto"``. See the module docstring.
    """

    _settings = ("alpha", "beta", "core_period", "c", "error_feedback", "values",
                 "quant_bucket", "dense_before_reselect")

    def __init__(self, alpha: float, beta: float, core_period: int = 100, c="auto",
                 error_feedback: bool = True, values="fp32", quant_bucket: int = 512,
                 dense_before_reselect: bool = True, **kw):
        super().__init__(**kw)
        cfg = self._validate_cfg(dict(alpha=alpha, beta=beta, core_period=core_period, c=c,
                                      error_feedback=error_feedback, values=values,
                                      quant_bucket=quant_bucket,
                                      dense_before_reselect=dense_before_reselect))
        for key, v in cfg.items():
            setattr(self, key, v)
        self._validate_overrides()

    def _validate_cfg(self, cfg, where=""):
        cfg = dict(cfg)
        a = cfg["alpha"]
        if not isinstance(a, (int, float)) or isinstance(a, bool) or not math.isfinite(a) \
                or not 0.0 < a <= 1.0:
            raise ValueError(f"{where}alpha must be a number in (0, 1], got {a!r}")
        b = cfg["beta"]
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b) \
                or not 0.0 <= b <= a:
            raise ValueError(f"{where}beta must be a number in [0, alpha={a}], got {b!r}")
        cfg["alpha"], cfg["beta"] = float(a), float(b)
        q = cfg["core_period"]
        if not isinstance(q, int) or isinstance(q, bool) or q < 1:
            raise ValueError(f"{where}core_period must be an int >= 1, got {q!r}")
        c = cfg["c"]
        if not (c == "auto" or (isinstance(c, (int, float)) and not isinstance(c, bool)
                                and math.isfinite(c) and c > 0)):
            raise ValueError(f"{where}c must be a positive number or 'auto', got {c!r}")
        check_bool(cfg["error_feedback"], "error_feedback", where)
        check_bool(cfg["dense_before_reselect"], "dense_before_reselect", where)
        cfg["values"] = prefixed(check_values, cfg["values"], where)
        check_quant_bucket(cfg["quant_bucket"], where)
        return cfg

    @staticmethod
    def sizes(n: int, alpha: float, beta: float):
        """(core size, explorer size) for a layer of n elements."""
        core = min(n, math.ceil(beta * n - 1e-9)) if beta > 0 else 0
        ex = min(n - core, max(0, math.ceil((alpha - beta) * n - 1e-9)))
        if core + ex == 0:
            ex = 1
        return core, ex

    def bind(self, rank, world_size, *, broadcast=None, owner=None):
        """See :meth:`Compressor.bind`; with ``world_size > 1`` Slim-DP needs
        ``broadcast`` (rank 0 decides the core, every rank receives it)."""
        if world_size != 1 and broadcast is None:
            raise ValueError(f"{type(self).__name__}: bind(rank={rank}, world_size="
                             f"{world_size}) needs broadcast=callable(tensor, name) -> "
                             f"rank 0's tensor: the core is chosen on rank 0 and broadcast")
        return super().bind(rank, world_size, broadcast=broadcast, owner=owner)

    def core(self, name: str):
        """The layer's current core indices (int64, ascending) or None."""
        st = self._layers.get(name)
        return None if st is None else st.get("core")

    @staticmethod
    def _push_step(step: int, cfg: dict) -> bool:
        """Whole layer dense this step: before every re-selection (Algorithm 1) and at
        step 0 (whose averaged gradient chooses the first core)."""
        q = cfg["core_period"]
        return cfg["dense_before_reselect"] and q > 1 and ((step + 1) % q == 0 or step == 0)

    @staticmethod
    def _reselect_step(step: int, cfg: dict) -> bool:
        """A new core is chosen at the end of this step (for the steps after it)."""
        return (step + 1) % cfg["core_period"] == 0 or step == 0

    def steady_state_step(self) -> int:
        """A regular (core + explorer) step: every layout from it on equals this one's
        except the periodic dense pushes (every ``core_period``-th step)."""
        cfgs = self._all_cfgs()
        s = 0
        while any(self._push_step(s, c) for c in cfgs):
            s += 1
        return s

    def _worth(self, n, cfg):
        core_size, ex_size = self.sizes(n, cfg["alpha"], cfg["beta"])
        enc = cfg["values"]
        vb = FLOAT_BYTES[enc] if enc in FLOAT_BYTES else QUANT_BITS[enc] / 8.0
        return core_size * vb + ex_size * (4 + vb) < n * vb

    def after_exchange(self, name, averaged_grad, step, param=None):
        """At the end of a re-selection step (``(step + 1) % core_period == 0``, and
        step 0): rank 0 chooses the core for the following steps from the averaged
        gradient and its weights ``param`` and broadcasts it (one blocking broadcast
        of ``ceil(beta n)`` int64 per layer and re-selection: a host sync). Every rank
        must call this for the same layers in the same order."""
        if self.policy.is_dense(name, averaged_grad.shape):
            return
        cfg = self.layer_cfg(name)
        n = averaged_grad.numel()
        core_size, _ = self.sizes(n, cfg["alpha"], cfg["beta"])
        if not core_size or not self._worth(n, cfg) or not self._reselect_step(step, cfg):
            return
        self._touch(name)
        dev = averaged_grad.device
        if self.rank == 0:
            core = self._significant(averaged_grad, param, core_size, cfg)
        else:
            core = torch.zeros(core_size, dtype=torch.int64, device=dev)
        if self.world_size > 1:
            if self._broadcast is None:
                raise RuntimeError(f"{type(self).__name__}: layer {name!r}: world_size "
                                   f"{self.world_size} but no broadcast (see bind)")
            got = self._broadcast(core, f"hvdsparse.slimdp.core.{name}")
            if not isinstance(got, torch.Tensor) or got.numel() != core_size:
                raise RuntimeError(f"{type(self).__name__}: layer {name!r}: broadcast "
                                   f"returned {got!r}, expected {core_size} int64 indices")
            core = got.reshape(-1).to(device=dev, dtype=torch.int64)
        self._layers[name] = dict(core=core, core_step=step + 1)

    @staticmethod
    def _significant(g, param, core_size, cfg):
        """Indices (int64, ascending) of the ``core_size`` largest
        ``S = |w| + c |g|`` (Eq. 1); ``c="auto"``: ``mean|w| / mean|g|``."""
        ag = g.detach().reshape(-1).float().abs()
        if param is None:
            S = ag
        else:
            aw = param.detach().reshape(-1).float().to(ag.device).abs()
            if cfg["c"] == "auto":
                mg = ag.mean()
                c = torch.where(mg > 0, aw.mean() / mg.clamp_min(TINY),
                                torch.ones((), device=ag.device))
            else:
                c = cfg["c"]
            S = aw + c * ag
        core = torch.topk(S, core_size, sorted=False).indices
        return torch.sort(core).values

    def _random_core(self, name, n, core_size, device):
        """The core of a layer that has none yet (no re-selection has run for it):
        ``core_size`` indices from a shared seed that does not depend on the step, so
        every rank -- and compress_absent -- gets the same set by construction."""
        keys = uniform(self._seed(name, 0, PURPOSE_CORE, shared=True), n, device)
        return torch.sort(torch.topk(keys, core_size, largest=False, sorted=False).indices).values

    def _layer_core(self, name, n, core_size, device):
        """The layer's core on ``device`` (its random core the first time it has none)."""
        st = self._layers.get(name)
        core = None if st is None else st.get("core")
        if core is None:
            core = self._random_core(name, n, core_size, device)
            self._layers[name] = dict(core=core, core_step=None)
        elif core.device != device:
            core = core.to(device)
            self._layers[name] = dict(st, core=core)
        return core

    def _compress(self, name, flat, shape, step, cfg, param):
        n = flat.numel()
        enc = cfg["values"]
        ef = cfg["error_feedback"]
        qb = cfg["quant_bucket"]
        core_size, ex_size = self.sizes(n, cfg["alpha"], cfg["beta"])
        qseed = self._seed(name, step, PURPOSE_QUANT)
        push_all = self._push_step(step, cfg)
        if push_all or not self._worth(n, cfg):
            return (self._send_all(name, flat, shape, enc, qseed, qb, ef),
                    dict(extra=dict(dense_push=push_all)))
        acc, _ = self._acc(name, flat, None, ef)
        dev = acc.device
        segs = []
        core = None
        if core_size:
            core = self._layer_core(name, n, core_size, dev)
            values, scales = self._take(acc, core, None, None, enc, qseed, qb, ef)
            segs.append(Segment(numel=n, capacity=core_size,
                                index_encoding=IndexEncoding.IMPLICIT, value_encoding=enc,
                                count=self._count(core_size, dev), values=values,
                                scales=scales, quant_bucket=qb, implicit_indices=core))
        if ex_size:
            ex = self._explorer(name, step, n, core, ex_size, dev)
            values, scales = self._take(acc, ex, None, None, enc, qseed ^ 0x1, qb, ef)
            segs.append(Segment(numel=n, capacity=ex_size, index_encoding=IndexEncoding.INT32,
                                value_encoding=enc, count=self._count(ex_size, dev),
                                values=values, indices=ex.to(torch.int32), scales=scales,
                                quant_bucket=qb, narrow_indices=True))
        return LayerPayload(name, shape, segs), dict(extra=dict(dense_push=False))

    def _explorer(self, name, step, n, core, ex_size, device, shared=False):
        """This step's explorer: ``ex_size`` indices (int64, ascending), one per stratum
        of the elements outside ``core`` (:func:`explorer_indices`); from a per-rank
        seed, or the same on every rank with ``shared``."""
        seed = self._seed(name, step, PURPOSE_EXPLORE, shared=shared)
        return explorer_indices(ops.philox_uniform(seed, ex_size, device=device), n, core)


def explorer_indices(u: torch.Tensor, n: int, core) -> torch.Tensor:
    """int64[e] (``e = u.numel()``): the explorer of a layer of ``n`` elements whose core
    is ``core`` (int64, ascending, or None): complement positions ``p`` =
    ``stratified_indices(u, n - |core|, e)``, mapped to indices ``p + #{j : core_j - j <=
    p}``. Ascending, distinct, none in the core (see the module docstring)."""
    e = u.numel()
    nc = 0 if core is None else core.numel()
    if e > n - nc:
        raise ValueError(f"explorer_indices: {e} slots but only {n - nc} elements outside "
                         f"a core of {nc} in a layer of {n}")
    p = stratified_indices(u, n - nc, e)
    if not nc:
        return p
    gap = core - torch.arange(nc, dtype=torch.int64, device=core.device)
    return p + torch.searchsorted(gap, p, right=True)
