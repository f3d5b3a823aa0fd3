"""The generative judge's pure parts (megarl.rewards.judge): the rubric's rendering, the verdict parser, and
JudgeRewards' batching, counting and mixing with a rule reward, over a stand-in for the judge's engine."""

from __future__ import annotations

import math
import threading

import pytest

from megarl.rewards import RewardManager, ScoringItem, compute_score
from megarl.rewards.judge import JudgeRewards, JudgeRubric, Verdict, check_template, parse_verdict, render_judge_prompt

CHOICES = {"correct": 1.0, "incorrect": 0.0, "partly": 0.5}


def test_template_fills_each_placeholder_and_keeps_doubled_braces():
    text = render_judge_prompt("{{rubric}} Q: {prompt} A: {response} ({ground_truth}, {response})", "1+1=", "2", "2")
    assert text == "{rubric} Q: 1+1= A: 2 (2, 2)"


@pytest.mark.parametrize("template, fragment", [("{answer}", "names {answer}"), ("a {", "not a format string"),
                                                ("{}", "not a format string"), ("{0}", "not a format string")])
def test_bad_templates_are_refused(template, fragment):
    with pytest.raises(ValueError, match=fragment.replace("{", r"\{").replace("}", r"\}")):
        check_template(template)


@pytest.mark.parametrize("text, expected", [
    ("correct", 1.0),
    ("Incorrect.", 0.0),  # "correct" lies inside "incorrect": whole words only
    ("The answer is CORRECT!", 1.0),
    ("partly, not incorrect", 0.5),  # the first verdict in the text counts
    ("incorrectly", None),
    ("notcorrect", None),
    ("corrected", None),
    ("", None),
    ("no verdict here", None),
])
def test_choice_verdicts(text, expected):
    assert parse_verdict(text, CHOICES, max_score=10) == expected


@pytest.mark.parametrize("text, expected", [
    ("Score: 7/10", 0.7),
    ("7.5", 0.75),
    ("10", 1.0),
    ("0 points", 0.0),
    ("11", None),  # off the scale: no verdict
    ("-1", None),
    ("seven", None),
])
def test_number_verdicts(text, expected):
    assert parse_verdict(text, {}, max_score=10) == (None if expected is None else pytest.approx(expected))


class FakeJudge:
    """Stands in for the judge's engine: a fixed verdict per response text; records the prompts it is shown."""

    def __init__(self, verdicts: dict[str, Verdict]):
        self.verdicts, self.prompts = verdicts, []

    def __call__(self, prompts: list[str]) -> list[Verdict]:
        self.prompts.append(prompts)
        return [self.verdicts[prompt.split("A:")[1].strip()] for prompt in prompts]


RUBRIC = JudgeRubric("Q: {prompt} key {ground_truth} A: {response}", CHOICES)
VERDICTS = {"5": Verdict("correct"), "6": Verdict("incorrect"), "x": Verdict("hmm"),
            "y": Verdict("correctly and at length", truncated=True), "z": Verdict("", error="too long")}


def items(*responses):
    return [ScoringItem("arithmetic", response, "5", None, origin=f"t.parquet: row {i}", prompt="2+3=")
            for i, response in enumerate(responses)]


def test_one_batched_call_scores_parses_and_counts():
    judge = FakeJudge(VERDICTS)
    result = JudgeRewards(judge, RUBRIC).score(items("5", "6", "x", "y", "z", "5"))
    assert judge.prompts == [[f"Q: 2+3= key 5 A: {r}" for r in ("5", "6", "x", "y", "z", "5")]]
    assert result.scores == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    nan = math.nan
    assert result.extra["judge_score"] == pytest.approx([1.0, 0.0, nan, nan, nan, 1.0], nan_ok=True)
    assert result.extra["judge_unparsable"] == [0, 0, 1, 0, 0, 0]  # stopped, no verdict
    assert result.extra["judge_timeouts"] == [0, 0, 0, 1, 0, 0]  # ran out of tokens, no verdict
    assert result.extra["judge_errors"] == [0, 0, 0, 0, 1, 0]  # not asked
    assert (result.num_errors, result.num_timeouts) == (1, 0)  # the prompt too long: an error, named
    assert result.first_error == "t.parquet: row 4 (data_source 'arithmetic'): judge: too long"


