"""Multi-latent attention on megatron-core's local layers (no Transformer Engine).

MLA's keys are wider than its values (each head's key is its no-RoPE part and its RoPE part, its
value only `v_head_dim`), so MLA builds its core attention with `k_channels` and `v_channels`,
which Transformer Engine's attention takes and megatron-core 0.16.1's local `DotProductAttention`
does not (its local MLA spec fails at build). The local attention needs neither: it reads each
width from its inputs, and only its output width from the config (`kv_channels`, which MLA leaves
unread and the builder sets to `v_head_dim`). `LatentDotProductAttention` is that attention
taking the two arguments.

Without Transformer Engine installed, megatron-core's TE extension module hands out mock objects
in place of TE's classes, and MLA (which imports them and then believes TE present) fails at build
on `isinstance(..., TELinear)`; MLA is told TE is absent when it is.

On the local layers MLA's down projections are column-parallel: each TP rank computes its columns of the latents
and of the RoPE key, then they are gathered (`gather_from_tensor_model_parallel_region`, whose backward keeps each
rank's own columns of the gradient, as if every rank's were the same). Every TP rank's heads use the whole RoPE
key, so each holds only its heads' part of its gradient: megatron-core 0.16.1 drops the others', and at TP > 1 the
key projection's RoPE rows (and everything below them) train on part of their gradient (a tiny DeepSeek-V3's
gradient norm at TP2 was 0.1% off TP1's, 2026-11-27). `LocalLatentSelfAttention` gathers that projection's output
with the RoPE key's gradient summed over TP (Transformer Engine's layers keep the projection whole and gather the
key along the sequence, whose backward sums it).

`local_mla_spec` does all three to a decoder block spec of local layers.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megarl import device


class LatentDotProductAttention(DotProductAttention):
    def __init__(self, config, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        """megatron's `Attention` builds it without the widths first, MLA then again with them."""
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"MLA's value width {v_channels} must be the config's kv_channels {config.kv_channels}")
        super().__init__(config, *args, **kwargs)


class _GatherSummingRopeKeyGradient(torch.autograd.Function):
    """The key/value down projection's columns gathered from the TP ranks. Backward: the RoPE key's columns of the
    gradient summed over TP (each rank's heads gave their part), then this rank's columns."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, rope_width: int, group) -> torch.Tensor:
        ctx.rope_width, ctx.group = rope_width, group
        return gather_from_tensor_model_parallel_region(shard, group=group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()  # contiguous, and ours to change
        rope_key = grad[..., -ctx.rope_width:].contiguous()
        torch.distributed.all_reduce(rope_key, group=ctx.group)
        grad[..., -ctx.rope_width:] = rope_key
        width = grad.size(-1) // ctx.group.size()
        rank = ctx.group.rank()
        return grad[..., rank * width:(rank + 1) * width].contiguous(), None, None


class LocalLatentSelfAttention(multi_latent_attention.MLASelfAttention):
    def get_query_key_value_tensors(self, *args, **kwargs):
        with self._rope_key_gradient_summed():
            return super().get_query_key_value_tensors(*args, **kwargs)

    @contextlib.contextmanager
    def _rope_key_gradient_summed(self) -> Iterator[None]:
        """megatron's own computation, but for its gather of the key/value down projection's output (found by
        identity: the output a forward hook saw), which sums the RoPE key's gradient over TP."""
        projected = []
        hook = self.linear_kv_down_proj.register_forward_hook(lambda module, args, output: projected.append(output[0]))
        rope_width = self.config.qk_pos_emb_head_dim

        def gather(shard: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if projected and shard is projected[-1]:
                return _GatherSummingRopeKeyGradient.apply(shard, rope_width, self.tp_group)
            return gather_from_tensor_model_parallel_region(shard, *args, **kwargs)

        multi_latent_attention.gather_from_tensor_model_parallel_region = gather
        try:
            yield
        finally:
            multi_latent_attention.gather_from_tensor_model_parallel_region = gather_from_tensor_model_parallel_region
            hook.remove()


def local_mla_spec(block: TransformerBlockSubmodules) -> None:
    """Make the MLA layers of a local-layer `block` spec build and train."""
    if device.transformer_engine_unavailable():
        multi_latent_attention.HAVE_TE = False
    for layer in block.layer_specs:
        self_attention = layer.submodules.self_attention
        attention = self_attention.submodules
        if attention.core_attention is DotProductAttention:
            attention.core_attention = LatentDotProductAttention
        if self_attention.module is multi_latent_attention.MLASelfAttention:
            self_attention.module = LocalLatentSelfAttention
