"""Does Adam's variance settle after a warm-up? A single-process study on one workload
of ``scripts/workloads.py`` (P simulated ranks, exact averages; no compression, no
Horovod), for the Adam recipe's choice of wire.

Two runs from the same weights and batches:

* **dense**: torch's AdamW / Adam on the ranks' averaged gradient. Every ``--every``
  steps after ``--warmup`` it records, per 2-D parameter, ``mean sqrt(v_hat_t) /
  mean sqrt(v_hat_Tw)`` (``v_hat = v / (1 - beta2^t)``): how far the preconditioner
  moved since the warm-up's end.
* **frozen**: the same, but from step ``--warmup`` on every 2-D parameter steps with
  its variance frozen at that step (``p -= lr / bc1 * m / D``, ``D = max(h, 0.1 *
  mean(h)) + eps``, ``h = sqrt(v_hat_Tw)``, the momentum from the exact averaged
  gradient): the Adam recipe's frozen-variance update with nothing compressed, its
  best case. 1-D parameters keep exact Adam in both runs.

Prints a table and saves JSON (``--out``)::

    .venv/bin/python scripts/study_adam_variance.py --workload text-gpt --np 2 --steps 1000
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workloads as W  # noqa: E402


def run(workload, P, steps, seed, warmup, every, frozen):
    wl = [W.make_workload(workload, r, P) for r in range(P)]
    model = wl[0].model(seed)
    opt = wl[0].optimizer(model)
    named = [(n, p) for n, p in model.named_parameters()]
    v0, D, ratios, evals, step = {}, {}, [], [], 0
    for ep in range(math.ceil(steps / wl[0].steps_per_epoch())):
        for batches in zip(*[w.batches(seed, ep) for w in wl]):
            if step == steps:
                break
            grads = []
            for r in range(P):
                model.zero_grad()
                wl[r].loss(model, batches[r]).backward()
                grads.append([p.grad.detach().clone() for _, p in named])
            for j, (n, p) in enumerate(named):
                p.grad = sum(g[j] for g in grads) / P
            if frozen and step >= warmup:
                _frozen_step(opt, named, D, warmup)
            else:
                opt.step()
            step += 1
            b2 = opt.param_groups[0]["betas"][1]
            if step == warmup:
                v0 = {n: (opt.state[p]["exp_avg_sq"] / (1 - b2 ** step)).sqrt().mean().item()
                      for n, p in named if p.dim() >= 2}
            if step % every == 0:
                evals.append(dict(step=step, loss=wl[0].evaluate(model)["loss"]))
                if not frozen and step > warmup:
                    ratios.append(dict(step=step, ratio={
                        n: (opt.state[p]["exp_avg_sq"] / (1 - b2 ** step)).sqrt().mean().item()
                        / v0[n] for n, p in named if p.dim() >= 2}))
    return dict(evals=evals, ratios=ratios)


@torch.no_grad()
def _frozen_step(opt, named, D, warmup):
    """The frozen-variance step for 2-D parameters (1-D ones: torch's own step)."""
    g = opt.param_groups[0]
    lr, (b1, b2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
    for n, p in named:
        if p.dim() < 2:
            continue
        st = opt.state[p]
        if n not in D:
            h = (st["exp_avg_sq"] / (1 - b2 ** warmup)).sqrt()
            D[n] = torch.maximum(h, 0.1 * h.mean()) + eps
        if isinstance(opt, torch.optim.AdamW):
            p.mul_(1 - lr * wd)
        st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1)
        st["step"] += 1
        p.addcdiv_(st["exp_avg"], D[n], value=-lr / (1 - b1 ** float(st["step"])))
        p.grad = None
    opt.step()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="text-gpt")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--out", default="results/adam_variance.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    out = dict(argv=sys.argv[1:], date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    for kind in ("dense", "frozen"):
        out[kind] = run(a.workload, a.np, a.steps, a.seed, a.warmup, a.every, kind == "frozen")
    out["wall_s"] = time.time() - t0
    names = list(out["dense"]["ratios"][0]["ratio"]) if out["dense"]["ratios"] else []
    print(f"{a.workload}, P = {a.np}, seed {a.seed}: mean sqrt(v_hat) over its value at "
          f"step {a.warmup}, per 2-D parameter; held-out loss, dense / v frozen at step "
          f"{a.warmup}")
    print("| step | " + " | ".join(names) + " | loss dense | loss frozen |")
    print("|---" * (len(names) + 3) + "|")
    frozen = {e["step"]: e["loss"] for e in out["frozen"]["evals"]}
    for r, e in zip(out["dense"]["ratios"],
                    [e for e in out["dense"]["evals"] if e["step"] > a.warmup]):
        print(f"| {r['step']} | " + " | ".join(f"{r['ratio'][n]:.2f}" for n in names)
              + f" | {e['loss']:.4f} | {frozen[e['step']]:.4f} |")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"saved {a.out} ({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
