"""The Triton log-prob/entropy kernels on CUDA against the full-vocabulary PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from megarl.kernels.vocab_parallel_logprobs import logprobs_and_entropy, reference_logprobs_and_entropy

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
NUM_ROWS, PADDED_VOCAB, VOCAB_SIZE = 300, 5120, 5000


def _inputs(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(NUM_ROWS, PADDED_VOCAB, generator=generator)
    targets = torch.randint(0, VOCAB_SIZE, (NUM_ROWS,), generator=generator)
    return logits.to(DEVICE, dtype).requires_grad_(), targets.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("inplace", [False, True])
def test_triton_path_matches_reference(dtype, temperature, inplace):
    pytest.importorskip("triton")
    leaf, targets = _inputs(dtype)
    # The kernel owns a copy of the logits (as in the engine, which gathers response rows first).
    logits = leaf * 1.0 if inplace else leaf
    logprob, entropy = logprobs_and_entropy(logits, targets, vocab_size=VOCAB_SIZE, temperature=temperature,
                                            inplace_backward=inplace, use_triton=True)
    ref_logits = leaf.detach().clone().requires_grad_()
    ref_logprob, ref_entropy = reference_logprobs_and_entropy(ref_logits, targets, VOCAB_SIZE, temperature)
    torch.testing.assert_close(logprob, ref_logprob, atol=1e-4, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-4, rtol=0)
    weights = torch.linspace(-1, 2, NUM_ROWS, device=DEVICE)
    (logprob * weights + 0.3 * entropy).sum().backward()
    (ref_logprob * weights + 0.3 * ref_entropy).sum().backward()
    # Both gradients are rounded to the logits' dtype: allow one bf16 rounding step.
    rtol = 1.6e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(leaf.grad, ref_logits.grad, atol=1e-6, rtol=rtol)
    assert torch.all(leaf.grad[:, VOCAB_SIZE:] == 0)  # padding columns get no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_row_stats_matches_torch(dtype):
    triton_logprobs = pytest.importorskip("megarl.kernels.triton_logprobs")
    temperature, valid = 0.7, VOCAB_SIZE
    generator = torch.Generator().manual_seed(1)
    # A column slice of a wider tensor: rows are strided, as for a rank's slice of gathered logits.
    logits = (3 * torch.randn(NUM_ROWS, PADDED_VOCAB + 64, generator=generator))[:, :PADDED_VOCAB]
    logits = logits.to(DEVICE, dtype)
    # Some targets belong to other TP ranks (negative or past this rank's columns): their target_z is 0.
    local_targets = torch.randint(-50, valid + 50, (NUM_ROWS,), generator=generator).to(DEVICE)
    local_max, sum_exp, sum_pz, target_z = triton_logprobs.local_row_stats(logits, local_targets, valid, temperature)

    z = logits[:, :valid].double() / temperature
    expected_max = z.max(dim=-1).values
    exp_z = (z - expected_max[:, None]).exp()
    owned = (local_targets >= 0) & (local_targets < valid)
    expected_target = torch.where(owned, z.gather(1, local_targets.clamp(0, valid - 1)[:, None]).squeeze(1), 0.0)
    torch.testing.assert_close(local_max.double(), expected_max, atol=1e-5, rtol=0)
    torch.testing.assert_close(sum_exp.double(), exp_z.sum(dim=-1), atol=0, rtol=1e-5)
    torch.testing.assert_close(sum_pz.double(), (exp_z * z).sum(dim=-1), atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(target_z.double(), expected_target, atol=1e-5, rtol=0)

    empty = triton_logprobs.local_row_stats(logits, local_targets, 0, temperature)
    assert torch.all(empty[0] == -torch.inf) and all(torch.all(stat == 0) for stat in empty[1:])
