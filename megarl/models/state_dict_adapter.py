"""Where every megatron-core parameter comes from in a HuggingFace checkpoint, slice by slice.

A megatron parameter on TP rank r is the concatenation, along one dim, of *pieces*: slices of
HF tensors (or zero rows of vocabulary padding). The whole mapping is this one idea:

    kind        megatron tensor on TP rank r                        pieces (all along `dim`)
    replicated  norms, value head                                   the whole HF tensor
    vocab       word embeddings, untied output layer, padded        rows [r*n/tp, (r+1)*n/tp), zero rows past
                                                                    the vocabulary
    row         linear_proj (o_proj), linear_fc2 (down_proj)         columns [r*n/tp, (r+1)*n/tp)
    gate_up     linear_fc1 = [gate_r; up_r]                         gate rows, up rows
    qkv         linear_qkv = per local query group g: [q_g; k_g; v_g] q/k/v rows of each group
    column      MLA's up projections (q_proj, q_b_proj, kv_b_proj)  rows [r*n/tp, (r+1)*n/tp): whole heads
    latent_down MLA's down projections (q_a_proj, kv_a_proj)        rows as `column` (megatron's local
                                                                    layers), the whole tensor (TE's)

Mixture-of-experts layers add the router, its correction bias and the Qwen2-MoE shared expert's
gate (replicated), the shared experts (split over TP like the dense MLP) and the routed experts. Each expert is an MLP
of the same kinds, gate_up and row, but split over the expert tensor-parallel ranks (ETP, which
`ParamMapping.expert` marks; `tp_split` picks the split), and a rank holds only its EP rank's
experts: local expert i of EP rank e is global expert e * num_local_experts + i, the index in
the HF names.

Loading reads exactly the pieces a rank owns (lazily from safetensors), exporting puts the TP
shards' pieces back in place, and the resharding planner moves the same pieces between layouts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from megarl.models.architecture import Architecture
from megarl.models.lora import is_adapter_parameter, merged_weights

# megatron suffix within `decoder.layers.<i>.` -> (kind, HF suffixes within `model.layers.<i>.`).
# Both the local spec's names and Transformer Engine's fused-norm names are listed.
_LAYER_RULES = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "self_attention.linear_qkv.bias": (
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
    # Mixture of experts ({moe}: the HF block's name; the routed experts follow `_EXPERT_NAME`).
    "mlp.router.weight": ("replicated", ("{moe}.gate.weight",)),
    "mlp.router.expert_bias": ("replicated", ("{moe}.gate.e_score_correction_bias",)),
    "mlp.shared_experts.linear_fc1.weight": (
        "gate_up",
        ("mlp.{shared}.gate_proj.weight", "mlp.{shared}.up_proj.weight"),
    ),
    "mlp.shared_experts.linear_fc2.weight": ("row", ("mlp.{shared}.down_proj.weight",)),
    "mlp.shared_experts.gate_weight": ("replicated", ("mlp.shared_expert_gate.weight",)),
}
# Multi-latent attention (DeepSeek-V3), in place of the rules of its names above.
_MLA_RULES = {
    "self_attention.linear_q_proj.weight": ("column", ("self_attn.q_proj.weight",)),
    "self_attention.linear_q_down_proj.weight": ("latent_down", ("self_attn.q_a_proj.weight",)),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_a_layernorm.weight",)),
    "self_attention.linear_q_up_proj.layer_norm_weight": ("replicated", ("self_attn.q_a_layernorm.weight",)),
    "self_attention.linear_q_up_proj.weight": ("column", ("self_attn.q_b_proj.weight",)),
    "self_attention.linear_kv_down_proj.weight": ("latent_down", ("self_attn.kv_a_proj_with_mqa.weight",)),
    "self_attention.kv_layernorm.weight": ("replicated", ("self_attn.kv_a_layernorm.weight",)),
    "self_attention.linear_kv_up_proj.layer_norm_weight": ("replicated", ("self_attn.kv_a_layernorm.weight",)),
    "self_attention.linear_kv_up_proj.weight": ("column", ("self_attn.kv_b_proj.weight",)),
}
_MLA_LAYER_RULES = {**_LAYER_RULES, **_MLA_RULES}
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# A routed expert's linear layers: one module per local expert (local spec), or one grouped
# module holding weight<i> per local expert (Transformer Engine's grouped GEMM).
_EXPERT_NAME = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight"
                          r"|(linear_fc[12])\.weight(\d+))")
# family -> (HF MoE block, HF names of an expert's gate, up and down projections)
_HF_EXPERTS = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}
_HF_EXPERTS_DEFAULT = ("mlp", "gate_proj", "up_proj", "down_proj")
_HF_SHARED_EXPERTS = {"qwen2_moe": "shared_expert"}  # the others: "shared_experts"


@dataclass(frozen=True)
class Piece:
    """Rows (or columns, by `dim`) [start, stop) of HF tensor `hf_name`; None means zero padding."""

    hf_name: str | None
    dim: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ParamMapping:
    megatron_name: str
    kind: str
    hf_names: tuple[str, ...]
    expert: bool = False
    """A routed expert's weight: split over the expert tensor-parallel ranks, not the TP ranks."""


