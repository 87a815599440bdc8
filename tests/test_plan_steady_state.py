"""The bucket plan is made for the steady state, not for a dense warm-up step: with a
warm-up whose step 0 is dense, the plan's bucket sizes follow the payload sizes after
warm-up, computed independently here from the compressor's own steady-state payloads.

Runs the scheduler's first-step agreement for real (``hvd.allgather_object`` in a
one-process Horovod job, started in a subprocess so this test process never initialises
Horovod), with ``world_size=2`` given to the scheduler so that it plans as a 2-rank job.
"""
import json
import subprocess
import sys

from tests.hvdrun import ROOT

SCRIPT = r'''
import json, torch, horovod.torch as hvd
import hvdsparse
from hvdsparse import codec
from hvdsparse.scheduler import LayerScheduler, plan_buckets
from hvdsparse.compressors import TopK, RtWarmup
hvd.init()
torch.manual_seed(0)
sizes = [(256, 64), (512, 32), (128, 128), (64, 300), (1000,), (48, 48)]
params = [(f"p{i}", torch.nn.Parameter(torch.randn(*s))) for i, s in enumerate(sizes)]
comp = TopK(0.01, warmup=RtWarmup(50))
comp.bind(0, 2, broadcast=lambda t, n: t)
FT = 6000
sched = LayerScheduler(params, comp, rank=0, world_size=2, prefix="t",
                       fusion_threshold=FT, exchange="allgather")
for name, p in params:
    p.grad = torch.randn_like(p)
    sched._compress(name)                        # step 0: dense (warm-up)
dense0 = {n: codec.encoded_nbytes([sched._payloads[n]]) for n, _ in params}
sched._build_plan()
# independent expectation: the same compressor settings at the end of warm-up
ref = TopK(0.01, warmup=RtWarmup(50)); ref.bind(0, 2, broadcast=lambda t, n: t)
steady = {}
for name, p in params:
    g = torch.randn_like(p)
    steady[name] = codec.encoded_nbytes([ref.compress(name, g, 50)])
order = [n for n, _ in params]
print("RESULT", json.dumps(dict(plan=sched.plan, steady=steady, dense0=dense0,
      expect=plan_buckets(order, steady, FT), at_step0=plan_buckets(order, dense0, FT))))
'''


def test_plan_uses_steady_state_sizes():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=str(ROOT), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                              "PATH": "/usr/bin:/bin"})
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    # the warm-up step really was denser than the steady state
    assert all(r["dense0"][n] > r["steady"][n] for n in r["steady"] if n != "p4"), r
    assert r["plan"] == r["expect"], r
    assert r["plan"] != r["at_step0"], r         # the test can tell the two apart
