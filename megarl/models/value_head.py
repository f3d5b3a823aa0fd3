"""A value head: one scalar per token, in place of the LM output layer (critic, reward model).

The head is replicated on every TP rank (hidden -> 1 cannot be split). Its input is the full
hidden state on every TP rank (gathered first under sequence parallelism), so all TP ranks compute
identical gradients for it and it needs no extra all-reduce. It matches HF's
`*ForTokenClassification` head with one label (`score`, a linear layer with bias).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int, sequence_parallel: bool, tp_group, dtype: torch.dtype, device):
        super().__init__()
        self.score = torch.nn.Linear(hidden_size, 1, dtype=dtype, device=device)
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden_SBH: torch.Tensor, weight=None, runtime_gather_output=None):
        # Called like megatron's output layer: returns (output, bias).
        if self.sequence_parallel:
            hidden_SBH = gather_from_sequence_parallel_region(hidden_SBH, group=self.tp_group)
        return self.score(hidden_SBH), None
