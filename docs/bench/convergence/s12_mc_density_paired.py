"""s12dens helper (not part of the library): per-method rows via bench_convergence.summarise
and the same-seed "mc minus no mc" differences (final accuracy, and the mean accuracy over
all evaluations after step 0) for every NAME+mc... / NAME... pair in each JSON given.

    .venv/bin/python docs/bench/convergence/s12_mc_density_paired.py \
        docs/bench/convergence/digits-cnn_np4_s12dens_cnn.json
"""
import json, sys, statistics
from pathlib import Path
_ROOT = Path(__file__).resolve().parents[3]          # docs/bench/convergence -> repo root
sys.path.insert(0, str(_ROOT / "scripts")); sys.path.insert(0, str(_ROOT))
from bench_convergence import summarise
for f in sys.argv[1:]:
    d = json.load(open(f))
    q = d["quality"]
    rows, _ = summarise(d)
    R = {r["method"]: r for r in rows}
    fin = {}
    for r in d["runs"]:
        fin.setdefault(r["method"], {})[r["seed"]] = r["evals"][-1][q]
    print(f"## {f}  ({d['workload']} P={d['np']} steps={d['steps']})")
    print("| method | seeds | final acc % mean +- sd | vs dense pp | x dense's steps (per seed) | x fewer bytes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        sr = [x for x in r["steps_ratio"]]
        srs = ", ".join("never" if x is None else f"{x:.2f}" for x in sr)
        ok = [x for x in sr if x is not None]
        m = f"{statistics.mean(ok):.2f}" + ("" if len(ok) == len(sr) else "*") if ok else "never"
        print(f"| {r['method']} | {len(r['seeds'])} | {100*r['final_mean']:.2f} +- {100*r['final_sd']:.2f} | "
              f"{'' if r['diff_mean'] is None else format(100*r['diff_mean'], '+.2f')} | {m} [{srs}] | "
              f"{'' if r['x_fewer'] is None else format(r['x_fewer'], '.2f')} |")
    print()
    auc = {}
    for r in d["runs"]:
        ev = [e[q] for e in r["evals"] if e["step"] > 0]
        auc.setdefault(r["method"], {})[r["seed"]] = sum(ev) / len(ev)
    print("| pair (mc - no mc) | seeds | per-seed diff pp | mean pp | sd pp | seeds >= 0 | steps ratio mc vs no-mc (mean) | mean-over-evals acc diff pp (seeds >= 0) |")
    print("|---|---|---|---|---|---|---|---|")
    for m in fin:
        if "+mc" not in m:
            continue
        base = m.replace("+mc", "")
        if base not in fin:
            continue
        seeds = sorted(set(fin[m]) & set(fin[base]))
        ds = [100 * (fin[m][s] - fin[base][s]) for s in seeds]
        da = [100 * (auc[m][s] - auc[base][s]) for s in seeds]
        sm = R[m]["steps_ratio"]; sb = R[base]["steps_ratio"]
        def mean_ok(x):
            ok = [v for v in x if v is not None]
            return f"{statistics.mean(ok):.2f}" + ("" if len(ok) == len(x) else "*") if ok else "never"
        print(f"| {m} vs {base} | {len(seeds)} | {', '.join(f'{x:+.2f}' for x in ds)} | {statistics.mean(ds):+.2f} | "
              f"{statistics.stdev(ds) if len(ds) > 1 else 0:.2f} | {sum(x >= 0 for x in ds)}/{len(ds)} | {mean_ok(sm)} vs {mean_ok(sb)} | {statistics.mean(da):+.2f} ({sum(x >= 0 for x in da)}/{len(da)}) |")
    print()
