"""Splitting a step's work over DP ranks and into micro-batches; every sample is used exactly once.

Over DP: items (sequences, or an RL step's groups: the n responses of one prompt) are dealt longest
first, each to the rank with the fewest tokens so far (the LPT rule, as verl's sequence balancing),
which keeps per-rank work within one item of balanced. An RL update cuts the step's groups into
mini-batches in a seeded order that does not depend on DP (`mini_batch_groups`), and each DP rank
owns a balanced part of every mini-batch of the first epoch (`owned_groups`).

Into micro-batches: fixed mode cuts a rank's share, in order, into micro-batches of a fixed size;
dynamic mode fills micro-batches under a token budget per rank. Where the layout packs sequences
(Transformer Engine's THD), a micro-batch costs its real tokens, and dynamic mode balances those. Where it
right-pads every row to the micro-batch's longest, a micro-batch costs its sequences times its longest:
dynamic mode then cuts the share sorted by length, so that short sequences are not padded to a long one's
length (`padded_micro_batches`: with a long tail of response lengths, most of a step's padding). With expert
parallelism every MoE layer's forward and backward is a collective over DP ranks, so their micro-batch
counts must agree (`recut_micro_batches`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from megarl.models.architecture import Architecture
from megarl.seeding import derive_seed


def balance_over_data_parallel(tokens: list[int], dp: int) -> list[list[int]]:
    """Item indices for each DP rank, balancing tokens; ranks still empty come first, so that every
    rank receives work while items last."""
    ranks: list[list[int]] = [[] for _ in range(dp)]
    loads = [0] * dp
    for index in sorted(range(len(tokens)), key=lambda i: -tokens[i]):
        rank = min(range(dp), key=lambda r: (len(ranks[r]) > 0, loads[r]))
        ranks[rank].append(index)
        loads[rank] += tokens[index]
    return [sorted(indices) for indices in ranks]


def mini_batch_groups(num_groups: int, groups_per_mini_batch: int, seed: int, step: int, epoch: int
                      ) -> list[list[int]]:
    """The groups of each mini-batch of an update's epoch: a permutation drawn from the run's `seed`
    for this step and epoch (`megarl.seeding`), cut into mini-batches; the same at any layout."""
    generator = torch.Generator().manual_seed(derive_seed(seed, "mini_batch_order", step=step, draw=epoch))
    order = torch.randperm(num_groups, generator=generator).tolist()
    return [order[i : i + groups_per_mini_batch] for i in range(0, num_groups, groups_per_mini_batch)]


def owned_groups(group_tokens: list[int], mini_batches: list[list[int]], dp: int) -> list[list[int]]:
    """The groups each DP rank owns: every mini-batch balanced over the ranks by tokens."""
    owners: list[list[int]] = [[] for _ in range(dp)]
    for groups in mini_batches:
        for rank, picks in enumerate(balance_over_data_parallel([group_tokens[g] for g in groups], dp)):
            owners[rank] += [groups[i] for i in picks]
    return [sorted(groups) for groups in owners]


def fixed_micro_batches(indices: list[int], micro_batch_size: int) -> list[list[int]]:
    return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]


MICRO_BATCH_TOKENS = 128
"""What running one more micro-batch costs (the schedule's and every layer's fixed work), in padded tokens.
Measured on 2 CPU processes (2026-11-27), the long-tailed task's update (bench/async_vs_sync.py's workload,
steps 3-15): 0.17 s a step at 32 and at 128, 0.20 s at 512, 0.28 s in the fewest micro-batches the budget
allows, 0.45 s in micro-batches balanced by real tokens; the quick start's, without prompt sharing (even
lengths): 0.07 s at 32, at 128 and in the fewest."""


DEFAULT_SEQUENCES = 4
"""A micro-batch's sequences where `micro_batch_size_per_rank` is 0 (the default): the fixed size, and under a
token budget its measure in the share's longest sequences (verl's and NeMo-RL's default micro-batch)."""

ACTIVATION_BYTES = 1 << 30
"""The activations of one micro-batch that the default token budget always allows (1 GiB): a small model
with short sequences runs a rank's whole share in one forward (4 sequences cut the quick start's 8x8 share
into four, at ~20 ms of fixed cost each on a CPU), while a larger model's budget stays `DEFAULT_SEQUENCES`
sequences (1 GiB holds ~340 tokens of a 0.5B Qwen2 in bfloat16 at rows of 1,280)."""


def activation_bytes_per_token(arch: Architecture, dtype_bytes: int, width: int) -> int:
    """An estimate of the bytes one token of a micro-batch keeps for backward, all layers together, counted on
    megatron-core's local layers: per layer 8 x hidden + 4 x query + 2 x key-value (the norms' inputs and
    outputs, the projections' inputs, RoPE's, and attention's with keys and values repeated for every query
    head), the probabilities of unfused attention over a row of `width` tokens (heads x width), and 5 x the
    MLP's width (its gate and up projections, their activation and product; in a mixture-of-experts layer the
    routed experts' times top-k plus the shared expert's, and the router's scores and the token's routed
    copies); then float32 logits. The saved tensors of a training step of the quick start's model (float32,
    16 rows of 17 tokens, 2026-11-29) came to 54,254 bytes a token, this estimate to 58,836. Unsplit over
    tensor parallelism; the first pipeline stage keeps as many micro-batches in flight as there are stages,
    each over its own layers: all layers' worth again."""
    query, key_value = arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    attention = 8 * arch.hidden_size + 4 * query + 2 * key_value + arch.num_attention_heads * width
    dense_mlp = 5 * arch.ffn_hidden_size
    moe_mlp = (5 * (arch.moe_topk * arch.moe_ffn_hidden_size + arch.shared_expert_ffn_hidden_size)
               + arch.num_experts + 2 * arch.moe_topk * arch.hidden_size)
    layers = sum(attention + (moe_mlp if arch.is_moe_layer(layer) else dense_mlp) for layer in range(arch.num_layers))
    return dtype_bytes * layers + 4 * arch.vocab_size


