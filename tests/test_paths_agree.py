"""The GPU (Triton) path and the CPU path of a whole training run agree bit for bit, at
P = 2 under real horovodrun (tests/workers/paths_worker.py): TopK (fp32 and fp16 values,
allgather and split; and a step skipped for a NaN on one rank), Threshold, AdaComp (also
under a layer budget) -- each
with momentum correction, the default with SGD momentum -- QSGD, RandomK (its Philox
draw: the same indices on both paths) and Slim-DP (its explorer's draw, over the dense
exchange), and TopK and Threshold under AdamW (the Adam recipe's update wire, made per
bucket on the Triton path), 4 steps each, every parameter compared after every step.
Kernels run through Triton's interpreter on CPU tensors; see the worker's docstring for
why the two paths must give the same bits there."""
from pathlib import Path

from tests.hvdrun import run_horovod

WORKER = Path(__file__).resolve().parent / "workers" / "paths_worker.py"


def test_triton_path_trains_to_the_cpu_paths_bits_np2():
    out = run_horovod(WORKER, np=2, timeout=900, env={"TRITON_INTERPRET": "1"})
    assert out.count("paths agree:") == 11, out[-3000:]
