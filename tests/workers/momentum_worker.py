"""DGC momentum correction + masking + local clipping through hvdsparse under real
horovodrun, against an independent plain-torch replay of DGC's update rule.

Every step each rank's raw local gradients are allgathered; the replay then runs, in
plain torch and for every rank, DGC's rule (Lin et al. 2018): g <- clip(g, c/sqrt(P));
g <- g + wd*w; u <- m*u + g (nesterov: u <- m*u + g, x = g + m*u); v <- v + x; send the
exact top-k of |v|; v[S] = 0; u[S] = 0; G = (sum of sent) / P; w <- w - lr*G. Layers
the compressor sends dense (size < min_numel) are clipped too and keep ordinary SGD
momentum on G. With a density warm-up a layer's velocity is not masked while the warm-up
holds it above its target and (1 - m) / 2. The
parameters must match the replay (and be bitwise identical across ranks) at every step.
Prints ``HVDSPARSE-OK rank=<r>``.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd
import hvdsparse
from tests.workers.dgc_replay import DGCReplay

hvd.init()
R, P = hvd.rank(), hvd.size()
torch.set_num_threads(1)


def check(cond, msg):
    if not cond:
        raise AssertionError(f"rank {R}: {msg}")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(40, 64)     # 2560 weights: compressed
        self.fc2 = nn.Linear(64, 32)     # 2048 weights: compressed
        self.fc3 = nn.Linear(32, 3)      # 96 weights: dense by policy

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def run(nesterov, clip, ratio=0.05, lr=0.1, m=0.9, wd=1e-3, steps=8, tag="", warmup=None,
        masking=True):
    torch.manual_seed(7)
    model = Net()
    replay = DGCReplay({n: p for n, p in model.named_parameters()}, P, lr=lr, m=m, wd=wd,
                       nesterov=nesterov, clip=clip, ratio=ratio, warmup=warmup,
                       masking=masking)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=m, nesterov=nesterov,
                          weight_decay=wd)
    comp = hvdsparse.TopK(ratio, exact=True, warmup=None if warmup is None else
                          hvdsparse.ExponentialWarmup(warmup[0], stages=warmup[1]))
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=comp, momentum_correction=True,
                                   momentum_masking=masking,
                                   clip_grad_norm=clip, fusion_threshold=2048)
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 * step + R)
        x = torch.randn(16, 40, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raw = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        everyone = hvd.allgather_object(raw, name=f"mc.{tag}.{step}")
        opt.step()
        replay.step(everyone)
        W = replay.W
        for n, p in model.named_parameters():
            err = (p.detach() - W[n]).abs().max().item()
            check(torch.allclose(p.detach(), W[n], rtol=1e-5, atol=1e-6),
                  f"{tag} step {step}: {n} differs from the DGC replay by {err:.3g}")
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).view(1, -1)
        allp = hvd.allgather(flat, name=f"mc.same.{tag}.{step}")
        check(all(torch.equal(allp[0], allp[r]) for r in range(P)), f"{tag}: replicas differ")
    # the user's hyper-parameters are untouched
    g0 = opt.param_groups[0]
    check(g0["momentum"] == m and g0["weight_decay"] == wd and g0["nesterov"] == nesterov,
          f"{tag}: param_groups changed: {g0}")


run(nesterov=False, clip=None, tag="plain")
run(nesterov=True, clip=None, tag="nesterov")
run(nesterov=False, clip=0.5, tag="clip")
# a 2-stage warm-up over 4 steps: fc1 at 0.368 / 0.136, the output layer fc2.weight at
# 0.464 / 0.215 (unmasked: above (1 - m) / 2 = 0.05), then 0.05 / 0.1 masked
run(nesterov=True, clip=None, tag="warmup", warmup=(4, 2))
run(nesterov=False, clip=None, tag="unmasked", masking=False)
print(f"HVDSPARSE-OK rank={R}", flush=True)
