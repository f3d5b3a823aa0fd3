"""The engine on GPU: Transformer Engine layers, NCCL, packed (THD) micro-batches or, for engines built for
prompt groups, shared-prompt rows (TE's attention under the rows' masks, RoPE unfused).

In bf16 (TE runs fp32 GEMMs as TF32): log-probs, entropy and values against `transformers` in fp32
differ by ~3e-2 on CPU in bf16 (measured); 1e-1 allows TE's different rounding."""

from __future__ import annotations

import pytest
import torch

from megarl import device
from tests.conftest import ROOT, assert_succeeded, reported, torchrun

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(device.transformer_engine_unavailable() is not None,
                       reason="Transformer Engine's PyTorch extension does not import"),
]


@pytest.mark.parametrize("share_prompts", [False, True], ids=["packed", "shared-prompts"])
@pytest.mark.parametrize("tp", [1, 2])
def test_transformer_engine_scores_match_transformers(tiny_models, tmp_path, tp, share_prompts):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    micro_batches = ["--share-prompts"] if share_prompts else ["--dynamic"]
    result = torchrun(tp, ROOT / "tests/distributed/scripts/engine_checks.py", "--policy", tiny_models["qwen3-untied"],
                      "--value", tiny_models["qwen2-value"], "--out", tmp_path, "--tp", tp, "--dtype", "bfloat16",
                      *micro_batches)
    assert_succeeded(result)
    report = reported(result)
    assert report["shares_prompts"] == [share_prompts] * 2
    assert report["attention_masks"] == [["arbitrary" if share_prompts else "causal"]] * 2
    assert report["rope_fusion"] == [not share_prompts] * 2
    assert report["logprob_entropy_diff"] <= 1e-1 and report["value_diff"] <= 1e-1
    assert report["kept_outputs_vs_score"] <= 1e-5
    # Parameters are bf16 apart from a few kept in fp32 (as on CPU): between 2 and 4 bytes each.
    assert 2 * report["param_count"] <= report["offload_bytes"]["params"] < 4 * report["param_count"]
