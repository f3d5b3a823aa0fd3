"""RewardManager: failures and timeouts score 0 and are counted; token_level_scores placement."""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from megarl.rewards import RewardManager, ScoringItem, compute_score, token_level_scores


def items(*solutions, data_source="arithmetic", ground_truth="5"):
    return [ScoringItem(data_source, solution, ground_truth, None) for solution in solutions]


def test_rule_scorers_through_manager():
    result = RewardManager(compute_score).score(items("5", "6", "x 5"))
    assert result.scores == [1.0, 0.0, 1.0]
    assert (result.num_errors, result.num_timeouts, result.first_error, result.extra) == (0, 0, None, {})


def test_math_verify_runs_in_the_worker_thread():
    # math-verify's own signal-based timeouts would fail outside the main thread: they must be off.
    result = RewardManager(compute_score).score(items("$\\boxed{\\frac{1}{2}}$", "$3$", data_source="math",
                                                      ground_truth="0.5"))
    assert result.scores == [1.0, 0.0] and result.num_errors == 0


def test_raising_scorer_scores_zero_is_counted_and_logged_once_with_its_row(caplog):
    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise KeyError("missing\nthing")
        return 1.0

    manager = RewardManager(scorer)
    batch = [replace(item, origin=f"train.parquet: row {row}")
             for row, item in enumerate(items("a", "boom", "b", "boom"))]
    result = manager.score(batch)
    assert result.scores == [1.0, 0.0, 1.0, 0.0]
    assert (result.num_errors, result.num_timeouts) == (2, 0)
    assert result.first_error.startswith("train.parquet: row 1 (data_source 'arithmetic'): KeyError")
    assert "\n" not in result.first_error
    assert manager.score(batch).num_errors == 2  # the next step's failures: counted, not logged again
    logged = [record.getMessage() for record in caplog.records if record.name == "megarl.rewards.manager"]
    assert len(logged) == 1 and "train.parquet: row 1" in logged[0], logged


def test_slow_scorer_times_out_and_the_run_goes_on():
    # Behaviour, not wall-clock bounds (a loaded machine stretches those): the hung call scores 0 and
    # is counted, the results stay in item order, and the calls after it run on a fresh thread while
    # the hung one is still stuck. Were the hung call awaited, it would return 1.0 after 30 s.
    release, served_by = threading.Event(), {}

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        served_by[solution_str] = threading.current_thread()
        if solution_str == "slow":
            release.wait(30.0)  # stands for a scorer stuck in a pathological case
        return {"score": 1.0, "length": len(solution_str)}

    manager = RewardManager(scorer, timeout_seconds=1.0)
    result = manager.score(items("fast", "slow", "after"))
    stuck = served_by["slow"]
    assert stuck.is_alive()  # still inside the hung call: the manager did not wait for it
    assert result.scores == [1.0, 0.0, 1.0] and result.extra["length"][::2] == [4.0, 5.0]
    assert (result.num_errors, result.num_timeouts) == (0, 1)
    assert "item 1" in result.first_error and "timed out" in result.first_error
    assert served_by["fast"] is stuck and served_by["after"] is not stuck  # the hung thread was replaced
    assert manager.score(items("again")).scores == [1.0] and served_by["again"] is served_by["after"]
    release.set()  # let the abandoned call finish: its thread then ends, running none of the calls behind it
    stuck.join(10.0)
    assert not stuck.is_alive() and served_by["after"] is not stuck


def test_dict_returns_give_aligned_extras():
    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "plain":
            return 0.5
        return {"score": 1, "acc": True, "length": len(solution_str), "pred": solution_str}

    result = RewardManager(scorer).score(items("ab", "plain", "abcd"))
    assert result.scores == [1.0, 0.5, 1.0]
    assert sorted(result.extra) == ["acc", "length"]
    assert result.extra["length"][0] == 2.0 and result.extra["length"][2] == 4.0
    assert math.isnan(result.extra["length"][1]) and math.isnan(result.extra["acc"][1])


@pytest.mark.parametrize("returned, expected", [
    (np.float32(0.25), 0.25), (np.float16(-2.5), -2.5), (np.int64(3), 3.0), (np.uint8(7), 7.0),
    (np.bool_(True), 1.0), (np.bool_(False), 0.0), (True, 1.0),  # bools count, numpy's as Python's
])
def test_numpy_scalars_are_numbers(returned, expected):
    # verl-style scorers return numpy scalars, as the score and as extras.
    def scorer(*args):
        return {"score": returned, "acc": np.bool_(True), "length": np.int64(4), "ratio": np.float32(0.5)}

    plain, in_dict = RewardManager(lambda *args: returned).score(items("x")), RewardManager(scorer).score(items("x"))
    assert (plain.scores, plain.num_errors, in_dict.scores, in_dict.num_errors) == ([expected], 0, [expected], 0)
    assert in_dict.extra == {"acc": [1.0], "length": [4.0], "ratio": [0.5]}


@pytest.mark.parametrize("returned, message", [
    ({"acc": 1.0}, "needs a 'score' key"),
    ("1.0", "finite number"),
    (np.str_("1.0"), "finite number"),
    (float("nan"), "finite number"),
    (np.float32("inf"), "finite number"),
    (None, "finite number"),
])
def test_invalid_returns_are_errors(returned, message):
    result = RewardManager(lambda *args: returned).score(items("x"))
    assert result.scores == [0.0] and result.num_errors == 1 and message in result.first_error


def test_token_level_scores():
    rewards_BR = token_level_scores([1.0, -0.5, 2.0], [3, 1, 4])
    expected = torch.zeros(3, 4)
    expected[0, 2], expected[1, 0], expected[2, 3] = 1.0, -0.5, 2.0
    assert rewards_BR.dtype == torch.float32
    torch.testing.assert_close(rewards_BR, expected, rtol=0, atol=0)
    assert token_level_scores([1.0], [2], max_response_length=5).shape == (1, 5)


def test_token_level_scores_rejects_bad_lengths():
    with pytest.raises(ValueError, match="response 1 has length 0"):
        token_level_scores([1.0, 1.0], [2, 0])
    with pytest.raises(ValueError, match="2 scores for 1 responses"):
        token_level_scores([1.0, 1.0], [2])
    with pytest.raises(ValueError, match="length 6; expected 1..5"):
        token_level_scores([1.0], [6], max_response_length=5)
