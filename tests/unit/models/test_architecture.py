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


QWEN3_MOE = dict(BASE, architectures=["Qwen3MoeForCausalLM"], num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def test_moe_families():
    qwen3 = architecture_from_hf(QWEN3_MOE)
    assert (qwen3.family, qwen3.is_moe, qwen3.num_experts, qwen3.moe_topk, qwen3.moe_ffn_hidden_size) == (
        "qwen3_moe", True, 8, 2, 32)
    assert qwen3.qk_norm and qwen3.moe_norm_topk_prob and not qwen3.shared_expert_ffn_hidden_size
    qwen2 = architecture_from_hf(dict(QWEN3_MOE, architectures=["Qwen2MoeForTokenClassification"], num_labels=1,
                                      norm_topk_prob=False, shared_expert_intermediate_size=96))
    assert (qwen2.family, qwen2.value_model, qwen2.qkv_bias, qwen2.qk_norm) == ("qwen2_moe", True, True, False)
    assert (qwen2.shared_expert_ffn_hidden_size, qwen2.shared_expert_gate,
            qwen2.moe_norm_topk_prob) == (96, True, False)
    assert qwen2.hf_architecture() == "Qwen2MoeForTokenClassification"
    # Mixtral: the expert count under its other name, experts of the model's intermediate size, always renormalised.
    mixtral = architecture_from_hf(dict(BASE, architectures=["MixtralForCausalLM"], num_local_experts=4,
                                        num_experts_per_tok=2, sliding_window=None))
    assert (mixtral.num_experts, mixtral.moe_ffn_hidden_size, mixtral.moe_norm_topk_prob) == (4, 128, True)
    assert not architecture_from_hf(BASE).is_moe


@pytest.mark.parametrize("change,needle", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "sliding_window": 4096}, "sliding_window"),
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "router_jitter_noise": 0.1},
     "router_jitter_noise"),
])
def test_moe_layers_must_all_be_sparse_and_plain(change, needle):
    with pytest.raises(ValueError, match=needle) as error:
        architecture_from_hf(dict(QWEN3_MOE, **change), source="m/config.json")
    assert "m/config.json" in str(error.value) and "\n" not in str(error.value)


def test_expert_parallelism_needs_a_moe_model_and_fitting_experts():
    with pytest.raises(ValueError, match="actor.ep=2 needs a mixture-of-experts model; this qwen3 model is dense"):
        check_layout_fits(architecture_from_hf(BASE), tp=1, pp=1, ep=2)
    check_layout_fits(architecture_from_hf(QWEN3_MOE), tp=1, pp=1, ep=8)
    with pytest.raises(ValueError, match="actor.ep=3 must divide the number of experts 8"):
        check_layout_fits(architecture_from_hf(QWEN3_MOE), tp=1, pp=1, ep=3)


UNSUPPORTED_CHANGES = [  # (change to BASE, what the error names)
    ({"architectures": ["MistralForCausalLM"]}, "LlamaForCausalLM"),
    ({"architectures": ["GptOssForCausalLM"]},
     r"architectures=\['GptOssForCausalLM'\] is not supported; supported: .*Glm4MoeForCausalLM"),
    ({"architectures": ["Qwen3NextForCausalLM"]}, "DeepseekV3ForCausalLM"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type must be one of"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}}, "llama3"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
]


def test_layout_must_fit_the_model():
    arch = architecture_from_hf(BASE)
    check_layout_fits(arch, tp=2, pp=4)
    with pytest.raises(ValueError, match="actor.pp=3"):
        check_layout_fits(arch, tp=1, pp=3)
    with pytest.raises(ValueError, match="actor.tp=4"):
        check_layout_fits(arch, tp=4, pp=1)


# DeepSeek-V3's own config.json fields, at a tiny size.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 101, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 4, "n_group": 4,
    "topk_group": 2, "moe_intermediate_size": 24, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 1,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}
GLM4_MOE = dict(BASE, architectures=["Glm4MoeForCausalLM"], head_dim=16, attention_bias=True, use_qk_norm=True,
                partial_rotary_factor=0.5, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                moe_intermediate_size=24, first_k_dense_replace=3, routed_scaling_factor=1.0, n_group=1, topk_group=1)


