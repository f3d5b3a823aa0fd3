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

`local_mla_spec` does both to a decoder block spec of local layers.
"""

from __future__ import annotations

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


def local_mla_spec(block: TransformerBlockSubmodules) -> None:
    """Make the MLA layers of a local-layer `block` spec build."""
    if device.transformer_engine_unavailable():
        multi_latent_attention.HAVE_TE = False
    for layer in block.layer_specs:
        attention = layer.submodules.self_attention.submodules
        if attention.core_attention is DotProductAttention:
            attention.core_attention = LatentDotProductAttention
