# megarl images. Not built in megarl's CI (its machines have no Docker engine): see docs/hardware.md.
#
#   docker build --target gpu -t megarl:gpu .     # CUDA: megatron-core, Transformer Engine, Apex, vLLM
#   docker build --target cpu -t megarl:cpu .     # laptop: vLLM's CPU build, gloo

# ---- GPU clusters -------------------------------------------------------------------------------
# CUDA 13.0 because PyPI's torch 2.13.0 and vLLM 0.32 are CUDA 13 builds: Apex and Transformer Engine
# compile against this toolkit and Apex stops when nvcc's version differs from torch's. Versions come
# from requirements-gpu.txt alone; `make docker-check` resolves it for this image without building it.
FROM nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04 AS gpu
ARG APEX_COMMIT=6424da3b4faa6c8f062da4a48c424fff3f02d42d
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3.12 python3.12-dev python3.12-venv git build-essential \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /opt/megarl
RUN pip install --upgrade pip setuptools wheel packaging ninja
COPY requirements-gpu.txt .
# Order matters: torch; then Transformer Engine's PyTorch extension (an sdist) compiled against that
# torch, hence no build isolation; then vLLM and the rest, which find both already satisfied.
RUN pip install -c requirements-gpu.txt torch
RUN pip install --no-build-isolation -c requirements-gpu.txt \
        transformer-engine transformer-engine-cu13 transformer-engine-torch
RUN pip install -r requirements-gpu.txt
# NVIDIA Apex is not on PyPI; build its fused CUDA kernels against the installed torch.
RUN pip install -v --no-build-isolation \
        --config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext" \
        "git+https://github.com/NVIDIA/apex.git@${APEX_COMMIT}"
COPY . .
RUN pip install --no-build-isolation -c requirements-gpu.txt -e ".[gpu,test]"
RUN useradd --create-home --uid 1000 megarl && chown -R megarl /opt/megarl
USER megarl

# ---- CPU (try it on a laptop) -------------------------------------------------------------------
FROM python:3.11-slim AS cpu
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
RUN apt-get update && apt-get install -y --no-install-recommends build-essential make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/megarl
COPY . .
RUN python -m venv .venv && make install
RUN useradd --create-home --uid 1000 megarl && chown -R megarl /opt/megarl
USER megarl
CMD ["make", "quickstart"]
