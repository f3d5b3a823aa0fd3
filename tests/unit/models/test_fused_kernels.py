"""Fused kernels and sequence parallelism are on exactly where they run (sequence parallelism also for
mixture-of-experts models on CPU), and megatron-core accepts
the configuration it gets on CUDA (its own checks run when the config is built, no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megarl import device
from megarl.models import builder
from megarl.models.architecture import Architecture

ARCH = Architecture(
    family="qwen2", value_model=False, num_layers=2, hidden_size=16, num_attention_heads=4, num_kv_heads=2,
    head_dim=4, ffn_hidden_size=32, vocab_size=64, max_position_embeddings=32, rope_theta=1e4, rope_type="default",
    rope_factor=1.0, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True, qk_norm=False,
    initializer_range=0.02,
)
OFF = dict.fromkeys(("bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion",
                     "gradient_accumulation_fusion", "sequence_parallel"), False)


@pytest.mark.parametrize(("cuda", "te", "layer_spec", "tp", "moe", "on"), [
    (False, False, "local", 2, False, set()),
    (False, False, "local", 1, True, set()),
    (False, False, "local", 2, True, {"sequence_parallel"}),  # megatron trains MoE at TP > 1 only with it
    (True, False, "local", 1, False, {"bias_activation_fusion", "bias_dropout_fusion"}),
    (True, False, "local", 2, False, {"bias_activation_fusion", "bias_dropout_fusion", "sequence_parallel"}),
    (True, True, "local", 1, False, {"bias_activation_fusion", "bias_dropout_fusion", "apply_rope_fusion"}),
    (True, True, "transformer_engine", 4, False, set(OFF)),
])
def test_speed_features_follow_the_device(monkeypatch, cuda, te, layer_spec, tp, moe, on):
    monkeypatch.setattr(device, "cuda", lambda: cuda)
    monkeypatch.setattr(device, "transformer_engine", lambda: cuda and te)
    assert builder.fused_kernels(layer_spec, tp, moe) == {**OFF, **dict.fromkeys(on, True)}


def test_megatron_accepts_the_cuda_configuration_without_transformer_engine(monkeypatch):
    """The features that need no extension package (SwiGLU and bias-dropout fusions, sequence
    parallelism at TP2) pass megatron-core's configuration checks for megarl's models."""
    monkeypatch.setattr(device, "cuda", lambda: True)
    monkeypatch.setattr(device, "transformer_engine", lambda: False)
    layout = SimpleNamespace(tp=2, pp=1, cp=1, ep=1)
    config = builder.transformer_config(ARCH, layout, "bfloat16", layer_spec="local")
    assert config.sequence_parallel and config.bias_activation_fusion and config.bias_dropout_fusion
