"""The batch contract between phases (`trainer.check_batches=true`).

After each phase the batch must still be self-consistent: response-aligned tensors (B, R) of
float32, finite, zero outside the response mask, token ids inside the vocabulary. A violation
fails naming the phase and the field, so a broken estimator or backend is caught where it broke.
"""

from __future__ import annotations

import torch

from megarl.engine.batch import SequenceBatch


class BatchContractError(ValueError):
    pass


def check_batch(phase: str, batch: SequenceBatch, vocab_size: int, required: tuple[str, ...]) -> None:
    def fail(field: str, problem: str):
        raise BatchContractError(f"batch contract broken after phase '{phase}': field '{field}' {problem}")

    if batch.tokens_BT.dtype != torch.long:
        fail("tokens_BT", f"has dtype {batch.tokens_BT.dtype}, expected torch.int64")
    if int(batch.tokens_BT.min()) < 0 or int(batch.tokens_BT.max()) >= vocab_size:
        fail("tokens_BT", f"has ids outside [0, {vocab_size})")
    if int(batch.sequence_lengths_B.max()) > batch.tokens_BT.shape[1]:
        fail("response_lengths_B", "runs past the end of tokens_BT")
    width = batch.max_response_length
    mask_BR = batch.response_mask_BR
    for name in required:
        if name not in batch.response_tensors:
            fail(name, "is missing")
    for name, tensor in batch.response_tensors.items():
        if tuple(tensor.shape) != (len(batch), width):
            fail(name, f"has shape {tuple(tensor.shape)}, expected ({len(batch)}, {width}) aligned with responses")
        if tensor.dtype != torch.float32:
            fail(name, f"has dtype {tensor.dtype}, expected torch.float32")
        if not torch.isfinite(tensor).all():
            fail(name, "has non-finite values")
        if (tensor * (1 - mask_BR)).abs().max() > 0:
            fail(name, "is non-zero past the end of a response (misaligned with response tokens)")
