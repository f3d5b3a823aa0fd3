"""A value head: one scalar per token, in place of the LM output layer (critic, reward model).

The head is replicated on every TP rank (hidden -> 1 cannot be split). It sees the full hidden state
on every TP rank: with sequence parallelism (TP > 1 on GPU; MoE models on CPU too) it first
all-gathers the sequence that the ranks split, and its backward hands each rank the gradient of its
own part. So all TP ranks compute identical gradients for the head, which needs no extra all-reduce.
It matches HF's `*ForTokenClassification` head with one label (`score`, a linear layer with bias).
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device, sequence_parallel: bool = False):
        super().__init__()
        self.score = torch.nn.Linear(hidden_size, 1, dtype=dtype, device=device)
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_SBH: torch.Tensor, weight=None, runtime_gather_output=None):
        # Called like megatron's output layer: returns (output, bias).
        if self.sequence_parallel:
            # The loss downstream is replicated over TP: backward splits, it does not reduce-scatter.
            hidden_SBH = gather_from_sequence_parallel_region(hidden_SBH, tensor_parallel_output_grad=False)
        return self.score(hidden_SBH), None


class GPTValueModel(GPTModel):
    """A GPTModel whose output layer is a `ValueHead` (set by the builder on the last stage)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        # The language-model version assumes a vocabulary-sized output layer to pad or tie; the
        # value head is a plain replicated layer, which the generic module version checkpoints.
        return MegatronModule.sharded_state_dict(self, prefix, sharded_offsets,
                                                 ensure_metadata_has_dp_cp_group(metadata))
