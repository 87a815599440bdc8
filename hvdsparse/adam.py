"""The Adam / AdamW recipe: a dense warm-up, then a frozen variance and the gradient,
scaled by it, compressed with error feedback (after 1-bit Adam, Tang et al. 2021,
Algorithm 1, and DeepSpeed's ``OnebitAdam``, which compress the momentum instead; 0/1
Adam, Lu et al. 2022, refreshes the variance on a schedule; ``refresh=`` here refreshes
it from statistics each rank gathers locally).

Why: Adam divides every coordinate by its own ``sqrt(v)``. With error feedback a small
coordinate of a compressed *gradient* waits in the residual and then arrives in one
lump; Adam's non-linear per-coordinate normalisation distorts the lump (and ``v`` sees
lumps instead of gradients), so compressing the gradient and applying Adam afterwards
loses quality. Once ``v`` has settled it changes slowly; freezing it makes the update
linear in the momentum, and a linear update tolerates compression with error feedback
as SGD does.

Per parameter ``p`` of the wrapped ``torch.optim.Adam`` / ``AdamW`` (``s`` = Adam's
``state[p]["step"]`` before this step, identical on every rank; ``T_w`` = warm-up steps;
hyper-parameters of ``p``'s param group):

* **warm-up** (``s < T_w``): the local gradient ``g_i`` travels **dense** (fp32, exact,
  no residual), the exchange averages it into ``G`` and the wrapped optimizer's own
  ``step()`` runs: exact Adam, ``m`` and ``v`` updated as usual (``foreach`` / ``fused``
  honoured).
* **after warm-up** (``s >= T_w``), ``wire="gradient"`` (the default): on every rank ``i``

      g_i <- g_i + wd * p                 (Adam's L2 weight decay; not for AdamW)
      g_i <- -g_i                         (maximize=True)
      x_i  = g_i / D,   D = max(h, f * mean(h)) + eps,   h = sqrt(v / bc2)

  ``x_i`` is handed to the compressor as its "gradient" (error feedback = the
  compressor's residual: ``acc = r + x_i``, sends ``C(acc)``, ``r = acc - C(acc)``); the
  exchange averages the compressed values into ``X = (1/P) sum_i C(acc_i)``
  (bitwise identical on every rank), and every rank applies

      p <- p * (1 - lr * wd)              (AdamW's decoupled decay, as torch does it)
      m <- beta1 * m + (1 - beta1) * X * D     (m = state["exp_avg"])
      state["step"] <- s + 1;   v = state["exp_avg_sq"] unchanged (frozen)
      p <- p - lr / bc1 * m / D           (Adam with v frozen)
      bc1 = 1 - beta1 ** (s + 1),   bc2 = 1 - beta2 ** c,   f = 0.1 (mean over the layer)

  ``c`` = the steps ``v`` averages: ``T_w``, or the step of the last refresh (below).
  ``D`` is frozen, so the update is linear in ``X``: momentum SGD on the preconditioned
  gradient, with the momentum applied *after* the exchange on the synchronised ``X``.

  ``wire="momentum"`` (1-bit Adam as published; no variance refresh): the momentum
  travels instead, ``x_i = m_i / D`` with ``m_i = beta1 * m + (1 - beta1) * g_i``, and
  every rank sets ``m <- X * D``, ``p <- p - lr / bc1 * X``. Which wire is better depends
  on the model (3 seeds each, TopK(0.01), BENCHMARKS "Transformer LM under AdamW"): on
  the char-LSTM text-lm (P = 4, 900 steps) the gradient wire ends +1.9% above dense
  against +4.0% for the momentum wire -- the momentum wire spends the sparsifier's
  budget re-sending the decaying momentum of recently sent coordinates, which every
  rank already holds in ``m``; on the GPT-style text-gpt (P = 2, 1000 steps) the
  momentum wire ends +17.7% against +39.8%. The default stays ``"gradient"``.

* **variance refresh** (``refresh=R``, ``R >= 2``, from step ``S = refresh_start >=
  T_w``; the front doors' defaults: :data:`DEFAULT_REFRESH`, ``S =``
  :data:`REFRESH_START_FACTOR` ``T_w``): the steps ``k = S + R, S + 2R, ...`` advance the
  frozen ``v``, from statistics the ranks gather over the window since the last refresh
  (``refresh_from="local"``) or from the refresh step's averaged gradient
  (``"sample"``); the estimate, why it is built so and what it costs:
  :mod:`hvdsparse.adam_refresh`.

  Two deviations from 1-bit Adam as published (which compresses ``m_i`` itself and
  divides by ``sqrt(v)`` after the exchange), both measured in ``docs/bench/adam/``
  (``scripts/study_adam.py``, variants ``.../raw``): (1) what travels is in Adam's step
  units, divided by ``D``. ``D`` is frozen, so this is a fixed per-coordinate
  scaling and error feedback stays exact; but a compressor's error (AdaComp's one
  scale per layer, a quantiser's rounding, TopK's choice) is then bounded in *parameter
  step* units rather than gradient units -- with ``m_i`` compressed, a coordinate whose
  ``v`` is small gets ``lr * s / sqrt(v)`` from AdaComp's layer-wide scale ``s``, which
  diverged on the digits MLP. (2) ``f``: a coordinate that was (nearly) silent during
  the warm-up (a dead ReLU unit, an unused input) has ``v ~ 0``, and frozen, the first
  gradient it gets later moves it by ``lr * g / eps``; the floor bounds its step
  multiplier to ``1 / f`` times the layer's mean. Without it even the uncompressed
  recipe (TopK(1.0)) broke the digits MLP after a 33-step warm-up.

Bias correction: torch.optim.Adam divides ``m`` by ``1 - beta1^t`` and ``v`` by
``1 - beta2^t`` (both moments are averages started at 0) and computes
``denom = sqrt(v) / sqrt(bc2) + eps``, ``p -= lr / bc1 * m / denom``. The momentum keeps
averaging after the warm-up, so its correction keeps following the step (``t = s + 1``).
``v`` stopped averaging at step ``T_w``: its unbiased value is ``v / (1 - beta2^T_w)``,
so ``bc2`` is frozen with it (and moves only at a refresh) (continuing ``bc2`` with ``t`` would inflate the update by
``sqrt(bc2(t) / bc2(T_w))``, 1.8x at T_w = 300, t = 1000, beta2 = 0.999). The 1-bit Adam
paper and DeepSpeed's ``OnebitAdam`` use no bias correction at all (``x -= lr * m /
sqrt(v_Tw)``); with the correction above the first compressed step continues the warm-up's
last exact step without a jump. ``eps`` is added outside the square root, as torch does.

Layers the compressor sends dense by its size / 1-D policy (biases, norms, small
layers) get exact Adam on the averaged dense gradient, ``v`` keeps updating: they pay
no compression error, so nothing argues for freezing their variance, and exact Adam is
what the dense baseline does.

State, where the user expects it: ``state[p]["exp_avg"]`` (the synchronised momentum),
``["exp_avg_sq"]`` (frozen after ``T_w`` but for the refreshes) and ``["step"]`` stay
Adam's, so ``optimizer.state_dict()`` checkpoints and resumes the recipe; the phase of
every parameter (and ``c``) follows from its ``step``, ``T_w``, ``R`` and ``S``.
``compression_state_dict()`` records ``T_w``, ``R``, ``S`` and the wire under
``"adam_recipe"`` (and warns when a checkpoint was saved with others), with the local
refresh's per-rank window statistics; the per-rank residuals are the compressor's,
saved there as usual.

Transactions: nothing of this module's state changes before the optimizer applies a
step (``x_i`` is computed without being stored; ``m``, ``v``, ``step``, the host copy of
``step`` and the parameter change in ``step()`` only), so a step that GradScaler or
``nonfinite="skip"`` skips leaves it as it was; the compressor's residuals are rolled
back by the compressor's own transaction. ``begin_step`` / ``commit`` / ``rollback`` are
therefore no-ops (kept for the scheduler's local-update interface).

A trainable parameter without a gradient on a rank (unused on that rank) is a zero
gradient there, as Horovod's and DDP's zero-fill make it for dense Adam: that rank
contributes ``g_i = 0`` to the formulas above (during warm-up and refreshes: a dense
zero). A parameter frozen
with ``requires_grad=False`` is left alone.

What ``p.grad`` holds after ``synchronize()``: the averaged gradient ``G`` for warm-up,
refresh and dense layers, the averaged scaled gradient (or momentum) ``X`` for recipe
layers after the warm-up
(so clipping ``p.grad`` between ``synchronize()`` and ``step()`` clips the step; use
``clip_grad_norm=`` -- local clipping of ``g_i`` before it is sent -- instead).

Not supported (``ValueError``): ``amsgrad=True`` (its max of ``v`` has no frozen
counterpart), ``differentiable=True``, complex parameters, ``local_gradient``,
``momentum_correction`` (that is SGD's). ``foreach`` / ``fused`` apply to the wrapped
step of the warm-up and dense layers only; the recipe's own update is the single-tensor
form above. With ``capturable=True`` / ``fused=True`` Adam keeps ``step`` on the device,
and the phase check reads it (one host read per parameter and step until the parameter
leaves its warm-up).
"""
from __future__ import annotations

