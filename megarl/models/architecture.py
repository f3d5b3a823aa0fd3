"""The decoder architecture read from a HuggingFace config: Llama, Qwen2, Qwen3, their
mixture-of-experts relatives Qwen3-MoE, Qwen2-MoE and Mixtral, and the frontier MoE families
DeepSeek-V3 (DeepSeek-V3/V3.1/R1, Kimi-K2, Moonlight; DeepSeek-V2 differs in routing alone) and GLM-4.5
(GLM-4.5/4.6/4.7, GLM-4.5-Air).

One `Architecture` describes everything megarl needs to build the megatron-core model and to map
weights both ways. The families differ only in a few switches:
- Llama: no biases, RoPE with optional llama3 or linear scaling.
- Qwen2: bias on q/k/v (not on o_proj).
- Qwen3: per-head RMSNorm on q and k before RoPE (`qk_norm`), explicit head_dim.
- MoE families: every layer's MLP is `num_experts` SwiGLU experts of which a router picks
  `moe_topk` per token. Qwen3-MoE has Qwen3's attention; Qwen2-MoE has Qwen2's plus a shared
  expert whose output a sigmoid gate scales; Mixtral has Llama's. The top-k routing weights are
  renormalised to sum to one (`moe_norm_topk_prob`: always for Mixtral, per config for Qwen).
- DeepSeek-V3: multi-latent attention (`LatentAttention`: keys and values through one shared
  latent, queries optionally through a low-rank one, a decoupled RoPE part per head, YaRN), the
  first `first_k_dense_replace` layers dense, then sigmoid routing whose choice (not weights) adds a
  per-expert correction bias, limited to the best `topk_group` of `n_group` expert groups, weights
  renormalised and scaled by `routed_scaling_factor`, plus always-on shared experts.
- DeepSeek-V2: DeepSeek-V3 with softmax routing (`topk_method: greedy`): the chosen experts' entries
  of the softmax over all experts, scaled, not renormalised; no correction bias.
- GLM-4.5: grouped-query attention with q/k/v biases, optional qk-norm and RoPE on part of each head
  (`partial_rotary_factor`), with DeepSeek-V3's routing, shared experts and dense first layers.
Multi-token-prediction layers of either (`num_nextn_predict_layers`) are not loaded: RL trains the
next-token policy; they serve speculative decoding, which the rollout does not use.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

# HF `architectures` entry -> (family, is a value model). A value model is the
# `*ForTokenClassification` head with one label: one scalar per token (critic, reward model).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("qwen3", False),
    "LlamaForTokenClassification": ("llama", True),
    "Qwen2ForTokenClassification": ("qwen2", True),
    "Qwen3ForTokenClassification": ("qwen3", True),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False),
    "Qwen2MoeForCausalLM": ("qwen2_moe", False),
    "MixtralForCausalLM": ("mixtral", False),
    "Qwen3MoeForTokenClassification": ("qwen3_moe", True),
    "Qwen2MoeForTokenClassification": ("qwen2_moe", True),
    "MixtralForTokenClassification": ("mixtral", True),
    "DeepseekV3ForCausalLM": ("deepseek_v3", False),
    "DeepseekV3ForTokenClassification": ("deepseek_v3", True),
    "DeepseekV2ForCausalLM": ("deepseek_v2", False),
    "Glm4MoeForCausalLM": ("glm4_moe", False),
}
HF_CLASS_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe",
                   "qwen2_moe": "Qwen2Moe", "mixtral": "Mixtral", "deepseek_v3": "DeepseekV3", "glm4_moe": "Glm4Moe",
                   "deepseek_v2": "DeepseekV2"}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe", "deepseek_v2")
SIGMOID_ROUTED_FAMILIES = ("deepseek_v3", "glm4_moe")

# megatron-core implements llama3 scaling with these constants only (rotary_pos_embedding.py).
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class LatentAttention:
    """Multi-latent attention: every head's key and value are up-projected from one shared latent
    of `kv_lora_rank` (normalised), its query from the hidden state or from a normalised low-rank
    latent of `q_lora_rank`; RoPE acts on a separate `rope_head_dim` part of queries and keys
    (the key's part shared by all heads), on interleaved pairs."""

    q_lora_rank: int | None
    kv_lora_rank: int
    nope_head_dim: int
    rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class YarnScaling:
    """YaRN context extension: RoPE frequencies interpolated between `beta_slow` and `beta_fast`
    rotations, attention logits scaled by mscale(factor, `mscale_all_dim`) squared."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclass(frozen=True)
class Architecture:
    family: str
    value_model: bool
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_type: str
    """"default", "linear", "llama3" or "yarn" (multi-latent attention only)."""
    rope_factor: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    initializer_range: float
    num_experts: int = 0
    """Routed experts per layer; 0 for a dense model."""
    moe_topk: int = 0
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int = 0
    """Intermediate size of one routed expert."""
    shared_expert_ffn_hidden_size: int = 0
    """Intermediate size of the shared expert every token passes through (Qwen2-MoE); 0: none."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(gate . hidden) (Qwen2-MoE)."""
    moe_norm_topk_prob: bool = True
    """The top-k routing weights are renormalised to sum to one (softmax over the chosen experts'
    logits); otherwise they are the chosen entries of the softmax over all experts."""
    router_score: str = "softmax"
    """"softmax" or "sigmoid" (DeepSeek-V3, GLM-4.5: each expert's score on its own)."""
    router_bias: bool = False
    """A per-expert correction bias (`e_score_correction_bias`) is added to the scores for choosing
    experts, not for weighting them: aux-loss-free balancing's bias, part of the checkpoint."""
    router_groups: int = 1
    """Experts form this many equal groups; a token's experts come from its best `router_group_topk`
    groups, a group scored by the sum of its two best (bias-corrected) scores."""
    router_group_topk: int = 1
    routed_scaling_factor: float = 1.0
    """The routed experts' weights are scaled by this (the shared experts' are not)."""
    dense_layers: int = 0
    """The first layers have a dense MLP of `ffn_hidden_size` (`first_k_dense_replace`)."""
    rotary_percent: float = 1.0
    """RoPE rotates the first this-fraction of each head's dims (GLM-4.5: 0.5)."""
    mla: LatentAttention | None = None
    """Multi-latent attention (DeepSeek-V3) in place of grouped-query attention."""
    yarn: YarnScaling | None = None
    mtp_layers: int = 0
    """Multi-token-prediction layers in the checkpoint after the decoder's, not loaded."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.dense_layers

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    def hf_architecture(self) -> str:
        return HF_CLASS_PREFIX[self.family] + ("ForTokenClassification" if self.value_model else "ForCausalLM")


def read_hf_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not found; expected a HuggingFace model directory with config.json")
    with open(path) as f:
        return json.load(f)


def architecture_from_hf(config: dict, source: str = "config.json") -> Architecture:
    """Read an `Architecture` from a HF config dict; unsupported features fail naming the field."""
    names = config.get("architectures") or []
    if len(names) != 1 or names[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{source}: architectures={names} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    family, value_model = SUPPORTED_ARCHITECTURES[names[0]]

    def unsupported(field: str, allowed: str):
        raise ValueError(f"{source}: {field}={config.get(field)!r} is not supported for {family}; {allowed}")

    if config.get("hidden_act", "silu") != "silu":
        unsupported("hidden_act", "expected 'silu'")
    if config.get("use_sliding_window"):
        unsupported("use_sliding_window", "sliding-window attention is not implemented")
    if config.get("mlp_bias"):
        unsupported("mlp_bias", "expected false")
    if config.get("attention_bias") and family not in ("qwen2", "qwen2_moe", "glm4_moe"):
        unsupported("attention_bias", "expected false (o_proj biases are not implemented)")
    if family == "mixtral" and config.get("sliding_window") is not None:
        unsupported("sliding_window", "expected null (sliding-window attention is not implemented)")
    if value_model and config.get("num_labels", len(config.get("id2label", {0: 0}))) != 1:
        unsupported("num_labels", "a value model has exactly one label")

    heads = config["num_attention_heads"]
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    mla = _latent_attention(config, unsupported) if family in ("deepseek_v3", "deepseek_v2") else None
    if rope_type not in ("default", "linear", "llama3") and not (mla and rope_type == "yarn"):
        unsupported("rope_parameters", "rope_type must be one of default, linear, llama3 (and yarn with "
                    "multi-latent attention)")
    if rope_type == "llama3" and any(rope.get(k) != v for k, v in _MEGATRON_LLAMA3_ROPE.items()):
        unsupported("rope_parameters", f"megatron-core implements llama3 scaling with {_MEGATRON_LLAMA3_ROPE}")
    if mla and rope_type not in ("default", "yarn"):
        unsupported("rope_parameters", "multi-latent attention takes default or yarn RoPE")
    rotary_percent = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if rotary_percent != 1.0 and family != "glm4_moe":
        unsupported("partial_rotary_factor", "expected 1.0 (partial RoPE is read for GLM-4.5 only)")
    return Architecture(
        family=family,
        value_model=value_model,
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_attention_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=(mla.nope_head_dim + mla.rope_head_dim if mla
                  else config.get("head_dim") or config["hidden_size"] // heads),
        ffn_hidden_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        max_position_embeddings=config["max_position_embeddings"],
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        rope_factor=float(rope.get("factor", 1.0)),
        rms_norm_eps=config["rms_norm_eps"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=(family == "qwen2" or (family == "qwen2_moe" and config.get("qkv_bias", True))
                  or (family == "glm4_moe" and bool(config.get("attention_bias")))),
        qk_norm=family in ("qwen3", "qwen3_moe") or (family == "glm4_moe" and bool(config.get("use_qk_norm"))),
        initializer_range=config.get("initializer_range", 0.02),
        rotary_percent=rotary_percent,
        mla=mla,
        yarn=_yarn(rope, config) if rope_type == "yarn" else None,
        mtp_layers=config.get("num_nextn_predict_layers") or 0,
        **(_moe_fields(config, family, unsupported) if family in MOE_FAMILIES else {}),
    )


def _latent_attention(config: dict, unsupported) -> LatentAttention:
    if config.get("attention_bias"):
        unsupported("attention_bias", "expected false (multi-latent attention without biases)")
    if config.get("rope_interleave", True) is not True:
        unsupported("rope_interleave",
                    "expected true (megatron-core's multi-latent attention rotates interleaved pairs)")
    return LatentAttention(q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=config["kv_lora_rank"],
                           nope_head_dim=config["qk_nope_head_dim"], rope_head_dim=config["qk_rope_head_dim"],
                           v_head_dim=config["v_head_dim"])


def _yarn(rope: dict, config: dict) -> YarnScaling:
    original = rope.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    return YarnScaling(factor=float(rope["factor"]), original_max_position_embeddings=int(original),
                       beta_fast=float(rope.get("beta_fast", 32)), beta_slow=float(rope.get("beta_slow", 1)),
                       mscale=float(rope.get("mscale", 1)), mscale_all_dim=float(rope.get("mscale_all_dim", 0)))


def _moe_fields(config: dict, family: str, unsupported) -> dict:
    """The mixture-of-experts fields of `Architecture`; every layer must be a sparse MoE layer."""
    if config.get("decoder_sparse_step", 1) != 1:
        unsupported("decoder_sparse_step", "expected 1 (every layer a mixture of experts)")
    if config.get("mlp_only_layers"):
        unsupported("mlp_only_layers", "expected [] (every layer a mixture of experts)")
    if config.get("router_jitter_noise"):
        unsupported("router_jitter_noise", "expected 0 (megatron's router has no jitter of this kind)")
    if family in SIGMOID_ROUTED_FAMILIES:
        return _sigmoid_routed_moe_fields(config, unsupported)
    if family == "deepseek_v2":
        return _deepseek_v2_moe_fields(config, unsupported)
    shared = (config.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
    return dict(
        num_experts=config.get("num_experts") or config["num_local_experts"],
        moe_topk=config["num_experts_per_tok"],
        moe_ffn_hidden_size=config["intermediate_size"] if family == "mixtral" else config["moe_intermediate_size"],
        shared_expert_ffn_hidden_size=shared,
        shared_expert_gate=shared > 0,
        moe_norm_topk_prob=family == "mixtral" or bool(config.get("norm_topk_prob", False)),
    )


def _deepseek_moe_fields(config: dict, unsupported) -> dict:
    """What DeepSeek-V2, DeepSeek-V3 and GLM-4.5 name alike: routed and shared experts of
    `moe_intermediate_size`, routed scaling, dense first layers, then a mixture of experts in every layer."""
    if config.get("moe_layer_freq", 1) != 1:
        unsupported("moe_layer_freq", "expected 1 (every layer after first_k_dense_replace a mixture of experts)")
    return dict(
        num_experts=config["n_routed_experts"],
        moe_topk=config["num_experts_per_tok"],
        moe_ffn_hidden_size=config["moe_intermediate_size"],
        shared_expert_ffn_hidden_size=config["moe_intermediate_size"] * (config.get("n_shared_experts") or 0),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        dense_layers=config.get("first_k_dense_replace", 0),
    )


def _sigmoid_routed_moe_fields(config: dict, unsupported) -> dict:
    """DeepSeek-V3's and GLM-4.5's routing (`topk_method: noaux_tc`), as megatron-core's router
    computes it: sigmoid scores renormalised over the chosen experts, groups scored by their top
    `topk // topk_group` scores (HF's top two)."""
    if config.get("topk_method", "noaux_tc") != "noaux_tc":
        unsupported("topk_method", "expected 'noaux_tc' (sigmoid scores with a correction bias)")
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        unsupported("scoring_func", "expected 'sigmoid'")
    if not config.get("norm_topk_prob", True):
        unsupported("norm_topk_prob", "expected true (megatron-core renormalises sigmoid routing weights)")
    topk, groups, group_topk = config["num_experts_per_tok"], config.get("n_group") or 1, config.get("topk_group") or 1
    if groups > 1 and topk != 2 * group_topk:
        unsupported("topk_group", f"with n_group={groups}, megatron-core scores a group by its top "
                    f"num_experts_per_tok // topk_group experts, HF by its top 2: expected topk_group={topk // 2}")
    return dict(_deepseek_moe_fields(config, unsupported), router_score="sigmoid", router_bias=True,
                router_groups=groups, router_group_topk=group_topk)


def _deepseek_v2_moe_fields(config: dict, unsupported) -> dict:
    """DeepSeek-V2's routing as transformers computes it: softmax over all experts, the top-k entries
    scaled by `routed_scaling_factor`, never renormalised."""
    if config.get("topk_method", "greedy") != "greedy":
        unsupported("topk_method", "expected 'greedy' (megatron-core scores a group by the sum of its top "
                    "scores, DeepSeek-V2's group_limited_greedy by its best one)")
    if config.get("norm_topk_prob"):
        unsupported("norm_topk_prob", "expected false (transformers' DeepSeek-V2 ignores it, vLLM applies it)")
    return dict(_deepseek_moe_fields(config, unsupported), moe_norm_topk_prob=False)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocabulary so that every TP rank holds an equal, aligned slice."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def check_layout_fits(arch: Architecture, tp: int, pp: int, ep: int = 1) -> None:
    """Fail early, naming the layout key, when the model cannot be split this way."""
    if ep > 1 and not arch.is_moe:
        raise ValueError(f"actor.ep={ep} needs a mixture-of-experts model; this {arch.family} model is dense: "
                         "use actor.ep=1")
    if arch.is_moe and arch.num_experts % ep:
        raise ValueError(f"actor.ep={ep} must divide the number of experts {arch.num_experts}")
    if arch.num_layers % pp:
        raise ValueError(f"actor.pp={pp} must divide num_hidden_layers={arch.num_layers}")
    if arch.mla:
        for field, size in (("num_attention_heads", arch.num_attention_heads), ("q_lora_rank", arch.mla.q_lora_rank),
                            ("kv_lora_rank + qk_rope_head_dim", arch.mla.kv_lora_rank + arch.mla.rope_head_dim)):
            if size and size % tp:
                raise ValueError(f"actor.tp={tp} must divide {field}={size}")
    elif arch.num_kv_heads % tp:
        raise ValueError(f"actor.tp={tp} must divide num_key_value_heads={arch.num_kv_heads}")
