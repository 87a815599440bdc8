# hvdsparse on NVIDIA's NGC PyTorch image: Horovod 0.28.1 (NCCL GPU ops, PyTorch, Gloo and
# MPI controllers) built from its PyPI sdist, then hvdsparse. See docs/cluster.md.
#
#   docker build -t hvdsparse:24.10 .
#   docker run --rm -it --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
#       hvdsparse:24.10 horovodrun -np 8 -H localhost:8 python scripts/train.py --compression topk --ratio 0.01
#
# Base image, tag pinned: nvcr.io/nvidia/pytorch:24.10-py3. From memory of NVIDIA's
# "PyTorch Release 24.10" notes it ships PyTorch 2.5.0a0 (NVIDIA build), CUDA 12.6.2,
# NCCL 2.22.x, Ubuntu 24.04 with Python 3.12, OpenMPI 4.1.x (HPC-X) and NVIDIA's
# pytorch-triton. NOT CONFIRMED: those notes were not reachable from where this file was
# written, and this image has never been built (no Docker, no GPU there). Check with
#   docker run --rm nvcr.io/nvidia/pytorch:24.10-py3 python -c \
#     "import torch, sys; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), sys.version)"
# The tag is kept below CUDA 13 on purpose: Horovod 0.28.1 predates CUDA 13.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:24.10-py3
FROM ${BASE_IMAGE}

ARG HOROVOD_VERSION=0.28.1
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

WORKDIR /workspace/hvdsparse
COPY . .
# --no-deps: keep the image's torch / triton. scikit-learn and tqdm are the training
# example's only extra needs (numpy ships with the image).
RUN python -m pip install --no-build-isolation --no-deps . \
 && python -m pip install scikit-learn tqdm \
 && python -c "import torch, horovod.torch, hvdsparse, hvdsparse.kernels; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
 && python -c "from hvdsparse import native; assert native.available(), native.why_unavailable()"
