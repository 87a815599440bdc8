"""hvdsparse's DDP communication hook under real ``torchrun`` (Gloo, CPU), every check in
one launch. Each rank draws its own data (seeded by step and rank). Checks:

1. ``TopK(1.0)`` with fp32 values (every element sent; the exchange only sums and
   averages) gives the same parameters as DDP's default allreduce within float
   tolerance, for SGD with momentum and for Adam, through every exchange strategy
   (allgather, split, dense, auto), with several buckets (DDP rebuilds them after the
   first iteration) and with ``static_graph=True``.
2. Every compressor (at its defaults) trains the digits MLP (loss goes down) with
   parameters bitwise identical across ranks at every step, DGC momentum correction on
   where the default rule puts it.
3. ``no_sync()``: two accumulated micro-batches + one synchronised one equal one
   backward over all three (TopK(1.0) vs DDP's own no_sync, and TopK(0.05) vs a summed
   loss); the hook's step counts synchronised steps only.
4. ``find_unused_parameters=True`` with a branch only rank 0 uses on odd steps: equal to
   DDP's allreduce for TopK(1.0); with TopK(0.05) the other ranks' residual of that
   branch is untouched when they did not use it; replicas identical.
5. Checkpoint / resume of the hook state (+ model + optimizer): the resumed run is
   bitwise identical to the uninterrupted one.
6. ``Join`` with uneven inputs: replicas identical, step counters equal.
7. Ranks with different compressor settings: every rank raises ValueError naming the
   setting (no hang).
8. DGC momentum correction against a plain-torch replay; non-finite gradients raise;
   ``exchange="balanced"`` feeds undelivered elements back.
9. ``torch.amp.GradScaler`` (``grad_scaler=``): an overflow step is skipped on every
   rank and rolled back (bitwise equal to a run without it, SGD and Adam);
   ``nonfinite="propagate"`` marks the layer on every rank.

Prints ``HVDSPARSE-OK rank=<r>``.
"""
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdsparse
import hvdsparse.ddp
import hvdsparse.native
from tests.workers.torchrun_exit import finish

dist.init_process_group("gloo")
R, P = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)
DIN, NCLS = 24, 4


def check(cond, msg):
    if not cond:
        raise AssertionError(f"rank {R}: {msg}")


class Net(nn.Module):
    def __init__(self, branch=False):
        super().__init__()
        self.fc1 = nn.Linear(DIN, 64)       # 1536 weights
        self.fc2 = nn.Linear(64, 48)        # 3072 weights
        self.fc3 = nn.Linear(48, NCLS)
        self.branch = nn.Linear(64, 48) if branch else None

    def forward(self, x, use_branch=False):
        h = torch.tanh(self.fc1(x))
        z = self.fc2(h)
        if use_branch:
            z = z + self.branch(h)
        return self.fc3(torch.tanh(z))


# a fixed random teacher: learnable labels
_T = torch.Generator().manual_seed(1234)
TEACHER = torch.randn(DIN, NCLS, generator=_T)


def batch(step, rank=R, n=16):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, DIN, generator=g)
    return x, (x @ TEACHER).argmax(1)


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def identical_across_ranks(model, what):
    v = flat_params(model)
    out = [torch.empty_like(v) for _ in range(P)]
    dist.all_gather(out, v)
    for r in range(P):
        check(torch.equal(out[r], out[0]), f"{what}: parameters of rank {r} differ from rank 0 "
              f"(max {float((out[r] - out[0]).abs().max())})")


def make(seed=0, branch=False, **ddp_kw):
    torch.manual_seed(seed)
    net = Net(branch)
    return DDP(net, **ddp_kw)


def make_opt(model, kind):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def hooked(comp, seed=0, branch=False, ddp_kw=None, **state_kw):
    model = make(seed, branch, **(ddp_kw or {}))
    state = hvdsparse.ddp.State(comp, model.named_parameters(), **state_kw)
    model.register_comm_hook(state, hvdsparse.ddp.hook)
    return model, state


def train_step(model, opt, step, **fw):
    x, y = batch(step)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x, **fw), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


SMALL = dict(bucket_cap_mb=0.01)   # ~10 KB buckets: several buckets, rebuilt after iter 0


