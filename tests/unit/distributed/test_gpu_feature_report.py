"""Start-up names each GPU feature that is off on a CUDA machine, and why, in one line per host;
nothing on CPU, where they are off by design (`configure_process`)."""

from __future__ import annotations

import logging

import pytest

from megarl import device
from megarl.distributed import process

FEATURES_OFF = {"transformer_engine": "ImportError: libcudnn.so.9: cannot open shared object file",
                "apex": "not installed"}


@pytest.fixture
def features_off(monkeypatch):
    """Transformer Engine fails to import, Apex is absent (and so its extension: not named apart), Triton works."""
    monkeypatch.setattr(device, "transformer_engine_unavailable", lambda: FEATURES_OFF["transformer_engine"])
    monkeypatch.setattr(device, "nvidia_apex_unavailable", lambda: FEATURES_OFF["apex"])
    monkeypatch.setattr(device, "gradient_fusion_extension_unavailable", lambda: "not installed")
    monkeypatch.setattr(device, "triton_unavailable", lambda: None)


def _reported(caplog) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megarl"):
        process.report_unavailable_gpu_features()
    return [record.getMessage() for record in caplog.records]


def test_cuda_machine_reports_every_feature_off_in_one_line(monkeypatch, caplog, features_off):
    monkeypatch.setattr(device, "cuda", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert _reported(caplog) == ["GPU features off: transformer_engine (ImportError: libcudnn.so.9: cannot open "
                                 "shared object file), apex (not installed)"]
    monkeypatch.setenv("LOCAL_RANK", "1")  # the host's other ranks have the same packages
    assert _reported(caplog) == []


def test_cpu_reports_nothing(monkeypatch, caplog, features_off):
    monkeypatch.setattr(device, "cuda", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert _reported(caplog) == []


def test_cuda_machine_with_every_feature_reports_nothing(monkeypatch, caplog):
    monkeypatch.setattr(device, "cuda", lambda: True)
    for probe in ("transformer_engine_unavailable", "nvidia_apex_unavailable", "gradient_fusion_extension_unavailable",
                  "triton_unavailable"):
        monkeypatch.setattr(device, probe, lambda: None)
    assert _reported(caplog) == []

