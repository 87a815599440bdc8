"""Launch a real ``torchrun --nproc-per-node N`` job (Gloo, localhost) from a test.

Each launch costs a few seconds of start-up, so tests batch many checks into one worker
script. The worker prints ``HVDSPARSE-OK rank=<r>`` at the end of a successful run; a
launch passes only when every rank printed it and torchrun exited 0.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def torchrun_path() -> str:
    exe = Path(sys.executable).with_name("torchrun")
    if exe.exists():
        return str(exe)
    found = shutil.which("torchrun")
    if found is None:
        pytest.fail("torchrun not found (it ships with torch)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script, nproc: int, args=(), timeout: float = 300, env=None) -> str:
    """Run ``torchrun --nproc-per-node <nproc> --master-port <free> <script> <args>``;
    returns the combined output, fails the test (with the output) when the job fails,
    times out, or a rank did not report success."""
    cmd = [torchrun_path(), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), *map(str, args)]
    full_env = dict(os.environ)
    full_env.pop("TRITON_INTERPRET", None)  # workers run the torch reference path
    full_env["OMP_NUM_THREADS"] = "1"
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
    if env:
        full_env.update(env)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout, env=full_env, cwd=str(ROOT))
    except subprocess.TimeoutExpired as exc:
        out = exc.output.decode() if isinstance(exc.output, bytes) else exc.output
        pytest.fail(f"torchrun timed out after {timeout}s: {' '.join(cmd)}\n{out}")
    out = proc.stdout
    missing = [r for r in range(nproc) if f"HVDSPARSE-OK rank={r}" not in out]
    if proc.returncode != 0 or missing:
        pytest.fail(f"torchrun failed (rc={proc.returncode}, ranks without OK: {missing}):\n"
                    f"{' '.join(cmd)}\n{out[-6000:]}")
    return out
