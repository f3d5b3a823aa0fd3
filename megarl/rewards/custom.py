"""A user's scoring function, named `path/to/file.py:function` or `pkg.module:function`
(`megarl.user_code`), or the rule scorers by data_source when none is named.

The function keeps the common signature `compute_score(data_source, solution_str, ground_truth,
extra_info=None) -> float | dict` and is used unchanged; `RewardManager` turns a dict return
("score" plus extra numeric metrics) into rewards and metrics. A function that cannot be called
with these four arguments is refused when it is loaded, before any model is built.
"""

from __future__ import annotations

import inspect
from typing import Callable

from megarl.rewards.scorers import compute_score
from megarl.user_code import load_callable

SIGNATURE = "compute_score(data_source, solution_str, ground_truth, extra_info=None)"


def load_scoring_function(spec: str) -> Callable:
    """The function `spec` (config key reward.function) names, its signature checked; "" gives the rule scorers."""
    if not spec:
        return compute_score
    function = load_callable(spec, "reward.function")
    _check_signature(function, spec)
    return function


def _check_signature(function: Callable, spec: str) -> None:
    """ValueError unless `function` accepts the four arguments `RewardManager` passes, by position."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins and extension functions have none: found by calling
        return
    try:
        signature.bind("data_source", "solution_str", "ground_truth", {})
    except TypeError as exc:
        raise ValueError(f"reward.function={spec!r} has the signature {signature} ({exc}); "
                         f"expected {SIGNATURE}") from None
