"""scripts/bench_ddp_gpu.py end to end on the CPU (``--device cpu --tiny``: Gloo, two
rank processes, tiny models): every mode of both models reports a row, the DDP modes
keep bitwise identical replicas (digests allgathered across the ranks), and the table
and JSON are written."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_ddp_gpu.py"
_spec = importlib.util.spec_from_file_location("bench_ddp_gpu", SCRIPT)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
MODES, MODELS = _mod.MODES, _mod.MODELS


def _scale() -> float:
    return max(1.0, float(os.environ.get("HVDSPARSE_TEST_TIMEOUT_SCALE", "1")))


def test_bench_ddp_gpu_cpu_tiny(tmp_path):
    budget = 900 * _scale()   # the script's own budget; nothing may be skipped within it
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(tmp_path),
         "--budget", str(budget)],
        cwd=ROOT, capture_output=True, text=True, timeout=budget + 60,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    res = json.loads((tmp_path / "bench_ddp_gpu.json").read_text())
    assert res["skipped"] == [] and res["failed"] == [], out[-4000:]
    rows = {(r["model"], r["mode"]): r for r in res["rows"]}
    assert set(rows) == {(m, mode) for m in MODELS for mode in MODES}, sorted(rows)
    for (model, mode), r in rows.items():
        assert r["status"] == "ok", r
        assert r["transport"] == "gloo-cpu"
        assert r["steps"] == 3 and r["median_step_ms"] > 0 and r["mean_step_ms"] > 0, r
        assert r["aten_ops_per_step"] > 0, r
        assert len(r["digests"]) == 2
        if mode == "local":
            assert r["identical"] is None       # no communication: not applicable
        else:
            assert r["identical"] is True, r
            assert r["digests"][0] == r["digests"][1]
    # local training without communication diverges (each rank has its own data): the
    # digest comparison is not vacuous
    for model in MODELS:
        d = rows[(model, "local")]["digests"]
        assert d[0] != d[1], d
    # hvdsparse's modes went through its hook: the exchange counted every step
    for mode in ("topk", "threshold", "adacomp", "qsgd", "randomk"):
        tot = rows[("lm", mode)]["hvdsparse_totals"]
        assert tot["steps"] == 2 + 3 + 1, tot        # warm-up + measured + profiled
        assert tot["bytes_sent_total"] > 0, tot
    assert "NOT ResNet-50" in rows[("resnet50", "dense")]["model_desc"]
    md = (tmp_path / "bench_ddp_gpu.md").read_text()
    for mode in MODES:
        assert f"| {mode} |" in md
