"""Start-up checks that need the world size or the file system, before any process group exists."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError
from megarl.trainer.startup import parse_config


def test_layout_that_does_not_fit_the_world_fails_naming_actor_tp(monkeypatch, tiny_models):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"actor\.tp \* actor\.pp \* actor\.cp = 2"):
        parse_config(["--config", "configs/tiny_cpu.yaml", f"model.path={tiny_models['qwen2-tied']}", "actor.tp=2"],
                     rl=True)


def test_model_path_without_config_json_fails_naming_model_path(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match=r"'model\.path' = .* has no config.json"):
        parse_config(["--config", "configs/tiny_cpu.yaml", f"model.path={tmp_path}"], rl=True)


def test_valid_start_up_config(monkeypatch, tiny_models):
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = parse_config(["--config", "configs/tiny_cpu.yaml", f"model.path={tiny_models['qwen3-tied']}",
                           "actor.tp=2", "actor.pp=2"], rl=True)
    assert (config.actor.tp, config.actor.pp) == (2, 2)


def test_world_size_checks_run_before_any_process_group(monkeypatch, tiny_models):
    """rollout.tp and the batch's split are checked from WORLD_SIZE alone (torch.distributed stays
    uninitialised): 2 ranks, rollout.tp=4; then 3 ranks (DP 3) for 2 prompts."""
    import torch.distributed as dist

    model = f"model.path={tiny_models['qwen2-tied']}"
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"'rollout\.tp' = 4 does not divide world size 2"):
        parse_config(["--config", "configs/tiny_cpu.yaml", model, "rollout.tp=4"], rl=True)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"'data\.train_batch_size' = 2 .* 3 DP ranks"):
        parse_config(["--config", "configs/tiny_cpu.yaml", model, "data.train_batch_size=2"], rl=True)
    assert not dist.is_initialized()


def test_gae_without_critic_fails_naming_the_estimator(monkeypatch, tiny_models):
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--config", "configs/tiny_cpu.yaml", f"model.path={tiny_models['qwen2-tied']}",
            "algorithm.adv_estimator=gae"]
    with pytest.raises(ConfigError, match=r"'algorithm\.adv_estimator' = 'gae' needs a critic; set critic\.enable"):
        parse_config(argv, rl=True)
    assert parse_config([*argv, "critic.enable=true"], rl=True).critic.enable
    assert parse_config(argv, rl=False).algorithm.adv_estimator == "gae"  # SFT trains no critic and needs none


def test_remax_refuses_a_reward_its_greedy_baseline_would_leave_out(monkeypatch, tiny_models):
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--config", "configs/tiny_cpu.yaml", f"model.path={tiny_models['qwen2-tied']}",
            "algorithm.adv_estimator=remax"]
    assert parse_config(argv, rl=True).algorithm.adv_estimator == "remax"
    shaping = (("reward.reward_model_path", tiny_models["qwen2-value"]), ("algorithm.overlong_buffer_length", 2))
    for key, value in shaping:
        with pytest.raises(ConfigError, match=rf"'{key}' is set, and algorithm\.adv_estimator='remax' scores"):
            parse_config([*argv, f"{key}={value}"], rl=True)


def test_aux_loss_free_balancing_in_rl_needs_a_family_the_engine_routes_with_a_bias(monkeypatch, tiny_moe_models):
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--config", "configs/tiny_cpu.yaml", "model.moe.expert_bias=true"]
    with pytest.raises(ConfigError, match=r"'model\.moe\.expert_bias' = True: qwen3_moe checkpoints carry no routing"):
        parse_config([*argv, f"model.path={tiny_moe_models['qwen3-moe']}"], rl=True)
    assert parse_config([*argv, f"model.path={tiny_moe_models['qwen3-moe']}"], rl=False).model.moe.expert_bias  # SFT
    assert parse_config([*argv, f"model.path={tiny_moe_models['deepseek-v3']}"], rl=True).model.moe.expert_bias


def test_rollout_correction_preset_is_registered_and_reads_the_bounds_set(monkeypatch, tiny_models):
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--config", "configs/tiny_cpu.yaml", f"model.path={tiny_models['qwen2-tied']}"]
    with pytest.raises(ConfigError, match=r"'algorithm\.rollout_correction\.preset' = 'mis' is not registered; "
                                          r"registered: geo_rs, geo_rs_token_tis, icepop, none, seq_mis"):
        parse_config([*argv, "algorithm.rollout_correction.preset=mis"], rl=True)
    with pytest.raises(ConfigError, match=r"'algorithm\.rollout_correction\.lower' = 0\.3 is not read by preset "
                                          r"'token_tis'; allowed: null, or a preset that rejects"):
        parse_config([*argv, "algorithm.rollout_correction.preset=token_tis", "algorithm.rollout_correction.lower=0.3"],
                     rl=True)
    with pytest.raises(ConfigError, match=r"'algorithm\.rollout_correction\.cap' = 3\.0 is not read by preset "
                                          r"'geo_rs'; allowed: null, or a preset that weights"):
        parse_config([*argv, "algorithm.rollout_correction.preset=geo_rs", "algorithm.rollout_correction.cap=3"],
                     rl=True)
    config = parse_config([*argv, "algorithm.rollout_correction.preset=seq_mis",
                           "algorithm.rollout_correction.upper=3", "algorithm.rollout_correction.cap=2.5"], rl=True)
    assert (config.algorithm.rollout_correction.upper, config.algorithm.rollout_correction.cap) == (3.0, 2.5)


def test_engine_old_logprobs_refuse_a_rollout_correction(monkeypatch, tiny_models):
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--config", "configs/tiny_cpu.yaml", f"model.path={tiny_models['qwen2-tied']}",
            "actor.recompute_old_logprobs=false"]
    with pytest.raises(ConfigError, match=r"'algorithm\.rollout_correction\.preset' = 'token_tis' needs the trainer's "
                                          r"old log-probs, .*allowed: none, or actor\.recompute_old_logprobs=true"):
        parse_config([*argv, "algorithm.rollout_correction.preset=token_tis"], rl=True)
    assert not parse_config(argv, rl=True).actor.recompute_old_logprobs


def test_split_placement_sizes_the_trainer_side_from_the_ranks_left(monkeypatch, tiny_models):
    """4 ranks, 2 of them rollout ranks: the trainers' TP2 fits the 2 left, TP4 does not; all 4 rollout ranks
    leave no trainer; ReMax's greedy rollouts are refused."""
    model, split = f"model.path={tiny_models['qwen2-tied']}", ["trainer.placement=split", "rollout.num_ranks=2"]
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert parse_config(["--config", "configs/tiny_cpu.yaml", model, *split, "actor.tp=2"], rl=True).actor.tp == 2
    with pytest.raises(ConfigError, match=r"world size 2 is not divisible by actor\.tp \* actor\.pp \* actor\.cp = 4"):
        parse_config(["--config", "configs/tiny_cpu.yaml", model, *split, "actor.tp=4"], rl=True)
    with pytest.raises(ConfigError, match=r"'rollout\.num_ranks' = 4 leaves no trainer rank"):
        parse_config(["--config", "configs/tiny_cpu.yaml", model, "trainer.placement=split", "rollout.num_ranks=4"],
                     rl=True)
    with pytest.raises(ConfigError, match=r"'algorithm\.adv_estimator' = 'remax' .* trainer\.placement=split"):
        parse_config(["--config", "configs/tiny_cpu.yaml", model, *split, "algorithm.adv_estimator=remax"], rl=True)


def test_start_up_requires_what_the_run_uses(monkeypatch, tiny_models):
    """The GPU smoke kit's box has no vLLM or mlflow: SFT needs no rollout engine, a run logging to the
    console alone needs no mlflow; an RL run on vLLM needs vLLM."""
    from megarl.trainer import startup

    required = []
    monkeypatch.setattr(startup, "require", required.append)
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--config", "configs/tiny_cpu.yaml", f"model.path={tiny_models['qwen2-tied']}", "rollout.backend=vllm"]
    parse_config([*argv, "trainer.loggers=[console]"], rl=False)
    parse_config([*argv, "trainer.loggers=[console,mlflow]"], rl=True)
    assert required == [["core"], ["core", "vllm", "mlflow"]]
