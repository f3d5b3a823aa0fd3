"""The engine on GPU: Transformer Engine layers, packed (THD) micro-batches, NCCL."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import ROOT, assert_succeeded, torchrun

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tp", [1, 2])
def test_packed_transformer_engine_scores_match_transformers(tiny_models, tmp_path, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    result = torchrun(tp, ROOT / "tests/distributed/scripts/engine_checks.py", "--policy", tiny_models["qwen3-untied"],
                      "--value", tiny_models["qwen2-value"], "--out", tmp_path, "--tp", tp, "--dynamic")
    assert_succeeded(result)
    report = json.loads(next(l for l in result.stdout.splitlines() if l.startswith("REPORT ")).removeprefix("REPORT "))
    assert report["logprob_entropy_diff"] <= 1e-4 and report["value_diff"] <= 1e-4
    assert report["offload_bytes"]["params"] == 4 * report["param_count"]
