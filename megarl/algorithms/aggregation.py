"""Reducing a per-token loss (B, R) to the scalar that is back-propagated.

With L the per-token loss, m the 0/1 response mask, T = num_tokens, N = num_sequences and
R_max = max_response_length:

    token-mean               sum_{i,t} L_it m_it / T
    seq-mean-token-sum       sum_i [sum_t L_it m_it] / N
    seq-mean-token-mean      sum_i [sum_t L_it m_it / sum_t m_it] / N
    seq-mean-token-sum-norm  sum_{i,t} L_it m_it / (N * R_max)        (Dr. GRPO, constant normaliser)

Every mode is a sum of per-token or per-sequence terms divided by a count. The counts default to
the local ones (mask.sum(), B, R), which gives the mean over this batch alone. The trainer instead
passes the GLOBAL counts of the whole mini-batch (all its micro-batches on all DP ranks): the loss of
one micro-batch is then its contribution to the global mean, so contributions simply add up and the
summed gradients equal those of the mini-batch loss whatever the micro-batching. A sequence with no
valid token contributes 0 to `seq-mean-token-mean` (its token count is clamped to 1).
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from megarl.registry import Registry

# fn(loss_BR, mask_BR, num_tokens, num_sequences, max_response_length) -> scalar
LOSS_AGGREGATIONS: Registry[Callable[[Tensor, Tensor, float, float, float], Tensor]] = Registry(
    "loss aggregation"
)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` where `mask` is 1 (over all elements, or along `dim`); 0 where nothing is valid."""
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(loss_BR: Tensor, mask_BR: Tensor, num_tokens, num_sequences, max_response_length) -> Tensor:
    return (loss_BR * mask_BR).sum() / num_tokens


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss_BR: Tensor, mask_BR: Tensor, num_tokens, num_sequences, max_response_length) -> Tensor:
    return (loss_BR * mask_BR).sum(dim=1).sum() / num_sequences


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss_BR: Tensor, mask_BR: Tensor, num_tokens, num_sequences, max_response_length) -> Tensor:
    per_sequence_B = (loss_BR * mask_BR).sum(dim=1) / mask_BR.sum(dim=1).clamp(min=1)
    return per_sequence_B.sum() / num_sequences


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_BR: Tensor, mask_BR: Tensor, num_tokens, num_sequences, max_response_length
) -> Tensor:
    return (loss_BR * mask_BR).sum() / (num_sequences * max_response_length)


def aggregate(
    loss_BR: Tensor,
    mask_BR: Tensor,
    mode: str,
    num_tokens: int | None = None,
    num_sequences: int | None = None,
    max_response_length: int | None = None,
) -> Tensor:
    """Scalar loss for `mode`; counts default to this batch's own (see the module docstring)."""
    reduce = LOSS_AGGREGATIONS.get(mode)
    for name, count in (("num_tokens", num_tokens), ("num_sequences", num_sequences),
                        ("max_response_length", max_response_length)):
        if count is not None and count <= 0:
            raise ValueError(f"{name} must be positive, got {count}")
    if num_tokens is None:
        num_tokens = mask_BR.sum().clamp(min=1)
    if num_sequences is None:
        num_sequences = loss_BR.shape[0]
    if max_response_length is None:
        max_response_length = loss_BR.shape[1]
    return reduce(loss_BR, mask_BR, num_tokens, num_sequences, max_response_length)
