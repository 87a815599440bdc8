"""What the DDP door (:class:`hvdsparse.ddp.State`) checks and installs when it is built:
its arguments (what a communication hook cannot do is refused, naming the option), and
the local update with the optimizer step hooks that run it around the user's unchanged
``optimizer.step()``.

Contracts:

* :func:`check_state_args`: ``(compressor, settings, named parameters)``, or a
  ``TypeError`` / ``ValueError`` naming the argument: no compressor, an option a comm
  hook cannot honour (``backward_passes_per_step``, ``local_gradient``,
  ``sync_period``, ``fusion_threshold``, ``nonfinite="skip"``), a ``grad_scaler`` that
  is not a ``torch.amp.GradScaler``, missing or duplicate parameter names.
* :func:`ddp_local_update`: ``(local update or None, optimizer hooks)``. DGC momentum
  correction / local clipping (``torch.optim.SGD``): the velocity is built in the hook,
  so the optimizer's momentum and weight decay are 0 for the duration of its ``step()``
  (pre/post hooks; ``param_groups`` and checkpoints keep the user's values). The Adam
  recipe: its update replaces Adam's for the recipe's parameters around ``step()``. Every
  trainable named parameter must be the optimizer's; an ``optimizer=`` that none of these
  uses raises ``ValueError``. At world size 1 no hook is installed (nothing is exchanged).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from .door import check_compressor, make_local_update
from .settings import DEFAULT_FUSION_THRESHOLD, ExchangeSettings

__all__ = ["UNSUPPORTED", "check_state_args", "ddp_local_update"]

#: options a communication hook cannot honour -> what to do instead
UNSUPPORTED = {
    "backward_passes_per_step": "use DDP's no_sync() to accumulate gradients locally",
    "local_gradient": "local-gradient modes need the optimizer step, which a comm hook "
                      "does not control",
    "sync_period": "local-gradient modes are not supported by the DDP hook",
    "fusion_threshold": "DDP's bucket_cap_mb forms the buckets",
}


def check_state_args(compression, named_parameters, settings, options: dict, grad_scaler):
    """``State``'s arguments checked (module docstring): returns ``(compressor,
    ExchangeSettings, [(name, parameter), ...])``."""
    if compression is None:
        raise TypeError("compression must be an hvdsparse compressor instance "
                        "(hvdsparse.TopK(0.01), ...)")
    compression = check_compressor(compression)
    for k in options:
        if k in UNSUPPORTED:
            raise ValueError(f"hvdsparse.ddp.State: {k}= is not supported: "
                             f"{UNSUPPORTED[k]}")
    settings = ExchangeSettings.from_options(settings, options, "hvdsparse.ddp.State",
                                             fusion_threshold=DEFAULT_FUSION_THRESHOLD)
    for k in ("backward_passes_per_step", "local_gradient"):
        if getattr(settings, k) != getattr(ExchangeSettings(), k):
            raise ValueError(f"hvdsparse.ddp.State: {k}= is not supported: "
                             f"{UNSUPPORTED[k]}")
    if settings.nonfinite == "skip":
        raise ValueError("hvdsparse.ddp.State: nonfinite='skip' is not supported (a "
                         "comm hook cannot cancel the optimizer step); pass "
                         "grad_scaler= (torch.amp.GradScaler skips overflow steps on "
                         "every rank) or nonfinite='propagate'")
    if grad_scaler is not None and not (hasattr(grad_scaler, "is_enabled") and
                                        hasattr(grad_scaler, "get_scale")):
        raise TypeError(f"hvdsparse.ddp.State: grad_scaler must be a "
                        f"torch.amp.GradScaler, got {type(grad_scaler).__name__}")
    if named_parameters is None:
        raise ValueError("hvdsparse.ddp.State needs named_parameters "
                         "(model.named_parameters()): DDP hands the hook tensors, "
                         "not names")
    named = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) "
                         "tuples, usually model.named_parameters()")
    seen, dups = set(), set()
    for n, _ in named:
        (dups if n in seen else seen).add(n)
    if dups:
        raise ValueError(f"parameter names in named_parameters must be unique; "
                         f"duplicates: {', '.join(sorted(dups))}")
    return compression, settings, named


def ddp_local_update(optimizer, params: Dict[str, torch.Tensor], world_size: int,
                     compressor, settings: ExchangeSettings, *, momentum_correction: bool,
                     adam) -> Tuple[object, List]:
    """The local update of the DDP door and its optimizer hooks (module docstring);
    ``momentum_correction`` / ``adam``: :func:`hvdsparse.door.resolve_local_update`'s."""
    clip_grad_norm = settings.clip_grad_norm
    if adam is not None:
        return _adam(optimizer, params, world_size, compressor, adam, clip_grad_norm)
    if momentum_correction or clip_grad_norm is not None:
        return _momentum(optimizer, params, world_size, compressor, momentum_correction,
                         clip_grad_norm, settings.momentum_masking)
    if optimizer is not None and not isinstance(optimizer, torch.optim.SGD):
        # an SGD optimizer is read by the momentum-correction default even when that
        # leaves it off; anything else here is an optimizer= that does nothing
        raise ValueError("optimizer= is only used with momentum_correction (SGD), "
                         "clip_grad_norm=... or the Adam recipe (torch.optim.Adam / "
                         f"AdamW), got {type(optimizer).__name__} with none of them on")
    return None, []


