"""derive_seed: one seed per (seed, purpose, step, replica, draw), never shared between two streams."""

from __future__ import annotations

import itertools

from megarl.seeding import SEED_BITS, derive_seed

PURPOSES = ("prompt_order", "rollout", "validation", "mini_batch_order")


def test_seeds_are_deterministic_and_fit_a_64_bit_generator_with_request_offsets():
    seed = derive_seed(1, "rollout", step=3, draw=1)
    assert seed == derive_seed(1, "rollout", step=3, draw=1)
    assert isinstance(seed, int) and 0 <= seed < 2**SEED_BITS
    assert seed + 10**9 < 2**63  # request i of a call samples with seed + i (a signed 64-bit seed)


def test_no_two_streams_share_a_seed():
    # The grid holds the collisions of the formulas this replaced: step * 31 + round (step 1 round 31 vs.
    # step 2 round 0), seed * 1000 + epoch and seed + epoch (seed 1 epoch 0 vs. seed 0 epoch 1).
    grid = list(itertools.product(range(4), PURPOSES, range(64), range(4), range(40)))
    seeds = {derive_seed(seed, purpose, step=step, replica=replica, draw=draw)
             for seed, purpose, step, replica, draw in grid}
    assert len(seeds) == len(grid)


def test_every_coordinate_changes_the_seed():
    base = derive_seed(7, "rollout", step=5, replica=1, draw=2)
    assert len({base, derive_seed(8, "rollout", step=5, replica=1, draw=2),
                derive_seed(7, "validation", step=5, replica=1, draw=2),
                derive_seed(7, "rollout", step=6, replica=1, draw=2),
                derive_seed(7, "rollout", step=5, replica=2, draw=2),
                derive_seed(7, "rollout", step=5, replica=1, draw=3)}) == 6
