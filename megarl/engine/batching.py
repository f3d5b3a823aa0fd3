"""Splitting a batch over DP ranks and into micro-batches; every sample is used exactly once.

Fixed mode: each DP rank takes B / DP sequences and cuts them into micro-batches of a fixed size.
Dynamic mode: micro-batches are filled under a token budget per rank. In both modes sequences are
dealt to DP ranks longest first, each to the rank with the fewest tokens so far (the LPT rule),
which keeps per-rank work within one sequence of balanced.
"""

from __future__ import annotations

import torch


def split_over_data_parallel(lengths_B: torch.Tensor, dp: int, equal_counts: bool) -> list[list[int]]:
    """Sequence indices for each DP rank, balancing tokens; with `equal_counts` each rank gets B/DP."""
    batch_size = len(lengths_B)
    if batch_size < dp or (equal_counts and batch_size % dp):
        need = "a multiple of" if equal_counts else "at least"
        raise ValueError(f"batch of {batch_size} sequences cannot be split over {dp} DP ranks; need {need} {dp}")
    capacity = batch_size // dp if equal_counts else batch_size
    ranks: list[list[int]] = [[] for _ in range(dp)]
    tokens = [0] * dp
    for index in sorted(range(batch_size), key=lambda i: -int(lengths_B[i])):
        open_ranks = [r for r in range(dp) if len(ranks[r]) < capacity]
        # Ranks still empty come first so that every rank receives work.
        rank = min(open_ranks, key=lambda r: (len(ranks[r]) > 0, tokens[r]))
        ranks[rank].append(index)
        tokens[rank] += int(lengths_B[index])
    return [sorted(indices) for indices in ranks]


def fixed_micro_batches(indices: list[int], micro_batch_size: int) -> list[list[int]]:
    return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]


def budgeted_micro_batches(indices: list[int], lengths_B: torch.Tensor, max_tokens: int) -> list[list[int]]:
    """Fewest micro-batches whose real tokens each fit `max_tokens`, balanced by first-fit decreasing
    into the least-loaded bin; more bins are opened only when a sequence fits nowhere."""
    longest = max(int(lengths_B[i]) for i in indices)
    if longest > max_tokens:
        raise ValueError(
            f"a sequence of {longest} tokens exceeds the micro-batch budget max_token_len_per_rank={max_tokens}"
        )
    total = sum(int(lengths_B[i]) for i in indices)
    num_bins = -(-total // max_tokens)
    while True:
        bins: list[list[int]] = [[] for _ in range(num_bins)]
        loads = [0] * num_bins
        for index in sorted(indices, key=lambda i: -int(lengths_B[i])):
            length = int(lengths_B[index])
            fitting = [b for b in range(num_bins) if loads[b] + length <= max_tokens]
            if not fitting:
                break
            target = min(fitting, key=lambda b: loads[b])
            bins[target].append(index)
            loads[target] += length
        else:
            return [sorted(b) for b in bins if b]
        num_bins += 1


def token_imbalance(lengths_B: torch.Tensor, ranks: list[list[int]]) -> float:
    """Most-loaded DP rank's tokens over the mean (1.0 is perfect balance)."""
    tokens = [sum(int(lengths_B[i]) for i in indices) for indices in ranks]
    return max(tokens) / (sum(tokens) / len(tokens))
