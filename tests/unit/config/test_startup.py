"""Start-up checks that need the world size or the file system, before any process group exists."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError
from megarl.trainer.startup import parse_config


def test_layout_that_does_not_fit_the_world_fails_naming_actor_tp(monkeypatch, tiny_models):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"actor\.tp \* actor\.pp \* actor\.cp = 2"):
        parse_config(["--config", "configs/tiny_cpu.yaml", f"model.path={tiny_models['qwen2-tied']}", "actor.tp=2"])


def test_model_path_without_config_json_fails_naming_model_path(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match=r"'model\.path' = .* has no config.json"):
        parse_config(["--config", "configs/tiny_cpu.yaml", f"model.path={tmp_path}"])


def test_valid_start_up_config(monkeypatch, tiny_models):
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = parse_config(["--config", "configs/tiny_cpu.yaml", f"model.path={tiny_models['qwen3-tied']}",
                           "actor.tp=2", "actor.pp=2"])
    assert (config.actor.tp, config.actor.pp) == (2, 2)
