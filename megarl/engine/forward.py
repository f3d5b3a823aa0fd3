"""Forward-only passes through megatron-core's pipeline schedule.

Micro-batches flow through the pipeline stages with p2p sends; only the last stage sees the
model's outputs. Sequences in a batch share one padded length T (the p2p tensor shape is fixed
per call); attention is causal, so right padding never changes the outputs of real tokens.
"""

from __future__ import annotations

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megarl import device
from megarl.distributed import collectives
from megarl.distributed.layout import ParallelLayout


@torch.no_grad()
def forward_outputs(
    model: torch.nn.Module, layout: ParallelLayout, tokens_BT: torch.Tensor, micro_batch_size: int
) -> torch.Tensor | None:
    """The model's outputs (B, T, V/TP) logits or (B, T, 1) values on the last stage, else None."""
    batch_size, seq_len = tokens_BT.shape
    tokens_BT = tokens_BT.to(device.compute_device())
    positions_BT = torch.arange(seq_len, device=tokens_BT.device).expand(batch_size, seq_len)
    micro_batches = iter(zip(tokens_BT.split(micro_batch_size), positions_BT.split(micro_batch_size)))

    def forward_step(data_iterator, model):
        tokens, positions = next(data_iterator)
        return model(tokens, positions, attention_mask=None), None

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=micro_batches,
        model=[model],
        num_microbatches=-(-batch_size // micro_batch_size),
        seq_length=seq_len,
        micro_batch_size=micro_batch_size,
        forward_only=True,
    )
    return torch.cat(outputs) if layout.is_last_stage else None


def gather_vocab(logits_BTV: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """Full-vocabulary logits from the vocab-parallel slices of the TP group (for checks and tools;
    training never materialises the full vocabulary on one rank)."""
    if layout.tp == 1:
        return logits_BTV
    return torch.cat(collectives.all_gather(logits_BTV.contiguous(), group=layout.tp_group), dim=-1)
