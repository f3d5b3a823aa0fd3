"""LoRA targets an architecture lacks, or whose adapters megarl cannot place, are refused in one line naming
actor.lora.target_modules and what the architecture allows."""

from __future__ import annotations

import pytest

from megarl.models.architecture import architecture_from_hf, read_hf_config
from megarl.models.lora import LoRASettings, _check_targets

MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def _check(models: dict, name: str, targets: list[str]) -> None:
    _check_targets(architecture_from_hf(read_hf_config(str(models[name]))), LoRASettings(4, 8.0, 0.0, tuple(targets)))


@pytest.mark.parametrize("name, targets", [
    ("qwen3-moe", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("deepseek-v3", MLA),
    ("deepseek-v3-no-q-lora-value", ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]),
    ("mixtral-untied", ["q_proj", "o_proj"]),
])
def test_what_an_architecture_has_is_accepted(tiny_moe_models, name, targets):
    _check(tiny_moe_models, name, targets)


@pytest.mark.parametrize("name, targets, fragments", [
    ("qwen3-moe", ["q_proj", "kv_b_proj"], ["qwen3_moe has no kv_b_proj", "allowed: q_proj, k_proj, v_proj"]),
    ("deepseek-v3", ["k_proj", "q_proj"], ["deepseek_v3 has no k_proj, q_proj", "allowed: q_a_proj, q_b_proj, "
                                           "kv_a_proj_with_mqa, kv_b_proj, o_proj, gate_proj"]),
    ("deepseek-v3", MLA + ["down_proj"], ["MLPs of deepseek_v3", "allowed: q_a_proj, q_b_proj"]),
    ("mixtral-untied", ["gate_proj", "up_proj"], ["MLPs of mixtral"]),
    ("qwen2-moe", ["down_proj"], ["MLPs of qwen2_moe"]),
    ("qwen3-moe", ["gate_proj"], ["gate_proj and up_proj are one fused weight"]),
])
def test_a_target_the_architecture_cannot_take_names_the_key(tiny_moe_models, name, targets, fragments):
    with pytest.raises(ValueError) as error:
        _check(tiny_moe_models, name, targets)
    message = str(error.value)
    assert message.startswith("config key 'actor.lora.target_modules' = ") and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
