"""Small collectives on CPU tensors and Python objects: through shared memory where the group's ranks
share a host and each has a core of its own, over torch.distributed elsewhere.

An RL step's bookkeeping (every sequence's score, the loss normalizer's token counts, the metrics)
and megatron's own small reductions (the grad norm, a TP all-reduce of a few activations) move a
few bytes each, so over gloo they cost its latency: about 1.2 ms for an all-reduce of 8 numbers over
2 processes on a 2-core machine (gloo's threads hand each message on through the kernel several
times), against 5-15 us through vLLM's shared-memory kernels (`megarl.distributed.shared_memory`).

Every rank gets the same result. A sum of fp32, bf16 or fp16 runs in the shared-memory kernel; any
other reduction (a dtype such as float64 or int64, or MAX, MIN, PRODUCT) gathers every rank's tensor
and reduces the rows in rank order. Over 2 ranks both equal gloo's to the bit (a + b is b + a). A
group of one rank returns at once; tensors off the CPU, and groups where shared memory does not pay
(`megarl.distributed.shared_memory.shared_memory_group`), go to torch.distributed.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from megarl.distributed.shared_memory import SUPPORTED_DTYPES, SharedMemoryGroup, shared_memory_group

_ROW_REDUCTIONS = {
    dist.ReduceOp.SUM: lambda rows: rows.sum(0),
    dist.ReduceOp.MAX: lambda rows: rows.amax(0),
    dist.ReduceOp.MIN: lambda rows: rows.amin(0),
    dist.ReduceOp.PRODUCT: lambda rows: rows.prod(0),
}


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> None:
    """`tensor` reduced over `group` (None: the default group), in place."""
    if dist.get_world_size(group) == 1:
        return
    host = _host_group(tensor, group)
    if host is None:
        dist.all_reduce(tensor, op=op, group=group)
    elif op == dist.ReduceOp.SUM and tensor.dtype in SUPPORTED_DTYPES and tensor.is_contiguous():
        host.all_reduce(tensor)
    else:
        tensor.copy_(_ROW_REDUCTIONS[op](host.gather_rows(tensor)))


def all_gather(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's `tensor` (one shape and dtype on every rank), in rank order."""
    if dist.get_world_size(group) == 1:
        return [tensor.clone()]
    host = _host_group(tensor, group)
    if host is not None:
        return list(host.gather_rows(tensor).unbind(0))
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


def all_to_all(output: torch.Tensor, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group=None) -> None:
    """`dist.all_to_all_single` of 1-D tensors: `tensor` in parts of `input_splits`, one per rank in
    rank order, each to its rank; `output` gets every rank's part for this one, in parts of
    `output_splits`. Through shared memory, every rank gathers every rank's `tensor` (padded to the
    longest) and keeps its parts: the group's whole payload crosses each rank, which is what small
    payloads on one host afford."""
    if dist.get_world_size(group) == 1:
        output.copy_(tensor)
        return
    host = _host_group(tensor, group)
    if host is None:
        dist.all_to_all_single(output, tensor, output_splits, input_splits, group=group)
        return
    splits = host.gather_rows(torch.tensor(input_splits))
    me = dist.get_rank(group)
    if splits[:, me].tolist() != list(output_splits):
        raise ValueError(f"all_to_all: rank {me} expects parts of {list(output_splits)}, the ranks send "
                         f"{splits[:, me].tolist()}")
    padded = tensor.new_zeros(int(splits.sum(1).max()))
    padded[: tensor.numel()] = tensor
    rows = host.gather_rows(padded)
    starts = (splits.cumsum(1) - splits)[:, me].tolist()
    output.copy_(torch.cat([row[start : start + size] for row, start, size in zip(rows, starts, output_splits)]))


def all_gather_object(obj: object, group=None) -> list:
    """Every rank's `obj` (picklable), in rank order."""
    if dist.get_world_size(group) == 1:
        return [obj]
    host = shared_memory_group(group)
    if host is None:
        objects = [None] * dist.get_world_size(group)
        dist.all_gather_object(objects, obj, group=group)
        return objects
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = host.gather_rows(torch.tensor(data.numel())).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: data.numel()] = data
    rows = host.gather_rows(padded)
    return [pickle.loads(row[:size].numpy().tobytes()) for row, size in zip(rows, sizes)]


def _host_group(tensor: torch.Tensor, group) -> SharedMemoryGroup | None:
    return shared_memory_group(group) if tensor.device.type == "cpu" else None
