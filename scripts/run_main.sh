#!/usr/bin/env bash
# Set up the environment if needed (idempotent), then run the main job: a real
# 2-process horovodrun training run (Gloo, CPU) with hvdsparse compression.
# Extra arguments go to scripts/train.py (e.g. --compression adacomp).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
NP="${NP:-2}"
exec "$ROOT/.venv/bin/horovodrun" -np "$NP" -H "localhost:$NP" --gloo \
  "$ROOT/.venv/bin/python" scripts/train.py --workload digits --compression topk --ratio 0.01 --epochs 10 "$@"
