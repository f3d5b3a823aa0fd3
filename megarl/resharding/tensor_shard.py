"""An HF tensor of which this rank holds only its engine shard: what an engine rank is handed.

vLLM's weight loaders take a whole HF tensor and cut their TP rank's rows or columns out of it with
`narrow` (column/row parallel layers, each of q/k/v and gate/up of the merged ones, vocabulary
rows), then copy the cut into the parameter. A `TensorShard` has the whole tensor's shape but only
the bytes of one interval along the split dim: `narrow` within that interval returns the received
bytes themselves, so the loader copies this rank's shard into vLLM's parameter and no full-size
tensor is ever allocated. vLLM's MoE loader first gives a per-expert tensor a leading expert
dimension and unbinds it again (`unsqueeze(0)`, `unbind(0)`): both keep the held interval and
return shards. Any other use fails loudly instead of reading bytes that were never sent.
"""

from __future__ import annotations

import torch


class TensorShard(torch.Tensor):
    shard: torch.Tensor
    split_dim: int
    start: int

    @staticmethod
    def __new__(cls, shard: torch.Tensor, full_shape: tuple[int, ...], split_dim: int, start: int):
        return torch.Tensor._make_wrapper_subclass(cls, full_shape, dtype=shard.dtype, device=shard.device)

    def __init__(self, shard: torch.Tensor, full_shape: tuple[int, ...], split_dim: int, start: int):
        self.shard, self.split_dim, self.start = shard, split_dim, start

    def __repr__(self) -> str:
        stop = self.start + self.shard.shape[self.split_dim]
        return f"TensorShard({tuple(self.shape)}, holding [{self.start}, {stop}) along dim {self.split_dim})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # `narrow` reaches the dispatcher as `slice(dim, start, end)`.
        if func is torch.ops.aten.slice.Tensor:
            tensor, dim, start, end, *step = list(args) + [None] * (5 - len(args))
            dim, start = dim % tensor.dim(), start or 0
            end = tensor.shape[dim] if end is None else min(end, tensor.shape[dim])
            stop = tensor.start + tensor.shard.shape[tensor.split_dim]
            if dim == tensor.split_dim and step[0] in (None, 1) and tensor.start <= start <= end <= stop:
                return tensor.shard.narrow(dim, start - tensor.start, end - start)
        if func is torch.ops.aten.unsqueeze.default:
            tensor, dim = args
            dim %= tensor.dim() + 1
            split_dim = tensor.split_dim + (dim <= tensor.split_dim)
            shape = (*tensor.shape[:dim], 1, *tensor.shape[dim:])
            return TensorShard(tensor.shard.unsqueeze(dim), shape, split_dim, tensor.start)
        if func is torch.ops.aten.unbind.int:
            tensor, dim = args[0], (args[1] if len(args) > 1 else 0) % args[0].dim()
            if dim != tensor.split_dim:
                split_dim = tensor.split_dim - (dim < tensor.split_dim)
                shape = (*tensor.shape[:dim], *tensor.shape[dim + 1:])
                return tuple(TensorShard(part, shape, split_dim, tensor.start) for part in tensor.shard.unbind(dim))
        raise RuntimeError(f"{func} on {args[0]!r} with arguments {args[1:]}: only narrowing to the held "
                           "interval is possible, the rest of the tensor was never sent to this rank")