# ------------------------------------------------------------------ 0. the transport
def check_transport():
    """Every TorchDistTransport operation against what each rank's (seeded) input makes
    it: uint8 rows, alltoall with empty splits and an empty rank, pre/post scaling,
    poll/synchronize, futures, broadcast, allgather_object."""
    from hvdsparse.transport import TorchDistTransport
    t = TorchDistTransport()
    check(t.rank() == R and t.size() == P and t.ordered, "rank / size / ordered")

    def rows_of(r, n):
        g = torch.Generator().manual_seed(50 + r)
        return torch.randint(0, 256, (n, 6), generator=g, dtype=torch.uint8)
    h = t.allgather_async(rows_of(R, 3), name="t.ag")
    got = t.synchronize(h)
    check(torch.equal(got, torch.cat([rows_of(r, 3) for r in range(P)])), "allgather rows")
    check(t.poll(h), "poll after synchronize")

    def splits_of(r):      # rank r sends splits_of(r)[q] rows to rank q; last rank none
        return [0 if r == P - 1 else (r + 2 * q) % 3 for q in range(P)]
    mine = rows_of(R, sum(splits_of(R)))
    h = t.alltoall_async(mine, splits_of(R), name="t.a2a")
    out, recv = t.synchronize(h)
    expect = []
    for r in range(P):
        sp = splits_of(r)
        src = rows_of(r, sum(sp))
        expect.append(src[sum(sp[:R]):sum(sp[:R]) + sp[R]])
    check(recv.dtype == torch.int32 and recv.tolist() == [splits_of(r)[R] for r in range(P)],
          f"alltoall recv splits {recv.tolist()}")
    check(torch.equal(out, torch.cat(expect)), "alltoall rows")
    x = torch.full((5,), float(R + 1))
    h = t.allreduce_async_(x, name="t.ar", prescale_factor=0.5, postscale_factor=4.0)
    val = t.future(h).wait()
    want = 2.0 * sum(range(1, P + 1))
    check(torch.equal(val, torch.full((5,), want)) and torch.equal(x, val), "allreduce scale")
    b = torch.full((3,), float(R))
    check(torch.equal(t.broadcast(b, P - 1), torch.full((3,), float(P - 1))), "broadcast")
    check(t.allgather_object({"r": R}) == [{"r": r} for r in range(P)], "allgather_object")


# ------------------------------------------------------------------ 1. TopK(1.0) == DDP
def check_equivalence():
    static = dict(static_graph=True)
    fp16 = dict(dense_dtype="fp16", gradient_predivide_factor=2.0)
    for opt_kind, exchange, ddp_kw, kw, tol in (
            ("sgd", "allgather", SMALL, {}, 1e-5), ("sgd", "split", SMALL, {}, 1e-5),
            ("sgd", "dense", static, {}, 1e-5), ("sgd", "auto", SMALL, {}, 1e-5),
            ("sgd", "dense", SMALL, fp16, 2e-3),
            ("adam", "allgather", static, {}, 1e-5), ("adam", "split", SMALL, {}, 1e-5)):
        ref = make(0, **ddp_kw)
        ref_opt = make_opt(ref, opt_kind)
        model, state = hooked(hvdsparse.TopK(1.0, exact=True, min_numel=0),
                              exchange=exchange, ddp_kw=ddp_kw, **kw)
        opt = make_opt(model, opt_kind)
        init = flat_params(ref).clone()
        check(torch.equal(init, flat_params(model)), "same init")
        for step in range(5):
            train_step(ref, ref_opt, step)
            train_step(model, opt, step)
        a, b = flat_params(ref), flat_params(model)
        check(torch.allclose(a, b, rtol=tol, atol=tol / 10),
              f"TopK(1.0) {opt_kind} {exchange} {ddp_kw} {kw}: max diff "
              f"{float((a - b).abs().max())} vs DDP allreduce")
        check(float((a - init).abs().max()) > 1e-3,
              "training moved the parameters")
        identical_across_ranks(model, f"TopK(1.0) {opt_kind} {exchange}")
        check(state.step == 5, f"state.step {state.step} != 5")
        strategies = set(state.totals["strategy_counts"])
        if exchange != "auto":
            check(strategies == {exchange}, f"strategies {strategies} != {exchange}")
        if ddp_kw is SMALL:
            check(len(state.last_stats["buckets"]) >= 2,
                  f"expected several buckets, got {state.last_stats['buckets']}")


