"""hvdsparse.DistributedOptimizer under real ``horovodrun`` (Gloo, localhost).

Two launches (each ~9 s of start-up) run every check of tests/workers/optimizer_worker.py:

* ``-np 2`` (all checks): per strategy (allgather, split, dense, auto; split with dense
  and 8-bit ranges; fp16 values; backward_passes_per_step=2; one bucket per layer) the
  gradient every rank ends with equals a reference built in the worker from all ranks'
  raw gradients and exact top-k with error feedback replayed in plain torch; identical
  buckets / strategies with a perturbed hook order on rank 1; overlap (first launch
  before backward ends); local-gradient modes (combined gradient, params differ between
  syncs and are identical after); TopK(1.0) == plain hvd.DistributedOptimizer over 20
  steps with SGD+momentum, Adam, AdamW (with broadcast_parameters /
  broadcast_optimizer_state); the user's ``hvd.DistributedOptimizer(...,
  compression=hvdsparse.TopK(0.01))`` line trains and sends < 10 % of a dense
  allreduce; routing leaves hvd.Compression.fp16 to Horovod; misuse errors.
* ``-np 4`` (core checks): the strategy correctness, hook order, overlap and
  local-gradient checks again at P = 4.
"""
from pathlib import Path

import pytest

from tests.hvdrun import run_horovod

pytest.importorskip("horovod.torch", reason="Horovod not installed: run scripts/setup_env.sh")

WORKER = Path(__file__).resolve().parent / "workers" / "optimizer_worker.py"

CORE = ["allgather: P={P} allgather", "split: P={P} split", "dense: P={P} dense",
        "auto: P={P} auto", "split-dense-ranges: P={P}", "split-q8: P={P}",
        "allgather-fp16: P={P}", "split-fp16: P={P}", "allgather-bpps2: P={P}",
        "dense-fp16-predivide: P={P}", "allgather-op-sum: P={P}",
        "local partial + RtWarmup(4)",
        "auto-one-bucket-per-layer: P={P}", "hook order perturbed (auto, ft=0)",
        "hook order perturbed (allgather, ft=2500)", "hook order perturbed (split, ft=0)",
        "local_gradient='sum'", "local_gradient='partial'", "local_gradient='error'"]


def _expect(out, lines, P):
    for line in lines:
        assert line.format(P=P) in out, f"missing check {line!r}:\n{out[-4000:]}"


def test_optimizer_np2_all_checks():
    out = run_horovod(WORKER, np=2, args=["all"], timeout=240)
    _expect(out, CORE + ["TopK(1.0) == hvd.DistributedOptimizer over 20 steps with "
                         "sgd+momentum",
                         "TopK(1.0) == hvd.DistributedOptimizer over 20 steps with adam",
                         "TopK(1.0) == hvd.DistributedOptimizer over 20 steps with adamw",
                         "hvd.Compression.fp16 passes through the routing to Horovod",
                         "user line: loss", "misuse errors"], 2)
    print("\n".join(l for l in out.splitlines() if "[check]" in l))


def test_optimizer_np4_core_checks():
    out = run_horovod(WORKER, np=4, args=["core"], timeout=300)
    _expect(out, CORE, 4)
    print("\n".join(l for l in out.splitlines() if "[check]" in l))
