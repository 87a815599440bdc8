"""Convergence benchmark: each method at its defaults against dense Horovod, same run.

Workloads in ``scripts/workloads.py``: ``digits-mlp``, ``digits-wide``, ``digits-cnn``,
``text-lm`` and ``text-gpt`` (a GPT-style transformer under AdamW; ``--gpt`` sizes it), real ``horovodrun`` (Gloo, localhost), P ranks. ONE launch
per (workload, P) trains every (seed, method) sequentially in the same processes: a
fresh model (initial weights from the seed, identical across methods, broadcast from
rank 0), a fresh optimizer and a fresh compressor each time. Dense is Horovod's own
``hvd.DistributedOptimizer`` (plain allreduce); every other method is
``hvdsparse.DistributedOptimizer(opt, named_parameters, compression=X)``.

Method specs: ``NAME[+mc][:key=value,...]`` with NAME one of :data:`COMPRESSORS`
(each at its defaults; ``key=value`` overrides a constructor argument, e.g.
``slimdp:core_period=50``) and ``+mc`` = ``momentum_correction=True`` (SGD only). A
plain NAME passes ``momentum_correction=False`` explicitly, so a row's meaning does not
depend on the library's default. ``opt.KEY=value`` passes a keyword of
``hvdsparse.DistributedOptimizer`` (``opt.adam_refresh=0``); ``recipe.KEY=value`` sets an
attribute of the Adam recipe after construction (study knobs: ``recipe.wire='momentum'``;
``recipe.wire_by={'lstm': 'gradient', '*': 'momentum'}`` picks the wire per layer kind of
``workloads.layer_kind``, see :func:`mixed_wire`).

Reported per method (mean +- sd over seeds): final held-out quality (accuracy, or loss
for the LM), its difference to dense (paired by seed; also over the mean of each run's
last ``TAIL_EVALS`` evaluations, less noisy than one evaluation), steps to a target (accuracy: first evaluation
reaching 95% of the same seed's dense final accuracy; loss: first evaluation at or
below 1.05 x the same seed's dense final loss), that step count over dense's, wire bytes
per rank per step (dense: the ring allreduce's 2 (P-1)/P x 4 bytes x parameters;
hvdsparse: ``optimizer.stats()["totals"]["bytes_sent_total"] / steps``) and x fewer than
dense; plus, per compressor and layer kind (fc / conv / lstm / embedding), the mean rate
of what travelled and the "effective" rate (AdaComp's figure of merit, see
``hvdsparse/compressors/adacomp.py``). Saves ``<out>/<workload>_np<P>.json`` (every run,
every evaluation), ``.md`` (the tables) and ``.png`` (quality against steps, mean over
seeds).

    .venv/bin/python scripts/bench_convergence.py --workload digits-mlp --np 2
    .venv/bin/python scripts/bench_convergence.py --workload text-lm --np 4 --seeds 0 1 2
    .venv/bin/python scripts/bench_convergence.py --workload digits-cnn --np 2 --report

``--lr-schedule cosine`` anneals every method's learning rate to 0 over the run (cosine,
set in the wrapped optimizer's param groups after each step); the default keeps the
workload's rate, the issue's setting.

``--methods`` adds runs to an existing JSON (same workload, P, steps), so a sweep can be
split over several launches; ``--report`` only re-reads the JSON and re-prints.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "scripts")):
    if p not in sys.path:
        sys.path.insert(0, p)

#: NAME -> (hvdsparse class, positional args = the issue's settings; all else default)
COMPRESSORS = {
    "topk": ("TopK", (0.01,)),
    "threshold": ("Threshold", (0.99,)),
    "adacomp": ("AdaComp", ()),
    "slimdp": ("SlimDP", (0.3, 0.15)),      # the paper's GoogLeNet setting
    "qsgd": ("QSGD", (4,)),
    # study variants (scripts/study_compressors.py), not library options
    "adacomp-fp32": ("study_compressors.AdaCompExactValues", ()),
    "threshold-track": ("study_compressors.ThresholdTracking", (0.99,)),
    "threshold-largest": ("study_compressors.ThresholdLargestOnOverflow", (0.99,)),
    "threshold-coarse": ("study_compressors.ThresholdCoarseLadder", (0.99,)),
    "slimdp-shared": ("study_compressors.SlimDPSharedExplorer", (0.3, 0.15)),
}
SGD_METHODS = ["dense", "topk", "topk+mc", "threshold", "threshold+mc", "adacomp",
               "adacomp+mc", "slimdp", "qsgd"]
ADAM_METHODS = ["dense", "topk", "threshold", "adacomp", "slimdp", "qsgd"]
#: workload -> (epochs, evaluate every N steps, default methods)
DEFAULTS = {"digits-mlp": (15, 11, SGD_METHODS), "digits-wide": (10, 11, SGD_METHODS),
            "digits-cnn": (15, 11, SGD_METHODS),
            "text-lm": (12, 25, ADAM_METHODS),
            "text-gpt": (20, 50, ["dense", "topk", "threshold", "adacomp"])}
TOL_ACC_PP = 0.5
TOL_LOSS = 0.02


def _split_top(text):
    """``text`` split at the commas outside brackets (``()``, ``[]``, ``{}``)."""
    out, depth, cur = [], 0, []
    for ch in text:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def parse_method(spec):
    """``NAME[+mc][:k=v,...]`` -> (name, momentum_correction, kwargs)."""
    head, _, tail = spec.partition(":")
    name, _, flag = head.partition("+")
    if name != "dense" and name not in COMPRESSORS:
        raise SystemExit(f"unknown method {spec!r} (dense or {sorted(COMPRESSORS)})")
    if flag not in ("", "mc", "off"):
        raise SystemExit(f"method {spec!r}: unknown flag +{flag} (+mc or +off)")
    kw, okw = {}, {}
    if flag == "mc":
        okw["momentum_correction"] = True
    elif name != "dense":
        okw["momentum_correction"] = False      # (Adam: False is what auto gives)
    if flag == "off":
        okw["adam_recipe"] = False
    for item in filter(None, _split_top(tail)):   # commas outside (...), [...], {...}
        k, _, v = item.partition("=")
        try:
            v = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            pass
        if k.startswith("opt."):
            okw[k[4:]] = v
        elif k.startswith("recipe."):             # an attribute of the Adam recipe
            okw.setdefault("_recipe", {})[k[7:]] = v
        else:
            kw[k] = v
    return name, okw, kw


def parse_gpt(text):
    """``--gpt key=value,...`` -> a dict of :data:`workloads.GPT_CONFIG` entries."""
    from workloads import GPT_CONFIG
    out = {}
    for item in filter(None, (text or "").split(",")):
        k, _, v = item.partition("=")
        if k not in GPT_CONFIG:
            raise SystemExit(f"--gpt: unknown key {k!r} (choose from {sorted(GPT_CONFIG)})")
        out[k] = ast.literal_eval(v)
    return out


# ------------------------------------------------------------------------ worker (ranks)

def lr_factor(step, total, warmup_frac=0.0):
    """The cosine schedule's factor for the step after ``step`` steps: a linear warm-up
    ``(step + 1) / W`` over the first ``W = round(warmup_frac * total)`` steps, then
    ``0.5 (1 + cos(pi (step - W) / (total - W)))`` (0 at the end of the run)."""
    w = int(round(warmup_frac * total))
    if step < w:
        return (step + 1) / w
    return 0.5 * (1.0 + math.cos(math.pi * (step - w) / max(total - w, 1)))


class AdamTrace:
    """Per parameter group, what the Adam recipe's compressed step does against the dense
    Adam step the same gradients would give (``--trace N``; study instrument, one extra
    dense allreduce of the local gradients per step, not counted in the bytes).

    Every step: ``G`` = the ranks' average of their local gradients (the exact
    allreduce); a shadow dense Adam ``m~ = b1 m~ + (1 - b1) G``, ``v~ = b2 v~ + (1 - b2)
    G^2`` (bias-corrected with the step) along the recipe's trajectory; for the layers
    past the warm-up, the recipe's applied step ``u = m / D`` (``m``: its synchronised
    momentum, ``D``: its frozen denominator) against the shadow's ``u~ = m~ / bc1 /
    (sqrt(v~ / bc2) + eps)`` (bc1 cancels in a cosine; both get it). Per group and
    window of N steps (means): ``cos(u, u~)``, ``|u| / |u~|``, ``cos(X D, G)`` (the
    exchanged gradient of one step against the exact one), ``D / sqrt(v~_hat)`` (median
    over the coordinates whose ``v~_hat`` exceeds 1% of the layer's mean: the frozen
    variance against the one dense Adam would have now), and the residual's
    age on rank 0: ``sum |r| / mean sum |x|`` (steps of this rank's sent quantity
    ``x = g / D`` that wait in the residual)."""

    def __init__(self, opt, comp, named, group_of, every):
        import torch
        self.torch, self.opt, self.comp = torch, opt, comp
        self.recipe = getattr(opt, "_local_update", None)
        if getattr(self.recipe, "wire", "gradient") != "gradient":
            raise ValueError(f"--trace measures the gradient wire's frozen-variance step; "
                             f"this method runs wire={self.recipe.wire!r} (pass "
                             f"opt.adam_wire='gradient')")
        self.named = [(n, p) for n, p in named if p.requires_grad]
        self.group_of, self.every = group_of, every
        self.m = {n: torch.zeros_like(p) for n, p in self.named}
        self.v = {n: torch.zeros_like(p) for n, p in self.named}
        self.xabs = {}
        self.t = 0
        self.acc, self.out = {}, []

    def before(self):
        import horovod.torch as hvd
        self.local = {n: p.grad.detach().clone() for n, p in self.named if p.grad is not None}
        self.G = {n: hvd.allreduce(g, name=f"trace.{n}", op=hvd.Average)
                  for n, g in self.local.items()}
        r = self.recipe
        self.refresh = {n for n, _ in self.named
                        if r is not None and hasattr(r, "refreshing") and r.refreshing(n)}

    def after(self, step):
        torch = self.torch
        self.t += 1
        group0 = self.opt.param_groups[0]
        b1, b2 = group0["betas"]
        eps = group0["eps"]
        bc2 = 1 - b2 ** self.t
        r = self.recipe
        for n, p in self.named:
            G = self.G.get(n)
            if G is None:
                continue
            self.m[n].mul_(b1).add_(G, alpha=1 - b1)
            self.v[n].mul_(b2).addcmul_(G, G, value=1 - b2)
            if r is None or not hasattr(r, "frozen") or not r.frozen(n) or n in self.refresh:
                continue
            st = self.opt.state[p]
            D = r._denom(st, self.opt.param_groups[0] if len(self.opt.param_groups) == 1
                         else r._groups.of(p), r._steps[n])
            u = st["exp_avg"] / D
            ud = self.m[n] / ((self.v[n] / bc2).sqrt() + eps)
            X = p.grad
            x = self.local[n] / D
            xa = float(x.abs().sum())
            self.xabs[n] = xa if n not in self.xabs else 0.9 * self.xabs[n] + 0.1 * xa
            res = self.comp._residuals.get(n) if self.comp is not None else None
            a = self.acc.setdefault(self.group_of(n), dict(k=0, cos_u=0.0, ratio_u=0.0,
                                                            cos_g=0.0, d_ratio=0.0, age=0.0))
            a["k"] += 1
            a["cos_u"] += float(torch.nn.functional.cosine_similarity(
                u.flatten(), ud.flatten(), dim=0))
            a["ratio_u"] += float(u.norm() / ud.norm().clamp_min(1e-30))
            a["cos_g"] += float(torch.nn.functional.cosine_similarity(
                (X * D).flatten(), G.flatten(), dim=0))
            vh = self.v[n] / bc2
            live = vh > 0.01 * vh.mean()          # coordinates with a gradient (embeddings:
            a["d_ratio"] += float((D / (vh.sqrt() + eps))[live].median())   # rows used)
            if res is not None:
                a["age"] += float(res.abs().sum()) / max(self.xabs[n], 1e-30)
        if step % self.every == 0 and self.acc:
            self.out.append(dict(step=step, groups={
                g: {k: v / a["k"] for k, v in a.items() if k != "k"} | dict(n=a["k"])
                for g, a in self.acc.items()}))
            self.acc = {}


def mixed_wire(recipe, wire_of):
    """Study variant of the Adam recipe (``recipe.wire_by={kind: wire, ...}`` in a method
    spec): the wire chosen per layer kind (``wire_of(name)`` -> ``"gradient"`` or
    ``"momentum"``) instead of one for the whole model. A momentum-wire layer never
    refreshes its variance (``v`` frozen after the warm-up, bias correction ``1 -
    beta2^T_w``); a gradient-wire layer follows the recipe's refresh schedule. With every
    layer on one wire this is the recipe itself (the momentum wire with the refresh off,
    or the gradient wire with the recipe's refresh)."""
    from hvdsparse.adam import AdamRecipe

    class MixedWire(type(recipe)):
        _cur = None

        @property
        def wire(self):
            return wire_of(self._cur) if self._cur is not None else "gradient"

        @wire.setter
        def wire(self, value):          # the constructor's single wire: superseded
            pass

        def _mom(self, name):
            return name is not None and wire_of(name) == "momentum"

        def refreshing(self, name):
            return False if self._mom(name) else AdamRecipe.refreshing(self, name)

        def _local(self):
            return False if self._mom(self._cur) else AdamRecipe._local(self)

        def _v_count(self, s):
            return self.warmup if self._mom(self._cur) else AdamRecipe._v_count(self, s)

        def corrected(self, name, *a, **k):
            self._cur = name
            try:
                return AdamRecipe.corrected(self, name, *a, **k)
            finally:
                self._cur = None

        def _update(self, name, *a, **k):
            self._cur = name
            try:
                return AdamRecipe._update(self, name, *a, **k)
            finally:
                self._cur = None

    recipe.__class__ = MixedWire
    return recipe


def worker(args):
    import torch
    import horovod.torch as hvd
    import hvdsparse
    import workloads
    from workloads import layer_kind, make_workload
    torch.set_num_threads(1)
    workloads.GPT_CONFIG.update(parse_gpt(args.gpt))
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    wl = make_workload(args.workload, rank, world)
    spe = wl.steps_per_epoch()
    total = args.epochs * spe
    runs = []
    for seed in args.seeds:
        for spec in args.methods:
            name, extra_okw, kw = parse_method(spec)
            model = wl.model(seed)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            base = wl.optimizer(model, args.optimizer)
            named = list(model.named_parameters())
            numel = sum(p.numel() for _, p in named)
            comp = None
            if name == "dense":
                opt = hvd.DistributedOptimizer(base, named_parameters=named)
            else:
                cls, pos = COMPRESSORS[name]
                if cls.startswith("study_compressors."):
                    import study_compressors
                    klass = getattr(study_compressors, cls.split(".", 1)[1])
                else:
                    klass = getattr(hvdsparse, cls)
                # a keyword naming a positional default replaces it (topk:ratio=1.0)
                names = list(inspect.signature(klass.__init__).parameters)[1:]
                pos = tuple(kw.pop(n) if n in kw else v for n, v in zip(names, pos))
                comp = klass(*pos, **kw)
                extra_okw = dict(extra_okw)
                recipe_attrs = extra_okw.pop("_recipe", {})
                okw = dict(named_parameters=named, compression=comp, **extra_okw)
                opt = hvdsparse.DistributedOptimizer(base, **okw)
                for k, v in recipe_attrs.items():       # study knobs (Adam recipe)
                    if k == "wire_by":       # {layer kind: wire, "*": the others' wire}
                        mixed_wire(opt._local_update, lambda n, v=v, m=model: v.get(
                            layer_kind(m, n), v.get("*", "gradient")))
                    else:
                        setattr(opt._local_update, k, v)
            evals = []
            tracer = None
            if args.trace and comp is not None:
                tracer = AdamTrace(opt, comp, named, lambda n: layer_kind(model, n),
                                   args.trace)
            step, t0, tl = 0, time.time(), []
            lr0 = [g["lr"] for g in opt.param_groups]
            if args.lr_schedule == "cosine":     # the first step's rate
                for g, l0 in zip(opt.param_groups, lr0):
                    g["lr"] = l0 * lr_factor(0, total, args.warmup_frac)

            def record():
                if rank == 0:
                    model.eval()
                    e = wl.evaluate(model)
                    model.train()
                    e.update(step=step, train_loss=(sum(tl) / len(tl)) if tl else None)
                    if comp is not None:     # cumulative wire bytes (warm-up vs steady)
                        e["bytes_total"] = opt.stats()["totals"]["bytes_sent_total"]
                    evals.append(e)
            record()
            for epoch in range(args.epochs):
                for batch in wl.batches(seed, epoch):
                    opt.zero_grad()
                    loss = wl.loss(model, batch)
                    loss.backward()
                    if tracer is not None:
                        tracer.before()
                    opt.step()
                    if tracer is not None:
                        tracer.after(step + 1)
                    tl.append(loss.detach())
                    step += 1
                    if args.lr_schedule == "cosine":
                        f = lr_factor(step, total, args.warmup_frac)
                        for g, l0 in zip(opt.param_groups, lr0):
                            g["lr"] = l0 * f
                    if step % args.eval_every == 0 or step == total:
                        tl = [float(torch.stack(tl).mean())]
                        record()
                        tl = []
            wall = time.time() - t0
            if comp is None:
                bytes_step = 2 * (world - 1) / world * numel * 4
                layers = {}
            else:
                tot = opt.stats()["totals"]
                bytes_step = tot["bytes_sent_total"] / max(tot["steps"], 1)
                shapes = {n: tuple(p.shape) for n, p in named}
                layers = {n: dict(kind=layer_kind(model, n), numel=s["numel"],
                                  policy_dense=comp.policy.is_dense(n, shapes[n]),
                                  total_payload_bytes=s["total_payload_bytes"],
                                  total_dense_bytes=s["total_dense_bytes"],
                                  total_effective_bytes=s["total_effective_bytes"],
                                  total_sent=s["total_sent"], steps=s["steps"],
                                  last_selected=s.get("selected"), last_sent=s.get("sent"),
                                  capacity=(comp.capacity(shapes[n], n)
                                            if isinstance(comp, hvdsparse.AdaComp) else None),
                                  encodings=s.get("index_encodings"))
                          for n, s in comp.stats().items()}
            if rank == 0:
                runs.append(dict(method=spec, seed=seed, steps=step, wall_s=wall,
                                 bytes_per_rank_step=bytes_step, numel=numel, evals=evals,
                                 layers=layers,
                                 trace=tracer.out if tracer is not None else None))
                q = evals[-1][wl.quality]
                print(f"[{args.workload} P={world}] {spec:18s} seed {seed}: "
                      f"{wl.quality} {q:.4f}, {bytes_step:.0f} B/rank/step, {wall:.1f} s",
                      flush=True)
                # after every run: a killed sweep keeps what it finished
                Path(args.worker_out).write_text(json.dumps(dict(
                    workload=args.workload, np=world, epochs=args.epochs, steps=total,
                    eval_every=args.eval_every, optimizer=args.optimizer,
                    lr_schedule=args.lr_schedule + (f"+warmup{args.warmup_frac:g}"
                                                    if args.warmup_frac else ""),
                    gpt=args.gpt, quality=wl.quality, runs=runs)))
            del opt, base, model, comp
    print(f"HVDSPARSE-OK rank={rank}", flush=True)


# ------------------------------------------------------------------------------- driver

def launch(args, methods):
    with tempfile.TemporaryDirectory() as d:
        js = Path(d) / "runs.json"
        cmd = [str(Path(sys.executable).with_name("horovodrun")), "-np", str(args.np),
               "-H", f"localhost:{args.np}", "--gloo", sys.executable, str(Path(__file__)),
               "--worker", "--worker-out", str(js), "--workload", args.workload,
               "--epochs", str(args.epochs), "--eval-every", str(args.eval_every),
               "--optimizer", args.optimizer, "--lr-schedule", args.lr_schedule,
               f"--gpt={args.gpt or ''}", "--warmup-frac", str(args.warmup_frac),
               "--trace", str(args.trace),
               "--seeds", *map(str, args.seeds), "--methods", *methods]
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env.pop("TRITON_INTERPRET", None)
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env=env, cwd=str(ROOT))
        out = []
        for line in p.stdout:
            out.append(line)
            if re.sub(r"^\[[\d,]+\]<std\w+>:", "", line).startswith("[" + args.workload):
                print(line.rstrip(), flush=True)
        p.wait()
        if p.returncode != 0 or not js.exists():
            raise SystemExit(f"horovodrun failed (rc={p.returncode}):\n{''.join(out)[-6000:]}")
        return json.loads(js.read_text())


