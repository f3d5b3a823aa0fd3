"""Reading the architecture from HF configs, and clear errors for what megarl does not support."""

from __future__ import annotations

import pytest

from megarl.models.architecture import architecture_from_hf, check_layout_fits

BASE = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 101,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
}


def test_qwen3_switches():
    arch = architecture_from_hf(BASE)
    assert (arch.family, arch.qk_norm, arch.qkv_bias, arch.head_dim, arch.rope_theta) == ("qwen3", True, False, 32, 5e5)
    assert arch.heads_per_group == 2 and arch.tie_word_embeddings


def test_qwen2_has_qkv_bias_and_default_head_dim():
    config = dict(BASE, architectures=["Qwen2ForCausalLM"], head_dim=None)
    arch = architecture_from_hf(config)
    assert arch.qkv_bias and not arch.qk_norm and arch.head_dim == 16


def test_value_model_and_llama3_rope():
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    arch = architecture_from_hf(dict(BASE, architectures=["LlamaForTokenClassification"], rope_parameters=rope,
                                     num_labels=1))
    assert arch.value_model and arch.rope_type == "llama3" and arch.rope_factor == 8.0
    assert arch.hf_architecture() == "LlamaForTokenClassification"


@pytest.mark.parametrize("change,needle", [
    ({"architectures": ["MistralForCausalLM"]}, "LlamaForCausalLM"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type must be one of"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}}, "llama3"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_configs_fail_naming_the_field(change, needle):
    with pytest.raises(ValueError, match=needle) as error:
        architecture_from_hf(dict(BASE, **change), source="m/config.json")
    assert "m/config.json" in str(error.value) and "\n" not in str(error.value)


def test_layout_must_fit_the_model():
    arch = architecture_from_hf(BASE)
    check_layout_fits(arch, tp=2, pp=4)
    with pytest.raises(ValueError, match="actor.pp=3"):
        check_layout_fits(arch, tp=1, pp=3)
    with pytest.raises(ValueError, match="actor.tp=4"):
        check_layout_fits(arch, tp=4, pp=1)
