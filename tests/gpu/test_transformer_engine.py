"""The Transformer Engine layer spec on GPU: same logits as `transformers` (run where CUDA is present).

TE runs fp32 GEMMs as TF32, so an fp32 run cannot meet fp32's 1e-4; the check runs in bf16 against
`transformers` in fp32, within 4x the error `transformers` itself makes in bf16 on the same GPU (measured
by compare_logits for each model: bf16 rounding differs between kernels and devices)."""

from __future__ import annotations

import re

import pytest
import torch

from megarl import device
from tests.conftest import ROOT, TINY_MODELS, assert_succeeded, torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(device.transformer_engine_unavailable() is not None,
                       reason="Transformer Engine's PyTorch extension does not import"),
]


def assert_te_logits_match(models: dict, nproc: int, *layout: object) -> None:
    """compare_logits on `nproc` GPUs at `layout` with the TE spec in bf16: every model OK."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    result = torchrun(nproc, ROOT / "checkpoints_tools/compare_logits.py", "--hf", *models.values(), *layout,
                      "--layer-spec", "transformer_engine", "--dtype", "bfloat16", "--tolerance", "4x")
    assert_succeeded(result)
    assert len(re.findall(r"^OK ", result.stdout, re.MULTILINE)) == len(models)


@pytest.mark.parametrize("tp", [1, 2])
def test_transformer_engine_logits_match_transformers(tiny_models, tp):
    assert len(tiny_models) == len(TINY_MODELS)
    assert_te_logits_match(tiny_models, tp, "--tp", tp)


@pytest.mark.parametrize("ep", [1, 2])
def test_transformer_engine_moe_logits_match_transformers(tiny_moe_models, ep):
    """The MoE models on TE's grouped-GEMM experts (weight<i> per local expert), at EP1 and EP2."""
    assert_te_logits_match(tiny_moe_models, ep, "--ep", ep)
