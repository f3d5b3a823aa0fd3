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
        device.transformer_engine_importable.cache_clear()

    yield make
    for name in [name for name in sys.modules if name.split(".")[0] == "transformer_engine"]:
        del sys.modules[name]
    device.transformer_engine_importable.cache_clear()


def test_transformer_engine_counts_only_when_its_pytorch_extension_imports(fake_transformer_engine):
    fake_transformer_engine("raise OSError('libtransformer_engine.so: cannot open shared object file')")
    import transformer_engine  # noqa: F401  (the package alone imports: not enough)

    assert not device.transformer_engine_importable()


def test_transformer_engine_with_a_working_extension(fake_transformer_engine, monkeypatch):
    fake_transformer_engine("")
    assert device.transformer_engine_importable()
    monkeypatch.setattr(device, "cuda", lambda: False)
    assert not device.transformer_engine()  # importable, but GPU-only
    monkeypatch.setattr(device, "cuda", lambda: True)
    assert device.transformer_engine()


def test_answers_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU verdicts, on any machine
    monkeypatch.setattr(device, "triton_importable", lambda: True)
    monkeypatch.setattr(device, "nvidia_apex_importable", lambda: True)
    assert device.backend() == "gloo" and device.compute_device() == torch.device("cpu")
    assert not any(answer() for answer in (device.cuda, device.transformer_engine, device.apex, device.triton,
                                           device.sleep_mode))


def test_answers_with_cuda(monkeypatch):
    monkeypatch.setattr(device, "cuda", lambda: True)
    monkeypatch.setattr(device, "triton_importable", lambda: True)
    monkeypatch.setattr(device, "nvidia_apex_importable", lambda: False)
    assert device.backend() == "cuda:nccl,cpu:gloo"
    assert device.triton() and device.sleep_mode() and not device.apex()


def test_nothing_else_asks_torch_about_cuda():
    asks = re.compile(r"torch\.cuda\.is_available\(\)")
    sources = [path for folder in ("megarl", "launchers", "kernels", "checkpoints_tools")
               for path in (ROOT / folder).rglob("*.py") if path != ROOT / "megarl/device.py"]
    assert [str(path.relative_to(ROOT)) for path in sources if asks.search(path.read_text())] == []
