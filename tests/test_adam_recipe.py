"""The Adam recipe (hvdsparse.adam) in one process: P simulated ranks, each with its own
real compressor, driven the way the scheduler drives them (corrected -> dense payload in
warm-up or compress after it -> average of the decoded payloads -> p.grad -> the wrapped
step inside ``neutralised()``), against an independent plain-torch replay of the recipe's
written definition (tests/workers/adam_replay.py). Also the argument checks and a
checkpoint round trip. The multi-rank versions run under horovodrun / torchrun in
tests/test_adam_hvd.py."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hvdsparse
from hvdsparse import codec
from hvdsparse.payload import IndexEncoding, ValueEncoding
from hvdsparse.adam_settings import UPDATE_WARMUP, default_wire
from hvdsparse.adam import (AdamRecipe, DEFAULT_REFRESH, DEFAULT_WARMUP, REFRESH_START_FACTOR,
                            adam_setup)
from tests.workers.adam_replay import AdamReplay, adacomp, topk_exact


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(24, 64)     # 1536 weights: compressed
        self.fc2 = nn.Linear(64, 40)     # 2560 weights: compressed
        self.fc3 = nn.Linear(40, 5)      # 200 weights: dense by policy

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class SimRanks:
    """P ranks of the recipe in one process (one optimizer: its state is the same on every
    rank; one compressor per rank)."""

    def __init__(self, model, opt, make_comp, P, warmup, precondition=True, floor=0.1,
                 wire=None, refresh=None, refresh_from="sample"):
        self.model, self.opt, self.P = model, opt, P
        self.named = dict(model.named_parameters())
        self.comps = [make_comp().bind(r, P) for r in range(P)]
        pol = self.comps[0].policy
        self.recipe = AdamRecipe(opt, self.named, P,
                                 lambda n: not pol.is_dense(n, self.named[n].shape),
                                 warmup=warmup, precondition=precondition,
                                 floor=floor, refresh=refresh,
                                 refresh_from=refresh_from, residual=self._residuals,
                                 **({} if wire is None else dict(wire=wire)))
        self.t = 0

    def _residuals(self, name):
        """Every simulated rank's residual of ``name`` (one recipe serves them all)."""
        rs = [c.residual(name) for c in self.comps]
        return None if any(r is None for r in rs) else _AllRanks(rs)

    def step(self, everyone):
        rc, P = self.recipe, self.P
        for n, p in self.named.items():
            dense = self.comps[0].policy.is_dense(n, p.shape)
            total = torch.zeros(p.numel())
            for r in range(P):
                x, nf = rc.corrected(n, everyone[r][n], p, dense, None)
                assert int(nf) == 0
                pl = rc.dense_payload(n, x) if rc.sends_dense(n) else \
                    self.comps[r].compress(n, x, self.t, param=p.detach())
                total += codec.payload_to_dense(pl).reshape(-1)
            p.grad = (total * (1.0 / P)).view(p.shape).to(p.dtype)
        with rc.neutralised():
            self.opt.step()
        self.t += 1


class _AllRanks:
    """The P residuals of one layer, rescaled together (a real rank has one)."""

    def __init__(self, rs):
        self.rs, self.shape = rs, rs[0].shape

    def mul_(self, f):
        for r in self.rs:
            r.mul_(f)


def grads(model, P, step, seed):
    out = []
    for r in range(P):
        g = torch.Generator().manual_seed(seed * 1000 + 31 * step + r)
        x = torch.randn(12, 24, generator=g)
        y = torch.randint(0, 5, (12,), generator=g)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return out


def _close(sim, rep, what):
    for n, p in sim.named.items():
        err = (p.detach() - rep.W[n]).abs().max().item()
        assert torch.allclose(p.detach(), rep.W[n], rtol=1e-5, atol=1e-6), \
            f"{what}: {n} differs from the replay by {err:.3g}"


@pytest.mark.parametrize("wire", ["gradient", "momentum"])
@pytest.mark.parametrize("kind,comp,pre", [("adam", "topk", True), ("adamw", "topk", True),
                                           ("adam", "adacomp", True),
                                           ("adamw", "topk", False),
                                           ("adam", "adacomp", False)])
def test_recipe_matches_replay(seed, kind, comp, pre, wire):
    torch.manual_seed(seed)
    P, warmup, lr, wd, betas, eps = 3, 3, 3e-3, 1e-2, (0.9, 0.99), 1e-8
    model = Net()
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    opt = cls(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd)
    if comp == "topk":
        make, sel, dw = (lambda: hvdsparse.TopK(0.05, exact=True)), topk_exact(0.05), False
    else:
        make, sel, dw = hvdsparse.AdaComp, adacomp(), True
    rep = AdamReplay(dict(model.named_parameters()), P, lr=lr, betas=betas, eps=eps, wd=wd,
                     decoupled=kind == "adamw", warmup=warmup, select=sel, needs_dw=dw,
                     precondition=pre, floor=0.1 if pre else 0.0, wire=wire)
    sim = SimRanks(model, opt, make, P, warmup, precondition=pre, floor=0.1 if pre else 0.0,
                   wire=wire)
    for step in range(9):
        everyone = grads(model, P, step, seed)
        sim.step(everyone)
        rep.step(everyone)
        _close(sim, rep, f"{kind}/{comp} step {step}")
    # state stays Adam's: exp_avg = the synchronised momentum, exp_avg_sq frozen at T_w
    for n, p in sim.named.items():
        st = opt.state[p]
        assert int(st["step"]) == 9
        assert torch.allclose(st["exp_avg"], rep.m[n], rtol=1e-5, atol=1e-7), n
        assert torch.allclose(st["exp_avg_sq"], rep.v[n], rtol=1e-5, atol=1e-10), n
    assert sim.recipe.frozen("fc1.weight") and not sim.recipe.frozen("fc3.weight")


