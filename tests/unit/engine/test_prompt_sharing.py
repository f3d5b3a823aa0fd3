"""The shared-prompt layout gives every response token the log-prob, and every weight the gradient,
that each sequence scored in a row of its own gives.

A one-head causal attention model (float64, position embeddings, an attention mask) stands in for
megatron's; the reference runs each sequence alone with a plain causal mask.

Whether a model shares prompts: on for the quick start's groups, off (with the reason) where nothing
repeats, for mixture-of-experts models and long responses, and on Transformer Engine's layers for rows whose
attention probabilities outweigh the rest of a layer's activations.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megarl.engine.batch import SequenceBatch
from megarl.engine.prompt_sharing import PromptGroups, share_prompts, sharing_off_reason
from megarl.models.architecture import Architecture

VOCAB, HIDDEN, MAX_POSITIONS = 17, 8, 32


class MaskedAttentionModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.tokens, self.positions, self.qkv, self.out = (
            torch.nn.Parameter(torch.randn(*shape, generator=generator, dtype=torch.float64))
            for shape in ((VOCAB, HIDDEN), (MAX_POSITIONS, HIDDEN), (HIDDEN, 3 * HIDDEN), (HIDDEN, VOCAB))
        )

    def forward(self, tokens_bT, positions_bT, blocked_b1TT):
        """(b, T, V) logits; `blocked_b1TT`: True where a query may not attend a key."""
        hidden = self.tokens[tokens_bT] + self.positions[positions_bT]
        query, key, value = (hidden @ self.qkv).split(HIDDEN, dim=-1)
        scores = (query @ key.transpose(1, 2)).masked_fill(blocked_b1TT[:, 0], float("-inf"))
        return (hidden + scores.softmax(-1) @ value) @ self.out


def _logprobs(logits_NV, rows, batch):
    targets = batch.response_tokens_BR().flatten()
    logprobs = logits_NV[rows].log_softmax(-1).gather(1, targets[:, None]).view(len(batch), -1)
    return logprobs * batch.response_mask_BR


def _batch():
    """Seven sequences over three prompts, the samples of a prompt not all adjacent."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (4, 2, 5)]
    prompt_of = [0, 0, 1, 0, 2, 1, 2]
    response_lengths = [3, 1, 6, 2, 4, 5, 1]
    sequences = [prompts[p] + torch.randint(0, VOCAB, (r,), generator=generator).tolist()
                 for p, r in zip(prompt_of, response_lengths)]
    width = max(map(len, sequences))
    tokens_BT = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    prompt_lengths = torch.tensor([len(prompts[p]) for p in prompt_of])
    return SequenceBatch(tokens_BT, prompt_lengths, torch.tensor(response_lengths))


def test_shared_prompt_rows_give_each_sequence_its_own_logprobs_and_gradients():
    batch = _batch()
    model = MaskedAttentionModel()

    expected = torch.zeros(len(batch), batch.max_response_length, dtype=torch.float64)
    for i in range(len(batch)):
        single = batch.select([i])
        n = int(single.sequence_lengths_B[0])
        causal = ~torch.ones(n, n, dtype=torch.bool).tril()
        logits = model(single.tokens_BT[:, :n], torch.arange(n)[None], causal[None, None])[0]
        rows = single.response_positions_BR().flatten()
        expected[i, : single.max_response_length] = _logprobs(logits, rows, single)[0]
    expected_grads = torch.autograd.grad(expected.sum(), list(model.parameters()))

    for multiple in (1, 4):
        shared = share_prompts(batch, multiple)
        assert shared.tokens_gW.shape[0] == 3 and shared.tokens_gW.shape[1] % multiple == 0
        assert shared.tokens_gW.shape[1] == {1: 13, 4: 16}[multiple]  # the longest row: prompt 1 (2) + 6 + 5
        logits = model(shared.tokens_gW, shared.positions_gW, shared.blocked_g1WW)
        logprobs = _logprobs(logits.flatten(0, 1), shared.output_rows, batch)
        assert torch.allclose(logprobs, expected, atol=1e-12, rtol=0)
        grads = torch.autograd.grad(logprobs.sum(), list(model.parameters()))
        for grad, expected_grad in zip(grads, expected_grads):
            assert torch.allclose(grad, expected_grad, atol=1e-10, rtol=0)


