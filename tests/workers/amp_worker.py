"""Mixed precision with hvdsparse under real horovodrun: torch.amp.GradScaler (CPU).

Two replicas of the same model train side by side on every rank:
* A: the README's AMP recipe -- ``grad_scaler=scaler``, ``scaler.scale(loss).backward()``,
  ``synchronize()``, ``scaler.unscale_``, ``scaler.step`` inside ``skip_synchronize()``,
  ``scaler.update()``; at step ``BAD`` rank 1's gradient of ``fc1.weight`` overflows (an
  Inf injected by a tensor hook, i.e. during backward, before hvdsparse compresses it);
* B: no scaler, and step ``BAD`` never happens (the reference run that GradScaler's skip
  should be equivalent to).

Runs: TopK(0.3) (momentum correction off by the default rule: denser than 0.25), TopK(0.05)
(on: the velocity and the dense layers' momentum buffers must live in unscaled units
too; SGD has weight decay, which a buffer in scaled units would divide by the loss
scale), Slim-DP with a fixed ``c`` (its core choice must see the unscaled gradient) and
the three local-gradient modes (``partial`` / ``error`` combine with the own payload /
the residual, which are in unscaled units), the split / balanced exchanges, and
``backward_passes_per_step=2`` (two scaled micro-batches accumulated, compressed once).

Checked after every step, independently of the code under test: A's and B's
parameters and residuals are bitwise equal (residuals in unscaled units whatever the
loss scale; the overflow step left residuals untouched), residuals finite, replicas
identical across ranks, and the scaler halved its scale after the overflow.
Prints ``HVDSPARSE-OK rank=<r>``.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd
import hvdsparse

hvd.init()
R, P = hvd.rank(), hvd.size()
torch.set_num_threads(1)
BAD = 3
STEPS = 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(24, 64)
        self.fc2 = nn.Linear(64, 32)
        self.fc3 = nn.Linear(32, 3)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def build(scaler, make_comp, **kw):
    torch.manual_seed(1234)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    comp = make_comp()
    return model, comp, hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), compression=comp,
        fusion_threshold=4096, grad_scaler=scaler, **kw)


def check(cond, msg):
    if not cond:
        raise AssertionError(f"rank {R}: {msg}")


def replicas_identical(model, tag):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).view(1, -1)
    allp = hvd.allgather(flat, name=f"amp.same.{tag}")
    check(all(torch.equal(allp[0], allp[r]) for r in range(P)), f"replicas differ ({tag})")


def run(make_comp, tag, mc, steps=STEPS, **kw):
    """One A/B comparison; ``mc``: DGC momentum correction expected on (the default
    rule for SGD momentum 0.9)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    mA, cA, oA = build(scaler, make_comp, **kw)
    mB, cB, oB = build(None, make_comp, **kw)
    names = [n for n, _ in mA.named_parameters()]

    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + R)
        passes = kw.get("backward_passes_per_step", 1)
        xs = [torch.randn(16, 24, generator=gen) for _ in range(passes)]
        ys = [torch.randint(0, 3, (16,), generator=gen) for _ in range(passes)]

        # A: the AMP recipe
        before = [p.detach().clone() for p in mA.parameters()]
        scale_before = scaler.get_scale()
        oA.zero_grad()
        handle = None
        if step == BAD and R == 1:
            handle = mA.fc1.weight.register_hook(lambda g: g * float("inf"))
        for x, y in zip(xs, ys):        # micro-batches accumulate (scaled) in p.grad
            scaler.scale(F.cross_entropy(mA(x), y)).backward()
            if handle is not None:
                handle.remove()
                handle = None
        oA.synchronize()
        scaler.unscale_(oA)
        with oA.skip_synchronize():
            scaler.step(oA)
        scaler.update()

        if step == BAD:
            check(scaler.get_scale() == scale_before / 2, "scaler did not back off")
            check(all(torch.equal(a, b) for a, b in zip(before, mA.parameters())),
                  "the overflow step changed parameters")
        else:
            # B: plain hvdsparse, never sees step BAD
            oB.zero_grad()
            for x, y in zip(xs, ys):
                F.cross_entropy(mB(x), y).backward()
            oB.step()
            for (n, pa), pb in zip(mA.named_parameters(), mB.parameters()):
                check(torch.equal(pa, pb), f"{tag} step {step}: {n} differs from the reference run")
        if not kw.get("local_gradient"):      # local modes: replicas differ by design
            replicas_identical(mA, f"{tag}.{step}")
        if step > BAD:
            # residual of the skipped step was rolled back when step BAD+1 opened
            for n in names:
                ra, rb = cA.residual(n), cB.residual(n)
                if ra is None and rb is None:
                    continue
                check(ra is not None and rb is not None, f"{n}: residual missing")
                check(bool(torch.isfinite(ra).all()), f"{n}: non-finite residual")
                check(torch.equal(ra, rb), f"step {step}: residual of {n} differs from the "
                                            f"reference (units or rollback)")

    check((oA.scheduler.local_update is not None) == mc,
          f"{tag}: momentum correction {'off' if mc else 'on'}")


# TopK exact: the selection does not depend on the step seed (A's step counter is one
# ahead of B's after the skipped step)
run(lambda: hvdsparse.TopK(0.3, exact=True), "plain", mc=False)
run(lambda: hvdsparse.TopK(0.05, exact=True), "momentum-correction", mc=True)
# Slim-DP with a fixed c: its core (|w| + c |g|, re-chosen in after_exchange every 2
# steps) must see the unscaled gradient. Steps before the overflow only: Slim-DP's
# schedule is keyed by the step number, which a skipped step still uses up
run(lambda: hvdsparse.SlimDP(alpha=0.3, beta=0.15, core_period=2, c=1.0, min_numel=256),
    "slimdp", mc=False, steps=BAD)
# local-gradient modes combine the exchanged gradient with the local one, the own
# payload ("partial") or the residual ("error"): all in the same (unscaled) units
for mode in ("sum", "partial", "error"):
    run(lambda: hvdsparse.TopK(0.1, exact=True), f"local-{mode}", mc=False,
        local_gradient=mode, sync_period=3)
# split / balanced: owners reduce; balanced hands back what it did not deliver
for ex in ("split", "balanced"):
    run(lambda: hvdsparse.TopK(0.05, exact=True), f"exchange-{ex}", mc=True, exchange=ex)
# gradient accumulation: two scaled backward passes per step, compressed once
run(lambda: hvdsparse.TopK(0.05, exact=True), "accumulate-2", mc=True,
    backward_passes_per_step=2)
print(f"HVDSPARSE-OK rank={R}", flush=True)