import math
from typing import Dict, NamedTuple, Optional

import torch

from .adam_checkpoint import RecipeCheckpoint
from .adam_refresh import VarianceRefresh, host_value
from .compressors.base import Compressor
from .payload import IndexEncoding, LayerPayload, Segment, ValueEncoding
from .momentum import clean_local_gradient
from .param_groups import GroupLookup

__all__ = ["AdamRecipe", "AdamSettings", "DEFAULT_REFRESH", "DEFAULT_WARMUP",
           "REFRESH_START_FACTOR", "adam_setup", "check_adam", "default_refresh", "is_adam"]

#: warm-up steps when the user gives none: ~30% of the 300-330-step runs measured in
#: docs/bench/adam/ (``scripts/study_adam.py``); on a 900-step run 300 was no better
#: than 100 with the gradient wire
DEFAULT_WARMUP = 100

#: variance refresh period when the user gives none (``adam_refresh=None``; AdaComp:
#: off, :func:`default_refresh`), and the start of the first window, in units of the
#: warm-up: on text-lm (P = 4, 900 steps) refreshing every 50 steps from step 3 T_w
#: takes TopK's loss gap to dense Adam from +2.54% to +1.66% and Threshold's from
#: +2.37% to +1.34%, and leaves runs of up to 3 T_w steps as they were (refreshes
#: from T_w cost 300-step runs 0.6-1.2 points)
DEFAULT_REFRESH = 50
REFRESH_START_FACTOR = 3


