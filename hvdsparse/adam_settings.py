"""The Adam recipe's front-door options (``adam_recipe``, ``adam_warmup``,
``adam_refresh``, ``adam_refresh_start``, ``adam_wire``): their defaults, their checks
and :func:`adam_setup`, which resolves them into :class:`AdamSettings`. What the options
mean: :mod:`hvdsparse.adam`."""
from __future__ import annotations

import re
from typing import Iterable, NamedTuple, Optional

import torch

from .compressors.base import Compressor

__all__ = ["AdamSettings", "DEFAULT_REFRESH", "DEFAULT_WARMUP", "REFRESH_START_FACTOR",
           "RECURRENT_WEIGHT", "UPDATE_WARMUP", "WIRES", "adam_setup", "check_adam", "check_refresh", "check_refresh_start",
           "check_warmup", "default_refresh", "default_wire", "is_adam", "resolve_refresh"]

#: warm-up steps when the user gives none: ~30% of the 300-330-step runs measured in
#: docs/bench/adam/ (``scripts/study_adam.py``); on a 900-step run 300 was no better
#: than 100 with the gradient wire
DEFAULT_WARMUP = 100

#: the update wire's warm-up: one dense step, which creates Adam's state from the
#: averaged gradient (every rank's moments then follow its own gradient; nothing is
#: frozen, so nothing needs to settle first) -- and, with ``adam_warmup`` left at its
#: default and a compressor whose ``adam_dense_while_rate_rises`` is set (Threshold,
#: AdaComp), every step after it at which a parameter group's learning rate rises (a
#: schedule's warm-up). Measured on the GPT-style LM under a 5% warm-up + cosine
#: (BENCHMARKS "Transformer LM under AdamW"): Threshold +43% -> +15.9% of dense's loss
#: at P = 2 (3 seeds) and +47.8% -> +10.0% at P = 4 (a threshold taken while the rate
#: rises sits on a tie); AdaComp +2.20% -> +1.07% at P = 4 (6 seeds, 5 better),
#: +4.01% -> +1.85% at P = 8 and -1.6% / -1.4% at P = 2 (3 seeds each), at 11x fewer
#: bytes over the run instead of 24x at P = 4 (the same 24x after the warm-up); TopK
#: +3.34% / +3.19% at P = 4 (3 seeds) at 10x instead of 20x, so TopK (and the
#: compressors not measured) keep the one step. A constant rate never rises: nothing
#: changes there.
UPDATE_WARMUP = 1

#: the values of ``adam_wire`` (:mod:`hvdsparse.adam`)
WIRES = ("gradient", "momentum", "update")

#: a recurrent layer's hidden-to-hidden weight as torch names it (nn.RNN / LSTM / GRU:
#: ``weight_hh_l0``, ``weight_hh_l1_reverse``; the cells: ``weight_hh``)
RECURRENT_WEIGHT = re.compile(r"(^|\.)weight_hh(_l\d+(_reverse)?)?$")


def default_wire(param_names: Iterable[str] = ()) -> str:
    """``adam_wire=None``: ``"gradient"`` for a model with a recurrent layer (a name
    :data:`RECURRENT_WEIGHT` matches), else ``"update"``. Measured with each compressor's
    defaults, 3 seeds (BENCHMARKS "Transformer LM under AdamW"): on the GPT-style
    text-gpt the update wire ends -4.1% to +4.0% against dense AdamW where the gradient
    wire ends +39.8%; on the char-LSTM text-lm it helps TopK and Threshold (+1.0% /
    +0.35% against +1.9% / +1.3%) but not AdaComp (+3.3% against +2.0%), so recurrent
    models keep the wire their measured rows were taken with."""
    return "gradient" if any(RECURRENT_WEIGHT.search(n) for n in param_names) else "update"

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


def check_warmup(warmup, default: int = DEFAULT_WARMUP) -> int:
    if warmup is None:
        return default
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise ValueError(f"adam_warmup must be None (default {default}) or an int "
                         f">= 1 (dense Adam steps before the compressed phase), got "
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
    while_rate_rises: bool = False    # the warm-up also lasts while the learning rate rises


def adam_setup(optimizer, compression, adam_recipe, adam_warmup, *, local_gradient=None,
               momentum_correction=False, adam_refresh=None,
               adam_refresh_start=None, adam_wire=None,
               param_names: Iterable[str] = ()) -> Optional[AdamSettings]:
    """Validate the ``adam_recipe`` / ``adam_warmup`` / ``adam_refresh`` /
    ``adam_refresh_start`` / ``adam_wire`` arguments of a front door; return the
    resolved :class:`AdamSettings` when the recipe is on, None when it is off.
    ``adam_recipe=None`` (auto): on for ``torch.optim.Adam`` / ``AdamW`` with a compressor
    that compresses. ``adam_wire`` (module docstring): ``"gradient"``, ``"momentum"``
    (1-bit Adam's wire) or ``"update"`` (every rank's own Adam step; its warm-up
    defaults to :data:`UPDATE_WARMUP`); ``None``: :func:`default_wire` of
    ``param_names`` (the optimised parameters' names). The last two have no variance
    refresh, so ``adam_refresh`` must then be None or 0."""
    if adam_wire is not None and adam_wire not in WIRES:
        raise ValueError(f"adam_wire must be None (default: by the model) or one of "
                         f"{', '.join(map(repr, WIRES))}, got {adam_wire!r}")
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
    wire = adam_wire or default_wire(param_names)
    warmup = check_warmup(adam_warmup, UPDATE_WARMUP if wire == "update" else DEFAULT_WARMUP)
    if wire != "gradient":
        if adam_refresh not in (None, 0, False) or adam_refresh_start is not None:
            raise ValueError(f"adam_wire={wire!r} has no variance refresh: adam_refresh "
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
    rises = wire == "update" and adam_warmup is None and \
        bool(getattr(compression, "adam_dense_while_rate_rises", False))
    return AdamSettings(warmup, refresh, start, wire, while_rate_rises=rises)
