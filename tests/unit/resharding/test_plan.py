"""The resharding plan is pure: checked by hand for TP4xPP2 training -> TP_r=2 engine, no processes."""

from __future__ import annotations

import pytest

from megarl.models.architecture import Architecture
from megarl.models.state_dict_adapter import ParamMapping, shard_pieces
from megarl.resharding.engine_layout import engine_needs
from megarl.resharding.executor import hf_shapes_from, layer_buckets
from megarl.resharding.plan import SourcePiece, Transfer, make_plan

ARCH = Architecture(
    family="llama", value_model=False, num_layers=2, hidden_size=16, num_attention_heads=8, num_kv_heads=4,
    head_dim=2, ffn_hidden_size=8, vocab_size=10, max_position_embeddings=32, rope_theta=1e4, rope_type="default",
    rope_factor=1.0, rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=False, qk_norm=False,
    initializer_range=0.02,
)
TP, PP = 4, 2
PADDED_VOCAB = 12  # make_vocab_size_divisible_by=1: 10 rows padded to a multiple of TP


def _stage_mappings(stage: int) -> list[tuple[ParamMapping, tuple[int, ...]]]:
    """Megatron parameters of one pipeline stage (one layer each) with their TP4 shard shapes."""
    layer = f"model.layers.{stage}."
    local = "decoder.layers.0."
    mappings = [
        (ParamMapping(local + "input_layernorm.weight", "replicated", (layer + "input_layernorm.weight",)), (16,)),
        (ParamMapping(local + "self_attention.linear_qkv.weight", "qkv",
                      tuple(layer + f"self_attn.{p}_proj.weight" for p in "qkv")), (8, 16)),
        (ParamMapping(local + "self_attention.linear_proj.weight", "row", (layer + "self_attn.o_proj.weight",)), (16, 4)),
        (ParamMapping(local + "pre_mlp_layernorm.weight", "replicated", (layer + "post_attention_layernorm.weight",)), (16,)),
        (ParamMapping(local + "mlp.linear_fc1.weight", "gate_up",
                      (layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight")), (4, 16)),
        (ParamMapping(local + "mlp.linear_fc2.weight", "row", (layer + "mlp.down_proj.weight",)), (16, 2)),
    ]
    if stage == 0:
        mappings.append((ParamMapping("embedding.word_embeddings.weight", "vocab", ("model.embed_tokens.weight",)), (3, 16)))
    else:
        mappings.append((ParamMapping("decoder.final_layernorm.weight", "replicated", ("model.norm.weight",)), (16,)))
        mappings.append((ParamMapping("output_layer.weight", "vocab", ("lm_head.weight",)), (3, 16)))
    return mappings


def _sources():
    sources, shard_shapes = [], {}
    for stage in range(PP):
        for tp_rank in range(TP):
            rank = stage * TP + tp_rank  # megatron orders ranks tp fastest, pp slowest
            for mapping, shape in _stage_mappings(stage):
                shard_shapes[(rank, mapping.megatron_name)] = shape
                offset = 0
                for piece in shard_pieces(mapping, ARCH, shape, tp_rank, TP):
                    if piece.hf_name is not None:
                        sources.append(SourcePiece(rank, piece.hf_name, piece.dim, piece.start, piece.stop,
                                                   mapping.megatron_name, offset))
                    offset += piece.size
    return sources, hf_shapes_from(sources, shard_shapes)


@pytest.fixture(scope="module")
def plan():
    sources, shapes = _sources()
    needs = [n for rank in range(TP * PP) for n in engine_needs(rank, rank % 2, 2, shapes, ARCH)]
    return make_plan(sources, needs, shapes, itemsize=4)


def test_hf_shapes_are_recovered_from_the_shards(plan):
    assert plan.hf_shapes["model.embed_tokens.weight"] == (10, 16)
    assert plan.hf_shapes["model.layers.1.self_attn.q_proj.weight"] == (16, 16)
    assert plan.hf_shapes["model.layers.0.self_attn.k_proj.weight"] == (8, 16)
    assert plan.hf_shapes["model.layers.0.mlp.down_proj.weight"] == (16, 8)


def test_engine_rank0_q_proj_transfers_by_hand(plan):
    # Engine rank 0 (vLLM TP rank 0 of 2) needs q heads 0-3 = rows [0, 8). Training TP rank r holds the
    # rows of query group r: [4r, 4r + 4). Layer 0 lives on ranks 0-3, layer 1 on ranks 4-7.
    def q_transfers(layer):
        return [t for t in plan.transfers if t.dst == 0 and t.hf_name == f"model.layers.{layer}.self_attn.q_proj.weight"]

    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert q_transfers(0) == [Transfer(0, 0, "model.layers.0.self_attn.q_proj.weight", 0, 0, 4, qkv, 0),
                              Transfer(1, 0, "model.layers.0.self_attn.q_proj.weight", 0, 4, 8, qkv, 0)]
    assert [(t.src, t.start, t.stop) for t in q_transfers(1)] == [(4, 0, 4), (5, 4, 8)]
    # o_proj: megatron splits its columns by 4, vLLM by 2: rank 0 keeps columns [0, 4), gets [4, 8).
    o = [t for t in plan.transfers if t.dst == 0 and t.hf_name == "model.layers.0.self_attn.o_proj.weight"]
    assert [(t.src, t.dim, t.start, t.stop) for t in o] == [(0, 1, 0, 4), (1, 1, 4, 8)]


def test_engine_rank0_lower_bound_by_hand(plan):
    # Layer 0 (held in part): q 4 rows, k and v 2 rows each, gate and up 2 rows each (x16 floats);
    # o_proj 4 columns and down_proj 2 columns (x16 rows). Norms are held.
    layer0 = (4 + 2 + 2 + 2 + 2) * 16 * 4 + (4 + 2) * 16 * 4
    # Layer 1 (held by stage 1): q 8, k 4, v 4, gate 4, up 4 rows; o 8 and down 4 columns; two norms.
    layer1 = (8 + 4 + 4 + 4 + 4) * 16 * 4 + (8 + 4) * 16 * 4 + 2 * 16 * 4
    embedding = (10 - 3) * 16 * 4  # megatron TP rank 0 holds vocab rows [0, 3)
    head_and_norm = 10 * 16 * 4 + 16 * 4  # last stage
    assert plan.lower_bound(0) == layer0 + layer1 + embedding + head_and_norm == 4736


@pytest.mark.parametrize("rank", range(TP * PP))
def test_every_need_is_covered_exactly_and_only_missing_bytes_move(plan, rank):
    assert plan.bytes_received(rank) == plan.lower_bound(rank)
    covered = sum(plan.slice_bytes(t.hf_name, t.dim, t.start, t.stop) for t in plan.transfers if t.dst == rank)
    assert covered == plan.bytes_needed(rank)
    for need in (n for n in plan.needs if n.rank == rank):
        pieces = sorted((t.start, t.stop) for t in plan.transfers if t.dst == rank and t.hf_name == need.hf_name)
        assert pieces[0][0] == need.start and pieces[-1][1] == need.stop
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))  # contiguous, no overlap


def test_senders_are_balanced_across_replicas():
    # At engine TP 1 every rank needs everything. Replicated tensors (norms) have four holders per
    # stage; choosing the holder that has sent least keeps every rank's sent bytes within one norm
    # (and one vocab row block) of the others.
    sources, shapes = _sources()
    needs = [n for rank in range(TP * PP) for n in engine_needs(rank, 0, 1, shapes, ARCH)]
    plan = make_plan(sources, needs, shapes, itemsize=4)
    sent = [plan.bytes_sent(rank) for rank in range(TP * PP)]
    assert max(sent) - min(sent) <= 512, sent


def test_buckets_keep_layers_whole():
    _, shapes = _sources()
    buckets = layer_buckets(shapes, 4, bucket_bytes=1)
    assert buckets[0] == ["model.embed_tokens.weight"]
    assert all(len({n.split(".")[2] for n in b}) == 1 for b in buckets if b[0].startswith("model.layers."))
    assert buckets[-1] == ["lm_head.weight"] and sorted(sum(buckets, [])) == sorted(shapes)
