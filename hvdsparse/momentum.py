"""DGC's momentum correction, momentum-factor masking and local gradient clipping
(Lin et al., "Deep Gradient Compression", ICLR'18), applied on each rank before its
gradient meets the compressor.

Why: with error feedback a small coordinate waits several steps in the residual before
it is sent; if the wrapped optimizer then applies momentum to the sparse, delayed
gradient, the delay compounds and the momentum points the wrong way. DGC accumulates
the *velocity* locally instead and sends the top of the accumulated velocity.

Per compressed layer on rank ``r`` (``m`` momentum, ``wd`` weight decay, ``d``
dampening of the wrapped ``torch.optim.SGD`` param group):

    g  <- clip(g, c / sqrt(P))          (``clip_grad_norm=c``: local clipping, per layer)
    g  <- g + wd * w                    (weight decay folded in before the momentum)
    u  <- m * u + (1 - d) * g           (nesterov: u <- m * u + g;  x = g + m * u)
    x   = u                             (what the compressor receives as "gradient")
    compressor: v = residual + x, sends top(v), residual = v - sent  (v: DGC's velocity)
    u[sent] <- 0                        (momentum-factor masking, ``momentum_masking=True``
                                         only, see below; after the exchange, only
                                         where the element was delivered: balanced's
                                         dropped ones went back into the residual; not
                                         while a density warm-up holds the layer above
                                         both its target and (1 - m) / 2)

and the wrapped optimizer applies the exchanged average ``G`` with momentum 0 and weight
decay 0 (``w <- w - lr * G``); hvdsparse sets both to 0 only for the duration of the
wrapped ``step()``, so ``param_groups`` and checkpoints keep the user's values. Layers
that the compressor sends dense (its size / 1-D policy) keep ordinary momentum, applied
after the exchange to the averaged gradient (identical on every rank):
``buf <- m * buf + (1 - d) * (G + wd * w)``, update ``buf`` (nesterov: ``G' + m * buf``).

Masking is off by default (``momentum_masking=False`` in both front doors; the
``LocalUpdate`` class itself implements DGC's rule, ``masking=True``). Without it the
velocity is linear in the gradients and nothing is dropped: every step adds the whole
velocity into the residual, so the ranks' sent values add up, with a delay, to the
momentum SGD update. DGC masks to stop a coordinate that waited long in the residual
from being pushed on by its stale momentum after it is sent. On this project's
workloads (digits MLP and CNN, P = 4, TopK / Threshold / AdaComp) masking cost accuracy
and steps to a target in short runs and made no difference in longer ones, hence the
default; DGC's own regime (0.1% density over 10^5 steps) was not measured, and
``momentum_masking=True`` restores DGC's rule.

Masking during a density warm-up (``TopK`` / ``Threshold`` / ``RandomK(warmup=...)``):
masking exists for coordinates that wait many steps in the residual, whose velocity would
otherwise keep pushing a direction that the delayed update has already taken. While a
warm-up keeps a layer's density above ``(1 - m) / 2`` (and above its target), each
coordinate is sent every few steps and masking would only discard momentum: at density 1
masked DGC is SGD *without* momentum, while unmasked it is exactly momentum SGD (the
velocity is linear in the gradients, so the sum of the ranks' sent velocities is the
dense momentum update). So masking is suspended there and resumes when the warm-up has
lowered the density (``Compressor.warmup_density``). (With masking throughout, DGC's
4-stage warm-up fell behind no warm-up at all on the 4.35 M-parameter MLP at P = 4; with
masking suspended its first steps track dense training.)

What the user writes stays the same: ``torch.optim.SGD(params, lr, momentum=0.9,
nesterov=..., weight_decay=...)`` wrapped with ``momentum_correction=True``.

Local clipping (DGC section 3.2): each layer's local gradient is scaled to norm at most
``c * P**-0.5`` before it is accumulated (the N^-1/2 keeps the clipped sum of P ranks at
the scale of a dense ``clip_grad_norm_(..., c)``); computed on the device, no host sync.

With non-finite gradients the elements are zeroed before they reach the velocity (they
would poison it forever) and counted into the payload's ``nonfinite``, so the
optimizer's non-finite policy sees them as usual.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from . import codec, ops
from .compressors.base import Compressor
from .param_groups import GroupLookup

__all__ = ["LocalUpdate", "UNMASKED_MAX_DENSITY", "clean_local_gradient",
           "resolve_momentum_correction"]


#: the densest TopK / Threshold setting the rule turns momentum correction on for when
#: masking is off: the densest setting at which it was measured not to hurt
UNMASKED_MAX_DENSITY = 0.25


def resolve_momentum_correction(momentum_correction, optimizer, compression,
                                local_gradient=None, momentum_masking=False) -> bool:
    """The ``momentum_correction`` argument of a front door, resolved. ``True`` /
    ``False``: as given. ``None`` (auto, the default): **on** when

    * ``optimizer`` is a ``torch.optim.SGD`` with momentum ``m > 0`` (largest over its
      param groups) and no local-gradient mode is set;
    * the compressor is a sparsifier whose error feedback delays coordinates:
      ``AdaComp``, or ``TopK`` / ``Threshold`` with error feedback at a density ``d``
      (``ratio``, ``1 - sparsity``) of at most :data:`UNMASKED_MAX_DENSITY` (0.25)
      without masking (``momentum_masking=False``, the default), and at most
      ``(1 - m) / 2`` with masking (0.05 at ``m = 0.9``).

    Off otherwise. Why the tight bound with masking: momentum-factor masking zeroes a
    coordinate's velocity whenever it is sent, so a coordinate sent about every ``1/d``
    steps keeps its momentum only if that is well beyond the momentum's horizon
    ``1/(1 - m)``; at ``TopK(1.0)`` every coordinate is sent every step and masked DGC
    is SGD without momentum. Measured on digits-cnn at P = 4 (3 seeds): masked momentum
    correction at 10% / 25% ends 3.6 / 8.1 pp below dense. Without masking the velocity
    is kept, every step adds the whole velocity into the residual, and what the ranks
    send adds up to the momentum SGD update, only delayed. Unmasked correction was
    measured up to density 0.25 (digits MLP and CNN at P = 4, TopK 5% to 25%: final
    accuracy within noise of no correction, steps to target mostly fewer); denser
    settings were not, and at ``TopK(1.0)`` correction would only reorder the
    floating-point sums of momentum SGD, so the rule stops at 0.25 and ``TopK(1.0)``
    stays exactly plain Horovod.

    Why on: with TopK 1%, Threshold 99% and AdaComp at m = 0.9 (digits MLP and CNN,
    P = 2 and 4) correction raised final accuracy and cut steps to target in all but
    one measured case (AdaComp on the CNN at P = 4). Other compressors were not measured
    with it (QSGD sends every coordinate; Slim-DP, RandomK), so auto leaves them alone.

    The default of both front doors (``None``). The local update works in place (the
    velocity updated with ``mul_`` / ``add_``, the finite check one reduction on the
    CPU, masking O(capacity) with ``codec.sent_positions``): no full-size temporaries
    and no decode of the layer's own payload per step."""
    if momentum_correction not in (None, True, False):
        raise ValueError(f"momentum_correction must be None (auto), True or False, got "
                         f"{momentum_correction!r}")
    if not isinstance(momentum_masking, bool):
        raise ValueError(f"momentum_masking must be a bool, got {momentum_masking!r}")
    if momentum_correction is not None:
        return momentum_correction
    if local_gradient is not None or type(optimizer) is not torch.optim.SGD:
        return False
    m = max(float(g.get("momentum", 0.0) or 0.0) for g in optimizer.param_groups)
    if m <= 0.0:
        return False
    if not isinstance(compression, Compressor):
        return False
    if compression.momentum_correction_always:
        return True
    density = compression.error_feedback_density()
    if density is None:
        return False
    if not momentum_masking:
        return density <= UNMASKED_MAX_DENSITY
    # the tolerance keeps the documented boundary: (1 - 0.9) / 2 is 0.04999... in binary
    return density <= (1.0 - m) / 2.0 + 1e-12


