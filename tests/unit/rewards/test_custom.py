"""A user scoring function is used unchanged; none named gives the rule scorers."""

from __future__ import annotations

import textwrap

import pytest

from megarl.rewards import RewardManager, ScoringItem, compute_score, load_scoring_function

USER_FILE = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        correct = solution_str.strip() == ground_truth
        if data_source == "with_metrics":
            return {"score": float(correct), "length": len(solution_str), "note": "ignored"}
        return 1.0 if correct else 0.0
''')


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return str(path)


def test_loads_from_file_and_scores(user_file):
    user_function = load_scoring_function(f"{user_file}:compute_score")
    assert user_function("x", "42", "42") == 1.0
    assert user_function("x", "41", "42") == 0.0
    result = RewardManager(user_function).score([
        ScoringItem("with_metrics", "42", "42", None),
        ScoringItem("plain", "41", "42", {}),
        ScoringItem("with_metrics", "7", "42", {"k": 1}),
    ])
    assert result.scores == [1.0, 0.0, 0.0]
    assert list(result.extra) == ["length"]  # "note" is not numeric
    assert result.extra["length"][0] == 2.0 and result.extra["length"][2] == 1.0
    assert result.extra["length"][1] != result.extra["length"][1]  # nan where the item had none
    assert result.num_errors == 0 and result.first_error is None


def test_no_function_named_gives_the_rule_scorers():
    assert load_scoring_function("") is compute_score
