"""The HF <-> megatron slice mapping, checked by hand on small shapes (no processes needed)."""

from __future__ import annotations

import pytest
import torch

from megarl.models.architecture import Architecture, LatentAttention, padded_vocab_size
from megarl.models.state_dict_adapter import (
    ParamMapping,
    Piece,
    assemble_shard,
    merge_shards,
    param_mapping,
    shard_pieces,
    tp_split,
)

ARCH = Architecture(
    family="qwen2", value_model=False, num_layers=2, hidden_size=8, num_attention_heads=4, num_kv_heads=2,
    head_dim=2, ffn_hidden_size=6, vocab_size=10, max_position_embeddings=16, rope_theta=1e4,
    rope_type="default", rope_factor=1.0, rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True,
    qk_norm=False, initializer_range=0.02,
)
QKV = ParamMapping("decoder.layers.0.self_attention.linear_qkv.weight", "qkv", ("q", "k", "v"))


def test_qkv_pieces_follow_query_groups_by_hand():
    # 4 heads in 2 groups of 2, head dim 2: group g owns q rows [4g, 4g+4), k and v rows [2g, 2g+2).
    assert shard_pieces(QKV, ARCH, (8, 8), tp_rank=1, tp=2) == [
        Piece("q", 0, 4, 8), Piece("k", 0, 2, 4), Piece("v", 0, 2, 4),
    ]
    assert shard_pieces(QKV, ARCH, (16, 8), tp_rank=0, tp=1) == [
        Piece("q", 0, 0, 4), Piece("k", 0, 0, 2), Piece("v", 0, 0, 2),
        Piece("q", 0, 4, 8), Piece("k", 0, 2, 4), Piece("v", 0, 2, 4),
    ]


def test_vocab_padding_is_zero_rows_past_the_vocabulary():
    assert padded_vocab_size(10, divisible_by=4, tp=2) == 16
    embed = ParamMapping("embedding.word_embeddings.weight", "vocab", ("e",))
    assert shard_pieces(embed, ARCH, (8, 8), tp_rank=0, tp=2) == [Piece("e", 0, 0, 8)]
    assert shard_pieces(embed, ARCH, (8, 8), tp_rank=1, tp=2) == [Piece("e", 0, 8, 10), Piece(None, 0, 0, 6)]


def _hf_tensors(mapping: ParamMapping) -> dict[str, torch.Tensor]:
    shapes = {
        "qkv": {"q": (8, 8), "k": (4, 8), "v": (4, 8)},
        "gate_up": {"gate": (6, 8), "up": (6, 8)},
        "row": {"o": (8, 8)},
        "vocab": {"e": (10, 8)},
        "replicated": {"n": (8,)},
    }[mapping.kind]
    return {name: torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1000 * i
            for i, (name, shape) in enumerate(shapes.items())}


MAPPINGS = [
    QKV,
    ParamMapping("mlp.linear_fc1.weight", "gate_up", ("gate", "up")),
    ParamMapping("self_attention.linear_proj.weight", "row", ("o",)),
    ParamMapping("embedding.word_embeddings.weight", "vocab", ("e",)),
    ParamMapping("input_layernorm.weight", "replicated", ("n",)),
]
SHARD_SHAPES = {"qkv": (16, 8), "gate_up": (12, 8), "row": (8, 8), "vocab": (16, 8), "replicated": (8,)}


@pytest.mark.parametrize("mapping", MAPPINGS, ids=lambda m: m.kind)
@pytest.mark.parametrize("tp", [1, 2])
def test_assemble_then_merge_is_identity_and_reads_only_own_bytes(mapping, tp):
    hf = _hf_tensors(mapping)
    full_shape = list(SHARD_SHAPES[mapping.kind])
    split_dim = 1 if mapping.kind == "row" else 0
    if mapping.kind != "replicated":
        full_shape[split_dim] //= tp
    shards, read_bytes = [], 0
    for tp_rank in range(tp):
        def read(name, dim, start, stop):
            nonlocal read_bytes
            part = hf[name].narrow(dim, start, stop - start)
            read_bytes += part.numel() * 4
            return part
        shards.append(assemble_shard(mapping, ARCH, full_shape, tp_rank, tp, read))
    merged = merge_shards(mapping, ARCH, shards)
    assert merged.keys() == hf.keys()
    for name in hf:
        assert torch.equal(merged[name], hf[name])
    # Every HF byte is read once per rank that needs it: once overall unless replicated.
    total = sum(t.numel() * 4 for t in hf.values())
    assert read_bytes == (total * tp if mapping.kind == "replicated" else total)


def test_gate_up_shard_is_gate_slice_then_up_slice():
    hf = _hf_tensors(MAPPINGS[1])
    read = lambda name, dim, start, stop: hf[name][start:stop]  # noqa: E731
    shard = assemble_shard(MAPPINGS[1], ARCH, (6, 8), tp_rank=1, tp=2, read=read)
    assert torch.equal(shard, torch.cat([hf["gate"][3:6], hf["up"][3:6]]))


