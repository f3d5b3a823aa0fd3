"""bench/async_vs_sync.py's arithmetic: tokens/s over the timed steps, training seconds to the
accuracy threshold, and the table's ratios against colocated synchronous, on hand-made runs."""

import pytest

from bench.async_vs_sync import Result, table


def run(name: str, colocated: bool, step_seconds: list[float], accuracy: list[tuple[int, float]]) -> Result:
    waits = [] if colocated else [0.1] * len(step_seconds)
    return Result(name, 2, None, colocated, step_seconds, [100.0] * len(step_seconds), waits, waits,
                  [0.2] * len(step_seconds), accuracy, wall_seconds=30.0)


COLOCATED = run("colocated 2, sync", True, [1.0, 0.5, 0.5, 0.5], [(0, 0.4), (2, 0.45), (4, 0.6)])
FASTER = run("split 1+1, staleness 1", False, [2.0, 0.25, 0.25, 0.25], [(0, 0.4), (2, 0.55), (4, 0.5)])
NEVER = run("split 1+1, staleness 2", False, [1.0, 1.0, 1.0, 1.0], [(0, 0.7), (2, 0.3), (4, 0.45)])


def test_tokens_per_second_leaves_out_the_warmup_steps():
    assert COLOCATED.tokens_per_second(warmup=1) == pytest.approx(300 / 1.5)
    assert FASTER.tokens_per_second(warmup=1) == pytest.approx(300 / 0.75)


def test_seconds_to_threshold_counts_steps_up_to_the_first_evaluation_reaching_it():
    assert COLOCATED.seconds_to(0.5) == (4, pytest.approx(2.5))
    assert FASTER.seconds_to(0.5) == (2, pytest.approx(2.25))
    assert NEVER.seconds_to(0.5) is None  # step 0's 70% is before training: not counted


def test_table_ratios_against_colocated_synchronous():
    header, colocated, faster, never = table([COLOCATED, FASTER, NEVER], threshold=0.5, warmup=1)
    assert "train s to 50%" in header
    # tokens/s ratio, mean wait, idle and generation after the warm-up, seconds to 50%, x sooner, final, process s
    assert faster.split()[-12:] == ["4", "400", "2.00", "0.100", "0.100", "0.200", "2", "(step", "2)", "1.11",
                                    "50.0%", "30"]
    assert colocated.split()[-11:] == ["200", "1.00", "-", "-", "0.200", "2", "(step", "4)", "1.00", "60.0%", "30"]
    assert never.split()[-10:] == ["100", "0.50", "0.100", "0.100", "0.200", "not", "reached", "-", "45.0%", "30"]


def test_seed_summary_means_seconds_to_threshold_and_ranges_final_accuracy():
    from dataclasses import replace

    from bench.async_vs_sync import seed_summary

    runs = [replace(COLOCATED, seed=0), replace(COLOCATED, seed=1, step_seconds=[1.0, 1.5, 0.5, 0.5]),
            replace(FASTER, seed=0), replace(FASTER, seed=1, accuracy=[(0, 0.4), (2, 0.45), (4, 0.6)])]
    header, colocated, faster = seed_summary(runs, threshold=0.5)
    # colocated: 2.5 s and 3.5 s to 50% (step 4); split: 2.25 s (step 2) and 2.75 s (step 4)
    assert colocated.split()[-5:] == ["2", "3", "1.00", "60.0", "60.0-60.0"]
    assert faster.split()[-5:] == ["2", "2", "1.20", "55.0", "50.0-60.0"]
    never = seed_summary([replace(COLOCATED, seed=0), replace(NEVER, seed=0)], threshold=0.5)[2]
    assert never.split()[-6:] == ["1", "not", "all", "-", "45.0", "45.0-45.0"]