def _momentum(optimizer, params, world_size, compressor, momentum_correction,
              clip_grad_norm, momentum_masking):
    """DGC momentum correction / local clipping, momentum and weight decay applied in the
    hook (neutralised in the optimizer's ``step()``)."""
    if optimizer is None:       # (momentum_correction without it: resolve_local_update)
        raise ValueError("momentum_correction / clip_grad_norm need optimizer= (the "
                         "torch.optim.SGD that steps the DDP model)")
    owned = optimised_by(optimizer, params, "momentum_correction")
    lu = make_local_update(optimizer, {n: p for n, p in params.items()
                                       if id(p) in owned}, world_size,
                           compressor, momentum_correction=momentum_correction,
                           clip_grad_norm=clip_grad_norm, masking=momentum_masking)
    hooks: list = []
    if world_size > 1 and momentum_correction:
        ctx = {}

        def pre(_opt, _args, _kw):     # momentum / wd were applied in the hook
            ctx["n"] = lu.neutralised()
            ctx["n"].__enter__()

        def post(_opt, _args, _kw):
            n = ctx.pop("n", None)
            if n is not None:
                n.__exit__(None, None, None)
        hooks = [optimizer.register_step_pre_hook(pre),
                 optimizer.register_step_post_hook(post)]
    return lu, hooks


def optimised_by(optimizer, params: Dict[str, torch.Tensor], what: str) -> set:
    """Ids of ``optimizer``'s parameters; every trainable one of ``params`` must be one
    (else ``ValueError`` naming ``what`` and the parameters)."""
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [n for n, p in params.items() if p.requires_grad and
               id(p) not in owned]
    if missing:
        raise ValueError(f"{what}: parameters {missing[:5]} are not optimised by the "
                         f"given optimizer")
    return owned


def _adam(optimizer, params, world_size, compressor, adam, clip_grad_norm):
    """The Adam recipe (:mod:`hvdsparse.adam`): scaled gradient compressed in the hook, the
    recipe's update applied around the optimizer's ``step()`` (pre/post hooks)."""
    optimised_by(optimizer, params, "adam recipe")
    lu = make_local_update(optimizer, params, world_size, compressor,
                           adam=adam, clip_grad_norm=clip_grad_norm)
    hooks: list = []
    if world_size > 1:
        hooks = [
            optimizer.register_step_pre_hook(lambda _o, _a, _k: lu.enter()),
            optimizer.register_step_post_hook(lambda _o, _a, _k: lu.exit(True)),
            optimizer.register_load_state_dict_post_hook(lambda _o: lu.forget())]
    return lu, hooks
