"""Packed (THD) and padded layouts of one micro-batch give every response token the same log-prob,
also when sequence parallelism rounds their token count up to a multiple of TP.

A small causal model that honours sequence boundaries stands in for Transformer Engine's THD attention
(positions restart per sequence, context resets at each `cu_seqlens` offset). Each sequence scored on
its own is the reference; the padded and packed layouts go through the engine's own index functions.
"""

from __future__ import annotations

import torch

from megarl.kernels.vocab_parallel_logprobs import logprobs_and_entropy
from megarl.engine.batch import SequenceBatch
from megarl.engine.packing import pack, response_output_rows

VOCAB, HIDDEN, MAX_POSITIONS = 23, 8, 64


class BoundaryAwareCausalModel:
    """logits_t = (token_t + position_t embeddings + mean of earlier token embeddings in the same sequence) @ W."""

    def __init__(self, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
        self.positions = torch.randn(MAX_POSITIONS, HIDDEN, generator=generator, dtype=torch.float64)
        self.out = torch.randn(HIDDEN, VOCAB, generator=generator, dtype=torch.float64)

    def __call__(self, tokens_N: torch.Tensor, positions_N: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """(N, V) logits of N tokens holding the sequences [cu_seqlens[i], cu_seqlens[i+1])."""
        embedded_NH = self.tokens[tokens_N]
        context = []
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            running_nH = embedded_NH[start:end].cumsum(0)
            context.append(running_nH / torch.arange(1, end - start + 1, dtype=torch.float64)[:, None])
        return (embedded_NH + self.positions[positions_N] + torch.cat(context)) @ self.out


def _logprobs(logits_NV, rows, batch):
    logprobs, _ = logprobs_and_entropy(logits_NV[rows], batch.response_tokens_BR().flatten())
    return logprobs.view(len(batch), -1) * batch.response_mask_BR


def test_packed_and_padded_layouts_give_each_sequence_its_own_logprobs():
    # Lengths 19 and 7 as in the dynamic-batching check (the short sequence last), then a mix.
    for prompt_lengths, response_lengths in [([5, 3], [14, 4]), ([2, 6, 1, 4], [9, 1, 12, 3])]:
        prompts, responses = torch.tensor(prompt_lengths), torch.tensor(response_lengths)
        lengths = prompts + responses
        tokens_BT = torch.randint(0, VOCAB, (len(lengths), int(lengths.max())),
                                  generator=torch.Generator().manual_seed(1))
        batch = SequenceBatch(tokens_BT, prompts, responses)
        model = BoundaryAwareCausalModel()

        # Reference: every sequence alone, its response tokens' log-probs read off by hand.
        expected = torch.zeros(len(batch), batch.max_response_length, dtype=torch.float64)
        for i, (p, n) in enumerate(zip(prompt_lengths, lengths.tolist())):
            logits = model(tokens_BT[i, :n], torch.arange(n), torch.tensor([0, n]))
            log_p = torch.log_softmax(logits, dim=-1)
            expected[i, : n - p] = log_p[torch.arange(p - 1, n - 1), tokens_BT[i, p:n]]

        for multiple in (1, 4):  # 4: sequence parallelism at TP4 (26 and 38 tokens are not multiples)
            wide = batch.widened_to_multiple(multiple)
            width = wide.tokens_BT.shape[1]
            assert width % multiple == 0 and torch.equal(wide.tokens_BT[:, : tokens_BT.shape[1]], tokens_BT)
            padded_logits = torch.cat([model(row, torch.arange(width), torch.tensor([0, width]))
                                       for row in wide.tokens_BT])
            padded = _logprobs(padded_logits, response_output_rows(wide, packed=False), wide)

            tokens_1N, positions_1N, cu_seqlens = pack(batch, multiple)
            total = int(lengths.sum())
            assert tokens_1N.shape[1] % multiple == 0 and tokens_1N.shape[1] - total < multiple
            segments = [*lengths.tolist(), *([tokens_1N.shape[1] - total] if tokens_1N.shape[1] > total else [])]
            assert cu_seqlens.tolist() == [0, *torch.tensor(segments).cumsum(0).tolist()]
            packed_logits = model(tokens_1N[0], positions_1N[0], cu_seqlens)
            rows = response_output_rows(batch, packed=True)
            # Every row read belongs to the sequence whose response it scores.
            owner = torch.bucketize(rows, cu_seqlens[1:].long(), right=True).view(len(batch), -1)
            assert torch.equal(owner, torch.arange(len(batch))[:, None].expand_as(owner))
            packed = _logprobs(packed_logits, rows, batch)

            # The kernel computes in fp32: log-probs of size ~20 round at ~1e-6 relative.
            torch.testing.assert_close(padded.double(), expected, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(packed.double(), expected, atol=1e-6, rtol=1e-6)