@pytest.mark.parametrize("wire", ["gradient", "momentum"])
@pytest.mark.parametrize("kind,comp,pre", [("adam", "topk", True), ("adamw", "adacomp", True),
                                           ("adamw", "topk", False)])
def test_sample_refresh_matches_replay(seed, kind, comp, pre, wire):
    """refresh_from="sample" (the study variant): every R-th step after the warm-up is
    exact Adam on the dense average with v advanced by R steps of it; D's bias correction
    counts the refreshes; the residuals are rescaled by D_old / D_new."""
    torch.manual_seed(seed)
    P, warmup, R, lr, wd, betas, eps = 3, 3, 3, 3e-3, 1e-2, (0.9, 0.99), 1e-8
    model = Net()
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    opt = cls(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd)
    if comp == "topk":
        make, sel, dw = (lambda: hvdsparse.TopK(0.05, exact=True)), topk_exact(0.05), False
    else:
        make, sel, dw = hvdsparse.AdaComp, adacomp(), True
    floor = 0.1 if pre else 0.0
    rep = AdamReplay(dict(model.named_parameters()), P, lr=lr, betas=betas, eps=eps, wd=wd,
                     decoupled=kind == "adamw", warmup=warmup, select=sel, needs_dw=dw,
                     precondition=pre, floor=floor, wire=wire, refresh=R)
    sim = SimRanks(model, opt, make, P, warmup, precondition=pre, floor=floor, wire=wire,
                   refresh=R)                          # SimRanks: refresh_from="sample"
    refreshed = []
    for step in range(12):
        refreshed.append(sim.recipe.refreshing("fc1.weight"))
        everyone = grads(model, P, step, seed)
        sim.step(everyone)
        rep.step(everyone)
        _close(sim, rep, f"{kind}/{comp} R={R} step {step}")
        v1 = opt.state[sim.named["fc1.weight"]]["exp_avg_sq"]
        if step == warmup - 1:
            frozen_v = v1.clone()
        elif step == 4:
            assert torch.equal(v1, frozen_v), "v moved between refreshes"
        elif step == 5:
            assert not torch.equal(v1, frozen_v), "the refresh left v as it was"
        for r in range(P):
            for n in ("fc1.weight", "fc2.weight"):
                if step >= warmup:
                    torch.testing.assert_close(sim.comps[r].residual(n).view(-1),
                                               rep.e[r][n].view(-1), rtol=1e-4, atol=1e-5)
    # steps 5, 8, 11 (the 3rd, 6th, 9th after the 3-step warm-up) refresh
    assert [i for i, f in enumerate(refreshed) if f] == [5, 8, 11]
    for n, p in sim.named.items():
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], rep.v[n], rtol=1e-5,
                                   atol=1e-10)


class Replicas:
    """P real replicas in one process, as P ranks hold them: each its own model, wrapped
    optimizer, compressor and recipe (the local refresh keeps per-rank statistics), the
    payloads averaged as the exchange averages them."""

    def __init__(self, make_model, make_opt, make_comp, P, warmup, refresh,
                 refresh_from="local", refresh_start=None):
        self.P = P
        self.models = [make_model() for _ in range(P)]
        for m in self.models[1:]:
            m.load_state_dict(self.models[0].state_dict())
        self.opts = [make_opt(m) for m in self.models]
        self.named = [dict(m.named_parameters()) for m in self.models]
        self.comps = [make_comp().bind(r, P) for r in range(P)]
        for c in self.comps:
            c.transactional = True       # as under GradScaler / nonfinite="skip"
        pol = self.comps[0].policy
        self.recipes = [
            AdamRecipe(o, nm, P, lambda n, nm=nm: not pol.is_dense(n, nm[n].shape),
                       warmup=warmup, refresh=refresh, refresh_from=refresh_from,
                       refresh_start=refresh_start, residual=c.residual)
            for o, nm, c in zip(self.opts, self.named, self.comps)]
        self.t = 0
        self.dense_steps = []           # per step: the compressed layers sent dense

    def step(self, everyone, apply=True):
        P, avg, dense_now = self.P, {}, set()
        for c in self.comps:
            c.begin_step(self.t)
        for n in self.named[0]:
            total = None
            for r in range(P):
                p, rc = self.named[r][n], self.recipes[r]
                dense = self.comps[r].policy.is_dense(n, p.shape)
                x, nf = rc.corrected(n, everyone[r][n], p, dense, None)
                assert int(nf) == 0
                if rc.sends_dense(n):
                    pl = rc.dense_payload(n, x)
                    if not dense:
                        dense_now.add(n)
                else:
                    pl = self.comps[r].compress(n, x, self.t, param=p.detach())
                d = codec.payload_to_dense(pl).reshape(-1)
                total = d if total is None else total + d
            avg[n] = total * (1.0 / P)
        for r in range(P):
            for n, p in self.named[r].items():
                p.grad = avg[n].view(p.shape).clone()
            if apply:
                with self.recipes[r].neutralised():
                    self.opts[r].step()
                self.comps[r].commit()
            else:                        # a skipped step (GradScaler, nonfinite="skip")
                self.recipes[r].enter()
                self.recipes[r].exit(False)
                self.comps[r].rollback()
        self.t += 1
        self.dense_steps.append(sorted(dense_now))

    def assert_identical(self, what):
        for r in range(1, self.P):
            for n, p in self.named[r].items():
                assert torch.equal(p, self.named[0][n]), f"{what}: rank {r}'s {n} differs"
                a, b = self.opts[r].state[p], self.opts[0].state[self.named[0][n]]
                for k in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(a[k], b[k]), f"{what}: rank {r}'s {n} {k} differs"


