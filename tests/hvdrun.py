"""Launch a real ``horovodrun`` job (Gloo, localhost) from a test.

Each launch costs ~9 s of start-up, so tests batch many checks into one worker script.
The worker prints ``HVDSPARSE-OK rank=<r>`` at the end of a successful run; a launch
passes only when every rank printed it and horovodrun exited 0.

Every launch runs with :data:`REPEATABLE_HOROVOD_ENV` (tests/conftest.py also puts it in
the test process's environment, so launchers that copy ``os.environ`` get it too).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Horovod settings of every test launch: tensor fusion off. With fusion on, the
#: allreduces that are ready in the same Horovod cycle are copied into one buffer and
#: reduced together; Gloo's ring splits that buffer into P chunks, and the chunk an
#: element falls in decides which rank starts its sum. Which tensors share a cycle
#: depends on timing (machine load), so at P >= 3 an element's summation order, and its
#: fp32 rounding, could change from one launch to the next. With fusion off each tensor
#: is reduced on its own and its chunks depend only on its size and P: a dense allreduce
#: gives the same bits in every launch (scripts/check_repeatable.py shows it, quiet and
#: loaded). Fusion changes no result a test checks beyond these bits; the tests never
#: exercise Horovod's fusion buffer itself.
REPEATABLE_HOROVOD_ENV = {"HOROVOD_FUSION_THRESHOLD": "0"}


def timeout_scale() -> float:
    """``HVDSPARSE_TEST_TIMEOUT_SCALE`` (default 1): multiplies every launch's timeout.
    A timeout only guards against a hang; a machine much slower or busier than a quiet
    2-core one can stretch them all instead of failing on wall time."""
    raw = os.environ.get("HVDSPARSE_TEST_TIMEOUT_SCALE", "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = 0.0
    if not scale >= 1.0:
        raise ValueError(f"HVDSPARSE_TEST_TIMEOUT_SCALE must be a number >= 1, got {raw!r}")
    return scale


def launcher_path(name: str, hint: str) -> str:
    """``name`` next to this Python (the venv's launcher), else on PATH."""
    exe = Path(sys.executable).with_name(name)
    if exe.exists():
        return str(exe)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: {hint}")
    return found


def horovodrun_path() -> str:
    return launcher_path("horovodrun", "run scripts/setup_env.sh (the README test command "
                                       "does)")


def run_job(cmd, np: int, timeout: float, env=None, omp_threads: str = "1") -> str:
    """Run a multi-process launcher command; returns the combined output, fails the test
    (with the output) when the job fails, times out, or a rank did not print
    ``HVDSPARSE-OK rank=<r>``. ``timeout`` (seconds) is scaled by :func:`timeout_scale`."""
    timeout = timeout * timeout_scale()
    full_env = dict(os.environ)
    full_env.pop("TRITON_INTERPRET", None)  # workers run the CPU path unless told otherwise
    full_env.setdefault("OMP_NUM_THREADS", omp_threads)
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
    full_env.update(REPEATABLE_HOROVOD_ENV)
    if env:
        full_env.update(env)
    what = Path(cmd[0]).name
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, env=full_env, cwd=str(ROOT))
    except subprocess.TimeoutExpired as exc:
        out = exc.output.decode() if isinstance(exc.output, bytes) else exc.output
        pytest.fail(f"{what} timed out after {timeout:.0f}s (a hang, or a machine too busy: "
                    f"HVDSPARSE_TEST_TIMEOUT_SCALE stretches every launch's timeout): "
                    f"{' '.join(cmd)}\n{out}")
    out = proc.stdout
    missing = [r for r in range(np) if f"HVDSPARSE-OK rank={r}" not in out]
    if proc.returncode != 0 or missing:
        pytest.fail(f"{what} failed (rc={proc.returncode}, ranks without OK: {missing}):\n"
                    f"{' '.join(cmd)}\n{out[-6000:]}")
    return out


def run_horovod(script, np: int, args=(), timeout: float = 300, env=None) -> str:
    """Run ``horovodrun -np <np> -H localhost:<np> --gloo python <script> <args>``
    (see :func:`run_job`)."""
    cmd = [horovodrun_path(), "-np", str(np), "-H", f"localhost:{np}", "--gloo",
           sys.executable, str(script), *map(str, args)]
    return run_job(cmd, np, timeout, env)
