"""ResumableSampler: seeded epochs, exact resumption from a state dict."""

from __future__ import annotations

import pytest

from megarl.data import ResumableSampler


def test_resume_yields_the_same_batches():
    sampler = ResumableSampler(num_items=23, batch_size=4, seed=3)
    for _ in range(7):  # 5 batches per epoch: this crosses into the second epoch
        sampler.next_batch()
    state = sampler.state_dict()
    expected = [sampler.next_batch() for _ in range(5)]
    restored = ResumableSampler(num_items=23, batch_size=4, seed=3)
    restored.load_state_dict(state)
    assert [restored.next_batch() for _ in range(5)] == expected


@pytest.mark.parametrize("drop_last", [True, False])
def test_every_index_once_per_epoch(drop_last):
    sampler = ResumableSampler(num_items=10, batch_size=3, seed=0, drop_last=drop_last)
    assert sampler.batches_per_epoch == (3 if drop_last else 4)
    orders = []
    for _ in range(3):
        epoch = [i for _ in range(sampler.batches_per_epoch) for i in sampler.next_batch()]
        orders.append(epoch)
        if drop_last:
            assert len(epoch) == 9 and len(set(epoch)) == 9
        else:
            assert sorted(epoch) == list(range(10))
    assert sampler.epoch == 2
    assert orders[0] != orders[1]  # reshuffled each epoch


def test_seeded_and_unshuffled():
    first = ResumableSampler(8, 4, seed=5).next_batch()
    assert first == ResumableSampler(8, 4, seed=5).next_batch()
    assert first != ResumableSampler(8, 4, seed=6).next_batch()
    plain = ResumableSampler(8, 4, seed=5, shuffle=False)
    assert [plain.next_batch() for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


def test_rejects_bad_arguments_and_states():
    with pytest.raises(ValueError, match="batch_size 5 exceeds the 4 items"):
        ResumableSampler(4, 5, seed=0)
    sampler = ResumableSampler(10, 2, seed=0)
    with pytest.raises(ValueError, match="num_items=12"):
        sampler.load_state_dict(ResumableSampler(12, 2, seed=0).state_dict())

