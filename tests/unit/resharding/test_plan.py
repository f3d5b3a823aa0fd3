"""The resharding plan is pure: checked by hand for TP4xPP2 training -> TP_r=2 engine, against the
whole-world greedy planner it replaced, and at 1,024 ranks (TP8xPP8xDP16 -> TP_r=8), no processes."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from bench.resharding_cost_model import (HF_CONFIGS, TrainingLayout, architecture, plan_sync, rank_sources,
                                         stage_shard_shapes)

from megarl.models.architecture import Architecture, architecture_from_hf
from megarl.models.state_dict_adapter import ParamMapping, shard_pieces
from megarl.resharding.engine_layout import engine_needs
from megarl.resharding.executor import allocated_bytes, hf_shapes_from, layer_buckets
from megarl.resharding.plan import Plan, SourcePiece, Transfer, merge_plans, plan_for_rank

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
        (ParamMapping(local + "self_attention.linear_proj.weight", "row", (layer + "self_attn.o_proj.weight",)),
         (16, 4)),
        (ParamMapping(local + "pre_mlp_layernorm.weight", "replicated", (layer + "post_attention_layernorm.weight",)),
         (16,)),
        (ParamMapping(local + "mlp.linear_fc1.weight", "gate_up",
                      (layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight")), (4, 16)),
        (ParamMapping(local + "mlp.linear_fc2.weight", "row", (layer + "mlp.down_proj.weight",)), (16, 2)),
    ]
    if stage == 0:
        mappings.append((ParamMapping("embedding.word_embeddings.weight", "vocab", ("model.embed_tokens.weight",)),
                         (3, 16)))
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


def _world_plan(sources, shapes, engine_tp: int, world: int) -> Plan:
    """Every rank's own plan, merged, after checking that each transfer between two ranks is in the
    plans of both (a send without its receive, or the reverse, would hang the sync)."""
    def needs_of(rank, names):
        return engine_needs(rank, rank % engine_tp, engine_tp, shapes, ARCH, names)

    plans = [plan_for_rank(rank, sources, needs_of, shapes, itemsize=4) for rank in range(world)]
    for rank, plan in enumerate(plans):
        assert all(rank in (t.src, t.dst) for t in plan.transfers)
        for t in plan.transfers:
            assert t in plans[t.src].transfers and t in plans[t.dst].transfers, t
    return merge_plans(plans)


@pytest.fixture(scope="module")
def plan():
    sources, shapes = _sources()
    return _world_plan(sources, shapes, engine_tp=2, world=TP * PP)


def test_hf_shapes_are_recovered_from_the_shards(plan):
    assert plan.hf_shapes["model.embed_tokens.weight"] == (10, 16)
    assert plan.hf_shapes["model.layers.1.self_attn.q_proj.weight"] == (16, 16)
    assert plan.hf_shapes["model.layers.0.self_attn.k_proj.weight"] == (8, 16)
    assert plan.hf_shapes["model.layers.0.mlp.down_proj.weight"] == (16, 8)


def test_engine_rank0_q_proj_transfers_by_hand(plan):
    # Engine rank 0 (vLLM TP rank 0 of 2) needs q heads 0-3 = rows [0, 8). Training TP rank r holds the
    # rows of query group r: [4r, 4r + 4). Layer 0 lives on ranks 0-3, layer 1 on ranks 4-7.
    def q_transfers(layer):
        name = f"model.layers.{layer}.self_attn.q_proj.weight"
        return [t for t in plan.transfers if t.dst == 0 and t.hf_name == name]

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


def test_receivers_spread_evenly_over_the_holders_of_a_replicated_tensor():
    # At engine TP 1 every rank needs everything. A norm has four holders (the TP ranks of its
    # stage) and four receivers (the other stage's ranks): each holder sends it exactly once.
    sources, shapes = _sources()
    plan = _world_plan(sources, shapes, engine_tp=1, world=TP * PP)
    norms = [name for name in shapes if name.endswith("norm.weight")]
    for name in norms:
        senders = sorted(t.src for t in plan.transfers if t.hf_name == name and t.src != t.dst)
        holders = sorted(p.rank for p in sources if p.hf_name == name)
        assert senders == holders, name


def test_rank0_allocates_its_engine_shard_but_what_it_lends_and_staging_for_column_slices_by_hand():
    # Engine rank 0 (TP_r=2) needs columns [0, 8) of each o_proj and [0, 4) of each down_proj
    # (16 rows). Each part from another rank lands in a column slice of that shard, which is not
    # contiguous: layer 0, o_proj [4, 8) from rank 1 and down_proj [2, 4); layer 1, all four parts.
    # What it sends (whole shards of its own) needs no staging. The norms of layer 0 (16 values each),
    # which it holds whole, are lent to the engine as views of its shards: not allocated.
    sources, shapes = _sources()
    plan = plan_for_rank(0, sources, lambda r, names: engine_needs(r, r % 2, 2, shapes, ARCH, names), shapes,
                         itemsize=4)
    own = {mapping.megatron_name: shape for mapping, shape in _stage_mappings(0)}
    staging = (16 * 4 + 16 * 2 + 2 * 16 * 4 + 2 * 16 * 2) * 4
    assert plan.lent(0) == {f"model.layers.0.{norm}.weight" for norm in ("input_layernorm", "post_attention_layernorm")}
    allocated = allocated_bytes(plan, 0, own, {name: torch.float32 for name in shapes})
    assert sum(allocated.values()) == plan.bytes_needed(0) - 2 * 16 * 4 + staging


def test_buckets_keep_layers_whole():
    _, shapes = _sources()
    buckets = layer_buckets({name: 4 for name in shapes}, bucket_bytes=1)
    assert buckets[0] == ["model.embed_tokens.weight"]
    assert all(len({n.split(".")[2] for n in b}) == 1 for b in buckets if b[0].startswith("model.layers."))
    assert buckets[-1] == ["lm_head.weight"] and sorted(sum(buckets, [])) == sorted(shapes)


def _whole_world_plan(sources, needs, shapes) -> list[Transfer]:
    """The planner this project had before per-rank planning, kept as the reference: it plans every
    rank's needs at once and gives each slice to the holder that has sent the fewest bytes so far."""
    by_name, sent, transfers = defaultdict(list), defaultdict(int), []
    for piece in sources:
        by_name[piece.hf_name].append(piece)
    for need in needs:
        pieces, position = by_name[need.hf_name], need.start
        while position < need.stop:
            covering = [p for p in pieces if p.start <= position < p.stop]
            local = [p for p in covering if p.rank == need.rank]
            if local:
                piece = max(local, key=lambda p: p.stop)
                end = min(piece.stop, need.stop)
            else:
                piece = min(covering, key=lambda p: (sent[p.rank], p.rank))
                local_starts = [p.start for p in pieces if p.rank == need.rank and position < p.start]
                end = min([piece.stop, need.stop, *local_starts])
            transfers.append(Transfer(piece.rank, need.rank, need.hf_name, need.dim, position, end,
                                      piece.megatron_name, piece.shard_offset + position - piece.start))
            if piece.rank != need.rank:
                sent[piece.rank] += (end - position) * 16
            position = end
    return transfers


