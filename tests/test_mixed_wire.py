"""The convergence benchmark's per-layer-wire study variant of the Adam recipe
(``scripts/bench_convergence.py``, ``mixed_wire`` / ``recipe.wire_by``): with every layer
on one wire it is the recipe itself, step for step (the momentum wire with the variance
frozen, or the gradient wire with the local refresh); with the wires mixed, a
momentum-wire layer never refreshes (it never travels dense after the warm-up and keeps
its warm-up variance) while a gradient-wire layer refreshes on the recipe's schedule."""
import sys
from pathlib import Path

import pytest
import torch

import hvdsparse
from tests.test_adam_recipe import Net, SimRanks, grads

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_convergence import mixed_wire  # noqa: E402

P, WARMUP, R, START = 3, 3, 3, 4


def _sim(seed, wire, refresh, wire_of=None):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=1e-2)
    sim = SimRanks(model, opt, lambda: hvdsparse.TopK(0.05, exact=True), P, WARMUP,
                   wire=wire, refresh=refresh, refresh_from="local")
    if refresh is not None:
        sim.recipe.refresh_start = START
    if wire_of is not None:
        mixed_wire(sim.recipe, wire_of)
    return model, opt, sim


def _run(seed, sim, model, steps=12):
    dense_steps = {n: [] for n in ("fc1.weight", "fc2.weight")}
    for step in range(steps):
        for n in dense_steps:
            dense_steps[n].append(sim.recipe.sends_dense(n))
        sim.step(grads(model, P, step, seed))
    return dense_steps


@pytest.mark.parametrize("wire", ["gradient", "momentum"])
def test_one_wire_everywhere_is_the_recipe(seed, wire):
    refresh = R if wire == "gradient" else None        # the local refresh: gradient wire
    m_ref, o_ref, ref = _sim(seed, wire, refresh)
    m_mix, o_mix, mix = _sim(seed, "gradient", R, wire_of=lambda n: wire)
    d_ref, d_mix = _run(seed, ref, m_ref), _run(seed, mix, m_mix)
    assert d_ref == d_mix
    for (n, a), b in zip(m_ref.named_parameters(), m_mix.parameters()):
        assert torch.equal(a, b), f"{wire}: {n} differs from the recipe with wire={wire!r}"
        assert torch.equal(o_ref.state[a]["exp_avg_sq"], o_mix.state[b]["exp_avg_sq"]), n


def test_mixed_wires_refresh_only_the_gradient_layers(seed):
    wire_of = {"fc1.weight": "momentum"}
    model, opt, sim = _sim(seed, "gradient", R,
                           wire_of=lambda n: wire_of.get(n, "gradient"))
    v_warm = {}
    dense = {n: [] for n in ("fc1.weight", "fc2.weight")}
    for step in range(12):
        for n in dense:
            dense[n].append(sim.recipe.sends_dense(n))
        sim.step(grads(model, P, step, seed))
        if step == WARMUP - 1:
            v_warm = {n: opt.state[sim.named[n]]["exp_avg_sq"].clone() for n in dense}
    # warm-up dense on both; afterwards only fc2 (gradient wire) has dense refresh steps,
    # at Adam steps k = S + R, S + 2R, ... (k = step + 1)
    want_fc2 = [s < WARMUP or (s + 1 >= START + R and (s + 1 - START - R) % R == 0)
                for s in range(12)]
    assert dense["fc1.weight"] == [s < WARMUP for s in range(12)]
    assert dense["fc2.weight"] == want_fc2 and any(want_fc2[WARMUP:])
    assert torch.equal(opt.state[sim.named["fc1.weight"]]["exp_avg_sq"], v_warm["fc1.weight"])
    assert not torch.equal(opt.state[sim.named["fc2.weight"]]["exp_avg_sq"],
                           v_warm["fc2.weight"])
    # the momentum-wire layer's exp_avg is what was exchanged (m <- X * D), finite
    assert all(torch.isfinite(p).all() for p in model.parameters())
