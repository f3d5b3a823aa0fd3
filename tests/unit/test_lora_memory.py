"""bench/lora_memory.py's formula on two tiny models, every number counted by hand below."""

import pytest

from bench.lora_memory import TARGETS, Layout, LoRA, Model, footprint

# h 4, 2 layers, 2 query heads and 1 KV head of 2, ffn 8, vocab 10 (padded to 128 x TP).
DENSE = Model("dense", hidden_size=4, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=2, ffn_hidden_size=8,
              vocab_size=10)


def test_full_fine_tuning_at_tp2_dp2():
    full = footprint(DENSE, Layout(tp=2, pp=1, dp=2, engine_tp=2))
    # A layer on one TP rank: qkv (2 + 1 + 1) * 2 = 8 rows x 4 / 2 = 16, o 4 x 4 / 2 = 8, MLP 3 x 4 x 8 / 2 = 48,
    # norms 2 x 4 = 8: 80; 2 layers 160; embedding and LM head 256 x 4 / 2 = 512 each; final norm 4.
    assert full.trainable_params == 160 + 512 + 512 + 4 == 1188
    assert (full.weight_bytes, full.grad_bytes, full.optimizer_bytes) == (2 * 1188, 4 * 1188, 12 * 1188 / 2)
    # An engine rank at TP_r=2 (its 1 KV head replicated): a layer's q 2 x 4, k 2 x 4, v 2 x 4, o 4 x 2,
    # gate, up, down 4 x 4 each, norms 8: 88; embedding and LM head 5 x 4 each, final norm 4; bf16.
    assert full.sync_bytes == 2 * (2 * 88 + 20 + 20 + 4) == 440
    assert full.adapter_sync_bytes == 0


def test_lora_rank_2_on_all_targets_at_tp2_dp2():
    lora = footprint(DENSE, Layout(tp=2, pp=1, dp=2, engine_tp=2), LoRA(rank=2))
    # One TP rank, per layer: column q 2 x 4 + 4 / 2 x 2 = 12, k and v 2 x 4 + 2 / 2 x 2 = 10 each; row
    # o 2 x 4 / 2 + 4 x 2 = 12; gate and up 2 x 4 + 8 / 2 x 2 = 16 each; down 2 x 8 / 2 + 4 x 2 = 16.
    adapters = 2 * (12 + 10 + 10 + 12 + 16 + 16 + 16)
    assert lora.trainable_params == adapters == 184
    assert lora.weight_bytes == 2 * (1188 + 184)
    assert (lora.grad_bytes, lora.optimizer_bytes) == (4 * 184, 12 * 184 / 2)
    # Merged: the seven weights of an engine rank, 8 + 8 + 8 + 8 + 16 + 16 + 16 = 80 a layer.
    assert lora.sync_bytes == 2 * 2 * 80 == 320
    # The whole adapter: r (in + out) per target: 2 (8 + 6 + 6 + 8 + 12 + 12 + 12) = 128 a layer.
    assert lora.adapter_sync_bytes == 2 * 2 * 128 == 512


def test_pipeline_stages_and_bias():
    model = Model("biased", hidden_size=4, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=2, ffn_hidden_size=8,
                  vocab_size=10, qkv_bias=True)
    # PP2 splits 3 layers as 1 + 2 (the first stage holds the embedding); each layer at TP1: qkv 32 + bias 8,
    # o 16, MLP 96, norms 8 = 160. First stage 160 + 128 x 4 = 672; last 320 + 512 + 4 = 836: the largest.
    full = footprint(model, Layout(tp=1, pp=2, dp=1, engine_tp=1))
    assert full.trainable_params == 836
    # q_proj and v_proj only, rank 1: 2 layers x ((4 + 4) + (4 + 2)).
    assert footprint(model, Layout(tp=1, pp=2, dp=1, engine_tp=1), LoRA(1, ("q_proj", "v_proj"))).trainable_params \
        == 2 * 14


MOE = Model("moe", hidden_size=4, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2, ffn_hidden_size=0,
            vocab_size=10, num_experts=4, expert_ffn_hidden_size=2)


def test_moe_experts_shard_over_expert_dp():
    # 4 GPUs: TP1, EP2, so DP4 for the dense weights and expert DP 2 for the experts.
    full = footprint(MOE, Layout(tp=1, pp=1, dp=4, engine_tp=1, ep=2))
    # Dense: qkv 8 x 4, o 16, router 4 x 4, norms 8, embedding and LM head 128 x 4 each, final norm 4.
    dense = 32 + 16 + 16 + 8 + 512 + 512 + 4
    experts = 2 * 3 * 4 * 2  # 2 of the 4 experts, gate, up and down of 4 x 2
    assert full.trainable_params == dense + experts == 1148
    assert full.optimizer_bytes == pytest.approx(12 * (dense / 4 + experts / 2))
    # The engine (TP_r=1) needs every expert: q 16, k 8, v 8, o 16, norms 8, router 16, experts 96; vocab 40 + 40 + 4.
    assert full.sync_bytes == 2 * (168 + 84)


def test_moe_lora_is_attention_only():
    lora = footprint(MOE, Layout(tp=1, pp=1, dp=4, engine_tp=1, ep=2), LoRA(1, TARGETS[:4]))
    assert lora.trainable_params == (4 + 4) + (4 + 2) + (4 + 2) + (4 + 4)
    assert lora.sync_bytes == 2 * (16 + 8 + 8 + 16)
    with pytest.raises(ValueError, match="gate_proj"):
        footprint(MOE, Layout(tp=1, pp=1, dp=4, engine_tp=1, ep=2), LoRA(1))
