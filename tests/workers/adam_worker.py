"""The Adam recipe through hvdsparse.DistributedOptimizer under real horovodrun (run at
P=3), against Horovod's own dense Adam and an independent plain-torch replay of the
recipe (tests/workers/adam_replay.py).

Checks, each at every step:
* TopK(1.0) (everything sent) with a warm-up longer than the run: equals Horovod's dense
  DistributedOptimizer with torch Adam within float tolerance; with warm-up 2: equals the
  replay (frozen variance, uncompressed momentum);
* TopK(0.05, exact) with Adam L2 decay, a layer used on rank 0 only (zero gradient
  elsewhere) and a NaN on rank 1 at one step under nonfinite="skip" (skipped on every
  rank, residuals rolled back); AdaComp() with AdamW: parameters bitwise identical
  across ranks and equal to the replay;
* adam_refresh=2 (every 2nd step after the warm-up sends each rank's local average of
  g_i^2 dense and defers its gradient to the next step): equals the replay; so does
  adam_refresh=3 with the default start (3 x the warm-up: a long first window);
* adam_wire="update" (every rank's own moments and Adam step; TopK's biases and small
  layers sent whole in bf16), with Adam L2, a rank-0-only layer and a skipped NaN step,
  and with AdaComp + AdamW at the default wire of a model without recurrent layers:
  equals the replay;
* GradScaler: an overflow step on rank 1 is skipped by the scaler everywhere and rolled
  back; the run equals the replay without that step;
* checkpoint (the default, update wire: every rank saves and loads its own moments):
  optimizer.state_dict() + compression_state_dict() saved mid-run and loaded into a
  fresh model / optimizer continue bitwise identically;
* the front door's defaults (update wire; gradient wire for a model with an LSTM) and
  argument checks.
The cases that check the gradient wire's own features name adam_wire="gradient".
Prints ``HVDSPARSE-OK rank=<r>``.
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd
import hvdsparse
from hvdsparse.compressors.topk import UPDATE_WIRE_FRESH_WEIGHT, UPDATE_WIRE_VALUES
from tests.workers.adam_replay import AdamReplay, adacomp, out_layer, topk_exact

hvd.init()
R, P = hvd.rank(), hvd.size()
torch.set_num_threads(1)


def check(cond, msg):
    if not cond:
        raise AssertionError(f"rank {R}: {msg}")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(24, 64)     # 1536 weights: compressed
        self.side = nn.Linear(64, 25, bias=False)   # 1600: compressed, rank 0 only
        self.fc2 = nn.Linear(64, 40)     # 2560 weights: compressed
        self.fc3 = nn.Linear(40, 5)      # 200 weights: dense by policy

    def forward(self, x, side=False):
        h = torch.tanh(self.fc1(x))
        if side:
            h = h + 0.1 * self.side(h).sum(dim=1, keepdim=True)
        return self.fc3(torch.tanh(self.fc2(h)))


def batch(step):
    g = torch.Generator().manual_seed(1000 * step + R)
    return torch.randn(12, 24, generator=g), torch.randint(0, 5, (12,), generator=g)


def same_everywhere(model, tag):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).view(1, -1)
    allp = hvd.allgather(flat, name=f"adam.same.{tag}")
    check(all(torch.equal(allp[0], allp[r]) for r in range(P)), f"{tag}: replicas differ")


def train(opt, model, steps, *, side=False, nan_at=None, start=0, replay=None, tag="",
          lrs=None):
    for step in range(start, start + steps):
        if lrs is not None:                 # a schedule: this step's rate, everywhere
            for g in opt.param_groups:
                g["lr"] = lrs[step - start]
            if replay is not None:
                replay.lr = lrs[step - start]
        x, y = batch(step)
        if nan_at == step and R == 1:
            x[0, 0] = float("nan")          # non-finite gradients on rank 1 only
        opt.zero_grad()
        F.cross_entropy(model(x, side=side and R == 0), y).backward()
        if replay is not None:
            raw = {n: (p.grad.detach().clone() if p.grad is not None
                       else torch.zeros_like(p)) for n, p in model.named_parameters()}
            everyone = hvd.allgather_object(raw, name=f"adam.raw.{tag}.{step}")
        opt.step()
        if replay is not None and nan_at != step:
            replay.step(everyone)
            for n, p in model.named_parameters():
                err = (p.detach() - replay.W[n]).abs().max().item()
                check(torch.allclose(p.detach(), replay.W[n], rtol=1e-5, atol=1e-6),
                      f"{tag} step {step}: {n} differs from the replay by {err:.3g}")
        same_everywhere(model, f"{tag}.{step}")


def make(cls=torch.optim.Adam, comp=None, seed=3, **kw):
    torch.manual_seed(seed)
    model = Net()
    base = cls(model.parameters(), lr=kw.pop("lr", 3e-3), betas=(0.9, 0.99),
               weight_decay=kw.pop("weight_decay", 0.0))
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=comp, fusion_threshold=4096, **kw)
    return model, opt


def replay_for(model, select, *, warmup, wd=0.0, decoupled=False, needs_dw=False,
               refresh=None, refresh_start=None, wire="gradient", whole=None):
    return AdamReplay(dict(model.named_parameters()), P, lr=3e-3, betas=(0.9, 0.99),
                      eps=1e-8, wd=wd, decoupled=decoupled, warmup=warmup, select=select,
                      needs_dw=needs_dw, refresh=refresh, refresh_from="local",
                      refresh_start=refresh_start, wire=wire, whole=whole)


# 1. TopK(1.0): warm-up longer than the run = Horovod's dense Adam
model, opt = make(comp=hvdsparse.TopK(1.0), adam_warmup=50)
torch.manual_seed(3)
ref = Net()
ref.load_state_dict(model.state_dict())
ropt = hvdsparse.horovod_original()(torch.optim.Adam(ref.parameters(), lr=3e-3,
                                                     betas=(0.9, 0.99)),
                                    named_parameters=ref.named_parameters())
for step in range(4):
    for m, o in ((model, opt), (ref, ropt)):
        x, y = batch(step)
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        check(torch.allclose(a, b, rtol=1e-5, atol=1e-7),
              f"TopK(1.0) warm-up step {step}: {n} differs from Horovod dense Adam by "
              f"{(a - b).abs().max().item():.3g}")

# ... and with warm-up 2: the frozen-variance recipe on the uncompressed momentum
model, opt = make(comp=hvdsparse.TopK(1.0), adam_warmup=2, adam_wire="gradient")
train(opt, model, 4, replay=replay_for(model, topk_exact(1.0), warmup=2), tag="all")

# 2. TopK(0.05) + Adam L2 + a rank-0-only layer + a skipped NaN step; AdaComp + AdamW
model, opt = make(comp=hvdsparse.TopK(0.05, exact=True), adam_warmup=3, weight_decay=1e-2,
                  nonfinite="skip", adam_wire="gradient")
rep = replay_for(model, topk_exact(0.05, output=out_layer(model)), warmup=3, wd=1e-2)
train(opt, model, 8, side=True, nan_at=5, replay=rep, tag="topk")
check(opt.scheduler.skipped_steps == 1, "the NaN step was not skipped")
check(int(opt.state[model.fc1.weight]["step"]) == 7, "Adam step count after a skip")
st = opt.state[model.fc1.weight]
check(torch.allclose(st["exp_avg"], rep.m["fc1.weight"], rtol=1e-5, atol=1e-7) and
      torch.allclose(st["exp_avg_sq"], rep.v["fc1.weight"], rtol=1e-5, atol=1e-10),
      "Adam's state is not the recipe's m / frozen v")

model, opt = make(torch.optim.AdamW, comp=hvdsparse.AdaComp(), adam_warmup=2,
                  weight_decay=1e-2, adam_wire="gradient")
train(opt, model, 6, replay=replay_for(model, adacomp(), warmup=2, wd=1e-2, decoupled=True,
                                       needs_dw=True), tag="adacomp")

# 2c. adam_wire="update": every rank's own moments, its own Adam step sent with error
# feedback; Adam L2 + a rank-0-only layer + a skipped NaN step (Adam's state untouched by
# it), and AdaComp + AdamW at the default warm-up (one dense step)
model, opt = make(comp=hvdsparse.TopK(0.05, exact=True), adam_warmup=2, weight_decay=1e-2,
                  nonfinite="skip", adam_wire="update")
rep = replay_for(model, topk_exact(0.05, output=out_layer(model),   # the update wire's
                                  fresh=UPDATE_WIRE_FRESH_WEIGHT, values=UPDATE_WIRE_VALUES),
                 warmup=2, wd=1e-2, wire="update", whole=UPDATE_WIRE_VALUES)   # biases whole
train(opt, model, 7, side=True, nan_at=4, replay=rep, tag="update")
check(opt.scheduler.skipped_steps == 1, "update: the NaN step was not skipped")
st = opt.state[model.fc1.weight]
check(int(st["step"]) == 6, "update: Adam step count after a skip")
check(torch.allclose(st["exp_avg"], rep.mr[R]["fc1.weight"], rtol=1e-5, atol=1e-7) and
      torch.allclose(st["exp_avg_sq"], rep.vr[R]["fc1.weight"], rtol=1e-5, atol=1e-10),
      "update: Adam's state is not this rank's own m / v")
model, opt = make(torch.optim.AdamW, comp=hvdsparse.AdaComp(), weight_decay=1e-2)
check(opt._local_update.wire == "update" and opt._local_update.warmup == 1,
      "update: not the default wire of a model without recurrent layers, or its default "
      "warm-up is not one step")
train(opt, model, 5, replay=replay_for(model, adacomp(), warmup=1, wd=1e-2, decoupled=True,
                                       needs_dw=True, wire="update"), tag="update-w")
# ... and under a schedule whose rate rises at steps 1 and 2: AdaComp's default warm-up
# also lasts while the rate rises (adam_dense_while_rate_rises), so steps 0-2 are dense,
# exact Adam, and the compressed phase starts at step 3 (where the rate stops rising)
model, opt = make(torch.optim.AdamW, comp=hvdsparse.AdaComp(), weight_decay=1e-2)
check(opt._local_update.while_rate_rises, "update: AdaComp's warm-up does not last while "
      "the rate rises")
train(opt, model, 7, lrs=[1e-3, 2e-3, 3e-3, 3e-3, 2e-3, 2.5e-3, 1e-3],
      replay=replay_for(model, adacomp(), warmup=3, wd=1e-2, decoupled=True, needs_dw=True,
                        wire="update"), tag="update-rise")

# 2a. adam_refresh=2, adam_refresh_start=2: every 2nd step after the warm-up sends the
# ranks' local averages of g_i^2 dense and refreshes v from them (a dense exchange between
# compressed ones, the rank-0-only layer a zero gradient elsewhere); its gradient goes out
# with the next step
model, opt = make(comp=hvdsparse.TopK(0.05, exact=True), adam_warmup=2, adam_refresh=2,
                  adam_refresh_start=2, weight_decay=1e-2, adam_wire="gradient")
rep = replay_for(model, topk_exact(0.05, output=out_layer(model)), warmup=2, wd=1e-2,
                 refresh=2)
train(opt, model, 7, side=True, replay=rep, tag="refresh")
check(torch.allclose(opt.state[model.fc1.weight]["exp_avg_sq"], rep.v["fc1.weight"],
                     rtol=1e-5, atol=1e-10), "refresh: v differs from the replay's")
check(opt.compression_state_dict().get("adam_recipe", {}).get("refresh") == 2,
      "refresh: the period is not in compression_state_dict()")
# ... and with AdamW, where the local gradient the refresh step defers is p.grad itself
# until the exchange's result overwrites it; the default start (3 x the warm-up = 6): the
# first refresh is Adam step 9 (index 8) and stands for the 7 steps since the warm-up
model, opt = make(torch.optim.AdamW, comp=hvdsparse.AdaComp(), adam_warmup=2,
                  adam_refresh=3, weight_decay=1e-2, adam_wire="gradient")
check(opt._local_update.refresh_start == 6, "refresh-w: the default start is not 3 T_w")
train(opt, model, 9, replay=replay_for(model, adacomp(), warmup=2, wd=1e-2, decoupled=True,
                                       needs_dw=True, refresh=3, refresh_start=6),
      tag="refresh-w")
# exchange="auto" prices a refresh step as the dense step it is, not by the sparse
# steps' counts (cost_model: prev_capacity); index 11 (Adam step 12 = 6 + 2 x 3) refreshes
for step in (9, 10, 11):
    x, y = batch(step)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    strategies = opt.stats()["last"]["strategies"]
    check((set(strategies) == {"dense"}) == (step == 11),
          f"refresh-w step {step}: strategies {strategies}")

# 2b. GradScaler (the README's AMP recipe): an overflow on rank 1 at step 4 is skipped by
# the scaler on every rank and rolled back; the rest equals the replay
model, opt = make(torch.optim.AdamW, comp=hvdsparse.TopK(0.05, exact=True), adam_warmup=2,
                  weight_decay=1e-2, adam_wire="gradient", grad_scaler=torch.amp.GradScaler(
                      "cpu", init_scale=2.0 ** 8, growth_interval=1000))
scaler = opt.scheduler.grad_scaler
rep = replay_for(model, topk_exact(0.05, output=out_layer(model)), warmup=2, wd=1e-2,
                 decoupled=True)
for step in range(7):
    x, y = batch(step)
    opt.zero_grad()
    hook = model.fc1.weight.register_hook(lambda g: g * float("inf")) \
        if step == 4 and R == 1 else None
    scale = scaler.get_scale()
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    if hook is not None:
        hook.remove()
    raw = {n: (p.grad.detach() / scale if p.grad is not None else torch.zeros_like(p))
           for n, p in model.named_parameters()}
    everyone = hvd.allgather_object(raw, name=f"adam.amp.{step}")
    opt.synchronize()
    scaler.unscale_(opt)
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
    if step != 4:
        rep.step(everyone)
    for n, p in model.named_parameters():
        check(torch.allclose(p.detach(), rep.W[n], rtol=1e-5, atol=1e-6),
              f"amp step {step}: {n} differs from the replay by "
              f"{(p.detach() - rep.W[n]).abs().max().item():.3g}")
    same_everywhere(model, f"amp.{step}")
check(int(opt.state[model.fc1.weight]["step"]) == 6, "the overflow step was applied")

# 3. checkpoint / resume, exchange="auto": its strategies sum in different orders at
# P=3, so the cost model's figures must travel in compression_state_dict() too
model, opt = make(torch.optim.AdamW, comp=hvdsparse.TopK(0.05), adam_warmup=2,
                  exchange="auto")
train(opt, model, 3, tag="ck0")
saved = copy.deepcopy((model.state_dict(), opt.state_dict(), opt.compression_state_dict()))
train(opt, model, 1, start=3, tag="ck1")
figures_after_4 = opt.scheduler.engine.history_state()
train(opt, model, 2, start=4, tag="ck1")
model2, opt2 = make(torch.optim.AdamW, comp=hvdsparse.TopK(0.05), adam_warmup=2, seed=11,
                    exchange="auto")
model2.load_state_dict(saved[0])
opt2.load_state_dict(saved[1])
opt2.load_compression_state_dict(saved[2])
train(opt2, model2, 1, start=3, tag="ck2")
check(opt2.scheduler.engine.history_state() == figures_after_4 and figures_after_4,
      "resume: the auto cost model's figures differ from the uninterrupted run's")
train(opt2, model2, 2, start=4, tag="ck2")
for (n, a), b in zip(model.named_parameters(), model2.parameters()):
    check(torch.equal(a, b), f"resume: {n} differs from the uninterrupted run")

# 4. on by default for Adam; the front door's checks
model, opt = make(comp=hvdsparse.TopK(0.01))
lu = opt._local_update
check(type(lu).__name__ == "AdamRecipe" and lu.wire == "update" and lu.warmup == 1 and
      lu.refresh is None, "the recipe (update wire, one warm-up step) is not the default "
      "for Adam on a model without recurrent layers")
rnn = torch.nn.LSTM(4, 8)
lu = hvd.DistributedOptimizer(torch.optim.Adam(rnn.parameters()),
                              named_parameters=rnn.named_parameters(),
                              compression=hvdsparse.TopK(0.01))._local_update
check(lu.wire == "gradient" and lu.warmup == hvdsparse.adam.DEFAULT_WARMUP and
      (lu.refresh, lu.refresh_start) == (50, 300) and lu.refresh_from == "local",
      "the recipe (gradient wire, warm-up 100, refresh every 50 steps from step 300) is "
      "not the default for Adam on a model with a recurrent layer")
for kw, words in ((dict(amsgrad=True), "amsgrad"),):
    try:
        hvd.DistributedOptimizer(torch.optim.Adam(Net().parameters(), **kw),
                                 compression=hvdsparse.TopK(0.01))
        check(False, f"{kw} was accepted")
    except ValueError as exc:
        check(words in str(exc), f"{kw}: {exc}")
for kw, words in ((dict(local_gradient="sum"), "local_gradient"),
                  (dict(adam_recipe=False, adam_warmup=5), "recipe is off")):
    try:
        hvd.DistributedOptimizer(torch.optim.Adam(Net().parameters()),
                                 compression=hvdsparse.TopK(0.01), **kw)
        check(False, f"{kw} was accepted")
    except ValueError as exc:
        check(words in str(exc), f"{kw}: {exc}")
print(f"HVDSPARSE-OK rank={R}", flush=True)