def test_shape_mismatch_names_the_parameter():
    hf = _hf_tensors(MAPPINGS[2])
    read = lambda name, dim, start, stop: hf[name].narrow(dim, start, stop - start)  # noqa: E731
    with pytest.raises(ValueError, match="linear_proj.weight"):
        assemble_shard(MAPPINGS[2], ARCH, (5, 4), 0, 2, read)


def _moe(family: str) -> Architecture:
    return Architecture(**{**vars(ARCH), "family": family, "num_experts": 8, "moe_topk": 2, "moe_ffn_hidden_size": 4})


@pytest.mark.parametrize("name", ["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight",
                                  "decoder.layers.1.mlp.experts.linear_fc1.weight2"])  # local and TE grouped
def test_expert_names_are_global_experts_of_the_global_layer(name):
    # Local layer 1 is global layer 3 (second stage); local expert 2 of the EP rank starting at expert 4 is expert 6.
    mapping = param_mapping(name, _moe("qwen3_moe"), {1: 3}, expert_offset=4)
    assert mapping == ParamMapping(name, "gate_up", ("model.layers.3.mlp.experts.6.gate_proj.weight",
                                                     "model.layers.3.mlp.experts.6.up_proj.weight"), expert=True)
    mixtral = param_mapping(name.replace("fc1", "fc2"), _moe("mixtral"), {1: 3}, expert_offset=4)
    assert (mixtral.kind, mixtral.hf_names, mixtral.expert) == (
        "row", ("model.layers.3.block_sparse_moe.experts.6.w2.weight",), True)


def test_router_and_shared_expert_are_split_like_dense_weights():
    layers = {0: 0}
    router = param_mapping("decoder.layers.0.mlp.router.weight", _moe("mixtral"), layers)
    assert (router.kind, router.hf_names) == ("replicated", ("model.layers.0.block_sparse_moe.gate.weight",))
    shared = param_mapping("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", _moe("qwen2_moe"), layers)
    assert (shared.kind, shared.expert) == ("gate_up", False)
    assert shared.hf_names == ("model.layers.0.mlp.shared_expert.gate_proj.weight",
                               "model.layers.0.mlp.shared_expert.up_proj.weight")
    gate = param_mapping("decoder.layers.0.mlp.shared_experts.gate_weight", _moe("qwen2_moe"), layers)
    assert gate.hf_names == ("model.layers.0.mlp.shared_expert_gate.weight",)


def test_experts_split_over_expert_tensor_parallel_ranks():
    layout = type("Layout", (), {"tp_rank": 1, "tp": 2, "etp_rank": 0, "etp": 1})
    expert = ParamMapping("e", "row", ("down",), expert=True)
    assert tp_split(expert, layout) == (0, 1)
    assert tp_split(ParamMapping("d", "row", ("down",)), layout) == (1, 2)


def test_latent_attention_names_and_splits():
    # Query latent 6, key/value latent 4 + RoPE key 2: megatron's local layers split the down
    # projections' rows over TP like the up projections'; Transformer Engine keeps them whole on every rank.
    mla = Architecture(**{**vars(_moe("deepseek_v3")), "mla": LatentAttention(6, 4, 2, 2, 2), "router_bias": True})
    layers = {0: 0}
    down = param_mapping("decoder.layers.0.self_attention.linear_kv_down_proj.weight", mla, layers)
    assert (down.kind, down.hf_names) == ("latent_down", ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight",))
    assert shard_pieces(down, mla, (3, 8), tp_rank=1, tp=2) == [Piece(down.hf_names[0], 0, 3, 6)]
    assert shard_pieces(down, mla, (6, 8), tp_rank=1, tp=2) == [Piece(down.hf_names[0], 0, 0, 6)]
    q_down = param_mapping("decoder.layers.0.self_attention.linear_q_down_proj.weight", mla, layers)
    assert shard_pieces(q_down, mla, (6, 8), tp_rank=1, tp=2) == [Piece(q_down.hf_names[0], 0, 0, 6)]
    up = param_mapping("decoder.layers.0.self_attention.linear_kv_up_proj.weight", mla, layers)
    assert shard_pieces(up, mla, (8, 4), tp_rank=1, tp=2) == [
        Piece("model.layers.0.self_attn.kv_b_proj.weight", 0, 8, 16)]
    norms = {n: param_mapping(f"decoder.layers.0.self_attention.{n}", mla, layers).hf_names[0]
             for n in ("q_layernorm.weight", "kv_layernorm.weight", "linear_q_up_proj.layer_norm_weight")}
    assert norms == {"q_layernorm.weight": "model.layers.0.self_attn.q_a_layernorm.weight",
                     "kv_layernorm.weight": "model.layers.0.self_attn.kv_a_layernorm.weight",
                     "linear_q_up_proj.layer_norm_weight": "model.layers.0.self_attn.q_a_layernorm.weight"}
    bias = param_mapping("decoder.layers.0.mlp.router.expert_bias", mla, layers)
    assert (bias.kind, bias.hf_names) == ("replicated", ("model.layers.0.mlp.gate.e_score_correction_bias",))
    shared = param_mapping("decoder.layers.0.mlp.shared_experts.linear_fc2.weight", mla, layers)
    assert shared.hf_names == ("model.layers.0.mlp.shared_experts.down_proj.weight",)
