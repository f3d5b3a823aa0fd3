"""The teacher of on-policy distillation is checked at start-up, before any model is built."""

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


def test_a_teacher_with_another_tokenizer_fails_naming_both_paths(monkeypatch, tiny_models, tmp_path):
    # The same characters, but '+' and '=' trade ids: a user's "same vocabulary" is not enough.
    student = tiny_models["qwen2-tied"]
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_models["llama-untied"], teacher)
    tokenizer = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["+"], vocab["="] = vocab["="], vocab["+"]
    (teacher / "tokenizer.json").write_text(json.dumps(tokenizer))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError) as error:
        _parse(student, "algorithm.adv_estimator=opd", f"teacher.path={teacher}")
    message = str(error.value)
    assert "\n" not in message and str(student) in message and str(teacher) in message
    assert "token '+' has id" in message
    # Another family with the same tokenizer is a valid teacher.
    config = _parse(student, "algorithm.adv_estimator=opd", f"teacher.path={tiny_models['llama-untied']}")
    assert config.teacher.path == str(tiny_models["llama-untied"])


def test_opd_without_a_teacher_fails_naming_the_key(monkeypatch, tiny_models):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="'teacher.path' is empty: algorithm.adv_estimator='opd'"):
        _parse(tiny_models["qwen2-tied"], "algorithm.adv_estimator=opd")


def test_the_teacher_takes_the_actors_engine_settings_but_its_own_micro_batch():
    actor = ActorConfig(offload=True, micro_batch_size_per_rank=8, use_dynamic_batch_size=True)
    same, smaller = teacher_engine_config(actor, 0), teacher_engine_config(actor, 2)
    assert same.offload and same.use_dynamic_batch_size and same.micro_batch_size_per_rank == 8
    assert smaller.offload and smaller.micro_batch_size_per_rank == 2
