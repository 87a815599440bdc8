"""Proof across real ranks of the trust matrix: tests/workers/trust_worker.py under real
``horovodrun`` (Gloo, localhost), three launches plus one plain process.

* ``-np 3`` matrix (one launch): every compressor (TopK(0.05), Threshold(0.95),
  AdaComp(), SlimDP(0.3, 0.15, core_period=5), RandomK(0.05), QSGD(4), TopK with int8 /
  int4 / int2 values, TopK per-bucket 512) x every exchange (allgather, split, dense,
  auto, balanced), 10 steps each through ``hvd.DistributedOptimizer(..., compression=...)``, a
  small 4-layer model with mixed sizes and ``fusion_threshold=2000`` (buckets of several
  layers). After every step, against a plain-torch replay built in the worker from the
  raw gradients (captured by a hook registered before the optimizer) and every rank's
  payload (read by an independent decoder):
  (a) ``sent + residual_after == residual_before + grad`` -- exact for fp32 values,
  within one fp32 rounding of the residual (``|err| <= 2^-24 |residual_after|``) for
  quantised / sign values; (b) the compressor's rule on ``acc = residual_before + grad``
  (TopK: count in [min(k, nnz), ceil(1.5 k)] and no unsent |acc| above a sent one;
  per-bucket: min(kb, nnz) per bucket, same order rule; Threshold: exactly the first
  ``cap`` indices with ``|acc| >= tau``, tau replayed (k-th largest at step 0, overflow
  guard); AdaComp: per-bin ``|H| >= max|G|``, ``min(c, #passing)`` largest ``|H|``,
  values ``sign(G) * mean bin max`` (``oracle.segment_mean``'s summation order),
  residual ``G - Q(G)`` bitwise; Slim-DP: dense push at step 0 and before re-selection,
  core + explorer sizes, disjoint, core = top of ``|w| + c|g|`` of the push step and
  identical on all ranks; RandomK: k distinct entries; quantised values: scale = max
  |v| per bucket, ``|deq - v| <= scale / s``, sign kept); (c) ``p.grad == (sum over
  ranks in rank order of sent_r) / P``, bitwise for allgather buckets (``sum *
  fp32(1/P)`` accepted too), within the fp32 reordering bound ``2 (P-1) u sum|sent_r| /
  P + 2 u |G|`` for split / dense; parameters bitwise
  identical on all ranks before every update and at the end. ``balanced`` (Ok-Topk):
  per owner region, exactly ``min(c, nnz)`` entries of the rank sum delivered, the
  largest ``|sum|``, values within the same bound; the truncation's feedback: a sent
  element that was not delivered is back in the sender's residual
  (``(acc - sent) + sent``), each rank's residual is carried by the replay across the
  10 steps (``r <- (r + g - sent) + sent * [not delivered]``, bitwise for fp32 values,
  re-synchronised each step within a few fp32 roundings for quantised ones) and must
  equal the compressor's at the start of every step, and the parameters must follow a
  plain-SGD replay (lr 0.1, momentum 0.5) of the delivered sum / P.
* ``-np 3`` scenarios (one launch): NaN on one rank (default policy: every rank raises
  naming layer and rank, no non-finite residual, the element not absorbed;
  ``nonfinite="skip"``: step skipped everywhere, residuals restored, training goes on;
  the same with ``exchange="balanced"`` and momentum correction: the rollback also undoes
  the truncation's add-back and the velocity masking, and the velocity is masked exactly
  where an element was sent and delivered);
  a layer frozen mid-run (plain SGD and SGD momentum: bitwise unchanged while frozen,
  trains after); ``synchronize()`` then ``step()`` without ``skip_synchronize()`` (one
  exchange: same parameters as with it, step counter +1 per step); sparse embeddings
  (p.grad = average of the ranks' sparse gradients); checkpoint (state_dict carries
  step counters + fingerprint, loading without the compression state warns about
  residuals, a resumed run -- through torch.save and torch.load's defaults -- equals the
  uninterrupted one bitwise); mismatched fusion_threshold (keyword, or the
  HVDSPARSE_FUSION_THRESHOLD environment default) / compressor ratio / exchange on one
  rank (ValueError on every rank naming the setting and the rank, no hang).
* ``-np 3`` killed rank: rank 2 SIGKILLs itself mid-training; the job must end non-zero
  within 60 s, saying which process died, and no other rank may finish.
* world size 1 (plain ``python``, ``hvd.init()`` without horovodrun): p.grad untouched,
  no residual, a step equals the plain wrapped optimizer's step bitwise.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.hvdrun import ROOT, horovodrun_path

pytest.importorskip("horovod.torch", reason="Horovod not installed: run scripts/setup_env.sh")

WORKER = Path(__file__).resolve().parent / "workers" / "trust_worker.py"

COMPRESSORS = ["topk", "threshold", "adacomp", "adacomp-budget", "slimdp", "randomk", "qsgd4",
               "topk-int8", "topk-int4", "topk-int2", "topk-perbucket"]
EXCHANGES = ["allgather", "split", "dense", "auto", "balanced"]
SCENARIOS = ["nan/raise", "nan/raise-dense", "nan/skip-allgather", "nan/skip-split",
             "nan/skip-balanced-dgc", "frozen/sgd", "frozen/sgd-momentum", "sync-then-step",
             "sparse-embeddings", "checkpoint", "mismatch/fusion_threshold", "mismatch/ratio",
             "mismatch/exchange", "mismatch/env-fusion-threshold"]


def _env():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)      # workers run the torch reference path
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _run(cmd, timeout):
    """(returncode or None on timeout, output, wall seconds, end time)."""
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, env=_env(), cwd=str(ROOT))
        rc, out = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.output or ""
        if isinstance(out, bytes):
            out = out.decode(errors="replace")
        rc = None
    end = time.time()
    return rc, out, end - t0, end


def _horovodrun(np_, mode, timeout):
    cmd = [horovodrun_path(), "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
           sys.executable, str(WORKER), mode]
    return _run(cmd, timeout)


def _expect_case(run, name):
    rc, out, wall, _ = run
    m = re.search(rf"\[case\] {re.escape(name)} (OK|FAIL)(.*)", out)
    if m is None:
        pytest.fail(f"case {name!r} did not report (horovodrun rc={rc}, {wall:.0f}s; a "
                    f"hang or a crash earlier in the launch):\n{out[-5000:]}")
    if m.group(1) != "OK":
        pytest.fail(f"case {name!r} failed:{m.group(2)}")
    print(f"{name} OK{m.group(2)}")


def _expect_clean(run, np_):
    rc, out, wall, _ = run
    missing = [r for r in range(np_) if f"HVDSPARSE-OK rank={r}" not in out]
    assert rc == 0 and not missing, (f"launch rc={rc}, ranks without OK {missing} after "
                                     f"{wall:.0f}s:\n{out[-5000:]}")
    print(f"launch took {wall:.1f}s")


# ---------------------------------------------------------------------------- matrix
@pytest.fixture(scope="module")
def matrix_run():
    return _horovodrun(3, "matrix", timeout=600)     # 55 cases


@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("comp", COMPRESSORS)
def test_matrix_p3(matrix_run, comp, exchange):
    _expect_case(matrix_run, f"matrix/{comp}/{exchange}")


def test_matrix_launch_clean(matrix_run):
    _expect_clean(matrix_run, 3)


# ---------------------------------------------------------------------------- scenarios
@pytest.fixture(scope="module")
def scenario_run():
    return _horovodrun(3, "scenarios", timeout=360)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_p3(scenario_run, name):
    _expect_case(scenario_run, name)


def test_scenario_launch_clean(scenario_run):
    _expect_clean(scenario_run, 3)


# ---------------------------------------------------------------------------- killed rank
def test_killed_rank_ends_job_within_60s():
    rc, out, wall, end = _horovodrun(3, "kill", timeout=180)
    assert rc is not None, f"job still running after 180 s with rank 2 dead:\n{out[-4000:]}"
    m = re.search(r"\[kill\] rank 2 SIGKILL at ([0-9.]+)", out)
    assert m, f"rank 2 never reached its kill point (rc={rc}):\n{out[-4000:]}"
    after = end - float(m.group(1))
    assert rc != 0, f"horovodrun exited 0 although rank 2 was killed:\n{out[-4000:]}"
    assert after <= 60, f"the job ended {after:.0f}s after rank 2 was killed (limit 60 s)"
    assert "finished all steps" not in out, f"a rank finished training without rank 2:\n{out}"
    # horovodrun reports the dead process with its signal exit code (128 + 9) and ends
    # the others; a survivor that reaches a collective first sees Horovod shut down
    assert "Process 2 exit with status code 137" in out, out[-4000:]
    assert ("Terminating remaining workers after failure of Process 2" in out
            or "Horovod has been shut down" in out), out[-4000:]
    for r in (0, 1):     # when horovodrun reports a survivor's exit, it is non-zero
        m = re.search(rf"Process {r} exit with status code (-?\d+)", out)
        assert m is None or int(m.group(1)) != 0, f"rank {r} exited 0:\n{out[-4000:]}"
    seen = [ln for ln in out.splitlines() if "[kill]" in ln or "Terminating" in ln]
    print(f"job ended {after:.1f}s after the SIGKILL (rc={rc}):\n" + "\n".join(seen))


# ---------------------------------------------------------------------------- world size 1
def test_world_size_one_plain_process():
    rc, out, wall, _ = _run([sys.executable, str(WORKER), "single"], timeout=180)
    _expect_case((rc, out, wall, None), "single")
    _expect_clean((rc, out, wall, None), 1)