def is_adam(optimizer) -> bool:
    """torch.optim.Adam or AdamW (AdamW is a subclass of Adam in torch >= 2.6; checked
    by name too for older torch)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def check_adam(optimizer, where: str = "adam_recipe") -> None:
    """Raise ``ValueError`` for an Adam configuration the recipe cannot run."""
    if not is_adam(optimizer):
        raise ValueError(f"{where}: the Adam recipe needs torch.optim.Adam or AdamW, got "
                         f"{type(optimizer).__name__}")
    for i, g in enumerate(optimizer.param_groups):
        if g.get("amsgrad", False):
            raise ValueError(f"{where}: amsgrad=True (param group {i}) is not supported by "
                             f"the Adam recipe (its running max of v has no frozen form); "
                             f"use amsgrad=False, or adam_recipe=False to compress the "
                             f"gradient and apply AMSGrad after the exchange")
        if g.get("differentiable", False):
            raise ValueError(f"{where}: differentiable=True (param group {i}) is not "
                             f"supported by the Adam recipe")
        b1, b2 = (float(b) for b in g["betas"])
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"{where}: betas {g['betas']} of param group {i} must lie in "
                             f"[0, 1)")
        for p in g["params"]:
            if torch.is_complex(p):
                raise ValueError(f"{where}: complex parameter of shape {tuple(p.shape)} in "
                                 f"param group {i}: not supported by the Adam recipe")


def check_warmup(warmup) -> int:
    if warmup is None:
        return DEFAULT_WARMUP
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise ValueError(f"adam_warmup must be None (default {DEFAULT_WARMUP}) or an int "
                         f">= 1 (dense Adam steps before the variance is frozen), got "
                         f"{warmup!r}")
    return warmup


def check_refresh(refresh) -> Optional[int]:
    """The recipe's own ``refresh``: None (off) or an int >= 1 (R = 1 only for the
    sample refresh; the front doors resolve ``adam_refresh`` with
    :func:`resolve_refresh`)."""
    if refresh is None:
        return None
    if not isinstance(refresh, int) or isinstance(refresh, bool) or refresh < 1:
        raise ValueError(f"adam_refresh must be None (variance frozen after the warm-up) "
                         f"or an int >= 1 (steps between variance refreshes), got "
                         f"{refresh!r}")
    return refresh


def default_refresh(compression) -> Optional[int]:
    """``adam_refresh=None``: :data:`DEFAULT_REFRESH`, or None (off) for a compressor whose
    ``adam_refresh_by_default`` is False (AdaComp: on text-lm, P = 4, 900 steps, the
    refresh did not lower its loss gap to dense Adam, and one dense step in 50 costs it
    28% of its byte saving)."""
    if not isinstance(compression, Compressor) or compression.adam_refresh_by_default:
        return DEFAULT_REFRESH
    return None


def check_refresh_start(refresh_start, warmup: int) -> int:
    """``adam_refresh_start``: None -> ``REFRESH_START_FACTOR * T_w``; an int ``>= T_w``."""
    if refresh_start is None:
        return REFRESH_START_FACTOR * warmup
    if not isinstance(refresh_start, int) or isinstance(refresh_start, bool) or \
            refresh_start < warmup:
        raise ValueError(f"adam_refresh_start must be None (default {REFRESH_START_FACTOR} "
                         f"x adam_warmup) or an int >= adam_warmup ({warmup}): the Adam "
                         f"step after which the refresh windows start, got "
                         f"{refresh_start!r}")
    return refresh_start


def resolve_refresh(refresh, refresh_start, warmup: int, compression=None):
    """A front door's ``adam_refresh`` / ``adam_refresh_start`` -> the recipe's
    ``(refresh, refresh_start)``: ``adam_refresh=None`` is the compressor's default
    (:func:`default_refresh`), ``0`` / ``False`` freezes ``v`` for good (then
    ``refresh_start`` must be None); ``adam_refresh_start``: :func:`check_refresh_start`."""
    if refresh is None:
        refresh = default_refresh(compression)
        off = (f"the variance refresh is off by default for {type(compression).__name__}; "
               f"pass adam_refresh=R too")
    elif refresh is False or (refresh == 0 and isinstance(refresh, int)
                              and not isinstance(refresh, bool)):
        off = f"adam_refresh={refresh!r} turns the variance refresh off"
        refresh = None
    elif not isinstance(refresh, int) or isinstance(refresh, bool) or refresh < 2:
        raise ValueError(f"adam_refresh must be None (default: every {DEFAULT_REFRESH} "
                         f"steps), 0 / False (variance frozen after the warm-up) or an int "
                         f">= 2 (steps between variance refreshes), got {refresh!r}")
    if refresh is None:
        if refresh_start is not None:
            raise ValueError(f"adam_refresh_start={refresh_start!r} is given but {off}")
        return None, None
    return refresh, check_refresh_start(refresh_start, warmup)


class AdamSettings(NamedTuple):
    """The recipe's resolved front-door settings."""
    warmup: int
    refresh: Optional[int]            # None: v frozen for good after the warm-up
    refresh_start: Optional[int]
    wire: str = "gradient"            # what travels after the warm-up (module docstring)


