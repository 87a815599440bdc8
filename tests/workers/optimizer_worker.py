"""Multi-process checks of hvdsparse.DistributedOptimizer (run under real horovodrun).

Usage: horovodrun -np P ... python optimizer_worker.py [all|core]

Every check builds its expectation independently: raw gradients of every rank are
allgathered (hvd.allgather_object) and the compressor's selection (exact top-k with
error feedback, computed here with plain torch) is replayed for every rank.
Prints ``HVDSPARSE-OK rank=<r>`` at the end.
"""
from __future__ import annotations

import copy
import math
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd
import hvdsparse
from tests.workers.topk_oracle import topk_indices

hvd.init()
R, P = hvd.rank(), hvd.size()
MODE = sys.argv[1] if len(sys.argv) > 1 else "all"
torch.set_num_threads(1)


def check(cond, msg):
    if not cond:
        raise AssertionError(f"rank {R}: {msg}")


def say(msg):
    if R == 0:
        print(f"[check] {msg}", flush=True)


def gather(obj, tag):
    return hvd.allgather_object(obj, name=f"test.{tag}")


# ---------------------------------------------------------------------------- models
class Net(nn.Module):
    """fc1 / fc2 / aux weights are compressed (>= 1024 elements), fc3 and biases go
    dense by the compressor's policy; aux is used on rank 0 only (no grad elsewhere)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(40, 64)
        self.fc2 = nn.Linear(64, 32)
        self.fc3 = nn.Linear(32, 4)
        self.aux = nn.Linear(40, 32)

    def forward(self, x, use_aux=False):
        h = F.relu(self.fc1(x))
        h = F.relu(self.fc2(h))
        if use_aux:
            h = h + torch.tanh(self.aux(x))
        return self.fc3(h)


class Branchy(nn.Module):
    """Independent branches: the forward order decides the hook order in backward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 48)
        self.b = nn.Linear(32, 48)
        self.c = nn.Linear(32, 48)
        self.head = nn.Linear(48, 4)

    def forward(self, x, order):
        y = 0
        for n in order:
            y = y + torch.tanh(getattr(self, n)(x))
        return self.head(y)


def batch(step, rank, n=16, d=40, salt=0):
    g = torch.Generator().manual_seed(100003 * salt + 1009 * step + rank)
    return torch.randn(n, d, generator=g)


# ---------------------------------------------------------------------------- reference
class Reference:
    """Replays exact top-k with error feedback for every rank from raw gradients."""

    def __init__(self, comp, ratio, values="fp32"):
        self.comp, self.ratio, self.values = comp, ratio, values
        self.res = {}

    def selection(self, r, name, g):
        """(S, E) of rank r for layer name: sent vector and new residual."""
        flat = g.detach().float().reshape(-1)
        if self.comp.policy.is_dense(name, g.shape):
            return flat.clone(), None
        n = flat.numel()
        acc = self.res.get((r, name), torch.zeros(n)) + flat
        k = max(1, min(n, math.ceil(self.ratio * n - 1e-9)))
        idx = topk_indices(acc, k)
        idx = idx[acc[idx] != 0]
        S = torch.zeros(n)
        v = acc[idx]
        if self.values == "fp16":
            v = v.half().float()
        S[idx] = v
        E = acc - S
        self.res[(r, name)] = E
        return S, E

    def step(self, allraw, average=True):
        """Returns G[name] (averaged) and, for every rank, S and E per layer."""
        G, S_all, E_all = {}, {}, {}
        for name in allraw[0]:
            tot = torch.zeros(allraw[0][name].numel())
            for r in range(len(allraw)):
                S, E = self.selection(r, name, allraw[r][name])
                S_all[(r, name)], E_all[(r, name)] = S, E
                tot += S
            G[name] = (tot / len(allraw) if average else tot).view(allraw[0][name].shape)
        return G, S_all, E_all


