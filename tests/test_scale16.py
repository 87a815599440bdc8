"""``horovodrun -np 16`` works: one launch of 16 ranks (Gloo, localhost) running
tests/workers/scale16_worker.py.

Per configuration, three steps on a tiny model, every rank on its own batch:
TopK(0.1, exact=True) with exchange allgather / split / auto against exact top-k with
error feedback replayed in plain torch from all 16 ranks' allgathered raw gradients,
and the user's ``hvd.DistributedOptimizer(..., compression=hvdsparse.TopK(0.1))`` line
(sampled threshold) against the plain average of what every rank sent. Parameters must
be bitwise identical on all 16 ranks after every step.

16 Python processes on a small machine: one thread each (OMP_NUM_THREADS=1,
torch.set_num_threads(1)), tensors of a few thousand elements, ~0.3 GB per rank.
"""
from pathlib import Path

import pytest

from tests.hvdrun import run_horovod

pytest.importorskip("horovod.torch", reason="Horovod not installed: run scripts/setup_env.sh")

WORKER = Path(__file__).resolve().parent / "workers" / "scale16_worker.py"


def test_horovodrun_np16_topk_against_reference():
    out = run_horovod(WORKER, np=16, args=["16"], timeout=420,
                      env={"OMP_NUM_THREADS": "1", "HOROVOD_START_TIMEOUT": "120"})
    for line in ("P=16 exchange=allgather: gradients == exact top-k replay of all 16 ranks",
                 "P=16 exchange=split: gradients == exact top-k replay of all 16 ranks",
                 "P=16 exchange=auto: gradients == exact top-k replay of all 16 ranks",
                 "P=16 user line TopK(0.1): averaged gradient == plain average"):
        assert line in out, f"missing check {line!r}:\n{out[-4000:]}"
    print("\n".join(l for l in out.splitlines() if "[check]" in l))
