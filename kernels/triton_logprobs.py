"""Triton versions of the two per-row loops of `vocab_parallel_logprobs`, used on CUDA.

Both kernels launch one program per row and walk that row's columns in BLOCK-wide tiles. Registers
hold one tile at a time, so rows of any width fit. Apart from the gradient itself, no (N, V) buffer
is allocated. Logits are read in their own dtype (fp32, bf16, fp16), and all arithmetic is in fp32.

`local_row_stats` (forward) uses an online softmax, as in flash attention. It keeps a running max m
and the sums S = sum exp(z - m) and P = sum exp(z - m) z. When a tile raises the max to m', both
sums are first multiplied by exp(m - m'), and then the tile's own terms are added. So one read of
the logits gives all three values, and the target logit costs one extra scalar load. Combining the
TP ranks stays in PyTorch (`vocab_parallel_logprobs`).

`row_gradients_` (backward) reads a tile, recomputes p = exp(z - lse) and writes

    d/dlogits = (-p (g_logprob + g_entropy (z - E_p[z])) + [v = target] g_logprob) / T

with zero past `valid` (Megatron's vocabulary padding). Programs own disjoint rows. Each program
loads a tile before it stores to it, and every element of the gradient depends only on the same
element of the logits. So `grad_out_NV` may be the logits tensor itself (in-place backward).

Row offsets are computed in int64, because N * V exceeds 2**31 for long batches with a 150k
vocabulary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Wide tiles keep the loops memory-bound. At 4096 fp32 values on 8 warps, each thread holds 16.
MAX_BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _row_stats_kernel(logits_ptr, targets_ptr, max_ptr, sum_exp_ptr, sum_pz_ptr, target_z_ptr,
                      stride_row, stride_col, valid, temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_row
    offsets = tl.arange(0, BLOCK)
    running_max = float("-inf")
    sum_exp = 0.0
    sum_pz = 0.0
    for start in range(0, valid, BLOCK):
        cols = start + offsets
        mask = cols < valid
        z = tl.load(logits_row + cols * stride_col, mask=mask, other=float("-inf")).to(tl.float32) / temperature
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        exp_z = tl.exp(z - new_max)  # 0 on masked columns
        scale = tl.exp(running_max - new_max)  # 0 on the first tile
        sum_exp = sum_exp * scale + tl.sum(exp_z, axis=0)
        # Masked columns would give 0 * -inf = nan.
        sum_pz = sum_pz * scale + tl.sum(tl.where(mask, exp_z * z, 0.0), axis=0)
        running_max = new_max
    target = tl.load(targets_ptr + row)
    owned = (target >= 0) & (target < valid)
    target_logit = tl.load(logits_row + tl.where(owned, target, 0) * stride_col, mask=owned, other=0.0)
    tl.store(max_ptr + row, running_max)
    tl.store(sum_exp_ptr + row, sum_exp)
    tl.store(sum_pz_ptr + row, sum_pz)
    tl.store(target_z_ptr + row, target_logit.to(tl.float32) / temperature)


@triton.jit
def _row_gradients_kernel(grad_ptr, logits_ptr, targets_ptr, lse_ptr, mean_z_ptr, grad_logprob_ptr,
                          grad_entropy_ptr, grad_stride_row, grad_stride_col, stride_row, stride_col,
                          num_cols, valid, temperature, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * stride_row
    grad_row = grad_ptr + row * grad_stride_row
    target = tl.load(targets_ptr + row)
    lse = tl.load(lse_ptr + row)
    mean_z = tl.load(mean_z_ptr + row)
    grad_logprob = tl.load(grad_logprob_ptr + row)
    grad_entropy = tl.load(grad_entropy_ptr + row)
    offsets = tl.arange(0, BLOCK)
    for start in range(0, num_cols, BLOCK):
        cols = start + offsets
        in_vocab = cols < valid
        z = tl.load(logits_row + cols * stride_col, mask=in_vocab, other=0.0).to(tl.float32) / temperature
        p = tl.exp(z - lse)
        grad = -p * (grad_logprob + grad_entropy * (z - mean_z)) + tl.where(cols == target, grad_logprob, 0.0)
        grad = tl.where(in_vocab, grad / temperature, 0.0)
        tl.store(grad_row + cols * grad_stride_col, grad.to(grad_ptr.dtype.element_ty), mask=cols < num_cols)


def _block(num_cols: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(max(num_cols, 16)))


def local_row_stats(logits_NV: torch.Tensor, local_targets_N: torch.Tensor, valid: int, temperature: float):
    """(local_max_N, sum_exp_N, sum_pz_N, target_z_N) in fp32 over the first `valid` columns."""
    num_rows = logits_NV.shape[0]
    stats = torch.zeros(4, num_rows, dtype=torch.float32, device=logits_NV.device)
    stats[0].fill_(-torch.inf)
    if valid > 0 and num_rows > 0:
        _row_stats_kernel[(num_rows,)](
            logits_NV, local_targets_N.contiguous(), *stats, *logits_NV.stride(), valid, float(temperature),
            BLOCK=_block(valid), num_warps=NUM_WARPS,
        )
    return tuple(stats)


def row_gradients_(grad_out_NV, logits_NV, local_targets_N, lse_N, mean_z_N, grad_logprob_N, grad_entropy_N,
                   valid: int, temperature: float) -> torch.Tensor:
    """Write d(logprob, entropy)/dlogits into every column of `grad_out_NV`. It may be `logits_NV`."""
    num_rows, num_cols = logits_NV.shape
    if num_rows > 0 and num_cols > 0:
        # Autograd may hand in expanded (stride-0) per-row gradients.
        vectors = [t.float().contiguous() for t in (lse_N, mean_z_N, grad_logprob_N, grad_entropy_N)]
        _row_gradients_kernel[(num_rows,)](
            grad_out_NV, logits_NV, local_targets_N.contiguous(), *vectors, *grad_out_NV.stride(),
            *logits_NV.stride(), num_cols, valid, float(temperature), BLOCK=_block(num_cols), num_warps=NUM_WARPS,
        )
    return grad_out_NV
