"""Start-up's objects are frozen out of the garbage collector's sight before the first step."""

from __future__ import annotations

import gc

from megarl.distributed.process import freeze_start_up_objects


def test_objects_made_before_the_freeze_are_no_longer_walked_by_a_collection():
    made_at_start_up = [[index] for index in range(10_000)]  # containers: tracked by the collector
    try:
        freeze_start_up_objects()
        walked = {id(obj) for obj in gc.get_objects()}
        assert gc.get_freeze_count() >= len(made_at_start_up)
        assert not any(id(obj) in walked for obj in made_at_start_up)
        made_after = [0]
        assert id(made_after) in {id(obj) for obj in gc.get_objects()}
    finally:
        gc.unfreeze()