def raw_grads(model):
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------- checks
def correctness(tag, strategy, ratio, values="fp32", steps=3, bits=0, bpps=1,
                fusion_threshold=3000, **extra):
    torch.manual_seed(0)
    model = Net()
    comp = hvdsparse.TopK(ratio, exact=True, values=values)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   compression=comp, exchange=strategy,
                                   fusion_threshold=fusion_threshold, split_dense_bits=bits,
                                   backward_passes_per_step=bpps, **extra)
    check(hasattr(opt, "scheduler"), "routing did not send a TopK call to hvdsparse")
    ref = Reference(comp, ratio, values)
    strategies = []
    for step in range(steps):
        opt.zero_grad()
        for rep in range(bpps):
            model(batch(step, R, salt=rep), use_aux=(R == 0)).pow(2).mean().backward()
        allraw = gather(raw_grads(model), f"{tag}.raw{step}")
        opt.synchronize()
        G, _, _ = ref.step(allraw, average=extra.get("op", hvd.Average) == hvd.Average)
        half = values == "fp16" or extra.get("dense_dtype") == "fp16"
        gmax = max(float(g.abs().max()) for g in G.values())
        for n, p in model.named_parameters():
            if bits:
                tol = 1.01 * gmax / (2 ** (bits - 1) - 1) + 1e-6
                err = float((p.grad - G[n]).abs().max())
                check(err <= tol, f"{tag} step {step} layer {n}: error {err} > {tol}")
            else:
                atol = 1e-3 * max(gmax, 1e-3) if half else 1e-6
                check(torch.allclose(p.grad, G[n], atol=atol, rtol=1e-3 if half else 1e-5),
                      f"{tag} step {step} layer {n}: max diff "
                      f"{float((p.grad - G[n]).abs().max())}")
        strategies.append(opt.stats()["last"]["strategies"])
        with opt.skip_synchronize():
            opt.step()
    everyone = gather((opt.scheduler.plan, strategies), f"{tag}.plan")
    check(all(e == everyone[0] for e in everyone), f"{tag}: ranks differ in buckets/strategies "
          f"{everyone}")
    if strategy != "auto":
        check(all(s == strategy for st in strategies for s in st), f"{tag}: {strategies}")
    check(len(opt.scheduler.plan) >= 2, f"{tag}: expected several buckets, got "
          f"{opt.scheduler.plan}")
    st = opt.stats()
    check(st["totals"]["steps"] == steps, f"{tag}: stats steps {st['totals']}")
    if strategy == "split":
        modes = [b["figures"]["range_modes"] for b in st["last"]["buckets"]]
        dense_ranges = sum(m["dense"] + m["quantised"] for m in modes)
        # TopK(0.45): the union of P selections is denser than SparCML's delta = N/2
        if ratio > 0.4:
            check(dense_ranges > 0, f"{tag}: range modes {modes}")
        if bits:
            check(sum(m["quantised"] for m in modes) > 0, f"{tag}: range modes {modes}")
    say(f"{tag}: P={P} {strategy} ratio={ratio} values={values} bits={bits} bpps={bpps} "
        f"ok; strategies {strategies[-1]}; last sent {st['last']['bytes_sent']} vs dense "
        f"{st['last']['dense_allreduce_bytes']}")
    opt.scheduler.remove_hooks()
    return opt


