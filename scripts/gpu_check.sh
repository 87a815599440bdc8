#!/usr/bin/env bash
# One-command GPU check of hvdsparse (see README "Known limits", BENCHMARKS.md), sized to
# fit one 6-minute device call on one H100/H200, Triton compiles included.
#
#   bash scripts/gpu_check.sh OUTDIR
#
# On a machine without a CUDA device it prints "no CUDA device: skipped" and exits 0
# (HVDSPARSE_GPU_CHECK_DEVICE=cpu runs the same stages on the CPU instead, the kernels
# in Triton's interpreter: a check of this script's plumbing, not of a GPU).
# The python is HVDSPARSE_PYTHON, else the checkout's .venv, else python3 (torch +
# triton; Horovod is not needed and never imported).
#
# Stages, each with a header, a time limit (`timeout`; the stage's own budget, cut to
# what is left of the whole budget HVDSPARSE_GPU_CHECK_BUDGET, default 355 s), its wall
# time and a log OUTDIR/<stage>.log; a failing or timed-out stage does not stop the
# next; a summary table ends the run:
#   env     versions, the GPU, nvidia-smi (OUTDIR/nvidia-smi.txt)
#   oracle  tests/test_oracle.py with HVDSPARSE_TEST_DEVICE=cuda: every kernel compiled
#           for this GPU against the plain oracle bit for bit (NaN/Inf, FMA, rank-order
#           decode); HVDSPARSE_TEST_SMOKE=1 runs a subset of the widest parametrised
#           grids (each combination is one more Triton compile; every kernel still runs)
#   bucket  tests/test_bucket_topk.py, tests/test_bucket_compress.py and
#           tests/test_adam_bucket.py on CUDA: the bucket path (TopK / Threshold rows;
#           AdaComp, QSGD, dense rows; the Adam recipe's update wire) against the
#           per-layer path, bit for bit; tests/test_capture_ready.py: the staged row
#           tables' pinned upload (stream order, a rewrite while a copy is in flight);
#           tests/test_device_graphs.py: every kind of row's compress replayed from a
#           real CUDA graph against the same steps eager, bit for bit;
#           tests/test_split_ranges.py: the split exchange's one-launch range decode
#   bench   scripts/gpu_bench.py: every kernel against a device copy of the same bytes
#           at 1M and 25M elements, TopK compress of a 25M layer, a few training steps
#           at world size 1 (CUDA decode == CPU decode bit for bit), a CUDA-graph probe
#           of one bucket (eager vs one replay, host time per phase)
#   sweep   scripts/gpu_sweep.py: select_compact / quantize_pack launch parameters at 25M
#           elements against a device copy (outputs checked against the default's)
#   ddp     scripts/bench_ddp_gpu.py if the file exists (skipped, not failed, if not);
#           on CUDA its modes include topk-graphs / adacomp-graphs (cuda_graphs=True)
# Budgets (seconds) can be changed with HVDSPARSE_GPU_CHECK_<STAGE>_S (e.g.
# HVDSPARSE_GPU_CHECK_ORACLE_S=200). Triton's cache (~/.triton/cache unless
# TRITON_CACHE_DIR is set) makes a second run on a warm machine much faster.
# Exit status: 0 if every stage that ran passed and none was cut by its time limit.
set -u
OUT=${1:-gpu_check_out}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
START=$(date +%s)
BUDGET=${HVDSPARSE_GPU_CHECK_BUDGET:-355}
DEVICE=${HVDSPARSE_GPU_CHECK_DEVICE:-cuda}
PY=${HVDSPARSE_PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if [ "$DEVICE" = cuda ]; then
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "no CUDA device: skipped"
    exit 0
  fi
  export TRITON_INTERPRET=0
else
  echo "HVDSPARSE_GPU_CHECK_DEVICE=$DEVICE: plumbing run, kernels in Triton's interpreter (not a GPU check)"
  export TRITON_INTERPRET=1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset HVDSPARSE_FORCE_TRITON

NAMES=() STATUS=() WALL=()
FAILED=0

# stage NAME BUDGET_S CMD...: run CMD under `timeout`, log to $OUT/NAME.log
stage() {
  local name=$1 budget=$2
  shift 2
  local now left limit t0 t1 rc status
  now=$(date +%s)
  left=$(( START + BUDGET - now ))
  limit=$budget
  if [ "$left" -lt "$limit" ]; then limit=$left; fi
  echo
  echo "=== [$name] $(date -u +%H:%M:%S) limit ${limit}s (budget ${budget}s, ${left}s of ${BUDGET}s left)"
  echo "=== [$name] $(echo "$*" | tr -s '\n ' '  ' | cut -c1-240)"
  if [ "$limit" -lt 10 ]; then
    echo "=== [$name] SKIPPED: no time left"
    NAMES+=("$name") STATUS+=("SKIPPED (no time left)") WALL+=("0")
    FAILED=1
    return
  fi
  t0=$(date +%s.%N)
  HVDSPARSE_STAGE_BUDGET_S=$limit timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  t1=$(date +%s.%N)
  local wall
  wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  if [ "$rc" -eq 0 ]; then
    status="ok"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status="TIMEOUT after ${limit}s (rc=$rc)"
    FAILED=1
  else
    status="FAILED (rc=$rc)"
    FAILED=1
  fi
  echo "=== [$name] $status, wall ${wall}s"
  NAMES+=("$name") STATUS+=("$status") WALL+=("$wall")
}

skip() {  # skip NAME REASON: listed in the summary, not a failure
  echo
  echo "=== [$1] SKIPPED: $2"
  NAMES+=("$1") STATUS+=("skipped: $2") WALL+=("0")
}

budget() {  # budget STAGE DEFAULT: HVDSPARSE_GPU_CHECK_<STAGE>_S or DEFAULT
  local var="HVDSPARSE_GPU_CHECK_$(echo "$1" | tr '[:lower:]' '[:upper:]')_S"
  echo "${!var:-$2}"
}

stage env "$(budget env 30)" bash -c '
  "$1" -c "import sys, torch, triton; print(\"python\", sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__); print(\"device:\", torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"none\")" || exit 1
  nvidia-smi > "$2/nvidia-smi.txt" 2>&1 && head -15 "$2/nvidia-smi.txt" || echo "nvidia-smi: not available"
' env-stage "$PY" "$OUT"

stage oracle "$(budget oracle 120)" env HVDSPARSE_TEST_DEVICE="$DEVICE" HVDSPARSE_TEST_SMOKE=1 \
  "$PY" -m pytest -v -p no:cacheprovider --durations=10 tests/test_oracle.py

stage bucket "$(budget bucket 80)" env HVDSPARSE_TEST_DEVICE="$DEVICE" \
  "$PY" -m pytest -v -p no:cacheprovider --durations=5 tests/test_bucket_topk.py \
  tests/test_bucket_compress.py tests/test_adam_bucket.py tests/test_capture_ready.py \
  tests/test_device_graphs.py tests/test_split_ranges.py

stage bench "$(budget bench 75)" "$PY" scripts/gpu_bench.py --out "$OUT"

stage sweep "$(budget sweep 40)" "$PY" scripts/gpu_sweep.py --out "$OUT"

# ----------------------------------------------------------------------------- DDP
# DDP hook at world size 2 on one GPU (ResNet-50, a GPT-2-small-like LM; dense DDP,
# PowerSGD, hvdsparse; step time, launches and host syncs per step): the script's
# own stage, called as `bench_ddp_gpu.py --out OUTDIR`; every stage's command sees its
# time limit in HVDSPARSE_STAGE_BUDGET_S. Skipped while the file does not exist.
if [ -f scripts/bench_ddp_gpu.py ]; then
  stage ddp "$(budget ddp 120)" "$PY" scripts/bench_ddp_gpu.py --out "$OUT"
else
  skip ddp "scripts/bench_ddp_gpu.py does not exist"
fi

echo
echo "=== summary ($(( $(date +%s) - START ))s of ${BUDGET}s; logs in $OUT/)"
{
  printf '| stage | status | wall s |\n|---|---|---|\n'
  for i in "${!NAMES[@]}"; do
    printf '| %s | %s | %s |\n' "${NAMES[$i]}" "${STATUS[$i]}" "${WALL[$i]}"
  done
} | tee "$OUT/summary.md"
exit "$FAILED"