# ------------------------------------------------------------------ 2. every compressor
def digits():
    """scikit-learn's 8x8 digits (bundled, offline), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    return torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y, dtype=torch.long)


class DigitsMLP(nn.Module):
    """The digits MLP of the convergence benchmark (64-512-512-10, 300 K weights)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512),
                                 nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x):
        return self.net(x)


# each at its defaults (the layers below 1024 elements go dense by policy)
COMPRESSORS = {
    "TopK": lambda: hvdsparse.TopK(0.01),
    "TopK-int8": lambda: hvdsparse.TopK(0.01, values="int8"),
    "TopK-warmup": lambda: hvdsparse.TopK(0.01, warmup=hvdsparse.ExponentialWarmup(4)),
    "Threshold": lambda: hvdsparse.Threshold(0.99),
    "AdaComp": lambda: hvdsparse.AdaComp(),
    "SlimDP": lambda: hvdsparse.SlimDP(0.3, 0.15, core_period=4),
    "RandomK": lambda: hvdsparse.RandomK(0.01),
    "RandomK-shared": lambda: hvdsparse.RandomK(0.01, shared_seed=True),
    "QSGD": lambda: hvdsparse.QSGD(4),
    "NoCompression": lambda: hvdsparse.NoCompression(),
}


def check_every_compressor():
    """Every compressor trains the digits MLP (SGD momentum 0.9, lr 0.05, 16 images per
    rank, 4 batches cycled so the loss must fall) with parameters bitwise identical
    across ranks at every step. The State gets ``optimizer=``, so DGC's momentum
    correction is on where the default rule puts it (TopK / Threshold / AdaComp)."""
    x_all, y_all = digits()
    order = torch.randperm(x_all.shape[0], generator=torch.Generator().manual_seed(5))
    for name, mk in COMPRESSORS.items():
        exchange = "split" if name == "AdaComp" else "auto"
        torch.manual_seed(1)
        model = DDP(DigitsMLP(), bucket_cap_mb=0.5)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        comp = mk()
        state = hvdsparse.ddp.State(comp, model.named_parameters(), exchange=exchange,
                                    optimizer=opt)
        model.register_comm_hook(state, hvdsparse.ddp.hook)
        mc = state.fingerprint["momentum_correction"]
        check(mc == (name in ("TopK", "TopK-int8", "TopK-warmup", "Threshold", "AdaComp")),
              f"{name}: momentum correction {mc} is not the default rule's")
        losses = []
        for step in range(12):
            i = order[(16 * (P * (step % 4) + R)) + torch.arange(16)]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x_all[i]), y_all[i])
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            identical_across_ranks(model, f"{name} step {step}")
        first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
        check(last < first, f"{name}: loss did not go down ({first:.4f} -> {last:.4f})")
        check(state.step == 12, f"{name}: step {state.step}")
        check(state.totals["bytes_sent_total"] > 0, f"{name}: nothing sent")


# ------------------------------------------------------------------ 3. no_sync
def check_no_sync():
    # (a) TopK(1.0) with no_sync == DDP's own no_sync
    ref = make(2)
    ref_opt = make_opt(ref, "sgd")
    model, state = hooked(hvdsparse.TopK(1.0, exact=True, min_numel=0), seed=2)
    opt = make_opt(model, "sgd")
    for m, o in ((ref, ref_opt), (model, opt)):
        for step in range(3):
            o.zero_grad(set_to_none=True)
            with m.no_sync():
                for micro in range(2):
                    x, y = batch(10 * step + micro)
                    F.cross_entropy(m(x), y).backward()
            x, y = batch(10 * step + 2)
            F.cross_entropy(m(x), y).backward()
            o.step()
    a, b = flat_params(ref), flat_params(model)
    check(torch.allclose(a, b, rtol=1e-5, atol=1e-6),
          f"no_sync TopK(1.0): max diff {float((a - b).abs().max())}")
    check(state.step == 3, f"no_sync: step {state.step} counts micro-batches")
    # (b) TopK(0.05): the accumulated gradient is what gets compressed
    m1, s1 = hooked(hvdsparse.TopK(0.05, exact=True, min_numel=0), seed=3)
    m2, s2 = hooked(hvdsparse.TopK(0.05, exact=True, min_numel=0), seed=3)
    o1, o2 = make_opt(m1, "sgd"), make_opt(m2, "sgd")
    for step in range(3):
        xs = [batch(10 * step + i) for i in range(3)]
        o1.zero_grad(set_to_none=True)
        with m1.no_sync():
            for x, y in xs[:2]:
                F.cross_entropy(m1(x), y, reduction="sum").backward()
        F.cross_entropy(m1(xs[2][0]), xs[2][1], reduction="sum").backward()
        o1.step()
        o2.zero_grad(set_to_none=True)
        sum(F.cross_entropy(m2(x), y, reduction="sum") for x, y in xs).backward()
        o2.step()
    a, b = flat_params(m1), flat_params(m2)
    check(torch.allclose(a, b, rtol=1e-4, atol=1e-5),
          f"no_sync TopK(0.05): max diff {float((a - b).abs().max())}")
    identical_across_ranks(m1, "no_sync")