@pytest.mark.parametrize("kind,comp,start", [("adam", "topk", None), ("adamw", "topk", None),
                                             ("adam", "adacomp", None),
                                             ("adamw", "no-residual", None),
                                             ("adamw", "topk", 5), ("adam", "adacomp", 4)])
def test_local_refresh_matches_replay(seed, kind, comp, start):
    """adam_refresh=R (refresh_from="local", the default): every rank averages its own
    g_i^2 over the window, the refresh step sends that (dense) and defers its gradient to
    the next step, v advances by the batch-corrected average; replicas stay bitwise
    identical and follow the written definition (tests/workers/adam_replay.py).
    ``start``: refresh_start=S, the first refresh at step S + R stands for the S + R - T_w
    steps since the warm-up."""
    torch.manual_seed(seed)
    P, warmup, R, lr, wd, betas, eps = 3, 3, 3, 3e-3, 1e-2, (0.9, 0.99), 1e-8
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    if comp == "topk":
        make, sel, dw = (lambda: hvdsparse.TopK(0.05, exact=True)), topk_exact(0.05), False
    elif comp == "adacomp":
        make, sel, dw = hvdsparse.AdaComp, adacomp(), True
    else:                                 # no residual: the deferral is the recipe's own
        make, sel, dw = (lambda: hvdsparse.TopK(1.0, error_feedback=False)), \
            (lambda acc, name=None, x=None: acc), False
    sim = Replicas(Net, lambda m: cls(m.parameters(), lr=lr, betas=betas, eps=eps,
                                      weight_decay=wd), make, P, warmup, R,
                   refresh_start=start)
    rep = AdamReplay(sim.named[0], P, lr=lr, betas=betas, eps=eps, wd=wd,
                     decoupled=kind == "adamw", warmup=warmup, select=sel, needs_dw=dw,
                     refresh=R, refresh_from="local", refresh_start=start)
    vs = []
    for step in range(13):
        everyone = grads(sim.models[0], P, step, seed)
        sim.step(everyone)
        rep.step(everyone)
        sim.assert_identical(f"{kind}/{comp} step {step}")
        for n, p in sim.named[0].items():
            err = (p.detach() - rep.W[n]).abs().max().item()
            assert torch.allclose(p.detach(), rep.W[n], rtol=1e-5, atol=1e-6), \
                f"{kind}/{comp} step {step}: {n} differs from the replay by {err:.3g}"
            torch.testing.assert_close(sim.opts[0].state[p]["exp_avg_sq"], rep.v[n],
                                       rtol=1e-5, atol=1e-12)
        if comp != "no-residual":
            for r in range(P):
                for n in ("fc1.weight", "fc2.weight"):
                    if step >= warmup:
                        torch.testing.assert_close(sim.comps[r].residual(n).view(-1),
                                                   rep.e[r][n].view(-1), rtol=1e-4,
                                                   atol=1e-5)
        vs.append(sim.opts[0].state[sim.named[0]["fc1.weight"]]["exp_avg_sq"].clone())
    # refresh steps (0-based: Adam step S + R is index S + R - 1), S = T_w by default:
    # the compressed layers travel dense there and only there
    first = (warmup if start is None else start) + R - 1
    want = list(range(first, 13, R))
    assert len(want) >= 2
    assert [i for i, d in enumerate(sim.dense_steps[warmup:], warmup) if d] == want
    assert sim.dense_steps[first] == ["fc1.weight", "fc2.weight"]
    moved = [i for i in range(warmup, 13) if not torch.equal(vs[i], vs[i - 1])]
    assert moved == want, f"v moved at steps {moved}"


@pytest.mark.parametrize("comp", ["topk", "adacomp"])
def test_refresh_changes_nothing_before_its_start(seed, comp):
    """The default schedule (refresh windows from S = 3 T_w) leaves a run that ends before
    its first refresh bitwise identical to the frozen variance (the statistics gathered
    meanwhile change nothing that travels), and the first refresh then moves v."""
    torch.manual_seed(seed)
    P, warmup, R, start = 3, 2, 3, 6
    make = (lambda: hvdsparse.TopK(0.05)) if comp == "topk" else hvdsparse.AdaComp
    mk_opt = lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=1e-2)  # noqa
    frozen = Replicas(Net, mk_opt, make, P, warmup, None)
    refresh = Replicas(Net, mk_opt, make, P, warmup, R, refresh_start=start)
    for sim in (frozen, refresh):
        sim.models[0].load_state_dict(frozen.models[0].state_dict())
        for m in sim.models[1:]:
            m.load_state_dict(sim.models[0].state_dict())
    for step in range(start + R):
        everyone = grads(frozen.models[0], P, step, seed)
        frozen.step(everyone)
        refresh.step(everyone)
        refresh.assert_identical(f"{comp} step {step}")
        same = all(torch.equal(a, b) for a, b in zip(frozen.models[0].parameters(),
                                                      refresh.models[0].parameters()))
        v = [o.state[p]["exp_avg_sq"] for o, p in ((frozen.opts[0], frozen.named[0]["fc1.weight"]),
                                                  (refresh.opts[0], refresh.named[0]["fc1.weight"]))]
        if step < start + R - 1:     # Adam steps 1 .. S + R - 1: no refresh yet
            assert same and torch.equal(*v), f"{comp} step {step}: the refresh schedule " \
                                             f"changed a step before its start"
        else:                        # Adam step S + R: the first refresh
            assert refresh.dense_steps[step] == ["fc1.weight", "fc2.weight"]
            assert not torch.equal(*v), f"{comp}: the first refresh left v as it was"
    assert not any(refresh.dense_steps[warmup:start + R - 1])