def adam_setup(optimizer, compression, adam_recipe, adam_warmup, *, local_gradient=None,
               momentum_correction=False, adam_refresh=None,
               adam_refresh_start=None, adam_wire=None) -> Optional[AdamSettings]:
    """Validate the ``adam_recipe`` / ``adam_warmup`` / ``adam_refresh`` /
    ``adam_refresh_start`` / ``adam_wire`` arguments of a front door; return the
    resolved :class:`AdamSettings` when the recipe is on, None when it is off.
    ``adam_recipe=None`` (auto): on for ``torch.optim.Adam`` / ``AdamW`` with a compressor
    that compresses. ``adam_wire``: ``None`` / ``"gradient"`` (default) or
    ``"momentum"`` (1-bit Adam's wire, module docstring; it has no variance refresh, so
    ``adam_refresh`` must then be None or 0)."""
    if adam_wire not in (None, "gradient", "momentum"):
        raise ValueError(f"adam_wire must be None (default: 'gradient'), 'gradient' or "
                         f"'momentum', got {adam_wire!r}")
    if adam_recipe not in (None, True, False):
        raise ValueError(f"adam_recipe must be None (auto), True or False, got "
                         f"{adam_recipe!r}")
    if adam_recipe is None:
        on = is_adam(optimizer) and (not isinstance(compression, Compressor)
                                     or compression.compresses)
    else:
        on = adam_recipe
    if not on:
        for arg, val in (("adam_refresh", adam_refresh), ("adam_warmup", adam_warmup),
                         ("adam_refresh_start", adam_refresh_start), ("adam_wire", adam_wire)):
            if val is not None:
                raise ValueError(f"{arg}={val!r} is given but the Adam recipe is off "
                                 f"(adam_recipe={adam_recipe!r}, optimizer "
                                 f"{type(optimizer).__name__}, compression "
                                 f"{type(compression).__name__})")
        return None
    warmup = check_warmup(adam_warmup)
    wire = adam_wire or "gradient"
    if wire == "momentum":
        if adam_refresh not in (None, 0, False) or adam_refresh_start is not None:
            raise ValueError(f"adam_wire='momentum' has no variance refresh: adam_refresh "
                             f"must be None or 0 and adam_refresh_start None (got "
                             f"adam_refresh={adam_refresh!r}, adam_refresh_start="
                             f"{adam_refresh_start!r})")
        adam_refresh = 0
    refresh, start = resolve_refresh(adam_refresh, adam_refresh_start, warmup, compression)
    check_adam(optimizer)
    if local_gradient is not None:
        raise ValueError(f"local_gradient={local_gradient!r} cannot be combined with the "
                         f"Adam recipe (on by default for {type(optimizer).__name__}): every "
                         f"rank must apply the same synchronised momentum; pass "
                         f"adam_recipe=False to use the local-gradient modes")
    if momentum_correction:
        raise ValueError("momentum_correction is DGC's for torch.optim.SGD; with Adam / "
                         "AdamW the Adam recipe applies the momentum after the exchange "
                         "(adam_recipe)")
    return AdamSettings(warmup, refresh, start, wire)