def test_each_token_sees_its_prompt_and_its_own_response_only():
    shared = share_prompts(_batch())
    # Row 0: prompt 0 (4 tokens), then sequence 0 (3), sequence 1 (1), sequence 3 (2).
    allowed = ~shared.blocked_g1WW[0, 0]
    assert allowed[5].tolist()[:10] == [True] * 4 + [True, True] + [False] * 4
    assert allowed[7].tolist()[:10] == [True] * 4 + [False] * 3 + [True] + [False] * 2
    assert shared.positions_gW[0].tolist()[:10] == [0, 1, 2, 3, 4, 5, 6, 4, 4, 5]


# The quick start's model: Qwen2 h128, 4 layers, 4 heads of 32, 2 KV heads, ffn 384, 101 tokens.
QUICK_START = Architecture(
    family="qwen2", value_model=False, num_layers=4, hidden_size=128, num_attention_heads=4, num_kv_heads=2,
    head_dim=32, ffn_hidden_size=384, vocab_size=101, max_position_embeddings=512, rope_theta=1e4,
    rope_type="default", rope_factor=1.0, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True, qk_norm=False,
    initializer_range=0.02,
)


def test_quick_start_groups_share_and_long_responses_do_not():
    """Per layer and token the linear layers take 128 x (2 x 128 + 2 x 64) + 3 x 128 x 384 = 196,608
    multiply-adds, attention 2 x 128 = 256 per (query, key) pair. 8 responses of 8 tokens to a 16-token
    prompt: one row of 80 tokens, 80 x 196,608 + 80^2 x 256 = 17.4M, against 8 rows of 24,
    8 x (24 x 196,608 + 24^2 x 256) = 38.9M: shared. Of 1,024 tokens: 8,208 x 196,608 + 8,208^2 x 256
    = 18.9G against 8 x (1,040 x 196,608 + 1,040^2 x 256) = 3.85G: the square of the shared row loses
    (4.9x; the output layer, 128 x 101 a token, is small beside them)."""
    assert sharing_off_reason(QUICK_START, "local", PromptGroups(8, 16, 8)) is None
    reason = sharing_off_reason(QUICK_START, "local", PromptGroups(8, 16, 1024))
    assert reason.startswith("attention over one row of 16 + 8 x 1024 tokens per prompt costs more")
    assert "(4.8" in reason


@pytest.mark.parametrize(("arch", "layer_spec", "samples", "reason"), [
    (QUICK_START, "local", 1, "rollout.n = 1: no prompt repeats"),
    (dataclasses.replace(QUICK_START, num_experts=4, moe_topk=2, moe_ffn_hidden_size=64), "local", 8,
     "mixture-of-experts models do not share prompts"),
], ids=["one-sample", "moe"])
def test_sharing_is_off_where_it_cannot_pay_or_run(arch, layer_spec, samples, reason):
    assert sharing_off_reason(arch, layer_spec, PromptGroups(samples, 16, 8)).startswith(reason)


def test_transformer_engine_layers_share_rows_whose_probabilities_do_not_outweigh_the_layer():
    """TE's unfused attention keeps 2 bytes x 4 heads x W per token of a row, the rest of the layer 34 x 128 = 4,352
    bytes: rows of up to 544 tokens share. A long prompt with short answers, where the multiply-adds favour sharing
    by far (one row of 528 tokens against 8 of 472): 464 + 8 x 8 = 528 shares on TE too; 512 + 8 x 8 = 576 only on
    the local layers, whose separate rows keep their squares as well."""
    assert sharing_off_reason(QUICK_START, "transformer_engine", PromptGroups(8, 16, 8)) is None
    assert sharing_off_reason(QUICK_START, "transformer_engine", PromptGroups(8, 464, 8)) is None
    reason = sharing_off_reason(QUICK_START, "transformer_engine", PromptGroups(8, 512, 8))
    assert reason.startswith("Transformer Engine's unfused attention would keep the 576^2 probabilities per head")
    assert sharing_off_reason(QUICK_START, "local", PromptGroups(8, 512, 8)) is None
