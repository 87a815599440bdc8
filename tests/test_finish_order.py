"""The scheduler's finish order (``LayerScheduler.synchronize``): every bucket is waited
for and decoded before the non-finite counts' allgather, which Horovod queues behind the
buckets' collectives (so each bucket's wait is booked as its own, and a bucket's decode
overlaps the later buckets' transfers); and a bucket that fails while finishing raises
its own error, with the counts' handle collected rather than left behind.

One-process Horovod job in a subprocess (this test process never initialises Horovod),
with ``HVDSPARSE_COMPRESS_AT_SIZE_ONE=1`` so the whole exchange path runs at size 1; the
planted failure wraps the real ``AllgatherPending.finish`` (which still runs)."""
import json
import os
import subprocess
import sys

from tests.hvdrun import ROOT

SCRIPT = r'''
import json, os, torch, horovod.torch as hvd
import hvdsparse
from hvdsparse.exchange import allgather
hvd.init()
torch.manual_seed(int(os.environ["SEED"]))
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4),
                            torch.nn.ReLU(), torch.nn.Linear(4, 64))
opt = hvdsparse.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(),
                                     compression=hvdsparse.TopK(0.1, min_numel=0),
                                     exchange="allgather", fusion_threshold=600)
sched = opt.scheduler
real_nf = sched._finish_nonfinite
def traced(handle):
    sched.events.append(("nonfinite",))
    return real_nf(handle)
sched._finish_nonfinite = traced
def step():
    opt.zero_grad()
    model(torch.randn(8, 32)).pow(2).mean().backward()
    opt.step()
for _ in range(3):
    step()
events = [e for e in sched.events if e[0] in ("finish", "nonfinite")]
real_finish = allgather.AllgatherPending.finish
def boom(self):
    real_finish(self)
    raise RuntimeError("planted decode failure")
allgather.AllgatherPending.finish = boom
try:
    step()
    err = None
except Exception as e:
    err = f"{type(e).__name__}: {e}"
print("RESULT", json.dumps(dict(events=events, buckets=len(sched._specs), err=err,
                                wait=sched.last_stats["time_wait_s"])))
'''


def test_buckets_finish_before_the_counts_and_errors_surface_as_themselves():
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           "HVDSPARSE_COMPRESS_AT_SIZE_ONE": "1",
           "SEED": str(int.from_bytes(os.urandom(3), "little"))}
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=str(ROOT), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120,
                         env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    nb = r["buckets"]
    assert nb >= 2, r                      # several buckets, or the order says nothing
    # the last step's events: every bucket finished, in launch order, then the counts
    last = r["events"][-(nb + 1):]
    assert last == [["finish", b] for b in range(nb)] + [["nonfinite"]], r["events"]
    assert r["err"] == "RuntimeError: planted decode failure", r
    assert r["wait"] >= 0.0, r