def test_local_refresh_loses_no_gradient(seed):
    """With nothing compressed (TopK(1.0)) the gradient a refresh step defers arrives
    with the next step: over a window the momentum receives every step's averaged
    gradient exactly once (checked on the sum of what was folded into m)."""
    torch.manual_seed(seed)
    P, warmup, R = 2, 2, 4
    b1 = 0.9
    sim = Replicas(Net, lambda m: torch.optim.Adam(m.parameters(), lr=1e-3,
                                                   betas=(b1, 0.999)),
                   lambda: hvdsparse.TopK(1.0), P, warmup, R)
    name = "fc1.weight"
    p0 = sim.named[0][name]
    sent_sum, grad_sum = torch.zeros_like(p0), torch.zeros_like(p0)
    for step in range(warmup + 2 * R + 1):
        everyone = grads(sim.models[0], P, step, seed)
        m_before = sim.opts[0].state[p0]["exp_avg"].clone() if step else None
        sim.step(everyone)
        if step >= warmup:
            m = sim.opts[0].state[p0]["exp_avg"]
            sent_sum += (m - b1 * m_before) / (1 - b1)     # what this step folded in
            grad_sum += sum(e[name] for e in everyone) / P
    # the last step (warmup + 2R) is not a refresh: nothing is left carried
    torch.testing.assert_close(sent_sum, grad_sum, rtol=1e-4, atol=1e-6)


def test_local_refresh_skipped_step_and_checkpoint(seed):
    """A skipped step changes none of the local statistics; a checkpoint taken inside a
    window (after a refresh, with a carried gradient) resumes bitwise identically."""
    torch.manual_seed(seed)
    P, warmup, R = 2, 2, 3

    def fresh():
        torch.manual_seed(seed)
        return Replicas(Net, lambda m: torch.optim.AdamW(m.parameters(), lr=5e-3),
                        lambda: hvdsparse.TopK(0.05), P, warmup, R)

    def snapshot(sim):
        return torch.utils._pytree.tree_map(
            lambda x: x.clone() if isinstance(x, torch.Tensor) else x,
            [(m.state_dict(), o.state_dict(), c.state_dict(), rc.state_dict())
             for m, o, c, rc in zip(sim.models, sim.opts, sim.comps, sim.recipes)])

    sim = fresh()
    for step in range(5):                       # step 4 (= T_w + R - 1) refreshes
        sim.step(grads(sim.models[0], P, step, seed))
    assert set(sim.recipes[0].state_dict()["local"]["fc1.weight"]) == {"carry"}
    def kept(sim):      # what a skipped step must leave alone (not the byte counters)
        return [(m, o, rc, {n: c.residual(n).clone() for n in ("fc1.weight", "fc2.weight")})
                for (m, o, _, rc), c in zip(snapshot(sim), sim.comps)]

    before = kept(sim)
    sim.step(grads(sim.models[0], P, 5, seed), apply=False)       # skipped
    after = kept(sim)
    for r in range(P):
        la, lb = (torch.utils._pytree.tree_leaves(x[r]) for x in (before, after))
        assert len(la) == len(lb)
        for a, b in zip(la, lb):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), "a skipped step changed the state"
    sim.t = 5
    for step in range(5, 7):
        sim.step(grads(sim.models[0], P, step, seed))
    saved = snapshot(sim)             # inside the window: A, B held, no carry
    assert set(saved[0][3]["local"]["fc1.weight"]) == {"acc", "gsum"}
    for step in range(7, 12):
        sim.step(grads(sim.models[0], P, step, seed))
    s2 = fresh()
    for r, (msd, osd, csd, rsd) in enumerate(saved):
        s2.models[r].load_state_dict(msd)
        s2.opts[r].load_state_dict(osd)
        s2.comps[r].load_state_dict(csd)
        s2.recipes[r].load_state_dict(rsd)
    s2.t = 7
    for step in range(7, 12):
        s2.step(grads(s2.models[0], P, step, seed))
    for r in range(P):
        for (n, a), b in zip(sim.models[r].named_parameters(), s2.models[r].parameters()):
            assert torch.equal(a, b), f"rank {r}: {n} differs after resume"


@pytest.mark.parametrize("saved_R,saved_S", [(None, None), (3, None)])
def test_checkpoint_keeps_its_refresh_schedule(seed, saved_R, saved_S):
    """A checkpoint saved with another refresh schedule (v frozen for good, as every
    checkpoint before the refresh became the default; or windows from T_w) continues
    with that schedule, with a warning: v's bias correction counts the refreshes done,
    so this run's own schedule would rescale the saved v."""
    torch.manual_seed(seed)
    P, warmup = 2, 2

    def fresh(R, S):
        torch.manual_seed(seed)
        return Replicas(Net, lambda m: torch.optim.AdamW(m.parameters(), lr=5e-3),
                        lambda: hvdsparse.TopK(0.05), P, warmup, R, refresh_start=S)

    sim = fresh(saved_R, saved_S)
    for step in range(6):
        sim.step(grads(sim.models[0], P, step, seed))
    saved = torch.utils._pytree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x,
        [(m.state_dict(), o.state_dict(), c.state_dict(), rc.state_dict())
         for m, o, c, rc in zip(sim.models, sim.opts, sim.comps, sim.recipes)])
    for step in range(6, 12):
        sim.step(grads(sim.models[0], P, step, seed))
    s2 = fresh(4, 3)                            # this run's own schedule differs
    for r, (msd, osd, csd, rsd) in enumerate(saved):
        s2.models[r].load_state_dict(msd)
        s2.opts[r].load_state_dict(osd)
        s2.comps[r].load_state_dict(csd)
        if r == 0 and saved_R is None:          # as a checkpoint from before the keys
            rsd = {k: v for k, v in rsd.items() if k not in ("refresh", "refresh_start")}
        with pytest.warns(UserWarning, match=f"adam_refresh={saved_R}, "
                                             f"adam_refresh_start={saved_S}.*continues"):
            s2.recipes[r].load_state_dict(rsd)
        assert (s2.recipes[r].refresh, s2.recipes[r].refresh_start) == (saved_R, saved_S)
    s2.t = 6
    for step in range(6, 12):
        s2.step(grads(s2.models[0], P, step, seed))
    assert sim.dense_steps[6:] == s2.dense_steps      # the same refresh steps
    for r in range(P):
        for (n, a), b in zip(sim.models[r].named_parameters(), s2.models[r].parameters()):
            assert torch.equal(a, b), f"rank {r}: {n} differs after resume"


