# hvdsparse on NVIDIA's NGC PyTorch image: Horovod 0.28.1 (NCCL GPU ops, PyTorch, Gloo and
# MPI controllers) built from its PyPI sdist, then hvdsparse. See docs/cluster.md.
#
#   docker build -t hvdsparse:24.10 .
#   docker run --rm -it --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#       hvdsparse:24.10 horovodrun -np 8 -H localhost:8 python scripts/train.py --compression topk --ratio 0.01
#
# Base image, tag pinned: nvcr.io/nvidia/pytorch:24.10-py3. Public records of that image
# (NVIDIA's version table, users' environment dumps) give PyTorch 2.5.0a0+e000cf0ad9,
# CUDA 12.6.2, Ubuntu 22.04 with Python 3.10.12. Its Triton is NVIDIA's build for that
# PyTorch (upstream torch 2.5 pins triton 3.1.0; the image's exact version was not
# confirmed), below the range hvdsparse supports (triton>=3.6,<3.10, see setup.cfg and
# README "Known limits"): the image's Triton is replaced by TRITON_VERSION below.
# This image has never been built (no Docker, no GPU where this file was written).
# Check with
#   docker run --rm nvcr.io/nvidia/pytorch:24.10-py3 python -c \
#     "import torch, sys, triton; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), sys.version, triton.__version__)"
# The tag is kept below CUDA 13 on purpose: Horovod 0.28.1 predates CUDA 13.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:24.10-py3
FROM ${BASE_IMAGE}

ARG HOROVOD_VERSION=0.28.1
# The oldest supported Triton (what torch 2.10 / 2.11 CUDA wheels pin), the one the
# kernels ran with on an H100/H200; it ships its own ptxas and needs only the driver.
ARG TRITON_VERSION=3.6.0
# HOROVOD_WITH_MPI against the image's OpenMPI. If CMake cannot find it, build with
# --build-arg HOROVOD_MPI=HOROVOD_WITHOUT_MPI (horovodrun then uses Gloo, which is enough).
ARG HOROVOD_MPI=HOROVOD_WITH_MPI

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1

# Horovod from the sdist with the C++17 fix (0.28.1 asks for C++14; PyTorch >= 2.1 headers
# need C++17), exactly as scripts/setup_env.sh does. --no-build-isolation builds against
# the image's torch; only horovod's own small deps (cloudpickle, psutil, pyyaml, packaging)
# and cmake are added, torch and triton are never reinstalled.
RUN python -m pip install "cmake>=3.13,<4" \
 && mkdir -p /tmp/hvd && cd /tmp/hvd \
 && python -m pip download --no-binary :all: --no-deps "horovod==${HOROVOD_VERSION}" -d . \
 && tar -xzf "horovod-${HOROVOD_VERSION}.tar.gz" \
 && cd "horovod-${HOROVOD_VERSION}" \
 && sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' CMakeLists.txt horovod/torch/CMakeLists.txt \
 && grep -q 'CMAKE_CXX_STANDARD 17' horovod/torch/CMakeLists.txt \
 && env HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED \
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 "${HOROVOD_MPI}=1" \
        HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        MAKEFLAGS="-j$(nproc)" \
        python -m pip install --no-build-isolation . \
 && cd / && rm -rf /tmp/hvd \
 && horovodrun --check-build | tee /tmp/check-build.txt \
 && for x in PyTorch Gloo NCCL; do grep -q "\[X\] $x" /tmp/check-build.txt || { echo "Horovod built without $x" >&2; exit 1; }; done \
 && rm /tmp/check-build.txt

# Triton: the image's build (package "triton" or "pytorch-triton") is removed first so
# the two cannot share one triton/ directory. torch.compile in this image then runs with
# a Triton its PyTorch was not built against (untested; hvdsparse does not use it).
RUN (python -m pip uninstall -y triton pytorch-triton || true) \
 && python -m pip install --no-deps "triton==${TRITON_VERSION}" \
 && python -c "import triton; v = triton.__version__; print('triton', v); assert v == '${TRITON_VERSION}', v"

WORKDIR /workspace/hvdsparse
COPY . .
# --no-deps: keep the image's torch and the Triton installed above. scikit-learn and
# tqdm are the training example's only extra needs (numpy ships with the image).
RUN python -m pip install --no-build-isolation --no-deps . \
 && python -m pip install scikit-learn tqdm \
 && python -c "import torch, horovod.torch, hvdsparse, hvdsparse.kernels; import triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
 && python -c "from hvdsparse import native; assert native.available(), native.why_unavailable()"