class AdamRecipe(VarianceRefresh, RecipeCheckpoint):
    """The recipe for one optimizer (see the module docstring). Same interface as
    :class:`hvdsparse.momentum.LocalUpdate` where the scheduler / DDP hook call it.

    ``optimizer``: the torch optimizer whose ``state`` / ``param_groups`` are read at use
    time (``load_state_dict`` replaces both); ``params``: name -> parameter;
    ``compressed(name)``: True when the compressor compresses that layer (not sent dense
    by its policy); ``warmup``: ``T_w``; ``clip_grad_norm``: DGC's local clipping of
    ``g_i`` to ``c / sqrt(P)`` per layer before it enters the momentum."""

    state_key = "adam_recipe"
    #: a refresh rescales the residual by ``D_old / D_new`` (study knob: False keeps the
    #: residual in the old ``g / D_old`` units)
    rescale_residual = True
    momentum_correction = False      # no DGC velocity (scheduler: no dense momentum)
    zero_fills_absent = True         # a trainable layer without a gradient is zero

    def __init__(self, optimizer, params: Dict[str, torch.Tensor], world_size: int,
                 compressed, *, warmup: int, clip_grad_norm: Optional[float] = None,
                 precondition: bool = True, floor: float = 0.1, wire: str = "gradient",
                 refresh: Optional[int] = None, refresh_from: str = "local",
                 refresh_start: Optional[int] = None, residual=None):
        self.optimizer = optimizer
        self.params = dict(params)
        self.world_size = int(world_size)
        self._compressed = compressed
        self.warmup = check_warmup(warmup)
        self.clip = None if clip_grad_norm is None else \
            float(clip_grad_norm) / (self.world_size ** 0.5)
        #: compress ``x / D`` (True, the default) or ``x`` itself (1-bit Adam as
        #: published; measured in docs/bench/adam/: diverges with AdaComp)
        self.precondition = bool(precondition)
        #: lower bound of every coordinate's frozen ``sqrt(v_hat)``, as a fraction of the
        #: layer's mean ``sqrt(v_hat)`` (0 = none; see the module docstring)
        self.floor = float(floor)
        if wire not in ("momentum", "gradient"):
            raise ValueError(f"wire must be 'momentum' or 'gradient', got {wire!r}")
        #: what travels after the warm-up: ``m_i / D`` (1-bit Adam) or ``g_i / D`` with
        #: the momentum applied to the exchanged average on every rank
        self.wire = wire
        #: variance refresh period R (None: v frozen for good): every R-th step from
        #: ``refresh_start`` on travels dense and advances ``v`` (a checkpoint's
        #: schedule replaces it in load_state_dict)
        self.refresh = check_refresh(refresh)
        #: the Adam step ``S`` after which the refresh windows start (None: ``T_w``): the
        #: first refresh is step ``S + R`` and advances ``v`` by ``S + R - T_w`` steps
        self.refresh_start = None if refresh_start is None else \
            check_refresh_start(refresh_start, self.warmup)
        if refresh_from not in ("local", "sample"):
            raise ValueError(f"refresh_from must be 'local' or 'sample', got "
                             f"{refresh_from!r}")
        if refresh_from == "local" and self.refresh is not None:
            if self.refresh < 2:
                raise ValueError(f"adam_refresh={self.refresh}: a refresh step's gradient "
                                 f"travels with the next step, so the period must be >= 2")
            if wire != "gradient" or not precondition:
                raise ValueError(f"the local variance refresh needs wire='gradient' and "
                                 f"precondition=True (got wire={wire!r}, precondition="
                                 f"{precondition!r}); use refresh_from='sample'")
        #: what a refresh advances ``v`` with: ``"local"`` (every rank's window average
        #: of its own ``g_i^2``, averaged by the refresh step's dense exchange, and the
        #: window's mean exchanged gradient; the refresh step's gradient travels with
        #: the next step) or ``"sample"`` (the refresh step's averaged gradient ``G`` itself,
        #: standing for R steps; measured worse)
        self.refresh_from = refresh_from
        #: name -> the compressor's residual of that layer (rescaled when D changes)
        self._residual = residual or (lambda name: None)
        self._steps: dict = {}       # name -> Adam step before this step (host copy)
        self.u: dict = {}            # no DGC velocity: nothing to mask
        self.transactional = False
        self._after: set = set()     # layers known to be past their warm-up (cache)
        self._groups = GroupLookup(optimizer)   # param -> its current param group
        self._stash: list = []
        # refresh_from="local", per layer name, this rank's: window statistics, this
        # step's pending gradient (committed in _update) and the gradient a refresh step
        # carries over to the next
        self._acc: dict = {}         # A: this rank's average of g_i^2 over the window
        self._gsum: dict = {}        # B: the window's sum of the exchanged gradient
        self._pend: dict = {}
        self._carry: dict = {}

    # ----------------------------------------------------------------- phase
    def frozen(self, name: str) -> bool:
        """True when ``name`` is a recipe layer past its warm-up (``step >= T_w``):
        compressed scaled gradient, frozen variance. Identical on every rank."""
        if name in self._after:
            return True
        if not self._compressed(name):
            return False
        st = self.optimizer.state.get(self.params[name])
        if not st or "step" not in st:
            return False
        s = host_value(st["step"])
        if s < self.warmup:
            return False
        self._after.add(name)
        self._steps[name] = int(s)   # counted on the host from here (_update)
        return True

    def forget(self):
        """The optimizer's state was replaced (load_state_dict): re-read every phase."""
        self._after.clear()
        self._steps.clear()

    def sends_dense(self, name: str) -> bool:
        """Warm-up (exact Adam) or a variance refresh of a recipe layer: its gradient
        travels dense, without the residual."""
        return self._compressed(name) and (not self.frozen(name) or self.refreshing(name))

    # ----------------------------------------------------------------- transactions
    def begin_step(self):
        pass

    def commit(self):
        pass

    def rollback(self):
        pass

    # ----------------------------------------------------------------- before compress
    def wants(self, name: str) -> bool:
        return name in self.params

    def corrected(self, name: str, grad: torch.Tensor, param: torch.Tensor, dense: bool,
                  grad_scale: Optional[torch.Tensor], nonfinite: Optional[torch.Tensor] = None):
        """``(x, nonfinite)``: what travels for this layer -- the (unscaled, clipped)
        gradient in warm-up, refreshes and for dense layers, ``x_i`` after the warm-up -- and the
        int32[1] count of non-finite elements of ``grad`` (zeroed here). ``nonfinite``: a
        zeroed int32[1] counter to count into (the scheduler's slice of the step's
        counter tensor, ``clean_local_gradient``); None: a new one."""
        g, nonfinite = clean_local_gradient(grad, grad_scale, self.clip, nonfinite)
        local = self._local() and not dense and self.frozen(name)
        if dense or not self.frozen(name) or (self.refreshing(name) and not local):
            return g, nonfinite
        group = self._groups.of(param)
        wd = group.get("weight_decay", 0.0)
        if wd and not group.get("decoupled_weight_decay", False):
            g = g + wd * param.detach().float()
        if group.get("maximize", False):
            g = -g
        b1 = host_value(group["betas"][0])
        st = self.optimizer.state[self.params[name]]
        if local:
            return self._local_x(name, g, st, group), nonfinite
        if self.wire == "gradient":
            if self.precondition:
                return g / self._denom(st, group, self._steps[name]), nonfinite
            return g, nonfinite
        mi = st["exp_avg"].float() * b1 + g * (1.0 - b1)
        if self.precondition:
            return mi / self._denom(st, group, self._steps[name]), nonfinite
        return mi, nonfinite

    def _denom(self, st: dict, group: dict, step: int) -> torch.Tensor:
        """``D = max(s, floor * mean(s)) + eps`` with ``s = sqrt(v) / sqrt(1 - beta2^c)``,
        ``c`` = :meth:`_v_count` of the step (v frozen between refreshes: the same every
        step; the mean over the layer stays on the device)."""
        b2 = host_value(group["betas"][1])
        s = st["exp_avg_sq"].float().sqrt() / math.sqrt(1 - b2 ** self._v_count(step))
        if self.floor > 0:
            s = torch.maximum(s, s.mean() * self.floor)
        return s.add_(group["eps"])

    def dense_payload(self, name: str, x: torch.Tensor) -> LayerPayload:
        """``x`` as one DENSE fp32 segment (no residual: exact), the layout a
        policy-dense layer has."""
        flat = x.detach().float().reshape(-1).contiguous()
        n = flat.numel()
        seg = Segment(numel=n, capacity=n, index_encoding=IndexEncoding.DENSE,
                      value_encoding=ValueEncoding.FP32,
                      count=torch.full((1,), n, dtype=torch.int32, device=flat.device),
                      values=flat)
        return LayerPayload(name, x.shape, [seg])

    def mask(self, name: str, payload, undelivered=None):
        pass                         # no DGC velocity (``self.u`` stays empty)

    # ----------------------------------------------------------------- the step
    def neutralised(self):
        """Context around the wrapped optimizer's ``step()``: on entry the recipe layers
        past their warm-up hide ``p.grad`` (= ``X``) so the wrapped Adam skips them; on a
        normal exit the recipe's update is applied to them and ``p.grad`` comes back."""
        return _Around(self)

    def enter(self):
        self._stash = []
        for name, p in self.params.items():
            if p.grad is not None and self.frozen(name):
                self._stash.append((name, p, p.grad))
                p.grad = None

    def exit(self, ok: bool):
        stash, self._stash = self._stash, []
        if ok:
            with torch.no_grad():
                for name, p, M in stash:
                    self._update(name, p, M)
        for _, p, M in stash:
            p.grad = M

    def _update(self, name: str, p: torch.Tensor, M: torch.Tensor):
        group = self._groups.of(p)
        st = self.optimizer.state[p]
        lr = group["lr"]
        b1 = host_value(group["betas"][0])
        wd = group.get("weight_decay", 0.0)
        s = self._steps[name]
        refresh = self.refreshing(name)
        self._steps[name] = s + 1
        local = self._local()
        if refresh:                                   # before step / p change
            d_old = self._denom(st, group, s)
            if not local:                             # M holds the averaged gradient
                G = M.float()
                if wd and not group.get("decoupled_weight_decay", False):
                    G = G + wd * p.detach().float()
                if group.get("maximize", False):
                    G = -G
        step_t = st["step"]
        if isinstance(step_t, torch.Tensor):
            step_t += 1                               # in place, as torch's Adam does
        else:                                         # a state dict with a float step
            st["step"] = step_t = step_t + 1
        if wd and group.get("decoupled_weight_decay", False):
            p.mul_(1 - lr * wd)
        if isinstance(step_t, torch.Tensor) and step_t.device.type != "cpu":
            bc1 = 1 - torch.pow(b1, step_t)          # device step: no host read
        else:
            bc1 = 1 - b1 ** host_value(step_t)
        step_size = lr / bc1
        if refresh:
            if local:                                 # M holds the ranks' statistics
                self._refresh_local(name, st, group, M.float(), d_old, s, step_size, p)
            else:
                self._refresh(name, st, group, G, d_old, s, step_size, p)
            return
        denom = self._denom(st, group, s)
        if self.wire == "gradient":                   # M holds X = avg C(g_i [/ D])
            m = st["exp_avg"]
            XD = M * denom if self.precondition else M
            m.mul_(b1).add_(XD, alpha=1 - b1)
            if local:
                self._accumulate(name, group, XD)
            if isinstance(step_size, torch.Tensor):
                p.sub_(m / denom * step_size.to(p.device))
            else:
                p.addcdiv_(m, denom, value=-step_size)
            return
        if self.precondition:                         # M holds X = avg C(m_i / D)
            st["exp_avg"].copy_(M * denom)
            if isinstance(step_size, torch.Tensor):
                p.sub_(M * step_size.to(p.device))
            else:
                p.add_(M, alpha=-step_size)
            return
        st["exp_avg"].copy_(M)
        if isinstance(step_size, torch.Tensor):       # lr or step as a tensor
            p.sub_(st["exp_avg"] / denom * step_size.to(p.device))
        else:                                         # torch's single-tensor form
            p.addcdiv_(st["exp_avg"], denom, value=-step_size)


class _Around:
    def __init__(self, recipe: AdamRecipe):
        self.recipe = recipe

    def __enter__(self):
        self.recipe.enter()
        return self

    def __exit__(self, exc_type, *exc):
        self.recipe.exit(exc_type is None)
        return False