def hook_order_and_overlap():
    torch.manual_seed(3)
    model = Branchy()
    order = ["a", "b", "c"] if R == 0 else ["c", "b", "a"]
    named = list(model.named_parameters())
    if R == 1:
        named = named[::-1]      # perturb the named_parameters order too
    for ex, ft in (("auto", 0), ("allgather", 2500), ("split", 0)):
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=named,
                                       compression=hvdsparse.TopK(0.1, exact=True,
                                                                  compress_1d=True,
                                                                  min_numel=0),
                                       exchange=ex, fusion_threshold=ft)
        ready_orders, strategies, events = [], [], None
        for step in range(3):
            opt.zero_grad()
            x = batch(step, R, d=32, salt=7)
            model(x, order).pow(2).mean().backward()
            opt.step()
            ready_orders.append([e[1] for e in opt.scheduler.events if e[0] == "ready"])
            strategies.append(opt.stats()["last"]["strategies"])
            if step == 1:
                events = list(opt.scheduler.events)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        everyone = gather(dict(plan=opt.scheduler.plan, strategies=strategies,
                               ready=ready_orders, grads=grads), f"order.{ex}")
        for r, e in enumerate(everyone):
            check(e["plan"] == everyone[0]["plan"], f"{ex}: rank {r} plan {e['plan']} != rank 0 "
                  f"{everyone[0]['plan']}")
            check(e["strategies"] == everyone[0]["strategies"], f"{ex}: rank {r} strategies "
                  f"differ: {e['strategies']} vs {everyone[0]['strategies']}")
            for n in grads:
                check(torch.equal(e["grads"][n], everyone[0]["grads"][n]),
                      f"{ex}: averaged gradient of {n} differs on rank {r}")
        check(everyone[0]["ready"][1] != everyone[1]["ready"][1],
              f"{ex}: hook order was not perturbed: {everyone[0]['ready'][1]}")
        if ft == 0:
            check(len(opt.scheduler.plan) == len(named), f"{ex}: plan {opt.scheduler.plan}")
            # overlap: step 1's first launch happens before backward finishes
            first_launch = next(i for i, e in enumerate(events) if e[0] == "launch")
            done = events.index(("backward_done",))
            check(first_launch < done, f"{ex}: no overlap, events {events}")
            n_before = sum(1 for e in events[:done] if e[0] == "launch")
            check(n_before >= 1, f"{ex}: {events}")
        say(f"hook order perturbed ({ex}, ft={ft}): plans/strategies identical; "
            f"rank0 ready {everyone[0]['ready'][1][:3]}..., rank1 "
            f"{everyone[1]['ready'][1][:3]}...; events step1 {events[:6]}...")
        opt.scheduler.remove_hooks()


def equivalence_with_horovod():
    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(24, 64)
            self.l2 = nn.Linear(64, 5)

        def forward(self, x):
            return self.l2(torch.relu(self.l1(x)))

    makers = {
        "sgd+momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
    }
    for oname, make in makers.items():
        torch.manual_seed(11 + R)          # different init per rank: broadcast fixes it
        mA = Mlp()
        mB = copy.deepcopy(mA)
        hvd.broadcast_parameters(mA.state_dict(), root_rank=0)
        hvd.broadcast_parameters(mB.state_dict(), root_rank=0)
        # Adam: the gradient wire, whose 100 dense warm-up steps are Horovod's own Adam
        oA = hvd.DistributedOptimizer(make(mA.parameters()),
                                      named_parameters=mA.named_parameters(),
                                      compression=hvdsparse.TopK(1.0),
                                      **({} if oname.startswith("sgd") else
                                         dict(adam_wire="gradient")))
        oB = hvd.DistributedOptimizer(make(mB.parameters()),
                                      named_parameters=mB.named_parameters(),
                                      compression=hvd.Compression.none)
        check(hasattr(oA, "scheduler") and not hasattr(oB, "scheduler"),
              "routing: TopK must go to hvdsparse, Compression.none to Horovod")
        check(isinstance(oA, type(make([torch.zeros(1, requires_grad=True)]))),
              "hvdsparse optimizer is not a subclass of the wrapped class")
        hvd.broadcast_optimizer_state(oA, root_rank=0)
        hvd.broadcast_optimizer_state(oB, root_rank=0)
        for step in range(20):
            g = torch.Generator().manual_seed(step * 31 + R)
            x = torch.randn(32, 24, generator=g)
            y = torch.randint(0, 5, (32,), generator=g)
            for m, o in ((mA, oA), (mB, oB)):
                o.zero_grad()
                F.cross_entropy(m(x), y).backward()
                o.step()
        for (n, a), (_, b) in zip(mA.named_parameters(), mB.named_parameters()):
            check(torch.allclose(a, b, atol=1e-5, rtol=1e-4),
                  f"{oname}: {n} differs from plain Horovod by {float((a - b).abs().max())}")
        params = gather({n: p.detach().clone() for n, p in mA.named_parameters()}, f"eq.{oname}")
        for r in range(P):
            for n in params[0]:
                check(torch.equal(params[r][n], params[0][n]), f"{oname}: rank {r} {n} differs")
        say(f"TopK(1.0) == hvd.DistributedOptimizer over 20 steps with {oname}; strategies "
            f"{oA.stats()['last']['strategies']}")
        oA.scheduler.remove_hooks()
    # stock fp16 compression keeps working through the routing wrapper
    torch.manual_seed(5)
    m = Mlp()
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    o = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                 named_parameters=m.named_parameters(),
                                 compression=hvd.Compression.fp16)
    check(not hasattr(o, "scheduler") and type(o).__module__ == "horovod.torch.optimizer",
          "fp16 call must reach Horovod's own optimizer")
    for step in range(2):
        o.zero_grad()
        m(torch.randn(8, 24)).pow(2).mean().backward()
        o.step()
    say("hvd.Compression.fp16 passes through the routing to Horovod")


