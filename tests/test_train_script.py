"""Smoke test of scripts/train.py under a real horovodrun (2 ranks, Gloo, digits, TopK).

Two launches (~9 s start-up each):

1. three epochs with ``--checkpoint`` and ``--keep-checkpoints`` (a copy per epoch);
2. ``--resume`` from the epoch-2 copy up to epoch 3, with ``--profile`` (per-step
   synchronise + ``optimizer.stats()``).

The resumed epoch 3 must reproduce the uninterrupted epoch 3 (same test loss/accuracy,
same training loss), which needs model, optimizer *and* every rank's compressor
residuals restored, and shows that ``--profile`` changes only what is measured. The
logs must be readable under horovodrun: no progress bar (stderr is a pipe), exactly one
INFO line per epoch, from rank 0 only. Also checks the per-rank checkpoint files, the JSON figures, and
that TopK actually compressed (bytes sent < dense allreduce bytes).
"""
from __future__ import annotations

import json
import math
import os

import pytest

from hvdrun import ROOT, run_horovod

hvdsparse = pytest.importorskip("hvdsparse")
if not hasattr(hvdsparse, "DistributedOptimizer"):
    pytest.skip("hvdsparse.DistributedOptimizer not available yet", allow_module_level=True)

TRAIN = ROOT / "scripts" / "train.py"
COMMON = ["--workload", "digits", "--width", "64", "--compression", "topk", "--ratio", "0.05",
          "--batch-size", "64", "--no-progress", "--target-acc", "0.5"]


def test_train_topk_checkpoint_resume(tmp_path):
    ck = tmp_path / "ck.pt"
    full_json, res_json = tmp_path / "full.json", tmp_path / "resumed.json"

    out = run_horovod(TRAIN, 2, COMMON + ["--epochs", "3", "--checkpoint", ck,
                                          "--keep-checkpoints", "--json", full_json],
                      timeout=300)
    assert "epoch   3" in out
    epoch_lines = [l for l in out.splitlines() if "INFO epoch " in l]
    assert len(epoch_lines) == 3 and all("[rank 0]" in l for l in epoch_lines), epoch_lines
    assert "it/s" not in out and "\r" not in out, "progress bar output under horovodrun"
    for f in (ck, f"{ck}.rank0", f"{ck}.rank1", f"{ck}.e2", f"{ck}.e2.rank0", f"{ck}.e2.rank1"):
        assert os.path.exists(f), f"missing checkpoint file {f}"

    full = json.loads(full_json.read_text())
    s = full["summary"]
    assert s["world_size"] == 2 and s["steps"] > 0
    assert len(full["history"]["epochs"]) == 3
    assert s["bytes_sent_per_rank_step"] is not None, "optimizer reported no bytes"
    assert s["effective_compression"] > 1.0, s
    assert s["time_to_target_s"] is not None and s["final_test_acc"] >= 0.5, s

    out = run_horovod(TRAIN, 2, COMMON + ["--epochs", "3", "--resume", f"{ck}.e2",
                                          "--json", res_json, "--profile"], timeout=300)
    assert "resumed from" in out
    res = json.loads(res_json.read_text())
    assert res["summary"]["profiled_steps"] and res["summary"]["median_opt_step_s"] > 0
    # per-step bytes (profile) and the epoch mean from the stats totals agree
    per_step = res["history"]["bytes_sent"][-res["summary"]["lo_steps"]:]
    assert math.isclose(sum(per_step) / len(per_step),
                        res["history"]["epochs"][2]["bytes_sent_per_rank_step"], rel_tol=1e-9)
    a, b = full["history"]["epochs"][2], res["history"]["epochs"][2]
    assert b["epoch"] == 3 and b["steps"] == a["steps"]
    for key in ("train_loss", "test_loss", "test_acc"):
        assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), \
            f"resumed epoch 3 differs in {key}: {a[key]} vs {b[key]}"
