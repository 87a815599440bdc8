"""Convergence benchmark: each method at its defaults against dense Horovod, same run.

Launches ``scripts/train.py`` under real ``horovodrun`` (Gloo, localhost) for every
(method, seed), reads its JSON summary, and prints / saves per method: final test
accuracy and loss (mean +- sd over seeds), steps to dense's 95%-of-final accuracy
(first evaluation that reaches it), and wire bytes per rank per step vs dense.

So far one workload: the digits MLP (``--workload digits``, SGD momentum 0.9, lr 0.1,
batch 32 per rank). The CNN and the language-model workloads of issue 11 are not built
yet.

    .venv/bin/python scripts/bench_convergence.py --np 2 --seeds 0 1 2 --epochs 15 \\
        --out docs/bench/convergence
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: name -> train.py arguments (each compressor at its defaults unless stated)
METHODS = {
    "dense": ["--compression", "none"],
    "topk1%": ["--compression", "topk", "--ratio", "0.01"],
    "topk1%+mc": ["--compression", "topk", "--ratio", "0.01", "--momentum-correction"],
    "threshold99%": ["--compression", "threshold", "--sparsity", "0.99"],
    "threshold99%+mc": ["--compression", "threshold", "--sparsity", "0.99",
                        "--momentum-correction"],
    "adacomp": ["--compression", "adacomp"],
    "adacomp+mc": ["--compression", "adacomp", "--momentum-correction"],
}


def run_one(np_, method, seed, epochs, width, extra):
    with tempfile.TemporaryDirectory() as d:
        js = Path(d) / "summary.json"
        cmd = [str(Path(sys.executable).with_name("horovodrun")), "-np", str(np_), "-H",
               f"localhost:{np_}", "--gloo", sys.executable, str(ROOT / "scripts" / "train.py"),
               "--epochs", str(epochs), "--width", str(width), "--seed", str(seed),
               "--eval-every", "11", "--json", str(js), *METHODS[method], *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env, cwd=str(ROOT), timeout=1800)
        if p.returncode != 0 or not js.exists():
            raise SystemExit(f"{method} seed {seed} failed:\n{p.stdout[-3000:]}")
        d = json.loads(js.read_text())
        return dict(d["summary"], evals=d["history"]["evals"])


def steps_to(history, target):
    for h in history:
        if h.get("test_acc") is not None and h["test_acc"] >= target:
            return h["step"]
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--out", default="docs/bench/convergence")
    args, extra = ap.parse_known_args()
    runs = {m: [run_one(args.np, m, s, args.epochs, args.width, extra) for s in args.seeds]
            for m in args.methods}
    dense = runs.get("dense")
    rows = []
    for m, rs in runs.items():
        acc = [r["final_test_acc"] for r in rs]
        loss = [r["final_test_loss"] for r in rs]
        steps = []
        for i, r in enumerate(rs):
            target = 0.95 * dense[i]["final_test_acc"] if dense else None
            steps.append(steps_to(r["evals"], target) if target else None)
        byts = statistics.mean(r["bytes_sent_per_rank_step"] or 0 for r in rs)
        dense_b = statistics.mean(r["bytes_sent_per_rank_step"] or 0 for r in dense) \
            if dense else None
        rows.append(dict(method=m, acc_mean=statistics.mean(acc),
                         acc_sd=statistics.pstdev(acc), loss_mean=statistics.mean(loss),
                         steps_to_target=steps, bytes_per_rank_step=byts,
                         bytes_vs_dense=(dense_b / byts) if dense_b and byts else None))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"digits_np{args.np}"
    (out / f"{tag}.json").write_text(json.dumps(dict(args=vars(args), extra=extra,
                                                     rows=rows, runs=runs), indent=1))
    lines = [f"| method | final acc (mean +- sd, {len(args.seeds)} seeds) | final loss | "
             f"steps to 95% of dense | bytes/rank/step | x fewer than dense |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        d = r["acc_mean"] - rows[0]["acc_mean"] if rows and rows[0]["method"] == "dense" else 0
        ratio = "" if r["bytes_vs_dense"] is None else f"{r['bytes_vs_dense']:.1f}"
        lines.append(f"| {r['method']} | {100 * r['acc_mean']:.2f} +- {100 * r['acc_sd']:.2f}"
                     f" ({100 * d:+.2f} pp) | {r['loss_mean']:.4f} | {r['steps_to_target']} | "
                     f"{r['bytes_per_rank_step']:.0f} | {ratio} |")
    table = "\n".join(lines)
    (out / f"{tag}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