def test_warmup_is_exact_adam(seed):
    """Before T_w the recipe is torch's own Adam on the averaged gradient, bit for bit."""
    torch.manual_seed(seed)
    P = 2
    model, ref = Net(), Net()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    sim = SimRanks(model, opt, lambda: hvdsparse.TopK(0.01), P, warmup=5)
    for step in range(5):
        everyone = grads(model, P, step, seed)
        sim.step(everyone)
        for n, p in ref.named_parameters():
            p.grad = (everyone[0][n] + everyone[1][n]) * (1.0 / P)
        ropt.step()
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(a, b), f"warm-up step {step}: {n} differs from torch Adam"


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_update_wire_uncompressed_is_adam(seed, kind):
    """At P = 1 with nothing dropped (TopK(1.0): the residual stays 0), the update wire's
    step ``w -= X`` (``X = lr * u``) is torch's Adam / AdamW step on the same gradients, to
    rounding; a skipped step (``neutralised`` left by an exception) changes nothing."""
    torch.manual_seed(seed)
    model, ref = Net(), Net()
    ref.load_state_dict(model.state_dict())
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    opt = cls(model.parameters(), lr=1e-2, weight_decay=1e-2)
    ropt = cls(ref.parameters(), lr=1e-2, weight_decay=1e-2)
    sim = SimRanks(model, opt, lambda: hvdsparse.TopK(1.0), 1, warmup=1, wire="update")
    for step in range(8):
        everyone = grads(model, 1, step, seed)
        if step == 4:                       # an aborted step: Adam's state stays as it was
            before = {n: {k: v.clone() for k, v in opt.state[p].items()}
                      for n, p in model.named_parameters()}
            rc = sim.recipe
            for n, p in sim.named.items():
                rc.corrected(n, everyone[0][n], p, sim.comps[0].policy.is_dense(n, p.shape),
                             None)
            with pytest.raises(RuntimeError):
                with rc.neutralised():
                    raise RuntimeError("skipped")
            for n, p in model.named_parameters():
                for k, v in before[n].items():
                    assert torch.equal(opt.state[p][k], v), f"aborted step changed {n} {k}"
        sim.step(everyone)
        for n, p in ref.named_parameters():
            p.grad = everyone[0][n].clone()
        ropt.step()
        for (n, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), \
                f"{kind} step {step}: {n} differs from torch's by {(a - b).abs().max():.3g}"
    with pytest.raises(ValueError, match="wire='update' .*no refresh"):
        AdamRecipe(opt, sim.named, 1, lambda n: True, warmup=1, wire="update", refresh=2)


@pytest.mark.parametrize("comp", ["topk", "adacomp"])
def test_update_wire_under_a_schedule_matches_replay(seed, comp):
    """The update wire with a learning rate that changes every step (a warm-up, then a
    decay) against the replay of its definition (``x_r = lr_t * u_r`` with error
    feedback, ``w -= X``): what a residual holds back is applied at the rate of the
    step it came from, whichever step sends it. P = 1 (the update wire's moments are
    per rank: one process holds one rank's; tests/workers/adam_worker.py runs P = 3)."""
    torch.manual_seed(seed)
    P, lr0, wd, betas, eps = 1, 3e-3, 1e-2, (0.9, 0.99), 1e-8
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=lr0, betas=betas, eps=eps,
                            weight_decay=wd)
    if comp == "topk":
        make, sel, dw = (lambda: hvdsparse.TopK(0.05, exact=True)), topk_exact(0.05), False
    else:
        make, sel, dw = hvdsparse.AdaComp, adacomp(), True
    rep = AdamReplay(dict(model.named_parameters()), P, lr=lr0, betas=betas, eps=eps,
                     wd=wd, decoupled=True, warmup=1, select=sel, needs_dw=dw,
                     wire="update")
    sim = SimRanks(model, opt, make, P, 1, wire="update")
    for step in range(9):
        lr = lr0 * min(1.0, (step + 1) / 4) * 0.7 ** max(0, step - 4)
        opt.param_groups[0]["lr"] = rep.lr = lr
        everyone = grads(model, P, step, seed)
        sim.step(everyone)
        rep.step(everyone)
        _close(sim, rep, f"{comp} step {step} (lr {lr:.3g})")