def user_line():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    teacher = torch.nn.Linear(100, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                         compression=hvdsparse.TopK(0.01))
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    check(hasattr(optimizer, "scheduler"), "user line did not reach hvdsparse")
    losses = []
    for step in range(60):
        g = torch.Generator().manual_seed(step * 7 + R)
        x = torch.randn(64, 100, generator=g)
        with torch.no_grad():
            y = teacher(x).argmax(1)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    st = optimizer.stats()["totals"]
    ratio = st["bytes_sent_total"] / st["dense_allreduce_bytes"]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    check(last < 0.8 * first, f"user line: loss did not fall ({first:.3f} -> {last:.3f})")
    check(0 < ratio < 0.1, f"user line: sent {st['bytes_sent_total']} bytes vs dense "
          f"{st['dense_allreduce_bytes']} (ratio {ratio:.3f})")
    params = gather([p.detach().clone() for p in model.parameters()], "user.params")
    check(all(torch.equal(a, b) for a, b in zip(params[0], params[-1])),
          "user line: parameters differ across ranks")
    say(f"user line: loss {first:.3f} -> {last:.3f}; bytes sent {st['bytes_sent_total']} vs "
        f"dense allreduce {st['dense_allreduce_bytes']} ({100 * ratio:.2f}%), "
        f"strategies {st['strategy_counts']}")
    optimizer.scheduler.remove_hooks()


def local_modes():
    for mode in ("sum", "partial", "error"):
        torch.manual_seed(2)
        model = Net()
        comp = hvdsparse.TopK(0.1, exact=True)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(),
                                       compression=comp, exchange="allgather",
                                       local_gradient=mode, sync_period=3)
        ref = Reference(comp, 0.1)
        history = []
        for step in range(6):
            opt.zero_grad()
            model(batch(step, R, salt=5)).pow(2).mean().backward()
            if step == 0:
                allraw = gather(raw_grads(model), f"local.{mode}.raw")
                L = raw_grads(model)
                opt.synchronize()
                G, S, E = ref.step(allraw)
                for n, p in model.named_parameters():
                    s = 1.0 / P
                    Sn = S[(R, n)].view(p.shape)
                    En = E[(R, n)]
                    if mode == "sum":
                        C = (G[n] + L[n]) / 2
                    elif mode == "partial":
                        C = G[n] + s * (L[n] - Sn)
                    else:
                        C = G[n] + (s * En.view(p.shape) if En is not None else 0)
                    check(torch.allclose(p.grad, C, atol=1e-6, rtol=1e-5),
                          f"local {mode}: {n} combined gradient off by "
                          f"{float((p.grad - C).abs().max())}")
                    if mode == "error" and comp.residual(n) is not None:
                        check(float(comp.residual(n).abs().max()) == 0.0,
                              f"local error: residual of {n} not cleared")
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            params = gather([p.detach().clone() for p in model.parameters()],
                            f"local.{mode}.{step}")
            same = all(torch.equal(a, b) for r in range(P) for a, b in zip(params[0], params[r]))
            history.append(same)
        # steps done 1..6: synced after 3 and 6
        check(history == [False, False, True, False, False, True],
              f"local {mode}: identical-after-step pattern {history}")
        check(("param_sync", 6) in opt.scheduler.events, f"local {mode}: {opt.scheduler.events}")
        say(f"local_gradient={mode!r}: combined gradient matches; params identical after "
            f"steps {[i + 1 for i, s in enumerate(history) if s]} only (sync_period=3)")
        opt.scheduler.remove_hooks()