# ------------------------------------------------------------------ 4. unused parameters
def check_unused():
    kw = dict(find_unused_parameters=True)
    ref = make(4, branch=True, **kw)
    ref_opt = make_opt(ref, "sgd")
    model, state = hooked(hvdsparse.TopK(1.0, exact=True, min_numel=0), seed=4, branch=True,
                          ddp_kw=kw)
    opt = make_opt(model, "sgd")
    sparse_m, sparse_s = hooked(hvdsparse.TopK(0.05, exact=True, min_numel=0), seed=4,
                                branch=True, ddp_kw=kw)
    sparse_o = make_opt(sparse_m, "sgd")
    bname = "module.branch.weight"
    for step in range(6):
        use = (R == 0 and step % 2 == 1) or step == 0
        train_step(ref, ref_opt, step, use_branch=use)
        train_step(model, opt, step, use_branch=use)
        before = sparse_s.compressor.residual(bname)
        before = None if before is None else before.clone()
        train_step(sparse_m, sparse_o, step, use_branch=use)
        after = sparse_s.compressor.residual(bname)
        if not use:
            check(before is not None and torch.equal(before, after),
                  f"step {step}: residual of unused {bname} changed")
        identical_across_ranks(sparse_m, f"unused step {step}")
    a, b = flat_params(ref), flat_params(model)
    check(torch.allclose(a, b, rtol=1e-5, atol=1e-6),
          f"unused TopK(1.0): max diff {float((a - b).abs().max())}")


# ------------------------------------------------------------------ 5. checkpoint
def check_checkpoint():
    """Resume from (model, optimizer, hook state) is bitwise identical to the
    uninterrupted run; without and with ``optimizer=`` (DGC momentum correction on by
    the default rule: the velocities are part of the hook state)."""
    import copy
    for mc in (False, True):
        def fresh():
            model = make(5, **SMALL)
            opt = make_opt(model, "sgd")
            state = hvdsparse.ddp.State(hvdsparse.TopK(0.05, min_numel=256),
                                        model.named_parameters(),
                                        optimizer=opt if mc else None)
            model.register_comm_hook(state, hvdsparse.ddp.hook)
            check((state.local_update is not None) == mc, f"mc={mc}: momentum correction")
            return model, state, opt
        m, s, o = fresh()
        for step in range(3):
            train_step(m, o, step)
        ck = copy.deepcopy(dict(model={k: v.clone() for k, v in m.state_dict().items()},
                                opt=o.state_dict(), hook=s.state_dict()))
        ck_hist = ck["hook"]["history"]
        for step in range(3, 7):
            train_step(m, o, step)
        m2, s2, o2 = fresh()
        m2.load_state_dict(ck["model"])
        o2.load_state_dict(ck["opt"])
        s2.load_state_dict(ck["hook"])
        check(s2.step == 3, f"resumed step {s2.step}")
        # exchange="auto": the resumed run holds the cost model's figures of the
        # checkpoint (each layout's last two exchanges), which its next steps read
        check(ck_hist and s2.engine.history_state() == ck_hist and
              all(v and v[-1].get("pairs") is not None for v in ck_hist.values()),
              f"mc={mc} resume: the cost model's figures differ: "
              f"{s2.engine.history_state()} vs "
              f"{ck_hist}")
        train_step(m2, o2, 3)
        for step in range(4, 7):
            train_step(m2, o2, step)
        check(torch.equal(flat_params(m), flat_params(m2)),
              f"mc={mc} resume: max diff {float((flat_params(m) - flat_params(m2)).abs().max())}")
        r1 = s.compressor.residual("module.fc2.weight")
        r2 = s2.compressor.residual("module.fc2.weight")
        check(r1 is not None and torch.equal(r1, r2), f"mc={mc} resume: residuals differ")
        if mc:
            u1, u2 = s.local_update.u, s2.local_update.u
            check(set(u1) == set(u2) and len(u1) > 0 and
                  all(torch.equal(u1[k], u2[k]) for k in u1), "resume: velocities differ")
        # without loading the hook state the run differs (the check above can fail)
        m3, s3, o3 = fresh()
        m3.load_state_dict(ck["model"])
        o3.load_state_dict(ck["opt"])
        for step in range(3, 7):
            train_step(m3, o3, step)
        check(not torch.equal(flat_params(m), flat_params(m3)), "resume without state equal?")


