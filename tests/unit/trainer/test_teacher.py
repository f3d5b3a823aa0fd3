"""The teacher of on-policy distillation, and every model that reads the policy's token ids, is checked at start-up,
before any model is built."""

from __future__ import annotations

import json
import shutil

import pytest

from megarl.config import ConfigError
from megarl.config.schema import ActorConfig
from megarl.trainer.startup import parse_config
from megarl.trainer.teacher import teacher_engine_config


def _parse(model, *overrides):
    return parse_config(["--config", "configs/tiny_cpu.yaml", f"model.path={model}", *overrides], rl=True)


@pytest.mark.parametrize("key, base, estimator", [
    ("teacher.path", "llama-untied", "opd"),
    ("reward.reward_model_path", "qwen2-value", "grpo"),
    ("critic.path", "qwen2-value", "gae"),
])
def test_a_model_with_another_tokenizer_than_the_policy_fails_naming_both_paths(monkeypatch, tiny_models, tmp_path,
                                                                                key, base, estimator):
    # The same characters, but '+' and '=' trade ids: a user's "same vocabulary" is not enough.
    policy = tiny_models["qwen2-tied"]
    other = tmp_path / "other"
    shutil.copytree(tiny_models[base], other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["+"], vocab["="] = vocab["="], vocab["+"]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    monkeypatch.setenv("WORLD_SIZE", "1")
    overrides = [f"algorithm.adv_estimator={estimator}", *(["critic.enable=true"] if key == "critic.path" else [])]
    with pytest.raises(ConfigError) as error:
        _parse(policy, *overrides, f"{key}={other}")
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{key}=") and str(policy) in message and str(other) in message
    assert "token '+' has id" in message
    # Another family (or a value model) with the same tokenizer is valid.
    config = _parse(policy, *overrides, f"{key}={tiny_models[base]}")
    assert str(tiny_models[base]) in (config.teacher.path, config.reward.reward_model_path, config.critic.path)


def test_opd_without_a_teacher_fails_naming_the_key(monkeypatch, tiny_models):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="'teacher.path' is empty: algorithm.adv_estimator='opd'"):
        _parse(tiny_models["qwen2-tied"], "algorithm.adv_estimator=opd")


def test_the_teacher_takes_the_actors_engine_settings_but_its_own_micro_batch():
    actor = ActorConfig(offload=True, micro_batch_size_per_rank=8, use_dynamic_batch_size=True)
    same, smaller = teacher_engine_config(actor, 0), teacher_engine_config(actor, 2)
    assert same.offload and same.use_dynamic_batch_size and same.micro_batch_size_per_rank == 8
    assert smaller.offload and smaller.micro_batch_size_per_rank == 2
