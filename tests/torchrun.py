"""Launch a real ``torchrun --nproc-per-node N`` job (Gloo, localhost) from a test.

Each launch costs a few seconds of start-up, so tests batch many checks into one worker
script. The worker prints ``HVDSPARSE-OK rank=<r>`` at the end of a successful run; a
launch passes only when every rank printed it and torchrun exited 0.
"""
from __future__ import annotations

import socket

from tests.hvdrun import launcher_path, run_job


def torchrun_path() -> str:
    return launcher_path("torchrun", "it ships with torch")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script, nproc: int, args=(), timeout: float = 300, env=None) -> str:
    """Run ``torchrun --nproc-per-node <nproc> --master-port <free> <script> <args>``
    (see :func:`tests.hvdrun.run_job`)."""
    cmd = [torchrun_path(), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), *map(str, args)]
    return run_job(cmd, nproc, timeout, dict(env or {}, OMP_NUM_THREADS="1"))
