"""Rule scorers by hand: correct, wrong and malformed responses for every registered data_source."""

from __future__ import annotations

import json

import pytest

from megarl.rewards import RULE_SCORERS, compute_score


def test_registry_holds_every_source():
    assert set(RULE_SCORERS.names()) == {
        "openai/gsm8k", "math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "arithmetic", "countdown"}


def test_unknown_source_lists_registered():
    with pytest.raises(ValueError, match=r"unknown .*'nope'.*registered: .*arithmetic.*countdown"):
        compute_score("nope", "1", "1")


@pytest.mark.parametrize("response, ground_truth, expected", [
    ("so 5 + 13 = 18\n#### 18", "18", 1.0),
    ("#### 1,234", "1234", 1.0),             # thousands separators are dropped
    ("#### 18.0", "18", 1.0),                # compared numerically
    ("#### 12\nlater #### 18", "18", 1.0),   # the last marker counts
    ("#### -3", "-3", 1.0),
    ("#### 17", "18", 0.0),
    ("the answer is 18", "18", 0.0),         # strict: no "#### N", no credit
    ("####18", "18", 0.0),                   # strict needs the space, as in verl
    ("#### 1.2.3", "18", 0.0),               # malformed number
    ("", "18", 0.0),
])
def test_gsm8k_strict(response, ground_truth, expected):
    assert compute_score("openai/gsm8k", response, ground_truth) == expected


def test_gsm8k_flexible_falls_back_to_last_number():
    flexible = {"gsm8k_method": "flexible"}
    assert compute_score("openai/gsm8k", "first 3, then 18.", "18", flexible) == 1.0
    assert compute_score("openai/gsm8k", "#### 18 and then 5", "18", flexible) == 1.0
    assert compute_score("openai/gsm8k", "no numbers", "18", flexible) == 0.0


def test_gsm8k_only_looks_at_the_tail():
    assert compute_score("openai/gsm8k", "#### 18" + " pad" * 200, "18") == 0.0


@pytest.mark.parametrize("source", ["math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval"])
@pytest.mark.parametrize("response, ground_truth, expected", [
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
    ("So we get $0.5$", "\\frac{1}{2}", 1.0),
    ("$\\boxed{2\\sqrt{2}}$", "\\sqrt{8}", 1.0),
    ("$\\boxed{\\frac{1}{3}}$", "\\frac{1}{2}", 0.0),
    ("I have no idea", "\\frac{1}{2}", 0.0),
    ("$\\boxed{\\frac{1}{", "\\frac{1}{2}", 0.0),   # malformed LaTeX
])
def test_math_verify(source, response, ground_truth, expected):
    assert compute_score(source, response, ground_truth) == expected


def test_math_ground_truth_that_cannot_be_parsed_is_a_data_error():
    with pytest.raises(ValueError, match=r"math ground_truth ' ' cannot be parsed"):
        compute_score("math", "$\\boxed{1}$", " ")


@pytest.mark.parametrize("response, expected", [
    ("579", 1.0), (" 579 because 123+456", 1.0), ("578", 0.0), ("5 7 9", 0.0), ("no digits", 0.0), ("", 0.0)])
def test_arithmetic(response, expected):
    assert compute_score("arithmetic", response, "579") == expected


COUNTDOWN = json.dumps({"target": 24, "numbers": [4, 6, 2, 9]})


@pytest.mark.parametrize("response, expected", [
    ("<think>4*6=24</think><answer>4 * 6</answer>", 1.0),          # a subset of the numbers is enough
    ("<answer>(9 - 6) * 4 * 2</answer>", 1.0),
    ("<answer>6 / (2 / 8)</answer>", 0.0),                          # 8 is not a given number
    ("<answer>(9 + 6 - 2) * 2 - 2</answer>", 0.0),                  # 2 used twice
    ("<answer>4 * 6 + 2</answer>", 0.0),                            # valid, wrong value
    ("<answer>9 * 2 + 6 / 1</answer>", 0.0),                        # 1 is not given
    ("<answer>4 * 6 / (9 - 9)</answer>", 0.0),                      # reuse and division by zero
    ("<answer>__import__('os').system('true')</answer>", 0.0),      # forbidden syntax
    ("<answer>4 ** 2 + 6 + 2</answer>", 0.0),                       # ** is not allowed
    ("<answer>24</answer>", 0.0),                                   # not a given number
    ("<answer>4 * 6.0</answer>", 0.0),                              # only integer literals
    ("<answer>4 * 6 +</answer>", 0.0),                              # syntax error
    ("<answer>1</answer> then <answer>6 * 4</answer>", 1.0),        # the last answer counts
    ("thinking...\n(9 - 6) * 4 * 2", 1.0),                           # no tags: the last line
    ("", 0.0),
])
def test_countdown(response, expected):
    assert compute_score("countdown", response, COUNTDOWN) == expected


def test_countdown_division_is_exact():
    ground_truth = json.dumps({"target": 7, "numbers": [3, 2, 4]})
    assert compute_score("countdown", "<answer>(3 + 4) * 2 / 2</answer>", ground_truth) == 0.0  # 2 twice
    assert compute_score("countdown", "<answer>(4 / 3) * 3 + 3</answer>", ground_truth) == 0.0
    ground_truth = json.dumps({"target": 2, "numbers": [3, 2, 3]})
    assert compute_score("countdown", "<answer>(3 / 3) * 2</answer>", ground_truth) == 1.0  # 3 given twice


def test_bad_ground_truth_raises():
    with pytest.raises(ValueError, match="countdown ground_truth"):
        compute_score("countdown", "<answer>1</answer>", "not json")
    with pytest.raises(ValueError, match="gsm8k ground_truth"):
        compute_score("openai/gsm8k", "#### 1", "one")