def test_update_wire_warmup_lasts_while_the_rate_rises():
    """``adam_warmup`` left at its default on the update wire with a compressor measured
    to gain from it (Threshold, AdaComp): after the one dense step, a layer stays dense (exact
    Adam) at every step whose group's learning rate is above the previous step's, and is
    compressed from the first step at which it is not, for good (a later rise does not
    bring the warm-up back); a group whose rate does not rise is compressed after the one
    step. An explicit ``adam_warmup``, another wire or another compressor (TopK, QSGD,
    RandomK, Slim-DP): a fixed count."""
    from hvdsparse.adam_settings import adam_setup
    a, b = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))
    opt = torch.optim.AdamW([dict(params=[a], lr=1e-4), dict(params=[b], lr=1e-3)])
    for comp in (hvdsparse.Threshold(0.9), hvdsparse.AdaComp()):
        st = adam_setup(opt, comp, None, None, adam_wire="update")
        assert st.warmup == 1 and st.while_rate_rises, type(comp).__name__
    for comp, warm, wire in ((hvdsparse.Threshold(0.9), 5, "update"),
                             (hvdsparse.Threshold(0.9), None, "gradient"),
                             (hvdsparse.AdaComp(), 5, "update"),
                             (hvdsparse.AdaComp(), None, "gradient"),
                             (hvdsparse.TopK(0.1), None, "update"),
                             (hvdsparse.QSGD(4), None, "update"),
                             (hvdsparse.RandomK(0.1), None, "update"),
                             (hvdsparse.SlimDP(0.3, 0.15), None, "update")):
        assert not adam_setup(opt, comp, None, warm, adam_wire=wire).while_rate_rises
    rc = AdamRecipe(opt, dict(a=a, b=b), 2, lambda n: True, warmup=st.warmup, wire="update",
                    warmup_while_rate_rises=True)
    lrs_a = [1e-4, 2e-4, 3e-4, 3e-4, 2e-4, 4e-4, 1e-4]     # warm-up, peak, decay, a rise
    frozen_a, frozen_b = [], []
    for t, lr in enumerate(lrs_a):
        opt.param_groups[0]["lr"] = lr
        rc.begin_step()
        frozen_a.append(rc.frozen("a"))
        frozen_b.append(rc.frozen("b"))
        a.grad, b.grad = torch.randn(8, 8), torch.randn(8, 8)
        opt.step()
    assert frozen_a == [False, False, False, True, True, True, True]
    assert frozen_b == [False, True, True, True, True, True, True]


def test_update_wire_sends_topks_small_layers_whole():
    """On the update wire TopK with fp16 / bf16 values (bf16 its default there) sends the
    layers its size / 1-D rule keeps dense whole: every element in its value encoding,
    the rounding kept in the residual; an override's ``dense=True`` keeps a layer exact,
    as do fp32 values, another wire, and the compressors not measured with it."""
    model = nn.Sequential(nn.Linear(40, 64), nn.LayerNorm(64), nn.Linear(64, 30))
    shapes = [(n, p.shape) for n, p in model.named_parameters()]
    small = [n for n, s in shapes if len(s) == 1 or torch.Size(s).numel() < 1024]
    assert small == ["0.bias", "1.weight", "1.bias", "2.bias"]

    def whole(comp, on=True):
        comp.register_layers(shapes)
        comp.set_adam_update_wire(on)
        return [n for n, s in shapes if comp.policy.is_whole(n, s)], \
            [n for n, s in shapes if comp.policy.is_dense(n, s)]
    assert whole(hvdsparse.TopK(0.01)) == (small, [])
    assert whole(hvdsparse.TopK(0.01, values="fp16")) == (small, [])
    assert whole(hvdsparse.TopK(0.01, overrides={"1.*": dict(dense=True)})) == \
        (["0.bias", "2.bias"], ["1.weight", "1.bias"])
    for comp, on in ((hvdsparse.TopK(0.01, values="fp32"), True),
                     (hvdsparse.TopK(0.01, values="int8"), True),
                     (hvdsparse.TopK(0.01), False), (hvdsparse.Threshold(0.99), True),
                     (hvdsparse.AdaComp(), True), (hvdsparse.QSGD(4), True),
                     (hvdsparse.RandomK(0.01, values="bf16"), True)):
        assert whole(comp, on) == ([], small), (comp, on)
    comp = hvdsparse.TopK(0.01)
    whole(comp)
    g = torch.randn(64) * 1e-3
    pay = comp.compress("1.bias", g, 3)
    seg, = pay.segments
    assert seg.index_encoding == IndexEncoding.DENSE and seg.value_encoding == ValueEncoding.BF16
    sent = seg.values.float()
    assert torch.equal(sent, g.to(torch.bfloat16).float())
    assert torch.equal(comp.residual("1.bias"), g - sent) and (g != sent).any()


@pytest.mark.parametrize("wire", ["gradient", "momentum", "update"])
def test_unused_layer_is_a_zero_gradient(seed, wire):
    """A trainable layer without a gradient on a rank is a zero g_i: it sends x_i = 0 on
    the gradient wire, m_i / D = beta1 * m / D on the momentum wire."""
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sim = SimRanks(model, opt, lambda: hvdsparse.TopK(1.0), 2, warmup=1, wire=wire)
    sim.step(grads(model, 2, 0, seed))
    p = sim.named["fc1.weight"]
    m = opt.state[p]["exp_avg"].clone()
    v = opt.state[p]["exp_avg_sq"]
    x, _ = sim.recipe.corrected("fc1.weight", torch.zeros_like(p), p, False, None)
    s = v.sqrt() / math.sqrt(1 - 0.999)                  # frozen after T_w = 1 step
    D = torch.clamp(s, min=float(0.1 * s.mean())) + 1e-8
    if wire == "gradient":
        assert torch.equal(x, torch.zeros_like(x))
    elif wire == "update":                  # this rank's Adam step with g = 0, times lr
        m1, v1 = 0.9 * m, 0.999 * v
        u = m1 / (v1.sqrt() / math.sqrt(1 - 0.999 ** 2) + 1e-8) / (1 - 0.9 ** 2)
        assert torch.allclose(x, u * 1e-2, rtol=1e-6, atol=0)
    else:
        assert torch.allclose(x, m * 0.9 / D, rtol=1e-6, atol=0)


