"""AdaComp: adaptive residual gradient compression
(adacomp-adaptive-residual-compression.txt, Algorithm 2 ``pack()``).

Per layer, bins of ``L`` consecutive elements (``bin_size``; default 50 for 4-D
convolution weights and 500 for everything else, as in the paper; last bin partial):

    G = residue + dW                        (fused: ops.residual_add_binmax)
    H = G + (scale - 1) dW                  (the paper's H = G + dW is scale = 2;
                                             the default here is 4, see below)
    gmax_b = max_{i in bin b} |G_i|
    send i  iff  |H_i| >= gmax_b            (local max compare)
    Q(G_i) = sign(G_i) * s,   s = mean_b gmax_b   (one scale per layer: the mean of the
                                                   bin maxima over all bins, summed in
                                                   kernels/segment_mean.py's order on
                                                   every path)
    residue_i = G_i - Q(G_i) if sent else G_i

Wire form: one segment, values SIGN1 (1 bit per slot, 1 = negative, ``G_i == 0``
counts as positive) with ``scales = [s]``; indices bin-relative, BIN_U8 when
``L <= 256`` else BIN_U16, slots sorted by bin with ``bin_counts[b]`` slots per bin.

Deviations (documented):

* **``scale = 4`` by default** (the paper's compare is ``scale = 2``). The compare
  decides how many elements of a bin travel, and with the messages' fixed capacity
  (below) the bytes on the wire do not depend on it. Measured (3 seeds, P = 4):
  on the char-LSTM with the Adam recipe the loss
  gap to dense Adam falls from +3.14% to +1.99% at 900 steps and from +2.21% to +0.30%
  at 300, at the same 20.4x fewer bytes; the digits MLP (SGD, momentum correction)
  gains 0.7 pp and the CNN stays within a test image of ``scale = 2``. There ``scale =
  2`` passed ~4 elements per 500-bin on the LSTM where 10 slots are paid for: exact
  fp32 values, more slots and larger bins did not help, letting more through did.

* **Fixed capacity.** The paper sends every element that passes the compare, a number
  that varies with the data ("typically up to 5 elements within each bin"). Messages
  here have a fixed size: at most ``max_per_bin`` slots per bin (default
  ``max(4, ceil(L / 50))``: 4 for L = 50, 10 for L = 500), capacity
  ``nbins * max_per_bin``. When more elements of a bin pass the compare, the
  ``max_per_bin`` with the largest ``|H|`` are sent (so the element holding ``gmax``
  on a zero-residue step -- ``|H| = 2 gmax``, the largest -- always is) and the others
  keep ``G`` in their residue (error feedback: deferred, not lost); ties in ``|H|`` go
  to the lower index. O(N), no global sort: on the CPU one chunked numpy pass plus a
  sort of the passing elements (``ops.binned_select``), on the Triton path two launches
  (``ops.binned_pack``, ``kernels/binned.py``; bins up to 4096 elements), elsewhere
  ``torch.topk(|H|.view(nbins, L), max_per_bin)`` (tie order unspecified there).
* **Layer budget** (``mean_per_bin``; off by default: measured at 3 / 5 / 7 slots, no
  setting won on every workload -- BENCHMARKS.md). Bins of one layer fill unevenly
  (a conv layer's 4 slots carry 2.3 on average in the digits CNN, an embedding's 10
  slots 2-3 in the text LM), so a fixed ``nbins * max_per_bin`` message travels partly
  empty. With ``mean_per_bin = a`` a layer's message holds ``B = min(nbins *
  max_per_bin, max(max_per_bin, ceil(a * nbins)))`` slots, and when its bins want more
  (``w_b = min(#pass_b, max_per_bin)``, ``sum w_b > B``) the slots are dealt one per bin
  per round, every round visiting the bins cyclically from bin ``rot``: bin ``b`` keeps
  its ``q_b`` largest ``|H|``, with ``q_b = min(w_b, r*) + [w_b > r* and rank_b <
  B - S(r*)]``, ``S(r) = sum_b min(w_b, r)``, ``r* = max {r : S(r) <= B}``
  (``oracle.bin_quota``). Fair: a bin cut short has at most one slot fewer than any
  other; ``rot = step * 2654435761 mod nbins`` moves the start each step, so the bins
  left one short change; what is not sent stays in the residue (deferred, not lost).
  The quota depends on the per-bin counts only: on the Triton path one launch between
  the count and the pack (``kernels/bin_quota.py``), on the CPU routes a cut of the
  selection (``binned.trim_to_quota``), the same bits.
* **Zero bins.** ``gmax`` is clamped to ``TINY``, so an all-zero bin sends nothing
  (the paper's ``>=`` against ``gmax = 0`` would send every element as ``+-s``).
* **Effective compression rate** (the paper's figure of merit) is reported per layer by
  :meth:`Compressor.stats` as ``effective_rate = 32 n / (8 * effective_bytes)`` with
  ``effective_bytes = sent * (index bytes + 1/8) + 4 (scale) + w * nbins (bin counts,
  ``w = payload.bin_count_width(L)``: 1 byte for L <= 255, else 2) + 4 (count)``;
  ``compression_rate`` uses the fixed capacity (what travels).
  ``stats()[name]["threshold"]`` is the layer scale ``s``; ``selected`` counts every
  element that passed the compare (before the per-bin cap), ``sent`` what travelled.
"""
from __future__ import annotations

