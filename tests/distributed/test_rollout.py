"""Colocated vLLM after resharding, for training layouts TP1, TP2, PP2, TP2xPP2 and DP2 (engine TP2).

Each launch trains a step, syncs the training shards into a vLLM engine and an `hf` engine on every
rank, and checks: the synced weights are bit-identical to the HF export of the training model,
greedy generations of vLLM and `hf` agree token for token, after a second optimizer step and sync
vLLM's sampled-token log-probs equal the trainer's (<= 1e-4), bytes received equal the analytic
lower bound, the reported peak is what a bucket allocates and within the bucket size (unless one
layer alone exceeds it), a sync is one vLLM reload processing each layer once with no layer left
unloaded, and failed generations or syncs never leave a half-loaded engine serving.
"""

from __future__ import annotations

import json
import re

import pytest
from safetensors.torch import load_file

from tests.conftest import ROOT, assert_succeeded, torchrun

SCRIPT = ROOT / "tests/distributed/scripts/rollout_checks.py"
CASES = {  # name: (model, processes, training TP, PP, engine TP)
    "tp1": ("qwen3-tied", 1, 1, 1, 1),
    "tp2": ("qwen2-untied", 2, 2, 1, 1),
    "pp2": ("llama-tied", 2, 1, 2, 1),
    "tp2pp2": ("qwen3-untied", 4, 2, 2, 1),
    "dp2-engine-tp2": ("qwen2-tied", 2, 1, 1, 2),
}


def rank0_lower_bound(model_dir, tp, pp, engine_tp) -> int:
    """Bytes training rank 0 (TP rank 0, first stage) lacks, counted from the HF tensors by hand."""
    tensors = {}
    for file in model_dir.glob("*.safetensors"):
        tensors.update(load_file(file))
    num_layers = 1 + max(int(m.group(1)) for n in tensors if (m := re.match(r"model\.layers\.(\d+)\.", n)))
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    padded_per_rank = -(-vocab // (128 * tp)) * 128  # megatron pads to 128 * TP rows
    missing = 0
    for name, tensor in tensors.items():
        row_bytes = tensor[0].numel() * 4 if tensor.dim() == 2 else 4
        full = tensor.numel() * 4
        if engine_tp > 1:
            # Engine TP2 at TP1 training: rank 0 holds everything it needs.
            continue
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        on_stage0 = (int(layer.group(1)) < num_layers // pp) if layer else name == "model.embed_tokens.weight" or pp == 1
        if not on_stage0:
            missing += full
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            missing += full - min(vocab, padded_per_rank) * row_bytes
        elif name.endswith("norm.weight"):
            continue
        else:
            missing += full - full // tp
    return missing


@pytest.mark.parametrize("case", CASES)
def test_rollout_after_resharding(tiny_models, tmp_path, case):
    model, nproc, tp, pp, engine_tp = CASES[case]
    result = torchrun(nproc, SCRIPT, "--hf", tiny_models[model], "--out", tmp_path, "--tp", tp, "--pp", pp,
                      "--engine-tp", engine_tp)
    assert_succeeded(result)
    report = json.loads(next(l for l in result.stdout.splitlines() if l.startswith("REPORT ")).removeprefix("REPORT "))
    assert report["hf_engine_bit_identical"] and report["vllm_plain_bit_identical"], report
    assert report["vllm_plain_tensors_checked"] >= 9
    assert report["greedy_tokens_equal"] and report["greedy_logprob_diff"] <= 1e-4, report
    assert report["rollout_vs_trainer_logprob_diff"] <= 1e-4, report
    assert report["buckets"] > 1 and report["reloads_per_sync"] == 1, report
    assert report["layers_processed_once"] and report["failed_load_warnings"] == [], report
    assert report["bytes_received"] == report["lower_bound"] == rank0_lower_bound(tiny_models[model], tp, pp, engine_tp)
    assert 0 < report["peak_reported"] == report["peak_allocated"], report
    assert all(units == 1 for units in report["units_of_buckets_over_size"]), report
    assert report["long_prompt_rejected"] and report["after_failed_generation_equal"], report
    # vLLM's loader rejects the norm of the wrong shape: "Attempted to load weight (torch.Size([3])) into ..."
    assert report["failed_load_error"].startswith("AssertionError: ") and "Size([3])" in report["failed_load_error"]
    assert "step 7" in report["refused_after_failed_sync"], report
    assert report["rolled_back_tokens_equal"] and report["rolled_back_logprob_diff"] <= 1e-6, report
    assert report["recovered_tokens_equal"], report
