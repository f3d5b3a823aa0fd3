"""A `TensorShard` is a whole HF tensor to a weight loader that narrows it to the held interval, and
nothing else: it holds only the shard's bytes and refuses to give out any it was not sent."""

from __future__ import annotations

import pytest
import torch

from megarl.resharding.tensor_shard import TensorShard


def test_narrowing_to_the_held_interval_gives_the_received_bytes_without_a_copy():
    full = torch.arange(48.0).reshape(8, 6)
    rows = full[2:6].clone()  # what engine TP rank 1 of 2 receives
    shard = TensorShard(rows, tuple(full.shape), split_dim=0, start=2)
    assert shard.shape == full.shape and shard.dtype == full.dtype
    part = shard.narrow(0, 3, 2)  # as vLLM's q/k/v loader cuts one head's rows
    assert torch.equal(part, full[3:5]) and part.data_ptr() == rows[1].data_ptr()
    columns = TensorShard(full[:, 3:].clone(), tuple(full.shape), split_dim=1, start=3)
    target = torch.empty(8, 3)
    target.copy_(columns.narrow(1, 3, 3))  # as a row-parallel loader does
    assert torch.equal(target, full[:, 3:])


def test_an_expert_tensor_stacked_and_unbound_as_vllms_moe_loader_does_keeps_its_held_interval():
    full = torch.arange(48.0).reshape(6, 8)  # one expert's down projection, split along dim 1
    shard = TensorShard(full[:, 4:].clone(), tuple(full.shape), split_dim=1, start=4)
    (expert,) = shard.unsqueeze(0).unbind()
    assert isinstance(expert, TensorShard) and expert.shape == full.shape
    assert torch.equal(expert.narrow(1, 4, 4), full[:, 4:])
    with pytest.raises(RuntimeError, match="never sent to this rank"):
        expert.narrow(1, 0, 4)


@pytest.mark.parametrize("cut", [lambda s: s.narrow(0, 1, 2), lambda s: s.narrow(1, 0, 2), lambda s: s + 1,
                                 lambda s: s.sum()])
def test_anything_but_the_held_interval_is_refused(cut):
    shard = TensorShard(torch.ones(4, 6), (8, 6), split_dim=0, start=2)
    with pytest.raises(RuntimeError, match="never sent to this rank"):
        cut(shard)
