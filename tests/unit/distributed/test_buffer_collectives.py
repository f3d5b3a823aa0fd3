"""Over a one-rank group, the distributed optimizer's in-place buffer collectives are skipped, and
skipping them changes nothing that gloo's own collective would have changed (over two ranks:
tests/distributed/scripts/cpu_compat_scenarios.py, `faster_collectives`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megarl.distributed.cpu_compat import _all_gather_in_place, _reduce_scatter_in_place


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("collective", "faster"), [(dist.reduce_scatter_tensor, _reduce_scatter_in_place),
                                                   (dist.all_gather_into_tensor, _all_gather_in_place)],
                         ids=["reduce_scatter", "all_gather"])
def test_in_place_collective_over_one_rank_is_skipped_and_is_the_identity(one_rank_world, collective, faster):
    calls = []

    def counted(output, input, *args, **kwargs):
        calls.append(output.numel())
        return collective(output, input, *args, **kwargs)

    skipping = faster(counted)
    buffer = torch.randn(1000)
    by_gloo = buffer.clone()
    collective(by_gloo, by_gloo)
    skipping(buffer, buffer, group=None)
    assert calls == []
    assert torch.equal(buffer, by_gloo)

    elsewhere = torch.zeros(1000)  # not in place: the collective runs
    skipping(elsewhere, buffer, group=None)
    assert calls == [1000] and torch.equal(elsewhere, buffer)