@pytest.mark.parametrize("engine_tp", [1, 2, 4])
def test_per_rank_plans_agree_with_the_whole_world_plan(engine_tp):
    # The same slices reach every rank, the same ones are local copies, and every slice comes from
    # a holder of exactly those bytes (which holder of a replicated slice may differ).
    sources, shapes = _sources()
    needs = [n for rank in range(TP * PP) for n in engine_needs(rank, rank % engine_tp, engine_tp, shapes, ARCH)]
    reference = _whole_world_plan(sources, needs, shapes)
    ours = _world_plan(sources, shapes, engine_tp, TP * PP).transfers

    def received(transfers):
        return sorted((t.dst, t.hf_name, t.start, t.stop, t.src == t.dst) for t in transfers)

    assert received(ours) == received(reference)
    held = {(p.rank, p.hf_name, p.megatron_name, p.start - p.shard_offset): (p.start, p.stop) for p in sources}
    for t in ours:
        start, stop = held[(t.src, t.hf_name, t.megatron_name, t.start - t.shard_offset)]
        assert start <= t.start < t.stop <= stop, t


def _replica_sources(tp, pp, dp, dp_rank):
    layout = TrainingLayout(tp * pp * dp, tp=tp, pp=pp)
    sources, shard_shapes = [], {}
    for rank in layout.dense_replica(dp_rank * tp):
        dense, _, shapes = rank_sources(LLAMA, layout, rank)
        sources += dense
        shard_shapes |= shapes
    return sources, hf_shapes_from(sources, shard_shapes)