def tp_split(mapping: ParamMapping, layout) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel split of `mapping`'s parameter on this `ParallelLayout`."""
    return (layout.etp_rank, layout.etp) if mapping.expert else (layout.tp_rank, layout.tp)


def mapped_tensors(model: torch.nn.Module, arch: Architecture) -> dict[str, torch.Tensor]:
    """The tensors of this rank's model stage that have HF counterparts: its parameters (LoRA adapters'
    are not: `served_tensors` merges them into their linears' weights), and the
    routers' correction biases of an architecture whose checkpoints carry them (buffers: moved by
    aux-loss-free balancing, not by the optimizer)."""
    tensors = {name: parameter for name, parameter in model.named_parameters() if not is_adapter_parameter(name)}
    if arch.router_bias:
        tensors.update((name, buffer) for name, buffer in model.named_buffers() if name.endswith(".router.expert_bias"))
    return tensors


def served_tensors(model: torch.nn.Module, arch: Architecture) -> dict[str, torch.Tensor]:
    """`mapped_tensors` as the rollout engine serves them: each LoRA-adapted linear's weight merged with its
    adapter (W + (alpha / r) B A, computed now); the others as they are."""
    return {**mapped_tensors(model, arch), **merged_weights(model)}


def param_mappings(model: torch.nn.Module, arch: Architecture, ep_rank: int | None = None) -> list[ParamMapping]:
    """The mapping of every tensor of `mapped_tensors`, in its order; with `ep_rank`, named as EP
    rank `ep_rank` names its own experts (the same tensors, in the same order)."""
    layer_numbers = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    moe_layer = next((layer.mlp for layer in model.decoder.layers if arch.is_moe_layer(layer.layer_number - 1)), None)
    expert_offset = 0
    if moe_layer is not None:
        expert_offset = moe_layer.local_expert_indices[0] if ep_rank is None else ep_rank * moe_layer.num_local_experts
    return [param_mapping(name, arch, layer_numbers, expert_offset) for name in mapped_tensors(model, arch)]


def param_mapping(name: str, arch: Architecture, layer_numbers: dict[int, int], expert_offset: int = 0) -> ParamMapping:
    """The mapping of megatron parameter `name`; `layer_numbers` maps local to global layer indices,
    `expert_offset` is the global index of this rank's first expert."""
    match = _LAYER_NAME.fullmatch(name)
    if match:
        layer = f"model.layers.{layer_numbers[int(match.group(1))]}."
        moe_block, gate, up, down = _HF_EXPERTS.get(arch.family, _HF_EXPERTS_DEFAULT)
        expert = _EXPERT_NAME.fullmatch(match.group(2))
        if expert:
            local_expert, linear = (expert.group(1), expert.group(2)) if expert.group(1) else expert.group(4, 3)
            prefix = f"{layer}{moe_block}.experts.{expert_offset + int(local_expert)}."
            if linear == "linear_fc1":
                return ParamMapping(name, "gate_up", (f"{prefix}{gate}.weight", f"{prefix}{up}.weight"), expert=True)
            return ParamMapping(name, "row", (f"{prefix}{down}.weight",), expert=True)
        rules = _MLA_LAYER_RULES if arch.mla else _LAYER_RULES
        kind, suffixes = rules[match.group(2)]
        shared = _HF_SHARED_EXPERTS.get(arch.family, "shared_experts")
        return ParamMapping(name, kind, tuple(layer + s.format(moe=moe_block, shared=shared) for s in suffixes))
    embed = "model.embed_tokens.weight"
    rules = {
        "embedding.word_embeddings.weight": ("vocab", (embed,)),
        "decoder.final_layernorm.weight": ("replicated", ("model.norm.weight",)),
        # With tied embeddings the last pipeline stage keeps its own copy of the embedding.
        "output_layer.weight": ("vocab", (embed if arch.tie_word_embeddings else "lm_head.weight",)),
        "output_layer.score.weight": ("replicated", ("score.weight",)),
        "output_layer.score.bias": ("replicated", ("score.bias",)),
    }
    if name not in rules:
        raise KeyError(f"no HuggingFace mapping for megatron parameter {name!r}")
    kind, hf_names = rules[name]
    return ParamMapping(name, kind, hf_names)


