# megarl images. Not built in megarl's CI (its machines have no Docker engine): see README.
#
#   docker build --target gpu -t megarl:gpu .     # CUDA: megatron-core, Transformer Engine, Apex, vLLM
#   docker build --target cpu -t megarl:cpu .     # laptop: vLLM's CPU build, gloo

# ---- GPU clusters -------------------------------------------------------------------------------
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04 AS gpu
ARG APEX_COMMIT=master
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3.11 python3.11-dev python3.11-venv git build-essential ninja-build \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /opt/megarl
COPY . .
RUN pip install --upgrade pip && pip install -e ".[gpu,test]"
# NVIDIA Apex is not on PyPI; build its fused CUDA kernels against the installed torch.
RUN pip install -v --no-build-isolation \
        --config-settings "--build-option=--cpp_ext" --config-settings "--build-option=--cuda_ext" \
        "git+https://github.com/NVIDIA/apex.git@${APEX_COMMIT}"
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