LLAMA = architecture("Llama-2-70B")


def _plan_of(rank, tp, pp, dp, engine_tp, itemsize=2):
    """What rank `rank` computes at set-up from its replica's shard descriptions."""
    replica = (rank // tp) % dp
    sources, shapes = _replica_sources(tp, pp, dp, replica)

    def needs_of(r, names):
        return engine_needs(r, r % engine_tp, engine_tp, shapes, LLAMA, names)

    return plan_for_rank(rank, sources, needs_of, shapes, itemsize)


def test_1024_ranks_plan_per_rank_and_every_send_meets_its_receive():
    # TP8xPP8xDP16 -> TP_r=8, Llama-2 70B: 1,024 ranks, each planning from its replica's 64 shard
    # descriptions. Rank 517's plan, and the plans of every rank it exchanges with. (How long a rank
    # takes to plan is measured by bench/resharding_cost_model.py.)
    tp, pp, dp, engine_tp, rank = 8, 8, 16, 8, 517
    plan = _plan_of(rank, tp, pp, dp, engine_tp)
    assert plan.bytes_received(rank) == plan.lower_bound(rank) > 0
    peers = {t.src for t in plan.transfers} | {t.dst for t in plan.transfers}
    # Only its own DP replica (the same DP coordinate): here the same TP rank of every other stage
    # (engine TP = training TP), and some holders of replicated norms.
    assert {(p // tp) % dp for p in peers} == {(rank // tp) % dp} and len(peers) > pp
    for peer in sorted(peers - {rank}):
        theirs = {t for t in _plan_of(peer, tp, pp, dp, engine_tp).transfers if rank in (t.src, t.dst)}
        assert theirs == {t for t in plan.transfers if peer in (t.src, t.dst)}, peer


# Mixture of experts: one layer of 2 experts (ffn 8, hidden 16) at EP2, TP = ETP; world = TP x EP
# (megatron orders the dense ranks tp-dp and the expert ranks etp-ep: rank = tp_rank + TP * ep_rank).
EXPERT_FFN = 8


def _moe_sources(tp: int, rank: int) -> tuple[list[SourcePiece], list[SourcePiece], dict]:
    """(dense pieces of `rank`'s DP replica, expert pieces of its expert replica, HF shapes): each DP
    replica holds the attention and the router; EP rank e holds expert e, split over ETP = TP."""
    dense, experts, shard_shapes = [], [], {}
    layer = "model.layers.0."

    def add(into, holder, mapping, shape, tp_rank):
        shard_shapes[(holder, mapping.megatron_name)] = shape
        offset = 0
        for piece in shard_pieces(mapping, ARCH, shape, tp_rank, tp):
            into.append(SourcePiece(holder, piece.hf_name, piece.dim, piece.start, piece.stop,
                                    mapping.megatron_name, offset))
            offset += piece.size

    for tp_rank in range(tp):
        holder = rank - rank % tp + tp_rank  # this DP replica
        add(dense, holder, ParamMapping("router", "replicated", (layer + "mlp.gate.weight",)), (2, 16), tp_rank)
        add(dense, holder, ParamMapping("proj", "row", (layer + "self_attn.o_proj.weight",)), (16, 16 // tp), tp_rank)
        for expert in range(2):
            holder = tp_rank + tp * expert  # every EP rank: one expert replica
            prefix = f"{layer}mlp.experts.{expert}."
            add(experts, holder, ParamMapping(f"fc1.{expert}", "gate_up", (prefix + "gate_proj.weight",
                                                                           prefix + "up_proj.weight")),
                (2 * EXPERT_FFN // tp, 16), tp_rank)
            add(experts, holder, ParamMapping(f"fc2.{expert}", "row", (prefix + "down_proj.weight",)),
                (16, EXPERT_FFN // tp), tp_rank)
    return dense, experts, hf_shapes_from(dense + experts, shard_shapes)


@pytest.mark.parametrize("tp, engine_tp", [(1, 1), (2, 2), (2, 1)])
def test_experts_come_from_the_expert_replica_and_only_missing_bytes_move(tp, engine_tp):
    world = 2 * tp
    plans = []
    for rank in range(world):
        dense, experts, shapes = _moe_sources(tp, rank)
        plans.append(plan_for_rank(
            rank, dense, lambda r, names: engine_needs(r, r % engine_tp, engine_tp, shapes, ARCH, names), shapes, 4,
            experts))
    for rank, plan in enumerate(plans):
        assert plan.bytes_received(rank) == plan.lower_bound(rank)
        for t in plan.transfers:
            assert t in plans[t.src].transfers and t in plans[t.dst].transfers, t
            if ".experts." not in t.hf_name:  # dense tensors never leave the DP replica
                assert t.src // tp == t.dst // tp, t
    # By hand: engine rank 0 needs rows [0, 8 / engine_tp) of each expert's gate and up, columns
    # [0, 8 / engine_tp) of its down (16 x 4 bytes per row or column). It holds expert 0's slice
    # [0, 8 / tp) and receives the rest; at TP2 -> TP_r1 the dense o_proj columns [8, 16) come from rank 1.
    wanted, held = EXPERT_FFN // engine_tp, EXPERT_FFN // tp
    expert_bytes = 3 * 16 * 4 * (2 * wanted - min(held, wanted))
    dense_bytes = 16 * 4 * (16 - 16 // tp) if engine_tp == 1 else 0
    assert plans[0].lower_bound(0) == expert_bytes + dense_bytes
    # Expert 1 comes from the ETP ranks of EP rank 1 that hold part of the needed interval.
    senders = {t.src for t in plans[0].transfers if t.dst == 0 and ".experts.1." in t.hf_name}
    assert senders == {tp + etp_rank for etp_rank in range(tp) if etp_rank * held < wanted}


# The frontier MoE models of the cost model: DeepSeek-V3's multi-latent attention, dense first layers,
# shared expert and router bias; GLM-4.5's q/k/v biases and qk-norm. Shapes by hand from the HF configs.
def _hf_shapes(arch, layout):
    sources, shard_shapes = [], {}
    for rank in range(layout.world):
        dense, experts, shapes = rank_sources(arch, layout, rank)
        sources += dense + experts
        shard_shapes |= shapes
    return hf_shapes_from(sources, shard_shapes)


def test_deepseek_v3_shards_rebuild_its_hf_tensors_and_its_published_671b_parameters():
    hf_shapes = _hf_shapes(architecture("DeepSeek-V3"), TrainingLayout(16, tp=2, pp=4, ep=4))
    # Its README: 671B parameters in the main model (685B with the 14B multi-token-prediction module).
    assert sum(math.prod(shape) for shape in hf_shapes.values()) == pytest.approx(671e9, rel=1e-3)
    attention, moe = "model.layers.3.self_attn.", "model.layers.3.mlp."
    assert hf_shapes[attention + "q_a_proj.weight"] == (1536, 7168)
    assert hf_shapes[attention + "q_b_proj.weight"] == (128 * (128 + 64), 1536)  # heads x (no-RoPE + RoPE dims)
    assert hf_shapes[attention + "kv_a_proj_with_mqa.weight"] == (512 + 64, 7168)  # latent + shared RoPE key
    assert hf_shapes[attention + "kv_b_proj.weight"] == (128 * (128 + 128), 512)  # heads x (key + value dims)
    assert hf_shapes[attention + "o_proj.weight"] == (7168, 128 * 128)
    assert hf_shapes[attention + "kv_a_layernorm.weight"] == (512,)
    assert hf_shapes[moe + "gate.e_score_correction_bias"] == (256,)
    assert hf_shapes[moe + "shared_experts.gate_proj.weight"] == (2048, 7168)
    assert len([name for name in hf_shapes if name.startswith(moe + "experts.")]) == 256 * 3
    assert hf_shapes["model.layers.2.mlp.gate_proj.weight"] == (18432, 7168)  # first_k_dense_replace=3
    assert not any(name.startswith("model.layers.2.mlp.gate.") for name in hf_shapes)
    assert "model.layers.61.input_layernorm.weight" not in hf_shapes  # the MTP layer is not synced


def test_latent_attention_shard_shapes_at_tp2_by_hand():
    # megatron's local MLA spec: the down projections too are column-parallel (halved at TP2).
    shapes = stage_shard_shapes(architecture("DeepSeek-V3"), TrainingLayout(4, tp=2, pp=2, ep=2), 0)
    layer = "decoder.layers.0.self_attention."
    assert {name[len(layer):]: shape for name, shape in shapes.items() if name.startswith(layer)} == {
        "linear_q_down_proj.weight": (768, 7168), "q_layernorm.weight": (1536,),
        "linear_q_up_proj.weight": (64 * 192, 1536), "linear_kv_down_proj.weight": (288, 7168),
        "kv_layernorm.weight": (512,), "linear_kv_up_proj.weight": (64 * 256, 512),
        "linear_proj.weight": (7168, 64 * 128)}
    no_query_latent = replace(architecture("DeepSeek-V3"), mla=replace(architecture("DeepSeek-V3").mla,
                                                                       q_lora_rank=None))
    shapes = stage_shard_shapes(no_query_latent, TrainingLayout(4, tp=2, pp=2, ep=2), 0)
    assert shapes[layer + "linear_q_proj.weight"] == (64 * 192, 7168)
    assert layer + "q_layernorm.weight" not in shapes and layer + "linear_q_up_proj.weight" not in shapes


def test_glm_shard_shapes_at_slimes_layout_by_hand():
    shapes = stage_shard_shapes(architecture("GLM-4.5"), TrainingLayout(64, tp=8, pp=4, ep=16), 0)
    # 96 query heads and 8 KV heads of 128 over TP8: 12 query heads and one KV head a rank.
    assert shapes["decoder.layers.0.self_attention.linear_qkv.weight"] == ((12 + 2) * 128, 5120)
    assert shapes["decoder.layers.0.self_attention.linear_qkv.bias"] == ((12 + 2) * 128,)
    assert shapes["decoder.layers.0.self_attention.linear_proj.weight"] == (5120, 12 * 128)
    assert shapes["decoder.layers.0.self_attention.k_layernorm.weight"] == (128,)
    assert shapes["decoder.layers.2.mlp.linear_fc1.weight"] == (2 * 12288 // 8, 5120)  # dense first layers
    assert shapes["decoder.layers.3.mlp.router.expert_bias"] == (160,)
    assert shapes["decoder.layers.3.mlp.shared_experts.linear_fc1.weight"] == (2 * 1536 // 8, 5120)
    assert shapes["decoder.layers.3.mlp.experts.local_experts.9.linear_fc2.weight"] == (5120, 1536)  # 160 / EP16
    assert "decoder.layers.3.mlp.experts.local_experts.10.linear_fc1.weight" not in shapes
    assert "decoder.layers.23.input_layernorm.weight" not in shapes  # 92 layers / PP4
    assert shapes["embedding.word_embeddings.weight"] == (151552 // 8, 5120)  # already a multiple of 128 x 8


def test_last_stage_holds_a_tied_copy_of_the_embedding_or_the_value_head():
    layout = TrainingLayout(TP * PP, tp=TP, pp=PP)
    tied = replace(ARCH, tie_word_embeddings=True)
    assert "output_layer.weight" in stage_shard_shapes(tied, layout, PP - 1)
    assert "output_layer.weight" not in stage_shard_shapes(tied, TrainingLayout(TP, tp=TP, pp=1), 0)
    value = stage_shard_shapes(replace(ARCH, value_model=True), layout, PP - 1)
    assert (value["output_layer.score.weight"], value["output_layer.score.bias"]) == ((1, 16), (1,))
    assert "output_layer.weight" not in value


def test_first_and_last_stage_layers_as_nemo_rl_sets_them_for_deepseek_v3():
    layout = TrainingLayout(256, tp=1, pp=16, ep=16, first_stage_layers=3, last_stage_layers=2)
    assert layout.stage_layers(61) == [3] + [4] * 14 + [2]
    with pytest.raises(ValueError, match="middle layers"):
        layout.stage_layers(60)
    with pytest.raises(ValueError, match="go together"):
        TrainingLayout(256, tp=1, pp=16, ep=16, first_stage_layers=3)


@pytest.mark.parametrize("model", ["DeepSeek-V3", "Kimi-K2", "GLM-4.5"])
def test_frontier_moe_models_plan_every_tensor_and_only_missing_bytes_move(model):
    # Their published configs shrunk to 4 layers of 16 experts, each split as at full size.
    config = HF_CONFIGS[model] | dict(num_hidden_layers=4, n_routed_experts=16, n_group=1, topk_group=1)
    arch = architecture_from_hf({"tie_word_embeddings": False, **config})
    traffic = plan_sync(arch, TrainingLayout(16, tp=2, pp=2, ep=4), engine_tp=4)
    assert traffic.received == traffic.lower_bound and min(traffic.received) > 0