def test_no_rule_call_without_a_rule_weight():
    def rule(*args):
        raise AssertionError("called")

    result = JudgeRewards(FakeJudge(VERDICTS), RUBRIC, RewardManager(rule)).score(items("5", "6"))
    assert result.scores == [1.0, 0.0] and result.num_errors == 0 and "rule_score" not in result.extra


def test_mixing_with_the_rule_reward():
    # The rule scorer for "arithmetic": 1 when the first integer is the ground truth. "x 5" and "y 5" are right by
    # the rule, the judge says nothing (unparsable) or runs out of tokens; "6" is wrong by both.
    judge = FakeJudge({"5": Verdict("correct"), "6": Verdict("partly"), "x 5": Verdict("?"),
                       "y 5": Verdict("...", truncated=True)})
    rubric = JudgeRubric(RUBRIC.template, CHOICES, rule_weight=0.25)
    result = JudgeRewards(judge, rubric, RewardManager(compute_score)).score(items("5", "6", "x 5", "y 5"))
    assert result.scores == pytest.approx([0.75 * 1 + 0.25 * 1, 0.75 * 0.5 + 0.25 * 0, 0.25, 0.25])
    assert result.extra["rule_score"] == [1.0, 0.0, 1.0, 1.0]
    assert result.extra["judge_unparsable"] == [0, 0, 1, 0] and result.extra["judge_timeouts"] == [0, 0, 0, 1]


def test_items_neither_source_scores_count_once_each():
    # The judge is asked about none (every prompt too long); the rule raises on three and times out on one.
    release = threading.Event()

    def rule(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "slow":
            release.wait(30.0)
        raise ValueError("no rule")

    judge = FakeJudge({r: Verdict("", error="too long") for r in ("a", "b", "slow", "c")})
    rubric = JudgeRubric(RUBRIC.template, CHOICES, rule_weight=0.5)
    result = JudgeRewards(judge, rubric, RewardManager(rule, timeout_seconds=0.2)).score(items("a", "b", "slow", "c"))
    release.set()
    assert result.scores == [0.0] * 4 and result.extra["rule_failures"] == [1.0] * 4
    # Each item once (not 4 judge errors + 3 rule errors + 1 timeout): errors + timeouts == items is how
    # Rollouts.require_rewards and the placements see that no item got a reward.
    assert (result.num_errors, result.num_timeouts) == (4, 0)


def test_items_one_source_scores_keep_its_share_and_are_no_failure():
    # The judge is not asked about "a 5" and "b 6"; the rule raises on "7" and "8", which the judge scores.
    def rule(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str in ("7", "8"):
            raise ValueError("no rule")
        return compute_score(data_source, solution_str, ground_truth)

    judge = FakeJudge({"a 5": Verdict("", error="too long"), "b 6": Verdict("", error="too long"),
                       "7": Verdict("correct"), "8": Verdict("partly")})
    rubric = JudgeRubric(RUBRIC.template, CHOICES, rule_weight=0.25)
    result = JudgeRewards(judge, rubric, RewardManager(rule)).score(items("a 5", "b 6", "7", "8"))
    assert result.scores == pytest.approx([0.25 * 1, 0.25 * 0, 0.75 * 1, 0.75 * 0.5])
    assert result.extra["judge_errors"] == [1, 1, 0, 0] and result.extra["rule_failures"] == [0, 0, 1, 1]
    assert (result.num_errors, result.num_timeouts) == (0, 0)  # not 2 + 2, which would stop the run
    assert result.first_error == "t.parquet: row 0 (data_source 'arithmetic'): judge: too long"  # logged, not fatal


def test_a_rule_weight_needs_a_rule():
    with pytest.raises(ValueError, match="rule reward"):
        JudgeRewards(FakeJudge({}), JudgeRubric("{response}", CHOICES, rule_weight=0.5))
