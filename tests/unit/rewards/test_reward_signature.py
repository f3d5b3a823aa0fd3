"""A user reward function that cannot take the four scoring arguments is refused when it is loaded."""

from __future__ import annotations

import pytest

from megarl.rewards import RewardManager, ScoringItem, load_scoring_function

ACCEPTED = {
    "common": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n",
    "variadic": "def compute_score(*args, **kwargs):\n    return 1.0\n",
    "extra defaults": "def compute_score(data_source, solution_str, ground_truth, extra_info, scale=2.0):\n"
                      "    return scale\n",
}
REFUSED = {
    "one argument": "def compute_score(solution_str):\n    return 1.0\n",
    "no extra_info": "def compute_score(data_source, solution_str, ground_truth):\n    return 1.0\n",
    "keyword-only extra_info": "def compute_score(data_source, solution_str, ground_truth, *, extra_info):\n"
                               "    return 1.0\n",
    "a class needing more": "class compute_score:\n    def __init__(self, a, b, c, d, e):\n        pass\n",
}


@pytest.mark.parametrize("source", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_functions_taking_the_four_arguments_load_and_score(tmp_path, source):
    path = tmp_path / "reward.py"
    path.write_text(source)
    result = RewardManager(load_scoring_function(f"{path}:compute_score")).score([ScoringItem("a", "b", "c", {})])
    assert result.num_errors == 0 and result.scores[0] > 0


@pytest.mark.parametrize("source", REFUSED.values(), ids=REFUSED.keys())
def test_other_signatures_are_refused_in_one_line_naming_file_and_expected_signature(tmp_path, source):
    path = tmp_path / "reward.py"
    path.write_text(source)
    with pytest.raises(ValueError) as error:
        load_scoring_function(f"{path}:compute_score")
    message = str(error.value)
    assert "\n" not in message and str(path) in message
    assert message.endswith("expected compute_score(data_source, solution_str, ground_truth, extra_info=None)")