def clean_local_gradient(grad: torch.Tensor, grad_scale: Optional[torch.Tensor],
                         clip: Optional[float], nonfinite: Optional[torch.Tensor] = None):
    """The first part of every local update, on the device: ``g = grad * grad_scale``
    (AMP's inverse scale) in fp32, non-finite elements counted (int32[1]) and zeroed
    (they would poison a velocity or momentum forever), then DGC's local clipping of
    the layer to norm ``clip`` (already ``c / sqrt(P)``) when ``clip`` is set.
    Returns ``(g, nonfinite)``; ``g`` may be ``grad`` itself (fp32, no scale, all
    finite, no clipping): callers must not write to it. ``nonfinite``: an int32[1]
    counter on ``grad``'s device to add the count into (the scheduler's slice of one
    zeroed per-step tensor), returned as the second element; None: a new zeroed one.

    CPU: one reduction decides: a finite sum of the elements means every element is
    finite (a NaN or an infinity makes any sum non-finite), so the usual case reads the
    layer once and allocates nothing; the element-wise check runs only when the sum is
    not finite (which includes finite elements whose sum overflows). Reading the sum is
    not a host synchronisation on the CPU. The device path (``ops.use_triton``): one
    launch (``ops.clean_grad``, ``kernels/clean.py``) plus the counter's zeroing (none
    with a ``nonfinite`` passed in), no host sync."""
    g = None
    if not ops.use_triton(grad):
        g = grad.detach().float()
        if grad_scale is not None:
            g = g * grad_scale
        if not bool(torch.isfinite(g.sum())):   # the CPU path: not every element finite
            g = None
    if nonfinite is None:
        nonfinite = torch.zeros(1, dtype=torch.int32, device=grad.device)
    if g is None:
        # the element-wise rule: scale, count, zero the non-finite elements (Triton: one
        # launch, kernels/clean.py)
        g = ops.clean_grad(grad.detach().reshape(-1), grad_scale=grad_scale,
                           nonfinite=nonfinite).view(grad.shape)
    if clip is not None:
        norm = torch.linalg.vector_norm(g)
        g = g * torch.clamp(clip / (norm + 1e-6), max=1.0)
    return g, nonfinite


