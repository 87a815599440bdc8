"""Is a dense Horovod training run bitwise repeatable across launches, quiet and loaded?

Launches the same short training job (``digits-cnn`` from ``scripts/workloads.py``,
``--np`` ranks, Gloo, localhost) several times and compares a SHA-256 digest of the final
parameters between launches, once per Horovod environment:

* ``tests``: the settings the test suite launches with (``tests/hvdrun.py``'s
  ``REPEATABLE_HOROVOD_ENV``: tensor fusion off);
* ``horovod-defaults``: Horovod's own defaults (fusion on, 1 ms cycle), those variables
  removed from the environment.

Each environment gets ``--runs`` launches; with ``--burn N`` every second launch runs
beside N busy-looping processes (started and ended by this script), so timing differs.
Two trainings per launch, each from the same seed:

* ``hvd-dense``: plain ``hvd.DistributedOptimizer`` (one allreduce per gradient, fused
  by Horovod when fusion is on);
* ``hvdsparse-dense``: ``hvdsparse.DistributedOptimizer(compression=TopK(0.01),
  exchange="dense", fusion_threshold=4096)`` (several buckets, one allreduce each).

Why fusion matters: with fusion on, the tensors ready in the same Horovod cycle are
copied into one buffer and reduced together; Gloo's ring splits that buffer into P
chunks, and the chunk an element falls in decides which rank starts its sum. Which
tensors share a cycle depends on timing, so at P >= 3 an element's sum order -- and its
fp32 rounding -- can change from launch to launch. At P = 2 a sum of two terms does not
depend on order. With fusion off each tensor is reduced alone and its chunks depend only
on its size and P.

Prints one line per launch (digests, wall seconds) and a verdict per environment; with
``--json`` saves the same. Usage::

    python scripts/check_repeatable.py --np 4 --runs 2 --burn 2
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAG = "REPEATABLE-DIGEST"


def worker(epochs: int) -> None:
    import torch
    import horovod.torch as hvd
    sys.path.insert(0, str(ROOT / "scripts"))
    sys.path.insert(0, str(ROOT))
    import hvdsparse
    from workloads import make_workload

    torch.set_num_threads(1)
    hvd.init()
    wl = make_workload("digits-cnn", hvd.rank(), hvd.size())
    out = {}
    for mode in ("hvd-dense", "hvdsparse-dense"):
        model = wl.model(0)
        base = wl.optimizer(model)
        named = list(model.named_parameters())
        if mode == "hvd-dense":
            opt = hvd.DistributedOptimizer(base, named_parameters=named)
        else:
            opt = hvdsparse.DistributedOptimizer(base, named_parameters=named,
                                                 compression=hvdsparse.TopK(0.01),
                                                 exchange="dense", fusion_threshold=4096)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for epoch in range(epochs):
            for batch in wl.batches(0, epoch):
                opt.zero_grad()
                wl.loss(model, batch).backward()
                opt.step()
        h = hashlib.sha256()
        for _, p in model.named_parameters():
            h.update(p.detach().contiguous().numpy().tobytes())
        digests = hvd.allgather_object(h.hexdigest()[:16], name=f"digest.{mode}")
        if len(set(digests)) != 1:
            raise SystemExit(f"{mode}: ranks disagree within one launch: {digests}")
        out[mode] = digests[0]
    if hvd.rank() == 0:
        out["HOROVOD_FUSION_THRESHOLD"] = os.environ.get("HOROVOD_FUSION_THRESHOLD")
        print(TAG, json.dumps(out), flush=True)


def launch(np_: int, epochs: int, env_name: str, burn: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.hvdrun import REPEATABLE_HOROVOD_ENV, horovodrun_path
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    for k in REPEATABLE_HOROVOD_ENV:
        env.pop(k, None)
    if env_name == "tests":
        env.update(REPEATABLE_HOROVOD_ENV)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(burn)]
    try:
        t0 = time.time()
        proc = subprocess.run([horovodrun_path(), "-np", str(np_), "-H", f"localhost:{np_}",
                               "--gloo", sys.executable, __file__, "--worker",
                               "--epochs", str(epochs)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, cwd=str(ROOT), timeout=900)
        wall = time.time() - t0
    finally:
        for b in burners:
            b.kill()
            b.wait()
    lines = [ln for ln in proc.stdout.splitlines() if TAG in ln]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"launch failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}")
    res = json.loads(lines[-1].split(TAG, 1)[1])
    res.update(env=env_name, burners=burn, wall_s=round(wall, 1))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--burn", type=int, default=2,
                    help="busy-looping processes beside every second launch")
    ap.add_argument("--envs", default="tests,horovod-defaults")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.worker:
        worker(a.epochs)
        return
    rows, verdicts = [], {}
    for env_name in a.envs.split(","):
        runs = []
        for i in range(a.runs):
            r = launch(a.np, a.epochs, env_name, a.burn if i % 2 else 0)
            runs.append(r)
            print(f"{env_name:17s} launch {i} burners={r['burners']} "
                  f"HOROVOD_FUSION_THRESHOLD={r['HOROVOD_FUSION_THRESHOLD']} "
                  f"hvd-dense {r['hvd-dense']} hvdsparse-dense {r['hvdsparse-dense']} "
                  f"({r['wall_s']} s)", flush=True)
        verdicts[env_name] = {m: len({r[m] for r in runs}) == 1
                              for m in ("hvd-dense", "hvdsparse-dense")}
        rows += runs
    for env_name, v in verdicts.items():
        print(f"{env_name:17s} identical across {a.runs} launches: "
              + ", ".join(f"{m} {'yes' if ok else 'NO'}" for m, ok in v.items()))
    if a.json:
        a.json.write_text(json.dumps(dict(np=a.np, epochs=a.epochs, launches=rows,
                                          identical=verdicts), indent=1))


if __name__ == "__main__":
    main()
