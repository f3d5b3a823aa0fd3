"""One forward of a prompt for all the sequences that share it (`share_prompt_forward`).

A GRPO group's n samples repeat the same prompt; run one sequence per row and the model computes
that prompt n times, forward and backward. Here a micro-batch row holds one distinct prompt
followed by each of its responses, and attention lets a response see the prompt and its own earlier
tokens only:

    row:       p0 p1 p2 | a0 a1 | b0 b1 b2
    position:   0  1  2 |  3  4 |  3  4  5
    a1 sees:   p0 p1 p2   a0 a1
    b0 sees:   p0 p1 p2         b0

Each response token sees exactly what it sees in its own row, at the same positions, so outputs and
gradients equal the one-row-per-sequence layout's up to float rounding (the prompt's gradient is
the sum of its responses' contributions, added in another order). The first response token of every
sequence is predicted by the shared prompt's last output row.

Rows are right-padded to the longest; padding tokens attend to nothing real and nothing attends to
them. Positions within a row differ per row, so RoPE takes per-token positions (`PositionedRope`) and
runs unfused. A model is built for the layout (`megarl.models.builder.build_model`'s `shared_prompts`) on
either layer spec: megatron's local attention applies the mask it is given; Transformer Engine's is told
the mask is arbitrary, and its micro-batches are these padded rows instead of packed sequences.

Whether a model shares prompts is decided when its engine is built (`sharing_off_reason`): it is on
by default wherever it gives the same result for less work, and off, with the reason, otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megarl.config.schema import RunConfig
from megarl.engine.batch import SequenceBatch
from megarl.models.architecture import Architecture

_PADDING = -1  # branch id of padding; the prompt is branch 0, its k-th response branch k


@dataclass(frozen=True)
class PromptGroups:
    """The sequences an RL run's models see: each prompt sampled `samples` times (rollout.n), prompts
    and responses at most these lengths (data.max_prompt_length, data.max_response_length)."""

    samples: int
    max_prompt_length: int
    max_response_length: int

    @classmethod
    def of_run(cls, config: RunConfig) -> PromptGroups:
        return cls(config.rollout.n, config.data.max_prompt_length, config.data.max_response_length)


def sharing_off_reason(arch: Architecture, layer_spec: str, groups: PromptGroups) -> str | None:
    """Why a model of `arch` on `layer_spec` (resolved) should not share prompts for `groups`; None: it should.

    Sharing needs a dense model (megatron's MoE layers route tokens of one row as one sequence's). It pays
    where the linear layers dominate: a group's row of P + nR tokens replaces n rows of P + R, but its
    attention scores the whole (P + nR)^2 square under the row's mask, against n (P + R)^2 separately.
    Long responses tip it: the forward's multiply-adds at the longest prompts and responses decide.

    On Transformer Engine's layers the mask takes TE's unfused attention, which keeps each row's W^2
    probabilities per head for backward, where the packed sequences' flash attention keeps none: sharing
    stays off where that exceeds what the rest of the layer keeps per token (2 bytes x heads x W against
    34 bytes x hidden, Korthikanti et al., 2022), W > 17 x hidden / heads (2,176 tokens at head dim 128)."""
    n, prompt, response = groups.samples, groups.max_prompt_length, groups.max_response_length
    if n < 2:
        return f"rollout.n = {n}: no prompt repeats"
    if arch.is_moe:
        return "mixture-of-experts models do not share prompts"
    width = prompt + n * response
    if layer_spec == "transformer_engine" and 2 * arch.num_attention_heads * width > 34 * arch.hidden_size:
        return (f"Transformer Engine's unfused attention would keep the {width}^2 probabilities per head of a row of "
                f"{prompt} + {n} x {response} tokens for backward, more than the rest of the layer's activations "
                f"(its packed sequences keep none)")
    shared, separate = _forward_cost(arch, width, 1), _forward_cost(arch, prompt + response, n)
    if shared >= separate:
        return (f"attention over one row of {prompt} + {n} x {response} tokens per prompt costs more than its "
                f"{n - 1} prompt copies ({shared / separate:.2f}x the multiply-adds of separate rows)")
    return None


def _forward_cost(arch: Architecture, width: int, rows: int) -> int:
    """Multiply-adds of a forward over `rows` rows of `width` tokens: the linear layers per token, the
    attention's scores and weighted sums per (query, key) pair of a row, the output layer per token."""
    query, key_value = arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    hidden = arch.hidden_size
    per_token = hidden * (2 * query + 2 * key_value) + 3 * hidden * arch.ffn_hidden_size
    per_pair = 2 * query
    return rows * (arch.num_layers * (width * per_token + width * width * per_pair) + width * hidden * arch.vocab_size)


