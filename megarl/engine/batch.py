"""The batch the engine scores and trains on: prompt+response sequences, right-padded.

Each sequence i is `prompt_i + response_i` packed from column 0 and right-padded to T. With causal
attention, right padding never changes the outputs of real tokens, so no attention mask is needed.
Per-token quantities of responses (log-probs, values, advantages, masks) are *response-aligned*:
(B, R) tensors whose column j is the j-th response token, right-padded to the longest response.
The logits that predict response token j of sequence i sit at position prompt_length_i - 1 + j.

Multi-turn rollouts (`megarl.agent`) interleave the model's tokens with its environment's in one
response: `loss_mask_BR` is 1 on the model's tokens only, and `response_mask_BR` is that mask, so every
loss, advantage and metric over the response mask counts the model's tokens alone. Lengths still
count every response token (`response_lengths_B`: the token budget, positions, micro-batching).

Mixture-of-experts rollouts also carry the experts the rollout engine routed each token to
(`routed_experts_BTLK`), token-aligned like `tokens_BT`: the actor replays them (router replay) and
measures how often its own routing agrees. The engine ran every position but the last of each
sequence (the last response token is never fed back); that position and the padding hold
placeholder ids (experts 0..k-1), where the router keeps its own choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

import torch


def routing_placeholder(num_layers: int, topk: int) -> torch.Tensor:
    """(L, k) int16 expert ids of a position the rollout engine did not route: experts 0..k-1 in every
    layer (valid, distinct ids: a well-formed top-k wherever they end up)."""
    return torch.arange(topk, dtype=torch.int16).expand(num_layers, topk)


def right_pad_routing(routing: list[torch.Tensor], width: int) -> torch.Tensor:
    """(B, width, L, k) int16: row i holds `routing[i]` ((n_i, L, k), n_i <= width) from position 0,
    then the placeholder."""
    num_layers, topk = routing[0].shape[1:]
    padded = routing_placeholder(num_layers, topk).repeat(len(routing), width, 1, 1)
    for i, ids in enumerate(routing):
        padded[i, : len(ids)] = ids
    return padded


def right_pad(rows: list[list], pad_value, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """(B, T): row i holds `rows[i]` from column 0, right-padded with `pad_value` to the longest row."""
    padded = torch.full((len(rows), max(map(len, rows))), pad_value, dtype=dtype)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return padded


@dataclass
class ResponseTensors:
    """The response-aligned (B, R) float32 tensors a batch carries from phase to phase of an RL step, each
    None until the phase that makes it has run (the phase in brackets)."""

    rollout_logprobs_BR: torch.Tensor | None = None
    """The rollout engine's log-probs of the sampled tokens [rollout]."""
    old_logprobs_BR: torch.Tensor | None = None
    """The actor's log-probs before its update [score; or the update's own forward when it is the only step]."""
    ref_logprobs_BR: torch.Tensor | None = None
    """The reference model's log-probs, for a KL loss or the KL in the reward [score]."""
    teacher_logprobs_BR: torch.Tensor | None = None
    """On-policy distillation: the teacher's log-probs [score]."""
    values_BR: torch.Tensor | None = None
    """The critic's values [score]."""
    prm_ref_logprobs_BR: torch.Tensor | None = None
    """PRIME: the log-probs of the implicit PRM's frozen reference [update_prm]."""
    prm_labels_BR: torch.Tensor | None = None
    """PRIME: each response's 0/1 outcome label on its tokens [update_prm]."""
    process_rewards_BR: torch.Tensor | None = None
    """PRIME: the implicit PRM's token rewards [update_prm]."""
    advantages_BR: torch.Tensor | None = None
    """[advantage]"""
    returns_BR: torch.Tensor | None = None
    """The critic's regression targets [advantage]."""

    def present(self) -> dict[str, torch.Tensor]:
        """The tensors made so far, by field name."""
        return {f.name: value for f in fields(self) if (value := getattr(self, f.name)) is not None}

    def map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> ResponseTensors:
        """`function` of every tensor made so far (the others stay None)."""
        return ResponseTensors(**{name: function(tensor) for name, tensor in self.present().items()})