def test_setup_checks():
    p = nn.Parameter(torch.randn(4, 4))
    adam = torch.optim.Adam([p])
    topk = hvdsparse.TopK(0.01)
    # the default wire follows the model: the gradient wire with a recurrent layer
    rnn = dict(param_names=["emb.weight", "lstm.weight_ih_l0", "lstm.weight_hh_l0"])
    assert adam_setup(adam, topk, None, None, **rnn) == \
        (DEFAULT_WARMUP, DEFAULT_REFRESH, REFRESH_START_FACTOR * DEFAULT_WARMUP, "gradient",
         False)
    assert adam_setup(adam, topk, None, None, param_names=["fc.weight", "attn.qkv.weight"]) \
        == (UPDATE_WARMUP, None, None, "update", False)
    assert adam_setup(adam, topk, None, None) == (UPDATE_WARMUP, None, None, "update", False)
    for names, wire in ((["rnn.weight_hh_l1_reverse"], "gradient"), (["cell.weight_hh"], "gradient"),
                        (["weight_hh_l0"], "gradient"), (["my_weight_hh_l0"], "update"),
                        (["head.weight", "gru.weight_hh_l0x"], "update"), ([], "update")):
        assert default_wire(names) == wire, names
    assert adam_setup(torch.optim.AdamW([p]), topk, None, 7, **rnn)[:3] == \
        (7, DEFAULT_REFRESH, 21)
    assert adam_setup(adam, topk, None, 7, adam_refresh=0, **rnn)[:3] == (7, None, None)
    assert adam_setup(adam, topk, None, 7, adam_refresh=False, **rnn)[:3] == (7, None, None)
    assert adam_setup(adam, topk, None, 7, adam_refresh=4, adam_refresh_start=7, **rnn)[:3] \
        == (7, 4, 7)
    assert adam_setup(adam, topk, None, 7, **rnn).wire == "gradient"
    assert adam_setup(adam, topk, None, 7, adam_wire="gradient") == (7, DEFAULT_REFRESH, 21,
                                                                     "gradient", False)
    for r in (None, 0):          # the momentum wire: the variance frozen for good
        assert adam_setup(adam, topk, None, 7, adam_wire="momentum", adam_refresh=r) == \
            (7, None, None, "momentum", False)
    # the update wire: every rank's variance live, no refresh; one dense warm-up step
    assert adam_setup(adam, topk, None, None, adam_wire="update") == \
        (UPDATE_WARMUP, None, None, "update", False)
    assert adam_setup(adam, topk, None, 5, adam_wire="update", adam_refresh=0) == \
        (5, None, None, "update", False)
    ada = hvdsparse.AdaComp()               # off by default for AdaComp; on when asked
    assert adam_setup(adam, ada, None, None, **rnn)[:3] == (DEFAULT_WARMUP, None, None)
    assert adam_setup(adam, ada, None, 7, adam_refresh=50, **rnn)[:3] == (7, 50, 21)
    with pytest.raises(ValueError, match="adam_refresh_start=30 .*AdaComp"):
        adam_setup(adam, ada, None, 7, adam_refresh_start=30, **rnn)
    assert adam_setup(adam, topk, False, None) is None
    assert adam_setup(adam, hvdsparse.NoCompression(), None, None) is None
    assert adam_setup(torch.optim.SGD([p], lr=0.1), topk, None, None) is None
    bad = [
        (dict(optimizer=torch.optim.SGD([p], lr=0.1), adam_recipe=True), "Adam or AdamW"),
        (dict(optimizer=torch.optim.Adam([p], amsgrad=True)), "amsgrad"),
        (dict(optimizer=torch.optim.Adam([p], differentiable=True)), "differentiable"),
        (dict(optimizer=torch.optim.Adam([nn.Parameter(torch.randn(3, dtype=torch.cfloat))])),
         "complex"),
        (dict(adam_warmup=0), "adam_warmup"),
        (dict(adam_warmup=2.5), "adam_warmup"),
        (dict(adam_warmup=True), "adam_warmup"),
        (dict(adam_recipe="yes"), "adam_recipe"),
        (dict(adam_recipe=False, adam_warmup=10), "recipe is off"),
        (dict(local_gradient="partial"), "local_gradient"),
        (dict(momentum_correction=True), "momentum_correction"),
        (dict(adam_refresh=1), "adam_refresh"),
        (dict(adam_refresh=-3), "adam_refresh"),
        (dict(adam_refresh=2.0), "adam_refresh"),
        (dict(adam_refresh=True), "adam_refresh"),
        (dict(adam_recipe=False, adam_refresh=50), "recipe is off"),
        (dict(adam_recipe=False, adam_refresh_start=300), "adam_refresh_start=300 .*off"),
        (dict(adam_refresh_start=99), "adam_refresh_start .*adam_warmup \\(100\\)"),
        (dict(adam_refresh_start=150.0), "adam_refresh_start"),
        (dict(adam_refresh=0, adam_refresh_start=300), "adam_refresh_start=300"),
        (dict(adam_wire="sign"), "adam_wire must be"),
        (dict(adam_wire="momentum", adam_refresh=50), "adam_wire='momentum' has no"),
        (dict(adam_wire="momentum", adam_refresh_start=300), "adam_wire='momentum' has no"),
        (dict(adam_recipe=False, adam_wire="momentum"), "adam_wire='momentum' is given .*off"),
        (dict(adam_wire="update", adam_refresh=50), "adam_wire='update' has no"),
        (dict(adam_wire="update", adam_warmup=0), "adam_warmup"),
    ]
    for kw, words in bad:
        args = dict(optimizer=adam, compression=topk, adam_recipe=None, adam_warmup=None)
        args.update(kw)
        extra = {k: args.pop(k) for k in ("local_gradient", "momentum_correction",
                                          "adam_refresh", "adam_refresh_start", "adam_wire")
                 if k in args}
        with pytest.raises(ValueError, match=words):
            adam_setup(args["optimizer"], args["compression"], args["adam_recipe"],
                       args["adam_warmup"], **extra, **rnn)


