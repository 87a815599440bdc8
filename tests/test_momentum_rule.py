"""The ``momentum_correction=None`` rule of both front doors
(:func:`hvdsparse.momentum.resolve_momentum_correction`): on for SGD with momentum
around the sparsifiers whose error feedback delays coordinates; with momentum-factor
masking only up to the density ``(1 - m) / 2``, without masking (the default) up to the
densest setting measured, 0.25."""
import pytest
import torch

from hvdsparse.compressors import QSGD, AdaComp, RandomK, Threshold, TopK
from hvdsparse.momentum import resolve_momentum_correction


def _sgd(momentum, groups=1):
    ps = [torch.nn.Parameter(torch.zeros(3)) for _ in range(groups)]
    return torch.optim.SGD([{"params": [p]} for p in ps], lr=0.1, momentum=momentum)


@pytest.mark.parametrize("masking", [False, True])
def test_the_density_bound_applies_with_masking_only(masking):
    opt = _sgd(0.9)
    # masked: below, at and above (1 - 0.9) / 2 = 0.05; unmasked: up to 0.25
    for comp, masked, unmasked in (
            (TopK(0.01), True, True), (TopK(0.05), True, True), (TopK(0.1), False, True),
            (TopK(0.25), False, True), (TopK(0.3), False, False), (TopK(1.0), False, False),
            (Threshold(0.99), True, True), (Threshold(0.95), True, True),
            (Threshold(0.9), False, True), (Threshold(0.75), False, True),
            (Threshold(0.5), False, False)):
        got = resolve_momentum_correction(None, opt, comp, None, masking)
        assert got is (masked if masking else unmasked), (comp, masking)
    # the bound follows m: 0.2 at m = 0.6
    assert resolve_momentum_correction(None, _sgd(0.6), TopK(0.15), None, True) is True
    assert resolve_momentum_correction(None, _sgd(0.6), TopK(0.25), None, True) is False
    # AdaComp: always, masked or not
    assert resolve_momentum_correction(None, opt, AdaComp(), None, masking) is True


def test_off_where_it_was_not_measured_or_does_not_apply():
    opt = _sgd(0.9)
    for comp in (QSGD(4), RandomK(0.01), TopK(0.01, error_feedback=False),
                 Threshold(0.99, error_feedback=False)):
        assert resolve_momentum_correction(None, opt, comp) is False, comp
    assert resolve_momentum_correction(None, _sgd(0.0), TopK(0.01)) is False
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(3))])
    assert resolve_momentum_correction(None, adam, TopK(0.01)) is False
    assert resolve_momentum_correction(None, opt, TopK(0.01), "sum") is False
    # the DDP hook without optimizer=
    assert resolve_momentum_correction(None, None, TopK(0.01)) is False
    # the largest momentum over the param groups decides
    mixed = _sgd(0.0, groups=2)
    mixed.param_groups[1]["momentum"] = 0.9
    assert resolve_momentum_correction(None, mixed, TopK(0.01)) is True


def test_explicit_values_win_and_bad_ones_are_named():
    opt = _sgd(0.9)
    assert resolve_momentum_correction(True, opt, QSGD(4)) is True
    assert resolve_momentum_correction(False, opt, TopK(0.01)) is False
    with pytest.raises(ValueError, match="momentum_correction must be None"):
        resolve_momentum_correction("auto", opt, TopK(0.01))
    for bad in ("yes", 1, None):        # checked here for both front doors
        with pytest.raises(ValueError, match="momentum_masking must be a bool"):
            resolve_momentum_correction(None, opt, TopK(0.01), None, bad)
        with pytest.raises(ValueError, match="momentum_masking must be a bool"):
            resolve_momentum_correction(True, opt, TopK(0.01), None, bad)