import math
from fractions import Fraction

import torch

from ..payload import IndexEncoding, LayerPayload, Segment, ValueEncoding, bin_count_width
from .. import ops
from .base import TINY, Compressor, binned_rel, binned_topc, ceil_div, pack_signs
from .binned import trim_to_quota

__all__ = ["AdaComp"]


class AdaComp(Compressor):
    """``AdaComp(bin_size=None, scale=4.0, max_per_bin=None, mean_per_bin=None,
    **policy)``.

    ``bin_size`` None -> 50 for 4-D gradients (conv weights), 500 otherwise; an int in
    [1, 65536]. ``scale`` in [1, 16]: H = G + (scale - 1) dW. ``max_per_bin`` None ->
    ``max(4, ceil(bin_size / 50))``. ``mean_per_bin`` None -> every bin has its
    ``max_per_bin`` slots; a number > 0 -> the layer budget below. See the module
    docstring.
    """

    _settings = ("bin_size", "scale", "max_per_bin", "mean_per_bin")
    #: momentum correction on by default (``momentum.resolve_momentum_correction``)
    momentum_correction_always = True
    #: the Adam recipe's variance refresh off by default (``adam.default_refresh``)
    adam_refresh_by_default = False
    #: the update wire stays dense while the learning rate rises (measured:
    #: ``adam_settings.UPDATE_WARMUP``)
    adam_dense_while_rate_rises = True

    def __init__(self, bin_size=None, scale: float = 4.0, max_per_bin=None,
                 mean_per_bin=None, **kw):
        super().__init__(**kw)
        cfg = self._validate_cfg(dict(bin_size=bin_size, scale=scale, max_per_bin=max_per_bin,
                                      mean_per_bin=mean_per_bin))
        for key, v in cfg.items():
            setattr(self, key, v)
        self._validate_overrides()

    def _validate_cfg(self, cfg, where=""):
        cfg = dict(cfg)
        b = cfg["bin_size"]
        if b is not None and (not isinstance(b, int) or isinstance(b, bool)
                              or not 1 <= b <= 65536):
            raise ValueError(f"{where}bin_size must be None or an int in [1, 65536], "
                             f"got {b!r}")
        s = cfg["scale"]
        if not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(s) \
                or not 1.0 <= s <= 16.0:
            raise ValueError(f"{where}scale must be a number in [1, 16], got {s!r}")
        cfg["scale"] = float(s)
        m = cfg["max_per_bin"]
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"{where}max_per_bin must be None or an int >= 1, got {m!r}")
        a = cfg["mean_per_bin"]
        if a is not None and (not isinstance(a, (int, float)) or isinstance(a, bool)
                              or not math.isfinite(a) or a <= 0):
            raise ValueError(f"{where}mean_per_bin must be None or a finite number > 0, "
                             f"got {a!r}")
        return cfg

    @staticmethod
    def bin_size_for(shape, bin_size=None) -> int:
        if bin_size is not None:
            return bin_size
        return 50 if len(shape) == 4 else 500

    def capacity(self, shape, name: str = "") -> int:
        """Slots for a layer of this shape: ``nbins * max_per_bin``, or the layer budget
        with ``mean_per_bin`` (data-independent)."""
        cfg = self.layer_cfg(name) if name else self._base_cfg()
        return self._layout(shape, cfg)[4]

    def _layout(self, shape, cfg):
        """``(n, L, nb, c, cap, ienc, dense)``: bin size, bins, slots per bin, capacity,
        index encoding, and whether the sparse form would not be smaller (sent dense)."""
        n = 1
        for s in shape:
            n *= int(s)
        L = max(1, min(self.bin_size_for(shape, cfg["bin_size"]), n))   # (n = 0: no bins)
        nb = ceil_div(n, L)
        c = min(cfg["max_per_bin"] or max(4, math.ceil(L / 50)), L)
        cap = nb * c
        if cfg["mean_per_bin"] is not None:     # exact: the float's own binary value
            cap = min(cap, max(c, math.ceil(Fraction(cfg["mean_per_bin"]) * nb)))
        ienc = IndexEncoding.BIN_U8 if L <= 256 else IndexEncoding.BIN_U16
        ib = 1.0 if L <= 256 else 2.0
        dense = cap * (ib + 0.125) + bin_count_width(L) * nb >= 4 * n
        return n, L, nb, c, cap, ienc, dense

    def fuses_momentum(self, name, grad, param) -> bool:
        """On the compiled CPU route (``native.adacomp_select``) AdaComp folds DGC's
        velocity update into its accumulate pass: one pass over gradient, velocity and
        residual where LocalUpdate.corrected + compress made four."""
        if grad.numel() == 0 or self.policy.is_dense(name, grad.shape):
            return False
        n, L, nb, c, cap, ienc, dense = self._layout(grad.shape, self.layer_cfg(name))
        return not dense and self._native_takes(grad, c) and param is not None and \
            param.dtype == torch.float32 and param.is_contiguous() and \
            param.device.type == "cpu"

    def _compress(self, name, flat, shape, step, cfg, param):
        n, L, nb, c, cap, ienc, dense = self._layout(shape, cfg)
        if dense:                                        # not smaller: sent dense
            return self._send_all(name, flat, shape, ValueEncoding.FP32, 0, 512), dict()
        if self._native_takes(flat, c):
            # CPU with the compiled loops: accumulate, bin maxima and selection in one
            # pass over the layer (hvdsparse/native/adacomp.c; the bits of the numpy
            # route below: residual_add_binmax, then binned_select), with DGC's velocity
            # update in the same pass when the scheduler hands it over (fuses_momentum)
            G = self._residual_for(name, flat)
            gmax, gidx, rel, vmask, count, bin_counts, selected = ops.adacomp_select(
                flat, G, L, c, cfg["scale"], self._call.grad_scale, self._call.nonfinite,
                momentum=self._call.momentum,
                param=None if param is None else param.detach().reshape(-1))
            scale = ops.segment_mean(gmax)
            gidx, rel, vmask, count, bin_counts = self._budget(
                gidx, rel, vmask, count, bin_counts, nb, c, cap, L, step)
            return self._pack(name, shape, n, cap, L, ienc, G, scale, gidx,
                              binned_rel(rel, L), vmask, count, bin_counts, selected)
        G, gmax = self._acc(name, flat, L, True)             # G = residue + dW, in place
        thr = gmax.clamp_min(TINY).unsqueeze(1)
        if ops.use_triton(G) and L <= ops.binned_max_bin():
            # one scale per layer, the mean of its bin maxima, in the order of
            # kernels/segment_mean.py (on every path: the bucket path's bits too)
            scale = ops.segment_mean(gmax)
            # two launches: per-bin counts, then pick + pack + residue (kernels/binned.py)
            rel, signs, count, bin_counts, selected = ops.binned_pack(
                G, flat.reshape(-1), cfg["scale"], thr.reshape(-1), L, c, scale,
                grad_scale=self._call.grad_scale,
                budget=cap if cap < nb * c else None, rot=self.rotation(step, nb))
            seg = Segment(numel=n, capacity=cap, index_encoding=ienc,
                          value_encoding=ValueEncoding.SIGN1, count=count, values=signs,
                          indices=rel, scales=scale.reshape(1).clone(),
                          bin_counts=bin_counts, bin_size=L)
            return LayerPayload(name, shape, [seg]), dict(selected=selected,
                                                          threshold=scale)
        scale = ops.segment_mean(gmax)                       # one scale per layer
        if ops.has_cpu_path(G):
            # CPU: H, |H|, the compare and the per-bin cap in one chunked numpy pass
            # plus a sort of the passing elements (no per-bin topk over the layer)
            gidx, rel, vmask, count, bin_counts, selected = ops.binned_select(
                G, flat, cfg["scale"], thr, L, c, grad_scale=self._call.grad_scale)
            gidx, rel, vmask, count, bin_counts = self._budget(
                gidx, rel, vmask, count, bin_counts, nb, c, cap, L, step)
            rel = binned_rel(rel, L)
        else:
            # dW as the residual saw it: non-finite elements 0, loss scale removed
            H = G + (cfg["scale"] - 1.0) * self._clean_grad(flat) if cfg["scale"] != 1.0 \
                else G
            gidx, rel, vmask, count, bin_counts, a = binned_topc(H.abs(), L, c, thr)
            selected = (a >= thr).sum(dtype=torch.int32).reshape(1)
            if cap < nb * c:
                gidx, rel, vmask, count, bin_counts = self._budget(
                    gidx, None, vmask, count, bin_counts, nb, c, cap, L, step)
                rel = binned_rel(rel, L)
        return self._pack(name, shape, n, cap, L, ienc, G, scale, gidx, rel, vmask, count,
                          bin_counts, selected)

    @staticmethod
    def rotation(step: int, nb: int) -> int:
        """The bin the budget's deal starts from at ``step``: ``step * 2654435761 mod
        nb`` (Knuth's multiplicative hash), so the bins that wait for a slot change
        from step to step."""
        return (int(step) * 2654435761) % nb if nb else 0

    def _budget(self, gidx, rel, vmask, count, bin_counts, nb, c, cap, L, step):
        """The per-bin selection cut to the layer budget ``cap`` when it is below
        ``nb * c`` (``ops.bin_quota``'s deal, then ``binned.trim_to_quota``); else the
        selection as it is. ``rel`` int64 in and out (recomputed when cut)."""
        if cap >= nb * c:
            return gidx, rel, vmask, count, bin_counts
        quota = ops.bin_quota(bin_counts.to(torch.int32, copy=True), cap,
                              self.rotation(step, nb), c)     # (in place on Triton)
        gidx, rel, vmask, count = trim_to_quota(gidx, vmask, bin_counts, quota, L, cap)
        return gidx, rel, vmask, count, quota

    def _native_takes(self, flat, c) -> bool:
        """Whether the compiled CPU loop (``native.adacomp_select``) takes this layer."""
        call = self._call
        return flat.device.type == "cpu" and flat.dtype == torch.float32 and \
            flat.is_contiguous() and c <= ops.ADACOMP_MAX_C and \
            (call.nonfinite is None or call.nonfinite.device.type == "cpu") and \
            not ops.use_triton(flat) and ops.compiled_cpu_available()

    def _pack(self, name, shape, n, cap, L, ienc, G, scale, gidx, rel, vmask, count,
              bin_counts, selected):
        """Sign x scale for the kept slots, their residue, the payload (both CPU routes)."""
        g = G[gidx]
        neg = (g < 0) & vmask
        q = torch.where(neg, -scale, scale)
        # residue = G - Q(G) if sent; unused slots (index 0) add -0.0, which leaves any
        # value as it is, -0.0 included (the kernel path does not touch them at all)
        nzero = torch.full((), -0.0, dtype=G.dtype, device=G.device)
        G.index_add_(0, gidx, torch.where(vmask, -q, nzero))
        seg = Segment(numel=n, capacity=cap, index_encoding=ienc,
                      value_encoding=ValueEncoding.SIGN1, count=count,
                      values=pack_signs(neg), indices=rel, scales=scale.reshape(1).clone(),
                      bin_counts=bin_counts, bin_size=L)
        return LayerPayload(name, shape, [seg]), dict(selected=selected,
                                                      threshold=scale)
