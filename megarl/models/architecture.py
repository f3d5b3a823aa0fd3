"""The decoder architecture read from a HuggingFace config: Llama, Qwen2, Qwen3 and their
mixture-of-experts relatives Qwen3-MoE, Qwen2-MoE and Mixtral.

One `Architecture` describes everything megarl needs to build the megatron-core model and to map
weights both ways. The families differ only in a few switches:
- Llama: no biases, RoPE with optional llama3 or linear scaling.
- Qwen2: bias on q/k/v (not on o_proj).
- Qwen3: per-head RMSNorm on q and k before RoPE (`qk_norm`), explicit head_dim.
- MoE families: every layer's MLP is `num_experts` SwiGLU experts of which a router picks
  `moe_topk` per token. Qwen3-MoE has Qwen3's attention; Qwen2-MoE has Qwen2's plus a shared
  expert whose output a sigmoid gate scales; Mixtral has Llama's. The top-k routing weights are
  renormalised to sum to one (`moe_norm_topk_prob`: always for Mixtral, per config for Qwen).
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
}
HF_CLASS_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3",
                   "qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe", "mixtral": "Mixtral"}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")

# megatron-core implements llama3 scaling with these constants only (rotary_pos_embedding.py).
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


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
    """"default", "linear" or "llama3"."""
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

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

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
    if config.get("attention_bias") and family not in ("qwen2", "qwen2_moe"):
        unsupported("attention_bias", "expected false (o_proj biases are not implemented)")
    if family == "mixtral" and config.get("sliding_window") is not None:
        unsupported("sliding_window", "expected null (sliding-window attention is not implemented)")
    if value_model and config.get("num_labels", len(config.get("id2label", {0: 0}))) != 1:
        unsupported("num_labels", "a value model has exactly one label")

    heads = config["num_attention_heads"]
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "linear", "llama3"):
        unsupported("rope_parameters", "rope_type must be one of default, linear, llama3")
    if rope_type == "llama3" and any(rope.get(k) != v for k, v in _MEGATRON_LLAMA3_ROPE.items()):
        unsupported("rope_parameters", f"megatron-core implements llama3 scaling with {_MEGATRON_LLAMA3_ROPE}")
    return Architecture(
        family=family,
        value_model=value_model,
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_attention_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        ffn_hidden_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        max_position_embeddings=config["max_position_embeddings"],
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        rope_factor=float(rope.get("factor", 1.0)),
        rms_norm_eps=config["rms_norm_eps"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or (family == "qwen2_moe" and config.get("qkv_bias", True)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        initializer_range=config.get("initializer_range", 0.02),
        **(_moe_fields(config, family, unsupported) if family in MOE_FAMILIES else {}),
    )


def _moe_fields(config: dict, family: str, unsupported) -> dict:
    """The mixture-of-experts fields of `Architecture`; every layer must be a sparse MoE layer."""
    if config.get("decoder_sparse_step", 1) != 1:
        unsupported("decoder_sparse_step", "expected 1 (every layer a mixture of experts)")
    if config.get("mlp_only_layers"):
        unsupported("mlp_only_layers", "expected [] (every layer a mixture of experts)")
    if config.get("router_jitter_noise"):
        unsupported("router_jitter_noise", "expected 0 (megatron's router has no jitter of this kind)")
    shared = (config.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
    return dict(
        num_experts=config.get("num_experts") or config["num_local_experts"],
        moe_topk=config["num_experts_per_tok"],
        moe_ffn_hidden_size=config["intermediate_size"] if family == "mixtral" else config["moe_intermediate_size"],
        shared_expert_ffn_hidden_size=shared,
        shared_expert_gate=shared > 0,
        moe_norm_topk_prob=family == "mixtral" or bool(config.get("norm_topk_prob", False)),
    )


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron pads the vocabulary so that every TP rank holds an equal, aligned slice."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def check_layout_fits(arch: Architecture, tp: int, pp: int, ep: int = 1) -> None:
    """Fail early, naming the layout key, when the model cannot be split this way."""
    if ep > 1 and not arch.is_moe:
        raise ValueError(f"actor.ep={ep} needs a mixture-of-experts model; this {arch.family} model is dense: use actor.ep=1")
    if arch.is_moe and arch.num_experts % ep:
        raise ValueError(f"actor.ep={ep} must divide the number of experts {arch.num_experts}")
    if arch.num_layers % pp:
        raise ValueError(f"actor.pp={pp} must divide num_hidden_layers={arch.num_layers}")
    if arch.num_kv_heads % tp:
        raise ValueError(f"actor.tp={tp} must divide num_key_value_heads={arch.num_kv_heads}")
