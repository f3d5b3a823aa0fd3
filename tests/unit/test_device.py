"""megarl.device: the one place that decides device, backend and GPU-only features."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from megarl import device
from tests.conftest import ROOT


@pytest.fixture
def fake_transformer_engine(tmp_path, monkeypatch):
    """Write a `transformer_engine` package whose `pytorch` extension runs `body` on import."""
    def make(body: str):
        package = tmp_path / "transformer_engine"
        (package / "pytorch").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "pytorch" / "__init__.py").write_text(body)
        monkeypatch.syspath_prepend(str(tmp_path))
        device.transformer_engine_unavailable.cache_clear()

    yield make
    for name in [name for name in sys.modules if name.split(".")[0] == "transformer_engine"]:
        del sys.modules[name]
    device.transformer_engine_unavailable.cache_clear()


def test_transformer_engine_counts_only_when_its_pytorch_extension_imports(fake_transformer_engine):
    fake_transformer_engine("raise OSError('libtransformer_engine.so: cannot open shared object file')")
    import transformer_engine  # noqa: F401  (the package alone imports: not enough)

    # the reason is kept, for the start-up line that names every GPU feature off
    why = device.transformer_engine_unavailable()
    assert why == "OSError: libtransformer_engine.so: cannot open shared object file"


def test_transformer_engine_with_a_working_extension(fake_transformer_engine, monkeypatch):
    fake_transformer_engine("")
    assert device.transformer_engine_unavailable() is None
    monkeypatch.setattr(device, "cuda", lambda: False)
    assert not device.transformer_engine()  # importable, but GPU-only
    monkeypatch.setattr(device, "cuda", lambda: True)
    assert device.transformer_engine()


def test_answers_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU verdicts, on any machine
    for probe in ("transformer_engine_unavailable", "nvidia_apex_unavailable", "gradient_fusion_extension_unavailable",
                  "triton_unavailable"):
        monkeypatch.setattr(device, probe, lambda: None)  # every package works
    assert device.backend() == "gloo" and device.compute_device() == torch.device("cpu")
    assert not any(answer() for answer in (device.cuda, device.transformer_engine, device.apex, device.triton,
                                           device.gradient_accumulation_fusion, device.sleep_mode))
    assert device.unavailable_gpu_features() == {}  # off by design, nothing to report


def test_answers_with_cuda(monkeypatch):
    monkeypatch.setattr(device, "cuda", lambda: True)
    monkeypatch.setattr(device, "transformer_engine_unavailable", lambda: None)
    monkeypatch.setattr(device, "triton_unavailable", lambda: None)
    monkeypatch.setattr(device, "nvidia_apex_unavailable", lambda: "not installed")
    monkeypatch.setattr(device, "gradient_fusion_extension_unavailable",
                        lambda: "ModuleNotFoundError: No module named 'fused_weight_gradient_mlp_cuda'")
    assert device.backend() == "cuda:nccl,cpu:gloo"
    assert device.transformer_engine() and device.triton() and device.sleep_mode()
    assert not device.apex() and not device.gradient_accumulation_fusion()
    assert device.unavailable_gpu_features() == {"apex": "not installed"}  # its extension is not named apart


def test_gradient_accumulation_fusion_needs_apex_cuda_extension(tmp_path, monkeypatch):
    """Apex's `fused_weight_gradient_mlp_cuda` (which a plain pip install lacks; megatron refuses to build
    a model that asks for the fusion without it): off, with why, when it fails to import; on when it imports."""
    monkeypatch.setattr(device, "cuda", lambda: True)
    monkeypatch.setattr(device, "nvidia_apex_unavailable", lambda: None)  # Apex installed, its extension maybe not
    broken, working = tmp_path / "broken", tmp_path / "working"
    for folder, body in ((broken, "raise ImportError('libcudart.so.13: cannot open shared object file')"),
                         (working, "")):
        folder.mkdir()
        (folder / "fused_weight_gradient_mlp_cuda.py").write_text(body)
    try:
        monkeypatch.syspath_prepend(str(broken))
        device.gradient_fusion_extension_unavailable.cache_clear()
        assert not device.gradient_accumulation_fusion()
        assert device.unavailable_gpu_features()["fused_weight_gradient_mlp_cuda"] == (
            "ImportError: libcudart.so.13: cannot open shared object file")
        monkeypatch.syspath_prepend(str(working))
        device.gradient_fusion_extension_unavailable.cache_clear()
        assert device.gradient_accumulation_fusion()
    finally:
        sys.modules.pop("fused_weight_gradient_mlp_cuda", None)
        device.gradient_fusion_extension_unavailable.cache_clear()


@pytest.mark.parametrize("cuda", [False, True])
def test_cached_memory_is_released_on_cuda_only(monkeypatch, cuda):
    released = []
    monkeypatch.setattr(device, "cuda", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(True))
    device.release_cached_memory()
    assert released == ([True] if cuda else [])


def test_nothing_else_asks_torch_about_cuda():
    asks = re.compile(r"torch\.cuda\.is_available\(\)")
    sources = [path for folder in ("megarl", "launchers", "kernels", "checkpoints_tools")
               for path in (ROOT / folder).rglob("*.py") if path != ROOT / "megarl/device.py"]
    assert [str(path.relative_to(ROOT)) for path in sources if asks.search(path.read_text())] == []
