"""Where the rollout's expert ids sit: token-aligned in the batch, then in the order megatron's routers
see a micro-batch's tokens (padded: sequence-major (T, b); packed: sequences end to end, then the
padding segment). Positions the rollout engine never routed (each sequence's last token, padding)
hold experts 0..k-1 and count as unrecorded."""

from __future__ import annotations

import pytest
import torch

from megarl.engine.batch import SequenceBatch
from megarl.engine.packing import pack, router_rows

LAYERS, TOPK = 3, 2
PROMPTS, RESPONSES = [[5, 6, 7], [8], [9, 10]], [[11, 12], [13, 14, 15, 16], [17]]


def _rollout_routing():
    """Distinct ids per (sequence, position, layer): id pair (100 s + 10 t + l, 1000 + that), as int16."""
    routing = []
    for s, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        n = len(prompt) + len(response) - 1
        first = torch.tensor([[100 * s + 10 * t + layer for layer in range(LAYERS)] for t in range(n)])
        routing.append(torch.stack([first, first + 1000], -1).short())
    return routing


def _batch():
    return SequenceBatch.from_sequences(PROMPTS, RESPONSES, 0, routed_experts=_rollout_routing())


def _expected(s: int, t: int) -> tuple[list[list[int]], bool]:
    """(L, k) ids at position t of sequence s and whether the rollout recorded them."""
    recorded = t < len(PROMPTS[s]) + len(RESPONSES[s]) - 1
    if not recorded:
        return [[0, 1]] * LAYERS, False
    return [[100 * s + 10 * t + layer, 1000 + 100 * s + 10 * t + layer] for layer in range(LAYERS)], True


def test_batch_routing_is_token_aligned_and_placeholder_where_nothing_was_routed():
    batch = _batch()
    assert batch.routed_experts_BTLK.shape == (3, 5, LAYERS, TOPK) and batch.routed_experts_BTLK.dtype == torch.int16
    for s in range(3):
        for t in range(5):
            ids, recorded = _expected(s, t)
            assert batch.routed_experts_BTLK[s, t].tolist() == ids
            assert bool(batch.routed_positions_BT()[s, t]) == recorded
    picked = batch.select([2, 1])  # trimmed to its own longest sequence (5 tokens)
    assert picked.routed_experts_BTLK.shape == (2, 5, LAYERS, TOPK)
    assert picked.routed_experts_BTLK[0, 1].tolist() == _expected(2, 1)[0]
    assert picked.select([0]).routed_experts_BTLK.shape == (1, 3, LAYERS, TOPK)
    widened = picked.widened_to_multiple(3)
    assert widened.routed_experts_BTLK.shape == (2, 6, LAYERS, TOPK)
    assert widened.routed_experts_BTLK[1, 3].tolist() == _expected(1, 3)[0]
    assert widened.routed_experts_BTLK[1, 5].tolist() == [[0, 1]] * LAYERS
    misaligned = SequenceBatch(batch.tokens_BT, batch.prompt_lengths_B, batch.response_lengths_B,
                               routed_experts_BTLK=batch.routed_experts_BTLK[:, :4])
    with pytest.raises(ValueError, match="routed_experts_BTLK has shape"):
        misaligned.validate(64)


def test_router_rows_follow_the_router_order_padded_and_packed():
    batch = _batch()
    ids_NLK, recorded_N = router_rows(batch, 5, packed=False)
    for t in range(5):
        for s in range(3):  # sequence-major: row t * b + s
            ids, recorded = _expected(s, t)
            assert ids_NLK[t * 3 + s].tolist() == ids and bool(recorded_N[t * 3 + s]) == recorded
    tokens_1N, _, _ = pack(batch, multiple=4)  # 13 tokens rounded up to 16: a padding segment of 3
    ids_NLK, recorded_N = router_rows(batch, tokens_1N.shape[1], packed=True)
    expected = [_expected(s, t) for s in range(3) for t in range(len(PROMPTS[s]) + len(RESPONSES[s]))]
    expected += [([[0, 1]] * LAYERS, False)] * 3
    assert ids_NLK.tolist() == [ids for ids, _ in expected]
    assert recorded_N.tolist() == [recorded for _, recorded in expected]