class _Group:
    __slots__ = ("momentum", "dampening", "nesterov", "weight_decay")

    def __init__(self, g: dict):
        self.momentum = float(g.get("momentum", 0.0) or 0.0)
        self.dampening = float(g.get("dampening", 0.0) or 0.0)
        self.nesterov = bool(g.get("nesterov", False))
        self.weight_decay = float(g.get("weight_decay", 0.0) or 0.0)


class LocalUpdate:
    """Momentum correction / masking and local clipping for one optimizer (see the module
    docstring). ``optimizer``: the wrapped torch optimizer, whose param groups are read
    at use time (``load_state_dict`` replaces them: :mod:`hvdsparse.param_groups`);
    ``params``: name -> parameter."""

    def __init__(self, optimizer, params: Dict[str, torch.Tensor], world_size: int, *,
                 momentum_correction: bool, clip_grad_norm: Optional[float],
                 masking: bool = True):
        self.world_size = int(world_size)
        self.momentum_correction = bool(momentum_correction)
        self.masking = bool(masking)         # momentum-factor masking (module docstring)
        self.clip = None if clip_grad_norm is None else float(clip_grad_norm) / \
            (self.world_size ** 0.5)
        self.params = dict(params)
        self._groups = GroupLookup(optimizer)
        for p in self.params.values():      # every parameter must be optimised
            self._groups.of(p)
        self.u: Dict[str, torch.Tensor] = {}        # velocity of compressed layers
        self.buf: Dict[str, torch.Tensor] = {}      # momentum buffer of dense layers
        self._snap: Optional[dict] = None
        self.transactional = False
        self._masks: Dict[str, torch.Tensor] = {}  # reused bool scratch of mask()

    def _mask_buf(self, n: int, device) -> torch.Tensor:
        """A reused bool buffer of at least ``n`` elements on ``device``."""
        b = self._masks.get(str(device))
        if b is None or b.numel() < n:
            b = self._masks[str(device)] = torch.empty(n, dtype=torch.bool, device=device)
        return b[:n]

    # ----------------------------------------------------------------- transactions
    def begin_step(self):
        self._snap = {} if self.transactional else None

    def _touch(self, store: dict, name: str):
        if self._snap is not None and (id(store), name) not in self._snap:
            t = store.get(name)
            self._snap[(id(store), name)] = (store, name, None if t is None else t.clone())

    def rollback(self):
        for store, name, t in (self._snap or {}).values():
            if t is None:
                store.pop(name, None)
            else:
                store[name] = t
        self._snap = {} if self.transactional else None

    def commit(self):
        self._snap = {} if self.transactional else None

    # ----------------------------------------------------------------- before compress
    def corrected(self, name: str, grad: torch.Tensor, param: torch.Tensor, dense: bool,
                  grad_scale: Optional[torch.Tensor], nonfinite: Optional[torch.Tensor] = None):
        """What the compressor receives for this layer: ``(x, nonfinite)`` where ``x`` is
        the (clipped, decayed, momentum-corrected) fp32 gradient and ``nonfinite`` an
        int32[1] device count of the non-finite elements of ``grad`` (zeroed here).
        ``nonfinite``: a zeroed int32[1] counter to count into (see
        :func:`clean_local_gradient`); None: a new one."""
        g, nonfinite = clean_local_gradient(grad, grad_scale, self.clip, nonfinite)
        h = _Group(self._groups.of(self.params[name]))
        if not self.momentum_correction or h.momentum == 0.0 or dense:
            return g, nonfinite
        if h.weight_decay:
            g = g + h.weight_decay * param.detach().float()
        self._touch(self.u, name)
        u = self.u.get(name)
        if u is None:
            u = self.u[name] = torch.zeros_like(g)
        # in place (the velocity is the only full-size state; no temporaries): the
        # same roundings as u * m + (1 - d) * g, one multiply and one add per element
        u.mul_(h.momentum)
        if h.nesterov:
            u.add_(g)
            x = g + h.momentum * u
        else:
            u.add_(g if h.dampening == 0.0 else (1.0 - h.dampening) * g)
            x = u      # read by the compressor before the next write to u (mask)
        return x, nonfinite

    def bucket_spec(self, name: str, grad: torch.Tensor, dense: bool):
        """The bucket path's form of :meth:`corrected` (``compressors/topk_bucket.py``
        folds the velocity update into its residual add): ``(fusable, spec)``.
        ``fusable`` is False when the layer needs the per-layer path (local clipping
        reads the layer's norm first); ``spec`` is None when no momentum is corrected
        for it (the compressor then accumulates the clean gradient), else a
        ``MomentumSpec`` holding the velocity (created as zeros on first use, snapshot
        for a rollback as in :meth:`corrected`)."""
        from .compressors.topk_bucket import MomentumSpec
        if self.clip is not None:
            return False, None
        h = _Group(self._groups.of(self.params[name]))
        if not self.momentum_correction or h.momentum == 0.0 or dense:
            return True, None
        self._touch(self.u, name)
        u = self.u.get(name)
        if u is None:
            u = self.u[name] = torch.zeros(grad.shape, dtype=torch.float32,
                                           device=grad.device)
        return True, MomentumSpec(u, h.momentum, h.dampening, h.nesterov, h.weight_decay)

    def fused_spec(self, compressor, name: str, grad: torch.Tensor, param: torch.Tensor):
        """The ``MomentumSpec`` to hand to ``compressor.compress(..., momentum=spec)``
        when the compressor folds the velocity update into its own pass for this layer
        (``Compressor.fuses_momentum``: AdaComp's compiled CPU route), else None (the
        caller uses :meth:`corrected`). The same bits either way."""
        dense = compressor.policy.is_dense(name, grad.shape)
        if dense or not compressor.fuses_momentum(name, grad, param):
            return None
        fusable, spec = self.bucket_spec(name, grad, dense)
        return spec if fusable else None

    def masks_now(self, name: str, warmup_density: Optional[float]) -> bool:
        """Whether :meth:`mask` masks layer ``name`` at this step (masking on, and the
        warm-up rule)."""
        if not self.masking:
            return False
        return warmup_density is None or warmup_density <= \
            (1.0 - _Group(self._groups.of(self.params[name])).momentum) / 2.0

    def mask(self, name: str, payload, undelivered: Optional[torch.Tensor] = None,
             warmup_density: Optional[float] = None):
        """Momentum-factor masking: ``u[sent] = 0`` for every element this rank's
        ``payload`` of the layer carries (each segment's slots below its count).
        ``warmup_density`` (``Compressor.warmup_density``: the layer's density while a
        density warm-up holds it above its target): no masking at this step when it is
        above ``(1 - m) / 2`` (see the module docstring: during such a warm-up every
        coordinate is sent within a few steps, nothing waits long enough for its
        momentum to go stale, and masking would only throw the momentum away).
        ``undelivered`` (the exchange's not-delivered own
        share, see ``Pending.undelivered``): an element the exchange dropped went back
        into the residual, so its velocity is kept too. Called after the exchange.

        Cost: O(capacity) per segment (``codec.sent_positions``: no dense decode, no
        full-size temporary, no host sync). With ``undelivered``: a sent slot whose
        element came back (``undelivered != 0`` there: only a non-zero own value can)
        keeps its velocity; the slots are marked in a reused bool[n + 1] (one byte per
        element, the spare one takes the kept and padding slots) and ``u`` is
        masked-filled: two light passes, no decode of the payload."""
        u = self.u.get(name)
        if u is None:
            return
        if not self.masks_now(name, warmup_density):
            return
        self._touch(self.u, name)
        flat = u.view(-1)
        if undelivered is not None:
            n = flat.numel()
            back = undelivered.reshape(-1)
            hit = self._mask_buf(n + 1, flat.device).zero_()
            for positions, count in codec.sent_positions(payload):
                pos = positions.to(torch.int64)
                slot = torch.arange(pos.numel(), device=pos.device)
                safe = pos.clamp(0, max(n - 1, 0))
                take = (slot < count) & (pos >= 0) & (pos < n) & (back[safe] == 0)
                hit.index_fill_(0, torch.where(take, pos, torch.full_like(pos, n)), True)
            flat.masked_fill_(hit[:n], 0.0)
            return
        for positions, count in codec.sent_positions(payload):
            ops.zero_slots(flat, positions, count)

    #: the scheduler's local-update interface, used by the Adam recipe (hvdsparse.adam)
    zero_fills_absent = False

    def sends_dense(self, name: str) -> bool:
        return False

    def wants(self, name: str) -> bool:
        h = _Group(self._groups.of(self.params[name]))
        return (self.momentum_correction and h.momentum != 0.0) or self.clip is not None

    # ----------------------------------------------------------------- after exchange
    def dense_momentum(self, name: str, G: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """Ordinary SGD momentum for a layer sent dense (see module docstring)."""
        h = _Group(self._groups.of(self.params[name]))
        if not self.momentum_correction or h.momentum == 0.0:
            return G
        d = G.float()
        if h.weight_decay:
            d = d + h.weight_decay * param.detach().float()
        self._touch(self.buf, name)
        buf = self.buf.get(name)
        buf = d.clone() if buf is None else buf * h.momentum + (1.0 - h.dampening) * d
        self.buf[name] = buf
        return d + h.momentum * buf if h.nesterov else buf

    def dense_momentum_many(self, names: Sequence[str], Gs: Sequence[torch.Tensor],
                            params: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """:meth:`dense_momentum` for several layers: ``out[i]`` is layer ``names[i]``'s
        momentum-corrected gradient (its velocity buffer itself without Nesterov: copy
        it, never write into it), or None for a layer without momentum (``Gs[i]`` is its
        gradient as it is). Each product and sum is rounded once, in the per-layer
        form's order (``buf * m``, then ``+ (1 - d) * G``; ``G + wd * p``; ``G + m *
        buf``), so the bits are the same; the work is a few multi-tensor ops per
        hyper-parameter set instead of three to five ops per layer. A layer's first step
        (no buffer yet) takes the per-layer form."""
        out: List[Optional[torch.Tensor]] = [None] * len(names)
        sets: Dict[tuple, list] = {}
        for i, (n, G, p) in enumerate(zip(names, Gs, params)):
            h = _Group(self._groups.of(self.params[n]))
            if not self.momentum_correction or h.momentum == 0.0:
                continue
            if self.buf.get(n) is None or G.dtype != torch.float32:
                out[i] = self.dense_momentum(n, G, p)
                continue
            key = (h.momentum, h.dampening, h.nesterov, h.weight_decay)
            sets.setdefault(key, []).append(i)
        for (m, damp, nesterov, wd), rows in sets.items():
            for i in rows:
                self._touch(self.buf, names[i])
            d = [Gs[i] for i in rows]
            if wd:
                d = torch._foreach_add(d, torch._foreach_mul(
                    [params[i].detach().float() for i in rows], wd))
            bufs = [self.buf[names[i]] for i in rows]
            torch._foreach_mul_(bufs, m)
            torch._foreach_add_(bufs, d if damp == 0.0 else torch._foreach_mul(d, 1.0 - damp))
            res = torch._foreach_add(d, torch._foreach_mul(bufs, m)) if nesterov else bufs
            for i, r in zip(rows, res):
                out[i] = r
        return out

    # ----------------------------------------------------------------- the wrapped step
    def neutralised(self):
        """Context: the wrapped optimizer's momentum and weight decay are 0 while it
        applies the corrected gradients (restored afterwards)."""
        return _Neutral(self._groups.groups_of(self.params.values())
                        if self.momentum_correction else [])

    def state_dict(self) -> dict:
        return dict(u={k: v.clone() for k, v in self.u.items()},
                    buf={k: v.clone() for k, v in self.buf.items()})

    def load_state_dict(self, sd: dict):
        self.u = {k: v.clone() for k, v in sd.get("u", {}).items()}
        self.buf = {k: v.clone() for k, v in sd.get("buf", {}).items()}


class _Neutral:
    def __init__(self, groups):
        self.groups = groups
        self.saved = []

    def __enter__(self):
        for g in self.groups:
            self.saved.append((g, g.get("momentum"), g.get("weight_decay"),
                               g.get("nesterov")))
            if "momentum" in g:
                g["momentum"] = 0.0
            if "weight_decay" in g:
                g["weight_decay"] = 0.0
            if "nesterov" in g:
                g["nesterov"] = False
        return self

    def __exit__(self, *exc):
        for g, m, wd, nest in self.saved:
            if "momentum" in g:
                g["momentum"] = m
            if "weight_decay" in g:
                g["weight_decay"] = wd
            if "nesterov" in g:
                g["nesterov"] = nest
        return False
