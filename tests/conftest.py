"""Shared fixtures: tiny HF models made locally, and launching real torchrun worlds on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "checkpoints_tools"))

# Every family, tied and untied, plus a value model: the models parity tests run over.
TINY_MODELS = {
    "llama-tied": ["--family", "llama"],
    "llama-untied": ["--family", "llama", "--no-tied"],
    "llama-rope-llama3": ["--family", "llama", "--rope-type", "llama3", "--rope-theta", "500000"],
    "qwen2-rope-linear": ["--family", "qwen2", "--rope-type", "linear", "--rope-factor", "4"],
    "qwen2-tied": ["--family", "qwen2"],
    "qwen2-untied": ["--family", "qwen2", "--no-tied", "--max-shard-size", "300KB"],
    "qwen2-value": ["--family", "qwen2", "--value-model"],
    "qwen3-tied": ["--family", "qwen3"],
    "qwen3-untied": ["--family", "qwen3", "--no-tied"],
    # (appended: a model's seed is its position here)
    "qwen2-varied-lengths": ["--family", "qwen2", "--eos-scale", "16"],
}
# Every mixture-of-experts family (8 experts, top-2): Qwen3-MoE renormalises its top-k routing
# weights, Qwen2-MoE does not and has a gated shared expert; plus an untied model and a value model.
# DeepSeek-V3 (multi-latent attention, YaRN) and GLM-4.5 (partial RoPE, q/k/v biases, qk-norm) route by
# sigmoid scores with non-zero correction biases in two expert groups, after a dense first layer; a
# DeepSeek-V3 value model without the query latent (as Moonlight); DeepSeek-V2's softmax routing.
TINY_MOE_MODELS = {
    "qwen3-moe": ["--family", "qwen3_moe"],
    "qwen2-moe": ["--family", "qwen2_moe"],
    "mixtral-untied": ["--family", "mixtral", "--no-tied"],
    "qwen2-moe-value": ["--family", "qwen2_moe", "--value-model"],
    "deepseek-v3": ["--family", "deepseek_v3", "--no-tied", "--n-group", "2", "--rope-type", "yarn",
                    "--rope-factor", "4"],
    "deepseek-v3-no-q-lora-value": ["--family", "deepseek_v3", "--q-lora-rank", "0", "--value-model"],
    "glm4-moe": ["--family", "glm4_moe", "--no-tied", "--n-group", "2"],
    "deepseek-v2": ["--family", "deepseek_v2", "--no-tied"],  # softmax routing, scaled, not renormalised
    # vLLM's CPU MLA decodes a latent of 576 only (kv_lora_rank 512 + qk_rope_head_dim 64), in bfloat16.
    "deepseek-v3-latent-576": ["--family", "deepseek_v3", "--no-tied", "--n-group", "2", "--hidden-size", "256",
                               "--num-layers", "2", "--kv-lora-rank", "512", "--qk-rope-head-dim", "64",
                               "--q-lora-rank", "96"],
}


def pytest_collection_modifyitems(config, items):
    """GPU tests are collected everywhere and reported as skipped where CUDA is absent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs CUDA (Transformer Engine, NCCL)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _make_tiny_models(root: Path, models: dict[str, list[str]]) -> dict[str, Path]:
    import make_tiny_model  # transformers' model classes: 3 s to import, for the sessions that make models

    for seed, (name, args) in enumerate(models.items()):
        make_tiny_model.main(["--out", str(root / name), "--seed", str(seed), *args])
    return {name: root / name for name in models}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    return _make_tiny_models(tmp_path_factory.mktemp("tiny_models"), TINY_MODELS)


@pytest.fixture(scope="session")
def tiny_moe_models(tmp_path_factory) -> dict[str, Path]:
    return _make_tiny_models(tmp_path_factory.mktemp("tiny_moe_models"), TINY_MOE_MODELS)


def torchrun(nproc: int, script: str | Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `script` under torchrun with `nproc` CPU processes; returns the finished process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        str(script), *map(str, args),
    ]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def megarl_shared_memory() -> set[str]:
    """The files of megarl's jobs in /dev/shm: its collectives' segments, and vLLM's CPU segments, named
    after the `VLLM_DIST_IDENT` megarl sets (`megarl.distributed.process`)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("megarl")}


def assert_succeeded(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"


def reported(result: subprocess.CompletedProcess):
    """The results a test script printed on its `REPORT` line (`tests/distributed/scripts/reporting.py`)."""
    line = next((line for line in result.stdout.splitlines() if line.startswith("REPORT ")), None)
    assert line is not None, f"no REPORT line\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return json.loads(line.removeprefix("REPORT "))
