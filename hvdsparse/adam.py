"""The Adam / AdamW recipe: a dense warm-up, then one of three *wires* compressed with
error feedback: every rank's own Adam step (``wire="update"``, the default but for
models with a recurrent layer: :func:`hvdsparse.adam_settings.default_wire`), or, with
the variance frozen after the warm-up, the gradient scaled by it (``"gradient"``; after
1-bit Adam, Tang et al. 2021, Algorithm 1, and DeepSpeed's ``OnebitAdam``, which
compress the momentum instead: ``"momentum"``; 0/1 Adam, Lu et al. 2022, refreshes the
variance on a schedule; ``refresh=`` here refreshes it from statistics each rank
gathers locally).

Why: Adam divides every coordinate by its own ``sqrt(v)``. With error feedback a small
coordinate of a compressed *gradient* waits in the residual and then arrives in one
lump; Adam's non-linear per-coordinate normalisation distorts the lump (and ``v`` sees
lumps instead of gradients), so compressing the gradient and applying Adam afterwards
loses quality. Two ways out: make the update linear in what travels by freezing ``v``
(the gradient and momentum wires: a linear update tolerates compression with error
feedback as SGD does, as long as ``v`` has settled), or let every rank apply Adam's
normalisation to its own gradient *before* compression and send the result (the update
wire: error feedback then works in parameter-step units, and nothing needs to settle).

Per parameter ``p`` of the wrapped ``torch.optim.Adam`` / ``AdamW`` (``s`` = Adam's
``state[p]["step"]`` before this step, identical on every rank; ``T_w`` = warm-up steps;
hyper-parameters of ``p``'s param group):

* **warm-up** (``s < T_w``): the local gradient ``g_i`` travels **dense** (fp32, exact,
  no residual), the exchange averages it into ``G`` and the wrapped optimizer's own
  ``step()`` runs: exact Adam, ``m`` and ``v`` updated as usual (``foreach`` / ``fused``
  honoured).
* **after warm-up** (``s >= T_w``), ``wire="gradient"`` (the default with a recurrent
  layer): on every rank ``i``

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
  every rank sets ``m <- X * D``, ``p <- p - lr / bc1 * X``.

  ``wire="update"`` (no frozen variance, no refresh; warm-up :data:`UPDATE_WARMUP` = 1
  step, which creates Adam's state from the averaged gradient, and by default for
  Threshold and AdaComp every later step at which the layer's learning rate rises,
  ``warmup_while_rate_rises``): every rank keeps Adam's moments of its *own* gradient
  and sends its own bias-corrected Adam step

      m_i <- beta1 * m_i + (1 - beta1) * g_i,   v_i <- beta2 * v_i + (1 - beta2) * g_i^2
      u_i  = m_i / (sqrt(v_i) / sqrt(1 - beta2^(s+1)) + eps) / (1 - beta1^(s+1))
      x_i  = lr_s * u_i

  (``m_i``, ``v_i`` = this rank's ``state["exp_avg"]`` / ``["exp_avg_sq"]``: they differ
  across ranks, as the residuals do; the parameters do not), and every rank applies
  ``p <- p * (1 - lr * wd)`` (AdamW), ``p <- p - X`` with ``X = (1/P) sum_i
  C(r_i + x_i)``. Nothing is frozen, so the preconditioner follows the run (a GPT's
  ``sqrt(v)`` moves 0.56-2.5x between steps 100 and 1000 as attention forms, which a
  frozen ``v`` cannot follow). The step travels with its learning rate, so error
  feedback is exact in parameter units under any schedule: an element held back during
  a learning-rate warm-up moves the parameter by what it was worth at its own step, not
  at the (larger) rate of the step that finally sends it. The cost: ``v_i``
  sees one rank's gradient noise rather than the average's (``1/P`` of it), which damps
  the steps of noise-dominated coordinates.

  Measured (each compressor's defaults, 3 seeds, BENCHMARKS "Transformer LM under
  AdamW"): on the GPT-style text-gpt (AdamW, P = 2, 1000 steps) the update wire ends
  +4.0% (TopK), +1.9% (Threshold), -4.1% (AdaComp) against dense AdamW, at 22-47x fewer
  bytes over the whole run, where the gradient wire ends +39.8% (TopK) and the momentum
  wire +17.7%; on the char-LSTM text-lm (Adam, P = 4, 900 steps) +1.0% (TopK), +0.35%
  (Threshold), +3.3% (AdaComp) against the gradient wire's +1.9%, +1.3%, +2.0% (and
  the momentum wire's +4.0% for TopK). Models with a recurrent layer keep the gradient
  wire by default, so those rows stay as measured.

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
what the dense baseline does. On the update wire a compressor may send them *whole*
instead (``Compressor.adam_small_layers_whole``, ``policy.is_whole``: TopK with fp16 /
bf16 values): they are then the recipe's own layers like the compressed ones (every
rank's own moments, ``x_i`` sent with error feedback), every element of ``acc`` in the
value encoding, so only the rounding waits in the residual. On the GPT-style LM (3
seeds, P = 2 and 4, constant rate and warm-up + cosine) TopK ended within 0.55 point of
its loss with them exact, at 15-17% fewer bytes (BENCHMARKS "Transformer LM under
AdamW"); an override's ``dense=True`` keeps a layer exact.

State, where the user expects it: ``state[p]["exp_avg"]`` (the synchronised momentum),
``["exp_avg_sq"]`` (frozen after ``T_w`` but for the refreshes) and ``["step"]`` stay
Adam's, so ``optimizer.state_dict()`` checkpoints and resumes the recipe; the phase of
every parameter (and ``c``) follows from its ``step``, ``T_w``, ``R`` and ``S``.
``compression_state_dict()`` records ``T_w``, ``R``, ``S`` and the wire under
``"adam_recipe"`` (and warns when a checkpoint was saved with others), with the local
refresh's per-rank window statistics; the per-rank residuals are the compressor's,
saved there as usual.

On the GPU path (Triton) the update wire's steps of a bucket's layers are made in one
launch (:meth:`AdamRecipe.bucket_own_step`, ``hvdsparse/adam_bucket.py``,
``kernels/bucket_adam.py``; the same bits as :meth:`AdamRecipe._own_step`) and go through
the compressor's bucket path; ``step()`` applies them with multi-tensor ops
(:meth:`AdamRecipe._update_together`). The warm-up, the other wires and the refreshes stay
per layer.

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
from typing import Dict, Optional

import torch

from . import ops
from .adam_checkpoint import RecipeCheckpoint
from .adam_refresh import VarianceRefresh, host_value
from .adam_settings import (AdamSettings, DEFAULT_REFRESH, DEFAULT_WARMUP,
                            REFRESH_START_FACTOR, UPDATE_WARMUP, WIRES, adam_setup,
                            check_adam, check_refresh, check_refresh_start, check_warmup,
                            default_refresh, is_adam)
from .payload import IndexEncoding, LayerPayload, Segment, ValueEncoding
from .momentum import clean_local_gradient
from .param_groups import GroupLookup

__all__ = ["AdamRecipe", "AdamSettings", "DEFAULT_REFRESH", "DEFAULT_WARMUP", "UPDATE_WARMUP",
           "REFRESH_START_FACTOR", "adam_setup", "check_adam", "default_refresh", "is_adam"]


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
                 refresh_start: Optional[int] = None, residual=None,
                 warmup_while_rate_rises: bool = False):
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
        if wire not in WIRES:
            raise ValueError(f"wire must be one of {', '.join(map(repr, WIRES))}, got "
                             f"{wire!r}")
        if wire == "update" and refresh is not None:
            raise ValueError(f"wire='update' keeps every rank's variance live: it has no "
                             f"refresh (got refresh={refresh!r})")
        #: what travels after the warm-up: ``g_i / D`` with the momentum applied to the
        #: exchanged average on every rank, ``m_i / D`` (1-bit Adam), or this rank's own
        #: Adam step ``u_i`` (module docstring)
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
        #: the warm-up also lasts while the learning rate rises: a layer's compressed
        #: phase starts at its first step past ``warmup`` at which its parameter group's
        #: (host) learning rate is not above the previous step's (a tensor ``lr`` is not
        #: read: no host sync; it never counts as rising). Every rank runs the same
        #: schedule, so every rank switches at the same step.
        self.while_rate_rises = bool(warmup_while_rate_rises)
        self._last_lr: dict = {}     # id(param group) -> its lr at the previous step
        self._rising: set = set()    # id(param group) whose lr rose at this step
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
        # wire="update": per layer name, this rank's new (m, v), committed in _update
        self._moments: dict = {}

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
        if self.while_rate_rises and id(self._groups.of(self.params[name])) in self._rising:
            return False
        self._after.add(name)
        self._steps[name] = int(s)   # counted on the host from here (_update)
        return True

    def layer_rate(self, name: str):
        """Layer ``name``'s learning rate this step (host float), None when it is a tensor
        (not read: no host sync) or ``name`` is not a recipe layer."""
        p = self.params.get(name)
        if p is None:
            return None
        lr = self._groups.of(p).get("lr")
        return None if isinstance(lr, torch.Tensor) or lr is None else float(lr)

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
        """Note which parameter groups' learning rate rose since the previous step."""
        if not self.while_rate_rises:
            return
        self._rising.clear()
        for group in self.optimizer.param_groups:
            lr = group.get("lr")
            if isinstance(lr, torch.Tensor) or lr is None:
                continue
            last = self._last_lr.get(id(group))
            if last is not None and lr > last:
                self._rising.add(id(group))
            self._last_lr[id(group)] = lr

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
        if self.wire == "update":
            return self._own_step(name, g, st, group), nonfinite
        if self.wire == "gradient":
            if self.precondition:
                return g / self._denom(st, group, self._steps[name]), nonfinite
            return g, nonfinite
        mi = st["exp_avg"].float() * b1 + g * (1.0 - b1)
        if self.precondition:
            return mi / self._denom(st, group, self._steps[name]), nonfinite
        return mi, nonfinite

    def own_step_constants(self, name: str, group: dict) -> tuple:
        """``(b1, c1, b2, c2, ib2, eps, ib1)`` of layer ``name``'s update-wire step
        (:meth:`_own_step`): ``c = 1 - b``, ``ib2 = 1 / sqrt(1 - b2^t)``, ``ib1 = 1 / (1 -
        b1^t)``, ``t`` = Adam's step + 1; host floats (the kernel takes their fp32)."""
        b1, b2 = (host_value(b) for b in group["betas"])
        t = self._steps[name] + 1
        return (b1, 1.0 - b1, b2, 1.0 - b2, 1.0 / math.sqrt(1.0 - b2 ** t),
                float(group["eps"]), 1.0 / (1.0 - b1 ** t))

    def _own_step(self, name: str, g: torch.Tensor, st: dict, group: dict) -> torch.Tensor:
        """``wire="update"``: this rank's Adam step from its own moments (torch's
        single-tensor formulas): ``m' = b1 m + (1 - b1) g``, ``v' = b2 v + (1 - b2) g^2``,
        ``u = m' / (sqrt(v') / sqrt(bc2) + eps) / bc1`` with ``bc = 1 - b^(s + 1)``,
        returned times this step's ``lr`` (the parameter displacement);
        ``(m', v')`` wait in ``_moments`` until :meth:`_update` commits them (a skipped
        step leaves Adam's state as it was). Every product and sum is its own fp32
        rounding, the divisions by constants are products with their fp32 reciprocals
        (:meth:`own_step_constants`): ``kernels/bucket_adam.py``'s bits (the bucket
        path, ``hvdsparse/adam_bucket.py``), on any device."""
        b1, c1, b2, c2, ib2, eps, ib1 = self.own_step_constants(name, group)
        m = st["exp_avg"].float().mul(b1).add_(g.mul(c1))
        v = st["exp_avg_sq"].float().mul(b2).add_(g.mul(g).mul_(c2))
        self._moments[name] = (m, v)
        denom = ops.sqrt_rn(v).mul_(ib2).add_(eps)
        u = m.div(denom).mul_(ib1)
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            return u.mul_(lr.to(device=u.device, dtype=u.dtype))
        return u.mul_(lr)

    # ----------------------------------------------------------------- bucket path
    def bucket_spec(self, name: str, grad: torch.Tensor, dense: bool):
        """The bucket path's question (``compressors/bucket.py``): ``(True, None)`` for a
        layer the compressor sends dense by its policy (exact Adam on the averaged cleaned
        gradient: a ``dense`` row, the per-layer path's bits) without local clipping;
        ``(False, None)`` for the recipe's own layers: their warm-up payloads are exact
        dense ones, their update-wire steps enter the bucket path already made
        (:meth:`bucket_own_step`, ``hvdsparse/adam_bucket.py``)."""
        return (dense and not self._compressed(name) and self.clip is None), None

    def bucket_own_step(self, name: str, grad: torch.Tensor, param: torch.Tensor):
        """``(state, group, constants)`` when layer ``name``'s update-wire step this step
        can be made by ``kernels/bucket_adam.py`` (the Triton path; the update wire past
        the warm-up; no local clipping; a host learning rate; fp32 moments and, with
        Adam's coupled weight decay, a parameter of the gradient's dtype, all contiguous
        on the gradient's device), else None (:meth:`corrected` makes it per layer)."""
        if self.wire != "update" or self.clip is not None or name not in self.params or \
                not ops.use_triton(grad) or grad.is_sparse or not grad.is_contiguous() or \
                grad.dtype not in (torch.float32, torch.float16, torch.bfloat16) or \
                not 0 < grad.numel() < 2 ** 31:
            return None
        if not self._compressed(name) or not self.frozen(name) or self.refreshing(name):
            return None
        group = self._groups.of(self.params[name])
        if isinstance(group["lr"], torch.Tensor) or group.get("amsgrad", False):
            return None
        st = self.optimizer.state[self.params[name]]
        for key in ("exp_avg", "exp_avg_sq"):
            t = st.get(key)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or \
                    not t.is_contiguous() or t.device != grad.device or \
                    t.numel() != grad.numel():
                return None
        if group.get("weight_decay", 0.0) and not group.get("decoupled_weight_decay", False) \
                and (param.dtype != grad.dtype or not param.is_contiguous() or
                     param.device != grad.device):
            return None
        return st, group, self.own_step_constants(name, group)

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
                together = []
                for name, p, M in stash:
                    if self._joins_update(name, p, M):
                        together.append((name, p, M))
                    else:
                        self._update(name, p, M)
                self._update_together(together)
        for _, p, M in stash:
            p.grad = M

    def _joins_update(self, name: str, p: torch.Tensor, M: torch.Tensor) -> bool:
        """Whether layer ``name``'s update-wire step is applied with the others'
        (:meth:`_update_together`): a host learning rate, a tensor ``step``, ``M`` of the
        parameter's dtype and device."""
        if self.wire != "update" or name not in self._moments:
            return False
        group = self._groups.of(p)
        st = self.optimizer.state[p]
        return not isinstance(group["lr"], torch.Tensor) and \
            isinstance(st.get("step"), torch.Tensor) and M.dtype == p.dtype and \
            M.device == p.device

    def _update_together(self, entries) -> None:
        """:meth:`_update` of update-wire layers with multi-tensor ops (a few launches per
        step on CUDA instead of four per layer; the same element-wise operations, so the
        same bits): ``step += 1``; AdamW's ``p *= 1 - lr * wd`` per distinct factor;
        ``exp_avg <- m'``, ``exp_avg_sq <- v'``; ``p -= X``."""
        if not entries:
            return
        steps, decay = [], {}
        ps, Ms, ms, vs, mts, vts = [], [], [], [], [], []
        for name, p, M in entries:
            group = self._groups.of(p)
            st = self.optimizer.state[p]
            self._steps[name] += 1
            steps.append(st["step"])
            wd = group.get("weight_decay", 0.0)
            if wd and group.get("decoupled_weight_decay", False):
                decay.setdefault(1 - group["lr"] * wd, []).append(p)
            m, v = self._moments.pop(name)
            ms.append(st["exp_avg"])
            vs.append(st["exp_avg_sq"])
            mts.append(m)
            vts.append(v)
            ps.append(p)
            Ms.append(M)
        torch._foreach_add_(steps, 1)
        for factor, plist in decay.items():
            torch._foreach_mul_(plist, factor)
        torch._foreach_copy_(ms + vs, mts + vts)
        torch._foreach_sub_(ps, Ms)

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
        if self.wire == "update":                     # M holds X = avg C(r_i + lr u_i)
            m, v = self._moments.pop(name)
            st["exp_avg"].copy_(m)
            st["exp_avg_sq"].copy_(v)
            p.sub_(M)
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
