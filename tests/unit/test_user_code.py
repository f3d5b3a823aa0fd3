"""User code is named one way everywhere: `path/to/file.py:function` or `pkg.module:function`."""

from __future__ import annotations

import textwrap

import pytest

from megarl.user_code import load_callable

USER_FILE = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 if solution_str.strip() == ground_truth else 0.0

    def helper():
        pass

    THRESHOLD = 3
''')


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return str(path)


def test_loads_from_a_file_and_from_a_module(user_file):
    assert load_callable(f"{user_file}:compute_score", "key")("x", "42", "42") == 1.0
    assert load_callable(f"{user_file}:helper", "key")() is None
    assert load_callable("megarl.rewards.scorers:compute_score", "key")("arithmetic", "3", "3") == 1.0


@pytest.mark.parametrize("spec", ["my_reward.py", "megarl.rewards.scorers", ":compute_score", "file.py:"])
def test_a_spec_without_location_and_name_is_refused_naming_the_spelling(spec):
    with pytest.raises(ValueError) as error:
        load_callable(spec, "reward.function")
    assert str(error.value) == (f"reward.function={spec!r}: expected path/to/file.py:function or "
                                "pkg.module:function")


def test_missing_function_lists_callables(user_file):
    with pytest.raises(ValueError) as error:
        load_callable(f"{user_file}:score_fn", "reward.function")
    message = str(error.value)
    assert "'score_fn'" in message and user_file in message and "compute_score, helper" in message
    assert "THRESHOLD" not in message and "\n" not in message


def test_not_callable(user_file):
    with pytest.raises(ValueError, match="'THRESHOLD' is a int, not callable"):
        load_callable(f"{user_file}:THRESHOLD", "reward.function")


def test_missing_file_and_module(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_callable(f"{tmp_path / 'nope.py'}:compute_score", "reward.function")
    with pytest.raises(ValueError, match="'no_such_pkg.rewards' failed: ModuleNotFoundError"):
        load_callable("no_such_pkg.rewards:compute_score", "reward.function")


def test_import_error_is_one_line(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import math\nraise RuntimeError('bad\\nconfig')\n")
    with pytest.raises(ValueError) as error:
        load_callable(f"{path}:compute_score", "reward.function")
    assert str(path) in str(error.value) and "RuntimeError: bad config" in str(error.value)
    assert "\n" not in str(error.value)
