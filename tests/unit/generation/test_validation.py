"""Validation metrics: mean score per data source and pass@k, computed by hand."""

from __future__ import annotations

import pytest

from megarl.data.dataset import Prompt
from megarl.generation.rollouts import Rollouts
from megarl.generation.validation import pass_at_k, validation_metrics


def test_pass_at_k_and_means_per_source():
    # Three prompts, two samples each: prompt 0 solved once, prompt 1 never, prompt 2 twice.
    sources = ["math", "math", "math", "math", "code", "code"]
    prompts = [Prompt(prompt_ids=[], data_source=source, ground_truth="", extra_info={}, index=i // 2)
               for i, source in enumerate(sources)]
    rollouts = Rollouts(prompts=prompts, group_ids=[0, 0, 1, 1, 2, 2], scores=[0.0, 1.0, 0.5, 0.0, 1.0, 1.0])
    assert pass_at_k(rollouts.group_ids, rollouts.scores) == pytest.approx(2 / 3)
    metrics = validation_metrics(rollouts, k=2)
    assert metrics == pytest.approx({"val/score/code": 1.0, "val/score/math": 1.5 / 4, "val/score/mean": 3.5 / 6,
                                     "val/pass@2": 2 / 3})
    assert "val/pass@1" not in validation_metrics(rollouts, k=1)
