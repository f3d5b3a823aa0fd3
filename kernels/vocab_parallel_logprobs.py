"""Log-probabilities of target tokens and the entropy, from vocab-parallel logits, in chunks.

Each TP rank holds logits for its slice of the vocabulary, (N, V/TP). With z = logits / T:

    lse     = log sum_v exp(z_v)                  (over the whole vocabulary, all TP ranks)
    logprob = z_target - lse
    entropy = lse - E_p[z],   p = softmax(z)

Forward: one pass over row chunks computes, per row, the local max m_r, the local sums
S_r = sum exp(z - m_r) and P_r = sum exp(z - m_r) z, and the target logit when this rank owns the
target. Two small all-reduces (MAX of m, then SUM of the rescaled S, P and target logit) combine
the ranks. Only one (chunk, V/TP) temporary exists at a time; neither the full vocabulary nor a
full (N, V/TP) softmax is ever materialised.

Backward recomputes p chunk by chunk from the saved logits and the per-row lse and E_p[z]:

    d logprob / d z_v = [v = target] - p_v
    d entropy / d z_v = -p_v (z_v - E_p[z])

and divides by T. With `inplace_backward` the gradient is written into the logits' own storage
(as megatron's vocab-parallel cross entropy does), so backward needs no second (N, V/TP) buffer;
the caller promises not to read the logits afterwards. Columns past the real vocabulary (Megatron's
padding) are excluded: they get probability zero and gradient zero. `reference_logprobs_and_entropy`
is the plain full-vocabulary version the kernel is tested against.

With `use_triton` (CUDA tensors; the caller decides, megarl asks `megarl.device.triton()`), the two
per-row loops (local statistics, gradient) run as the Triton kernels of `triton_logprobs`; the
chunked PyTorch loops here are the CPU path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _valid_columns(vocab_start: int, local_vocab: int, vocab_size: int) -> int:
    return max(0, min(local_vocab, vocab_size - vocab_start))


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _local_row_stats(logits_NV, local_targets_N, valid, temperature, chunk_size):
    """(local_max_N, sum_exp_N, sum_pz_N, target_z_N) over the first `valid` columns, chunk by chunk."""
    num_rows = logits_NV.shape[0]
    stats = torch.zeros(4, num_rows, dtype=torch.float32, device=logits_NV.device)
    local_max, sum_exp, sum_pz, target_z = stats
    local_max.fill_(-torch.inf)
    owned_N = (local_targets_N >= 0) & (local_targets_N < valid)
    for start in range(0, num_rows, chunk_size):
        if valid == 0:
            break
        rows = slice(start, min(start + chunk_size, num_rows))
        z = logits_NV[rows, :valid].float() / temperature  # (chunk, valid)
        chunk_max = z.max(dim=-1).values
        exp_z = (z - chunk_max[:, None]).exp_()
        local_max[rows] = chunk_max
        sum_exp[rows] = exp_z.sum(dim=-1)
        sum_pz[rows] = torch.linalg.vecdot(exp_z, z)
        index = local_targets_N[rows].clamp(0, valid - 1)
        target_z[rows] = torch.where(owned_N[rows], z.gather(1, index[:, None]).squeeze(1), 0.0)
    return local_max, sum_exp, sum_pz, target_z


def _row_gradients_(grad_out_NV, logits_NV, local_targets_N, lse_N, mean_z_N, grad_logprob_N, grad_entropy_N,
                    valid, temperature, chunk_size):
    """Write d/dlogits into every column of `grad_out_NV` (zero past `valid`); it may be `logits_NV`."""
    num_rows = logits_NV.shape[0]
    grad_out_NV[:, valid:] = 0
    owned_N = (local_targets_N >= 0) & (local_targets_N < valid)
    for start in range(0, num_rows, chunk_size):
        if valid == 0:
            break
        rows = slice(start, min(start + chunk_size, num_rows))
        # Two (chunk, valid) buffers: z becomes the gradient in place, p is the softmax.
        z = logits_NV[rows, :valid].float() / temperature
        p = (z - lse_N[rows, None]).exp_()
        grad_z = z.sub_(mean_z_N[rows, None]).mul_(grad_entropy_N[rows, None]).add_(grad_logprob_N[rows, None])
        grad_z.mul_(p).neg_()
        owned_rows = owned_N[rows].nonzero().squeeze(1)
        grad_z[owned_rows, local_targets_N[rows][owned_rows]] += grad_logprob_N[rows][owned_rows]
        grad_out_NV[rows, :valid] = grad_z.div_(temperature)  # each chunk is read (into z) before this write
    return grad_out_NV


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, targets_N, group, vocab_start, vocab_size, temperature, chunk_size, inplace_backward,
                use_triton):
        local_vocab = logits_NV.shape[1]
        valid = _valid_columns(vocab_start, local_vocab, vocab_size)
        local_targets_N = targets_N - vocab_start
        if use_triton:
            from megarl.kernels.triton_logprobs import local_row_stats

            local_max, sum_exp, sum_pz, target_z = local_row_stats(logits_NV, local_targets_N, valid, temperature)
        else:
            local_max, sum_exp, sum_pz, target_z = _local_row_stats(
                logits_NV, local_targets_N, valid, temperature, chunk_size
            )
        global_max = local_max.clone()
        _all_reduce(global_max, dist.ReduceOp.MAX, group)
        scale = torch.exp(local_max - global_max)  # zero on ranks without valid columns
        sums = torch.stack([sum_exp * scale, sum_pz * scale, target_z])
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        total_exp, total_pz, target_z = sums
        lse_N = global_max + torch.log(total_exp)
        mean_z_N = total_pz / total_exp
        ctx.save_for_backward(logits_NV, targets_N, lse_N, mean_z_N)
        ctx.config = (vocab_start, vocab_size, temperature, chunk_size, inplace_backward, use_triton)
        return target_z - lse_N, lse_N - mean_z_N

    @staticmethod
    def backward(ctx, grad_logprob_N, grad_entropy_N):
        logits_NV, targets_N, lse_N, mean_z_N = ctx.saved_tensors
        vocab_start, vocab_size, temperature, chunk_size, inplace_backward, use_triton = ctx.config
        local_vocab = logits_NV.shape[1]
        valid = _valid_columns(vocab_start, local_vocab, vocab_size)
        grad_logits_NV = logits_NV if inplace_backward else torch.empty_like(logits_NV)
        gradient_args = (grad_logits_NV, logits_NV, targets_N - vocab_start, lse_N, mean_z_N,
                         grad_logprob_N, grad_entropy_N, valid, temperature)
        if use_triton:
            from megarl.kernels.triton_logprobs import row_gradients_

            row_gradients_(*gradient_args)
        else:
            _row_gradients_(*gradient_args, chunk_size)
        return grad_logits_NV, None, None, None, None, None, None, None, None


def logprobs_and_entropy(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    inplace_backward: bool = False,
    use_triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob_N, entropy_N) in fp32 from this rank's vocab slice `logits_NV`.

    `vocab_start` is the global index of the slice's first column, `vocab_size` the real (unpadded)
    vocabulary size, `group` the TP group sharing the vocabulary (None: the whole vocab is local).
    `use_triton` runs the Triton kernels (CUDA tensors and an importable `triton` required).
    """
    assert not use_triton or logits_NV.is_cuda, "the Triton kernels need CUDA tensors"
    vocab_size = vocab_start + logits_NV.shape[-1] if vocab_size is None else vocab_size
    return _ChunkedLogProbs.apply(
        logits_NV, targets_N, group, vocab_start, vocab_size, temperature, chunk_size, inplace_backward, use_triton
    )


def reference_logprobs_and_entropy(
    logits_NV: torch.Tensor, targets_N: torch.Tensor, vocab_size: int, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same quantities from the full-vocabulary logits, with plain PyTorch autograd."""
    log_p = torch.log_softmax(logits_NV[:, :vocab_size].float() / temperature, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(dim=-1)
    return log_p.gather(1, targets_N[:, None]).squeeze(1), entropy
