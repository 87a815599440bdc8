"""Whole steps with ``cuda_graphs=True`` across real ranks give the eager steps' bits,
through both front doors.

One ``horovodrun -np 3`` (Gloo, an odd world size) and one ``torchrun --nproc-per-node
2`` (the DDP hook) under ``TRITON_INTERPRET=1 HVDSPARSE_FORCE_TRITON=1``
(tests/workers/graphs_worker.py): for TopK on
``allgather``, QSGD on ``dense``, TopK on ``split``, RandomK on ``balanced`` and TopK
under AdamW (the Adam recipe's update wire), a small MLP trains 6 steps eager and 6
steps with ``cuda_graphs`` (the graphs emulated by
``scripts/graph_emulator.py``: a replay re-issues the captured launches with their
recorded arguments). Asserted per run and rank: the parameters equal the eager run's bit
for bit, replays re-issued launches (the graphs were used, not only captured), and every
rank holds the same parameters.
"""
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("triton")

WORKER = Path(__file__).resolve().parent / "workers" / "graphs_worker.py"


def _problems(out, P):
    from tests.workers.graphs_worker import RUNS
    # torchrun's ranks share one pipe: two records may share a line
    runs = [json.loads(m.group(1)) for m in re.finditer(r"RUN (\{[^{}]*\})", out)]
    problems = []
    for name in sorted(f"{c}/{e}/{o}" for c, e, o in RUNS):
        got = {r["rank"]: r for r in runs if r["run"] == name}
        if set(got) != set(range(P)):
            problems.append(f"{name}: ranks {sorted(got)} reported")
            continue
        for r, rec in sorted(got.items()):
            if not rec["equal"]:
                problems.append(f"{name}: rank {r}'s parameters differ from the eager run's")
            if rec["reissued"] <= 0:
                problems.append(f"{name}: rank {r} replayed nothing")
        if len({rec["hash"] for rec in got.values()}) != 1:
            problems.append(f"{name}: replicas differ ({[got[r]['hash'] for r in range(P)]})")
    return problems


ENV = {"TRITON_INTERPRET": "1", "HVDSPARSE_FORCE_TRITON": "1"}


def test_graph_steps_equal_eager_steps_horovod_three_ranks():
    pytest.importorskip("horovod.torch", reason="Horovod not installed: run scripts/setup_env.sh")
    from tests.hvdrun import run_horovod
    problems = _problems(run_horovod(WORKER, np=3, timeout=900, env=ENV), 3)
    assert not problems, "\n".join(problems)


def test_graph_steps_equal_eager_steps_ddp_hook():
    from tests.torchrun import run_torchrun
    problems = _problems(run_torchrun(WORKER, 2, args=["ddp"], timeout=900, env=ENV), 2)
    assert not problems, "\n".join(problems)