# ------------------------------------------------------------------ 6. Join
def check_join():
    from torch.distributed.algorithms.join import Join
    model, state = hooked(hvdsparse.TopK(0.05, min_numel=256), seed=6, ddp_kw=SMALL)
    opt = make_opt(model, "sgd")
    nsteps = 3 + R                       # uneven inputs
    with Join([model]):
        for step in range(nsteps):
            train_step(model, opt, step)
    identical_across_ranks(model, "join")
    steps = [None] * P
    dist.all_gather_object(steps, state.step)
    check(len(set(steps)) == 1 and steps[0] == 3 + P - 1, f"join: step counters {steps}")


# ------------------------------------------------------------------ 7. disagreement
def check_disagreement():
    ratio = 0.05 if R == 0 else 0.1
    model, state = hooked(hvdsparse.TopK(ratio, min_numel=256), seed=7)
    x, y = batch(0)
    try:
        F.cross_entropy(model(x), y).backward()
    except Exception as e:     # noqa: BLE001 - DDP may wrap it
        msg = str(e)
        check("ranks disagree" in msg and "ratio" in msg, f"unexpected error: {msg[:300]}")
    else:
        raise AssertionError(f"rank {R}: mismatched settings were not detected")


# ------------------------------------------------------------------ 8. momentum correction
def check_momentum_correction():
    """DGC's momentum correction + masking (+ local clipping) in the hook against an
    independent plain-torch replay of DGC's rule from every rank's raw local gradient
    (tests/workers/dgc_replay.py)."""
    import copy
    from tests.workers.dgc_replay import DGCReplay
    lr, m, wd, ratio = 0.1, 0.9, 1e-3, 0.05
    # the second case warms up (2 stages over 4 steps: no masking while above (1 - m) / 2)
    for nesterov, clip, warm in ((False, None, None), (True, 0.5, (4, 2))):
        torch.manual_seed(8)
        net = Net()
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=m, nesterov=nesterov,
                              weight_decay=wd)
        comp = hvdsparse.TopK(ratio, exact=True, warmup=None if warm is None else
                              hvdsparse.ExponentialWarmup(warm[0], stages=warm[1]))
        state = hvdsparse.ddp.State(comp, net.named_parameters(), optimizer=opt,
                                    momentum_correction=True, clip_grad_norm=clip,
                                    momentum_masking=True)
        model.register_comm_hook(state, hvdsparse.ddp.hook)
        replay = DGCReplay(dict(net.named_parameters()), P, lr=lr, m=m, wd=wd,
                           nesterov=nesterov, clip=clip, ratio=ratio, warmup=warm)
        for step in range(5):
            x, y = batch(step)
            plain = copy.deepcopy(net)
            F.cross_entropy(plain(x), y).backward()
            raw = {n: q.grad.detach().clone() for n, q in plain.named_parameters()}
            everyone = [None] * P
            dist.all_gather_object(everyone, raw)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()

            replay.step(everyone)
            W = replay.W
            for n, q in net.named_parameters():
                check(torch.allclose(q.detach(), W[n], rtol=1e-5, atol=1e-6),
                      f"momentum nesterov={nesterov} clip={clip} step {step}: {n} differs "
                      f"from the DGC replay by {float((q.detach() - W[n]).abs().max()):.3g}")
            identical_across_ranks(model, "momentum correction")
        g0 = opt.param_groups[0]
        check(g0["momentum"] == m and g0["weight_decay"] == wd and g0["nesterov"] == nesterov,
              f"param_groups changed: {g0}")