def shard_pieces(
    mapping: ParamMapping, arch: Architecture, shard_shape: Sequence[int], tp_rank: int, tp: int
) -> list[Piece]:
    """The pieces that, concatenated along their dim, form TP rank `tp_rank`'s shard."""
    kind, names = mapping.kind, mapping.hf_names
    if kind == "replicated":
        return [Piece(names[0], 0, 0, shard_shape[0])]
    if kind == "row":
        n = shard_shape[1]
        return [Piece(names[0], 1, tp_rank * n, (tp_rank + 1) * n)]
    if kind == "latent_down" and shard_shape[0] == _latent_rows(arch, names[0]):
        return [Piece(names[0], 0, 0, shard_shape[0])]  # Transformer Engine keeps it whole on every TP rank
    if kind in ("column", "latent_down"):
        n = shard_shape[0]
        return [Piece(names[0], 0, tp_rank * n, (tp_rank + 1) * n)]
    if kind == "vocab":
        n = shard_shape[0]
        start, stop = tp_rank * n, (tp_rank + 1) * n
        real_stop = min(stop, arch.vocab_size)
        pieces = [Piece(names[0], 0, start, real_stop)] if real_stop > start else []
        padding = stop - max(start, real_stop)
        return pieces + ([Piece(None, 0, 0, padding)] if padding else [])
    if kind == "gate_up":
        n = shard_shape[0] // 2
        return [Piece(name, 0, tp_rank * n, (tp_rank + 1) * n) for name in names]
    if kind == "qkv":
        d, per_group = arch.head_dim, arch.heads_per_group
        groups = arch.num_kv_heads // tp
        pieces = []
        for g in range(tp_rank * groups, (tp_rank + 1) * groups):
            pieces.append(Piece(names[0], 0, g * per_group * d, (g + 1) * per_group * d))
            pieces.append(Piece(names[1], 0, g * d, (g + 1) * d))
            pieces.append(Piece(names[2], 0, g * d, (g + 1) * d))
        return pieces
    raise ValueError(f"unknown mapping kind {kind!r}")


def _latent_rows(arch: Architecture, hf_name: str) -> int:
    """Rows of MLA's down projection `hf_name`: the query latent, or the key/value latent and the RoPE key."""
    if hf_name.endswith("q_a_proj.weight"):
        return arch.mla.q_lora_rank
    return arch.mla.kv_lora_rank + arch.mla.rope_head_dim


ReadSlice = Callable[[str, int, int, int], torch.Tensor]


def assemble_shard(
    mapping: ParamMapping,
    arch: Architecture,
    shard_shape: Sequence[int],
    tp_rank: int,
    tp: int,
    read: ReadSlice,
) -> torch.Tensor:
    """Build this rank's shard from HF slices; `read(name, dim, start, stop)` reads one slice."""
    parts = []
    for piece in shard_pieces(mapping, arch, shard_shape, tp_rank, tp):
        if piece.hf_name is None:
            parts.append(torch.zeros(piece.size, *shard_shape[1:]))
        else:
            parts.append(read(piece.hf_name, piece.dim, piece.start, piece.stop))
    dim = 1 if mapping.kind == "row" else 0
    shard = torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]
    if tuple(shard.shape) != tuple(shard_shape):
        raise ValueError(
            f"{mapping.megatron_name}: HF tensors {mapping.hf_names} give shape {tuple(shard.shape)} "
            f"on TP rank {tp_rank}, model expects {tuple(shard_shape)}"
        )
    return shard


def merge_shards(mapping: ParamMapping, arch: Architecture, shards: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `assemble_shard`: the HF tensors rebuilt from every TP rank's shard, in order."""
    tp = len(shards)
    placed: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
    for tp_rank, shard in enumerate(shards):
        pieces = shard_pieces(mapping, arch, shard.shape, tp_rank, tp)
        if mapping.kind == "replicated":
            pieces = pieces if tp_rank == 0 else []
        offset = 0
        for piece in pieces:
            part = shard.narrow(piece.dim, offset, piece.size)
            offset += piece.size
            if piece.hf_name is not None:
                placed.setdefault(piece.hf_name, []).append((piece, part))
    merged = {}
    for name, parts in placed.items():
        dim = parts[0][0].dim
        shape = list(parts[0][1].shape)
        shape[dim] = max(piece.stop for piece, _ in parts)
        full = torch.empty(shape, dtype=parts[0][1].dtype)
        for piece, part in parts:
            full.narrow(dim, piece.start, piece.size).copy_(part)
        merged[name] = full
    return merged
