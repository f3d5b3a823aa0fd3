"""Where a micro-batch's sequences sit in the model's input and output: padded or packed.

Padded, (b, T): sequence i is row i, columns 0..n_i-1, right-padded to the longest sequence T.
Packed (THD), (1, sum n_i): sequences are concatenated without padding, positions restart at 0 in
each, and `cu_seqlens` (cumulative lengths from 0) tells attention where each sequence starts.

Either way the model output is read back through one index: output row = the sequence's first row
(i * T padded, cu_seqlens[i] packed) + the position inside the sequence that predicts the response
token (`SequenceBatch.response_positions_BR`, which stays inside each sequence's own tokens, so the
padded response columns of the last packed sequence never point past the last row). A sequence's
last token is read at its first row + its length - 1.
"""

from __future__ import annotations

import torch

from megarl.engine.batch import SequenceBatch, routing_placeholder


def cumulative_lengths(lengths_B: torch.Tensor) -> torch.Tensor:
    """(b + 1,) int32 offsets of each sequence in the packed row, starting at 0 (THD's cu_seqlens)."""
    return torch.cat([torch.zeros(1, dtype=torch.long), lengths_B.cumsum(0)]).to(torch.int32)


def pack(batch: SequenceBatch, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens (1, N), positions (1, N), cu_seqlens) of the sequences laid end to end, N = sum of
    their lengths; positions restart at every sequence. N is rounded up to a `multiple` (sequence
    parallelism splits it over TP ranks) by one extra segment of padding that attends only to itself,
    after the real sequences: cu_seqlens has b + 1 entries, or b + 2 with the padding segment."""
    lengths = batch.sequence_lengths_B.tolist()
    padding = -sum(lengths) % multiple
    tokens_N = torch.cat([row[:n] for row, n in zip(batch.tokens_BT, lengths)] + [batch.tokens_BT.new_zeros(padding)])
    positions_N = torch.cat([torch.arange(n) for n in [*lengths, padding]])
    cu_seqlens = cumulative_lengths(torch.tensor([*lengths, padding] if padding else lengths))
    return tokens_N[None], positions_N[None], cu_seqlens


def padding_mask(batch: SequenceBatch, width: int, packed: bool) -> torch.Tensor:
    """(b, width) padded or (1, width) packed: True at the model input's padding tokens (megatron's
    MoE routers leave them out of their losses)."""
    if packed:
        return (torch.arange(width) >= int(batch.sequence_lengths_B.sum()))[None]
    return torch.arange(width)[None] >= batch.sequence_lengths_B[:, None]


def response_output_rows(batch: SequenceBatch, packed: bool) -> torch.Tensor:
    """(b * R,) rows of the flattened model output, (b*T, ...) padded or (N, ...) packed, that predict
    each response token; padded response columns repeat the sequence's last real row."""
    return (batch.response_positions_BR() + _first_rows(batch, packed)[:, None]).flatten()


def last_token_rows(batch: SequenceBatch, packed: bool) -> torch.Tensor:
    """(b,) rows of the flattened model output that read each sequence's last token (where a reward model
    scores the whole sequence)."""
    return _first_rows(batch, packed) + batch.sequence_lengths_B - 1


def _first_rows(batch: SequenceBatch, packed: bool) -> torch.Tensor:
    if packed:
        return cumulative_lengths(batch.sequence_lengths_B)[:-1].long()
    return batch.tokens_BT.shape[1] * torch.arange(len(batch))


def router_rows(batch: SequenceBatch, width: int, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (N, L, k), recorded (N,)): the rollout's expert ids of every token of the model input in the
    order megatron's routers see them, and whether the rollout recorded that token's routing.

    Routers flatten their (sequence, batch) input sequence-major: padded (b, width) inputs give row
    t * b + i for position t of sequence i; a packed (1, width) input gives its positions in order.
    Padding rows hold the placeholder ids (`batch.routed_experts_BTLK`'s own padding)."""
    routing_BTLK, recorded_BT = batch.routed_experts_BTLK, batch.routed_positions_BT()
    if packed:
        lengths = batch.sequence_lengths_B.tolist()
        ids = torch.cat([row[:n] for row, n in zip(routing_BTLK, lengths)], 0)
        ids = torch.cat([ids, routing_placeholder(*ids.shape[1:]).repeat(width - len(ids), 1, 1)], 0)
        recorded = torch.cat([row[:n] for row, n in zip(recorded_BT, lengths)])
        return ids, torch.nn.functional.pad(recorded, (0, width - len(recorded)))
    assert routing_BTLK.shape[1] == width, "a padded micro-batch's routing is as wide as its tokens"
    return routing_BTLK.transpose(0, 1).flatten(0, 1), recorded_BT.transpose(0, 1).flatten()