def test_deepseek_v3_latent_attention_routing_and_dense_first_layers():
    arch = architecture_from_hf(DEEPSEEK_V3)
    assert (arch.family, arch.mla.q_lora_rank, arch.mla.kv_lora_rank, arch.mla.rope_head_dim, arch.head_dim) == (
        "deepseek_v3", 48, 32, 8, 24)
    assert (arch.router_score, arch.router_bias, arch.router_groups, arch.router_group_topk) == ("sigmoid", True, 4, 2)
    assert (arch.routed_scaling_factor, arch.shared_expert_ffn_hidden_size, arch.shared_expert_gate) == (2.5, 48, False)
    assert [arch.is_moe_layer(layer) for layer in range(4)] == [False, True, True, True]
    assert arch.rope_type == "yarn" and arch.yarn.factor == 40 and arch.yarn.mscale_all_dim == 1.0
    assert arch.mtp_layers == 1 and not arch.qkv_bias and not arch.qk_norm
    moonlight = architecture_from_hf(dict(DEEPSEEK_V3, q_lora_rank=None, rope_scaling=None, n_group=1, topk_group=1))
    assert moonlight.mla.q_lora_rank is None and moonlight.yarn is None and moonlight.router_groups == 1


def test_glm4_moe_partial_rope_biases_and_qk_norm():
    arch = architecture_from_hf(GLM4_MOE)
    assert (arch.family, arch.rotary_percent, arch.qkv_bias, arch.qk_norm, arch.mla) == (
        "glm4_moe", 0.5, True, True, None)
    assert arch.dense_layers == 3 and arch.router_bias and arch.shared_expert_ffn_hidden_size == 24


DEEPSEEK_V2 = dict(DEEPSEEK_V3, architectures=["DeepseekV2ForCausalLM"], topk_method="greedy", norm_topk_prob=False,
                   scoring_func="softmax", n_group=1, topk_group=1)
DEEPSEEK_V3_CHANGES = [  # what megatron-core cannot compute as transformers does
    ({"topk_group": 1}, "topk_group.*expected topk_group=2"),  # groups scored by their top 4, HF's by their top 2
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "rope_parameters"),
]
DEEPSEEK_V2_CHANGES = [({"topk_method": "group_limited_greedy"}, "topk_method"),
                       ({"norm_topk_prob": True}, "norm_topk_prob")]


@pytest.mark.parametrize("base,change,needle", [(BASE, *case) for case in UNSUPPORTED_CHANGES]
                         + [(DEEPSEEK_V3, *case) for case in DEEPSEEK_V3_CHANGES]
                         + [(DEEPSEEK_V2, *case) for case in DEEPSEEK_V2_CHANGES])
def test_unsupported_configs_fail_naming_the_field(base, change, needle):
    with pytest.raises(ValueError, match=needle) as error:
        architecture_from_hf(dict(base, **change), source="m/config.json")
    assert "m/config.json" in str(error.value) and "\n" not in str(error.value)


def test_latent_attention_layouts_split_heads_and_latents():
    arch = architecture_from_hf(DEEPSEEK_V3)
    check_layout_fits(arch, tp=4, pp=2, ep=8)
    with pytest.raises(ValueError, match="actor.tp=8 must divide num_attention_heads=4"):
        check_layout_fits(arch, tp=8, pp=1)
    with pytest.raises(ValueError, match=r"actor.tp=3 must divide"):
        check_layout_fits(arch, tp=3, pp=1)


def test_deepseek_v2_routes_by_softmax_without_renormalising():
    arch = architecture_from_hf(DEEPSEEK_V2)
    assert (arch.family, arch.router_score, arch.router_bias, arch.moe_norm_topk_prob) == ("deepseek_v2", "softmax",
                                                                                           False, False)
    assert arch.mla.kv_lora_rank == 32 and arch.routed_scaling_factor == 2.5 and arch.dense_layers == 1