def local_with_warmup():
    """partial + drop-ratio warm-up (RtWarmup): capacities shrink step by step (equal on
    all ranks), so the allgathered message shrinks; syncs still make params identical."""
    torch.manual_seed(2)
    model = Net()
    comp = hvdsparse.TopK(0.05, exact=True, warmup=hvdsparse.RtWarmup(4))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   compression=comp, exchange="allgather",
                                   local_gradient="partial", sync_period=5)
    sent = []
    for step in range(5):
        opt.zero_grad()
        model(batch(step, R, salt=9)).pow(2).mean().backward()
        opt.step()
        sent.append(opt.stats()["last"]["bytes_sent_total"])
    check(all(a >= b for a, b in zip(sent, sent[1:])) and sent[0] > sent[-1],
          f"warm-up: bytes per step should shrink, got {sent}")
    params = gather([p.detach().clone() for p in model.parameters()], "local.warmup")
    check(all(torch.equal(a, b) for r in range(P) for a, b in zip(params[0], params[r])),
          "warm-up: params differ right after the sync")
    say(f"local partial + RtWarmup(4): bytes per step {sent}; identical after sync")
    opt.scheduler.remove_hooks()


def expect_error(exc_type, fragment, fn):
    try:
        fn()
    except exc_type as e:
        check(fragment in str(e), f"error message {str(e)!r} lacks {fragment!r}")
        return str(e)
    raise AssertionError(f"rank {R}: expected {exc_type.__name__} containing {fragment!r}")


