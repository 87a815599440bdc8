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

import fnmatch
import math
import weakref
import zlib
from typing import Optional

import torch

from .. import ops
from ..payload import (FLOAT_BYTES, FLOAT_DTYPES, QUANT_BITS, VALUE_ENCODING_NAMES,
                       IndexEncoding, LayerPayload, Segment, ValueEncoding, to_wire_float)
from ..stats import StatsCollector
from .policy import LayerPolicy

__all__ = ["Compressor", "mix_seed", "TINY", "check_values", "pack_signs"]

#: smallest positive normal fp32: thresholds are clamped to it so exact zeros are never
#: selected (an all-zero layer sends nothing).
TINY = float(torch.finfo(torch.float32).tiny)

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


def check_values(values) -> ValueEncoding:
    """Parse the ``values=`` argument (fp32, fp16, bf16, int8, int4, int2)."""
    if isinstance(values, ValueEncoding) and values != ValueEncoding.SIGN1:
        return values
    if isinstance(values, str) and values.lower() in VALUE_ENCODING_NAMES:
        return VALUE_ENCODING_NAMES[values.lower()]
    raise ValueError(f"values must be one of {sorted(VALUE_ENCODING_NAMES)}, got {values!r}")


def value_name(enc: ValueEncoding) -> str:
    for k, v in VALUE_ENCODING_NAMES.items():
        if v == enc:
            return k
    return ValueEncoding(enc).name.lower()


def pack_signs(negative: torch.Tensor) -> torch.Tensor:
    """bool[n] -> uint8[ceil(n/8)], bit j%8 of byte j//8 set when element j is negative
    (the project's one bit packer, ``ops.pack_bits``, at 1 bit)."""
    return ops.pack_bits(negative.to(torch.uint8), 1)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)




def binned_topc(a: torch.Tensor, bin_size: int, c: int, thr):
    """Up to ``c`` largest entries of every bin of ``bin_size`` consecutive elements of
    ``a`` (non-negative magnitudes, 1-D) that are ``>= thr`` (a scalar or an [nbins, 1]
    tensor), laid out for the bin-relative wire format (BIN_U8 / BIN_U16).

    Returns ``(gidx, rel, vmask, count, bin_counts, padded)``: ``nbins * c`` slots with the
    valid ones first, in bin order (largest first within a bin); ``gidx`` the absolute
    int64 index (0 in unused slots), ``rel`` the index within its bin (0 in unused slots), cast to the
    wire dtype (uint8 for bins <= 256, else int16 holding the uint16 bits), ``vmask`` the
    valid slots, ``count`` int32[1], ``bin_counts`` int32[nbins], and ``padded`` = ``a``
    zero-padded to whole bins, viewed [nbins, bin_size]. All on the device, no host sync.
    """
    n = a.numel()
    nb = ceil_div(n, bin_size)
    pad = nb * bin_size - n
    if pad:
        a = torch.cat([a, a.new_zeros(pad)])
    padded = a.view(nb, bin_size)
    tv, ti = torch.topk(padded, c, dim=1, sorted=True)
    valid = tv >= thr                                    # [nb, c]
    bin_counts = valid.sum(dim=1, dtype=torch.int32)
    fvalid = valid.reshape(-1)
    order = torch.sort((~fvalid).to(torch.int8), stable=True).indices
    base = (torch.arange(nb, device=a.device) * bin_size).unsqueeze(1)
    gidx = (ti + base).reshape(-1)[order]
    rel = ti.reshape(-1)[order]
    vmask = fvalid[order]
    count = fvalid.sum(dtype=torch.int32).reshape(1)
    gidx = torch.where(vmask, gidx, torch.zeros_like(gidx))
    rel = torch.where(vmask, rel, torch.zeros_like(rel))   # padding slots: 0 on the wire
    return gidx, binned_rel(rel, bin_size), vmask, count, bin_counts, padded


def binned_rel(rel: torch.Tensor, bin_size: int) -> torch.Tensor:
    """int64 bin-relative indices in the wire dtype: uint8 for bins <= 256, else int16
    holding the uint16 bits."""
    if bin_size <= 256:
        return rel.to(torch.uint8)
    return torch.where(rel >= 32768, rel - 65536, rel).to(torch.int16)