def default_token_budget(arch: Architecture, dtype_bytes: int, longest: int, widest: int) -> int:
    """The token budget where neither `max_token_len_per_rank` nor `micro_batch_size_per_rank` is set:
    `DEFAULT_SEQUENCES` times the share's `longest` sequence, or what `ACTIVATION_BYTES` holds where that is
    more; `widest`: the share's widest row (a prompt with its responses where prompts are shared), over which
    attention weighs each token."""
    return max(DEFAULT_SEQUENCES * longest, ACTIVATION_BYTES // activation_bytes_per_token(arch, dtype_bytes, widest))


def _check_fits(tokens: int, max_tokens: int) -> None:
    """A sequence of `tokens` fits one micro-batch alone, or the run stops here."""
    if tokens > max_tokens:
        raise ValueError(f"a sequence of {tokens} tokens exceeds the micro-batch budget "
                         f"max_token_len_per_rank={max_tokens}")


def padded_micro_batches(indices: list[int], lengths_B: torch.Tensor, max_tokens: int) -> list[list[int]]:
    """Micro-batches of rows (a sequence each, or a prompt with its responses: `lengths_B` are their widths)
    whose padded tokens (rows x the widest: the right-padded layout's work and activations) each fit
    `max_tokens`, cut from the rows sorted by width where they cost least: each costs its padded tokens plus
    `MICRO_BATCH_TOKENS` for running at all (dynamic programming over where each run of sorted rows ends)."""
    order = sorted(indices, key=lambda i: int(lengths_B[i]))  # narrowest first, ties in index order
    lengths = [int(lengths_B[i]) for i in order]
    _check_fits(max(lengths, default=0), max_tokens)
    # least[j]: the least cost of the first j sorted rows; start[j]: where the run that ends at j begins (the
    # first of the cheapest). Each j weighs every start at once: a share of 1,024 rows in 8 ms, not 55.
    least, start = np.zeros(len(order) + 1), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        longest = lengths[j - 1]
        first = max(0, j - max_tokens // longest)
        costs = least[first:j] + np.arange(j - first, 0, -1) * longest
        best = int(costs.argmin())
        least[j], start[j] = costs[best] + MICRO_BATCH_TOKENS, first + best
    runs, end = [], len(order)
    while end:
        runs.append(sorted(order[start[end]:end]))
        end = start[end]
    return runs[::-1]


def shared_row_width(row: list[int], prompt_lengths_B: torch.Tensor, response_lengths_B: torch.Tensor) -> int:
    """The tokens of a shared-prompt row: its prompt once, then each of its sequences' responses."""
    return int(prompt_lengths_B[row[0]] + response_lengths_B[row].sum())


def shared_row_micro_batches(rows: list[list[int]], prompt_lengths_B: torch.Tensor, response_lengths_B: torch.Tensor,
                             max_tokens: int) -> list[list[int]]:
    """Micro-batches of shared-prompt rows (each a prompt's sequences: one row of the prompt and their responses)
    under `max_tokens` padded tokens: the rows that fit cut as `padded_micro_batches` cuts rows; a wider one
    alone, in as many micro-batches as its responses need, each taking the next responses while they fit."""
    width = functools.partial(shared_row_width, prompt_lengths_B=prompt_lengths_B,
                              response_lengths_B=response_lengths_B)
    fitting = [row for row in rows if width(row) <= max_tokens]
    runs = padded_micro_batches(list(range(len(fitting))), torch.tensor(list(map(width, fitting))), max_tokens)
    micro = [sorted(i for r in run for i in fitting[r]) for run in runs]
    for row in (row for row in rows if width(row) > max_tokens):
        part: list[int] = []
        for i in row:
            _check_fits(width([i]), max_tokens)
            if part and width(part + [i]) > max_tokens:
                micro.append(part)
                part = []
            part.append(i)
        micro.append(part)
    return micro


def budgeted_micro_batches(indices: list[int], lengths_B: torch.Tensor, max_tokens: int) -> list[list[int]]:
    """Fewest micro-batches whose real tokens each fit `max_tokens`, balanced by first-fit decreasing
    into the least-loaded bin; more bins are opened only when a sequence fits nowhere."""
    _check_fits(max(int(lengths_B[i]) for i in indices), max_tokens)
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


def recut_micro_batches(micro: list[list[int]], count: int, lengths_B: torch.Tensor) -> list[list[int]]:
    """`micro` re-cut into exactly `count` micro-batches (at most one per sequence): the micro-batch with
    the most tokens is split in halves, or the two with the fewest merged, until the count is met."""
    micro = [list(indices) for indices in micro]

    def tokens(indices: list[int]) -> int:
        return sum(int(lengths_B[i]) for i in indices)

    assert 1 <= count <= sum(map(len, micro)), (count, micro)
    while len(micro) < count:
        largest = max((m for m in micro if len(m) > 1), key=tokens)
        micro.remove(largest)
        micro += [largest[: len(largest) // 2], largest[len(largest) // 2 :]]
    while len(micro) > count:
        first, second = sorted(micro, key=tokens)[:2]
        micro.remove(first)
        micro.remove(second)
        micro.append(sorted(first + second))
    return micro


def token_imbalance(tokens_per_rank: list[int]) -> float:
    """Most-loaded DP rank's tokens over the mean (1.0 is perfect balance)."""
    return max(tokens_per_rank) / (sum(tokens_per_rank) / len(tokens_per_rank))
