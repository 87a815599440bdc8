"""Whole steps with ``cuda_graphs=True`` across real ranks give the eager steps' bits.

One ``horovodrun -np 3`` (Gloo, an odd world size) under ``TRITON_INTERPRET=1
HVDSPARSE_FORCE_TRITON=1`` (tests/workers/graphs_worker.py): for TopK on
``allgather``, QSGD on ``dense``, TopK on ``split``, RandomK on ``balanced`` and TopK
under AdamW (the Adam recipe's update wire), a small MLP trains 7 steps eager and 7
steps with ``cuda_graphs`` (the graphs emulated by
``scripts/graph_emulator.py``: a replay re-issues the captured launches with their
recorded arguments). Asserted per run and rank: the parameters equal the eager run's bit
for bit, replays re-issued launches (the graphs were used, not only captured), and every
rank holds the same parameters.
"""
import json
from pathlib import Path

import pytest

pytest.importorskip("triton")

WORKER = Path(__file__).resolve().parent / "workers" / "graphs_worker.py"


def test_graph_steps_equal_eager_steps_on_three_ranks():
    pytest.importorskip("horovod.torch", reason="Horovod not installed: run scripts/setup_env.sh")
    from tests.hvdrun import run_horovod
    from tests.workers.graphs_worker import RUNS
    out = run_horovod(WORKER, np=3, timeout=900,
                      env={"TRITON_INTERPRET": "1", "HVDSPARSE_FORCE_TRITON": "1"})
    runs = [json.loads(line[line.find("RUN {") + 4:]) for line in out.splitlines()
            if "RUN {" in line]
    names = {f"{c}/{e}/{o}" for c, e, o in RUNS}
    problems = []
    for name in sorted(names):
        got = {r["rank"]: r for r in runs if r["run"] == name}
        if set(got) != {0, 1, 2}:
            problems.append(f"{name}: ranks {sorted(got)} reported")
            continue
        for r, rec in sorted(got.items()):
            if not rec["equal"]:
                problems.append(f"{name}: rank {r}'s parameters differ from the eager run's")
            if rec["reissued"] <= 0:
                problems.append(f"{name}: rank {r} replayed nothing")
        if len({rec["hash"] for rec in got.values()}) != 1:
            problems.append(f"{name}: replicas differ ({[got[r]['hash'] for r in range(3)]})")
    assert not problems, "\n".join(problems)
