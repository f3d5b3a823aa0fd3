"""What each rank of a TP_r rollout engine needs: vLLM's tensor-parallel sharding of HF tensors.

vLLM shards the same way Megatron does, but on its own TP size and with its own vocabulary padding:
q rows by attention head, k/v rows by KV head (replicated when TP_r exceeds the KV heads),
gate/up rows and o/down columns evenly, embeddings and LM head by vocabulary rows in slices of a
vocabulary padded to a multiple of 64; norms whole. At TP_r = 1 every rank needs every tensor.

Mixture-of-experts layers (vLLM's FusedMoE, expert parallelism off): every rank holds every expert,
each split over TP_r like a dense MLP: its gate and up rows (Mixtral's w1 and w3; vLLM stacks them
as w13) and its down columns (w2) evenly along the expert's intermediate dim. The Qwen2-MoE shared
expert is a dense MLP; the router and the shared expert's gate are replicated (whole).

Multi-latent attention (DeepSeek-V3): the up projections (q_proj or q_b_proj, kv_b_proj) by heads,
evenly; the down projections (q_a_proj, kv_a_proj_with_mqa) and the latents' norms whole.
"""

from __future__ import annotations

import functools
from collections.abc import Collection

from megarl.models.architecture import Architecture
from megarl.resharding.plan import Need

VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


def _split(name: str) -> tuple[str, int]:
    """(how vLLM splits the tensor, along which dim)."""
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return "q_heads", 0
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return "kv_heads", 0
    if name.endswith(("gate_proj.weight", "up_proj.weight", ".w1.weight", ".w3.weight", "q_b_proj.weight",
                      "kv_b_proj.weight")):
        return "even", 0
    if name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
        return "even", 1
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "vocab", 0
    return "whole", 0


def engine_needs(rank: int, engine_tp_rank: int, engine_tp: int, hf_shapes: dict[str, tuple[int, ...]],
                 arch: Architecture, names: Collection[str] | None = None) -> list[Need]:
    """What engine rank `rank` (at `engine_tp_rank` of its engine) needs of every HF tensor, or of `names`,
    in name order. A rank plans what it sends to every engine rank of its replica (hundreds, each needing
    slices of up to 70,000 tensors for a frontier MoE model), so the slices of each engine TP rank are
    computed once, and only those of the tensors it holds become `Need`s."""
    slices = _engine_slices(engine_tp_rank, engine_tp, tuple(hf_shapes.items()), arch.num_kv_heads, arch.head_dim)
    wanted = slices if names is None else sorted(name for name in names if name in slices)
    return [Need(rank, name, *slices[name]) for name in wanted]


@functools.lru_cache(maxsize=64)
def _engine_slices(engine_tp_rank: int, engine_tp: int, shapes: tuple[tuple[str, tuple[int, ...]], ...],
                   num_kv_heads: int, head_dim: int) -> dict[str, tuple[int, int, int]]:
    """name -> (dim, start, stop) of each tensor slice an engine TP rank holds, in name order (shared: read only)."""
    slices = {}
    for name, shape in sorted(shapes):
        kind, dim = _split(name)
        size = shape[dim]
        if engine_tp == 1 or kind == "whole":
            start, stop = 0, size
        elif kind == "q_heads" or kind == "even":
            per_rank = size // engine_tp
            start, stop = engine_tp_rank * per_rank, (engine_tp_rank + 1) * per_rank
        elif kind == "kv_heads":
            if num_kv_heads >= engine_tp:
                per_rank = size // engine_tp
                start, stop = engine_tp_rank * per_rank, (engine_tp_rank + 1) * per_rank
            else:  # each KV head is replicated on engine_tp / num_kv_heads ranks
                head = engine_tp_rank * num_kv_heads // engine_tp
                start, stop = head * head_dim, (head + 1) * head_dim
        else:  # vocab
            padded = -(-size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
            per_rank = padded // engine_tp
            start, stop = min(size, engine_tp_rank * per_rank), min(size, (engine_tp_rank + 1) * per_rank)
        if stop > start:
            slices[name] = (dim, start, stop)
    return slices
