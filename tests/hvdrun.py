"""Launch a real ``horovodrun`` job (Gloo, localhost) from a test.

Each launch costs ~9 s of start-up, so tests batch many checks into one worker script.
The worker prints ``HVDSPARSE-OK rank=<r>`` at the end of a successful run; a launch
passes only when every rank printed it and horovodrun exited 0.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def horovodrun_path() -> str:
    exe = Path(sys.executable).with_name("horovodrun")
    if exe.exists():
        return str(exe)
    found = shutil.which("horovodrun")
    if found is None:
        pytest.fail("horovodrun not found: run scripts/setup_env.sh (the README test command does)")
    return found


def run_horovod(script, np: int, args=(), timeout: float = 300, env=None) -> str:
    """Run ``horovodrun -np <np> -H localhost:<np> --gloo python <script> <args>``.

    Returns the combined output; fails the test (with the output) when the job fails,
    times out, or a rank did not report success.
    """
    cmd = [horovodrun_path(), "-np", str(np), "-H", f"localhost:{np}", "--gloo",
           sys.executable, str(script), *map(str, args)]
    full_env = dict(os.environ)
    full_env.pop("TRITON_INTERPRET", None)  # workers run the torch reference path
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
    if env:
        full_env.update(env)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, env=full_env, cwd=str(ROOT))
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"horovodrun timed out after {timeout}s: {' '.join(cmd)}\n{exc.output}")
    out = proc.stdout
    missing = [r for r in range(np) if f"HVDSPARSE-OK rank={r}" not in out]
    if proc.returncode != 0 or missing:
        pytest.fail(f"horovodrun failed (rc={proc.returncode}, ranks without OK: {missing}):\n"
                    f"{' '.join(cmd)}\n{out[-6000:]}")
    return out