@dataclass
class SequenceBatch:
    tokens_BT: torch.Tensor
    """Token ids of prompt then response, right-padded (long)."""

    prompt_lengths_B: torch.Tensor
    """Number of prompt tokens of each sequence (>= 1)."""

    response_lengths_B: torch.Tensor
    """Number of response tokens of each sequence (>= 1)."""

    response_tensors: ResponseTensors = field(default_factory=ResponseTensors)
    """The per-token response-aligned tensors of the step's phases: log-probs, values, advantages..."""

    routed_experts_BTLK: torch.Tensor | None = None
    """MoE rollouts: (B, T, num MoE layers, top-k) int16 expert ids of each position, aligned with
    `tokens_BT` (placeholder ids where the engine routed nothing); None otherwise."""

    loss_mask_BR: torch.Tensor | None = None
    """Multi-turn rollouts: (B, R) float, 1 on the model's response tokens, 0 on its environment's and
    on padding; None: every response token is the model's."""

    @classmethod
    def from_sequences(cls, prompt_ids: list[list[int]], response_ids: list[list[int]], pad_token_id: int,
                       response_tensors: ResponseTensors | None = None,
                       routed_experts: list[torch.Tensor] | None = None,
                       loss_masks: list[list[int]] | None = None) -> SequenceBatch:
        """The batch of `prompt_ids[i] + response_ids[i]`, right-padded; `routed_experts[i]`: the
        (P_i + R_i - 1, L, k) expert ids the rollout engine routed that sequence's tokens to;
        `loss_masks[i]`: 1 on the model's tokens of `response_ids[i]`, 0 on the environment's."""
        tokens_BT = right_pad([p + r for p, r in zip(prompt_ids, response_ids)], pad_token_id)
        routing = right_pad_routing(routed_experts, tokens_BT.shape[1]) if routed_experts else None
        loss_mask = right_pad(loss_masks, 0, torch.float32) if loss_masks else None
        return cls(tokens_BT, torch.tensor([len(p) for p in prompt_ids]), torch.tensor([len(r) for r in response_ids]),
                   response_tensors or ResponseTensors(), routing, loss_mask)

    def __len__(self) -> int:
        return self.tokens_BT.shape[0]

    @property
    def sequence_lengths_B(self) -> torch.Tensor:
        return self.prompt_lengths_B + self.response_lengths_B

    @property
    def max_response_length(self) -> int:
        return int(self.response_lengths_B.max())

    @property
    def response_mask_BR(self) -> torch.Tensor:
        """1 on the response tokens the model wrote (what losses and metrics count), 0 elsewhere."""
        if self.loss_mask_BR is not None:
            return self.loss_mask_BR[:, : self.max_response_length]
        return self._length_mask_BR()

    def _length_mask_BR(self) -> torch.Tensor:
        """1 on every response token, 0 on padding."""
        columns_R = torch.arange(self.max_response_length)
        return (columns_R[None, :] < self.response_lengths_B[:, None]).float()

    @property
    def num_loss_tokens(self) -> int:
        """The model's response tokens: the count token-mean losses divide by."""
        return int(self.response_mask_BR.sum())

    def response_positions_BR(self) -> torch.Tensor:
        """Positions inside each sequence whose outputs predict its response tokens. Padded columns
        repeat the sequence's own last predicting position (length - 2), never a position past its
        own tokens: in a packed layout that would be another sequence's row, or past the last row."""
        columns_R = torch.arange(self.max_response_length)
        positions = self.prompt_lengths_B[:, None] - 1 + columns_R[None, :]
        return torch.minimum(positions, self.sequence_lengths_B[:, None] - 2)

    def routed_positions_BT(self) -> torch.Tensor:
        """(B, T) bool: the positions whose routing the rollout engine recorded (all but each
        sequence's last token, and no padding)."""
        return torch.arange(self.tokens_BT.shape[1])[None, :] < self.sequence_lengths_B[:, None] - 1

    def response_tokens_BR(self) -> torch.Tensor:
        return self.tokens_BT.gather(1, self.response_positions_BR() + 1)

    def select(self, indices: list[int] | torch.Tensor) -> SequenceBatch:
        """The sub-batch of `indices`, trimmed to its own longest sequence and response."""
        indices = torch.as_tensor(indices, dtype=torch.long)
        prompt_lengths = self.prompt_lengths_B[indices]
        response_lengths = self.response_lengths_B[indices]
        length = int((prompt_lengths + response_lengths).max())
        width = int(response_lengths.max())
        return SequenceBatch(
            tokens_BT=self.tokens_BT[indices, :length],
            prompt_lengths_B=prompt_lengths,
            response_lengths_B=response_lengths,
            response_tensors=self.response_tensors.map(lambda tensor_BR: tensor_BR[indices, :width]),
            routed_experts_BTLK=(self.routed_experts_BTLK[indices, :length]
                                 if self.routed_experts_BTLK is not None else None),
            loss_mask_BR=self.loss_mask_BR[indices, :width] if self.loss_mask_BR is not None else None,
        )

    def widened_to_multiple(self, multiple: int) -> SequenceBatch:
        """The batch with `tokens_BT` right-padded to a width that is a multiple of `multiple` (sequence
        parallelism splits the sequence over TP ranks); padding columns follow every real token."""
        padding = -self.tokens_BT.shape[1] % multiple
        if not padding:
            return self
        tokens_BT = torch.nn.functional.pad(self.tokens_BT, (0, padding))
        routing = self.routed_experts_BTLK
        if routing is not None:
            routing = torch.cat([routing, routing_placeholder(*routing.shape[2:]).repeat(len(self), padding, 1, 1)], 1)
        return SequenceBatch(tokens_BT, self.prompt_lengths_B, self.response_lengths_B, self.response_tensors, routing,
                             self.loss_mask_BR)

    def validate(self, max_sequence_length: int) -> None:
        """Reject batches the engine cannot run, naming the offending sequence."""
        if len(self) == 0:
            raise ValueError("empty batch: the engine needs at least one sequence")
        lengths = self.sequence_lengths_B
        if int(lengths.max()) > self.tokens_BT.shape[1]:
            raise ValueError(f"sequence lengths up to {int(lengths.max())} exceed tokens_BT width "
                             f"{self.tokens_BT.shape[1]}")
        if int(self.prompt_lengths_B.min()) < 1 or int(self.response_lengths_B.min()) < 1:
            raise ValueError("every sequence needs at least one prompt token and one response token")
        longest = int(lengths.argmax())
        if int(lengths[longest]) > max_sequence_length:
            raise ValueError(
                f"sequence {longest} has {int(lengths[longest])} tokens (prompt {int(self.prompt_lengths_B[longest])}"
                f" + response {int(self.response_lengths_B[longest])}), over the model's max length "
                f"{max_sequence_length}"
            )
        width = self.max_response_length
        for name, tensor in self.response_tensors.present().items():
            if tensor.shape[0] != len(self) or tensor.shape[1] < width:
                raise ValueError(f"response tensor {name!r} has shape {tuple(tensor.shape)}; expected "
                                 f"({len(self)}, >={width})")
        mask = self.loss_mask_BR
        if mask is not None and (mask.shape[0] != len(self) or mask.shape[1] < width
                                 or (mask[:, :width] > self._length_mask_BR()).any()):
            raise ValueError(f"loss_mask_BR has shape {tuple(mask.shape)} or ones past a response; expected "
                             f"({len(self)}, >={width}), zero past each response")
        routing = self.routed_experts_BTLK
        if routing is not None and routing.shape[:2] != self.tokens_BT.shape:
            raise ValueError(f"routed_experts_BTLK has shape {tuple(routing.shape)}; expected "
                             f"{tuple(self.tokens_BT.shape)} + (layers, top-k), aligned with tokens_BT")
