"""Where every megatron-core parameter comes from in a HuggingFace checkpoint, slice by slice.

A megatron parameter on TP rank r is the concatenation, along one dim, of *pieces*: slices of
HF tensors (or zero rows of vocabulary padding). The whole mapping is this one idea:

    kind        megatron tensor on TP rank r                        pieces (all along `dim`)
    replicated  norms, value head                                   the whole HF tensor
    vocab       word embeddings, untied output layer, padded        rows [r*n/tp, (r+1)*n/tp), zero rows past the vocabulary
    row         linear_proj (o_proj), linear_fc2 (down_proj)         columns [r*n/tp, (r+1)*n/tp)
    gate_up     linear_fc1 = [gate_r; up_r]                         gate rows, up rows
    qkv         linear_qkv = per local query group g: [q_g; k_g; v_g] q/k/v rows of each group

Loading reads exactly the pieces a rank owns (lazily from safetensors), exporting puts the TP
shards' pieces back in place, and the resharding planner moves the same pieces between layouts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from megarl.models.architecture import Architecture

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
}
_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


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


def param_mappings(model: torch.nn.Module, arch: Architecture) -> list[ParamMapping]:
    """The mapping of every parameter this rank's model stage holds."""
    layer_numbers = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    return [
        param_mapping(name, arch, layer_numbers)
        for name, _ in model.named_parameters()
    ]


def param_mapping(name: str, arch: Architecture, layer_numbers: dict[int, int]) -> ParamMapping:
    """The mapping of megatron parameter `name`; `layer_numbers` maps local to global layer indices."""
    match = _LAYER_NAME.fullmatch(name)
    if match:
        global_layer = layer_numbers[int(match.group(1))]
        kind, suffixes = _LAYER_RULES[match.group(2)]
        return ParamMapping(name, kind, tuple(f"model.layers.{global_layer}.{s}" for s in suffixes))
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
