"""The local updates read the wrapped optimizer's param groups at use time.

Regression: ``Optimizer.load_state_dict`` replaces every group dict; momentum
correction used to keep the dicts of construction time, so after a resume
``neutralised()`` zeroed the momentum of dicts the optimizer no longer used, and SGD
applied its own momentum on top of DGC's velocity.
"""
import torch

from hvdsparse.momentum import LocalUpdate
from hvdsparse.param_groups import GroupLookup


def _sgd_pair(seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.nn.Parameter(torch.randn(5, 3, generator=g))
    b = torch.nn.Parameter(torch.randn(7, generator=g))
    opt = torch.optim.SGD([{"params": [a], "momentum": 0.9},
                           {"params": [b], "momentum": 0.5, "weight_decay": 1e-2}], lr=0.1)
    return opt, {"a": a, "b": b}


def test_neutralised_after_load_state_dict_reaches_the_live_groups(seed):
    opt, params = _sgd_pair(seed)
    lu = LocalUpdate(opt, params, 2, momentum_correction=True, clip_grad_norm=None)
    opt.load_state_dict(opt.state_dict())            # new group dicts
    with lu.neutralised():
        assert [g["momentum"] for g in opt.param_groups] == [0.0, 0.0]
        assert opt.param_groups[1]["weight_decay"] == 0.0
    assert [g["momentum"] for g in opt.param_groups] == [0.9, 0.5]
    assert opt.param_groups[1]["weight_decay"] == 1e-2


def test_the_velocity_follows_hyperparameters_loaded_later(seed):
    """A loaded state with another momentum is what the next correction uses; the
    velocity is checked against the written rule u <- m u + g."""
    opt, params = _sgd_pair(seed)
    lu = LocalUpdate(opt, params, 2, momentum_correction=True, clip_grad_norm=None)
    sd = opt.state_dict()
    sd["param_groups"][0]["momentum"] = 0.25
    opt.load_state_dict(sd)
    g1, g2 = torch.randn(5, 3), torch.randn(5, 3)
    lu.corrected("a", g1, params["a"], dense=False, grad_scale=None)
    x, nf = lu.corrected("a", g2, params["a"], dense=False, grad_scale=None)
    torch.testing.assert_close(x, 0.25 * g1 + g2, rtol=0, atol=1e-6)
    assert int(nf) == 0


def test_group_lookup_names_a_foreign_parameter():
    opt, _ = _sgd_pair(0)
    stranger = torch.nn.Parameter(torch.zeros(4, 2))
    try:
        GroupLookup(opt).of(stranger)
    except KeyError as e:
        assert "(4, 2)" in str(e) and "SGD" in str(e)
    else:
        raise AssertionError("a parameter outside the optimizer was accepted")
    opt.add_param_group({"params": [stranger], "momentum": 0.3})
    assert GroupLookup(opt).of(stranger)["momentum"] == 0.3
