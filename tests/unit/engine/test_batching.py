"""Micro-batching and DP splitting: every sample exactly once, budgets respected, balance reported;
an update's mini-batches of whole groups, the same at any DP, each balanced over the DP ranks."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from megarl.engine.batch import ResponseTensors, SequenceBatch, right_pad
from megarl.engine.batching import (
    MICRO_BATCH_TOKENS,
    balance_over_data_parallel,
    budgeted_micro_batches,
    default_token_budget,
    fixed_micro_batches,
    mini_batch_groups,
    owned_groups,
    padded_micro_batches,
    shared_row_micro_batches,
    recut_micro_batches,
    token_imbalance,
)
from tests.unit.engine.test_prompt_sharing import QUICK_START

LENGTHS = torch.tensor([120, 30, 75, 300, 12, 64, 64, 200, 33, 90, 150, 7])


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_dynamic_batching_uses_every_sample_once_under_budget(dp):
    budget = 320
    ranks = balance_over_data_parallel(LENGTHS.tolist(), dp)
    used = []
    for indices in ranks:
        micro = budgeted_micro_batches(indices, LENGTHS, budget)
        for micro_batch in micro:
            assert sum(int(LENGTHS[i]) for i in micro_batch) <= budget
        # The fewest bins the budget allows, plus at most one for packing.
        total = sum(int(LENGTHS[i]) for i in indices)
        assert len(micro) <= -(-total // budget) + 1
        used += [i for micro_batch in micro for i in micro_batch]
    assert sorted(used) == list(range(len(LENGTHS)))
    imbalance = token_imbalance([sum(int(LENGTHS[i]) for i in indices) for indices in ranks])
    # LPT keeps the most-loaded rank within one (the longest) sequence of the mean.
    mean = int(LENGTHS.sum()) / dp
    assert 1.0 <= imbalance <= (mean + int(LENGTHS.max())) / mean


def test_lpt_split_by_hand():
    # Longest first, each to the least-loaded rank: 300->r0, 200->r1, 150->r1 (200<300)...
    ranks = balance_over_data_parallel([300, 200, 150, 100], 2)
    assert ranks == [[0, 3], [1, 2]]
    assert token_imbalance([400, 350]) == pytest.approx(400 / 375)
    # Ranks still empty take the next item, however light the loaded ones are.
    assert balance_over_data_parallel([5, 1, 1], 3) == [[0], [1], [2]]
    assert fixed_micro_batches([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3], [4]]


def test_recut_to_a_common_micro_batch_count_splits_the_heaviest_or_merges_the_lightest_by_hand():
    lengths = torch.tensor([10, 50, 20, 5, 40])
    # 80 tokens in [0, 1, 2] split into [0] and [1, 2]; then [1, 2] (70) into [1] and [2].
    assert recut_micro_batches([[0, 1, 2], [3, 4]], 4, lengths) == [[3, 4], [0], [1], [2]]
    # the two lightest, [3] (5) and [0] (10), merge.
    assert recut_micro_batches([[0], [1], [2], [3], [4]], 4, lengths) == [[1], [2], [4], [0, 3]]
    assert recut_micro_batches([[0, 1]], 1, lengths) == [[0, 1]]


def test_mini_batches_hold_whole_groups_in_a_seeded_order_and_each_is_balanced_over_dp():
    mini_batches = mini_batch_groups(6, 4, seed=1, step=3, epoch=0)
    assert sorted(g for groups in mini_batches for g in groups) == list(range(6))
    assert [len(groups) for groups in mini_batches] == [4, 2]
    assert mini_batches == mini_batch_groups(6, 4, seed=1, step=3, epoch=0)
    assert mini_batches != mini_batch_groups(6, 4, seed=1, step=3, epoch=1)
    # Group tokens by hand: in every mini-batch, LPT over 2 ranks.
    tokens = [100, 10, 40, 70, 30, 60]
    owners = owned_groups(tokens, [[0, 1, 2, 3], [4, 5]], dp=2)
    # [0, 1, 2, 3]: 100->r0, 70->r1, 40->r1 (70<100), 10->r0 (100<110); [4, 5]: 60->r0, 30->r1.
    assert owners == [[0, 1, 5], [2, 3, 4]]


def test_padded_micro_batches_cut_the_sorted_share_where_padding_costs_more_than_a_micro_batch_by_hand():
    lengths = torch.tensor([40, 240, 30, 100, 35, 50])
    # Budget 300 padded tokens: 240 alone; each micro-batch costs MICRO_BATCH_TOKENS (128) more. [30, 35, 40, 50] padded
    # to 50 (200 + 128), [100] (228), [240] (368): 924 (not [30, 35] [40, 50, 100]: 70 + 300 + 240 + 3 x 128 = 994).
    assert padded_micro_batches(list(range(6)), lengths, 300) == [[0, 2, 4, 5], [3], [1]]
    # Even lengths run together: 5 x 60 + 128 = 428 against [30, 35, 40, 50] [60]: 200 + 128 + 60 + 128 = 516.
    assert padded_micro_batches(list(range(5)), torch.tensor([40, 30, 35, 50, 60]), 1000) == [[0, 1, 2, 3, 4]]
    # A long tail: one 240 among short ones runs alone (200 + 128 + 240 + 128 = 696 against 5 x 240 + 128).
    assert padded_micro_batches([0, 1, 2, 4, 5], lengths, 4096) == [[0, 2, 4, 5], [1]]


def test_shared_rows_stay_whole_and_a_row_wider_than_the_budget_goes_alone_by_hand():
    prompts, responses = torch.tensor([10] * 7), torch.tensor([5, 5, 15, 15, 40, 40, 40])
    # Rows 20, 40 and 130 tokens wide at a budget of 100: the first two together (2 x 40 + 128 < 20 + 40 + 2 x 128);
    # the third split over micro-batches of the prompt with its next responses while they fit (10 + 80, 10 + 40).
    assert shared_row_micro_batches([[0, 1], [2, 3], [4, 5, 6]], prompts, responses, 100) == [[0, 1, 2, 3], [4, 5],
                                                                                              [6]]
    with pytest.raises(ValueError, match="a sequence of 105 tokens exceeds .*max_token_len_per_rank=100"):
        shared_row_micro_batches([[0, 1]], prompts, torch.tensor([5, 95]), 100)


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _set_partitions(rest):
        yield [[first], *partition]
        for k in range(len(partition)):
            yield [*partition[:k], [first, *partition[k]], *partition[k + 1:]]


def test_padded_micro_batches_match_a_search_of_every_partition():
    """The least padded tokens plus MICRO_BATCH_TOKENS a micro-batch under the padded budget, as a search over
    every way of splitting the share (not only runs of the sorted share) finds."""
    rng = random.Random(0)
    for _ in range(40):
        lengths = torch.tensor([rng.choice([3, 5, 8, 13, 40, 90]) for _ in range(7)])
        budget = rng.choice([90, 120, 200, 400])
        indices = rng.sample(range(7), rng.randint(1, 7))

        def padded(micro_batch):
            return len(micro_batch) * max(int(lengths[i]) for i in micro_batch)

        def cost(partition):
            return sum(padded(m) + MICRO_BATCH_TOKENS for m in partition)

        least = min(cost(p) for p in _set_partitions(indices) if all(padded(m) <= budget for m in p))
        micro = padded_micro_batches(indices, lengths, budget)
        assert sorted(i for m in micro for i in m) == sorted(indices)
        assert all(padded(m) <= budget for m in micro)
        assert cost(micro) == least


@pytest.mark.parametrize("call,needle", [
    (lambda: budgeted_micro_batches([0, 3], LENGTHS, 299), "300 tokens exceeds .*max_token_len_per_rank=299"),
    (lambda: padded_micro_batches([0, 3], LENGTHS, 299), "300 tokens exceeds .*max_token_len_per_rank=299"),
])
def test_bad_budgets_fail_clearly(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def _batch(prompt, response, width=12):
    return SequenceBatch(torch.ones(len(prompt), width, dtype=torch.long), torch.tensor(prompt), torch.tensor(response))


@pytest.mark.parametrize("batch,needle", [
    (_batch([], [], 0), "empty batch"),
    (_batch([4, 6], [3, 6]), "sequence 1 has 12 tokens .* over the model's max length 10"),
    (_batch([4, 0], [3, 2]), "at least one prompt token"),
    (_batch([4, 9], [3, 9]), "exceed tokens_BT width 12"),
])
def test_bad_batches_fail_naming_the_sequence(batch, needle):
    with pytest.raises(ValueError, match=needle):
        batch.validate(max_sequence_length=10)


QWEN2_5_7B = dataclasses.replace(QUICK_START, num_layers=28, hidden_size=3584, num_attention_heads=28, num_kv_heads=4,
                                 head_dim=128, ffn_hidden_size=18944, vocab_size=152064)


def test_default_budget_holds_a_small_models_share_and_keeps_a_large_ones_to_its_sequences_by_hand():
    """Bytes a token keeps, per layer 8 x hidden + 4 x query + 2 x key-value + heads x row + 5 x MLP, then 4 x
    vocab. The quick start's model in float32, rows of 34: (1,024 + 512 + 128 + 136 + 1,920) x 4 layers x 4 +
    404 = 59,924: 1 GiB holds 17,918 tokens, more than 4 sequences of 34. With 8 experts of 96, top-2, a shared
    expert of 192 after one dense layer: 5 x (2 x 96 + 192) + 8 + 2 x 2 x 128 = 2,440 in place of 1,920 in 3
    layers: 66,164 bytes, 16,228 tokens. Qwen2.5-7B in bfloat16, rows of 1,280: (28,672 + 14,336 + 1,024 +
    35,840 + 94,720) x 28 x 2 + 608,256 = 10,385,408: 1 GiB holds 103, so 4 x 1,280 stays."""
    assert default_token_budget(QUICK_START, 4, 34, 34) == 17_918
    moe = dataclasses.replace(QUICK_START, num_experts=8, moe_topk=2, moe_ffn_hidden_size=96,
                              shared_expert_ffn_hidden_size=192, dense_layers=1)
    assert default_token_budget(moe, 4, 34, 34) == 16_228
    assert default_token_budget(QWEN2_5_7B, 2, 1280, 1280) == 4 * 1280


def test_response_alignment_by_hand():
    tokens = torch.tensor([[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 10, 11]])
    batch = SequenceBatch(tokens, torch.tensor([2, 4]), torch.tensor([3, 2]))
    # Sequence 0: prompt [1, 2], response [3, 4, 5] predicted from positions 1, 2, 3.
    assert batch.response_tokens_BR().tolist() == [[3, 4, 5], [10, 11, 11]]
    assert batch.response_positions_BR().tolist() == [[1, 2, 3], [3, 4, 4]]
    assert batch.response_mask_BR.tolist() == [[1, 1, 1], [1, 1, 0]]
    sub = batch.select([1])
    assert sub.tokens_BT.tolist() == [[6, 7, 8, 9, 10, 11]] and sub.max_response_length == 2


def test_from_sequences_right_pads_prompt_plus_response():
    x = right_pad([[0.5], [1.0, 2.0, 3.0]], 0.0, torch.float32)
    batch = SequenceBatch.from_sequences([[5, 6], [7]], [[1], [2, 3, 4]], pad_token_id=0,
                                         response_tensors=ResponseTensors(rollout_logprobs_BR=x))
    assert batch.tokens_BT.tolist() == [[5, 6, 1, 0], [7, 2, 3, 4]]
    assert batch.prompt_lengths_B.tolist() == [2, 1] and batch.response_lengths_B.tolist() == [1, 3]
    assert batch.response_tokens_BR().tolist()[1] == [2, 3, 4]
    assert batch.response_tensors.rollout_logprobs_BR.tolist() == [[0.5, 0.0, 0.0], [1.0, 2.0, 3.0]]
    assert batch.select([1]).response_tensors.present().keys() == {"rollout_logprobs_BR"}  # the others stay None
