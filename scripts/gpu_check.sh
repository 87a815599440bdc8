#!/usr/bin/env bash
# One-command GPU check of hvdsparse's kernels (see README "Known limits", BENCHMARKS.md).
#
#   bash scripts/gpu_check.sh OUTDIR
#
# On a machine without a CUDA device it prints "no CUDA device: skipped" and exits 0.
# Otherwise, with the python that has torch + triton (HVDSPARSE_PYTHON, else the
# checkout's .venv, else python3; Horovod is not needed and never imported):
#   1. tests/test_oracle.py with HVDSPARSE_TEST_DEVICE=cuda: every kernel, compiled for
#      this GPU, against the plain oracle bit for bit (NaN/Inf, FMA, rank-order decode);
#      and tests/test_bucket_topk.py: TopK's bucket path against its per-layer path;
#   2. scripts/gpu_bench.py: every kernel timed with triton.testing.do_bench against a
#      device-to-device copy of the same bytes at 1M and 25M elements (fp32 and bf16
#      gradients), TopK compress of a 25M layer against one read + one write of the
#      gradient, and a few training steps of a small model through hvdsparse at world
#      size 1 (CUDA decode compared with the CPU decode bit for bit).
# Writes OUTDIR/oracle_cuda.log, OUTDIR/gpu_bench.{json,md}, OUTDIR/nvidia-smi.txt.
# Exit status: non-zero if the CUDA oracle tests fail.
set -u
OUT=${1:-gpu_check_out}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
PY=${HVDSPARSE_PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "no CUDA device: skipped"
  exit 0
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
unset HVDSPARSE_FORCE_TRITON
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"

echo "== 1. kernels on CUDA vs the oracle (tests/test_oracle.py)"
HVDSPARSE_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider tests/test_oracle.py \
  tests/test_bucket_topk.py 2>&1 | tee "$OUT/oracle_cuda.log"
rc=${PIPESTATUS[0]}

echo "== 2. benchmarks and training steps (scripts/gpu_bench.py)"
"$PY" scripts/gpu_bench.py --out "$OUT" || echo "gpu_bench.py failed (rc=$?)"
echo "== oracle tests rc=$rc"
exit "$rc"
