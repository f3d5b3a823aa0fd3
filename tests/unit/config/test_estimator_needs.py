"""Estimators declare what they need from the rollout; a config that cannot give it fails at start-up."""

from __future__ import annotations

import pytest

from megarl.algorithms import ADVANTAGE_ESTIMATORS
from megarl.config import ConfigError
from megarl.trainer.startup import parse_config


def test_group_relative_estimators_declare_that_they_need_groups():
    needs_groups = {name for name in ADVANTAGE_ESTIMATORS.names() if ADVANTAGE_ESTIMATORS.get(name).needs_groups}
    baseline = {name for name in ADVANTAGE_ESTIMATORS.names()
                if ADVANTAGE_ESTIMATORS.get(name).needs_greedy_baseline}
    values = {name for name in ADVANTAGE_ESTIMATORS.names() if ADVANTAGE_ESTIMATORS.get(name).needs_values}
    teacher = {name for name in ADVANTAGE_ESTIMATORS.names() if ADVANTAGE_ESTIMATORS.get(name).needs_teacher}
    process = {name for name in ADVANTAGE_ESTIMATORS.names()
               if ADVANTAGE_ESTIMATORS.get(name).needs_process_rewards}
    components = {name for name in ADVANTAGE_ESTIMATORS.names()
                  if ADVANTAGE_ESTIMATORS.get(name).needs_reward_components}
    assert needs_groups == {"grpo", "drgrpo", "rloo", "prime", "grpo_passk", "opo", "reinforce_plus_plus_baseline",
                            "gdpo"}
    assert baseline == {"remax"} and values == {"gae"}
    assert teacher == {"opd"} and process == {"prime"} and components == {"gdpo"}


def _parse(model, *overrides):
    return parse_config(["--config", "configs/tiny_cpu.yaml", f"model.path={model}", *overrides], rl=True)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_one_response_per_prompt_with_a_group_estimator_fails_naming_both_keys(monkeypatch, tiny_models, estimator):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError) as error:
        _parse(tiny_models["qwen2-tied"], "rollout.n=1", f"algorithm.adv_estimator={estimator}")
    message = str(error.value)
    assert "\n" not in message and "'rollout.n' = 1" in message and f"algorithm.adv_estimator='{estimator}'" in message


def test_one_response_per_prompt_suits_estimators_without_groups(monkeypatch, tiny_models):
    monkeypatch.setenv("WORLD_SIZE", "1")
    config = _parse(tiny_models["qwen2-tied"], "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus")
    assert config.rollout.n == 1


@pytest.mark.parametrize(("overrides", "expected"), [
    (["algorithm.adv_estimator=gdpo"],
     "config key 'algorithm.reward_components' is empty: algorithm.adv_estimator='gdpo'"),
    (["algorithm.reward_components=[correct,format]"],
     "config key 'algorithm.reward_components' = ['correct', 'format'] is set but algorithm.adv_estimator='grpo'"),
    (["algorithm.adv_estimator=gdpo", "algorithm.reward_components=[correct]", "algorithm.use_kl_in_reward=true"],
     "config key 'algorithm.use_kl_in_reward' = True: algorithm.adv_estimator='gdpo' takes its advantages from "
     "algorithm.reward_components alone"),
])
def test_reward_components_go_with_an_estimator_that_reads_them(monkeypatch, tiny_models, overrides, expected):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError) as error:
        _parse(tiny_models["qwen2-tied"], *overrides)
    assert "\n" not in str(error.value) and expected in str(error.value)


def test_gdpo_with_components_starts(monkeypatch, tiny_models):
    monkeypatch.setenv("WORLD_SIZE", "1")
    config = _parse(tiny_models["qwen2-tied"], "algorithm.adv_estimator=gdpo", "algorithm.reward_components=[a,b]")
    assert config.algorithm.reward_components == ["a", "b"]
