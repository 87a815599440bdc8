"""The Adam recipe in hvdsparse's DDP communication hook under real torchrun (run at P=2):
``State(..., optimizer=adam)`` turns it on by default. Against an independent plain-torch
replay of the recipe (tests/workers/adam_replay.py) from every rank's raw local gradient,
for Adam with L2 decay + TopK(0.05, exact), AdamW + AdaComp with adam_refresh=2 (the
local variance refresh), AdamW + TopK(0.05, exact) with adam_wire="update" and AdamW +
AdaComp at the default warm-up under a rising, then falling rate; parameters bitwise
identical across ranks; a checkpoint (model, optimizer, hook state) resumes bitwise
identically. Prints ``HVDSPARSE-OK rank=<r>``.
"""
import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hvdsparse
import hvdsparse.ddp
from hvdsparse.compressors.topk import UPDATE_WIRE_FRESH_WEIGHT, UPDATE_WIRE_VALUES
from tests.workers.adam_replay import AdamReplay, adacomp, out_layer, topk_exact
from tests.workers.torchrun_exit import finish

dist.init_process_group("gloo")
R, P = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(1)


def check(cond, msg):
    if not cond:
        raise AssertionError(f"rank {R}: {msg}")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(24, 64)     # 1536 weights: compressed
        self.fc2 = nn.Linear(64, 40)     # 2560 weights: compressed
        self.fc3 = nn.Linear(40, 5)      # dense by policy

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + R)
    return torch.randn(12, 24, generator=g), torch.randint(0, 5, (12,), generator=g)


def build(cls, comp, wd, seed=4, refresh=None, wire=None, warmup=2):
    torch.manual_seed(seed)
    net = Net()
    model = DDP(net, bucket_cap_mb=0.01)
    opt = cls(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=wd)
    # the refresh windows start right after the 2-step warm-up (adam_refresh_start=2)
    state = hvdsparse.ddp.State(comp, net.named_parameters(), optimizer=opt, adam_warmup=warmup,
                                adam_refresh=refresh,
                                adam_refresh_start=None if refresh is None else 2,
                                adam_wire=wire)
    model.register_comm_hook(state, hvdsparse.ddp.hook)
    return net, model, opt, state


def step_once(net, model, opt, step, replay=None):
    x, y = batch(step)
    everyone = None
    if replay is not None:
        plain = copy.deepcopy(net)
        F.cross_entropy(plain(x), y).backward()
        raw = {n: q.grad.detach().clone() for n, q in plain.named_parameters()}
        everyone = [None] * P
        dist.all_gather_object(everyone, raw)
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    if replay is not None:
        replay.step(everyone)
        for n, q in net.named_parameters():
            check(torch.allclose(q.detach(), replay.W[n], rtol=1e-5, atol=1e-6),
                  f"step {step}: {n} differs from the replay by "
                  f"{float((q.detach() - replay.W[n]).abs().max()):.3g}")
    flat = torch.cat([q.detach().reshape(-1) for q in net.parameters()])
    out = [torch.empty_like(flat) for _ in range(P)]
    dist.all_gather(out, flat)
    check(all(torch.equal(out[0], o) for o in out), f"step {step}: replicas differ")


for cls, comp, sel, dw, wd, R_, wire in (
        (torch.optim.Adam, hvdsparse.TopK(0.05, exact=True), "topk", False, 1e-2, None,
         "gradient"),
        (torch.optim.AdamW, hvdsparse.AdaComp(), adacomp(), True, 1e-2, 2, "gradient"),
        (torch.optim.AdamW, hvdsparse.TopK(0.05, exact=True), "topk", False, 1e-2, None,
         "update")):
    net, model, opt, state = build(cls, comp, wd, refresh=R_, wire=wire)
    if sel == "topk":
        # TopK's fresh_weight and values defaults on the update wire
        up = wire == "update"
        sel = topk_exact(0.05, output=out_layer(net),
                         fresh=UPDATE_WIRE_FRESH_WEIGHT if up else 0.0,
                         values=UPDATE_WIRE_VALUES if up else "fp32")
    check(type(state.local_update).__name__ == "AdamRecipe", "recipe not on by default")
    check(state.local_update.wire == wire, f"wire {state.local_update.wire!r}, asked {wire!r}")
    rep = AdamReplay(dict(net.named_parameters()), P, lr=3e-3, betas=(0.9, 0.99), eps=1e-8,
                     wd=wd, decoupled=cls is torch.optim.AdamW, warmup=2, select=sel,
                     needs_dw=dw, refresh=R_, refresh_from="local", wire=wire,
                     whole=UPDATE_WIRE_VALUES if wire == "update" else None)  # TopK's biases
    for step in range(6):
        step_once(net, model, opt, step, rep)

# the default wire of a model without recurrent layers: the update wire
check(build(torch.optim.AdamW, hvdsparse.TopK(0.05), 0.0)[3].local_update.wire == "update",
      "the DDP door's default wire is not the update wire")

# AdaComp at the default warm-up under a schedule whose rate rises at steps 1 and 2: dense,
# exact Adam through step 2, compressed from step 3 on, a later rise included (as through
# Horovod's door: adam_dense_while_rate_rises)
net, model, opt, state = build(torch.optim.AdamW, hvdsparse.AdaComp(), 1e-2, wire="update",
                               warmup=None)
check(state.local_update.while_rate_rises, "AdaComp's warm-up does not last while the rate "
      "rises")
rep = AdamReplay(dict(net.named_parameters()), P, lr=1e-3, betas=(0.9, 0.99), eps=1e-8,
                 wd=1e-2, decoupled=True, warmup=3, select=adacomp(), needs_dw=True,
                 wire="update")
for step, lr in enumerate([1e-3, 2e-3, 3e-3, 3e-3, 2e-3, 2.5e-3, 1e-3]):
    for g in opt.param_groups:
        g["lr"] = lr
    rep.lr = lr
    step_once(net, model, opt, step, rep)

# checkpoint / resume (with refreshes at steps 3 and 5: the resumed run starts on one)
net, model, opt, state = build(torch.optim.AdamW, hvdsparse.TopK(0.05), 0.0, refresh=2,
                               wire="gradient")
for step in range(3):
    step_once(net, model, opt, step)
saved = copy.deepcopy((net.state_dict(), opt.state_dict(), state.state_dict()))
for step in range(3, 6):
    step_once(net, model, opt, step)
net2, model2, opt2, state2 = build(torch.optim.AdamW, hvdsparse.TopK(0.05), 0.0, seed=9,
                                   refresh=2, wire="gradient")
net2.load_state_dict(saved[0])
opt2.load_state_dict(saved[1])
state2.load_state_dict(saved[2])
for step in range(3, 6):
    step_once(net2, model2, opt2, step)
for (n, a), b in zip(net.named_parameters(), net2.parameters()):
    check(torch.equal(a, b), f"resume: {n} differs from the uninterrupted run")
finish(R)
