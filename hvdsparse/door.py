"""What both front doors do when they are built: check and bind the compressor, resolve
the local-update options (DGC momentum correction, local clipping, the Adam recipe)
against the optimizer, build the local update, and put the resolved options into the
fingerprint ranks compare at the first step.
"""
from __future__ import annotations

import inspect
from typing import Dict

import torch

from .settings import ExchangeSettings

__all__ = ["check_compressor", "bind_compressor", "resolve_local_update",
           "local_fingerprint", "make_local_update"]


def check_compressor(compression):
    """``compression`` if it is an hvdsparse compressor instance (None:
    ``NoCompression()``), else a ``TypeError`` saying what was given."""
    from .compressors import Compressor, NoCompression
    if compression is None:
        return NoCompression()
    if isinstance(compression, type) and issubclass(compression, Compressor):
        raise TypeError(f"compression must be an hvdsparse compressor instance, got the class "
                        f"{compression.__name__}; write {compression.__name__}(...)")
    if not isinstance(compression, Compressor):
        raise TypeError(f"compression must be an hvdsparse compressor (hvdsparse.TopK(...), "
                        f"hvdsparse.AdaComp(...), ...), got {compression!r} "
                        f"({type(compression).__name__}); Horovod's own compressors "
                        f"(hvd.Compression.none / fp16) go to hvd.DistributedOptimizer")
    return compression


def bind_compressor(compressor, transport, prefix: str, owner) -> None:
    """Bind ``compressor`` to this rank and to its one owner (a second owner raises:
    residuals are keyed by layer name), with a blocking broadcast from rank 0 through
    ``transport`` (Slim-DP's core) for compressors that take one."""
    params = inspect.signature(compressor.bind).parameters
    kw = {}
    if "broadcast" in params:
        def broadcast(tensor, name):
            return transport.broadcast(tensor, 0, name=f"{prefix}.bcast.{name}")
        kw["broadcast"] = broadcast
    if "owner" in params:
        kw["owner"] = owner
    compressor.bind(transport.rank(), transport.size(), **kw)


def resolve_local_update(optimizer, compressor, settings: ExchangeSettings,
                         param_names=()):
    """``(momentum_correction, adam)``: the settings' local-update options resolved
    against ``optimizer`` (None: a door that was given none) -- DGC's momentum
    correction on or off (:func:`hvdsparse.momentum.resolve_momentum_correction`'s
    rule), the Adam recipe's resolved :class:`hvdsparse.adam.AdamSettings` or None
    (``param_names``: the optimised parameters' names, which choose the default wire).
    Combinations that cannot work raise ``ValueError`` naming the options."""
    from .adam import adam_setup
    from .momentum import resolve_momentum_correction     # also checks momentum_masking
    st = settings
    mc = resolve_momentum_correction(st.momentum_correction, optimizer, compressor,
                                     st.local_gradient, st.momentum_masking)
    if mc:
        if optimizer is None:
            raise ValueError("momentum_correction=True needs optimizer= (the "
                             "torch.optim.SGD that steps the model)")
        if not isinstance(optimizer, torch.optim.SGD):
            raise ValueError(f"momentum_correction=True needs torch.optim.SGD (with "
                             f"momentum), got {type(optimizer).__name__}")
        if st.local_gradient is not None:
            raise ValueError("momentum_correction cannot be combined with local_gradient")
    if optimizer is None:
        if st.adam_recipe or any(getattr(st, k) is not None for k in
                                 ("adam_warmup", "adam_refresh", "adam_refresh_start",
                                  "adam_wire")):
            raise ValueError("adam_recipe / adam_warmup / adam_refresh / adam_refresh_start "
                             "/ adam_wire need optimizer= (the torch.optim.Adam / AdamW "
                             "that steps the model)")
        return mc, None
    return mc, adam_setup(optimizer, compressor, st.adam_recipe, st.adam_warmup,
                          local_gradient=st.local_gradient, momentum_correction=mc,
                          adam_refresh=st.adam_refresh,
                          adam_refresh_start=st.adam_refresh_start,
                          adam_wire=st.adam_wire, param_names=param_names)


def local_fingerprint(momentum_correction: bool, adam, settings: ExchangeSettings) -> dict:
    """The resolved local-update options, as ranks compare them at the first step."""
    return dict(momentum_correction=bool(momentum_correction),
                momentum_masking=bool(settings.momentum_masking),
                clip_grad_norm=settings.clip_grad_norm,
                adam_warmup=adam and adam.warmup, adam_refresh=adam and adam.refresh,
                adam_refresh_start=adam and adam.refresh_start,
                adam_wire=adam and adam.wire,
                adam_warmup_while_rate_rises=bool(adam and adam.while_rate_rises))


def make_local_update(optimizer, params: Dict[str, torch.Tensor], world_size: int,
                      compressor, *, adam=None, momentum_correction=False,
                      clip_grad_norm=None, masking=False):
    """The local update both doors run between the gradient and the compressor: the Adam
    recipe (``adam``: resolved :class:`hvdsparse.adam.AdamSettings`), or DGC's momentum
    correction / local clipping (:class:`hvdsparse.momentum.LocalUpdate`), or None.
    ``params``: the optimised parameters by name. Tells ``compressor`` whether its
    layers travel on the Adam recipe's update wire (``adam_update_wire``)."""
    from .compressors import Compressor
    if isinstance(compressor, Compressor):
        compressor.set_adam_update_wire(adam is not None and adam.wire == "update")
    if adam is not None:
        from .adam import AdamRecipe
        shapes = {n: p.shape for n, p in params.items()}
        pol = compressor.policy
        recipe = AdamRecipe(optimizer, params, world_size,
                            lambda n: not pol.is_dense(n, shapes[n]), warmup=adam.warmup,
                            refresh=adam.refresh, refresh_start=adam.refresh_start,
                            wire=adam.wire,
                            clip_grad_norm=clip_grad_norm, residual=compressor.residual,
                            warmup_while_rate_rises=adam.while_rate_rises)
        if isinstance(compressor, Compressor) and adam.wire == "update":
            # x = lr u: a compressor's thresholds may follow the rate (Threshold's
            # tau_follows_rate)
            compressor.layer_rate = recipe.layer_rate
        return recipe
    if momentum_correction or clip_grad_norm is not None:
        from .momentum import LocalUpdate
        return LocalUpdate(optimizer, params, world_size,
                           momentum_correction=momentum_correction,
                           clip_grad_norm=clip_grad_norm, masking=masking)
    return None
