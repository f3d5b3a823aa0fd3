"""LoRA against PEFT at TP2 and at PP2, on a Qwen3-MoE's attention and routed experts at EP2 and on its attention at TP2
with sequence parallelism, and on a DeepSeek-V3's multi-latent attention at TP2
(tests/distributed/scripts/lora_checks.py): a PEFT adapter made here, A and B both non- zero, imported into the actor
gives PEFT's logits, its adapters off the base model's; exported back it is bit- identical; the served weights are
PEFT's merged model; one optimizer step moves the adapters alone, with PEFT's gradient norm for the same loss, and
the optimizer's gradient buffers hold exactly the adapters' elements."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tests.conftest import ROOT, assert_succeeded, reported, torchrun

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_adapter(model: str, targets: list[str], out):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    # init_lora_weights=False: B random too, so the adapter changes the logits from the first token on. On
    # transformers' fused experts PEFT puts gate_proj and up_proj into one adapter of rank 2r (target_parameters).
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("layout, model, targets", [
    (["--tp", "2"], "qwen2-untied", TARGETS), (["--pp", "2"], "qwen2-untied", TARGETS),
    (["--ep", "2"], "qwen3-moe", TARGETS),
    # An MoE at TP2 runs sequence-parallel (megarl.models.builder): attention's adapters take and give parts of the
    # sequence.
    (["--tp", "2"], "qwen3-moe", TARGETS[:4]),
    (["--tp", "2"], "deepseek-v3", ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])],
    ids=["tp2", "pp2", "ep2", "tp2-sequence-parallel", "tp2-latent-attention"])
def test_lora_matches_peft_and_trains_the_adapters_alone(tiny_models, tiny_moe_models, tmp_path, layout, model,
                                                         targets):
    model = {**tiny_models, **tiny_moe_models}[model]
    adapter = _peft_adapter(model, targets, tmp_path / "peft_adapter")
    result = torchrun(2, ROOT / "tests/distributed/scripts/lora_checks.py", "--model", model,
                      "--adapter", adapter, "--out", tmp_path, *layout)
    assert_succeeded(result)
    ranks = reported(result)
    first = ranks[0]
    assert first["peft_vs_base_logits_diff"] > 0.1  # the adapter matters
    assert first["adapted_logits_diff"] < 1e-4 and first["base_logits_diff"] < 1e-4
    assert first["served_vs_peft_merged_diff"] < 1e-6
    assert first["exported_names_equal"] and first["exported_bit_identical"]
    for report in ranks:
        assert report["base_unchanged"] and report["adapters_changed"] and report["trainable_names_are_adapters"]
        assert report["grad_buffer_elements"] == report["adapter_elements"] > 0
    assert first["grad_norm"] == pytest.approx(first["peft_grad_norm"], rel=5e-5)
