"""The chunked log-prob/entropy kernel against the full-vocabulary reference, forward and backward."""

from __future__ import annotations

import pytest
import torch

from megarl.kernels.vocab_parallel_logprobs import logprobs_and_entropy, reference_logprobs_and_entropy


def _inputs(num_rows=37, padded_vocab=64, vocab_size=50, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(num_rows, padded_vocab, generator=generator, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, vocab_size, (num_rows,), generator=generator)
    return logits, targets


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_size", [5, 1024])
@pytest.mark.parametrize("inplace", [False, True])
def test_matches_reference_forward_and_backward(temperature, chunk_size, inplace):
    leaf, targets = _inputs()
    # The kernel owns a copy of the logits (as in the engine, which gathers response rows first).
    logits = leaf * 1.0 if inplace else leaf
    logprob, entropy = logprobs_and_entropy(logits, targets, vocab_size=50, temperature=temperature,
                                            chunk_size=chunk_size, inplace_backward=inplace)
    ref_logits = leaf.detach().clone().requires_grad_()
    ref_logprob, ref_entropy = reference_logprobs_and_entropy(ref_logits, targets, 50, temperature)
    torch.testing.assert_close(logprob, ref_logprob, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=0)
    weights = torch.linspace(-1, 2, len(targets), dtype=torch.float32)
    (logprob * weights + 0.3 * entropy).sum().backward()
    (ref_logprob * weights + 0.3 * ref_entropy).sum().backward()
    torch.testing.assert_close(leaf.grad, ref_logits.grad, atol=1e-5, rtol=0)
    assert torch.all(leaf.grad[:, 50:] == 0)  # padding columns get no gradient


def test_hand_computed_uniform_case():
    # Four equal logits: every token has probability 1/4, entropy log 4.
    logits = torch.zeros(2, 4, requires_grad=True)
    logprob, entropy = logprobs_and_entropy(logits, torch.tensor([0, 3]))
    torch.testing.assert_close(logprob, torch.full((2,), -torch.log(torch.tensor(4.0)).item()))
    torch.testing.assert_close(entropy, torch.full((2,), torch.log(torch.tensor(4.0)).item()))
    logprob.sum().backward()
    # d logprob / d z = onehot - 1/4
    torch.testing.assert_close(logits.grad, torch.tensor([[0.75, -0.25, -0.25, -0.25], [-0.25, -0.25, -0.25, 0.75]]))


def test_bfloat16_logits_compute_in_float32():
    logits, targets = _inputs()
    logprob, _ = logprobs_and_entropy(logits.detach().bfloat16(), targets, vocab_size=50)
    ref, _ = reference_logprobs_and_entropy(logits.detach().bfloat16(), targets, 50)
    assert logprob.dtype == torch.float32
    torch.testing.assert_close(logprob, ref, atol=1e-4, rtol=0)