# ------------------------------------------------------------------ 9. non-finite
def check_nonfinite():
    """A NaN in rank P-1's gradient: every rank raises FloatingPointError naming the
    layer and the rank (no hang, nothing absorbed)."""
    model, state = hooked(hvdsparse.TopK(0.05, min_numel=256), seed=9)
    x, y = batch(0)
    if R == P - 1:
        x = x.clone()
        x[0, 0] = float("nan")
    try:
        F.cross_entropy(model(x), y).backward()
    except Exception as e:     # noqa: BLE001 - DDP may wrap it
        msg = str(e)
        check("non-finite" in msg and f"rank {P - 1}" in msg, f"unexpected error: {msg[:300]}")
    else:
        raise AssertionError(f"rank {R}: NaN gradient not reported")


# ------------------------------------------------------------------ 10. balanced feedback
def check_balanced_feedback():
    """exchange="balanced" in the hook: what a rank sent and the owners did not deliver
    is back in that rank's residual, policy-dense layers included (Ok-Topk's feedback):
    residual_after = (residual_before + grad - sent) + sent * [not delivered], replayed
    here from the payloads the compressor produced (captured, not recomputed)."""
    comp = hvdsparse.TopK(0.05, min_numel=256)
    model, state = hooked(comp, seed=10, exchange="balanced")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    names = dict(model.named_parameters())
    seen, compress = {}, comp.compress

    def capture(name, grad, *a, **k):
        pl = compress(name, grad, *a, **k)
        seen[name] = (grad.detach().reshape(-1).float().clone(), pl)
        return pl
    comp.compress = capture
    # TopK's bucket path (compressors/topk_bucket.py) compresses without compress():
    # capture what it returned too
    from hvdsparse.compressors import topk_bucket as TB
    bucket_compress = TB.compress_bucket

    bucketed = set()

    def capture_bucket(c, items, *a, **k):
        pays, batch = bucket_compress(c, items, *a, **k)
        bucketed.update(it.name for it in items)
        for it in items:
            seen[it.name] = (it.grad.detach().reshape(-1).float().clone(), pays[it.name])
        return pays, batch
    TB.compress_bucket = capture_bucket
    fed = 0
    for step in range(4):
        before = {n: None if comp.residual(n) is None else comp.residual(n).clone()
                  for n in names}
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        check(state.last_stats["strategies"] == ["balanced"] * len(state.last_stats["strategies"]),
              f"strategies {state.last_stats['strategies']}")
        for n, p in names.items():
            grad, pl = seen[n]
            sent = hvdsparse.codec.payload_to_dense(pl).reshape(-1).float()
            r0 = torch.zeros_like(sent) if before[n] is None else before[n]
            pure = (r0 + grad) - sent
            back = torch.where(p.grad.detach().reshape(-1) != 0, torch.zeros(()), sent)
            want = torch.where(back != 0, pure + back, pure)
            got = comp.residual(n)
            got = torch.zeros_like(sent) if got is None else got
            fed += int((back != 0).sum())
            check(torch.equal(got, want), f"balanced step {step} {n}: residual is not "
                  f"(r + g - sent) + undelivered (max diff {float((got - want).abs().max())})")
        opt.step()
        identical_across_ranks(model, f"balanced step {step}")
    TB.compress_bucket = bucket_compress
    if hvdsparse.native.available():
        check(bool(bucketed), "balanced: TopK's bucket path never ran in the DDP hook")
    total = torch.tensor([fed])
    dist.all_reduce(total)
    check(int(total) > 0, "balanced: nothing was truncated, the check saw no add-back")


