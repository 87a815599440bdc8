"""Launch counting of the CUDA path without a GPU (``scripts/count_device_ops.py``):
both front doors at world size 2 (DDP hook under torchrun, ``DistributedOptimizer``
under horovodrun, Gloo), ``validate=False``, forced Triton through the interpreter,
the compressors on the bucket path, on ResNet-50's 161 parameter shapes at narrow widths,
under SGD (momentum 0.9) and, for TopK, Threshold and AdaComp, under AdamW (the Adam
recipe's update wire: every rank's own Adam step made per bucket,
``hvdsparse/adam_bucket.py``), counted in one job per door.

Checks that the counting itself holds up (every compressor exchanged at least one
bucket, phases add up to the total, the model's own work is present in every run,
hvdsparse adds work beyond it) and asserts the launch bound -- at most ``20 * buckets +
10`` launches per step beyond the model's own backward + optimizer -- for every pair
counted here (every compressor through Horovod's door, five through the DDP hook).
``scripts/launch_bound_check.py`` asserts it for every compressor under both optimizers
through both doors. With ``cuda_graphs`` (the graphs emulated, ``scripts/graph_emulator.py``),
the DDP door's TopK step: what is left outside the replayed graphs, and QSGD with every
bucket forced through the ``dense`` exchange.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton")

_spec = importlib.util.spec_from_file_location(
    "launch_bound_check",
    Path(__file__).resolve().parents[1] / "scripts" / "launch_bound_check.py")
lbc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lbc)
cdo = lbc.cdo

#: the compressors counted here: every one ``scripts/count_device_ops.py`` knows under
#: SGD, and the three the transformer benchmarks use under AdamW (``+adamw``; all six:
#: ``scripts/launch_bound_check.py``), through Horovod's door. Both doors hand every
#: bucket to the one step engine (``hvdsparse/engine.py``), so the DDP door counts the
#: compressors whose buckets differ in kind (TopK's sampled select, Threshold's reused
#: threshold, AdaComp's bins, QSGD's codes, the Adam recipe's own steps), not all nine
#: again: each pair costs ~12 s of interpreted kernels.
SGD = ("topk", "threshold", "adacomp", "qsgd4", "randomk", "slimdp")
METHODS = SGD + ("topk+adamw", "threshold+adamw", "adacomp+adamw")
DOOR_METHODS = {"horovod": METHODS,
                "ddp": ("topk", "threshold", "adacomp", "qsgd4", "topk+adamw")}


@pytest.mark.parametrize("door", ["ddp", "horovod"])
def test_counts_are_consistent(door):
    if door == "horovod":
        pytest.importorskip("horovod.torch")
    methods = DOOR_METHODS[door]
    res = lbc.small_counts(door, methods)
    assert res["world"] == 2
    for base in ("none", "none+adamw"):      # the plain local step under each optimizer
        plain = res["results"][base]
        assert plain["total"] > 0 and set(plain["phases"]) == {"model"}
    for m in methods:
        r = res["results"][m]
        plain = res["results"]["none+adamw" if m.endswith("+adamw") else "none"]
        assert r["buckets"] >= 1, f"{door} / {m}: no exchange in the counted step"
        assert sum(p["total"] for p in r["phases"].values()) == pytest.approx(r["total"])
        assert r["added"] == pytest.approx(r["total"] - plain["total"])
        assert r["phases"]["model"]["total"] > 0, f"{door} / {m}: no model work counted"
        hv = sum(v["total"] for k, v in r["phases"].items() if k != "model")
        assert hv > 0, f"{door} / {m}: no hvdsparse work counted"
        assert r["phases"].get("exchange", {}).get("total", 0) >= r["buckets"], \
            f"{door} / {m}: fewer collectives than buckets"
        added, limit, nb = lbc.over_bound(door, m, methods)
        assert added <= limit, (f"{door} / {m}: {added:.0f} launches per step beyond "
                                f"the model's own, bound {limit:.0f} ({nb:g} buckets)")


def test_cuda_graphs_leave_two_launches_per_bucket_outside_compress():
    """``cuda_graphs=True`` through the DDP door (the graphs emulated, each replay one
    launch, past the warm-up that captures every segment): every Triton launch of the
    step runs inside a replayed graph, each bucket's encode is one replay and its decode
    the copy of the gathered rows home plus one replay, and the step adds fewer launches
    than the same step eager."""
    # eager: the consistency test's job (cached; TopK's step is steady from the third)
    eager = lbc.small_counts("ddp", DOOR_METHODS["ddp"])["results"]["topk"]
    res = cdo.run_door("ddp", ["topk+graphs", "qsgd4+via-dense+graphs"], np=2,
                       **dict(lbc.SMALL, warmup=6))
    graphs = res["results"]["topk+graphs"]
    nb = graphs["buckets"]
    assert nb == eager["buckets"] >= 1

    def phase(r, k):
        return r["phases"].get(k, {}).get("total", 0)
    assert phase(eager, "decode") > 2 * nb and phase(eager, "encode") > nb
    assert phase(graphs, "decode") == 2 * nb, graphs["phases"]
    assert phase(graphs, "encode") == nb, graphs["phases"]
    assert eager["phases"]["compress"]["triton"] > 0
    assert sum(p["triton"] for p in graphs["phases"].values()) == 0, graphs["phases"]
    assert graphs["added"] < eager["added"] - 2 * nb, (graphs["added"], eager["added"])
    # every bucket forced through the dense exchange: no Triton launch outside a replay,
    # within the bound
    dense = res["results"]["qsgd4+via-dense+graphs"]
    assert dense["strategies"] == {"dense": dense["buckets"]}, dense["strategies"]
    assert sum(p["triton"] for p in dense["phases"].values()) == 0, dense["phases"]
    assert dense["added"] <= cdo.bound(dense["buckets"]), (dense["added"], dense["buckets"])
