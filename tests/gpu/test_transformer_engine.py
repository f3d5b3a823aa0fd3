"""The Transformer Engine layer spec on GPU: same logits as `transformers` (run where CUDA is present)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import ROOT, TINY_MODELS, assert_succeeded, torchrun

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tp", [1, 2])
def test_transformer_engine_logits_match_transformers(tiny_models, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    result = torchrun(tp, ROOT / "checkpoints_tools/compare_logits.py", "--hf", *tiny_models.values(),
                      "--tp", tp, "--layer-spec", "transformer_engine", "--tolerance", "1e-4")
    assert_succeeded(result)
    assert len(re.findall(r"^OK ", result.stdout, re.MULTILINE)) == len(TINY_MODELS)
