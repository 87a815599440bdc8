#!/usr/bin/env bash
# Set up the environment if needed (idempotent), then run the whole test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec "$ROOT/.venv/bin/python" -m pytest -q --durations=20 tests "$@"