def misuse():
    m = Net()
    named = list(m.named_parameters())
    sgd = lambda: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    DO = hvd.DistributedOptimizer
    expect_error(ValueError, "exchange must be one of",
                 lambda: DO(sgd(), named_parameters=named, compression=hvdsparse.TopK(0.1),
                            exchange="ring"))
    expect_error(TypeError, "compression must be an hvdsparse compressor",
                 lambda: hvdsparse.DistributedOptimizer(sgd(), named_parameters=named,
                                                        compression=hvd.Compression.fp16))
    expect_error(TypeError, "write TopK(...)",
                 lambda: DO(sgd(), named_parameters=named, compression=hvdsparse.TopK))
    expect_error(ValueError, "local_gradient must be None or one of",
                 lambda: DO(sgd(), named_parameters=named, compression=hvdsparse.TopK(0.1),
                            local_gradient="mean"))
    expect_error(ValueError, "sync_period", lambda: DO(
        sgd(), named_parameters=named, compression=hvdsparse.TopK(0.1), sync_period=0))
    expect_error(ValueError, "split_dense_bits", lambda: DO(
        sgd(), named_parameters=named, compression=hvdsparse.TopK(0.1), split_dense_bits=3))
    expect_error(ValueError, "Adasum", lambda: DO(
        sgd(), named_parameters=named, compression=hvdsparse.TopK(0.1), op=hvd.Adasum))
    # Horovod's own messages for the shared options, compared with Horovod's
    orig = hvdsparse.horovod_original()
    dup = [("w", p) for _, p in named]
    for bad, exc in ((dup, ValueError), ([p for _, p in named], ValueError),
                     (named[:2], ValueError)):
        ours = expect_error(exc, "", lambda: DO(sgd(), named_parameters=bad,
                                                compression=hvdsparse.TopK(0.1)))
        theirs = expect_error(exc, "", lambda: orig(sgd(), named_parameters=bad))
        check(ours.split("Python object ids")[0] == theirs.split("Python object ids")[0],
              f"message differs from Horovod: {ours!r} vs {theirs!r}")
    expect_error(ValueError, "gradient_predivide_factor not supported with op != Average",
                 lambda: DO(sgd(), named_parameters=named, compression=hvdsparse.TopK(0.1),
                            op=hvd.Sum, gradient_predivide_factor=2.0))
    expect_error(ValueError, "backward_passes_per_step must be > 0",
                 lambda: DO(sgd(), named_parameters=named, compression=hvdsparse.TopK(0.1),
                            backward_passes_per_step=0))
    # zero_grad between backward and step, as Horovod
    torch.manual_seed(0)
    m2 = Net()
    o = DO(torch.optim.SGD(m2.parameters(), lr=0.1), named_parameters=m2.named_parameters(),
           compression=hvdsparse.TopK(0.1))
    m2(batch(0, R)).sum().backward()
    expect_error(AssertionError, "zero_grad() was called after loss.backward()",
                 lambda: o.zero_grad())
    o.step()
    # more backward passes than backward_passes_per_step
    o.zero_grad()
    m2(batch(1, R)).sum().backward()
    expect_error(Exception, "backward_passes_per_step", lambda: m2(batch(2, R)).sum().backward())
    o.synchronize()
    o.scheduler.remove_hooks()
    # ranks disagree on the model: the same clear error on every rank, no hang
    torch.manual_seed(0)
    m3 = Net()
    if R == 1:
        m3.extra = nn.Linear(3, 3)
    o3 = DO(torch.optim.SGD(m3.parameters(), lr=0.1), named_parameters=m3.named_parameters(),
            compression=hvdsparse.TopK(0.1))
    out = m3(batch(0, R))
    if R == 1:
        out = out + m3.extra(torch.ones(1, 3)).sum()
    out.sum().backward()
    expect_error(ValueError, "rank 1", lambda: o3.synchronize())
    o3.scheduler.remove_hooks()
    # ranks disagree on the wire's index narrowing (HVDSPARSE_NARROW_INDICES on one rank)
    from hvdsparse import payload as _payload
    _payload.NARROW_INDICES = R != 1
    try:
        torch.manual_seed(0)
        m4 = Net()
        o4 = DO(torch.optim.SGD(m4.parameters(), lr=0.1),
                named_parameters=m4.named_parameters(), compression=hvdsparse.TopK(0.1))
        m4(batch(0, R)).sum().backward()
        expect_error(ValueError, "HVDSPARSE_NARROW_INDICES", lambda: o4.synchronize())
        o4.scheduler.remove_hooks()
    finally:
        _payload.NARROW_INDICES = True
    say("misuse errors: exchange / compression type / class / local_gradient / sync_period / "
        "split_dense_bits / Adasum / Horovod's named_parameters + predivide + bpps messages / "
        "zero_grad race / too many backward passes / rank mismatch / index narrowing")


def main():
    warnings.simplefilter("ignore")
    if MODE == "user":
        user_line()
        hvd.barrier()
        print(f"HVDSPARSE-OK rank={R}", flush=True)
        return
    for strategy in ("allgather", "split", "dense", "auto"):
        correctness(f"{strategy}", strategy, 0.1)
    correctness("split-dense-ranges", "split", 0.45)
    correctness("split-q8", "split", 0.45, bits=8)
    correctness("allgather-fp16", "allgather", 0.1, values="fp16")
    correctness("split-fp16", "split", 0.1, values="fp16")
    correctness("allgather-bpps2", "allgather", 0.1, bpps=2)
    correctness("dense-fp16-predivide", "dense", 0.1, dense_dtype="fp16",
                gradient_predivide_factor=2.0)
    correctness("allgather-op-sum", "allgather", 0.1, op=hvd.Sum)
    correctness("auto-one-bucket-per-layer", "auto", 0.2, fusion_threshold=0)
    hook_order_and_overlap()
    local_modes()
    local_with_warmup()
    if MODE == "all":
        equivalence_with_horovod()
        user_line()
        misuse()
    hvd.barrier()
    print(f"HVDSPARSE-OK rank={R}", flush=True)


if __name__ == "__main__":
    main()
