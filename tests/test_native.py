"""The compiled CPU loops (``hvdsparse/native``): their table layout is the Triton
kernels' one, they build once per source and compiler, and when they cannot be used the
CPU path says why and keeps the per-layer numpy path (same bits: test_bucket_topk.py,
test_paths_agree.py)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _py(code: str, env: dict, cwd=ROOT) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full.pop("HVDSPARSE_FORCE_TRITON", None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=300)


def test_table_layout_is_the_triton_kernels_layout():
    from hvdsparse import native, ops
    if not native.available():
        pytest.skip(f"compiled CPU loops unavailable: {native.why_unavailable()}")
    nat = native.bucket_topk()
    tri = ops._kernels().bucket_topk
    cols = [c for c in dir(tri) if c.startswith("C_") or c.startswith("MODE_")] + ["W"]
    assert len(cols) > 20
    assert {c: getattr(nat, c) for c in cols} == {c: getattr(tri, c) for c in cols}


PLAN = textwrap.dedent("""
    import logging, torch
    logging.basicConfig(level=logging.WARNING)
    from hvdsparse import native
    from hvdsparse.compressors import TopK
    from hvdsparse.compressors import topk_bucket as TB
    comp = TopK(0.01, output_ratio=None)
    comp.register_layers([("w", (600, 500))])
    g = torch.randn(600, 500)
    print("available", native.available())
    print("why", native.why_unavailable())
    print("plan", TB.layer_plan(comp, "w", g, 0) is not None)
""")


def test_switched_off_the_cpu_path_stays_per_layer():
    r = _py(PLAN, {"HVDSPARSE_NATIVE": "0"})
    assert r.returncode == 0, r.stderr
    assert "available False" in r.stdout and "why HVDSPARSE_NATIVE=0" in r.stdout
    assert "plan False" in r.stdout


def test_failed_build_is_reported_once_and_the_cpu_path_stays_per_layer(tmp_path):
    # a "compiler" that fails with a message: the warning must carry it
    cc = tmp_path / "broken-cc"
    cc.write_text("#!/bin/sh\necho 'broken-cc: no such toolchain' >&2\nexit 3\n")
    cc.chmod(0o755)
    r = _py(PLAN + "\nprint('again', native.available())\n",
            {"CC": str(cc), "HVDSPARSE_NATIVE_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    assert "available False" in r.stdout and "plan False" in r.stdout
    assert "again False" in r.stdout
    assert r.stderr.count("compiled CPU loops are unavailable") == 1, r.stderr
    assert "broken-cc: no such toolchain" in r.stderr
    assert not list((tmp_path / "cache").glob("*.so"))     # nothing half-written kept


def test_built_once_per_source_and_reused(tmp_path):
    cache = tmp_path / "cache"
    code = PLAN + "\nimport hvdsparse.native as n; print('lib', n._state['lib']._name)\n"
    r1 = _py(code, {"HVDSPARSE_NATIVE_CACHE": str(cache)})
    assert r1.returncode == 0, r1.stderr
    if "available False" in r1.stdout:
        pytest.skip(f"compiled CPU loops unavailable: {r1.stdout}")
    assert "plan True" in r1.stdout
    libs = list(cache.glob("*.so"))
    assert len(libs) == 1
    stamp = libs[0].stat().st_mtime_ns
    r2 = _py(code, {"HVDSPARSE_NATIVE_CACHE": str(cache)})
    assert r2.returncode == 0, r2.stderr
    assert list(cache.glob("*.so")) == libs and libs[0].stat().st_mtime_ns == stamp
    assert [ln for ln in r1.stdout.splitlines() if ln.startswith("lib")] == \
        [ln for ln in r2.stdout.splitlines() if ln.startswith("lib")]


def test_bad_arguments_are_rejected_by_name():
    import torch
    from hvdsparse import native
    if not native.available():
        pytest.skip(f"compiled CPU loops unavailable: {native.why_unavailable()}")
    K = native.bucket_topk()
    with pytest.raises(ValueError, match="columns"):
        K.accumulate(torch.zeros((2, K.W + 1), dtype=torch.int64), None, None, 0)
    with pytest.raises(ValueError, match="table must be a contiguous CPU"):
        K.accumulate(torch.zeros((2, K.W), dtype=torch.int32), None, None, 0)
    with pytest.raises(ValueError, match="fp32 gradients only"):
        K.accumulate(torch.zeros((2, K.W), dtype=torch.int64), None, None, 1)
    with pytest.raises(ValueError, match="grad_scale"):
        K.accumulate(torch.zeros((1, K.W), dtype=torch.int64), None,
                     torch.ones(1, dtype=torch.float64), 0)
    with pytest.raises(ValueError, match="fp32 values only"):
        K.threshold_and_select(torch.zeros((1, K.W), dtype=torch.int64), None, 1, 8, 4, 2,
                               16, 1)
