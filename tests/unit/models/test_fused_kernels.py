"""Fused kernels and sequence parallelism are on exactly where they run, and megatron-core accepts the
configuration it gets on CUDA (its own checks run when the config is built, no GPU needed):
- sequence parallelism with Transformer Engine's layers, and with the local layers for mixture-of-experts
  models only (megatron trains MoE at TP > 1 with it alone), on every device: megatron's torch norm,
  which the local layers use, asserts it away unless `cpu_compat`'s bridge (applied on CUDA too) builds it;
- RoPE fusion with TE's layers only: the local layers keep megatron's unfused RoPE, which takes the
  per-row positions of shared prompts;
- gradient-accumulation fusion with TE's layers and Apex's `fused_weight_gradient_mlp_cuda` only
  (megatron refuses to build a model that asks for it without the extension).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from megarl import device
from megarl.distributed import cpu_compat
from megarl.models import builder
from megarl.models.architecture import Architecture

ARCH = Architecture(
    family="qwen2", value_model=False, num_layers=2, hidden_size=16, num_attention_heads=4, num_kv_heads=2,
    head_dim=4, ffn_hidden_size=32, vocab_size=64, max_position_embeddings=32, rope_theta=1e4, rope_type="default",
    rope_factor=1.0, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True, qk_norm=False,
    initializer_range=0.02,
)
MOE_ARCH = dataclasses.replace(ARCH, family="qwen3_moe", num_experts=4, moe_topk=2, moe_ffn_hidden_size=8)
OFF = dict.fromkeys(("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
                     "gradient_accumulation_fusion", "sequence_parallel"), False)
SPEED = {"bias_activation_fusion", "bias_dropout_fusion"}  # megatron's jit fusions, on CUDA with any layers


@pytest.mark.parametrize(("cuda", "te", "grad_fusion", "layer_spec", "tp", "moe", "on"), [
    (False, False, False, "local", 2, False, set()),
    (False, False, False, "local", 1, True, set()),
    (False, False, False, "local", 2, True, {"sequence_parallel"}),  # megatron trains MoE at TP > 1 only with it
    (True, False, False, "local", 1, False, SPEED),
    (True, False, False, "local", 2, False, SPEED),  # megatron's torch norm asserts sequence parallelism away
    (True, False, True, "local", 2, True, SPEED | {"sequence_parallel"}),
    (True, True, True, "local", 1, False, SPEED),  # unfused RoPE: it takes per-row positions
    (True, True, True, "local", 4, False, SPEED),
    (True, True, True, "local", 4, True, SPEED | {"sequence_parallel"}),
    (True, True, True, "transformer_engine", 4, False, set(OFF)),
    (True, True, True, "transformer_engine", 1, True, set(OFF) - {"sequence_parallel"}),
    (True, True, False, "transformer_engine", 2, False, set(OFF) - {"gradient_accumulation_fusion"}),  # plain Apex
])
def test_speed_features_follow_the_device_and_layers(monkeypatch, cuda, te, grad_fusion, layer_spec, tp, moe, on):
    monkeypatch.setattr(device, "cuda", lambda: cuda)
    monkeypatch.setattr(device, "transformer_engine", lambda: cuda and te)
    monkeypatch.setattr(device, "gradient_accumulation_fusion", lambda: cuda and grad_fusion)
    assert builder.fused_kernels(layer_spec, tp, moe) == {**OFF, **dict.fromkeys(on, True)}


def test_latent_attention_fuses_yarn_rope_only(monkeypatch):
    """megatron-core's MLA refuses RoPE fusion without YaRN (Moonlight, DeepSeek-V2-Lite) at config time."""
    monkeypatch.setattr(device, "cuda", lambda: True)
    monkeypatch.setattr(device, "gradient_accumulation_fusion", lambda: True)
    assert not builder.fused_kernels("transformer_engine", 1, True, rope_fusable=False)["apply_rope_fusion"]
    assert builder.fused_kernels("transformer_engine", 1, True, rope_fusable=True)["apply_rope_fusion"]


def test_cuda_applies_the_bridges_of_the_local_layers(monkeypatch):
    """On CUDA, the two bridges standing in for Transformer Engine's and Apex's modules (the MoE router's
    `te_general_gemm`, the sequence-parallel torch norm) are applied too; the CUDA ones only on CPU."""
    monkeypatch.setattr(device, "cuda", lambda: True)
    on_cuda = {bridge.name for bridge in cpu_compat.needed_bridges()}
    assert on_cuda == {"te_general_gemm", "torch_norm_sequence_parallel"}
    monkeypatch.setattr(device, "cuda", lambda: False)
    assert cpu_compat.needed_bridges() == list(cpu_compat.BRIDGES)


@pytest.mark.parametrize("moe", [False, True])
def test_megatron_accepts_the_cuda_configuration_without_transformer_engine(monkeypatch, moe):
    """The features that need no extension package (SwiGLU and bias-dropout fusions; sequence
    parallelism at TP2 for an MoE model) pass megatron-core's configuration checks for megarl's models."""
    monkeypatch.setattr(device, "cuda", lambda: True)
    monkeypatch.setattr(device, "transformer_engine", lambda: False)
    layout = SimpleNamespace(tp=2, pp=1, cp=1, ep=2 if moe else 1, etp=1)
    arch = MOE_ARCH if moe else ARCH
    config = builder.transformer_config(arch, layout, "bfloat16", layer_spec="local")
    assert config.bias_activation_fusion and config.bias_dropout_fusion
    assert config.sequence_parallel == moe and not config.apply_rope_fusion and not config.gradient_accumulation_fusion