# ------------------------------------------------------------------ 11. mixed precision
def check_grad_scaler():
    """torch.amp.GradScaler through the hook (``grad_scaler=``), PyTorch's usual loop
    (``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``), for SGD with
    momentum and weight decay (DGC momentum correction on by the default rule; the
    biases are below min_numel, so the dense-layer momentum runs too) and for Adam (the recipe,
    warm-up 3 so its compressed phase runs). Run A uses the scaler, and at step ``BAD``
    rank P-1's gradient of fc1.weight overflows (an Inf injected during backward); run
    B has no scaler and never sees step ``BAD``. After every step A's parameters and
    residuals equal B's bitwise (residuals in unscaled units; the overflow step was
    rolled back), replicas are identical, and the scaler backed off on every rank.
    Then ``nonfinite="propagate"`` without a scaler: a NaN on rank P-1 reaches every
    rank's gradient of that layer (element 0) and no residual."""
    BAD, STEPS = 3, 7
    for kind in ("sgd", "adam"):
        def build(scaler):
            torch.manual_seed(11)
            net = Net()
            model = DDP(net, **SMALL)
            opt = make_opt(model, kind) if kind == "adam" else torch.optim.SGD(
                model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
            comp = hvdsparse.TopK(0.05, exact=True, min_numel=256)
            kw = dict(adam_warmup=3) if kind == "adam" else {}
            state = hvdsparse.ddp.State(comp, net.named_parameters(), optimizer=opt,
                                        grad_scaler=scaler, **kw)
            model.register_comm_hook(state, hvdsparse.ddp.hook)
            return net, model, opt, comp, state
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
        nA, mA, oA, cA, sA = build(scaler)
        nB, mB, oB, cB, sB = build(None)
        check(kind == "adam" or sA.local_update is not None, "momentum correction is off")
        names = [n for n, _ in nA.named_parameters()]
        for step in range(STEPS):
            x, y = batch(step)
            before = [p.detach().clone() for p in nA.parameters()]
            scale_before = scaler.get_scale()
            oA.zero_grad(set_to_none=True)
            handle = None
            if step == BAD and R == P - 1:
                handle = nA.fc1.weight.register_hook(lambda g: g * float("inf"))
            scaler.scale(F.cross_entropy(mA(x), y)).backward()
            if handle is not None:
                handle.remove()
            scaler.step(oA)
            scaler.update()
            if step == BAD:
                check(scaler.get_scale() == scale_before / 2,
                      f"{kind}: the scaler did not back off on rank {R}")
                check(all(torch.equal(a, b) for a, b in zip(before, nA.parameters())),
                      f"{kind}: the overflow step changed parameters")
                check(sA.skipped_steps == 1 and sA.last_stats["skipped"] is True,
                      f"{kind}: the overflow step was not rolled back "
                      f"({sA.skipped_steps}, {sA.last_stats.get('skipped')})")
            else:
                oB.zero_grad(set_to_none=True)
                F.cross_entropy(mB(x), y).backward()
                oB.step()
                for (n, pa), pb in zip(nA.named_parameters(), nB.parameters()):
                    check(torch.equal(pa, pb), f"{kind} step {step}: {n} differs from the "
                          f"run without scaler and overflow step (max "
                          f"{float((pa - pb).abs().max()):.3g})")
                for n in names:
                    ra, rb = cA.residual(n), cB.residual(n)
                    check((ra is None) == (rb is None), f"{kind} step {step}: residual of {n}")
                    if ra is not None:
                        check(bool(torch.isfinite(ra).all()) and torch.equal(ra, rb),
                              f"{kind} step {step}: residual of {n} differs from the "
                              f"reference (units or rollback)")
            identical_across_ranks(mA, f"grad_scaler {kind} step {step}")
        check(scaler.get_scale() == 2.0 ** 9, f"{kind}: scale {scaler.get_scale()}")

    comp = hvdsparse.TopK(0.05, min_numel=256)
    model, state = hooked(comp, seed=12, nonfinite="propagate")
    names = dict(model.module.named_parameters())
    handle = None
    if R == P - 1:
        handle = model.module.fc2.weight.register_hook(
            lambda g: g.index_put((torch.tensor([3]), torch.tensor([5])),
                                  torch.tensor(float("nan"))))
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    if handle is not None:
        handle.remove()
    for n, p in names.items():
        g = p.grad.reshape(-1)
        if n == "fc2.weight":
            check(bool(g[0].isnan()) and bool(torch.isfinite(g[1:]).all()),
                  "propagate: fc2.weight's gradient should hold one NaN, at element 0")
        else:
            check(bool(torch.isfinite(g).all()), f"propagate: {n} is not finite")
        r = comp.residual(n)
        check(r is None or bool(torch.isfinite(r).all()), f"propagate: residual of {n}")


CHECKS = [check_transport, check_equivalence, check_every_compressor, check_no_sync, check_unused,
          check_checkpoint, check_join, check_momentum_correction, check_nonfinite,
          check_disagreement, check_balanced_feedback, check_grad_scaler]

if __name__ == "__main__":
    only = sys.argv[1:]
    for fn in CHECKS:
        if only and fn.__name__ not in only:
            continue
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        if R == 0:
            print(f"passed {fn.__name__} ({time.perf_counter() - t0:.1f} s)", flush=True)
    finish(R)
