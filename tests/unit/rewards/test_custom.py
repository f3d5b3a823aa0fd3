"""Loading user scoring functions by file path or module name, and using them unchanged."""

from __future__ import annotations

import textwrap

import pytest

from megarl.rewards import RewardManager, ScoringItem, load_function

USER_FILE = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        correct = solution_str.strip() == ground_truth
        if data_source == "with_metrics":
            return {"score": float(correct), "length": len(solution_str), "note": "ignored"}
        return 1.0 if correct else 0.0

    def helper():
        pass

    THRESHOLD = 3
''')


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return str(path)


def test_loads_from_file_and_scores(user_file):
    compute_score = load_function(user_file, "compute_score")
    assert compute_score("x", "42", "42") == 1.0
    assert compute_score("x", "41", "42") == 0.0
    result = RewardManager(compute_score).score([
        ScoringItem("with_metrics", "42", "42", None),
        ScoringItem("plain", "41", "42", {}),
        ScoringItem("with_metrics", "7", "42", {"k": 1}),
    ])
    assert result.scores == [1.0, 0.0, 0.0]
    assert list(result.extra) == ["length"]  # "note" is not numeric
    assert result.extra["length"][0] == 2.0 and result.extra["length"][2] == 1.0
    assert result.extra["length"][1] != result.extra["length"][1]  # nan where the item had none
    assert result.num_errors == 0 and result.first_error is None


def test_loads_from_module_name():
    assert load_function("megarl.rewards.scorers", "compute_score")("arithmetic", "3", "3") == 1.0


def test_missing_function_lists_callables(user_file):
    with pytest.raises(ValueError) as error:
        load_function(user_file, "score_fn")
    message = str(error.value)
    assert "'score_fn'" in message and user_file in message and "compute_score, helper" in message
    assert "THRESHOLD" not in message and "\n" not in message


def test_not_callable(user_file):
    with pytest.raises(ValueError, match="'THRESHOLD'.*not callable"):
        load_function(user_file, "THRESHOLD")


def test_missing_file_and_module(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_function(str(tmp_path / "nope.py"), "compute_score")
    with pytest.raises(ValueError, match="'no_such_pkg.rewards'.*ModuleNotFoundError"):
        load_function("no_such_pkg.rewards", "compute_score")


def test_import_error_is_one_line(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import math\nraise RuntimeError('bad\\nconfig')\n")
    with pytest.raises(ValueError) as error:
        load_function(str(path), "compute_score")
    assert str(path) in str(error.value) and "RuntimeError: bad config" in str(error.value)
    assert "\n" not in str(error.value)