def _mean_sd(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def steps_to(evals, quality, target):
    for e in evals:
        if (e[quality] >= target) if quality == "acc" else (e[quality] <= target):
            return e["step"]
    return None


def late_bytes(run):
    """Bytes per rank per step over the second half of the run (after any dense
    warm-up), from the cumulative counts recorded at the evaluations; None without."""
    ev = [e for e in run["evals"] if "bytes_total" in e]
    if not run["layers"]:
        return run["bytes_per_rank_step"]        # dense: the same every step
    if len(ev) < 2:
        return None
    mid = next(e for e in ev if e["step"] >= ev[-1]["step"] / 2)
    if ev[-1]["step"] == mid["step"]:
        return None
    return (ev[-1]["bytes_total"] - mid["bytes_total"]) / (ev[-1]["step"] - mid["step"])


#: the evaluations the "last evaluations" column averages: one final evaluation moves by
#: several pp between neighbouring evaluations on the digits workloads, so a window
#: judges a method's end state more fairly
TAIL_EVALS = 3


def tail_mean(evals, q, n=TAIL_EVALS):
    """Mean of the last ``n`` evaluations' quality ``q`` (the final one included)."""
    return statistics.mean(e[q] for e in evals[-n:])


def summarise(data):
    """Per-method rows (dense first) and per (method, layer kind) rate rows."""
    q = data["quality"]
    by = {}
    for r in data["runs"]:
        by.setdefault(r["method"], {})[r["seed"]] = r
    dense = by.get("dense", {})
    rows = []
    order = (["dense"] if "dense" in by else []) + [m for m in by if m != "dense"]
    for m in order:
        rs = by[m]
        seeds = sorted(rs)
        finals = [rs[s]["evals"][-1][q] for s in seeds]
        diffs, tails, st, ratio = [], [], [], []
        for s in seeds:
            d = dense.get(s)
            if d is None:
                continue
            df = d["evals"][-1][q]
            diffs.append(rs[s]["evals"][-1][q] - df)
            td = tail_mean(d["evals"], q)
            tails.append((tail_mean(rs[s]["evals"], q) - td) / (td if q == "loss" else 1.0))
            target = 0.95 * df if q == "acc" else 1.05 * df
            k = steps_to(rs[s]["evals"], q, target)
            kd = steps_to(d["evals"], q, target)
            st.append(k)
            ratio.append(None if k is None or not kd else k / kd)
        b = statistics.mean(rs[s]["bytes_per_rank_step"] for s in seeds)
        lb = [late_bytes(rs[s]) for s in seeds]
        lb = statistics.mean(lb) if None not in lb else None
        dlb = [late_bytes(dense[s]) for s in dense] if dense else [None]
        dlb = statistics.mean(dlb) if None not in dlb else None
        db = statistics.mean(dense[s]["bytes_per_rank_step"] for s in dense) if dense else None
        fm, fs = _mean_sd(finals)
        dm, _ = _mean_sd(diffs)
        rel = None
        if q == "loss" and dense:
            rel = statistics.mean(diffs[i] / dense[s]["evals"][-1][q]
                                  for i, s in enumerate(s for s in seeds if s in dense))
        rows.append(dict(method=m, seeds=seeds, final=finals, final_mean=fm, final_sd=fs,
                         diff_mean=dm, rel_diff=rel, tail_diff=_mean_sd(tails)[0],
                         steps_to_target=st,
                         steps_ratio=ratio, bytes_per_rank_step=b,
                         x_fewer=(db / b) if db and b else None,
                         late_bytes=lb, late_x_fewer=(dlb / lb) if dlb and lb else None,
                         wall_s=statistics.mean(rs[s]["wall_s"] for s in seeds)))
    kinds = []
    for m in order:
        agg = {}
        for r in by[m].values():
            for n, L in r["layers"].items():
                if L.get("policy_dense"):
                    continue        # under the size floor / 1-D: travels dense by policy
                a = agg.setdefault(L["kind"], dict(numel=0, pay=0.0, dense=0.0, eff=0.0,
                                                   sent=0, steps=0, layers=set()))
                a["layers"].add(n)
                a["pay"] += L["total_payload_bytes"]
                a["dense"] += L["total_dense_bytes"]
                a["eff"] += L["total_effective_bytes"]
                a["sent"] += L["total_sent"]
                a["steps"] += L["steps"]
                if n not in a.get("_seen", set()):
                    a["numel"] += L["numel"]
                    a.setdefault("_seen", set()).add(n)
        for k, a in agg.items():
            kinds.append(dict(method=m, kind=k, layers=sorted(a["layers"]), numel=a["numel"],
                              rate=a["dense"] / a["pay"] if a["pay"] else None,
                              effective_rate=a["dense"] / a["eff"] if a["eff"] else None,
                              bytes_per_element=4 * a["pay"] / a["dense"] if a["dense"]
                              else None))
    return rows, kinds


def tables(data, rows, kinds):
    q = data["quality"]
    n_seeds = max(len(r["seeds"]) for r in rows)
    tgt = ("95% of dense's final accuracy" if q == "acc"
           else "1.05 x dense's final loss")
    head = (f"| method | final {'accuracy %' if q == 'acc' else 'loss'} (mean +- sd, "
            f"{n_seeds} seeds) | vs dense | vs dense, last {TAIL_EVALS} evaluations | "
            f"steps to {tgt} | x dense's steps | "
            f"bytes/rank/step | x fewer than dense | 2nd half: bytes/rank/step (x fewer) "
            f"| s/run |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if q == "acc":
            f = f"{100 * r['final_mean']:.2f} +- {100 * r['final_sd']:.2f}"
            d = "" if r["diff_mean"] is None else f"{100 * r['diff_mean']:+.2f} pp"
            tl = "" if r.get("tail_diff") is None else f"{100 * r['tail_diff']:+.2f} pp"
        else:
            f = f"{r['final_mean']:.4f} +- {r['final_sd']:.4f} (ppl {math.exp(r['final_mean']):.2f})"
            d = "" if r["rel_diff"] is None else f"{100 * r['rel_diff']:+.2f}%"
            tl = "" if r.get("tail_diff") is None else f"{100 * r['tail_diff']:+.2f}%"
        rat = [x for x in r["steps_ratio"] if x is not None]
        ratio = (f"{statistics.mean(rat):.2f}" if len(rat) == len(r["steps_ratio"]) and rat
                 else f"{statistics.mean(rat):.2f}*" if rat else "never")
        xf = "" if r["x_fewer"] is None else f"{r['x_fewer']:.1f}"
        late = "" if r["late_bytes"] is None else (
            f"{r['late_bytes']:.0f} ({r['late_x_fewer']:.1f})" if r["late_x_fewer"]
            else f"{r['late_bytes']:.0f}")
        lines.append(f"| {r['method']} | {f} | {d} | {tl} | {r['steps_to_target']} | {ratio} | "
                     f"{r['bytes_per_rank_step']:.0f} | {xf} | {late} | {r['wall_s']:.1f} |")
    lines += ["", "| method | layer kind | layers | elements | bytes/element sent | "
                  "rate (what travels) | effective rate |", "|" + "---|" * 7]
    for k in kinds:
        if k["rate"] is None:
            continue
        lines.append(f"| {k['method']} | {k['kind']} | {', '.join(k['layers'])} | "
                     f"{k['numel']} | {k['bytes_per_element']:.4f} | {k['rate']:.1f} | "
                     f"{k['effective_rate']:.1f} |")
    return "\n".join(lines)


def trace_rows(data):
    """Per (method, parameter group): the :class:`AdamTrace` measures averaged over the
    windows of the first and the second half of the run (and over seeds)."""
    acc = {}
    for r in data["runs"]:
        for w in r.get("trace") or []:
            half = "1st" if w["step"] <= r["steps"] / 2 else "2nd"
            for g, a in w["groups"].items():
                e = acc.setdefault((r["method"], g, half), {})
                for k, v in a.items():
                    e.setdefault(k, []).append(v)
    rows = []
    for (m, g, half), e in acc.items():
        rows.append(dict(method=m, group=g, half=half,
                         **{k: statistics.mean(v) for k, v in e.items() if k != "n"}))
    return rows


def trace_table(rows):
    if not rows:
        return ""
    lines = ["| method | group | half | cos(step, dense Adam's) | norm ratio | "
             "cos(exchanged, exact gradient) | frozen D / dense sqrt(v) (median) | "
             "residual age (steps) |", "|" + "---|" * 8]
    for x in rows:
        lines.append(f"| {x['method']} | {x['group']} | {x['half']} | {x['cos_u']:.3f} | "
                     f"{x['ratio_u']:.3f} | {x['cos_g']:.3f} | {x['d_ratio']:.3f} | "
                     f"{x['age']:.1f} |")
    return "\n".join(lines)


def plot(data, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    q = data["quality"]
    by = {}
    for r in data["runs"]:
        by.setdefault(r["method"], []).append(r)
    fig, ax = plt.subplots(figsize=(8, 5))
    for m, rs in by.items():
        steps = [e["step"] for e in rs[0]["evals"]]
        ys = [statistics.mean(r["evals"][i][q] for r in rs) for i in range(len(steps))]
        if q == "acc":
            ys = [100 * y for y in ys]
        ax.plot(steps, ys, label=m, lw=2.5 if m == "dense" else 1.2,
                color="black" if m == "dense" else None,
                ls="-" if "+" not in m else "--")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out accuracy %" if q == "acc" else "held-out loss (nats/char)")
    if q == "acc":
        ax.set_ylim(80, 100)
    else:
        lo = min(min(e[q] for e in r["evals"]) for rs in by.values() for r in rs)
        ax.set_ylim(lo - 0.05, lo + 1.0)
    ax.set_title(f"{data['workload']}, P = {data['np']}, mean of {len(next(iter(by.values())))}"
                 f" seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def adacomp_breakdown(data):
    """Per AdaComp-compressed layer: where the payload bytes go (indices, int32 bin
    counts, sign bits, scale, count: what ``stats()`` counts) against the measured
    payload bytes per step; the codec's framing on top (a 72-byte segment record, each
    section padded to 8 bytes: ``hvdsparse/codec.py``); and the rate the paper would
    count (``sent`` elements x (index bits + 1 sign bit), nothing else)."""
    from hvdsparse.compressors import AdaComp
    from hvdsparse.payload import bin_count_width
    pad = lambda b: -(-b // 8) * 8                                  # noqa: E731
    out = []
    for r in data["runs"]:
        if not r["method"].startswith("adacomp") or ":" in r["method"] or r["seed"] != \
                min(x["seed"] for x in data["runs"]):
            continue
        for n, L in r["layers"].items():
            if L.get("policy_dense") or not L.get("capacity"):
                continue
            numel, cap = L["numel"], L["capacity"]
            shape = (1, 1, 1, 1) if L["kind"] == "conv" else (1, 1)
            B = min(AdaComp.bin_size_for(shape), numel)
            nb = -(-numel // B)
            ib = 1 if B <= 256 else 2
            w = bin_count_width(B)                      # codec v2: u8 / u16 / i32 counts
            parts = dict(indices=cap * ib, bin_counts=w * nb, signs=cap / 8, scale=4,
                         count=4)
            total = sum(parts.values())                 # what stats() counts
            # the codec adds a 72-byte segment record and pads each section to 8 bytes
            framing = 72 + (pad(cap * ib) - cap * ib) + (pad(w * nb) - w * nb) \
                + (pad(-(-cap // 8)) - cap / 8) + 4
            sent = L["total_sent"] / max(L["steps"], 1)
            idx_bits = max(1, math.ceil(math.log2(B)))
            out.append(dict(method=r["method"], layer=n, kind=L["kind"], numel=numel, bin=B,
                            bins=nb, per_bin=cap // nb, capacity=cap, **parts,
                            model_bytes=total, framing=framing,
                            measured_bytes=L["total_payload_bytes"] / max(L["steps"], 1),
                            rate=4 * numel / total, rate_framed=4 * numel / (total + framing),
                            sent_per_step=sent,
                            sent_per_bin=sent / nb,
                            paper_rate=32 * numel / (sent * (idx_bits + 1)) if sent else None))
    if not out:
        return out, ""
    lines = ["| method | layer (kind) | elements | bin L | slots/bin | indices | "
             "bin counts (u8 / u16 / i32 by bin size) | signs | scale + count | bytes/step (model / measured) | "
             "rate | + codec framing | rate framed | sent/bin | paper-style rate |",
             "|" + "---|" * 15]
    for x in out:
        lines.append(
            f"| {x['method']} | {x['layer']} ({x['kind']}) | {x['numel']} | {x['bin']} | "
            f"{x['per_bin']} | {x['indices']} | {x['bin_counts']} | "
            f"{x['signs']:.1f} | {x['scale'] + x['count']} | "
            f"{x['model_bytes']:.1f} / {x['measured_bytes']:.1f} | "
            f"{x['rate']:.1f} | {x['framing']:.1f} | {x['rate_framed']:.1f} | "
            f"{x['sent_per_bin']:.2f} | "
            f"{x['paper_rate']:.0f} |")
    return out, "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True, choices=sorted(DEFAULTS))
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--optimizer", default=None, help="sgd (digits), adam | adamw (text-lm)")
    ap.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"],
                    help="the workload's learning rate for the whole run (the issue's "
                         "setting), or cosine-annealed to 0 over the run's steps")
    ap.add_argument("--gpt", default="", help="text-gpt's model / batch, key=value,... "
                    "(d, layers, heads, seq, batch, lr, weight_decay; default: 2 layers, "
                    "d=128, 4 heads, seq 64, batch 16 per rank, lr 3e-3, wd 0.01)")
    ap.add_argument("--warmup-frac", type=float, default=0.0,
                    help="with --lr-schedule cosine: a linear learning-rate warm-up over "
                         "this fraction of the run before the cosine decay")
    ap.add_argument("--trace", type=int, default=0,
                    help="Adam recipe study: per parameter group, the compressed step "
                         "against a shadow dense Adam, averaged over windows of N steps "
                         "(AdamTrace; one extra dense allreduce per step)")
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "convergence"))
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--report", action="store_true", help="only re-read the JSON")
    ap.add_argument("--fresh", action="store_true", help="discard runs already in the JSON")
    ap.add_argument("--merge", nargs="+", default=[],
                    help="JSON files of the same workload / P / steps whose runs to add")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    ep, ev, methods = DEFAULTS[args.workload]
    args.epochs = args.epochs or ep
    args.eval_every = args.eval_every or ev
    args.optimizer = args.optimizer or {"text-lm": "adam", "text-gpt": "adamw"}.get(
        args.workload, "sgd")
    args.methods = args.methods or methods
    if args.worker:
        return worker(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{args.workload}_np{args.np}{args.tag}"
    js = stem.with_suffix(".json")
    data = json.loads(js.read_text()) if js.exists() and not args.fresh else None
    if not args.report:
        new = launch(args, args.methods)
        if data is not None:
            same = all(data.get(k, "constant") == new.get(k, "constant")
                       for k in ("workload", "np", "steps", "optimizer", "lr_schedule"))
            if not same:
                raise SystemExit(f"{js}: existing runs have other settings; use --fresh")
            keep = {(r["method"], r["seed"]) for r in new["runs"]}
            data["runs"] = [r for r in data["runs"] if (r["method"], r["seed"]) not in keep] \
                + new["runs"]
        else:
            data = new
        data.setdefault("commands", []).append(dict(
            argv=sys.argv[1:], date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            load=os.getloadavg()))
    if data is None:
        raise SystemExit(f"{js} does not exist: run without --report first")
    for f in args.merge:
        other = json.loads(Path(f).read_text())
        if not all(data.get(k, "constant") == other.get(k, "constant")
                   for k in ("workload", "np", "steps", "optimizer", "lr_schedule")):
            raise SystemExit(f"--merge {f}: other settings")
        # add the runs this file lacks; a (method, seed) it has is its own (never
        # replaced by an older file's run of the same name)
        have = {(r["method"], r["seed"]) for r in data["runs"]}
        data["runs"] += [r for r in other["runs"] if (r["method"], r["seed"]) not in have]
        data.setdefault("commands", []).extend(other.get("commands", []))
    rows, kinds = summarise(data)
    data["rows"], data["kinds"] = rows, kinds
    js.write_text(json.dumps(data, indent=1))
    md = tables(data, rows, kinds)
    data["adacomp_breakdown"], bd = adacomp_breakdown(data)
    js.write_text(json.dumps(data, indent=1))
    data["trace_rows"] = trace_rows(data)
    if data["trace_rows"]:
        js.write_text(json.dumps(data, indent=1))
        md += ("\n\nThe Adam recipe's step per parameter group against a shadow dense Adam "
               "on the same gradients (`--trace`, AdamTrace):\n\n"
               + trace_table(data["trace_rows"]))
    if bd:
        md += "\n\nAdaComp's wire bytes per layer and step (seed " \
              f"{min(r['seed'] for r in data['runs'])}):\n\n" + bd
    stem.with_suffix(".md").write_text(
        f"{data['workload']}, P = {data['np']}, {data['steps']} steps, optimizer "
        f"{data['optimizer']}, learning rate {data.get('lr_schedule', 'constant')}"
        f"\n\n{md}\n")
    plot(data, stem.with_suffix(".png"))
    print(md)


if __name__ == "__main__":
    main()
