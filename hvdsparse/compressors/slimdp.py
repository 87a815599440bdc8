"""Slim-DP: explore-exploit communication sets (slim-dp-explore-exploit.txt).

Per layer of ``n`` elements, each step sends the *communication set* ``T_C`` =

* **core** ``T_S``: the ``ceil(beta n)`` most significant elements,
  ``S_i = |w_i| + c |g_i|`` (Sec. 3.2, Eq. 1), re-selected every ``core_period`` (the
  paper's ``q``) steps from values identical on every rank: ``w`` = the synchronised
  weights (``param`` passed to ``compress`` on the re-selection step, or the last
  ``param`` passed to ``after_exchange``) and ``g`` = the last averaged gradient the
  optimizer passed to :meth:`SlimDP.after_exchange` (the paper likewise uses "an old
  version of gradients"). So every rank computes the same core; it is kept sorted by
  index and its values travel *in core order with no indices* (an IMPLICIT segment: the
  paper's key-caching filter);
* **explorer** ``T_R^k``: ``min(n - |core|, ceil((alpha - beta) n))`` indices drawn
  uniformly without replacement from outside the core, fresh every step and different
  on every rank (Philox keys from a per-rank seed, ``keys[core] = 2``, the
  ``|explorer|`` smallest keys), sent as index/value pairs (an INT32 segment).

Before every re-selection (``(t + 1) % q == 0``) the whole layer is pushed dense, as in
Algorithm 1 ("if (t+1)%q == 0: Push(delta)"), so the averaged gradient that feeds the
significance is complete (``dense_before_reselect=True``; not with ``core_period=1``,
where it would make every step dense -- the core then comes from the sparse average).

Wire cost (fp32 values, int32 indices): core ``beta n`` values + explorer
``(alpha - beta) n`` (index, value) pairs = ``beta n + 2 (alpha - beta) n =
(2 alpha - beta) n`` words per step -- the paper's figure exactly -- plus one 4-byte
count per segment, plus one dense push (``n`` words) every ``q`` steps. With
``values="fp16"`` etc. the value words shrink accordingly. If ``(2 alpha - beta) n``
words would not be smaller than the dense layer, the layer goes dense.

Deviations:

* **Error feedback on by default** (``error_feedback=True``): what is not in the
  communication set is kept in a residual and added to the next step's gradient; the
  paper drops it (``error_feedback=False`` reproduces that).
* **Parameter server -> all-to-all.** The paper pushes updates to a parameter server and
  pulls the communication set's weights; here all ranks decode all payloads and apply
  the same averaged update, so the weights stay identical and nothing is pulled.
* ``c="auto"`` (default): ``c = mean|w| / mean|g|`` computed from the same identical
  tensors, putting both terms "to the same scale" as the paper intends; a number sets
  ``c`` directly. Missing terms count as 0; with neither ``w`` nor ``g`` (first step,
  no ``param``) the core is a shared-seed random set (identical on all ranks).
"""
from __future__ import annotations

import math

import torch

from ..payload import FLOAT_BYTES, QUANT_BITS, IndexEncoding, LayerPayload, Segment
from .base import (uniform, PURPOSE_CORE, PURPOSE_EXPLORE, PURPOSE_QUANT, TINY, Compressor,
                   check_values)
from .topk import _check_bool, _check_quant_bucket, _wrap

__all__ = ["SlimDP"]


