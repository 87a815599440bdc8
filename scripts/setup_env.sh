#!/usr/bin/env bash
# Idempotent environment setup for hvdsparse.
#
# Creates .venv (if missing) with torch 2.13.0 (CPU build from this machine's disk),
# triton 3.7.1, numpy, pytest, hypothesis, and Horovod 0.28.1 built from its PyPI
# sdist with PyTorch + Gloo. Horovod 0.28.1 does not compile against PyTorch >= 2.1
# as released (it asks for C++14; torch headers need C++17), so we patch the two
# CMakeLists before building. The built wheel is cached under
# ~/.cache/hvdsparse/wheels keyed by horovod, torch and python versions: the first
# build takes ~12 minutes on 2 cores, later runs take seconds.
#
# Beside the venv, $VENV/triton-side/<version>/ holds the oldest and the newest
# supported Triton (setup.cfg states the range) as bare wheels (pip --target, no
# dependencies): tests/test_compile_offline.py compiles the kernels offline against
# each of them (torch and the rest from the venv). Checked on every run; installed once.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVDSPARSE_VENV:-$ROOT/.venv}"
PY_BOOT="${PYTHON:-python3}"
TORCH_VERSION=2.13.0
TRITON_VERSION=3.7.1
# the bounds of setup.cfg's triton range: the oldest release and the newest one
TRITON_SIDE_VERSIONS="${HVDSPARSE_TRITON_SIDE_VERSIONS:-3.6.0 3.9.0}"
HOROVOD_VERSION=0.28.1
CACHE="${HVDSPARSE_CACHE:-$HOME/.cache/hvdsparse}"
STAMP="$VENV/.hvdsparse-setup-v1"

log() { echo "[setup] $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY_BOOT" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)

SIDE="$VENV/triton-side"
mkdir -p "$SIDE"
for d in "$SIDE"/*; do          # versions no longer wanted (or half installed)
  [ -e "$d" ] || continue
  v=$(basename "$d")
  case " $TRITON_SIDE_VERSIONS " in
    *" $v "*) [ -f "$d/.complete" ] || { log "removing half-installed $d"; rm -rf "$d"; } ;;
    *) log "removing $d (not in: $TRITON_SIDE_VERSIONS)"; rm -rf "$d" ;;
  esac
done
for v in $TRITON_SIDE_VERSIONS; do
  if [ ! -f "$SIDE/$v/.complete" ]; then
    log "installing triton $v (wheel only) into $SIDE/$v"
    rm -rf "$SIDE/$v.tmp"
    "${PIP[@]}" install --no-deps --target "$SIDE/$v.tmp" "triton==$v"
    touch "$SIDE/$v.tmp/.complete"
    mv "$SIDE/$v.tmp" "$SIDE/$v"
  fi
done

if [ -f "$STAMP" ] && "$PY" -c "import horovod.torch, hvdsparse" 2>/dev/null; then
  log "environment ready ($VENV)"
  exit 0
fi

log "installing torch $TORCH_VERSION, triton $TRITON_VERSION and test tools"
"${PIP[@]}" install --upgrade pip setuptools wheel
"${PIP[@]}" install "torch==$TORCH_VERSION" "triton==$TRITON_VERSION" numpy pytest hypothesis \
  cloudpickle psutil pyyaml packaging scikit-learn tqdm matplotlib

PYV=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
TORCHV=$("$PY" -c 'import torch; print(torch.__version__.replace("+", "_"))')
KEY="horovod-$HOROVOD_VERSION-torch$TORCHV-$PYV"
WHEELDIR="$CACHE/wheels/$KEY"

if ! "$PY" -c "import horovod.torch" 2>/dev/null; then
  if ! ls "$WHEELDIR"/horovod-*.whl >/dev/null 2>&1; then
    log "building Horovod $HOROVOD_VERSION wheel (~12 min on 2 cores), cache: $WHEELDIR"
    BUILD=$(mktemp -d)
    trap 'rm -rf "$BUILD"' EXIT
    "${PIP[@]}" download --no-binary :all: --no-deps "horovod==$HOROVOD_VERSION" -d "$BUILD"
    tar -xzf "$BUILD"/horovod-$HOROVOD_VERSION.tar.gz -C "$BUILD"
    SRC="$BUILD/horovod-$HOROVOD_VERSION"
    # The C++17 fix (upstream master has it, no release does).
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/horovod/torch/CMakeLists.txt" || { log "C++17 patch did not apply"; exit 1; }
    mkdir -p "$WHEELDIR.tmp"
    ( cd "$SRC" && PATH="/usr/bin:$PATH" \
      HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
      HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo \
      MAKEFLAGS="-j$(nproc)" \
      "$PY" -m pip --disable-pip-version-check wheel --no-build-isolation --no-deps -w "$WHEELDIR.tmp" . ) >"$CACHE/horovod-build.log" 2>&1 \
      || { log "Horovod build failed, see $CACHE/horovod-build.log"; tail -40 "$CACHE/horovod-build.log" >&2; exit 1; }
    rm -rf "$WHEELDIR" && mv "$WHEELDIR.tmp" "$WHEELDIR"
  fi
  log "installing cached Horovod wheel"
  "${PIP[@]}" install --no-deps "$WHEELDIR"/horovod-*.whl
fi

log "installing hvdsparse (editable)"
"${PIP[@]}" install --no-build-isolation --no-deps -e "$ROOT"
"$VENV/bin/horovodrun" --check-build | grep -E 'PyTorch|Gloo' >&2
touch "$STAMP"
log "environment ready ($VENV)"
