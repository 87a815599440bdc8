"""Shared machinery of all compressors: residual memory, per-layer policy, value
encodings, deterministic seeds, ``state_dict`` and statistics.

Error feedback (all compressors with ``error_feedback=True``)
------------------------------------------------------------
Per layer ``name`` a fp32 residual ``r`` (same numel as the gradient, on the gradient's
device, created lazily as zeros) is kept. At each step

    d     = fp32(grad) * grad_scale        (grad_scale = 1 / loss scale, or 1)
    acc   = r + where(isfinite(d), d, 0)   (fp32; ``ops.residual_add_binmax`` in place;
                                            non-finite elements counted, never absorbed)
    sent  = deq(Q(acc[S]))                 on the selected set S, 0 elsewhere
    r_new = acc - sent

so ``sent + r_new == acc`` exactly when values travel as fp32 (``Q`` = identity:
``r_new[S] = 0``), and up to one fp32 rounding of ``acc - deq`` otherwise; the
quantisation error ``acc[S] - deq(Q(acc[S]))`` itself is kept in the residual, so its
magnitude is bounded by the encoding's error bound (fp16/bf16: half an ulp of the
value; INT-b with per-bucket scale ``m``: ``m / (2^(b-1) - 1)``; SIGN1:
``| |acc| - scale |``).

Seeds and determinism
---------------------
All randomness comes from counter-based generators keyed by an integer seed computed on
the host from ``(seed, step, crc32(name), purpose)`` -- plus the rank for per-rank
randomness (explorer sets, stochastic rounding) -- see :func:`mix_seed`. So a
compressor is a deterministic function of (its state, seed, rank, step, name, grad);
quantities that ranks must agree on (Slim-DP core, shared-seed RandomK indices,
capacities) never mix in the rank.

Capacities
----------
Every capacity is a function of (numel, settings, step) only -- never of the data --
so all ranks encode equal-size messages each step (warm-up changes them with the step,
identically on all ranks).

Host synchronisation
--------------------
``compress`` and ``compress_absent`` never call ``.item()``, ``.tolist()``, ``nonzero``,
boolean-mask indexing, ``unique`` or ``equal`` on device tensors: counts (including the
non-finite count), thresholds and scales stay device tensors. The only host work is
integer arithmetic on sizes and seeds (tests/test_compressor_trust.py checks the aten
ops with a ``TorchDispatchMode``). The one documented exception is Slim-DP's
``after_exchange``: a blocking broadcast of the core, once per layer and re-selection.

Buffers
-------
Full-size per-step temporaries (``|acc|``, comparison masks, the accumulator without
error feedback) live in per-compressor scratch buffers (one per kind, dtype and device,
sized to the largest layer), so a steady-state step allocates no full-size tensor for
them; payload tensors never alias a scratch buffer.
"""
from __future__ import annotations

import math
import weakref
from typing import List, Optional, Sequence

import torch

from .. import ops
from ..payload import IndexEncoding, LayerPayload, Segment, ValueEncoding
from ..stats import StatsCollector
from .checkpoint import CompressorState
from .encoding import ValueEncoder
from .gradients import check_grad_scale, clean_grad, residual_add
from .layer_settings import LayerSettings
from .policy import LayerPolicy
from .seeds import mix_seed, name_hash
from .transactions import StepTransactions, snapshot_state
# re-exported: the compressors import these from here
from .binned import binned_rel, binned_topc, ceil_div  # noqa: F401
from .encoding import check_values, pack_signs  # noqa: F401
from .gradients import inverse_loss_scale  # noqa: F401
from .seeds import (PURPOSE_CORE, PURPOSE_EXPLORE, PURPOSE_INDICES,  # noqa: F401
                    PURPOSE_QUANT, PURPOSE_SAMPLE, uniform)


__all__ = ["Compressor", "mix_seed", "TINY", "check_values", "pack_signs"]

#: smallest positive normal fp32: thresholds are clamped to it so exact zeros are never
#: selected (an all-zero layer sends nothing).
TINY = float(torch.finfo(torch.float32).tiny)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _Call:
    """Per-call inputs of one ``compress`` that the shared helpers need."""
    __slots__ = ("grad_scale", "nonfinite", "momentum")

    def __init__(self, grad_scale=None, nonfinite=None, momentum=None):
        self.grad_scale = grad_scale
        self.nonfinite = nonfinite
        self.momentum = momentum