class SlimDP(Compressor):
    """``SlimDP(alpha, beta, core_period=1000, c="auto", error_feedback=True,
    values="fp32", quant_bucket=512, dense_before_reselect=True, **policy)``.

    ``alpha`` in (0, 1]: communication-set fraction; ``beta`` in [0, alpha]: core
    fraction; ``core_period`` (q) >= 1 steps between core re-selections; ``c`` > 0 or
    ``"auto"``. See the module docstring.
    """

    _settings = ("alpha", "beta", "core_period", "c", "error_feedback", "values",
                 "quant_bucket", "dense_before_reselect")

    def __init__(self, alpha: float, beta: float, core_period: int = 1000, c="auto",
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
        _check_bool(cfg["error_feedback"], "error_feedback", where)
        _check_bool(cfg["dense_before_reselect"], "dense_before_reselect", where)
        cfg["values"] = _wrap(check_values, cfg["values"], where)
        _check_quant_bucket(cfg["quant_bucket"], where)
        return cfg

    @staticmethod
    def sizes(n: int, alpha: float, beta: float):
        """(core size, explorer size) for a layer of n elements."""
        core = min(n, math.ceil(beta * n - 1e-9)) if beta > 0 else 0
        ex = min(n - core, max(0, math.ceil((alpha - beta) * n - 1e-9)))
        if core + ex == 0:
            ex = 1
        return core, ex

    def core(self, name: str):
        """The layer's current core indices (int64, ascending) or None."""
        st = self._layers.get(name)
        return None if st is None else st.get("core")

    def after_exchange(self, name, averaged_grad, step, param=None):
        """Keep the averaged gradient (and weights) that the next re-selection needs:
        stored only when ``(step + 1) % core_period == 0`` or the layer has no core yet."""
        if self.policy.is_dense(name, averaged_grad.shape):
            return
        cfg = self.layer_cfg(name)
        st = self._layers.setdefault(name, dict(core=None, core_step=None, grad=None,
                                                param=None))
        if (step + 1) % cfg["core_period"] == 0 or st["core"] is None:
            st["grad"] = averaged_grad.detach().reshape(-1).float().clone()
            if param is not None:
                st["param"] = param.detach().reshape(-1).float().clone()

    def _select_core(self, name, n, core_size, step, cfg, param, device):
        st = self._layers[name]
        w = param.detach().reshape(-1).float().to(device) if param is not None else (
            st["param"].to(device) if st["param"] is not None else None)
        g = st["grad"].to(device) if st["grad"] is not None else None
        if w is None and g is None:
            S = uniform(self._seed(name, step, PURPOSE_CORE, shared=True), n, device)
        else:
            aw = w.abs() if w is not None else None
            ag = g.abs() if g is not None else None
            if aw is None:
                S = ag
            elif ag is None:
                S = aw
            else:
                if cfg["c"] == "auto":
                    mg = ag.mean()
                    c = torch.where(mg > 0, aw.mean() / mg.clamp_min(TINY),
                                    torch.ones((), device=device))
                else:
                    c = cfg["c"]
                S = aw + c * ag
        core = torch.topk(S, core_size, sorted=False).indices
        core = torch.sort(core).values
        st.update(core=core, core_step=step, grad=None, param=None)

    def _compress(self, name, flat, shape, step, cfg, param):
        n = flat.numel()
        enc = cfg["values"]
        ef = cfg["error_feedback"]
        qb = cfg["quant_bucket"]
        q = cfg["core_period"]
        core_size, ex_size = self.sizes(n, cfg["alpha"], cfg["beta"])
        qseed = self._seed(name, step, PURPOSE_QUANT)
        vb = FLOAT_BYTES[enc] if enc in FLOAT_BYTES else QUANT_BITS[enc] / 8.0
        worth = core_size * vb + ex_size * (4 + vb) < n * vb
        push_all = cfg["dense_before_reselect"] and q > 1 and (step + 1) % q == 0
        st = self._layers.setdefault(name, dict(core=None, core_step=None, grad=None,
                                                param=None))
        if push_all or not worth:
            acc, _ = self._acc(name, flat, None, ef)
            if param is not None and push_all:
                st["param"] = param.detach().reshape(-1).float().clone()
            return (self._dense_from_acc(name, acc, shape, enc, qseed, qb, ef),
                    dict(extra=dict(dense_push=push_all)))
        acc, _ = self._acc(name, flat, None, ef)
        dev = acc.device
        reselected = False
        if core_size and (st["core"] is None or
                          (step % q == 0 and st["core_step"] != step)):
            self._select_core(name, n, core_size, step, cfg, param, dev)
            reselected = True
        segs = []
        if core_size:
            core = st["core"].to(dev)
            st["core"] = core
            values, scales = self._take(acc, core, None, None, enc, qseed, qb, ef)
            segs.append(Segment(numel=n, capacity=core_size,
                                index_encoding=IndexEncoding.IMPLICIT, value_encoding=enc,
                                count=self._count(core_size, dev), values=values,
                                scales=scales, quant_bucket=qb, implicit_indices=core))
        if ex_size:
            keys = uniform(self._seed(name, step, PURPOSE_EXPLORE), n, dev)
            if core_size:
                keys[st["core"]] = 2.0
            ex = torch.topk(keys, ex_size, largest=False, sorted=False).indices
            ex = torch.sort(ex).values
            values, scales = self._take(acc, ex, None, None, enc, qseed ^ 0x1, qb, ef)
            segs.append(Segment(numel=n, capacity=ex_size, index_encoding=IndexEncoding.INT32,
                                value_encoding=enc, count=self._count(ex_size, dev),
                                values=values, indices=ex.to(torch.int32), scales=scales,
                                quant_bucket=qb))
        return LayerPayload(name, shape, segs), dict(extra=dict(reselected=reselected))