def _deep_clone(x):
    """Copy of a nest of dicts / lists / tuples whose tensors are detached clones, so a
    state dict never aliases live compressor state (and vice versa)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _deep_clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deep_clone(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_deep_clone(v) for v in x)
    return x

_MISSING = object()


def _plain(x):
    """Plain data for configs: value encodings by name ("int4"), containers rebuilt, so
    a config compares across ranks and loads with ``torch.load(weights_only=True)``."""
    if isinstance(x, ValueEncoding):
        return value_name(x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _snap_state(x):
    """Snapshot of a layer's algorithm state for :meth:`Compressor.rollback`: containers
    are copied, tensors are shared. Valid because compressors never modify a layer-state
    tensor in place -- they replace it (``st["tau"] = torch.where(...)``) -- so sharing
    costs nothing and stays exact (a core of beta*n indices is not copied every step)."""
    if isinstance(x, dict):
        return {k: _snap_state(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_snap_state(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_snap_state(v) for v in x)
    return x


def inverse_loss_scale(grad_scaler, device) -> Optional[torch.Tensor]:
    """``1 / scale`` of a ``torch.amp.GradScaler`` as the ``grad_scale`` that
    ``compress`` takes (fp32, on ``device``; a power of two, so multiplying by it is
    exact), or None: no scaler, a disabled one, or one whose scale ``scale()`` has not
    created yet. Device ops only (no host read). Both front doors call it once per
    step."""
    if grad_scaler is None or not grad_scaler.is_enabled():
        return None
    scale = getattr(grad_scaler, "_scale", None)
    if scale is None:
        return None
    return torch.reciprocal(scale.float()).to(device)


def _check_grad_scale(name, grad_scale, device):
    """``grad_scale``: None or a 1-element fp32 tensor on the gradient's device (checked
    from metadata only: no host sync)."""
    if grad_scale is None:
        return None
    if not isinstance(grad_scale, torch.Tensor) or grad_scale.dtype != torch.float32 \
            or grad_scale.numel() != 1:
        got = (f"{grad_scale.dtype} of shape {tuple(grad_scale.shape)}"
               if isinstance(grad_scale, torch.Tensor) else repr(grad_scale))
        raise TypeError(f"layer {name!r}: grad_scale must be None or a 1-element float32 "
                        f"tensor (1 / GradScaler scale), got {got}")
    if grad_scale.device != device:
        raise ValueError(f"layer {name!r}: grad_scale is on {grad_scale.device} but the "
                         f"gradient is on {device}")
    return grad_scale.reshape(1)


def clean_grad(flat: torch.Tensor, grad_scale, nonfinite: Optional[torch.Tensor],
               count: bool = True) -> torch.Tensor:
    """``d = fp32(g) * grad_scale``, then ``where(isfinite(d), d, 0)`` (a new fp32
    tensor) and, with ``count``, ``nonfinite[0] += #non-finite(d)`` -- the same rule as
    ``ops.residual_add_binmax`` (``ops.clean_grad``: one launch on the Triton path, torch
    ops elsewhere, no host sync), for the paths whose gradient does not go through that
    kernel."""
    return ops.clean_grad(flat.reshape(-1), grad_scale=grad_scale,
                          nonfinite=nonfinite if count else None)


def residual_add(flat: torch.Tensor, residual: torch.Tensor, bin_size: int, grad_scale,
                 nonfinite: Optional[torch.Tensor]) -> torch.Tensor:
    """``residual += d`` with ``d = fp32(g) * grad_scale`` where ``d`` is finite,
    ``nonfinite[0] += #non-finite(d)``; returns the per-bin max of ``|residual|``
    (``ops.residual_add_binmax``: one fused pass, no host sync on the Triton path)."""
    return ops.residual_add_binmax(flat, residual, bin_size, grad_scale=grad_scale,
                                   nonfinite=nonfinite)


class _Call:
    """Per-call inputs of one ``compress`` that the shared helpers need."""
    __slots__ = ("grad_scale", "nonfinite", "momentum")

    def __init__(self, grad_scale=None, nonfinite=None, momentum=None):
        self.grad_scale = grad_scale
        self.nonfinite = nonfinite
        self.momentum = momentum


class Compressor:
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
    ``begin_step(step)`` opens a step. The first time ``compress`` or ``after_exchange``
    touches a layer inside the step, the layer's residual (copied into a reused buffer)
    and its algorithm state (thresholds, Slim-DP core, histories; containers copied,
    tensors shared -- they are replaced, never modified in place) are snapshotted.
    ``commit()`` keeps everything; ``rollback()`` puts every touched layer back exactly
    as it was at ``begin_step`` (bitwise residual, same state objects; a residual or
    state created during the step is removed; a residual flushed by a policy-dense
    step comes back), so the next step behaves as if the skipped step had never run.
    Not rolled back: ``stats()`` (the skipped step's bytes did travel) and anything
    keyed by the step number (the caller decides whether the skipped step's number is
    used again). ``compress``/``after_exchange`` while ``transactional`` is set but no
    step is open, ``begin_step`` while one is open, and ``commit``/``rollback`` with
    none open raise ``RuntimeError``. With ``transactional=False`` (default)
    ``begin_step``/``commit``/``rollback`` are no-ops and nothing is copied (except
    that ``begin_step`` folds the last step's counts into ``stats()``, device ops only:
    :meth:`hvdsparse.stats.StatsCollector.fold`).
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
        #: set by the scheduler when it may need :meth:`rollback` (see class docstring)
        self.transactional = False
        self._txn: Optional[dict] = None
        self._txn_step: Optional[int] = None
        self._snap_bufs: dict = {}
        self._scratch: dict = {}
        self._call = _Call()
        self._absent = False

    # ------------------------------------------------------------------ settings
    def _base_cfg(self) -> dict:
        return {k: getattr(self, k) for k in self._settings}

    def _validate_cfg(self, cfg: dict, where: str = "") -> dict:
        """Validate (and normalise) a settings dict; raise ValueError naming the argument
        (prefixed by ``where`` for overrides)."""
        return cfg

    def _validate_overrides(self):
        base = self._base_cfg()
        for pat, ov in self.policy.overrides.items():
            merged = dict(base)
            merged.update({k: v for k, v in ov.items() if k in self._settings})
            self._validate_cfg(merged, where=f"overrides[{pat!r}]: ")

    def _all_cfgs(self) -> list:
        """The base settings and every override's merged settings."""
        base = self._base_cfg()
        out = [base]
        for pat, ov in self.policy.overrides.items():
            merged = dict(base)
            merged.update({k: v for k, v in ov.items() if k in self._settings})
            out.append(self._validate_cfg(merged, where=f"overrides[{pat!r}]: "))
        return out

    def layer_cfg(self, name: str) -> dict:
        cfg = self._cfg_cache.get(name)
        if cfg is None:
            cfg = self._base_cfg()
            ov = self.policy.match(name)
            cfg.update({k: v for k, v in ov.items() if k in self._settings})
            cfg = self._validate_cfg(cfg, where=f"layer {name!r}: ")
            self._cfg_cache[name] = cfg
        return cfg

    def register_layers(self, named_shapes) -> None:
        """Called once by the front door with every optimised ``(name, shape)`` in the
        optimizer's order (the same on every rank): :meth:`check_names`, then the
        compressor's own per-layer derivations (``_register_layers``)."""
        named_shapes = [(str(n), tuple(int(d) for d in s)) for n, s in named_shapes]
        self.check_names([n for n, _ in named_shapes])
        self._register_layers(named_shapes)

    def _register_layers(self, named_shapes) -> None:
        """Subclass hook of :meth:`register_layers` (default: nothing)."""

    def check_names(self, names) -> None:
        """Raise ``ValueError`` when an ``overrides`` pattern matches none of ``names``
        (the model's parameter names), naming the pattern and a few parameter names --
        e.g. a pattern written without the ``module.`` prefix that DDP-style wrappers
        add. Call once with every parameter name the compressor will see."""
        names = [str(n) for n in names]
        for pat in self.policy.overrides:
            if any(fnmatch.fnmatchcase(n, pat) for n in names):
                continue
            hint = ""
            if any(fnmatch.fnmatchcase(n, "*" + pat) for n in names):
                hint = " (it matches with a prefix: add e.g. 'module.' or a leading '*')"
            few = ", ".join(repr(n) for n in names[:5]) + (", ..." if len(names) > 5 else "")
            raise ValueError(f"{type(self).__name__}: overrides pattern {pat!r} matches no "
                             f"parameter name{hint}; parameter names are {few or '(none)'}")

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
    #: DGC momentum correction's automatic rule (``momentum.resolve_momentum_correction``)
    #: turns correction on with this compressor at any density (AdaComp)
    momentum_correction_always = False

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

    # ------------------------------------------------------------------ transactions
    def begin_step(self, step: int):
        """Open step ``step`` (before its first ``compress``); see the class docstring."""
        self._stats.fold()      # last step's counts into the statistics (device ops)
        if not self.transactional:
            return
        if self._txn is not None:
            raise RuntimeError(f"{type(self).__name__}.begin_step({step}): step "
                               f"{self._txn_step} is still open (call commit() or "
                               f"rollback() first)")
        self._txn = {}
        self._txn_step = step

    def commit(self):
        """The step's update was applied: keep the compressor state as it is."""
        if not self.transactional:
            return
        if self._txn is None:
            raise RuntimeError(f"{type(self).__name__}.commit() without begin_step()")
        self._txn = None
        self._txn_step = None

    def rollback(self):
        """The step was skipped: every layer touched since ``begin_step`` gets back its
        residual and algorithm state (see the class docstring)."""
        if not self.transactional:
            return
        if self._txn is None:
            raise RuntimeError(f"{type(self).__name__}.rollback() without begin_step()")
        for name, (rsnap, ssnap) in self._txn.items():
            if rsnap is None:
                self._residuals.pop(name, None)
            else:
                r, buf = rsnap
                r.copy_(buf)
                self._residuals[name] = r
            if ssnap is _MISSING:
                self._layers.pop(name, None)
            else:
                self._layers[name] = ssnap
        self._txn = None
        self._txn_step = None

    def _touch(self, name: str):
        """Snapshot layer ``name`` before its first change in the open step."""
        if self._absent or not self.transactional:
            return
        txn = self._txn
        if txn is None:
            raise RuntimeError(f"{type(self).__name__}: transactional=True but layer "
                               f"{name!r} is compressed outside begin_step()/commit()")
        if name in txn:
            return
        r = self._residuals.get(name)
        rsnap = None
        if r is not None:
            buf = self._snap_bufs.get(name)
            if buf is None or buf.numel() != r.numel() or buf.device != r.device:
                buf = torch.empty_like(r)
                self._snap_bufs[name] = buf
            buf.copy_(r)
            rsnap = (r, buf)
        st = self._layers.get(name, _MISSING)
        txn[name] = (rsnap, _MISSING if st is _MISSING else _snap_state(st))

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
        grad_scale = _check_grad_scale(name, grad_scale, grad.device)
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
        self._layers = {} if st is None else {name: _snap_state(st)}
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
        if not self.layer_cfg(name).get("error_feedback", True):
            return False
        r = self._residuals.get(name)
        if r is None:
            self._touch(name)
            r = torch.zeros(values.numel(), dtype=torch.float32, device=values.device)
            self._residuals[name] = r
        r.add_(values.reshape(-1))
        return True

    def residual(self, name: str) -> Optional[torch.Tensor]:
        """The fp32 residual of a layer (None before its first compressed step)."""
        return self._residuals.get(name)

    # ------------------------------------------------------------------ state
    def config(self) -> dict:
        """Everything that determines what this compressor sends: type, every
        constructor argument (per-layer settings, policy with its overrides, warm-up,
        seed, other behaviour switches). Ranks must agree on it."""
        w = getattr(self, "warmup", None)
        return _plain(dict(type=type(self).__name__, settings=self._base_cfg(),
                           policy=self.policy.config(), seed=self.seed,
                           warmup=None if w is None else w.config(),
                           args={k: getattr(self, k) for k in self._extra_args}))

    def state_dict(self) -> dict:
        """Everything needed to continue identically: residuals, per-layer algorithm
        state (thresholds, cores, step counters), seed, statistics. Tensors are cloned."""
        return dict(type=type(self).__name__, version=1, config=self.config(),
                    rank=self.rank, world_size=self.world_size,
                    residuals={k: _deep_clone(v) for k, v in self._residuals.items()},
                    layers=_deep_clone(self._layers), stats=_deep_clone(self._stats.state_dict()))

    def load_state_dict(self, sd: dict):
        if not isinstance(sd, dict) or "type" not in sd:
            raise ValueError("state_dict: not a compressor state dict")
        if sd["type"] != type(self).__name__:
            raise ValueError(f"state_dict: saved by {sd['type']}, cannot load into "
                             f"{type(self).__name__}")
        mine = self.config()
        saved = _plain(sd["config"])
        if saved["settings"] != mine["settings"] or saved["seed"] != mine["seed"]:
            raise ValueError(f"state_dict: settings differ (saved {sd['config']}, "
                             f"this compressor {mine})")

        self._residuals = {k: _deep_clone(v).float() for k, v in sd["residuals"].items()}
        self._layers = _deep_clone(sd["layers"])
        self._stats.load_state_dict(_deep_clone(sd.get("stats", {})))
        self._txn = {} if self._txn is not None else None

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

    @staticmethod
    def _count(n: int, device) -> torch.Tensor:
        return torch.full((1,), n, dtype=torch.int32, device=device)

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

    def _encode(self, vals: torch.Tensor, enc: ValueEncoding, seed: int, quant_bucket: int,
                count: Optional[torch.Tensor] = None, want_deq: bool = True):
        """Encode fp32 ``vals`` -> (values tensor, scales or None, dequantised fp32;
        None with ``want_deq=False``: nothing to put back into a residual)."""
        if enc in FLOAT_DTYPES:
            if enc == ValueEncoding.FP32:
                return vals, None, vals
            v = to_wire_float(vals, enc)       # saturated: fp16 has no room above 65504
            return v, None, (v.float() if want_deq else None)
        bits = QUANT_BITS[enc]
        codes, scales = ops.quantize_pack(vals, bits, quant_bucket, seed, count=count)
        if not want_deq:
            return codes, scales, None
        deq = ops.dequantize_unpack(codes, scales, bits, quant_bucket, vals.numel())
        return codes, scales, deq

    def _dense_from_acc(self, name, acc, shape, enc, seed, quant_bucket,
                        error_feedback=True) -> LayerPayload:
        """All of ``acc`` as one DENSE segment in encoding ``enc``; with error feedback
        the residual (``acc`` itself) becomes ``acc - deq`` (0 for fp32)."""
        n = acc.numel()
        # fp32 travels as a copy (acc is zeroed below, or is a scratch buffer); the
        # other encodings only read acc into fresh tensors
        vals = acc.clone() if enc == ValueEncoding.FP32 else acc
        values, scales, deq = self._encode(vals, enc, seed, quant_bucket,
                                           want_deq=error_feedback)
        if error_feedback:
            if enc == ValueEncoding.FP32:
                acc.zero_()
            else:
                acc.sub_(deq)
        seg = Segment(numel=n, capacity=n, index_encoding=IndexEncoding.DENSE,
                      value_encoding=enc, count=self._count(n, acc.device), values=values,
                      scales=scales, quant_bucket=quant_bucket)
        return LayerPayload(name, shape, [seg])

    def _take(self, acc, idx, valid, count, enc, seed, quant_bucket, error_feedback=True):
        """Gather ``acc[idx]`` for the valid slots (a prefix of length ``count``),
        encode, and with error feedback set ``acc[i] -= deq`` on the valid slots.

        ``idx`` int64[cap] (padding slots must hold an in-range index, e.g. 0);
        ``valid`` bool[cap] or None (all valid). Returns (values, scales, idx_int32).
        """
        v = acc[idx]
        if valid is not None:
            v = torch.where(valid, v, torch.zeros((), dtype=v.dtype, device=v.device))
        values, scales, deq = self._encode(v, enc, seed, quant_bucket,
                                           count=count if valid is not None else None,
                                           want_deq=error_feedback)
        if error_feedback:
            delta = -deq
            if valid is not None:
                delta = torch.where(valid, delta, torch.zeros((), dtype=delta.dtype,
                                                              device=delta.device))
            # unique valid indices; padding slots add 0.0 (no change)
            acc.index_add_(0, idx, delta)
        return values, scales

    @staticmethod
    def _sparse_is_worth_it(numel: int, capacity: int, enc: ValueEncoding,
                            index_bytes: float = 4.0) -> bool:
        """True when ``capacity`` index/value pairs are smaller than the dense layer in
        the same value encoding (quantisation scales are ignored on both sides)."""
        if enc in FLOAT_BYTES:
            vb = FLOAT_BYTES[enc]
        else:
            vb = QUANT_BITS[enc] / 8.0
        return capacity * (index_bytes + vb) < numel * vb

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._base_cfg().items())
        return f"{type(self).__name__}({args})"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def k_of(density: float, n: int) -> int:
    """k = ceil(density * n), at least 1, at most n (the 1e-9 guards float noise such as
    ceil(0.01 * 100) = 2)."""
    return max(1, min(n, math.ceil(density * n - 1e-9)))