class Compressor(LayerSettings, StepTransactions, CompressorState, ValueEncoder):
    """Base class. Subclasses implement :meth:`_compress` and list their per-layer
    settings (constructor arguments an override may change) in ``_settings``, and the
    other constructor arguments that change behaviour in ``_extra_args`` (both end up in
    :meth:`config`).

    Common keyword arguments: ``min_numel=1024``, ``compress_1d=False``,
    ``overrides=None`` (see :mod:`.policy`), ``seed=0`` (base of all seeds).

    Interface for the optimizer / scheduler (all of it on the calling thread; nothing
    here talks to Horovod except through the ``broadcast`` callable given to ``bind``):

    * ``bind(rank, world_size, *, broadcast=None, owner=None)``,
      ``register_layers(named_shapes)`` (once, every optimised ``(name, shape)`` in the
      optimizer's order: checks the override patterns, lets a compressor derive
      per-layer settings such as TopK's output layer), ``check_names(names)``,
      ``config()``, ``steady_state_step()``;
    * per step: ``begin_step(step)``; ``compress(name, grad, step, param=None,
      grad_scale=None)`` or ``compress_absent(name, like, step, param=None)`` per layer;
      ``after_exchange(name, averaged_grad, step, param=None)`` per exchanged layer, in
      the same layer order on every rank; then ``commit()`` or ``rollback()``.

    Non-finite gradients
    --------------------
    A NaN/Inf element of ``grad`` is treated as 0: it is never added to a residual and
    never sent (every path: error-feedback add, policy-dense layers,
    ``error_feedback=False``, AdaComp's ``H``, warm-up dense steps, Slim-DP, QSGD). The
    number of such elements is counted on the device into ``payload.nonfinite``
    (int32[1]); what to do about them (raise, skip the step) is the caller's policy.
    ``stats()[name]["nonfinite"]`` is the count of the layer's latest step (with a
    ``nonfinite=`` counter passed in, the caller's earlier count included).

    Loss scaling
    ------------
    ``grad_scale`` (None or a 1-element fp32 device tensor, ``1 / GradScaler.scale``)
    multiplies the (finite) gradient before it meets the residual: residuals are always
    in unscaled units, whatever the loss scale does.

    Transactions (``transactional=True``)
    -------------------------------------
    A step can be undone: :class:`~hvdsparse.compressors.transactions.StepTransactions`.
    """

    _settings: tuple = ()
    _extra_args: tuple = ()

    def __init__(self, *, min_numel: int = 1024, compress_1d: bool = False,
                 overrides: Optional[dict] = None, seed: int = 0):
        if not _is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.policy = LayerPolicy(min_numel, compress_1d, overrides, self._settings)
        self.seed = seed
        self.rank = 0
        self.world_size = 1
        self._broadcast = None
        self._owner = None
        self._residuals: dict = {}
        self._layers: dict = {}        # per-layer algorithm state (subclass-defined)
        self._stats = StatsCollector()
        self._cfg_cache: dict = {}
        #: set by the scheduler when it may need :meth:`rollback` (:mod:`.transactions`)
        self.transactional = False
        self._txn: Optional[dict] = None
        self._txn_step: Optional[int] = None
        self._snap_bufs: dict = {}
        self._scratch: dict = {}
        self._call = _Call()
        self._absent = False

    # ------------------------------------------------------------------ binding
    def bind(self, rank: int, world_size: int, *, broadcast=None, owner=None):
        """Tell the compressor which rank it runs on (per-rank randomness mixes it in).

        ``broadcast``: a callable ``broadcast(tensor, name) -> tensor`` that returns rank
        0's ``tensor`` on every rank (blocking; the scheduler wraps ``hvd.broadcast``);
        used by compressors whose decisions must agree across ranks (Slim-DP's core).
        ``owner``: the optimizer that owns this compressor's state; binding again with a
        different live owner raises ``ValueError`` (residuals are keyed by parameter
        name, so two optimizers sharing one compressor would corrupt each other)."""
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), "
                             f"got {rank!r}")
        if broadcast is not None and not callable(broadcast):
            raise TypeError(f"broadcast must be a callable (tensor, name) -> tensor, got "
                            f"{broadcast!r}")
        if owner is not None:
            cur = self._owner() if self._owner is not None else None
            same = cur is owner or (isinstance(owner, (str, int)) and cur == owner)
            if cur is not None and not same:
                raise ValueError(f"{self!r} is already bound to another optimizer "
                                 f"({type(cur).__name__} at {id(cur):#x}); one compressor "
                                 f"instance per optimizer (its residuals are keyed by "
                                 f"parameter name): create a second {type(self).__name__}(...)")
            try:
                self._owner = weakref.ref(owner)
            except TypeError:
                self._owner = (lambda o: (lambda: o))(owner)
        self.rank = rank
        self.world_size = world_size
        self._broadcast = broadcast
        return self

    def _seed(self, name: str, step: int, purpose: int, shared: bool = False) -> int:
        """Seed for (name, step, purpose); per rank unless ``shared``."""
        if shared:
            return mix_seed(self.seed, step, name_hash(name), purpose)
        return mix_seed(self.seed, step, name_hash(name), purpose, 0x5EED + self.rank)

    #: whole buckets on the device path (only TopK: compressors/topk_bucket.py)
    bucket_path = False

    # Capabilities the front doors' automatic rules ask of a compressor (never by its
    # class): each subclass states its own.

    #: False only for a compressor that sends every layer as it is (NoCompression): the
    #: Adam recipe's automatic switch (``adam.adam_setup``) stays off for it
    compresses = True
    #: whether the Adam recipe's periodic dense variance refresh is on by default with
    #: this compressor (``adam.default_refresh``)
    adam_refresh_by_default = True
    #: whether the Adam recipe's update wire, with ``adam_warmup`` left at its default,
    #: also stays dense at every step at which a parameter group's learning rate rises (a
    #: schedule's warm-up): measured per compressor (``adam_settings.UPDATE_WARMUP``)
    adam_dense_while_rate_rises = False
    #: whether its layers travel on the Adam recipe's update wire
    #: (:meth:`set_adam_update_wire`; TopK's ``fresh_weight`` default follows it)
    adam_update_wire = False
    #: name -> the layer's host learning rate on the Adam recipe's update wire (None:
    #: unknown); set by the front door (``door.make_local_update``)
    layer_rate = None
    #: whether, on the Adam recipe's update wire, the layers its size / 1-D rule sends
    #: dense travel whole (``policy.is_whole``: every element in the layer's fp16 / bf16
    #: value encoding, error feedback, every rank's own Adam moments) rather than fp32
    #: with exact Adam on their average: measured per compressor (TopK)
    adam_small_layers_whole = False
    #: DGC momentum correction's automatic rule (``momentum.resolve_momentum_correction``)
    #: turns correction on with this compressor at any density (AdaComp)
    momentum_correction_always = False

    def set_adam_update_wire(self, on: bool) -> None:
        """The front door says whether the layers travel on the Adam recipe's update wire
        (``door.make_local_update``); per-layer settings derived from it are derived
        again."""
        on = bool(on)
        if on != self.adam_update_wire:
            self.adam_update_wire = on
            self._cfg_cache.clear()
        self.policy.whole_small = on and self.adam_small_layers_whole and \
            self.layer_cfg_values() in (ValueEncoding.FP16, ValueEncoding.BF16)

    def layer_cfg_values(self) -> Optional[ValueEncoding]:
        """The value encoding in force of a layer without overrides (None for a
        compressor without a ``values`` setting)."""
        return None

    def error_feedback_density(self) -> Optional[float]:
        """The fraction of a layer sent per step by a sparsifier whose error feedback
        keeps the rest for later steps (TopK's ``ratio``, Threshold's ``1 - sparsity``),
        which momentum correction's automatic rule bounds; None when that rule does not
        apply (no error feedback, every coordinate sent, or never measured with it)."""
        return None

    def warmup_density(self, name: str, step: int) -> Optional[float]:
        """The layer's density at ``step`` while a density warm-up holds it above the
        layer's own target density; ``None`` otherwise (no warm-up, the warm-up is over,
        or a compressor without a target density). Read by momentum correction, which
        suspends DGC's momentum-factor masking while this is above ``(1 - m) / 2``
        (:meth:`hvdsparse.momentum.LocalUpdate.mask`)."""
        w = getattr(self, "warmup", None)
        if w is None or step >= w.T:
            return None
        target = self._target_density(name)
        if target is None:
            return None
        d = w(step, target)
        return d if d > target else None

    def _target_density(self, name: str) -> Optional[float]:
        """The layer's density after any warm-up (its settings and overrides applied);
        ``None`` for a compressor without one."""
        return None

    def steady_state_step(self) -> int:
        """The first step from which capacities and layouts no longer change: the end of
        the density warm-up (0 without one). Plan buckets with
        ``compress_absent(name, like, steady_state_step())``."""
        w = getattr(self, "warmup", None)
        return 0 if w is None else int(w.T)

    # ------------------------------------------------------------------ public API
    def compress(self, name: str, grad: torch.Tensor, step: int,
                 param: Optional[torch.Tensor] = None,
                 grad_scale: Optional[torch.Tensor] = None,
                 nonfinite: Optional[torch.Tensor] = None,
                 momentum=None) -> LayerPayload:
        """Compress one layer's gradient for this step (see the class docstring).
        ``payload.nonfinite`` counts the non-finite elements of ``grad`` (int32[1],
        device). ``nonfinite``: an int32[1] device counter that already holds this
        layer's count of an earlier stage (the local update's clean gradient); the
        compressor adds into it and returns it as ``payload.nonfinite`` (saves a
        zeroed counter and a sum per layer). ``momentum``: a
        ``topk_bucket.MomentumSpec`` (``LocalUpdate.bucket_spec``) when
        :meth:`fuses_momentum` said yes for this layer: DGC's velocity update is done
        inside the compressor's pass (``grad`` is then the raw gradient)."""
        self._check_args(name, grad, step, "grad")
        if momentum is not None and not self.fuses_momentum(name, grad, param):
            raise ValueError(f"layer {name!r}: {type(self).__name__} cannot fold the "
                             f"velocity update here (fuses_momentum is False)")
        grad_scale = check_grad_scale(name, grad_scale, grad.device)
        if nonfinite is not None and (not isinstance(nonfinite, torch.Tensor) or
                                      nonfinite.dtype != torch.int32 or
                                      nonfinite.numel() != 1 or
                                      nonfinite.device != grad.device):
            raise TypeError(f"layer {name!r}: nonfinite must be an int32[1] tensor on "
                            f"{grad.device}, got {nonfinite!r}")
        self._open_layer(name)
        return self._compress_layer(name, grad, step, param, grad_scale, record=True,
                                    nonfinite=nonfinite, momentum=momentum)

    def fuses_momentum(self, name: str, grad: torch.Tensor,
                       param: Optional[torch.Tensor]) -> bool:
        """Whether :meth:`compress` can take DGC's velocity update for this layer into
        its own pass (``momentum=``), with the bits of ``LocalUpdate.corrected``
        followed by an ordinary call. None of the base class's compressors do; AdaComp
        does on its compiled CPU route."""
        return False

    def _open_layer(self, name: str) -> None:
        """Before layer ``name``'s payload is made again (``compress``, the bucket path):
        fold its last counts if it was recorded without a ``begin_step`` since, and
        snapshot it for a rollback."""
        if self._stats.pending(name):
            self._stats.fold()
        self._touch(name)

    def compress_absent(self, name: str, like: torch.Tensor, step: int,
                        param: Optional[torch.Tensor] = None) -> LayerPayload:
        """The payload of a layer that has no gradient this step (frozen or unused
        parameter): the same wire layout -- segments, capacities, encodings, hence the
        same encoded size -- as :meth:`compress` would produce for ``like`` (a tensor of
        the gradient's shape, dtype and device) at ``step``, contributing exactly zero
        (count 0 in INT32 / bin-relative segments, zero values in DENSE / IMPLICIT
        ones). Changes nothing: residuals (kept for when the parameter is unfrozen),
        thresholds, cores, statistics, transactions."""
        self._check_args(name, like, step, "like")
        if self._stats.pending(name):
            self._stats.fold()
        saved = (self._residuals, self._layers)
        st = self._layers.get(name)
        # run the ordinary path on a zero gradient against scratch state: a zero
        # residual and a copy of the layer's state, both dropped afterwards
        self._residuals = {}
        self._layers = {} if st is None else {name: snapshot_state(st)}
        self._absent = True
        try:
            zero = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
            payload = self._compress_layer(name, zero, step, param, None, record=False)
        finally:
            self._residuals, self._layers = saved
            self._absent = False
        for seg in payload.segments:
            if seg.index_encoding in (IndexEncoding.INT32, IndexEncoding.BIN_U8,
                                      IndexEncoding.BIN_U16):
                seg.count = torch.zeros_like(seg.count)
                if seg.bin_counts is not None:
                    seg.bin_counts = torch.zeros_like(seg.bin_counts)
        return payload

    def _check_args(self, name, grad, step, argname):
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"layer {name!r}: {argname} must be a torch.Tensor, got "
                            f"{type(grad).__name__}")
        if grad.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"layer {name!r}: {argname} dtype must be float32, float16 or "
                            f"bfloat16, got {grad.dtype}")
        if not _is_int(step) or step < 0:
            raise ValueError(f"layer {name!r}: step must be an int >= 0, got {step!r}")

    def _compress_layer(self, name, grad, step, param, grad_scale, record, nonfinite=None,
                        momentum=None):
        shape = grad.shape
        flat = grad.detach().reshape(-1)
        if nonfinite is None:
            nonfinite = torch.zeros(1, dtype=torch.int32, device=flat.device)
        self._call = _Call(grad_scale, nonfinite, momentum)
        try:
            if flat.numel() == 0:
                seg = Segment(numel=0, capacity=0, index_encoding=IndexEncoding.DENSE,
                              value_encoding=ValueEncoding.FP32,
                              count=torch.zeros(1, dtype=torch.int32, device=flat.device),
                              values=torch.zeros(0, dtype=torch.float32, device=flat.device))
                payload, info = LayerPayload(name, shape, [seg]), {}
            elif self.policy.is_dense(name, shape):
                payload, info = self._policy_dense(name, flat, shape), dict(density=1.0)
            elif self.policy.is_whole(name, shape):
                payload, info = self._whole(name, flat, shape, step), dict(density=1.0)
            else:
                cfg = self.layer_cfg(name)
                payload, info = self._compress(name, flat, shape, step, cfg, param)
        finally:
            self._call = _Call()
        payload.nonfinite = nonfinite
        if record:
            extra = dict(info.pop("extra", None) or {})
            extra["nonfinite"] = nonfinite
            self._stats.record(name, step, payload, extra=extra, **info)
        return payload

    def after_exchange(self, name: str, averaged_grad: torch.Tensor, step: int,
                       param: Optional[torch.Tensor] = None):
        """Called by the optimizer with the decoded, averaged gradient (identical on all
        ranks), for every exchanged layer in the same order on every rank (it may
        broadcast). Only Slim-DP uses it."""
        return None

    def stats(self) -> dict:
        """Per-layer statistics (host numbers; synchronises here, never in compress)."""
        return self._stats.as_dict()

    def stats_totals(self) -> dict:
        return self._stats.totals()

    def reset_residuals(self):
        for r in self._residuals.values():
            r.zero_()

    def take_back(self, name: str, values: torch.Tensor) -> bool:
        """Error feedback for what the exchange sent but did not deliver (``balanced``'s
        phase-2 truncation): ``values`` (flat, this rank's own undelivered contribution,
        0 elsewhere) is added into the layer's residual, device ops only. A policy-dense
        layer, which keeps no residual, gets one for it; its next dense send flushes it
        (:meth:`_policy_dense`), and a rolled-back step removes it. Returns False, the
        share staying lost (reported as ``p2_dropped_energy``), only for a layer whose
        settings say ``error_feedback=False``."""
        return self.take_back_many([name], [values])[0]

    def take_back_many(self, names: Sequence[str], values: Sequence[torch.Tensor]) -> List[bool]:
        """:meth:`take_back` for several layers, their additions in one multi-tensor
        launch (``torch._foreach_add_``); the layers without a residual (policy-dense
        ones) get theirs as views of one zeroed buffer (one launch, not one per layer)."""
        took, rs, vs, new = [], [], [], []
        for name, v in zip(names, values):
            if not self.layer_cfg(name).get("error_feedback", True):
                took.append(False)
                continue
            r = self._residuals.get(name)
            if r is None:
                new.append((len(rs), name, v))
            rs.append(r)
            vs.append(v.reshape(-1))
            took.append(True)
        for device in {v.device for _, _, v in new}:
            mine = [(j, name, v) for j, name, v in new if v.device == device]
            flat = torch.zeros(sum(v.numel() for _, _, v in mine), dtype=torch.float32,
                               device=device)
            o = 0
            for j, name, v in mine:
                self._touch(name)
                rs[j] = self._residuals[name] = flat[o:o + v.numel()]
                o += v.numel()
        if rs:
            torch._foreach_add_(rs, vs)
        return took

    def residual(self, name: str) -> Optional[torch.Tensor]:
        """The fp32 residual of a layer (None before its first compressed step)."""
        return self._residuals.get(name)

    # ------------------------------------------------------------------ helpers
    def _compress(self, name, flat, shape, step, cfg, param):
        raise NotImplementedError

    def _scratch_buf(self, kind: str, n: int, dtype, device) -> torch.Tensor:
        """A reused 1-D buffer of at least ``n`` elements (one per kind, dtype and
        device, grown to the largest layer seen): per-step full-size temporaries
        without an allocation per step. Valid until the next call with the same kind;
        never handed out in a payload."""
        key = (kind, dtype, str(device))
        b = self._scratch.get(key)
        if b is None or b.numel() < n:
            b = torch.empty(n, dtype=dtype, device=device)
            self._scratch[key] = b
        return b[:n]

    def _residual_for(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        r = self._residuals.get(name)
        if r is None:
            r = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
            self._residuals[name] = r
        else:
            if r.numel() != flat.numel():
                raise ValueError(f"layer {name!r}: gradient has {flat.numel()} elements but "
                                 f"its residual has {r.numel()} (same name, different tensor?)")
            if r.device != flat.device:
                r = r.to(flat.device)
                self._residuals[name] = r
        return r

    def _acc(self, name, flat, bin_size=None, error_feedback=True):
        """acc = residual + clean(grad) * grad_scale (fp32, in place in the residual);
        returns (acc, binmax). Non-finite gradient elements add nothing and are counted
        into this call's ``nonfinite``. Without error feedback acc is a fp32 copy of the
        cleaned gradient in a reused scratch buffer (nothing remembered)."""
        n = flat.numel()
        c = self._call
        if error_feedback:
            acc = self._residual_for(name, flat)
        else:
            acc = self._scratch_buf("acc", n, torch.float32, flat.device).zero_()
        if bin_size is None:
            # the caller ignores the bin maxima (returned as None): the CPU path skips
            # them, one pass fewer over the layer
            ops.residual_add(flat, acc, grad_scale=c.grad_scale, nonfinite=c.nonfinite)
            return acc, None
        return acc, residual_add(flat, acc, bin_size, c.grad_scale, c.nonfinite)

    def _clean_grad(self, flat: torch.Tensor) -> torch.Tensor:
        """The gradient as the residual saw it: non-finite elements 0, times grad_scale,
        fp32 (not counted again: ``_acc`` counts)."""
        return clean_grad(flat, self._call.grad_scale, None, count=False)

    def _policy_dense(self, name, flat, shape) -> LayerPayload:
        """fp32 dense, no error feedback (a pending residual, if any, is flushed);
        non-finite elements travel as 0 and are counted."""
        r = self._residuals.pop(name, None)
        c = self._call
        vals = clean_grad(flat, c.grad_scale, c.nonfinite)
        if r is not None:
            vals += r.to(vals.device)
        seg = Segment(numel=flat.numel(), capacity=flat.numel(),
                      index_encoding=IndexEncoding.DENSE, value_encoding=ValueEncoding.FP32,
                      count=self._count(flat.numel(), flat.device), values=vals)
        return LayerPayload(name, shape, [seg])

    def _whole(self, name, flat, shape, step) -> LayerPayload:
        """Every element of ``acc = residual + clean(grad)`` in the layer's value encoding
        (``policy.is_whole``): :meth:`_send_all`."""
        cfg = self.layer_cfg(name)
        return self._send_all(name, flat, shape, cfg["values"],
                              self._seed(name, step, PURPOSE_QUANT), cfg["quant_bucket"],
                              cfg["error_feedback"])

    def _send_all(self, name, flat, shape, enc, seed, quant_bucket,
                  error_feedback=True) -> LayerPayload:
        """Every element of ``acc = residual + clean(grad)`` as one DENSE segment in
        encoding ``enc``; with error feedback the residual keeps the rounding (the whole
        layer, and a sparse layout that would not be smaller than it)."""
        acc, _ = self._acc(name, flat, None, error_feedback)
        return self._dense_from_acc(name, acc, shape, enc, seed, quant_bucket, error_feedback)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._base_cfg().items())
        return f"{type(self).__name__}({args})"


def k_of(density: float, n: int) -> int:
    """k = ceil(density * n), at least 1, at most n (the 1e-9 guards float noise such as
    ceil(0.01 * 100) = 2)."""
    return max(1, min(n, math.ceil(density * n - 1e-9)))