@dataclass(frozen=True)
class SharedPromptInput:
    tokens_gW: torch.Tensor
    """One row per distinct prompt of the micro-batch: the prompt, then each of its responses."""

    positions_gW: torch.Tensor
    """Each token's position inside its own sequence (a response continues its prompt)."""

    blocked_g1WW: torch.Tensor
    """True where a query (row, column) may not attend a key (megatron's attention-mask convention)."""

    output_rows: torch.Tensor
    """(b * R,) rows of the flattened (g * W) model output that predict each response token, in
    micro-batch order; padded response columns repeat the sequence's last predicting row."""

    last_rows: torch.Tensor
    """(b,) rows of the flattened (g * W) model output that read each sequence's last token."""


def prompt_rows(batch: SequenceBatch) -> list[list[int]]:
    """The sequences of each distinct prompt of `batch` (equal prompt tokens), in order of first appearance:
    the rows of its shared-prompt layout."""
    rows: dict[tuple[int, ...], list[int]] = {}
    for i in range(len(batch)):
        rows.setdefault(tuple(batch.tokens_BT[i, : int(batch.prompt_lengths_B[i])].tolist()), []).append(i)
    return list(rows.values())


def share_prompts(batch: SequenceBatch, multiple: int = 1) -> SharedPromptInput:
    """The shared-prompt layout of `batch`, a row per distinct prompt (`prompt_rows`). The width is rounded
    up to a `multiple` (sequence parallelism splits it over TP ranks)."""
    tokens, positions, branches, starts = [], [], [], [(0, 0)] * len(batch)
    for row, sequences in enumerate(prompt_rows(batch)):
        prompt_length = int(batch.prompt_lengths_B[sequences[0]])
        tokens.append(batch.tokens_BT[sequences[0], :prompt_length].tolist())
        positions.append(list(range(prompt_length)))
        branches.append([0] * prompt_length)
        for branch, i in enumerate(sequences, start=1):
            length = int(batch.sequence_lengths_B[i])
            starts[i] = (row, len(tokens[row]))
            tokens[row] += batch.tokens_BT[i, prompt_length:length].tolist()
            positions[row] += range(prompt_length, length)
            branches[row] += [branch] * (length - prompt_length)

    width = max(map(len, tokens))
    width += -width % multiple
    tokens_gW, positions_gW, branches_gW = (
        torch.tensor([row + [fill] * (width - len(row)) for row in rows])
        for rows, fill in ((tokens, 0), (positions, 0), (branches, _PADDING))
    )
    causal_WW = torch.ones(width, width, dtype=torch.bool).tril()
    query, key = branches_gW[:, :, None], branches_gW[:, None, :]
    allowed_gWW = causal_WW & ((key == 0) | (key == query))
    row_B, start_B = (torch.tensor(column) for column in zip(*starts))
    return SharedPromptInput(tokens_gW, positions_gW, ~allowed_gWW[:, None], _output_rows(batch, row_B, start_B, width),
                             _last_rows(batch, row_B, start_B, width))


def _output_rows(batch: SequenceBatch, row_B: torch.Tensor, start_B: torch.Tensor, width: int) -> torch.Tensor:
    last_column_B = batch.response_lengths_B - 1
    columns_BR = torch.minimum(torch.arange(batch.max_response_length)[None, :], last_column_B[:, None])
    # Response token j is predicted by the row before it: the prompt's last token for j = 0.
    predicting_BR = torch.where(columns_BR == 0, batch.prompt_lengths_B[:, None] - 1, start_B[:, None] + columns_BR - 1)
    return (row_B[:, None] * width + predicting_BR).flatten()


def _last_rows(batch: SequenceBatch, row_B: torch.Tensor, start_B: torch.Tensor, width: int) -> torch.Tensor:
    # A response's tokens start at its own column `start`; an empty one ends with the shared prompt.
    lengths_B = batch.response_lengths_B
    return row_B * width + torch.where(lengths_B > 0, start_B + lengths_B - 1, batch.prompt_lengths_B - 1)


class PositionedRope:
    """Gives megatron's RoPE per-token positions: while `positions_gW` is set, every `RotaryEmbedding`
    of the model returns the angles of those positions, (W, g, 1, dim), which its attention
    broadcasts over heads as it does the usual (W, 1, 1, dim) ones."""

    def __init__(self, model: torch.nn.Module):
        self.positions_gW: torch.Tensor | None = None
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.register_forward_hook(self._at_positions)

    def _at_positions(self, module, args, angles_W11D: torch.Tensor) -> torch.Tensor | None:
        if self.positions_gW is None:
            return None
        return angles_W11D[:, 0, 0][self.positions_gW.T.to(angles_W11D.device)].unsqueeze(2)