def test_local_refresh_checks():
    """The local refresh's own argument checks name the argument."""
    m = Net()
    named = dict(m.named_parameters())
    opt = torch.optim.Adam(m.parameters())
    for kw, words in ((dict(refresh=1), "adam_refresh=1"),
                      (dict(refresh=5, wire="momentum"), "wire='gradient'"),
                      (dict(refresh=5, precondition=False), "precondition=True"),
                      (dict(refresh=5, refresh_from="global"), "refresh_from"),
                      (dict(refresh=5, refresh_start=2), "adam_refresh_start.*\\(3\\)")):
        with pytest.raises(ValueError, match=words):
            AdamRecipe(opt, named, 2, lambda n: True, warmup=3, **kw)
    AdamRecipe(opt, named, 2, lambda n: True, warmup=3, refresh=1, refresh_from="sample")
    rc = AdamRecipe(opt, named, 2, lambda n: True, warmup=3, refresh=4)
    sd = rc.state_dict()
    sd["local"] = {"fc1.weight": {"acc": torch.zeros(3, 3)}}
    with pytest.raises(ValueError, match="fc1.weight.*shape"):
        rc.load_state_dict(sd)
    sd["local"] = {"nope": {"acc": torch.zeros(3, 3)}}
    with pytest.raises(ValueError, match="'nope'"):
        rc.load_state_dict(sd)


def test_checkpoint_round_trip(seed):
    """optimizer.state_dict() + the compressors' state continue bitwise identically."""
    torch.manual_seed(seed)
    P, warmup = 2, 2

    def fresh():
        torch.manual_seed(seed)
        m = Net()
        o = torch.optim.AdamW(m.parameters(), lr=5e-3)
        return m, o, SimRanks(m, o, lambda: hvdsparse.TopK(0.05), P, warmup)

    model, opt, sim = fresh()
    for step in range(4):
        sim.step(grads(model, P, step, seed))
    saved = (opt.state_dict(), [c.state_dict() for c in sim.comps],
             sim.recipe.state_dict(), model.state_dict())
    saved = torch.utils._pytree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, saved)
    for step in range(4, 8):
        sim.step(grads(model, P, step, seed))
    m2, o2, s2 = fresh()
    m2.load_state_dict(saved[3])
    o2.load_state_dict(saved[0])
    for c, sd in zip(s2.comps, saved[1]):
        c.load_state_dict(sd)
    s2.recipe.load_state_dict(saved[2])
    s2.recipe.forget()
    s2.t = 4
    for step in range(4, 8):
        s2.step(grads(m2, P, step, seed))
    for (n, a), b in zip(model.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), f"{n} differs after resume"
    assert math.isclose(float(o2.state[m2.fc1.weight]["step"]), 8)


def test_ddp_state_wiring():
    """hvdsparse.ddp.State: on by default with optimizer=Adam, checks as the front door
    (a world of one: no process group needed)."""
    from hvdsparse.ddp import State
    from hvdsparse.transport import Transport

    class One(Transport):
        def rank(self):
            return 0

        def size(self):
            return 1
    net = Net()
    st = State(hvdsparse.TopK(0.1), net.named_parameters(), transport=One(),
               optimizer=torch.optim.AdamW(net.parameters()))
    assert isinstance(st.local_update, AdamRecipe) and st.local_update.warmup == UPDATE_WARMUP
    assert st.fingerprint["adam_warmup"] == UPDATE_WARMUP
    assert st.local_update.wire == "update" and st.fingerprint["adam_wire"] == "update"
    rnn = nn.GRU(4, 8)                       # a recurrent layer: the gradient wire
    st = State(hvdsparse.TopK(0.1), rnn.named_parameters(), transport=One(),
               optimizer=torch.optim.AdamW(rnn.parameters()))
    assert st.local_update.wire == "gradient" and st.fingerprint["adam_wire"] == "gradient"
    assert st.local_update.warmup == DEFAULT_WARMUP and st.local_update.refresh == DEFAULT_REFRESH
    st = State(hvdsparse.TopK(0.1), net.named_parameters(), transport=One(),
               optimizer=torch.optim.AdamW(net.parameters()), adam_wire="momentum")
    assert st.local_update.wire == "momentum" and st.local_update.refresh is None
    assert st.fingerprint["adam_wire"] == "momentum"
    st = State(hvdsparse.TopK(0.1), net.named_parameters(), transport=One())
    assert st.local_update is None and st.fingerprint["adam_warmup"] is None
    for kw, words in ((dict(optimizer=torch.optim.Adam(net.parameters(), amsgrad=True)),
                       "amsgrad"),
                      (dict(adam_warmup=10), "need optimizer"),
                      (dict(adam_wire="momentum"), "need optimizer"),
                      (dict(optimizer=torch.optim.Adam(net.parameters()), adam_recipe=False),
                       "optimizer= is only used"),
                      (dict(optimizer=torch.optim.Adam(net.parameters()),
                            momentum_correction=True), "momentum_correction")):
        with pytest.raises(ValueError, match=words):
            State(hvdsparse.TopK(0.1), net.named_parameters(), transport=One(), **kw)
